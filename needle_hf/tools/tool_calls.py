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
import re

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


# Bounds on the JSON of a turn: deeper than any tool call nests, longer integers than any argument needs
# (int() of a long digit string takes quadratic time).
MAX_JSON_DEPTH = 64
MAX_NUMBER_DIGITS = 400


def _refuse_constant(name):
    raise ToolCallParseError(f"tool calls hold {name}, which is not a JSON number")


def _finite_float(text):
    # Any length: float() reads long digit strings in linear time, and the grammar
    # (`needle_hf.generation.grammar`) bounds a number's magnitude, not its fraction digits.
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


# JSON's own whitespace: what may stand between <tool_call> and the calls' list.
_JSON_SPACE = " \t\n\r"
# Inside the calls' JSON: the characters that open or close a string or a container, and the
# "<" that may start <|im_end|>; inside a string, the quote and the escape.
_VALUE_STOP = re.compile(r'["\[\]{}<]')
_STRING_STOP = re.compile(r'["\\]')

_LEAD, _THINK, _AFTER_THINK, _CALLS_OPEN, _CALLS, _AFTER_CALLS, _TRAILER, _CONTENT, _DONE = range(9)


@dataclasses.dataclass(frozen=True)
class TurnDelta:
    """What one `ToolCallStream.feed` or `finish` settles.

    Attributes:
        content: text now known to be plain content (not a tool-call turn), "" when none.
        turn: the complete tool-call turn, given once, when its end is known; else None.
    """

    content: str = ""
    turn: AssistantTurn | None = None


def _held_marker_prefix(text, marker):
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class ToolCallStream:
    """Reads a Needle turn as it is generated; the only parser of the format (`parse_assistant_turn`
    is this stream fed the whole text, then finished).

    A turn is either a tool-call turn (optional ``<think>`` block, then ``<tool_call>``, a JSON list of
    calls, ``</tool_call>``, then nothing but whitespace up to ``<|im_end|>`` or the end) or plain
    content. The turn ends at the first ``<|im_end|>`` that is not inside a JSON string of the calls;
    the content is the text before it, verbatim (the marker and what follows belong to no turn).

    Whatever way the text is cut into pieces, the pieces' `TurnDelta`s add up to the same result:
    text is held back while it may still become a tool-call turn (or a split ``<|im_end|>``) and given
    out as content once it cannot; the calls come whole, once the turn is known to end after
    ``</tool_call>`` (at ``<|im_end|>`` or at `finish`).

    Attributes:
        turn: the `AssistantTurn` once the text is known to be a complete tool-call turn, else None.
        error: once the text is known to be content, why it is not a tool-call turn, else None.
    """

    def __init__(self):
        self._text = ""
        self._pos = 0  # where the next phase reads from
        self._phase = _LEAD
        self._scan = 0  # a marker search restarts here (no marker starts between the phase start and it)
        self._reasoning = None
        self._value_start = 0
        self._depth = 0
        self._in_string = False
        self._calls = None
        self._turn_end = None
        self._sent = 0
        self._turn_sent = False
        self._finished = False
        self.turn = None
        self.error = None

    def feed(self, text: str) -> TurnDelta:
        """Append generated text; returns what it settles."""
        if not isinstance(text, str):
            raise ToolCallParseError(f"expected the generated text as a str, got {type(text).__name__}")
        if self._finished:
            raise ToolCallParseError("the turn was already finished; start a new ToolCallStream")
        self._text += text
        return self._settle(final=False)

    def finish(self) -> TurnDelta:
        """The generation ended: settle everything held back."""
        if self._finished:
            return TurnDelta()
        self._finished = True
        return self._settle(final=True)

    # --- the phases: each returns True when it moved on, False when it needs more text -----------

    def _settle(self, *, final):
        steps = {_LEAD: self._lead, _THINK: self._think, _AFTER_THINK: self._after_think,
                 _CALLS_OPEN: self._calls_open, _CALLS: self._calls_body, _AFTER_CALLS: self._after_calls,
                 _TRAILER: self._trailer}
        while self._phase in steps and steps[self._phase](final):
            pass
        content = self._content(final) if self._phase == _CONTENT else ""
        turn = None
        if self.turn is not None and not self._turn_sent:
            self._turn_sent, turn = True, self.turn
        return TurnDelta(content=content, turn=turn)

    def _skip_space(self, chars=None):
        text, pos = self._text, self._pos
        while pos < len(text) and (text[pos] in chars if chars else text[pos].isspace()):
            pos += 1
        self._pos = pos

    def _rest(self):
        return self._text[self._pos:]

    def _found(self):
        rest = self._rest().split(IM_END, 1)[0]
        return _excerpt(rest) if rest else "nothing"

    def _not_a_turn(self, error):
        self.error = error
        self._phase = _CONTENT
        self._scan = self._pos
        return True

    def _lead(self, final):
        self._skip_space()
        rest = self._rest()
        if rest.startswith(THINK_START):
            self._pos += len(THINK_START)
            self._phase, self._scan = _THINK, self._pos
            return True
        if rest.startswith(TOOL_CALL_START):
            self._pos += len(TOOL_CALL_START)
            self._phase = _CALLS_OPEN
            return True
        if not final and (THINK_START.startswith(rest) or TOOL_CALL_START.startswith(rest)):
            return False
        return self._not_a_turn(f"expected the answer to start with {TOOL_CALL_START}, found {self._found()}")

    def _think(self, final):
        text = self._text
        end = text.find(THINK_END, self._scan)
        stop = text.find(IM_END, self._scan)
        if end >= 0 and (stop < 0 or end < stop):
            self._reasoning = text[self._pos:end].strip()
            self._pos = end + len(THINK_END)
            self._phase = _AFTER_THINK
            return True
        if stop < 0 and not final:
            self._scan = max(self._scan, len(text) - len(IM_END) + 1)
            return False
        unclosed = text[self._pos - len(THINK_START):stop if stop >= 0 else len(text)]
        return self._not_a_turn(f"{THINK_START} block is never closed with {THINK_END}: {_excerpt(unclosed)}")

    def _after_think(self, final):
        self._skip_space()
        rest = self._rest()
        if rest.startswith(TOOL_CALL_START):
            self._pos += len(TOOL_CALL_START)
            self._phase = _CALLS_OPEN
            return True
        if not final and TOOL_CALL_START.startswith(rest):
            return False
        return self._not_a_turn(f"expected the answer to start with {TOOL_CALL_START}, found {self._found()}")

    def _unclosed(self):
        return self._not_a_turn(f"{TOOL_CALL_START} block is never closed with {TOOL_CALL_END} "
                                f"(generation cut short?): {_excerpt(self._text[self._value_start:self._pos])}")

    def _calls_open(self, final):
        self._skip_space(_JSON_SPACE)
        self._value_start = self._pos
        rest = self._rest()
        if not rest:
            return self._unclosed() if final else False
        if rest[0] in "[{":
            self._phase, self._depth, self._in_string = _CALLS, 0, False
            return True
        return self._not_a_turn(f"tool calls must be a JSON list, found {self._found()}")

    def _calls_body(self, final):
        """Follows strings and brackets of the calls' JSON to the end of the value (checked by the decoder)."""
        text, pos = self._text, self._pos
        while pos < len(text):
            if self._in_string:
                match = _STRING_STOP.search(text, pos)
                if match is None:
                    pos = len(text)
                    break
                pos = match.start()
                if text[pos] == "\\":
                    if pos + 1 == len(text):
                        break  # the escaped character has not arrived
                    pos += 2
                    continue
                self._in_string = False
                pos += 1
                continue
            match = _VALUE_STOP.search(text, pos)
            if match is None:
                pos = len(text)
                break
            pos, char = match.start(), match.group()
            if char == '"':
                self._in_string = True
                pos += 1
            elif char in "[{":
                self._depth += 1
                pos += 1
            elif char in "]}":
                self._depth -= 1
                pos += 1
                if self._depth == 0:
                    self._pos = pos
                    return self._decode()
            elif text.startswith(IM_END, pos):  # the turn ends inside the calls
                self._pos = pos
                return self._unfinished_calls()
            elif IM_END.startswith(text[pos:]) and not final:
                break  # maybe a split <|im_end|>
            else:
                pos += 1
        self._pos = pos
        return self._unfinished_calls() if final else False

    def _unfinished_calls(self):
        body = self._text[self._value_start:self._pos]
        if TOOL_CALL_END in body:
            try:
                _decode_calls(body, 0)
            except ToolCallParseError as error:
                return self._not_a_turn(str(error))
        return self._unclosed()

    def _decode(self):
        body = self._text[self._value_start:self._pos]
        try:
            calls, _ = _decode_calls(body, 0)  # the value ends where the brackets balance
            if not isinstance(calls, list):
                raise ToolCallParseError(f"tool calls must be a JSON list, got {type(calls).__name__}: {_excerpt(body)}")
            self._calls = [_checked_call(index, call) for index, call in enumerate(calls)]
        except ToolCallParseError as error:
            return self._not_a_turn(str(error))
        self._phase = _AFTER_CALLS
        return True

    def _after_calls(self, final):
        self._skip_space()
        rest = self._rest()
        if rest.startswith(TOOL_CALL_END):
            self._pos += len(TOOL_CALL_END)
            self._phase = _TRAILER
            return True
        if not final and TOOL_CALL_END.startswith(rest):
            return False
        if not rest:
            return self._unclosed()
        return self._not_a_turn(f"expected {TOOL_CALL_END} after the tool calls' JSON, found {self._found()}")

    def _trailer(self, final):
        self._skip_space()
        rest = self._rest()
        if rest.startswith(IM_END) or (final and not rest):
            self.turn = AssistantTurn(tool_calls=self._calls, reasoning=self._reasoning)
            self._phase = _DONE
            return True
        if not final and IM_END.startswith(rest):
            return False
        return self._not_a_turn(f"unexpected text after {TOOL_CALL_END}: {self._found()}")

    def _content(self, final):
        """The content not given out yet: the turn's text up to <|im_end|>, less a possibly split marker."""
        text = self._text
        if self._turn_end is None:
            found = text.find(IM_END, self._scan)
            if found >= 0:
                self._turn_end = found
            else:
                self._scan = max(self._scan, len(text) - len(IM_END) + 1)
        if self._turn_end is not None:
            limit = self._turn_end
        else:
            limit = len(text) if final else len(text) - _held_marker_prefix(text, IM_END)
        new = text[self._sent:limit]
        self._sent = max(self._sent, limit)
        return new


def parse_assistant_turn(text):
    """Parse a generated assistant turn into its reasoning and tool calls.

    The calls' JSON is read as JSON, so argument strings may hold any text, markers included; the
    block ends at the `</tool_call>` after the JSON value, and the turn at the `<|im_end|>` after it
    (or at the end of the text). Numbers must be finite (no NaN, Infinity or 1e999), integers at most
    400 digits long, nesting at most 64 levels deep. This is `ToolCallStream` fed the whole text.

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
    stream = ToolCallStream()
    stream.feed(text)
    stream.finish()
    if stream.turn is None:
        raise ToolCallParseError(stream.error)
    return stream.turn


def parse_tool_calls(text):
    """Return the tool calls of a generated turn as `[{"name": str, "arguments": dict}, ...]`.

    See `parse_assistant_turn` for the accepted format and the errors raised.
    """
    return parse_assistant_turn(text).tool_calls


def to_openai_tool_calls(calls):
    """Wrap `[{"name", "arguments"}]` as OpenAI / Hugging Face chat `tool_calls` entries."""
    return [{"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in calls]
