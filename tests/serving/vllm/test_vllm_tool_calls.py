"""OpenAI-compatible tool calling: the ``needle`` tool parser, and `vllm serve` on the demo model.

The server test starts `vllm serve DEMO_FOLDER --enable-auto-tool-choice --tool-call-parser needle`
with no other Needle-specific flag (the plugin entry point registers model and parser) and asks it
with the official `openai` client; the calls it returns must be the PyTorch model's greedy answer
on the same chat, parsed by needle_hf.tool_calls, and name the tool the query asks for.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo_support import MAX_NEW_TOKENS, TOOL_QUERIES  # noqa: E402

import needle_hf  # noqa: E402,F401
from needle_hf.tool_calls import parse_tool_calls  # noqa: E402
from needle_hf.vllm.tool_parser import NeedleToolParser  # noqa: E402
from vllm_support import demo_folder, vllm_server  # noqa: E402

pytestmark = pytest.mark.vllm  # runs in .venv-vllm only

TWO_CALLS = ('<think>\nalarm, then text\n</think>\n<tool_call>[{"name": "set_alarm", "arguments": {"time": "06:45"}}, '
             '{"name": "send_message", "arguments": {"to": "Zoë", "text": "up at 6:45"}}]</tool_call><|im_end|>')
EXPECTED_TWO = [("set_alarm", {"time": "06:45"}), ("send_message", {"to": "Zoë", "text": "up at 6:45"})]


def stream_through(parser, text, piece=3):
    """Feed ``text`` to the streaming parser ``piece`` characters at a time; (content, [(name, args)])."""
    content, calls = "", {}
    for end in range(piece, len(text) + piece, piece):
        previous, current = text[: end - piece], text[:end]
        delta = parser.extract_tool_calls_streaming(previous, current, current[len(previous):], [], [], [], None)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_parser_turns_a_needle_answer_into_tool_calls():
    result = NeedleToolParser(None).extract_tool_calls(TWO_CALLS, None)
    assert result.tools_called and result.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == EXPECTED_TWO
    assert all(c.type == "function" and c.id for c in result.tool_calls)


def test_streaming_parser_returns_the_same_calls():
    content, calls = stream_through(NeedleToolParser(None), TWO_CALLS)
    assert content == "" and calls == EXPECTED_TWO


@pytest.mark.parametrize("text", ["The alarm is set.", "Sure: <b>done</b>", "<tool_call>[{\"name\": "])
def test_text_that_is_not_a_complete_tool_call_turn_stays_content(text):
    result = NeedleToolParser(None).extract_tool_calls(text, None)
    assert not result.tools_called and result.content == text
    content, calls = stream_through(NeedleToolParser(None), text)
    assert calls == [] and content == ("" if text.startswith("<tool_call>") else text)


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
