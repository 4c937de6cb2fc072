"""The Needle prompt format as a Hugging Face chat template.

Needle is fine-tuned on one shape of conversation: an optional system turn, one user turn that
carries the tool schemas and the query, and one assistant turn that is a JSON list of tool calls,
optionally preceded by a reasoning block:

    <|im_start|>system\\n{system}<|im_end|>\\n                       (only when a system text is given)
    <|im_start|>user\\n<tools>{tools JSON}</tools>\\n{query}<|im_end|>\\n
    <|im_start|>assistant\\n                                        (end of the prompt)
    <think>\\n{reasoning}\\n</think>\\n                                (only when reasoning is given)
    <tool_call>{calls JSON}</tool_call><|im_end|>                  (the target)

JSON is compact (separators "," and ":") with non-ASCII characters kept as they are, key order
preserved. The system text and the reasoning are stripped of surrounding whitespace; the query
is used verbatim. With no tools the tools block is `<tools>[]</tools>`, as in the fine-tuning data.

Token-for-token parity with the reference. The reference encodes a training example as
`[BOS] + encode(prompt) + encode(target) + [EOS]`, two separate SentencePiece calls, so the
target starts with its own dummy-prefix piece "▁". The template therefore writes one space
between the prompt and the target (the tokenizer turns it into that "▁"), and writes the BOS
and EOS tokens itself because `apply_chat_template` tokenizes without adding special tokens.
The target, its leading space and the EOS sit inside `{% generation %}`, so
`return_assistant_tokens_mask=True` reproduces the reference's loss mask.

Message mapping (OpenAI / Hugging Face style to Needle):
  - `tools=[...]`: each entry is a bare schema `{"name", "description", "parameters"}` (what the
    Needle data holds) or an OpenAI wrapper `{"type": "function", "function": {...}}`, which is
    unwrapped to the inner schema. A `tools_text` string (a template keyword, as
    `needle_hf.finetune.data` passes it) is written as the tools block verbatim instead: the
    fine-tuning data's own spelling, which the reference trains on.
  - system message: optional, first only. user message: exactly one; its content is the query.
  - assistant message (optional, last): `tool_calls` as `[{"type": "function", "function":
    {"name", "arguments"}}]` (bare `{"name", "arguments"}` also accepted) becomes the list of
    `{"name", "arguments"}` answers; no `tool_calls` means the empty list (the "no tool applies"
    answer). `arguments` given as a dict is dumped compactly; given as a string it is inserted
    verbatim, so it must already be compact JSON. `reasoning_content` or `reasoning` fills the
    think block. Free-text `content` is rejected: Needle's answers are tool calls only.
  - Message content may be a string or a list of `{"type": "text", "text": ...}` parts.
  - Several turns: after an assistant turn the conversation continues with a user message (a
    follow-up query) or with `tool` messages (transformers' role for tool results). A run of
    consecutive `tool` messages becomes one user turn `<tool_result>[r1,r2,...]</tool_result>`:
    the JSON list of their contents (a string content is written as it is, any other value as
    compact JSON), which is what the reference's agent loop feeds back as the next user text.
    Earlier assistant turns render as the last one does, without the EOS; the tools block is
    written once, in the first user turn.
Anything else (a system turn later on, two user or assistant turns in a row, tool results with no
assistant turn before them) raises a template error naming the problem.
"""

#: The ten chat markers, in id order: the tokenizer gives them ids 4-13.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOLS_START = "<tools>"
TOOLS_END = "</tools>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"
CHAT_MARKERS = (
    IM_START, IM_END, THINK_START, THINK_END, TOOLS_START, TOOLS_END,
    TOOL_CALL_START, TOOL_CALL_END, TOOL_RESULT_START, TOOL_RESULT_END,
)
FIRST_CHAT_MARKER_ID = 4
#: The markers that only delimit turns and carry no answer text: hidden by `skip_special_tokens=True`.
TURN_MARKERS = (IM_START, IM_END)
#: What the template writes after a "<" of message text that would otherwise start a marker or a
#: special token's text (or that is followed by this character already); the tokenizer's normaliser
#: takes it out again after matching the markers, so message text is encoded as its own characters
#: and never as a control token. A Unicode noncharacter, reserved for such internal use.
MESSAGE_TEXT_ESCAPE = "\ufdd0"

# Written for transformers' chat-template environment (4.57 and 5.x): it provides a `tojson`
# filter that is Python's json.dumps (ensure_ascii=False by default) and accepts `separators`,
# plus `raise_exception` and the `{% generation %}` tag. The environment trims blocks, and every
# tag below also uses `-` so no template whitespace leaks into the prompt.
_TEMPLATE = r"""
{%- macro escaped(text) -%}
    {#- Message text never spells a marker: "<" + ESCAPE before each would-be marker (see MESSAGE_TEXT_ESCAPE). -#}
    {%- set esc = "@ESCAPE@" -%}
    {%- set literals = @MARKERS@ + [bos_token, eos_token, unk_token, pad_token] | select("string") | list -%}
    {%- set ns = namespace(text=(text | string) | replace("<" ~ esc, "<" ~ esc ~ esc)) -%}
    {%- for literal in literals if literal.startswith("<") -%}
        {%- set ns.text = ns.text | replace(literal, "<" ~ esc ~ literal[1:]) -%}
    {%- endfor -%}
    {{- ns.text -}}
{%- endmacro -%}

{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is none -%}
    {%- elif content is mapping or content is not iterable -%}
        {{- raise_exception("Message content must be a string or a list of text parts; got " ~ content ~ ".") -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part["type"] != "text" -%}
                {{- raise_exception("Needle reads text only; got a '" ~ part["type"] ~ "' content part.") -}}
            {%- endif -%}
            {{- part["text"] -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{%- macro tools_json(tools) -%}
    [
    {%- for tool in tools or [] -%}
        {%- if not loop.first %},{% endif -%}
        {%- if tool["type"] == "function" and tool["function"] is mapping -%}
            {{- tool["function"] | tojson(separators=(",", ":")) -}}
        {%- else -%}
            {{- tool | tojson(separators=(",", ":")) -}}
        {%- endif -%}
    {%- endfor -%}
    ]
{%- endmacro -%}

{%- macro calls_json(tool_calls) -%}
    [
    {%- for call in tool_calls or [] -%}
        {%- set function = call["function"] if call["function"] is mapping else call -%}
        {%- if function["name"] is not string -%}
            {{- raise_exception("Every tool call needs a string 'name'.") -}}
        {%- endif -%}
        {%- if not loop.first %},{% endif -%}
        {"name":{{ function["name"] | tojson }},"arguments":
        {%- if function["arguments"] is string -%}
            {{- function["arguments"] -}}
        {%- elif function["arguments"] is mapping -%}
            {{- function["arguments"] | tojson(separators=(",", ":")) -}}
        {%- else -%}
            {}
        {%- endif -%}
        }
    {%- endfor -%}
    ]
{%- endmacro -%}

{%- macro result_json(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {{- content | tojson(separators=(",", ":")) -}}
    {%- endif -%}
{%- endmacro -%}

{#- Checks first: the conversation shape the prompt format can express. -#}
{%- set state = namespace(system="", users=0, previous=none) -%}
{%- for message in messages -%}
    {%- set role = message["role"] -%}
    {%- if role == "system" -%}
        {%- if not loop.first -%}
            {{- raise_exception("Needle takes a system message only as the first message.") -}}
        {%- endif -%}
        {%- set state.system = text_of(message["content"]) | trim -%}
    {%- elif role == "user" -%}
        {%- if state.previous == "user" -%}
            {{- raise_exception("Needle takes one user message per turn; got two in a row (the second needs an assistant turn before it).") -}}
        {%- endif -%}
        {%- set state.users = state.users + 1 -%}
    {%- elif role == "assistant" -%}
        {%- if state.previous not in ["user", "tool"] -%}
            {{- raise_exception("Needle takes an assistant message only after the user message or tool results.") -}}
        {%- endif -%}
        {%- if text_of(message["content"]) | trim != "" -%}
            {{- raise_exception("Needle's assistant turn is tool calls only; use 'tool_calls', not 'content'.") -}}
        {%- endif -%}
    {%- elif role == "tool" -%}
        {%- if state.previous not in ["assistant", "tool"] -%}
            {{- raise_exception("Needle takes 'tool' messages only after an assistant turn with tool calls.") -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception("Needle has no '" ~ role ~ "' role; use system, user, assistant and tool.") -}}
    {%- endif -%}
    {%- set state.previous = role -%}
{%- endfor -%}
{%- if state.users == 0 -%}
    {{- raise_exception("Needle needs one user message (the query).") -}}
{%- endif -%}

{{- bos_token -}}
{%- if state.system -%}
    {{- "<|im_start|>system\n" + escaped(state.system) + "<|im_end|>\n" -}}
{%- endif -%}
{%- set tools_block = tools_text if tools_text is string else tools_json(tools) -%}
{%- set turn = namespace(tools_written=false, previous=none) -%}
{%- for message in messages -%}
    {%- set role = message["role"] -%}
    {%- if role == "user" or (role == "tool" and turn.previous != "tool") -%}
        {{- "<|im_start|>user\n" -}}
        {%- if not turn.tools_written -%}
            {{- "<tools>" + escaped(tools_block) + "</tools>\n" -}}
            {%- set turn.tools_written = true -%}
        {%- endif -%}
    {%- endif -%}
    {%- if role == "user" -%}
        {{- escaped(text_of(message["content"])) + "<|im_end|>\n" -}}
    {%- elif role == "tool" -%}
        {#- A run of tool messages is one user turn: the JSON list of their results (the reference's next user text). -#}
        {{- ("<tool_result>[" if turn.previous != "tool" else ",") + escaped(result_json(message["content"])) -}}
        {%- if loop.last or messages[loop.index0 + 1]["role"] != "tool" -%}
            {{- "]</tool_result><|im_end|>\n" -}}
        {%- endif -%}
    {%- elif role == "assistant" -%}
        {%- set reasoning = (message["reasoning_content"] or message["reasoning"] or "") | trim -%}
        {{- "<|im_start|>assistant\n" -}}
        {%- generation -%}
            {{- " " -}}
            {%- if reasoning -%}
                {{- "<think>\n" + escaped(reasoning) + "\n</think>\n" -}}
            {%- endif -%}
            {{- "<tool_call>" + escaped(calls_json(message["tool_calls"])) + "</tool_call><|im_end|>" -}}
            {%- if loop.last -%}
                {{- eos_token -}}
            {%- endif -%}
        {%- endgeneration -%}
        {%- if not loop.last -%}
            {{- "\n" -}}
        {%- endif -%}
    {%- endif -%}
    {%- set turn.previous = role -%}
{%- endfor -%}
{%- if add_generation_prompt and turn.previous != "assistant" -%}
    {{- "<|im_start|>assistant\n" -}}
{%- endif -%}
"""
NEEDLE_CHAT_TEMPLATE = _TEMPLATE.replace("@ESCAPE@", MESSAGE_TEXT_ESCAPE).replace(
    "@MARKERS@", "[" + ", ".join(f'"{marker}"' for marker in CHAT_MARKERS) + "]"
)
