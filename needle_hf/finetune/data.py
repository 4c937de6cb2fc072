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

Every problem in a file is reported as `FinetuneDataError` naming the file, line and field. What
a file must be, beyond the field types:
  - UTF-8 lines (a byte-order mark only at the very start; blank lines and ``\r\n`` endings are
    fine), each one JSON object with no repeated key and only the fields above;
  - numbers finite (no NaN, Infinity or 1e999) of at most 400 characters, nesting at most 64 levels,
    text without lone surrogates: the bounds of `parse_tool_calls`, so nothing is trained that the
    parser would refuse to read back;
  - every tool named (a non-empty string), no name offered twice in an example, every call naming an
    offered tool with a JSON object of arguments, and the target (reasoning and calls, as the chat
    template writes them) reading back through `parse_assistant_turn` as exactly those calls.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from ..models.needle.chat_template import IM_END, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START
from ..tools.tool_calls import MAX_JSON_DEPTH, MAX_NUMBER_DIGITS, ToolCallParseError, parse_assistant_turn

IGNORE_INDEX = -100  # label of a position outside the loss (transformers' convention)

#: The fields of one example; any other key is refused (a misspelt ``answers`` would train "no tool").
EXAMPLE_FIELDS = ("query", "tools", "answers", "function_calls", "system", "reasoning")
_ANSWER_FIELD_STEMS = ("answer", "function_call")  # a field whose name reduces to one of these is a misspelling
_BOM = b"\xef\xbb\xbf"
_EXCERPT_CHARS = 60
_INT_BOUND = 10 ** MAX_NUMBER_DIGITS


class FinetuneDataError(ValueError):
    """A fine-tuning example is not in the Needle JSONL format."""


def _excerpt(value) -> str:
    text = repr(value)
    return text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS] + "..."


def checked_option(name: str, value, *, low: float, low_inclusive: bool = True, high: Optional[float] = None,
                   high_inclusive: bool = True, integer: bool = False):
    """A numeric fine-tuning option, checked: a (finite) number, an int when ``integer``, in its range.

    Raises ValueError naming the option, the range expected and the value found.
    """
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    valid = not isinstance(value, bool) and isinstance(value, kinds) and math.isfinite(value)
    valid = valid and (value >= low if low_inclusive else value > low)
    valid = valid and (high is None or (value <= high if high_inclusive else value < high))
    if not valid:
        kind = "an int" if integer else "a finite number"
        bound = f"{'>=' if low_inclusive else '>'} {low}"
        bound += "" if high is None else f" and {'<=' if high_inclusive else '<'} {high}"
        raise ValueError(f"{name}: expected {kind} {bound}, found {_excerpt(value)}")
    return int(value) if integer else float(value)


def _compact_json(value) -> str:
    """JSON the way the Needle prompt writes it: separators "," and ":", non-ASCII kept, key order kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class _JsonProblem(ValueError):
    """A JSON text holds something the data format refuses (raised by the decoder's hooks)."""


def _refuse_constant(name):
    raise _JsonProblem(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite_float(text):
    if len(text) > MAX_NUMBER_DIGITS:
        raise _JsonProblem(f"a number of {len(text)} characters (at most {MAX_NUMBER_DIGITS})")
    value = float(text)
    if math.isinf(value):
        raise _JsonProblem(f"the number {_excerpt(text)} overflows a float")
    return value


def _bounded_int(text):
    if len(text) > MAX_NUMBER_DIGITS:
        raise _JsonProblem(f"a number of {len(text)} digits (at most {MAX_NUMBER_DIGITS})")
    return int(text)


def _unique_keys(pairs):
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _JsonProblem(f"an object repeats the key {_excerpt(duplicate)}")
    return value


# The bounds are the tool-call parser's: a target beyond them could never be read back from the model.
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_float=_finite_float, parse_int=_bounded_int,
                            parse_constant=_refuse_constant)


def _decode_json(text: str, where: str) -> object:
    """One JSON value, strictly: unique keys, finite numbers of bounded length, bounded nesting."""
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as error:
        hint = "; a byte-order mark is only allowed at the start of the file" if text.startswith("\ufeff") else ""
        raise FinetuneDataError(f"{where}: not valid JSON ({error.msg} at column {error.colno}{hint})") from None
    except RecursionError:
        raise FinetuneDataError(f"{where}: JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    except _JsonProblem as error:
        raise FinetuneDataError(f"{where}: {error}") from None
    except ValueError as error:  # an int beyond Python's digit limit
        raise FinetuneDataError(f"{where}: an unreadable number ({error})") from None


def _check_value(value, where: str, field: str, depth: int = 0) -> None:
    """A JSON value: JSON types only, finite numbers, valid Unicode, at most MAX_JSON_DEPTH levels deep."""
    if depth > MAX_JSON_DEPTH:
        outer = field.split("[", 1)[0].split(".", 1)[0]
        raise FinetuneDataError(f"{where}: field '{outer}': nests deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise FinetuneDataError(f"{where}: field '{field}': text with a lone surrogate (not valid Unicode): "
                                    f"{_excerpt(value)}") from None
    elif isinstance(value, int):
        if abs(value) >= _INT_BOUND:
            raise FinetuneDataError(f"{where}: field '{field}': an integer of more than {MAX_NUMBER_DIGITS} digits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise FinetuneDataError(f"{where}: field '{field}': expected a finite number, found {value}")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise FinetuneDataError(f"{where}: field '{field}': expected string keys, found {_excerpt(key)}")
            _check_value(key, where, field, depth + 1)
            _check_value(item, where, f"{field}.{key}", depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_value(item, where, f"{field}[{index}]", depth + 1)
    else:
        raise FinetuneDataError(f"{where}: field '{field}': expected a JSON value, found {type(value).__name__}")


def _json_text(text: str, where: str, field: str, *, expected: str) -> object:
    """The value a field given as JSON text holds, checked like a value of the line itself."""
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as error:
        raise FinetuneDataError(
            f"{where}: field '{field}': a string that is not JSON ({error.msg} at column {error.colno}); expected {expected}"
        ) from None
    except (RecursionError, ValueError):
        value = _decode_json(text, f"{where}: field '{field}'")
    _check_value(value, where, field)
    return value


def _tool_schemas(tools, where: str) -> list:
    """The schema list of an example's ``tools`` (a list, or its JSON string), checked."""
    if isinstance(tools, str):
        tools = _json_text(tools, where, "tools", expected="a list of schema objects or its JSON text")
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise FinetuneDataError(f"{where}: field 'tools': expected a list of schema objects (or its JSON text), "
                                f"found {_excerpt(tools)}")
    for index, tool in enumerate(tools):
        if tool.get("type") == "function" and not isinstance(tool.get("function"), dict):
            raise FinetuneDataError(f"{where}: field 'tools[{index}]': an OpenAI wrapper needs a 'function' "
                                    f"schema object, found {_excerpt(tool.get('function'))}")
    return tools


def _tool_names(schemas: list, where: str) -> list:
    """The names of the offered tools, each checked: a non-empty string, unique in the example."""
    names = []
    for index, tool in enumerate(schemas):
        wrapped = tool.get("type") == "function" and isinstance(tool.get("function"), dict)
        schema, field = (tool["function"], f"tools[{index}].function") if wrapped else (tool, f"tools[{index}]")
        name = schema.get("name")
        if not isinstance(name, str) or not name:
            raise FinetuneDataError(f"{where}: field '{field}.name': expected a non-empty string, found {_excerpt(name)}")
        for key, expected in (("description", str), ("parameters", dict)):
            if key in schema and not isinstance(schema[key], expected):
                kind = "a string" if expected is str else "a JSON object"
                raise FinetuneDataError(f"{where}: field '{field}.{key}': expected {kind}, found {_excerpt(schema[key])}")
        if name in names:
            raise FinetuneDataError(f"{where}: field '{field}.name': the tool name {name!r} is offered twice")
        names.append(name)
    return names


def reference_tools_text(tools) -> str:
    """The tools block's text in the reference's prompt: a JSON string verbatim, anything else dumped compactly."""
    return tools if isinstance(tools, str) else _compact_json(tools)


def _target_text(answers: list, reasoning: str) -> str:
    """The assistant target as the chat template writes it (markers unescaped: the text the model learns)."""
    think = f"{THINK_START}\n{reasoning}\n{THINK_END}\n" if reasoning else ""
    return think + TOOL_CALL_START + _compact_json(answers) + TOOL_CALL_END + IM_END


def _check_example(example, where: str, *, offered_tools_only: bool = True) -> list:
    """Validate one reference example and return its answers list.

    Besides the field types, the target must read back through `parse_assistant_turn` as exactly
    these calls and this reasoning (a target the parser refuses would teach unparseable answers),
    and, with ``offered_tools_only``, every call must name one of the example's tools.
    """
    if not isinstance(example, dict):
        raise FinetuneDataError(f"{where}: expected a JSON object, found {type(example).__name__}")
    # Other fields are ignored, as the reference's reader ignores them (rows often carry an id or a
    # source); a misspelling of the answers' field is not, since it would train "no tool applies".
    misspelt = [key for key in example if key not in EXAMPLE_FIELDS and key.lower().rstrip("s") in _ANSWER_FIELD_STEMS]
    if misspelt:
        raise FinetuneDataError(f"{where}: unknown field {_excerpt(misspelt[0])}; expected 'answers' or 'function_calls'")
    if "answers" in example and "function_calls" in example:
        raise FinetuneDataError(f"{where}: fields 'answers' and 'function_calls' both given; expected one of them")
    for field, value in example.items():
        if field in EXAMPLE_FIELDS:
            _check_value(value, where, field)
    if not isinstance(example.get("query"), str):
        found = "nothing" if "query" not in example else _excerpt(example["query"])
        raise FinetuneDataError(f"{where}: field 'query': expected a string, found {found}")
    offered = _tool_names(_tool_schemas(example.get("tools", []), where), where)
    for field in ("system", "reasoning"):
        if example.get(field) is not None and not isinstance(example[field], str):
            raise FinetuneDataError(f"{where}: field '{field}': expected a string, found {_excerpt(example[field])}")
    field = "answers" if "answers" in example else "function_calls"
    answers = example.get(field, [])
    if isinstance(answers, str):  # the reference's reader takes the list's JSON text too
        answers = _json_text(answers, where, field, expected="a list of calls or its JSON text")
    if not isinstance(answers, list):
        raise FinetuneDataError(f"{where}: field '{field}': expected a list of calls, found {_excerpt(answers)}")
    for index, call in enumerate(answers):
        # The target is written {"name":...,"arguments":...}; another key or order would change its tokens.
        if not isinstance(call, dict) or list(call) != ["name", "arguments"]:
            raise FinetuneDataError(
                f"{where}: field '{field}[{index}]': expected {{\"name\": str, \"arguments\": {{...}}}} "
                f"(these two keys, in this order), found {call!r:.80}"
            )
        if not isinstance(call["name"], str) or not call["name"]:
            raise FinetuneDataError(f"{where}: field '{field}[{index}].name': expected a non-empty string, "
                                    f"found {_excerpt(call['name'])}")
        if not isinstance(call["arguments"], dict):
            raise FinetuneDataError(f"{where}: field '{field}[{index}].arguments': expected a JSON object, "
                                    f"found {_excerpt(call['arguments'])}")
        if offered_tools_only and call["name"] not in offered:
            raise FinetuneDataError(f"{where}: field '{field}[{index}].name': calls {call['name']!r}, which the "
                                    f"example does not offer (its tools: {_excerpt(offered)})")
    reasoning = (example.get("reasoning") or "").strip()
    if THINK_END in reasoning:
        raise FinetuneDataError(f"{where}: field 'reasoning': holds {THINK_END}, which would end the reasoning "
                                "block early; expected reasoning text without it")
    try:
        turn = parse_assistant_turn(_target_text(answers, reasoning))
    except ToolCallParseError as error:
        raise FinetuneDataError(f"{where}: field '{field}': the target would not parse back as tool calls ({error})") from None
    if turn.tool_calls != answers or (turn.reasoning or "") != reasoning:
        raise FinetuneDataError(f"{where}: fields '{field}'/'reasoning': the target parses back as other calls or "
                                f"reasoning (does the reasoning hold {THINK_END}?)")
    return answers


def example_to_conversation(example: dict, *, where: str = "example", offered_tools_only: bool = True) -> dict:
    """One reference example -> ``{"messages": [...], "tools": JSON string, "chat_template_kwargs":
    {"tools_text": str}}`` (see the module docstring).

    ``offered_tools_only=False`` admits calls of tools the example does not offer (wrong answers
    scored by the confidence head); training data keeps the default.
    """
    answers = _check_example(example, where, offered_tools_only=offered_tools_only)
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


def _lines(path: Path, data: bytes):
    """(number, text) of every non-blank line of a JSONL file's bytes, each strictly UTF-8."""
    if data.startswith(_BOM):  # some editors write one; it is no part of the first line
        data = data[len(_BOM):]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise FinetuneDataError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at byte column "
                                    f"{error.start + 1}); expected a UTF-8 JSONL file") from None
        if line.strip():
            yield number, line


def read_finetune_jsonl(path) -> list[dict]:
    """The examples of a Needle fine-tuning JSONL file, validated (blank lines and a leading BOM skipped)."""
    if not isinstance(path, (str, os.PathLike)):
        raise FinetuneDataError(f"path: expected a file path (str or os.PathLike), found {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        problem = "a folder, not a file" if path.is_dir() else "no such file"
        raise FinetuneDataError(f"{path}: {problem}; expected a fine-tuning JSONL file")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise FinetuneDataError(f"{path}: cannot be read ({error.strerror or error})") from None
    examples = []
    for number, line in _lines(path, data):
        where = f"{path}:{number}"
        example = _decode_json(line, where)
        _check_example(example, where)
        examples.append(example)
    if not examples:
        raise FinetuneDataError(f"{path}: no examples (the file holds no non-blank line)")
    return examples


def conversations_dataset(examples: Iterable[dict]):
    """A `datasets.Dataset` (columns ``messages``, ``tools``) of reference examples."""
    import datasets

    if isinstance(examples, (str, bytes, dict)) or not isinstance(examples, Iterable):
        raise FinetuneDataError(f"examples: expected an iterable of example dicts, found {type(examples).__name__}")
    rows = [example_to_conversation(example, where=f"example {index}") for index, example in enumerate(examples)]
    if not rows:
        raise FinetuneDataError("examples: no examples")
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
    from jinja2 import TemplateError

    if isinstance(tools, str):
        try:
            tools = _DECODER.decode(tools)
        except (RecursionError, ValueError) as error:
            raise FinetuneDataError(f"tools: expected a list of schema objects or its JSON text, found text that "
                                    f"is not JSON ({error})") from None
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        raise FinetuneDataError(f"messages: expected a list of message dicts, found {_excerpt(messages)}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise FinetuneDataError(f"chat_template_kwargs: expected a dict, found {type(chat_template_kwargs).__name__}")
    try:
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            **(chat_template_kwargs or {}),
        )
    except TemplateError as error:
        raise FinetuneDataError(f"messages: the chat template refuses this conversation ({error})") from None
    return list(encoded["input_ids"]), [int(value) for value in encoded["assistant_masks"]]


def tokenize_conversations(dataset, tokenizer, *, max_length: Optional[int] = None):
    """Add ``input_ids`` and ``labels`` (the ids, -100 outside the loss mask) to a conversations dataset.

    Rows longer than ``max_length`` are cut at the end, as the reference cuts at its ``max_len``.
    """
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length: expected a positive int or None, found {max_length!r}")
    missing = [name for name in ("messages", "tools") if name not in getattr(dataset, "column_names", ())]
    if missing:
        raise FinetuneDataError(f"dataset: expected the columns 'messages' and 'tools' (conversations_dataset), "
                                f"found {getattr(dataset, 'column_names', type(dataset).__name__)}")

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
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)) or pad_token_id < 0:
            raise ValueError(f"pad_token_id: expected a non-negative int, found {pad_token_id!r}")
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors: expected 'pt' or 'np', found {return_tensors!r}")
        if (isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, (int, np.integer))
                or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of: expected a positive int, found {pad_to_multiple_of!r}")
        self.pad_token_id = int(pad_token_id)
        self.return_tensors = return_tensors
        self.pad_to_multiple_of = int(pad_to_multiple_of)

    def __call__(self, rows: list[dict]) -> dict:
        return self.pad(self.checked_rows(rows))

    def checked_rows(self, rows: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each row's ``(input_ids, labels)`` as int64 arrays [T]; a bad row raises `FinetuneDataError` naming it."""
        if not rows:
            raise FinetuneDataError("rows: expected at least one row to collate, found none")
        checked = []
        for index, row in enumerate(rows):
            if not isinstance(row, dict) or "input_ids" not in row or "labels" not in row:
                raise FinetuneDataError(f"rows[{index}]: expected a dict with 'input_ids' and 'labels', "
                                        f"found {_excerpt(row)}")
            try:
                sizes = len(row["input_ids"]), len(row["labels"])
            except TypeError:
                raise FinetuneDataError(f"rows[{index}]: expected 'input_ids' and 'labels' as lists of ints, found "
                                        f"{type(row['input_ids']).__name__} and {type(row['labels']).__name__}") from None
            if sizes[0] != sizes[1]:
                raise FinetuneDataError(f"rows[{index}]: 'labels' has {len(row['labels'])} entries, expected one per "
                                        f"input id ({len(row['input_ids'])})")
            try:
                ids = np.empty(sizes[0], np.int64)
                labels = np.empty(sizes[1], np.int64)
                ids[:] = row["input_ids"]
                labels[:] = row["labels"]
            except (TypeError, ValueError, OverflowError) as error:
                raise FinetuneDataError(f"rows[{index}]: expected 'input_ids' and 'labels' as lists of ints ({error})") from None
            checked.append((ids, labels))
        return checked

    def pad(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> dict:
        """The batch of `checked_rows`' ``(input_ids, labels)`` pairs, padded on the right."""
        longest = max(len(ids) for ids, _ in rows)
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = np.full((len(rows), length), self.pad_token_id, np.int64)
        labels = np.full((len(rows), length), IGNORE_INDEX, np.int64)
        attention = np.zeros((len(rows), length), np.int64)
        for index, (row_ids, row_labels) in enumerate(rows):
            ids[index, : len(row_ids)] = row_ids
            labels[index, : len(row_ids)] = row_labels
            attention[index, : len(row_ids)] = 1
        batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
        if self.return_tensors == "np":
            return batch
        import torch

        return {name: torch.from_numpy(value) for name, value in batch.items()}
