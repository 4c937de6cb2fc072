"""Read the tool calls out of a generated Needle assistant turn.

Needle answers with an optional reasoning block and one JSON list of calls:

    <think>\\n{reasoning}\\n</think>\\n<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call><|im_end|>

The empty list means "no tool applies". Decode the generated ids with the markers kept
(`tokenizer.decode(ids, skip_special_tokens=True)` keeps them: they are not special tokens)
and pass the text here. Anything after `<|im_end|>` belongs to no turn and is ignored.
"""

import dataclasses
import json

from .chat_template import IM_END, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START

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


def parse_assistant_turn(text):
    """Parse a generated assistant turn into its reasoning and tool calls.

    Args:
        text: decoded generation, starting where the prompt (`...<|im_start|>assistant\\n`) ended.

    Returns:
        An `AssistantTurn`.

    Raises:
        ToolCallParseError: no `<tool_call>` block, an unclosed block, invalid JSON, a payload
            that is not a list of `{"name", "arguments"}` objects, or stray text around the block.
    """
    turn = text.split(IM_END, 1)[0].strip()
    reasoning, rest = _split_reasoning(turn)
    if not rest.startswith(TOOL_CALL_START):
        found = _excerpt(rest) if rest else "nothing"
        raise ToolCallParseError(f"expected the answer to start with {TOOL_CALL_START}, found {found}")
    end = rest.find(TOOL_CALL_END)
    if end < 0:
        raise ToolCallParseError(f"{TOOL_CALL_START} block is never closed with {TOOL_CALL_END} "
                                 f"(generation cut short?): {_excerpt(rest)}")
    trailing = rest[end + len(TOOL_CALL_END):].strip()
    if trailing:
        raise ToolCallParseError(f"unexpected text after {TOOL_CALL_END}: {_excerpt(trailing)}")
    payload = rest[len(TOOL_CALL_START):end]
    try:
        calls = json.loads(payload)
    except json.JSONDecodeError as error:
        raise ToolCallParseError(f"tool calls are not valid JSON ({error}): {_excerpt(payload)}") from error
    if not isinstance(calls, list):
        raise ToolCallParseError(f"tool calls must be a JSON list, got {type(calls).__name__}: {_excerpt(payload)}")
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
