"""Read the tool calls out of a generated Needle assistant turn.

Needle answers with an optional reasoning block and one JSON list of calls:

    <think>\\n{reasoning}\\n</think>\\n<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call><|im_end|>

The empty list means "no tool applies". Decode the generated ids with the markers kept
(`tokenizer.decode(ids, skip_special_tokens=True)` keeps `<think>` and `<tool_call>`, which are
not special tokens, and drops only the turn markers and EOS) and pass the text here; a pipeline's
chat answer is such a text. Anything after `<|im_end|>` belongs to no turn and is ignored.
"""

import dataclasses
import json

from ..models.needle.chat_template import IM_END, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START

_EXCERPT_CHARS = 60


class ToolCallParseError(ValueError):
    """The generated text is not a well-formed Needle tool-call turn."""


@dataclasses.dataclass(frozen=True)
class AssistantTurn:
    """A parsed assistant turn.

    Attributes:
        tool_calls: the calls, each `{"name": str, "arguments": dict}`, in generation order.
        reasoning: the text of the `<think>` block, stripped, or None when there is none.
    """

    tool_calls: list
    reasoning: str | None = None


def _excerpt(text):
    return repr(text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS] + "...")


def _split_reasoning(text):
    """Return (reasoning or None, rest) for text that may open with a <think> block."""
    if not text.startswith(THINK_START):
        return None, text
    end = text.find(THINK_END)
    if end < 0:
        raise ToolCallParseError(f"{THINK_START} block is never closed with {THINK_END}: {_excerpt(text)}")
    reasoning = text[len(THINK_START):end].strip()
    return reasoning, text[end + len(THINK_END):].lstrip()


def _checked_call(index, call):
    if not isinstance(call, dict):
        raise ToolCallParseError(f"tool call {index}: expected a JSON object, got {type(call).__name__}: {call!r}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallParseError(f"tool call {index}: missing a non-empty string 'name': {call!r}")
    arguments = call.get("arguments", {})
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolCallParseError(
            f"tool call {index} ({name}): 'arguments' must be a JSON object, got {type(arguments).__name__}")
    return {"name": name, "arguments": arguments}


# Bounds on the JSON of a turn: deeper than any tool call nests, longer numbers than any argument needs.
MAX_JSON_DEPTH = 64
MAX_NUMBER_DIGITS = 400


def _refuse_constant(name):
    raise ToolCallParseError(f"tool calls hold {name}, which is not a JSON number")


def _finite_float(text):
    if len(text) > MAX_NUMBER_DIGITS:
        raise ToolCallParseError(f"tool calls hold a number of {len(text)} characters (at most {MAX_NUMBER_DIGITS})")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ToolCallParseError(f"tool calls hold the number {_excerpt(text)}, which overflows a float")
    return value


def _bounded_int(text):
    if len(text) > MAX_NUMBER_DIGITS:
        raise ToolCallParseError(f"tool calls hold a number of {len(text)} digits (at most {MAX_NUMBER_DIGITS})")
    return int(text)


_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_int=_bounded_int, parse_constant=_refuse_constant)


def _check_values(value, depth=0):
    """Bounded depth, and text that is valid Unicode (no lone surrogates, which UTF-8 cannot hold)."""
    if depth > MAX_JSON_DEPTH:
        raise ToolCallParseError(f"tool calls nest deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ToolCallParseError(f"tool calls hold text with a lone surrogate: {_excerpt(value)}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_values(key, depth + 1)
            _check_values(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_values(item, depth + 1)


def _decode_calls(text, start):
    """(calls, end): the JSON value at `text[start:]`; text after it (a marker too) is the caller's."""
    while start < len(text) and text[start] in " \t\n\r":
        start += 1
    try:
        calls, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as error:
        raise ToolCallParseError(f"tool calls are not valid JSON ({error}): {_excerpt(text[start:])}") from None
    except RecursionError:
        raise ToolCallParseError(f"tool calls nest deeper than {MAX_JSON_DEPTH} levels") from None
    except ToolCallParseError:
        raise
    except ValueError as error:  # an int beyond Python's digit limit
        raise ToolCallParseError(f"tool calls hold an unreadable number ({error})") from None
    _check_values(calls)
    return calls, end


def parse_assistant_turn(text):
    """Parse a generated assistant turn into its reasoning and tool calls.

    The calls' JSON is read as JSON, so argument strings may hold any text, markers included; the
    block ends at the `</tool_call>` after the JSON value. Numbers must be finite (no NaN,
    Infinity or 1e999) and at most 400 characters long, nesting at most 64 levels deep.

    Args:
        text: decoded generation, starting where the prompt (`...<|im_start|>assistant\\n`) ended.

    Returns:
        An `AssistantTurn`.

    Raises:
        ToolCallParseError: text that is not a `str`, no `<tool_call>` block, an unclosed block,
            invalid JSON, a payload that is not a list of `{"name", "arguments"}` objects, or stray
            text around the block.
    """
    if not isinstance(text, str):
        raise ToolCallParseError(f"expected the generated text as a str, got {type(text).__name__}")
    reasoning, rest = _split_reasoning(text.strip())
    if not rest.startswith(TOOL_CALL_START):
        found = _excerpt(rest.split(IM_END, 1)[0]) if rest.split(IM_END, 1)[0] else "nothing"
        raise ToolCallParseError(f"expected the answer to start with {TOOL_CALL_START}, found {found}")
    if TOOL_CALL_END not in rest:
        raise ToolCallParseError(f"{TOOL_CALL_START} block is never closed with {TOOL_CALL_END} "
                                 f"(generation cut short?): {_excerpt(rest)}")
    calls, end = _decode_calls(rest, len(TOOL_CALL_START))
    after = rest[end:].lstrip()
    if not after.startswith(TOOL_CALL_END):
        raise ToolCallParseError(f"expected {TOOL_CALL_END} after the tool calls' JSON, found {_excerpt(after)}")
    trailing = after[len(TOOL_CALL_END):].split(IM_END, 1)[0].strip()
    if trailing:
        raise ToolCallParseError(f"unexpected text after {TOOL_CALL_END}: {_excerpt(trailing)}")
    if not isinstance(calls, list):
        raise ToolCallParseError(f"tool calls must be a JSON list, got {type(calls).__name__}: {_excerpt(rest[:end])}")
    return AssistantTurn(tool_calls=[_checked_call(index, call) for index, call in enumerate(calls)],
                         reasoning=reasoning)


def parse_tool_calls(text):
    """Return the tool calls of a generated turn as `[{"name": str, "arguments": dict}, ...]`.

    See `parse_assistant_turn` for the accepted format and the errors raised.
    """
    return parse_assistant_turn(text).tool_calls


def to_openai_tool_calls(calls):
    """Wrap `[{"name", "arguments"}]` as OpenAI / Hugging Face chat `tool_calls` entries."""
    return [{"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in calls]
