"""The reference SDK's six acceptance suites (`needle.environments`) run against `needle_hf.Needle`.

A reference user's script keeps working when only the import changes: the suites' own harness
(`needle.environments._harness.run_tests`) drives our agent through its agent seam (the harness
keeps one agent per environment in `_harness._agents` and calls its `reset()` and `complete(query)`),
with the suites' own TOOLS (decorated by the reference's `needle.tool`, with its `Field`) and SYSTEM.

The model is a tiny random checkpoint made with the reference and converted, so the calls are
wrong and the suites fail; what is asserted is that the harness ran every case end to end and every
answer is a well-formed envelope over the suite's tools. The reference's native engine is never
loaded (its loader is replaced by one that fails) and its telemetry is off (set before import).
"""

from __future__ import annotations

import importlib
import os

os.environ["NEEDLE_TELEMETRY"] = "0"  # the reference SDK's opt-outs, before it is imported
os.environ["DO_NOT_TRACK"] = "1"

import pytest  # noqa: E402

import needle_hf  # noqa: E402
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, write_native_checkpoint  # noqa: E402
from spm_fixture import FIXTURE_VOCAB_SIZE  # noqa: E402
from test_sdk_needle import assert_envelope  # noqa: E402

SUITES = ("data_capture", "kitchen_appliance", "media_player", "productivity", "smart_home", "wearable")
# Long enough for the suites' prompts (five tools with long descriptions) plus the answer.
CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE, max_seq_len=4096)
MAX_NEW_TOKENS = 32  # a random model under the grammar writes long strings; the envelope says "truncated"

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def folder(needle_spm_model, tmp_path_factory):
    from needle_hf.conversion.convert import convert

    root = tmp_path_factory.mktemp("suites")
    checkpoint = root / "needle2-tiny.pkl"
    write_native_checkpoint(checkpoint, make_native_params(CONFIG, seed=11, with_heads=True), CONFIG)
    convert(checkpoint, root / "needle2-hf", tokenizer=needle_spm_model)
    return str(root / "needle2-hf")


class RecordingAgent:
    """What the harness sees as its agent: our Needle, each envelope kept for the checks."""

    def __init__(self, agent):
        self.agent = agent
        self.envelopes: list = []
        self.resets = 0

    def reset(self):
        self.resets += 1
        self.agent.reset()

    def complete(self, text):
        envelope = self.agent.complete(text, MAX_NEW_TOKENS)
        self.envelopes.append(envelope)
        return envelope


@pytest.fixture
def engine_never_loaded(monkeypatch):
    import needle

    def refuse(*args, **kwargs):
        raise AssertionError("the reference's native engine was asked for")

    monkeypatch.setattr(needle, "_lib", refuse)
    monkeypatch.setattr(needle, "_library_path", refuse)
    monkeypatch.setattr(needle, "_track", refuse)
    yield
    assert needle._lib_handles == {} and needle._active == {}


@pytest.mark.parametrize("name", SUITES)
def test_reference_suite_runs_end_to_end_on_needle_hf(name, folder, engine_never_loaded, monkeypatch, capsys):
    from needle.environments import _harness

    module = importlib.import_module(f"needle.environments.{name}")
    recorder = RecordingAgent(needle_hf.Needle(folder, tools=module.TOOLS, system=module.SYSTEM))
    monkeypatch.setitem(_harness._agents, module.__name__, recorder)  # the harness's agent seam
    assert module.agent is recorder

    passed = module.run_tests(verbose=False)

    cases = len(module.TEST_CASES)
    assert isinstance(passed, bool)
    assert recorder.resets == cases and len(recorder.envelopes) == cases
    names = {tool._needle_tool["name"] for tool in module.TOOLS}
    for envelope in recorder.envelopes:
        assert_envelope(envelope, names)
        assert envelope["success"] or envelope["error_code"] == "truncated", envelope["error"]
    assert f"/{cases} passed" in capsys.readouterr().out  # the harness scored every case
