"""vLLM reasoning parser ``needle``: a Needle answer's `<think>` block as `reasoning_content`.

A Needle answer opens with an optional reasoning block, then the calls (see `needle_hf.tools.tool_calls`):

    <think>\\n{reasoning}\\n</think>\\n<tool_call>[...]</tool_call><|im_end|>

Unlike models that always think, Needle thinks only when its answer *starts* with `<think>`; an answer
that starts with `<tool_call>` has no reasoning at all, and all of it goes to the tool-call parser
(vLLM's base `<think>` parser would file such an answer under reasoning). Served with

    vllm serve ./needle2-hf --enable-auto-tool-choice --tool-call-parser needle --reasoning-parser needle

the reply's `reasoning_content` is the block's text, stripped of the newlines the template writes
around it, exactly `parse_assistant_turn(...).reasoning`; the text after `</think>` is left for the
tool-call parser. Streaming gives the same pieces: the reasoning phase ends at `</think>`, or at the
first generated token that is not whitespace when that token is not `<think>`.
"""

from collections.abc import Iterable, Sequence

from vllm.reasoning.basic_parsers import BaseThinkingReasoningParser

from ...models.needle.chat_template import THINK_END, THINK_START


class NeedleReasoningParser(BaseThinkingReasoningParser):
    """`<think>...</think>` at the start of the answer is reasoning; an answer without it has none."""

    @property
    def start_token(self) -> str:
        return THINK_START

    @property
    def end_token(self) -> str:
        return THINK_END

    def _first_word_id(self, token_ids: Sequence[int]):
        """The first id of `token_ids` whose text is not whitespace (the answer's dummy-prefix "▁" is), or None."""
        for token_id in token_ids:
            if self.model_tokenizer.decode([token_id]).strip():
                return token_id
        return None

    def _answer_thinks(self, token_ids: Sequence[int]) -> bool | None:
        """Whether the answer opens with `<think>`; None while only whitespace has been generated."""
        first = self._first_word_id(token_ids)
        return None if first is None else first == self.start_token_id

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        """`input_ids` are the ids generated so far (the delta included)."""
        thinks = self._answer_thinks(input_ids)
        if thinks is None:
            return False
        return not thinks or self.end_token_id in delta_ids

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self._answer_thinks(input_ids) is False:
            return list(input_ids)
        return super().extract_content_ids(input_ids)

    def extract_reasoning(self, model_output: str, request) -> tuple[str | None, str | None]:
        """(reasoning, content): the `<think>` block's text, stripped, and what follows it, or (None, output)."""
        stripped = model_output.lstrip()
        if not stripped.startswith(THINK_START):
            return None, model_output
        body = stripped[len(THINK_START):]
        if THINK_END not in body:  # cut short while thinking
            return body.strip(), None
        reasoning, _, content = body.partition(THINK_END)
        return reasoning.strip(), content.lstrip("\n") or None
