"""`NeedleTokenizerFast`: the Needle fast tokenizer, turn markers hidden by `skip_special_tokens` on every tokenizers.

Needle's ten chat markers are added tokens that decode as text, because the tool-call parsers read
`<tool_call>`, `</tool_call>`, `<think>` and `</think>` out of the decoded answer. The two turn
markers, `<|im_start|>` and `<|im_end|>`, only delimit turns: an answer ends "...</tool_call><|im_end|>"
then EOS, and a chat answer (`pipeline("text-generation")`, `decode(..., skip_special_tokens=True)`)
should end where the turn ends, without the marker. `decode` with `skip_special_tokens=True` drops
them here, by id, besides the pad/eos/bos/unk tokens; with `skip_special_tokens=False` every id
decodes as written.

The turn markers are also flagged `special` in tokenizer.json, which is enough under tokenizers 0.22
(transformers 4.57): a plain `PreTrainedTokenizerFast` hides them too. Under tokenizers 0.23
(transformers 5.x) the flag does not take: the markers are matched after normalisation (see
`tokenization_needle.NeedleTokenizerConverter.normalizer`), 0.23 reports a normalised added token
by its normalised spelling (" <|im_end|>") and looks the special flag up by that spelling, which is
not the one it stored. No declaration fixes that without giving up the normalised match the
dummy prefix and the message-text escape need, so this class filters the ids before the library
decodes; on 5.x the `response_template` (see `response_template`) parses the answer whatever the
decode keeps.

Saved folders name the plain `PreTrainedTokenizerFast` (no remote code for tools that only
tokenize); load this class with `NeedleTokenizerFast.from_pretrained(folder)` after importing needle_hf.
"""

from transformers import PreTrainedTokenizerFast

from .chat_template import TURN_MARKERS


class NeedleTokenizerFast(PreTrainedTokenizerFast):
    """A `PreTrainedTokenizerFast` whose `skip_special_tokens=True` decoding also drops the turn markers.

    Encoding, the vocabulary, the chat template and `skip_special_tokens=False` decoding are those
    of the plain fast tokenizer built by `tokenization_needle.build_fast_tokenizer`.
    """

    def turn_marker_ids(self) -> frozenset:
        """The ids of `TURN_MARKERS` in this vocabulary (those it has)."""
        ids = self.convert_tokens_to_ids(list(TURN_MARKERS))
        return frozenset(token_id for token_id in ids if token_id is not None and token_id != self.unk_token_id)

    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        """Decode `token_ids` (an int or a list of ints); `skip_special_tokens` also drops the turn markers."""
        if skip_special_tokens:
            ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
            hidden = self.turn_marker_ids()
            token_ids = [token_id for token_id in ids if token_id not in hidden]
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
