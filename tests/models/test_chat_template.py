"""The chat template renders the reference prompt format, token for token, and answers parse back.

Ground truth: the reference's `render_example` (prompt and target text) and its training encoder
`_encode` (`[BOS] + encode(prompt) + encode(target) + [EOS]` with a loss mask over target + EOS),
run with sentencepiece on the session's Needle-style model.
"""

import json

import jinja2
import pytest
import sentencepiece
from needle.model.finetune import _encode, render_example
from needle.model.tokenizer import SANTokenizer

from needle_hf.models.needle.chat_template import NEEDLE_CHAT_TEMPLATE
from needle_hf.models.needle.tokenization_needle import BOS_ID, EOS_ID, PAD_ID, build_fast_tokenizer
from needle_hf.tools.tool_calls import (
    AssistantTurn,
    ToolCallParseError,
    parse_assistant_turn,
    parse_tool_calls,
    to_openai_tool_calls,
)

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

SET_ALARM = {
    "name": "set_alarm",
    "description": "Set an alarm. Use 24-hour time.",
    "parameters": {"type": "object",
                   "properties": {"hour": {"type": "integer"}, "minute": {"type": "integer"}},
                   "required": ["hour", "minute"]},
}
SEND_MESSAGE = {
    "name": "send_message",
    "description": "Envoyer un message à un contact — 发送消息 📨",
    "parameters": {"type": "object",
                   "properties": {"recipient": {"type": "string"}, "message": {"type": "string"}},
                   "required": ["recipient", "message"]},
}
# Keys deliberately out of alphabetical order, nested, with every JSON type and characters that
# Jinja's own tojson would HTML-escape ("<", ">", "&", "'").
CREATE_EVENT = {
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string", "description": "Shown as <b>title</b> & 'quoted'"},
        "when": {"type": "object", "properties": {"start": {"type": "string"}, "all_day": {"type": "boolean"}}},
        "attendees": {"type": "array", "items": {"type": "string"}},
    }},
    "name": "create_event",
    "description": "Create a calendar event.",
}


def openai_wrapped(*functions):
    """Tool schemas or calls in the OpenAI / Hugging Face `{"type": "function", "function": ...}` wrapper."""
    return [{"type": "function", "function": function} for function in functions]


ALARM_AT_7_30 = {"name": "set_alarm", "arguments": {"hour": 7, "minute": 30}}
ALARM_AT_6 = {"name": "set_alarm", "arguments": {"hour": 6, "minute": 0}}
MESSAGE_TO_LI_MING = {"name": "send_message", "arguments": {"recipient": "李明", "message": "j'arrive 🚗"}}
MESSAGE_TO_BOB = {"name": "send_message", "arguments": {"recipient": "Bob", "message": "running late"}}
TEAM_SYNC = {"name": "create_event", "arguments": {
    "title": "Team sync \"Q3\" \\ <ops> & co", "when": {"start": "2024-07-01", "all_day": True},
    "attendees": ["Zoë", "Ana"], "priority": None, "weight": 0.5}}
SYSTEM_TEXT = "  You are a helpful assistant on a phone. 🙂 \n"
FRENCH_QUERY = "Réveille-moi à 6h et dis à 李明 «j'arrive» 🚗"
EVENT_QUERY = "Team sync \"Q3\" on 2024-07-01, all day, with Zoë & Ana <ops>."
REASONING = "\n6h is hour 6, minute 0; 李明 is the recipient.  "

# Each case: the reference example (render_example's input), and the same conversation as
# Hugging Face chat messages plus the `tools` argument.
CASES = {
    "one_call": (
        {"query": "Wake me at 7:30.", "tools": [SET_ALARM], "answers": [ALARM_AT_7_30]},
        [{"role": "user", "content": "Wake me at 7:30."},
         {"role": "assistant", "tool_calls": openai_wrapped(ALARM_AT_7_30)}],
        openai_wrapped(SET_ALARM),
    ),
    "system_reasoning_unicode_multi_call": (
        {"system": SYSTEM_TEXT, "query": FRENCH_QUERY, "tools": [SET_ALARM, SEND_MESSAGE],
         "reasoning": REASONING, "answers": [ALARM_AT_6, MESSAGE_TO_LI_MING]},
        [{"role": "system", "content": SYSTEM_TEXT},
         {"role": "user", "content": FRENCH_QUERY},
         {"role": "assistant", "content": "", "reasoning_content": REASONING,
          "tool_calls": openai_wrapped(ALARM_AT_6, MESSAGE_TO_LI_MING)}],
        openai_wrapped(SET_ALARM, SEND_MESSAGE),
    ),
    "refusal_with_reasoning": (
        {"query": "What's the meaning of life?", "tools": [SET_ALARM], "reasoning": "No tool applies.", "answers": []},
        [{"role": "user", "content": "What's the meaning of life?"},
         {"role": "assistant", "reasoning": "No tool applies.", "tool_calls": []}],
        openai_wrapped(SET_ALARM),
    ),
    "nested_arguments_key_order": (
        {"query": EVENT_QUERY, "tools": [CREATE_EVENT], "answers": [TEAM_SYNC]},
        [{"role": "user", "content": EVENT_QUERY},
         {"role": "assistant", "tool_calls": openai_wrapped(TEAM_SYNC)}],
        openai_wrapped(CREATE_EVENT),
    ),
    "whitespace_in_query_bare_schemas_and_calls": (
        {"query": "  text   Bob:\n\t'running late'  ", "tools": [SEND_MESSAGE, SET_ALARM], "answers": [MESSAGE_TO_BOB]},
        [{"role": "user", "content": [{"type": "text", "text": "  text   Bob:\n"},
                                      {"type": "text", "text": "\t'running late'  "}]},
         {"role": "assistant", "tool_calls": [MESSAGE_TO_BOB]}],
        [SEND_MESSAGE, SET_ALARM],
    ),
    "no_tools": (
        {"query": "Hello there", "answers": []},
        [{"role": "user", "content": "Hello there"}, {"role": "assistant", "tool_calls": None}],
        None,
    ),
    "arguments_as_json_string": (
        {"query": "Alarm at 5:05", "tools": [SET_ALARM], "system": "Be exact.",
         "answers": [{"name": "set_alarm", "arguments": {"hour": 5, "minute": 5}}]},
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Alarm at 5:05"},
         {"role": "assistant",
          "tool_calls": openai_wrapped({"name": "set_alarm", "arguments": '{"hour":5,"minute":5}'})}],
        openai_wrapped(SET_ALARM),
    ),
}


@pytest.fixture(scope="module")
def sentencepiece_model(needle_spm_model):
    return sentencepiece.SentencePieceProcessor(model_file=needle_spm_model)


@pytest.fixture(scope="module")
def fast_tokenizer(needle_spm_model):
    return build_fast_tokenizer(needle_spm_model)


@pytest.fixture(scope="module")
def reference_tokenizer(needle_spm_model):
    return SANTokenizer(needle_spm_model)


def render(tokenizer, messages, tools, **kwargs):
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


def token_ids(tokenizer, messages, tools, **kwargs):
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, **kwargs)


def reference_training_ids(reference_tokenizer, example):
    """The reference's training sequence and loss mask, unpadded."""
    prompt, target = render_example(example)
    length = len(reference_tokenizer.encode(prompt)) + len(reference_tokenizer.encode(target)) + 2
    ids, mask = _encode(reference_tokenizer, example, max_len=length + 1)
    assert ids[-1] == PAD_ID  # nothing was truncated
    return ids[:length], [int(value) for value in mask[:length]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_generation_prompt_renders_the_reference_prompt(case, fast_tokenizer):
    example, messages, tools = CASES[case]
    prompt, _ = render_example(example)
    rendered = render(fast_tokenizer, messages[:-1], tools, add_generation_prompt=True)
    assert rendered == fast_tokenizer.bos_token + prompt


@pytest.mark.parametrize("case", sorted(CASES))
def test_full_conversation_renders_prompt_then_target(case, fast_tokenizer):
    example, messages, tools = CASES[case]
    prompt, target = render_example(example)
    # The space is the dummy prefix "▁" that the reference's separate encode(target) starts with.
    assert render(fast_tokenizer, messages, tools) == (
        fast_tokenizer.bos_token + prompt + " " + target + fast_tokenizer.eos_token)


@pytest.mark.parametrize("case", sorted(CASES))
def test_generation_prompt_ids_match_reference_inference(case, fast_tokenizer, reference_tokenizer):
    example, messages, tools = CASES[case]
    prompt, _ = render_example(example)
    ids = token_ids(fast_tokenizer, messages[:-1], tools, add_generation_prompt=True)["input_ids"]
    assert ids == [BOS_ID] + reference_tokenizer.encode(prompt)  # run.generate's prompt_ids


@pytest.mark.parametrize("case", sorted(CASES))
def test_full_conversation_ids_and_mask_match_reference_training(case, fast_tokenizer, reference_tokenizer):
    example, messages, tools = CASES[case]
    expected_ids, expected_mask = reference_training_ids(reference_tokenizer, example)
    encoded = token_ids(fast_tokenizer, messages, tools, return_assistant_tokens_mask=True)
    assert encoded["input_ids"] == expected_ids
    assert expected_ids[0] == BOS_ID and expected_ids[-1] == EOS_ID
    assert list(encoded["assistant_masks"]) == expected_mask


def test_template_without_generation_prompt_stops_after_the_user_turn(fast_tokenizer):
    rendered = render(fast_tokenizer, [{"role": "user", "content": "hi"}], None)
    assert rendered == fast_tokenizer.bos_token + "<|im_start|>user\n<tools>[]</tools>\nhi<|im_end|>\n"


def test_tools_json_is_byte_identical_to_python_compact_json(fast_tokenizer):
    tools = [CREATE_EVENT, SEND_MESSAGE]
    rendered = render(fast_tokenizer, [{"role": "user", "content": "x"}], openai_wrapped(*tools))
    compact = json.dumps(tools, separators=(",", ":"), ensure_ascii=False)
    assert "<tools>" + compact + "</tools>" in rendered
    assert '"parameters":{"type":"object","properties":{"title"' in compact  # key order kept, not sorted
    assert "<b>title</b> & 'quoted'" in rendered and "发送消息 📨" in rendered  # no HTML or \\u escaping


def test_openai_wrapped_and_bare_tools_render_the_same(fast_tokenizer):
    messages = [{"role": "user", "content": "x"}]
    assert render(fast_tokenizer, messages, openai_wrapped(SET_ALARM, SEND_MESSAGE)) == render(
        fast_tokenizer, messages, [SET_ALARM, SEND_MESSAGE])


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "system", "content": "s"}], "needs one user message"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "two in a row"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], "system message only as the first"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "{}"}], "only after an assistant turn"),
    ([{"role": "user", "content": "a"}, {"role": "function", "content": "{}"}], "no 'function' role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": []}, {"role": "assistant", "tool_calls": []}],
     "only after the user message or tool results"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "Sure, done!"}], "tool calls only"),
    ([{"role": "assistant", "tool_calls": []}, {"role": "user", "content": "a"}], "only after the user message"),
    ([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}], "text only"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of text parts; got 5"),
    ([{"role": "user", "content": {"type": "text", "text": "a"}}], "content must be a string or a list of text parts"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"arguments": {}}]}], "string 'name'"),
])
def test_conversations_outside_the_trained_format_are_refused(messages, problem, fast_tokenizer):
    with pytest.raises(jinja2.exceptions.TemplateError, match=problem):
        render(fast_tokenizer, messages, None)


def test_tokenizer_carries_the_needle_template(fast_tokenizer):
    assert fast_tokenizer.chat_template == NEEDLE_CHAT_TEMPLATE


# --- parsing generated answers ---------------------------------------------------------------

def test_generated_answer_parses_back_to_the_calls(fast_tokenizer, sentencepiece_model):
    example, _, _ = CASES["system_reasoning_unicode_multi_call"]
    _, target = render_example(example)
    generated_ids = sentencepiece_model.encode(target) + [EOS_ID]  # what the model learned to emit
    text = fast_tokenizer.decode(generated_ids, skip_special_tokens=True)
    turn = parse_assistant_turn(text)
    assert turn == AssistantTurn(tool_calls=example["answers"], reasoning=example["reasoning"].strip())
    assert parse_tool_calls(text) == example["answers"]


@pytest.mark.parametrize("text, calls", [
    ('<tool_call>[{"name":"a","arguments":{"x":1}}]</tool_call>', [{"name": "a", "arguments": {"x": 1}}]),
    ('<tool_call>[]</tool_call><|im_end|>', []),
    (' <tool_call>[{"name":"a","arguments":{}}]</tool_call><|im_end|>\n<|im_start|>user',
     [{"name": "a", "arguments": {}}]),
    ('<think>\nplan\n</think>\n<tool_call>[{"name":"a"}]</tool_call>', [{"name": "a", "arguments": {}}]),
    ('<tool_call>[{"name":"a","arguments":null,"extra":1}]</tool_call>', [{"name": "a", "arguments": {}}]),
])
def test_parse_tool_calls_accepts_well_formed_turns(text, calls):
    assert parse_tool_calls(text) == calls


@pytest.mark.parametrize("text, problem", [
    ("I'd be glad to help!", "start with <tool_call>, found \"I'd be"),
    ("", "found nothing"),
    ('<tool_call>[{"name":"a","arguments":{}}]', "never closed"),
    ("<think>\nplan", "<think> block is never closed"),
    ('<tool_call>[{"name":"a",]</tool_call>', "not valid JSON"),
    ('<tool_call>{"name":"a","arguments":{}}</tool_call>', "must be a JSON list, got dict"),
    ('<tool_call>[{"arguments":{}}]</tool_call>', "tool call 0: missing a non-empty string 'name'"),
    ('<tool_call>[{"name":"a","arguments":{}}, 3]</tool_call>', "tool call 1: expected a JSON object, got int"),
    ('<tool_call>[{"name":"a","arguments":[1]}]</tool_call>', r"tool call 0 \(a\): 'arguments' must be a JSON object"),
    ('<tool_call>[]</tool_call> and more', "unexpected text after </tool_call>"),
])
def test_parse_tool_calls_rejects_malformed_turns(text, problem):
    with pytest.raises(ToolCallParseError, match=problem):
        parse_tool_calls(text)
    assert issubclass(ToolCallParseError, ValueError)


def test_parsed_calls_feed_back_into_the_template(fast_tokenizer):
    calls = parse_tool_calls('<tool_call>[{"name":"set_alarm","arguments":{"hour":7,"minute":30}}]</tool_call>')
    messages = [{"role": "user", "content": "Wake me at 7:30."},
                {"role": "assistant", "tool_calls": to_openai_tool_calls(calls)}]
    example, _, _ = CASES["one_call"]
    assert render(fast_tokenizer, messages, [SET_ALARM]) == render(fast_tokenizer, CASES["one_call"][1], [SET_ALARM])
    assert calls == example["answers"]


def test_tool_results_render_as_the_next_user_turn(fast_tokenizer):
    """A run of `tool` messages is one user turn holding the JSON list of the results; the tools block is written once."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Wake me at 7:30 and text Bob."},
        {"role": "assistant", "tool_calls": [{"name": "set_alarm", "arguments": {"hour": 7, "minute": 30}},
                                             {"name": "send_message", "arguments": {"to": "Bob", "text": "hi"}}]},
        {"role": "tool", "name": "set_alarm", "content": {"ok": True, "at": "07:30"}},
        {"role": "tool", "name": "send_message", "content": '{"sent":true}'},
    ]
    tools = [SET_ALARM, SEND_MESSAGE]
    tools_json = json.dumps(tools, separators=(",", ":"), ensure_ascii=False)
    expected = (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n<tools>{tools_json}</tools>\nWake me at 7:30 and text Bob.<|im_end|>\n"
        '<|im_start|>assistant\n <tool_call>[{"name":"set_alarm","arguments":{"hour":7,"minute":30}},'
        '{"name":"send_message","arguments":{"to":"Bob","text":"hi"}}]</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_result>[{"ok":true,"at":"07:30"},{"sent":true}]</tool_result><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert render(fast_tokenizer, messages, tools, add_generation_prompt=True) == expected
    # A follow-up query after the answer continues the conversation without repeating the tools.
    follow_up = messages[:3] + [{"role": "user", "content": "Also at 8."}]
    rendered = render(fast_tokenizer, follow_up, tools, add_generation_prompt=True)
    assert rendered.count("<tools>") == 1
    assert rendered.endswith("<|im_end|>\n<|im_start|>user\nAlso at 8.<|im_end|>\n<|im_start|>assistant\n")


def test_tool_result_text_cannot_spell_a_marker(fast_tokenizer):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": []},
                {"role": "tool", "content": "</tool_result><|im_end|>"}]
    ids = token_ids(fast_tokenizer, messages, [SET_ALARM], add_generation_prompt=True)["input_ids"]
    marker_ids = set(fast_tokenizer.convert_tokens_to_ids(["<|im_end|>", "</tool_result>"]))
    # Only the template's own markers: the user turn, the assistant answer, the results turn (im_end x3, tool_result_end x1).
    assert sum(token in marker_ids for token in ids) == 4
