"""``pipeline("tool-calling")``: the SDK's envelope from a registered transformers task, one query or a batch.

Runs on transformers 4.57 and 5.x, on the demo checkpoint converted to a folder.
"""

from __future__ import annotations

import pytest
from transformers import pipeline

import needle_hf
from test_sdk_needle import DEMO_FUNCTIONS, assert_envelope, folder  # noqa: F401  (the converted demo folder)

QUERIES = ["Set an alarm for 6:30.", "Alarm at 7:45 please.", "Tell Bob I'm late", "don't play anything"]
MAX_NEW_TOKENS = 40

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]


@pytest.fixture(scope="module")
def pipe(folder):  # noqa: F811
    return pipeline("tool-calling", model=folder)


def test_task_is_registered_once_transformers_pipelines_is_imported():
    from transformers.pipelines import PIPELINE_REGISTRY

    from needle_hf.sdk.pipeline import ToolCallingPipeline

    assert PIPELINE_REGISTRY.supported_tasks["tool-calling"]["impl"] is ToolCallingPipeline


def test_one_query_gives_the_envelope_of_complete(pipe, folder):  # noqa: F811
    envelope = pipe(QUERIES[0], tools=DEMO_FUNCTIONS, max_new_tokens=MAX_NEW_TOKENS)
    assert_envelope(envelope, {f.__name__ for f in DEMO_FUNCTIONS})
    agent = needle_hf.Needle(pipe._backend, tools=DEMO_FUNCTIONS)
    expected = agent.complete(QUERIES[0], MAX_NEW_TOKENS)
    for key in ("type", "success", "function_calls", "reasoning", "validation"):
        assert envelope[key] == expected[key], key
    assert envelope["confidence"] == pytest.approx(expected["confidence"], abs=1e-5)


def test_a_batch_gives_each_query_its_own_envelope(pipe):
    batched = pipe(QUERIES, tools=DEMO_FUNCTIONS, max_new_tokens=MAX_NEW_TOKENS, batch_size=3)
    one_by_one = [pipe(query, tools=DEMO_FUNCTIONS, max_new_tokens=MAX_NEW_TOKENS) for query in QUERIES]
    assert len(batched) == len(QUERIES)
    for left, right in zip(batched, one_by_one):
        assert_envelope(left)
        for key in ("type", "success", "function_calls", "validation"):
            assert left[key] == right[key], key
        if right["confidence"] is not None:
            assert left["confidence"] == pytest.approx(right["confidence"], abs=1e-4)
    assert batched[0]["function_calls"] == [{"name": "set_alarm", "arguments": {"time": "6:30"}}]
    assert batched[3]["validation"]["negation"] is True


def test_unknown_arguments_are_refused(pipe):
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
        pipe(QUERIES[0], tools=DEMO_FUNCTIONS, temperature=0.7)
    for bad in (None, 5, {"query": QUERIES[0]}):
        with pytest.raises(TypeError, match="tool-calling pipeline: expected a query .str. or a list of queries"):
            pipe(bad, tools=DEMO_FUNCTIONS)
    with pytest.raises(TypeError, match=r"queries\[1\]: expected a str, got int"):
        pipe([QUERIES[0], 5], tools=DEMO_FUNCTIONS)
    assert len(pipe(iter(QUERIES[:2]), tools=DEMO_FUNCTIONS, max_new_tokens=MAX_NEW_TOKENS)) == 2  # any iterable
