"""`run_suite` with an agent of its own: a reset before every case, the options checked, the progress
bar on stderr, and a clear error for an agent that does not answer with an envelope."""

from __future__ import annotations

import pytest

from needle_hf.evaluation import Suite, run_suite, run_suites

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

TOOL = {"name": "ping", "description": "Ping a host.",
        "parameters": {"type": "object", "properties": {"host": {"type": "string"}}, "required": ["host"]}}
SUITE = Suite(name="pings", tools=[TOOL], system="", cases=[
    {"query": "ping alpha", "calls": [{"name": "ping", "arguments": {"host": "alpha"}}], "category": "positive"},
    {"query": "never ping beta", "calls": [], "category": "negation", "critical": True},
])


class EchoAgent:
    """Pings the query's last word; keeps a log of resets and queries."""

    def __init__(self, answer=None):
        self.log, self.answer = [], answer

    def reset(self):
        self.log.append("reset")

    def complete(self, text, max_new_tokens=256):
        self.log.append((text, max_new_tokens))
        if self.answer is not None:
            return self.answer
        calls = [{"name": "ping", "arguments": {"host": text.split()[-1]}}]
        return {"function_calls": calls, "confidence": 0.8,
                "validation": {"ungrounded": [], "negation": text.startswith("never")}}


def test_each_case_starts_from_a_reset_and_the_progress_bar_counts_cases(capsys):
    agent = EchoAgent()
    result = run_suite(SUITE, agent, max_new_tokens=16)
    assert agent.log == ["reset", ("ping alpha", 16), "reset", ("never ping beta", 16)]
    assert [(case.verdict, case.voided) for case in result.cases] == [("pass", None), ("pass", "negation")]
    assert result.passes and "pings: 100%" in capsys.readouterr().err
    run_suite(SUITE, agent, progress=False)
    assert agent.log[-1] == ("never ping beta", 256) and capsys.readouterr().err == ""


@pytest.mark.parametrize("gate", [-0.1, 1.5, float("nan"), "0.5", True])
def test_a_gate_outside_0_1_is_refused(gate):
    with pytest.raises(ValueError, match="min_confidence: expected a number in"):
        run_suite(SUITE, EchoAgent(), min_confidence=gate, progress=False)


def test_wrong_arguments_get_clear_errors():
    with pytest.raises(TypeError, match="suite: expected a needle_hf.evaluation.Suite, got dict"):
        run_suite({"name": "pings"}, EchoAgent(), progress=False)
    with pytest.raises(TypeError, match="an agent holds one suite's tools"):
        run_suites([SUITE], EchoAgent(), progress=False)
    with pytest.raises(TypeError, match="pings case 0: the agent's complete\\(\\) returned a str"):
        run_suite(SUITE, EchoAgent(answer="ping alpha"), progress=False)
