"""Needle's answer format as a transformers `response_template` (transformers 5.13+, vLLM's `hf` parsers).

A Needle assistant turn is an optional reasoning block and one JSON list of calls (see `tool_calls`):

    <think>\\n{reasoning}\\n</think>\\n<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call><|im_end|></s>

`RESPONSE_TEMPLATE` declares that shape in transformers' declarative format, so that
`tokenizer.parse_response(...)`, `pipeline("text-generation")` on chat input and vLLM's
`--tool-call-parser hf --reasoning-parser hf` return the assistant message
`{"role": "assistant", "thinking": str, "tool_calls": [{"type": "function", "function": {"name",
"arguments"}}]}` ("thinking" absent without a `<think>` block, "tool_calls" absent for the empty
list, "content" only for text outside both blocks). The reasoning field is named `thinking`, the
one name vLLM's `hf` reasoning parser and transformers' chat templates both read.

The template is written into tokenizer_config.json by `tokenization_needle.save_fast_tokenizer`
(transformers 4.57 ignores it; 5.13+ loads it as `tokenizer.response_template`). On well-formed
turns it gives the calls `tool_calls.parse_tool_calls` gives; malformed turns are where they differ:
the template never raises, `parse_tool_calls` names the fault.
"""

import re

from .chat_template import IM_END, IM_START, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START

# The prompt ends with this; parsing starts after its last occurrence in the prompt.
ASSISTANT_TURN_START = f"{IM_START}assistant\n"
# The tokenizer's EOS and pad texts: a generation decoded with special tokens kept ends "<|im_end|></s>",
# followed in a batch by the pads of rows that finished early.
_EOS_TEXT = "</s>"
_PAD_TEXT = "<pad>"


#: The declarative response template (format version 1 of transformers' `chat_parsing`).
RESPONSE_TEMPLATE = {
    "version": 1,
    "defaults": {"role": "assistant"},
    "start_anchor": ASSISTANT_TURN_START,
    "fields": {
        # The template writes "<think>\n{reasoning}\n</think>\n": the newlines inside are layout.
        "thinking": {
            "open_pattern": rf"\s*{re.escape(THINK_START)}\s*",
            "close_pattern": rf"\s*{re.escape(THINK_END)}",
            "content": "text",
        },
        # One JSON list per block; each element {"name", "arguments"} becomes an OpenAI-style call.
        # The block closes at the "</tool_call>" that follows the list's "]" and ends the turn, so an
        # argument string that spells "</tool_call>" stays inside the JSON.
        "tool_calls": {
            "open_pattern": rf"\s*{re.escape(TOOL_CALL_START)}",
            "close_pattern": (rf"(?<=\])\s*{re.escape(TOOL_CALL_END)}"
                              rf"(?=\s*(?:{re.escape(IM_END)}|{re.escape(_EOS_TEXT)}|\Z))"),
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
            "transform_each": True,
        },
        # Text outside both blocks (none in a well-formed turn); the turn ends at <|im_end|> or EOS,
        # and the end markers and pads after it are no text.
        "content": {
            "close_pattern": rf"(?:\s*(?:{re.escape(IM_END)}|{re.escape(_EOS_TEXT)}|{re.escape(_PAD_TEXT)}))+",
            "content": "text",
        },
    },
}
