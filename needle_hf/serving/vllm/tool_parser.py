"""vLLM tool-call parser ``needle`` (``--enable-auto-tool-choice --tool-call-parser needle``).

Needle answers a tool-calling prompt with an optional ``<think>`` block and one JSON list of calls,
``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``; `needle_hf.tools.tool_calls` reads
that format, and this parser only maps its result onto vLLM's OpenAI protocol objects.

Streaming: text that cannot be the start of a Needle tool-call turn streams as content as it
arrives. A tool-call turn is held back until its ``</tool_call>`` arrives, then every call is sent
whole (name and the complete JSON arguments) in one delta: the list is parsed by the same function
as in the non-streaming path, so both paths return the same calls. An empty list (``[]``, "no tool
applies") yields no tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from ...models.needle.chat_template import IM_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START
from ...tools.tool_calls import ToolCallParseError, parse_assistant_turn

# A Needle tool-call turn opens with one of these (after leading whitespace).
TURN_OPENINGS = (THINK_START, TOOL_CALL_START)


def _arguments_json(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def _may_open_tool_turn(text: str) -> bool:
    """Whether ``text`` (stripped of leading whitespace) is, or may grow into, a tool-call turn."""
    head = text.lstrip()
    return any(head.startswith(opening) or opening.startswith(head) for opening in TURN_OPENINGS)


class NeedleToolParser(ToolParser):
    """Turns Needle's ``<tool_call>[...]</tool_call>`` answers into OpenAI ``tool_calls``."""

    def __init__(self, tokenizer, tools=None):
        super().__init__(tokenizer, tools)
        self._sent_content_chars = 0
        self._calls_sent = False

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        """The calls of a complete answer; an answer that is not a tool-call turn is returned as content."""
        try:
            turn = parse_assistant_turn(model_output)
        except ToolCallParseError:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        tool_calls = [
            ToolCall(type="function", function=FunctionCall(name=call["name"], arguments=_arguments_json(call["arguments"])))
            for call in turn.tool_calls
        ]
        return ExtractedToolCallInformation(tools_called=bool(tool_calls), tool_calls=tool_calls, content=None)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request,
    ) -> DeltaMessage | None:
        if self._calls_sent:
            return None
        turn = current_text.split(IM_END, 1)[0]
        if not _may_open_tool_turn(turn):
            return self._content_delta(turn)
        if TOOL_CALL_END not in turn:
            return None  # a tool-call turn still being generated
        # What follows the list (the end-of-turn marker, possibly still partial) belongs to no call.
        closed = turn[: turn.index(TOOL_CALL_END) + len(TOOL_CALL_END)]
        try:
            calls = parse_assistant_turn(closed).tool_calls
        except ToolCallParseError:
            return self._content_delta(turn)
        self._calls_sent = True
        deltas = []
        for index, call in enumerate(calls):
            arguments = _arguments_json(call["arguments"])
            self.prev_tool_call_arr.append({"name": call["name"], "arguments": call["arguments"]})
            self.streamed_args_for_tool.append(arguments)
            deltas.append(
                DeltaToolCall(
                    index=index,
                    type="function",
                    id=make_tool_call_id(),
                    function=DeltaFunctionCall(name=call["name"], arguments=arguments).model_dump(exclude_none=True),
                )
            )
        self.current_tool_id = len(calls) - 1
        return DeltaMessage(tool_calls=deltas) if deltas else None

    def _content_delta(self, text: str) -> DeltaMessage | None:
        """The part of ``text`` not streamed yet, as content."""
        new = text[self._sent_content_chars :]
        self._sent_content_chars = len(text)
        return DeltaMessage(content=new) if new else None
