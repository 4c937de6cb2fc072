"""Our suite verdicts equal the reference harness's (`needle.environments._harness.run_tests`) for the same agent.

Both harnesses drive one agent: the reference's through its agent seam (it keeps one agent per
suite module in `_harness._agents`), ours through `run_suite`. The reference reports a suite's
verdict as its return value and each failing case as a ``FAIL [category] query`` line; ours as a
`SuiteResult`. Agents:

- a real `needle_hf.Needle` on the shipped demo model, on `phone_suite` (a suite module written for
  these tests): passes, failures, calls voided by negation and by ungrounded arguments, and a
  low-confidence call under a confidence gate;
- a replaying agent that answers each case with a scripted envelope: the exact and the order-free
  match of parallel calls, wrong arguments, every kind of void;
- the same replaying agent fed envelopes drawn by Hypothesis around each case's expected calls,
  on `phone_suite` and the reference's six suites, under random confidence gates;
- the real `Needle` on the reference's six suites (the demo's 512 positions hold none of their
  prompts: every answer is a `context_length` refusal, and both harnesses must score that alike).
"""

from __future__ import annotations

import copy
import importlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import needle_hf
from needle_hf.evaluation import find_suites, load_suite, run_suite
from demo_support import demo_folder  # noqa: F401  (the demo model as a Hugging Face folder)

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]

REFERENCE_SUITES = ("data_capture", "kitchen_appliance", "media_player", "productivity", "smart_home", "wearable")


def reference_verdicts(module, agent, min_confidence, monkeypatch, capsys):
    """(suite passes, the failing cases' queries in order) from the reference harness run on ``agent``."""
    from needle.environments import _harness

    capsys.readouterr()
    monkeypatch.setitem(_harness._agents, module.__name__, agent)
    passed = _harness.run_tests(module, min_confidence, True)
    out = capsys.readouterr().out
    failed = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("FAIL [")]
    return passed, failed


def our_verdicts(suite, agent, min_confidence):
    result = run_suite(suite, agent, min_confidence=min_confidence, progress=False)
    return result, (result.passes, [case.query for case in result.cases if not case.passed])


class ReplayAgent:
    """Answers the i-th case after the i-th reset with the i-th scripted envelope."""

    def __init__(self, queries, envelopes):
        self.queries, self.envelopes = queries, envelopes
        self.resets = self.asked = 0

    def reset(self):
        self.resets += 1

    def complete(self, text):
        index = self.asked
        assert self.resets == index + 1, "a case was asked without a reset before it"
        assert text == self.queries[index]
        self.asked += 1
        return copy.deepcopy(self.envelopes[index])


class RecordingAgent:
    """A real agent whose envelopes are kept, so that both harnesses can be checked against one run."""

    def __init__(self, agent):
        self.agent, self.envelopes = agent, []

    def reset(self):
        self.agent.reset()

    def complete(self, text):
        envelope = self.agent.complete(text, 48)
        self.envelopes.append(envelope)
        return envelope


def envelope(calls, *, confidence=0.9, ungrounded=(), negation=False, error_code=None):
    return {"type": "call" if calls else "respond", "success": error_code is None, "error": error_code,
            "error_code": error_code, "function_calls": calls, "reasoning": "", "confidence": confidence,
            "validation": {"ungrounded": list(ungrounded), "negation": negation}}


@pytest.fixture(scope="module")
def phone_module():
    return importlib.import_module("phone_suite")


@pytest.fixture(scope="module")
def phone(phone_module):
    return load_suite("phone_suite")


def test_real_needle_verdicts_equal_the_reference_harness(phone, phone_module, demo_folder, monkeypatch, capsys):  # noqa: F811
    agent = RecordingAgent(needle_hf.Needle(str(demo_folder), tools=phone.tools, system=phone.system))
    gate = 0.4
    reference = reference_verdicts(phone_module, agent, gate, monkeypatch, capsys)
    envelopes = list(agent.envelopes)
    result, ours = our_verdicts(phone, agent, gate)
    assert ours == reference
    answers = [(e["function_calls"], e["confidence"], e["validation"]) for e in agent.envelopes]
    assert answers[len(envelopes):] == answers[:len(envelopes)]  # the model answered both harnesses alike

    kinds = {(case.category, case.verdict, case.voided) for case in result.cases}
    assert ("positive", "pass", None) in kinds
    assert ("negation", "pass", "negation") in kinds  # the demo calls; the negated request voids it
    assert ("missing", "pass", "ungrounded") in kinds  # an alarm time the query never gave
    assert ("parallel", "fail", "low_confidence") in kinds  # one call of two, below the gate
    assert result.by_category["positive"].passed == 5
    assert (result.passed, result.threshold, result.critical_failures, result.passes) == (9, 9, [], True)

    # Without the gate, from the same envelopes: the parallel case fails on its calls instead.
    replay = ReplayAgent([case["query"] for case in phone.cases], envelopes)
    reference = reference_verdicts(phone_module, replay, 0.0, monkeypatch, capsys)
    replay.resets = replay.asked = 0
    result, ours = our_verdicts(phone, replay, 0.0)
    assert ours == reference
    assert result.cases[8].voided is None and result.cases[8].verdict == "fail" and len(result.cases[8].got) == 1


def _call(name, **arguments):
    return {"name": name, "arguments": arguments}


ALARM, JUDE = _call("set_alarm", time="8:00"), _call("play_music", song="Hey Jude")
# One scripted envelope per phone_suite case, and the verdict and void each must get.
SCRIPT = [
    (envelope([_call("set_alarm", time="6:45")]), "pass", None, "exact"),
    (envelope([_call("set_alarm", time="5:50")]), "fail", None, None),  # wrong argument
    (envelope([_call("play_music", song="Imagine")], confidence=0.2), "fail", "low_confidence", None),
    (envelope([_call("send_message", to="Bob", text="see you soon")], negation=True), "fail", "negation", None),
    (envelope([_call("set_alarm", time="7:00")], negation=True), "pass", "negation", "exact"),
    (envelope([], confidence=None, error_code="malformed"), "pass", None, "exact"),  # no call, as expected
    (envelope([_call("set_alarm", time="23:30")], ungrounded=["set_alarm.time"]), "pass", "ungrounded", "exact"),
    (envelope([_call("set_alarm", time="23:30")], confidence=0.7), "fail", None, None),  # a critical failure
    (envelope([ALARM, JUDE]), "pass", None, "order_free"),  # the parallel calls in the other order
    (envelope([_call("play_music", song="Clocks"), _call("play_music", song="Clocks")]), "fail", None, None),
]


def test_scripted_envelopes_get_the_reference_verdicts(phone, phone_module, monkeypatch, capsys):
    queries = [case["query"] for case in phone.cases]
    envelopes = [row[0] for row in SCRIPT]
    reference = reference_verdicts(phone_module, ReplayAgent(queries, envelopes), 0.5, monkeypatch, capsys)
    result, ours = our_verdicts(phone, ReplayAgent(queries, envelopes), 0.5)
    assert ours == reference
    assert [(case.verdict, case.voided, case.match) for case in result.cases] == [row[1:] for row in SCRIPT]
    assert result.passed == 5 and result.threshold == 9 and not result.passes
    assert result.by_category["negation"].passed == 2 and [c.index for c in result.critical_failures] == [7]


def _variants(want, other_tool):
    """Answers around the expected calls: right, reordered, wrong, extra, missing, numbers as floats."""
    variants = [want, list(reversed(want)), [], [*want, other_tool], want[:1]]
    if want:
        first = copy.deepcopy(want[0])
        first["arguments"] = {key: (value * 2 if isinstance(value, int) and not isinstance(value, bool) else
                                    f"{value}!" if isinstance(value, str) else value)
                              for key, value in first["arguments"].items()} or {"extra": 1}
        variants.append([first, *want[1:]])
        variants.append([{**call, "arguments": {key: float(value) if type(value) is int else value
                                                for key, value in call["arguments"].items()}} for call in want])
    return variants


@st.composite
def scripted_run(draw, suites):
    name = draw(st.sampled_from(sorted(suites)))
    suite = suites[name]
    other_tool = _call(suite.schemas[0]["name"])
    envelopes = []
    for case in suite.cases:
        calls = draw(st.sampled_from(_variants(case["calls"], other_tool)))
        ungrounded = draw(st.sampled_from([[], [f"{calls[0]['name']}.x"]])) if calls else []
        envelopes.append(envelope(copy.deepcopy(calls), confidence=draw(st.floats(0.0, 1.0)), ungrounded=ungrounded,
                                  negation=draw(st.booleans())))
    gate = draw(st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]) | st.floats(0.0, 1.0))
    return name, envelopes, gate


@pytest.fixture(scope="module")
def every_suite(phone):
    return {**find_suites(), "phone_suite": phone}


def test_found_suites_are_the_references_six(every_suite):
    assert sorted(every_suite) == sorted([*REFERENCE_SUITES, "phone_suite"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_drawn_envelopes_get_the_reference_verdicts(data, every_suite, monkeypatch, capsys):
    name, envelopes, gate = data.draw(scripted_run(every_suite))
    suite = every_suite[name]
    module = importlib.import_module(suite.source)
    queries = [case["query"] for case in suite.cases]
    reference = reference_verdicts(module, ReplayAgent(queries, envelopes), gate, monkeypatch, capsys)
    _, ours = our_verdicts(suite, ReplayAgent(queries, envelopes), gate)
    assert ours == reference


@pytest.mark.parametrize("name", REFERENCE_SUITES)
def test_reference_suites_on_the_demo_model_get_the_reference_verdicts(name, every_suite, demo_folder, monkeypatch,  # noqa: F811
                                                                      capsys):
    suite = every_suite[name]
    module = importlib.import_module(suite.source)
    agent = needle_hf.Needle(str(demo_folder), tools=suite.tools, system=suite.system)
    reference = reference_verdicts(module, agent, 0.0, monkeypatch, capsys)
    result, ours = our_verdicts(suite, agent, 0.0)
    assert ours == reference
    # The suites' prompts do not fit the demo's 512 positions: every answer is a refusal.
    assert {case.envelope["error_code"] for case in result.cases} == {"context_length"}
    assert result.passed == sum(not case["calls"] for case in suite.cases)
