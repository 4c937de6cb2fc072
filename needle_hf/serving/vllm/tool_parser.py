"""vLLM tool-call parser ``needle`` (``--enable-auto-tool-choice --tool-call-parser needle``).

Needle answers a tool-calling prompt with an optional ``<think>`` block and one JSON list of calls,
``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``. `needle_hf.tools.tool_calls.ToolCallStream`
is the one reader of that format; this parser only maps what it settles onto vLLM's OpenAI protocol
objects, so the streaming and the non-streaming answers are the same for every output and every way
vLLM cuts it into deltas.

Streaming: text that cannot be (or grow into) a tool-call turn streams as content as soon as that is
known; a tool-call turn is held back, and its calls are sent whole (name and complete JSON arguments)
in one delta once the turn is known to end after ``</tool_call>``: at ``<|im_end|>`` or when vLLM
finishes the stream (``finish_streaming``, which vLLM calls for parsers that set
``engine_based_streaming``; deltas then carry only the new text). An empty list (``[]``, "no tool
applies") yields neither calls nor content. With ``tool_choice="none"`` the output is content as is.

``tool_choice="required"`` and a named tool (``{"type": "function", "function": {"name": ...}}``) are
answered in Needle's own format, not vLLM's bare JSON list: `adjust_request` sets the request's
structured output to the grammar of `needle_hf.generation.grammar` (``<tool_call>``, a list of at least
one call of the offered tools, or exactly one call of the named tool, ``</tool_call><|im_end|>``),
which vLLM's llguidance backend (``guidance``) enforces, and the answer is read by this parser as any
other (``supports_required_and_named = False``).
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
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.abstract_tool_parser import ToolParser

from ...generation.grammar import ToolGrammarError, marker_ids, tool_calls_lark
from ...tools.tool_calls import ToolCallStream, TurnDelta


def _arguments_json(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def _tools_off(request) -> bool:
    return getattr(request, "tool_choice", None) == "none"


def _named_tool(request) -> str | None:
    """The function name of a named ``tool_choice`` (None for "auto", "required", "none")."""
    choice = request.tool_choice
    return None if isinstance(choice, str) or choice is None else choice.function.name


def forced_tool_call_grammar(tokenizer, request) -> str | None:
    """The grammar a ``required`` or named ``tool_choice`` forces (llguidance Lark), else None.

    required: one or more calls of the offered tools (at most one if ``parallel_tool_calls`` is false);
    named: exactly one call of that tool.

    Raises:
        VLLMValidationError: a tool whose parameters schema the grammar cannot enforce (the tool and
            keyword named), which the server answers with HTTP 400.
    """
    named = _named_tool(request)
    if not request.tools or (request.tool_choice != "required" and named is None):
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    if named is not None:
        tools = [tool for tool in tools if tool["function"]["name"] == named]
    single = named is not None or request.parallel_tool_calls is False
    try:
        return tool_calls_lark(marker_ids(tokenizer), tools, allow_empty=False, max_calls=1 if single else None)
    except ToolGrammarError as error:
        raise VLLMValidationError(f"tool_choice={request.tool_choice!r}: {error}", parameter="tools") from error


class NeedleToolParser(ToolParser):
    """Turns Needle's ``<tool_call>[...]</tool_call>`` answers into OpenAI ``tool_calls``."""

    # vLLM then calls `finish_streaming` at the end of every stream: a turn's end is only known there.
    engine_based_streaming = True
    # required / named tool_choice: Needle's format through `adjust_request`, read by this parser.
    supports_required_and_named = False

    def __init__(self, tokenizer, tools=None):
        super().__init__(tokenizer, tools)
        self._stream = ToolCallStream()

    def adjust_request(self, request):
        """For ``tool_choice="required"`` or a named tool: constrain the answer to Needle's tool-call turn.

        Chat Completions requests only; vLLM's Responses API is left as it comes (its required or named
        choice is then read by this parser without a grammar).
        """
        if not isinstance(request, ChatCompletionRequest):
            return request
        grammar = forced_tool_call_grammar(self.model_tokenizer, request)
        if grammar is not None:
            request.structured_outputs = StructuredOutputsParams(grammar=grammar)
            request.response_format = None
            # With a reasoning parser, vLLM starts a grammar after the reasoning phase, which Needle's parser
            # ends on the answer's first token, left unconstrained. The grammar covers the whole answer (no
            # <think> block): vLLM 0.32's mark of a parser-made grammar has it constrain from the first token.
            request._grammar_from_parser = True
        return request

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        """The calls of a complete answer; an answer that is not a tool-call turn is returned as content."""
        if _tools_off(request):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        stream = ToolCallStream()
        content = stream.feed(model_output).content + stream.finish().content
        if stream.turn is None:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=content)
        tool_calls = [
            ToolCall(type="function", function=FunctionCall(name=call["name"], arguments=_arguments_json(call["arguments"])))
            for call in stream.turn.tool_calls
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
        """Reads ``delta_text`` only: vLLM passes the accumulated text or not depending on its parsers."""
        if _tools_off(request):
            return DeltaMessage(content=delta_text) if delta_text else None
        return self._message(self._stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        """The stream ended: what was held back (the calls of a turn that ended, or content)."""
        return self._message(self._stream.finish())

    def _message(self, delta: TurnDelta) -> DeltaMessage | None:
        tool_calls = []
        if delta.turn is not None:
            for index, call in enumerate(delta.turn.tool_calls):
                arguments = _arguments_json(call["arguments"])
                self.prev_tool_call_arr.append({"name": call["name"], "arguments": call["arguments"]})
                self.streamed_args_for_tool.append(arguments)
                tool_calls.append(
                    DeltaToolCall(
                        index=index,
                        type="function",
                        id=make_tool_call_id(),
                        function=DeltaFunctionCall(name=call["name"], arguments=arguments).model_dump(exclude_none=True),
                    )
                )
            self.current_tool_id = len(tool_calls) - 1
        if not delta.content and not tool_calls:
            return None
        return DeltaMessage(content=delta.content or None, tool_calls=tool_calls)
