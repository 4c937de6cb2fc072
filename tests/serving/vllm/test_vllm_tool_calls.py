"""OpenAI-compatible tool calling: the ``needle`` tool parser, and `vllm serve` on the demo model.

The server test starts `vllm serve DEMO_FOLDER --enable-auto-tool-choice --tool-call-parser needle`
with no other Needle-specific flag (the plugin entry point registers model and parser) and asks it
with the official `openai` client; the calls it returns must be the PyTorch model's greedy answer
on the same chat, parsed by needle_hf.tools.tool_calls, and name the tool the query asks for.
"""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo_support import MAX_NEW_TOKENS, TOOL_QUERIES  # noqa: E402
from turn_strategies import cut, outputs  # noqa: E402

import needle_hf  # noqa: E402,F401
from needle_hf.tools.tool_calls import parse_tool_calls  # noqa: E402
from needle_hf.serving.vllm.tool_parser import NeedleToolParser  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.parser.abstract_parser import DelegatingParser  # noqa: E402
from vllm_support import demo_folder, vllm_server  # noqa: E402

pytestmark = pytest.mark.vllm  # runs in .venv-vllm only

TWO_CALLS = ('<think>\nalarm, then text\n</think>\n<tool_call>[{"name": "set_alarm", "arguments": {"time": "06:45"}}, '
             '{"name": "send_message", "arguments": {"to": "Zoë", "text": "up at 6:45"}}]</tool_call><|im_end|>')
EXPECTED_TWO = [("set_alarm", {"time": "06:45"}), ("send_message", {"to": "Zoë", "text": "up at 6:45"})]


def collect(deltas):
    """(content, [(name, arguments)]) of a stream of `DeltaMessage`s (None: nothing that step)."""
    content, calls = "", {}
    for delta in deltas:
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def stream_deltas(parser, deltas, request=None):
    """Feed ``deltas`` to the streaming parser as vLLM's legacy path does, then end the stream."""
    previous, out = "", []
    for delta in deltas:
        out.append(parser.extract_tool_calls_streaming(previous, previous + delta, delta, [], [], [], request))
        previous += delta
    out.append(parser.finish_streaming())
    return collect(out)


def stream_through(parser, text, piece=3):
    """Feed ``text`` to the streaming parser ``piece`` characters at a time; (content, [(name, args)])."""
    return stream_deltas(parser, [text[start:start + piece] for start in range(0, len(text), piece)])


def whole(text, request=None):
    """(content, [(name, args)]) of the non-streaming path."""
    result = NeedleToolParser(None).extract_tool_calls(text, request)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls]
    assert result.tools_called == bool(calls)
    return result.content or "", calls


def test_parser_turns_a_needle_answer_into_tool_calls():
    result = NeedleToolParser(None).extract_tool_calls(TWO_CALLS, None)
    assert result.tools_called and result.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == EXPECTED_TWO
    assert all(c.type == "function" and c.id for c in result.tool_calls)


def test_streaming_parser_returns_the_same_calls():
    content, calls = stream_through(NeedleToolParser(None), TWO_CALLS)
    assert content == "" and calls == EXPECTED_TWO


@pytest.mark.parametrize("text", ["The alarm is set.", "Sure: <b>done</b>", "<tool_call>[{\"name\": ",
                                  "<think>\nno tool fits\n</think>\nSorry, I can't.", "<think>\ncut short",
                                  '<tool_call>[{"name":"f","arguments":{}}]</tool_call> and more',
                                  "<tool_call>[]</tool_call><tool_call>[]</tool_call>"])
def test_text_that_is_not_a_complete_tool_call_turn_stays_content(text):
    result = NeedleToolParser(None).extract_tool_calls(text, None)
    assert not result.tools_called and result.content == text
    assert stream_through(NeedleToolParser(None), text) == (text, [])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), text=outputs)
def test_streamed_calls_and_content_equal_the_non_streaming_result_for_any_cut(data, text):
    assert stream_deltas(NeedleToolParser(None), data.draw(cut(text))) == whole(text)


class NeedleParser(DelegatingParser):
    """vLLM's composition of a tool parser (no reasoning parser), as `--tool-call-parser needle` builds it."""

    tool_parser_cls = NeedleToolParser


REQUEST = ChatCompletionRequest(model="needle", messages=[{"role": "user", "content": "hi"}],
                                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), text=outputs)
def test_vllms_stream_of_the_parser_equals_its_whole_answer(data, text):
    """Through `Parser.parse_delta(..., finished=...)`, the path `vllm serve` streams by."""
    deltas = data.draw(cut(text)) or [""]
    parser = NeedleParser(None)
    streamed = collect(parser.parse_delta(delta, [], REQUEST, [1], finished=index == len(deltas) - 1)
                       for index, delta in enumerate(deltas))
    _, content, calls = NeedleParser(None).parse(text, REQUEST, enable_auto_tools=True)
    assert streamed == (content or "", [(c.name, json.loads(c.arguments)) for c in calls or []])


def test_tool_choice_none_returns_the_output_as_content():
    request = REQUEST.model_copy(update={"tool_choice": "none"})
    assert whole(TWO_CALLS, request) == (TWO_CALLS, [])
    assert stream_deltas(NeedleToolParser(None), [TWO_CALLS[:9], TWO_CALLS[9:]], request) == (TWO_CALLS, [])


def test_empty_call_list_means_no_tool_call():
    result = NeedleToolParser(None).extract_tool_calls("<tool_call>[]</tool_call>", None)
    assert not result.tools_called and result.tool_calls == []


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_folder(tmp_path_factory.mktemp("vllm-demo") / "needle2-demo-hf")


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    with vllm_server(demo, "--enable-auto-tool-choice", "--tool-call-parser", "needle", "--dtype", "float32",
                     "--max-model-len", "512", log_path=log) as base_url:
        yield base_url


def hf_greedy_calls(folder, tools, query):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=tools, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return [(c["name"], c["arguments"]) for c in parse_tool_calls(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))]


@pytest.mark.parametrize("tools, query, tool", TOOL_QUERIES[:2])
def test_openai_client_gets_the_demo_models_tool_call(server, demo, tools, query, tool):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="unused")
    model = client.models.list().data[0].id
    request = dict(model=model, messages=[{"role": "user", "content": query}], tools=tools, temperature=0,
                   max_tokens=MAX_NEW_TOKENS)
    message = client.chat.completions.create(**request).choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert calls == hf_greedy_calls(demo, tools, query)
    assert calls and calls[0][0] == tool

    streamed = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == calls


# tool_choice "required" and named: Needle's own format, forced by the grammar of needle_hf.generation.grammar.

def demo_tokenizer(demo):
    return AutoTokenizer.from_pretrained(demo)


def test_required_and_named_tool_choice_set_needles_grammar_not_vllms_json(demo):
    from needle_hf.generation.grammar import ToolCallGrammar

    tools = TOOL_QUERIES[1][0]
    tokenizer = demo_tokenizer(demo)
    parser = NeedleParser(tokenizer, tools=None)
    base = dict(model="needle", messages=[{"role": "user", "content": "hi"}], tools=tools)
    required = parser.adjust_request(ChatCompletionRequest(**base, tool_choice="required"))
    assert required.structured_outputs.grammar == ToolCallGrammar(tokenizer).lark(tools, allow_empty=False)
    assert required.structured_outputs.json is None
    assert required._grammar_from_parser  # constrained from the first token, reasoning parser or not
    named = parser.adjust_request(ChatCompletionRequest(**base, tool_choice={"type": "function", "function": {"name": "send_message"}}))
    assert named.structured_outputs.grammar == ToolCallGrammar(tokenizer).lark(tools[1:], allow_empty=False, max_calls=1)
    single = parser.adjust_request(ChatCompletionRequest(**base, tool_choice="required", parallel_tool_calls=False))
    assert single.structured_outputs.grammar == ToolCallGrammar(tokenizer).lark(tools, allow_empty=False, max_calls=1)
    for choice in ("auto", "none"):
        assert parser.adjust_request(ChatCompletionRequest(**base, tool_choice=choice)).structured_outputs is None


def test_a_tool_schema_the_grammar_cannot_enforce_is_a_validation_error(demo):
    from vllm.exceptions import VLLMValidationError

    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    request = ChatCompletionRequest(model="needle", messages=[{"role": "user", "content": "hi"}], tools=[tool],
                                    tool_choice="required")
    with pytest.raises(VLLMValidationError, match="tool pick.*not"):
        NeedleParser(demo_tokenizer(demo), tools=None).adjust_request(request)


def hf_grammar_calls(folder, tools, query, *, allowed=None, **options):
    """The PyTorch model's greedy answer to a chat offering ``tools``, under `ToolCallGrammar` of the
    ``allowed`` tools (default: all; the grammar the server is given), parsed."""
    from transformers import LogitsProcessorList

    from needle_hf.generation.grammar import ToolCallGrammar

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=tools, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    processor = ToolCallGrammar(tokenizer).logits_processor(allowed or tools, allow_empty=False, **options)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             logits_processor=LogitsProcessorList([processor]))
    return [(c["name"], c["arguments"]) for c in parse_tool_calls(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))]


def served_calls(server, tools, query, *, stream=False, **options):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="unused")
    request = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": query}], tools=tools,
                   temperature=0, max_tokens=MAX_NEW_TOKENS, **options)
    if not stream:
        message = client.chat.completions.create(**request).choices[0].message
        return message.content, [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    content, calls = "", {}
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        for call in (delta.tool_calls or []) if delta else []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
    return content or None, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


CHIT_CHAT = "Good morning! How are you today?"


@pytest.mark.parametrize("tools, query", [(TOOL_QUERIES[0][0], CHIT_CHAT), (TOOL_QUERIES[1][0], CHIT_CHAT),
                                          (TOOL_QUERIES[2][0], TOOL_QUERIES[2][1])])
def test_required_tool_choice_always_yields_a_call_in_needles_format(server, demo, tools, query):
    content, calls = served_calls(server, tools, query, tool_choice="required")
    names = {tool["function"]["name"] for tool in tools}
    assert not content and calls and all(name in names for name, _ in calls)
    assert calls == hf_grammar_calls(demo, tools, query)
    streamed_content, streamed = served_calls(server, tools, query, tool_choice="required", stream=True)
    assert not streamed_content and streamed == calls


def test_named_tool_choice_yields_that_tool(server, demo):
    tools, query, asked = TOOL_QUERIES[1]
    other = next(tool["function"]["name"] for tool in tools if tool["function"]["name"] != asked)
    for name in (asked, other):
        choice = {"type": "function", "function": {"name": name}}
        content, calls = served_calls(server, tools, query, tool_choice=choice)
        assert not content and [call_name for call_name, _ in calls] == [name]
        chosen = [tool for tool in tools if tool["function"]["name"] == name]
        assert calls == hf_grammar_calls(demo, tools, query, allowed=chosen, max_calls=1)
        streamed_content, streamed = served_calls(server, tools, query, tool_choice=choice, stream=True)
        assert not streamed_content and streamed == calls
