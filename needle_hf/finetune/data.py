"""Needle fine-tuning data: the reference's JSONL examples as Hugging Face chat conversations.

One JSONL line is one example:

    {"query": str, "tools": [schema, ...], "answers": [{"name": str, "arguments": {...}}, ...],
     "system": str (optional), "reasoning": str (optional)}

(`function_calls` is accepted in place of `answers`; `[]` answers mean "no tool applies".) The tools
are what the reference's `render_example` accepts: a list of schemas, bare or OpenAI-wrapped
(`{"type": "function", "function": {...}}`), or that list as a JSON string. The prompt holds them
as the reference writes them: a list dumped compactly (wrappers kept), a string verbatim.

`load_finetune_dataset` turns a file into a `datasets.Dataset` with three columns, the layout TRL's
`SFTTrainer` reads for conversational data:
  - ``messages``: system (when given), user (the query) and assistant turns; the assistant turn
    carries ``tool_calls`` in the OpenAI layout and the reasoning as ``reasoning_content``;
  - ``tools``: the tool schemas as one JSON string;
  - ``chat_template_kwargs``: ``{"tools_text": ...}``, the tools block exactly as the reference's
    prompt spells it. The chat template writes it in place of its own rendering of ``tools`` (which
    unwraps OpenAI wrappers, as inference requests carry them), so a wrapped or non-compact
    spelling trains on the reference's tokens. `SFTTrainer` passes this column to the template.
Arrow stores a column of dicts as structs with the union of every row's keys (filling the gaps with
nulls), which would put `null` fields into tool schemas and arguments. So ``tools`` and each call's
``arguments`` are stored as compact JSON text; the chat template inserts the arguments text verbatim
and `SFTTrainer` decodes the tools string before rendering.

With the Needle chat template, `tokenizer.apply_chat_template(messages, tools=tools,
return_assistant_tokens_mask=True, return_dict=True)` then gives the reference's training ids and
loss mask (`[BOS] + prompt + target + [EOS]`, mask on target and EOS); `tokenize_conversations`
does that for a whole dataset and adds the ``labels`` (-100 outside the mask) that `Trainer` and
`needle_causal_lm_loss` read. `NeedlePaddingCollator` pads a batch to its longest row, on the right
as the reference does.

Every problem in a file is reported as `FinetuneDataError` naming the file, line and field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

IGNORE_INDEX = -100  # label of a position outside the loss (transformers' convention)


class FinetuneDataError(ValueError):
    """A fine-tuning example is not in the Needle JSONL format."""


def _compact_json(value) -> str:
    """JSON the way the Needle prompt writes it: separators "," and ":", non-ASCII kept, key order kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _tool_schemas(tools, where: str) -> list:
    """The schema list of an example's ``tools`` (a list, or its JSON string), checked."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise FinetuneDataError(
                f"{where}: field 'tools': a string that is not JSON ({error.msg} at column {error.colno}); "
                "expected a list of schema objects or its JSON text"
            ) from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise FinetuneDataError(f"{where}: field 'tools': expected a list of schema objects (or its JSON text), "
                                f"found {tools!r:.60}")
    for index, tool in enumerate(tools):
        if tool.get("type") == "function" and not isinstance(tool.get("function"), dict):
            raise FinetuneDataError(f"{where}: field 'tools[{index}]': an OpenAI wrapper needs a 'function' "
                                    f"schema object, found {tool.get('function')!r:.60}")
    return tools


def reference_tools_text(tools) -> str:
    """The tools block's text in the reference's prompt: a JSON string verbatim, anything else dumped compactly."""
    return tools if isinstance(tools, str) else _compact_json(tools)


def _check_example(example, where: str) -> list:
    """Validate one reference example and return its answers list."""
    if not isinstance(example, dict):
        raise FinetuneDataError(f"{where}: expected a JSON object, found {type(example).__name__}")
    if not isinstance(example.get("query"), str):
        raise FinetuneDataError(f"{where}: field 'query': expected a string, found {example.get('query')!r:.60}")
    _tool_schemas(example.get("tools", []), where)
    for field in ("system", "reasoning"):
        if example.get(field) is not None and not isinstance(example[field], str):
            raise FinetuneDataError(f"{where}: field '{field}': expected a string, found {example[field]!r:.60}")
    field = "answers" if "answers" in example else "function_calls"
    answers = example.get(field, [])
    if not isinstance(answers, list):
        raise FinetuneDataError(f"{where}: field '{field}': expected a list of calls, found {answers!r:.60}")
    for index, call in enumerate(answers):
        # The target is written {"name":...,"arguments":...}; another key or order would change its tokens.
        if not isinstance(call, dict) or list(call) != ["name", "arguments"] or not isinstance(call["name"], str):
            raise FinetuneDataError(
                f"{where}: field '{field}[{index}]': expected {{\"name\": str, \"arguments\": ...}} "
                f"(these two keys, in this order), found {call!r:.80}"
            )
    return answers


def example_to_conversation(example: dict, *, where: str = "example") -> dict:
    """One reference example -> ``{"messages": [...], "tools": JSON string, "chat_template_kwargs":
    {"tools_text": str}}`` (see the module docstring)."""
    answers = _check_example(example, where)
    messages = []
    if example.get("system"):
        messages.append({"role": "system", "content": example["system"]})
    messages.append({"role": "user", "content": example["query"]})
    messages.append({
        "role": "assistant",
        "content": "",
        "reasoning_content": example.get("reasoning") or "",
        "tool_calls": [
            {"type": "function", "function": {"name": call["name"], "arguments": _compact_json(call["arguments"])}}
            for call in answers
        ],
    })
    tools = example.get("tools", [])
    return {
        "messages": messages,
        "tools": _compact_json(_tool_schemas(tools, where)),
        "chat_template_kwargs": {"tools_text": reference_tools_text(tools)},
    }


def read_finetune_jsonl(path) -> list[dict]:
    """The examples of a Needle fine-tuning JSONL file, validated (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FinetuneDataError(f"{path}: no such file")
    examples = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError as error:
                raise FinetuneDataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            _check_example(example, where)
            examples.append(example)
    if not examples:
        raise FinetuneDataError(f"{path}: no examples")
    return examples


def conversations_dataset(examples: Iterable[dict]):
    """A `datasets.Dataset` (columns ``messages``, ``tools``) of reference examples."""
    import datasets

    rows = [example_to_conversation(example, where=f"example {index}") for index, example in enumerate(examples)]
    return datasets.Dataset.from_list(rows)


def load_finetune_dataset(path):
    """`datasets.Dataset` (columns ``messages``, ``tools``, ``chat_template_kwargs``) of a Needle fine-tuning JSONL file."""
    return conversations_dataset(read_finetune_jsonl(path))


def encode_conversation(
    tokenizer, messages: list, tools, *, chat_template_kwargs: Optional[dict] = None
) -> tuple[list[int], list[int]]:
    """Training ids and loss mask (1 on the assistant target and EOS) of one conversation.

    ``tools`` is the list of schemas or its JSON string (the dataset column); ``chat_template_kwargs``
    the dataset column of that name (``tools_text``), as `SFTTrainer` passes it.
    """
    if isinstance(tools, str):
        tools = json.loads(tools)
    encoded = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        **(chat_template_kwargs or {}),
    )
    return list(encoded["input_ids"]), [int(value) for value in encoded["assistant_masks"]]


def tokenize_conversations(dataset, tokenizer, *, max_length: Optional[int] = None):
    """Add ``input_ids`` and ``labels`` (the ids, -100 outside the loss mask) to a conversations dataset.

    Rows longer than ``max_length`` are cut at the end, as the reference cuts at its ``max_len``.
    """

    def encode(row):
        ids, mask = encode_conversation(tokenizer, row["messages"], row["tools"],
                                        chat_template_kwargs=row.get("chat_template_kwargs"))
        labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]
        if max_length is not None:
            ids, labels = ids[:max_length], labels[:max_length]
        return {"input_ids": ids, "labels": labels}

    return dataset.map(encode, remove_columns=dataset.column_names, desc="Tokenizing")


class NeedlePaddingCollator:
    """Pads ``input_ids`` / ``labels`` rows on the right to the longest row of the batch.

    Returns torch tensors ``input_ids`` [B, T] (pad id), ``attention_mask`` [B, T] and ``labels``
    [B, T] (-100 on padding), or numpy arrays with ``return_tensors="np"``.
    """

    def __init__(self, *, pad_token_id: int, return_tensors: str = "pt", pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.return_tensors = return_tensors
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        longest = max(len(row["input_ids"]) for row in rows)
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = np.full((len(rows), length), self.pad_token_id, np.int64)
        labels = np.full((len(rows), length), IGNORE_INDEX, np.int64)
        attention = np.zeros((len(rows), length), np.int64)
        for index, row in enumerate(rows):
            size = len(row["input_ids"])
            ids[index, :size] = row["input_ids"]
            labels[index, :size] = row["labels"]
            attention[index, :size] = 1
        batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
        if self.return_tensors == "np":
            return batch
        import torch

        return {name: torch.from_numpy(value) for name, value in batch.items()}
