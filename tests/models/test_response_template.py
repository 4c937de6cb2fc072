"""The folder's `response_template` parses Needle answers as `parse_tool_calls` does (transformers 5.13+).

The tokenizer is loaded from a saved folder with `AutoTokenizer` (a plain `PreTrainedTokenizerFast`),
as a user or vLLM's `hf` parsers see it. Answers are rendered by the chat template (the training
layout, so the ids are those a trained model writes) and parsed from ids and from text; the pipeline's
parsed message is checked in test_pipeline.py.
"""

import json

import pytest
import transformers
from transformers import AutoTokenizer

from needle_hf.models.needle.response_template import RESPONSE_TEMPLATE
from needle_hf.models.needle.tokenization_needle import save_fast_tokenizer
from needle_hf.tools.tool_calls import parse_assistant_turn, parse_tool_calls, to_openai_tool_calls

pytestmark = pytest.mark.v5  # the transformers 5.x suite (.venv-v5)

if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("response_template parsing is transformers 5.13+ (this suite runs in .venv-v5)",
                allow_module_level=True)

from transformers.utils.chat_parsing.response_parser import ResponseParser  # noqa: E402

MESSAGES = [{"role": "user", "content": "Wake me at 7:30 and text Chloé that I'm late."}]

# Assistant turns as the chat template writes them: (tool calls, reasoning or None).
ANSWERS = {
    "one_call": ([{"name": "set_alarm", "arguments": {"time": "07:30"}}], None),
    "no_tool_applies": ([], None),
    "two_calls_unicode": ([{"name": "set_alarm", "arguments": {"time": "07:30"}},
                           {"name": "send_message", "arguments": {"to": "Chloé", "text": "late 🙈"}}], None),
    "nested_arguments": ([{"name": "create_event", "arguments": {"title": "review", "attendees": ["a", "b"],
                                                                  "when": {"day": 1, "hour": 12.5}, "ok": True}}], None),
    "markers_in_arguments": ([{"name": "send_message",
                               "arguments": {"text": "</tool_call><|im_end|> <think> </think> ]</tool_call>"}}], None),
    "reasoning": ([{"name": "set_alarm", "arguments": {"time": "07:30"}}], "The user wants an alarm at 7:30."),
    "reasoning_then_nothing": ([], "No tool sets the oven."),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, demo_tokenizer):
    folder = tmp_path_factory.mktemp("response-template")
    save_fast_tokenizer(demo_tokenizer, folder)
    assert json.loads((folder / "tokenizer_config.json").read_text())["response_template"] == RESPONSE_TEMPLATE
    loaded = AutoTokenizer.from_pretrained(folder)
    assert type(loaded).__name__ == "TokenizersBackend"  # transformers' own class, no needle_hf code
    return loaded


def _turn(tokenizer, calls, reasoning):
    """(prompt ids, answer ids ending <|im_end|> EOS): the chat template's rendering of the answer."""
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assistant = {"role": "assistant", "tool_calls": to_openai_tool_calls(calls)}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    whole = tokenizer.apply_chat_template(MESSAGES + [assistant], return_dict=True)["input_ids"]
    assert whole[:len(prompt)] == prompt
    return prompt, whole[len(prompt):]


def _expected(calls, reasoning):
    message = {"role": "assistant"}
    if reasoning is not None:
        message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = to_openai_tool_calls(calls)
    return message


@pytest.mark.parametrize("name", list(ANSWERS))
def test_parse_response_on_ids_equals_parse_tool_calls(tokenizer, name):
    calls, reasoning = ANSWERS[name]
    prompt, answer = _turn(tokenizer, calls, reasoning)
    text = tokenizer.decode(answer, skip_special_tokens=False)
    turn = parse_assistant_turn(text)
    assert (turn.tool_calls, turn.reasoning) == (calls, reasoning)

    message = tokenizer.parse_response(answer, prefix=prompt)
    assert message == _expected(calls, reasoning)
    assert [call["function"] for call in message.get("tool_calls", [])] == parse_tool_calls(text)
    assert message.get("thinking") == turn.reasoning


@pytest.mark.parametrize("name", list(ANSWERS))
def test_parse_response_on_text_equals_parse_tool_calls(tokenizer, name):
    calls, reasoning = ANSWERS[name]
    prompt, answer = _turn(tokenizer, calls, reasoning)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
    text = tokenizer.decode(answer, skip_special_tokens=False)
    message = tokenizer.parse_response(text, prefix=prompt_text)
    assert message == _expected(calls, reasoning)
    assert [call["function"] for call in message.get("tool_calls", [])] == parse_tool_calls(text)
    # The text of skip_special_tokens=True (EOS gone, <|im_end|> kept under tokenizers 0.23) parses the same.
    assert tokenizer.parse_response(tokenizer.decode(answer, skip_special_tokens=True), prefix="") == message


@pytest.mark.parametrize("name", ["two_calls_unicode", "markers_in_arguments", "reasoning"])
def test_streaming_one_id_at_a_time_gives_the_whole_parse(tokenizer, name):
    calls, reasoning = ANSWERS[name]
    prompt, answer = _turn(tokenizer, calls, reasoning)
    parser = ResponseParser(tokenizer.response_template, prefix=prompt, tokenizer=tokenizer)
    closed = []
    for token_id in answer:
        closed += [event["field"] for event in parser.feed([token_id]) if event["type"] == "region_close"]
    message, _ = parser.finalize()
    assert message == _expected(calls, reasoning)
    # Each block closes as soon as its end marker arrives, not at the end of generation.
    assert closed == (["thinking"] if reasoning is not None else []) + ["tool_calls"]


def test_free_text_answer_becomes_content(tokenizer):
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    answer = tokenizer(" I cannot do that.<|im_end|>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.parse_response(answer, prefix=prompt) == {"role": "assistant", "content": "I cannot do that."}


def test_pads_after_the_end_of_the_turn_are_no_content(tokenizer):
    calls, reasoning = ANSWERS["one_call"]
    prompt, answer = _turn(tokenizer, calls, reasoning)
    padded = answer + [tokenizer.pad_token_id] * 5  # a batch row that finished before the others
    assert tokenizer.parse_response(padded, prefix=prompt) == _expected(calls, reasoning)
