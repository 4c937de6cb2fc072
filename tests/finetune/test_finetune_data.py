"""Fine-tuning JSONL -> `datasets.Dataset` of chat messages -> ids and loss mask equal to the reference's `_encode`."""

import json
import re

import pytest
from needle.model.finetune import _encode, render_example
from finetune_support import ALARM, EXAMPLES, WEATHER, fast_tokenizer  # noqa: F401  (fast_tokenizer: a fixture)
from needle.model.tokenizer import SANTokenizer

from needle_hf.finetune.data import (
    IGNORE_INDEX,
    FinetuneDataError,
    NeedlePaddingCollator,
    encode_conversation,
    load_finetune_dataset,
    tokenize_conversations,
)
from needle_hf.models.needle.tokenization_needle import PAD_ID

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

@pytest.fixture(scope="module")
def reference_tokenizer(needle_spm_model):
    return SANTokenizer(needle_spm_model)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(example, ensure_ascii=False) for example in EXAMPLES) + "\n\n", encoding="utf-8")
    return path


def reference_encoding(reference_tokenizer, example):
    """The reference's `_encode` of one example, unpadded."""
    prompt, target = render_example(example)
    length = len(reference_tokenizer.encode(prompt)) + len(reference_tokenizer.encode(target)) + 2
    ids, mask = _encode(reference_tokenizer, example, max_len=length)
    return ids, [int(value) for value in mask]


def test_dataset_rows_encode_to_the_reference_ids_and_mask(jsonl, fast_tokenizer, reference_tokenizer):
    dataset = load_finetune_dataset(jsonl)
    assert dataset.column_names == ["messages", "tools", "chat_template_kwargs"] and len(dataset) == len(EXAMPLES)
    for row, example in zip(dataset, EXAMPLES):
        assert encode_conversation(fast_tokenizer, row["messages"], row["tools"],
                                   chat_template_kwargs=row["chat_template_kwargs"]) == reference_encoding(
            reference_tokenizer, example)


def _wrapped(schema: dict) -> dict:
    return {"type": "function", "function": schema}


# Tools as the reference's `render_example` also takes them: OpenAI-wrapped (written wrapped), a JSON
# string (written verbatim, spaces and escapes included), wrapped and bare mixed inside a string.
TOOLS_SPELLINGS = {
    "wrapped": [_wrapped(WEATHER), _wrapped(ALARM)],
    "json-string": json.dumps([WEATHER, ALARM]),
    "json-string-ascii-escaped": json.dumps([_wrapped(ALARM), WEATHER], indent=1, ensure_ascii=True),
    "mixed-list": [WEATHER, _wrapped(ALARM)],
}


@pytest.mark.parametrize("spelling", list(TOOLS_SPELLINGS))
def test_wrapped_and_string_tools_encode_as_the_reference_writes_them(tmp_path, fast_tokenizer, reference_tokenizer, spelling):
    from finetune_support import EXAMPLES as base

    examples = [dict(example, tools=TOOLS_SPELLINGS[spelling]) for example in base[:3]]
    path = tmp_path / "tools.jsonl"
    path.write_text("\n".join(json.dumps(example, ensure_ascii=False) for example in examples), encoding="utf-8")
    tokenized = tokenize_conversations(load_finetune_dataset(path), fast_tokenizer)
    for row, example in zip(tokenized, examples):
        ids, mask = reference_encoding(reference_tokenizer, example)
        assert row["input_ids"] == ids
        assert row["labels"] == [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def test_inference_prompts_still_unwrap_openai_tools(fast_tokenizer):
    """Without `tools_text` (an inference request) the template unwraps OpenAI wrappers to the bare schemas."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    wrapped = fast_tokenizer.apply_chat_template(messages, tools=[_wrapped(WEATHER)], tokenize=False)
    assert wrapped == fast_tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False)
    assert '"type":"function"' not in wrapped


def test_tokenized_labels_are_the_ids_under_the_mask_and_collate_right_padded(jsonl, fast_tokenizer, reference_tokenizer):
    tokenized = tokenize_conversations(load_finetune_dataset(jsonl), fast_tokenizer)
    batch = NeedlePaddingCollator(pad_token_id=PAD_ID, return_tensors="np")([tokenized[i] for i in range(3)])
    longest = max(len(tokenized[i]["input_ids"]) for i in range(3))
    assert batch["input_ids"].shape == batch["labels"].shape == (3, longest)
    for index in range(3):
        ids, mask = reference_encoding(reference_tokenizer, EXAMPLES[index])
        padded = longest - len(ids)
        assert list(batch["input_ids"][index]) == ids + [PAD_ID] * padded
        assert list(batch["labels"][index]) == [t if m else IGNORE_INDEX for t, m in zip(ids, mask)] + [IGNORE_INDEX] * padded
        assert list(batch["attention_mask"][index]) == [1] * len(ids) + [0] * padded


@pytest.mark.parametrize("line, problem", [
    ('{"tools": []}', "field 'query'"),
    ('{"query": "hi", "answers": {"name": "x"}}', "field 'answers'"),
    ('{"query": "hi", "answers": [{"arguments": {}, "name": "x"}]}', "field 'answers[0]'"),
    ('{"query": "hi", "tools": "[{\\"name\\": 1"}', "field 'tools': a string that is not JSON"),
    ('{"query": "hi", "tools": "{}"}', "field 'tools': expected a list of schema objects"),
    ('{"query": "hi", "tools": {"name": "x"}}', "field 'tools': expected a list of schema objects"),
    ('{"query": "hi", "tools": [{"type": "function", "function": "x"}]}', "field 'tools[0]': an OpenAI wrapper"),
    ('{"query": "hi", "system": 3}', "field 'system'"),
    ('{"query": "hi",', "not valid JSON"),
])
def test_malformed_lines_are_reported_with_file_line_and_field(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"query": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(FinetuneDataError, match=r"bad\.jsonl:2: .*" + re.escape(problem)):
        load_finetune_dataset(path)


_TOOL = '{"name":"a","description":"x","parameters":{"type":"object","properties":{}}}'


def _line(arguments: str = "{}", name: str = "a", tools: str = f"[{_TOOL}]", extra: str = "") -> bytes:
    return f'{{"query":"q","tools":{tools},"answers":[{{"name":"{name}","arguments":{arguments}}}]{extra}}}'.encode()


def test_reference_rows_load_as_the_reference_reads_them(tmp_path):
    """What the reference's reader takes loads here too: the answers as their JSON text, and fields
    it ignores (an id, a source) ignored."""
    calls = [{"name": "a", "arguments": {"x": 1}}]
    tools = [{"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}]
    rows = [
        {"query": "q", "tools": tools, "answers": calls},
        {"query": "q", "tools": tools, "answers": json.dumps(calls)},
        {"id": 17, "source": "generated", "query": "q", "tools": tools, "answers": calls},
    ]
    path = tmp_path / "reference.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    dataset = load_finetune_dataset(path)
    assert len(dataset) == 3
    assert dataset[0]["messages"] == dataset[1]["messages"] == dataset[2]["messages"]


@pytest.mark.parametrize("data, problem", [
    (b'{"query":"caf\xe9","answers":[]}', "not UTF-8 text (byte 0xe9"),
    (_line('{"x":' + "[" * 100_000 + "]" * 100_000 + "}"), "nests deeper than 64 levels"),
    (_line('{"x":' + "[" * 70 + "]" * 70 + "}"), "field 'answers': nests deeper than 64 levels"),
    (_line('{"x":' + "9" * 5000 + "}"), "a number of 5000 digits"),
    (_line('{"x":1e999}'), "overflows a float"),
    (_line('{"x":NaN}'), "NaN is not a JSON number"),
    (_line('{"x":-Infinity}'), "-Infinity is not a JSON number"),
    (b'{"query":"q\\ud800","answers":[]}', "field 'query': text with a lone surrogate"),
    (_line('{"x":"\\udc00"}'), "field 'answers[0].arguments.x': text with a lone surrogate"),
    (_line(name="b"), "field 'answers[0].name': calls 'b', which the example does not offer"),
    (_line(tools="[]"), "field 'answers[0].name': calls 'a'"),
    (_line(tools=f"[{_TOOL},{_TOOL}]"), "field 'tools[1].name': the tool name 'a' is offered twice"),
    (_line(tools='[{"description":"x"}]'), "field 'tools[0].name': expected a non-empty string"),
    (_line(tools='[{"name":"a","parameters":[]}]'), "field 'tools[0].parameters': expected a JSON object"),
    (_line(tools='"[{\\"name\\":\\"a\\",\\"x\\":NaN}]"'), "field 'tools': NaN is not a JSON number"),
    (_line(arguments="null"), "field 'answers[0].arguments': expected a JSON object"),
    (_line(arguments='"{}"'), "field 'answers[0].arguments': expected a JSON object"),
    (_line(name=""), "field 'answers[0].name': expected a non-empty string"),
    (_line(extra=',"reasoning":"a</think>b"'), "field 'reasoning': holds </think>"),
    (_line(extra=',"reasoning":7'), "field 'reasoning': expected a string"),
    (_line(extra=',"function_calls":[]'), "'answers' and 'function_calls' both given"),
    (b'{"query":"q","answer":[{"name":"a","arguments":{}}]}', "unknown field 'answer'"),
    (b'{"query":"q","query":"r","answers":[]}', "repeats the key 'query'"),
    (b'{"query":["q"],"answers":[]}', "field 'query': expected a string"),
    (b'[{"query":"q"}]', "expected a JSON object, found list"),
    (b'{"query":"q","answers":[]}\x00', "not valid JSON"),
    (b'\xef\xbb\xbf{"query":"q","answers":[]}', "a byte-order mark is only allowed at the start of the file"),
])
def test_hostile_lines_are_refused_naming_file_line_and_field(tmp_path, data, problem):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"query": "fine", "answers": []}\n' + data + b"\n")
    with pytest.raises(FinetuneDataError, match=r"bad\.jsonl:2: .*" + re.escape(problem)):
        load_finetune_dataset(path)


def test_a_leading_bom_crlf_lines_and_blank_lines_are_read(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf' + _line() + b"\r\n\r\n" + _line(arguments='{"x":"</tool_call><|im_end|>"}') + b"\r\n")
    dataset = load_finetune_dataset(path)
    assert [row["messages"][-1]["tool_calls"][0]["function"]["arguments"] for row in dataset] == \
        ["{}", '{"x":"</tool_call><|im_end|>"}']


@pytest.mark.parametrize("content, problem", [
    (None, "no examples"), (b"", "no examples"), (b"\n  \n\n", "no examples"), ("folder", "a folder, not a file"),
])
def test_empty_missing_and_folder_paths_are_refused(tmp_path, content, problem):
    path = tmp_path / "data.jsonl"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    else:
        problem = "no such file"
    with pytest.raises(FinetuneDataError, match=re.escape(problem)):
        load_finetune_dataset(path)
    with pytest.raises(FinetuneDataError, match="path: expected a file path"):
        load_finetune_dataset(3)


def test_in_memory_examples_with_non_json_values_or_unoffered_tools_are_refused():
    from needle_hf.finetune.data import conversations_dataset, example_to_conversation

    tool = json.loads(_TOOL)
    for arguments, problem in (({"x": float("nan")}, "expected a finite number"), ({"x": {1, 2}}, "found set"),
                               ({"x": b"raw"}, "found bytes"), ({1: "x"}, "expected string keys")):
        with pytest.raises(FinetuneDataError, match=r"example 0: field 'answers\[0\]\.arguments.*" + re.escape(problem)):
            conversations_dataset([{"query": "q", "tools": [tool], "answers": [{"name": "a", "arguments": arguments}]}])
    wrong = {"query": "q", "tools": [tool], "answers": [{"name": "other", "arguments": {}}]}
    with pytest.raises(FinetuneDataError, match="does not offer"):
        example_to_conversation(wrong)
    assert example_to_conversation(wrong, offered_tools_only=False)["messages"][-1]["tool_calls"][0]["function"]["name"] == "other"
    with pytest.raises(FinetuneDataError, match="examples: no examples"):
        conversations_dataset([])
    with pytest.raises(FinetuneDataError, match="examples: expected an iterable"):
        conversations_dataset({"query": "q"})


def test_collator_refuses_bad_rows_and_options():
    with pytest.raises(ValueError, match="pad_token_id"):
        NeedlePaddingCollator(pad_token_id=-1)
    with pytest.raises(ValueError, match="return_tensors"):
        NeedlePaddingCollator(pad_token_id=0, return_tensors="tf")
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        NeedlePaddingCollator(pad_token_id=0, pad_to_multiple_of=0)
    collate = NeedlePaddingCollator(pad_token_id=0, return_tensors="np")
    for rows, problem in (([], "at least one row"), ([{"input_ids": [1, 2]}], r"rows\[0\]: expected a dict"),
                          ([{"input_ids": [1, 2], "labels": [1]}], r"rows\[0\]: 'labels' has 1 entries"),
                          ([{"input_ids": ["a"], "labels": [1]}], r"rows\[0\]: expected 'input_ids'")):
        with pytest.raises(FinetuneDataError, match=problem):
            collate(rows)
