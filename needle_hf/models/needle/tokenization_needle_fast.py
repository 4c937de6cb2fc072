"""`NeedleTokenizerFast`: the Needle fast tokenizer class, turn markers hidden by `skip_special_tokens`.

Needle's ten chat markers are added tokens that decode as text, because the tool-call parsers read
`<tool_call>`, `</tool_call>`, `<think>` and `</think>` out of the decoded answer. The two turn
markers, `<|im_start|>` and `<|im_end|>`, only delimit turns: an answer ends "...</tool_call><|im_end|>"
then EOS, and a chat answer (`pipeline("text-generation")`, `decode(..., skip_special_tokens=True)`)
should end where the turn ends, without the marker. `decode` with `skip_special_tokens=True` drops
them here, by id, besides the pad/eos/bos/unk tokens; with `skip_special_tokens=False` every id
decodes as written.

Why by id and not by flagging them `special` in tokenizer.json: the markers are matched after
normalisation (see `tokenization_needle.NeedleTokenizerConverter.normalizer`), and tokenizers 0.23
looks a decoded token's special flag up by its normalised spelling (" <|im_end|>"), which is not
the spelling it stored, so the flag works under tokenizers 0.22 (transformers 4.57) and not under
0.23 (transformers 5.x). Filtering the ids before the library decodes gives both the same text.

Saved folders name this class (`tokenizer_class` and `auto_map` in tokenizer_config.json, with this
file and `chat_template.py` beside it): `AutoTokenizer` loads it with needle_hf installed, or with
`trust_remote_code=True` without it. This file imports only transformers and `chat_template`, so
it runs from a saved folder.
"""

from transformers import PreTrainedTokenizerFast

from .chat_template import IM_END, IM_START

#: The markers `decode(..., skip_special_tokens=True)` hides: they delimit turns and carry no answer text.
TURN_MARKERS = (IM_START, IM_END)


class NeedleTokenizerFast(PreTrainedTokenizerFast):
    """A `PreTrainedTokenizerFast` whose `skip_special_tokens=True` decoding also drops the turn markers.

    Encoding, the vocabulary, the chat template and `skip_special_tokens=False` decoding are those
    of the plain fast tokenizer built by `tokenization_needle.build_fast_tokenizer`.
    """

    # Written into tokenizer_config.json's `auto_map` by `save_pretrained`, which also copies this file.
    _auto_class = "AutoTokenizer"

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
