"""Fine-tuning JSONL -> `datasets.Dataset` of chat messages -> ids and loss mask equal to the reference's `_encode`."""

import json
import re

import pytest
from needle.model.finetune import _encode, render_example
from finetune_support import ALARM, EXAMPLES, WEATHER, fast_tokenizer  # noqa: F401  (fast_tokenizer: a fixture)
from needle.model.tokenizer import SANTokenizer

from needle_hf.finetune_data import (
    IGNORE_INDEX,
    FinetuneDataError,
    NeedlePaddingCollator,
    encode_conversation,
    load_finetune_dataset,
    tokenize_conversations,
)
from needle_hf.tokenization_needle import PAD_ID

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
