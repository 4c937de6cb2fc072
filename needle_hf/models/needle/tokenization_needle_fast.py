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

A folder whose only tokenizer file is the SentencePiece `tokenizer.model` (how the reference ships
its tokenizer) loads too: `AutoTokenizer` maps a Needle config to this class, which builds the fast
tokenizer from that file with `build_fast_tokenizer`'s settings (transformers'
own SentencePiece conversion does not know Needle's pieces and markers).
"""

from transformers import PreTrainedTokenizerFast

from .chat_template import TURN_MARKERS
from .response_template import RESPONSE_TEMPLATE


class NeedleTokenizerFast(PreTrainedTokenizerFast):
    """A `PreTrainedTokenizerFast` whose `skip_special_tokens=True` decoding also drops the turn markers.

    Encoding, the vocabulary, the chat template and `skip_special_tokens=False` decoding are those
    of the plain fast tokenizer built by `tokenization_needle.build_fast_tokenizer`.
    """

    vocab_files_names = {"vocab_file": "tokenizer.model", "tokenizer_file": "tokenizer.json"}

    def __init__(self, vocab_file=None, tokenizer_file=None, tokenizer_object=None, **kwargs):
        """Load from ``tokenizer_file`` or ``tokenizer_object``; with neither, build from the SentencePiece
        ``vocab_file`` (explicit keyword arguments override the built tokenizer's settings)."""
        built = tokenizer_object is None and tokenizer_file is None and vocab_file is not None
        if built:
            from .sentencepiece_needle import sentencepiece_tokenizer_settings

            tokenizer_object, settings = sentencepiece_tokenizer_settings(vocab_file)
            kwargs = {**settings, **{key: value for key, value in kwargs.items() if value is not None}}
        super().__init__(tokenizer_object=tokenizer_object, tokenizer_file=tokenizer_file, **kwargs)
        self.vocab_file = vocab_file
        if built:
            self.response_template = RESPONSE_TEMPLATE

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        """transformers 5.x: the files go to `__init__` as they are (tokenizer.json loads as written, a lone
        tokenizer.model is built there); 5.x's own conversion would rebuild the backend from the vocabulary."""
        return dict(kwargs)

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
