"""The Needle vocabulary as a `tokenizers.Tokenizer`: the piece table and its conversion.

Needle uses a SentencePiece BPE model: pad 0, eos 1, bos 2, unk 3, the ten chat markers as
user-defined symbols (ids 4-13), byte fallback, identity normalisation, extra whitespace kept and
a dummy-prefix space. This module rebuilds it as a `tokenizers.Tokenizer` that gives the same ids
as `sentencepiece`, with the settings of the fast tokenizer around it
(`sentencepiece_tokenizer_settings`); `tokenization_needle.build_fast_tokenizer` and
`NeedleTokenizerFast` (from a lone `tokenizer.model`) wrap it.

The source is either a SentencePiece `.model` file or the piece table stored in a reference
`.cact` export (pieces, scores and piece types). Both go through one `PieceTable`.

How SentencePiece's behaviour maps onto the `tokenizers` pipeline:
  - Normaliser: spaces become "▁" and, with the dummy prefix, one "▁" is prepended. Nothing is
    collapsed or stripped (remove_extra_whitespaces=False) and no Unicode normalisation runs.
  - Chat markers: added tokens matched *after* normalisation (`normalized=True`), so the dummy
    prefix lands in front of the whole text even when it starts with a marker ("▁" then
    "<|im_start|>"), as SentencePiece's user-defined symbols do. Like user-defined symbols they are
    text, so `decode(..., skip_special_tokens=True)` keeps them (the tool-call parser needs them),
    except the turn markers `<|im_start|>` and `<|im_end|>`, flagged special (which hides them under
    tokenizers 0.22) and dropped by id in `NeedleTokenizerFast` (which hides them under 0.23 too;
    see `tokenization_needle_fast`). One difference remains: a text that is exactly one
    marker and nothing else encodes as that marker alone, without SentencePiece's leading "▁"
    (see `NeedleTokenizerConverter.normalizer`).
  - pad/eos/bos/unk are the special tokens. As in every transformers SentencePiece tokenizer,
    their literal text ("<s>", "</s>", ...) inside an input is read as the token (the chat
    template relies on it to write BOS and EOS); pass `split_special_tokens=True` to encode such
    text the way SentencePiece does.
  - Message text in the chat template never becomes a marker or a special token: the template
    escapes it and the normaliser undoes the escape after matching (see `normalizer`); the ids of
    marker-free text are SentencePiece's.
  - No pre-tokeniser: SentencePiece runs BPE over each stretch between markers as a whole.
  - BPE: the model's vocabulary, with merges derived from the piece scores. SentencePiece merges,
    at each step, the adjacent pair whose concatenation is the highest-scoring normal piece;
    ranking every (left, right) split of every normal piece by that piece's score reproduces it.
    Byte fallback maps characters outside the vocabulary to their UTF-8 byte pieces.
  - Post-processor: BOS in front of a single text (the reference encodes `[BOS] + ids`). A pair
    (prompt, target) becomes `[BOS] + prompt + target + [EOS]`, the reference's training layout.
  - Decoder: "▁" back to spaces, byte pieces back to bytes, and the dummy-prefix space removed.
"""

import collections
import dataclasses
import enum
import os
import re
from collections.abc import Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors

from .chat_template import CHAT_MARKERS, FIRST_CHAT_MARKER_ID, MESSAGE_TEXT_ESCAPE, NEEDLE_CHAT_TEMPLATE, TURN_MARKERS

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
SPACE_SYMBOL = "\u2581"  # "▁", SentencePiece's escaped space
# A raw space: no normalised text holds one, so "<marker>" written by the template (matched as
# " <marker>") can never be spelled by message text.
MARKER_MATCH_PREFIX = " "
NUM_BYTE_PIECES = 256


class PieceType(enum.IntEnum):
    """Piece types, numbered as in the reference `.cact` tokenizer table."""

    NORMAL = 0
    UNKNOWN = 1
    CONTROL = 2
    USER_DEFINED = 3
    BYTE = 4


# SentencePiece's ModelProto numbers the same types differently (UNUSED has no counterpart).
_PROTO_PIECE_TYPES = {1: PieceType.NORMAL, 2: PieceType.UNKNOWN, 3: PieceType.CONTROL,
                      4: PieceType.USER_DEFINED, 6: PieceType.BYTE}
_PROTO_UNUSED_TYPE = 5
_PROTO_BPE_MODEL_TYPE = 2


class TokenizerSourceError(ValueError):
    """A tokenizer source (a `.model` file or a piece table) that Needle's tokenizer cannot be."""


class TokenizerVocabMismatchError(ValueError):
    """The tokenizer's vocabulary size differs from the model's."""


def _byte_piece(value):
    return f"<0x{value:02X}>"


@dataclasses.dataclass(frozen=True)
class PieceTable:
    """A SentencePiece BPE vocabulary: one (piece, score, type) per id, plus the special ids.

    Attributes:
        pieces: the piece strings, indexed by id ("▁" stands for a space).
        scores: merge priority of each piece (higher merges first); only normal pieces use it.
        types: a `PieceType` per piece.
        pad_id, eos_id, bos_id, unk_id: ids of the special pieces.
        add_dummy_prefix: whether a "▁" is prepended to every encoded text.
        byte_fallback: whether characters outside the vocabulary become UTF-8 byte pieces.
    """

    pieces: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[PieceType, ...]
    pad_id: int = PAD_ID
    eos_id: int = EOS_ID
    bos_id: int = BOS_ID
    unk_id: int = UNK_ID
    add_dummy_prefix: bool = True
    byte_fallback: bool = True

    def __post_init__(self):
        self._validate()

    @classmethod
    def from_mapping(cls, table):
        """Build from a parsed reference `.cact` tokenizer table.

        Args:
            table: a mapping with "pieces", "scores", "types" (ints 0-4, see `PieceType`),
                "pad_id", "eos_id", "bos_id", "unk_id", "add_dummy_prefix", "byte_fallback".
        """
        required = ("pieces", "scores", "types", "pad_id", "eos_id", "bos_id", "unk_id",
                    "add_dummy_prefix", "byte_fallback")
        missing = [key for key in required if key not in table]
        if missing:
            raise TokenizerSourceError(f"tokenizer piece table: missing keys {missing}; expected {list(required)}")
        try:
            types = tuple(PieceType(int(value)) for value in table["types"])
        except ValueError as error:
            raise TokenizerSourceError(f"tokenizer piece table: {error}; piece types are 0-4") from error
        return cls(
            pieces=tuple(str(piece) for piece in table["pieces"]),
            scores=tuple(float(score) for score in table["scores"]),
            types=types,
            pad_id=int(table["pad_id"]),
            eos_id=int(table["eos_id"]),
            bos_id=int(table["bos_id"]),
            unk_id=int(table["unk_id"]),
            add_dummy_prefix=bool(table["add_dummy_prefix"]),
            byte_fallback=bool(table["byte_fallback"]),
        )

    @classmethod
    def from_sentencepiece(cls, model_path):
        """Read a SentencePiece `.model` file, refusing settings this converter does not reproduce."""
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        with open(model_path, "rb") as handle:
            proto.ParseFromString(handle.read())
        trainer, normalizer = proto.trainer_spec, proto.normalizer_spec

        def require(condition, problem):
            if not condition:
                raise TokenizerSourceError(f"{model_path}: {problem}")

        require(trainer.model_type == _PROTO_BPE_MODEL_TYPE,
                f"expected a BPE model, found model_type {trainer.model_type}")
        require(not normalizer.precompiled_charsmap,
                f"expected identity normalisation, found the '{normalizer.name}' rule with a charsmap")
        require(not normalizer.remove_extra_whitespaces,
                "expected remove_extra_whitespaces=False (Needle keeps runs of spaces)")
        require(normalizer.escape_whitespaces, "expected escape_whitespaces=True (spaces as '▁')")
        require(not trainer.treat_whitespace_as_suffix, "expected '▁' as a prefix, not a suffix")
        types = []
        for index, piece in enumerate(proto.pieces):
            require(piece.type != _PROTO_UNUSED_TYPE, f"piece {index} {piece.piece!r} is UNUSED, not supported")
            require(piece.type in _PROTO_PIECE_TYPES, f"piece {index} {piece.piece!r} has unknown type {piece.type}")
            types.append(_PROTO_PIECE_TYPES[piece.type])
        return cls(
            pieces=tuple(piece.piece for piece in proto.pieces),
            scores=tuple(piece.score for piece in proto.pieces),
            types=tuple(types),
            pad_id=trainer.pad_id,
            eos_id=trainer.eos_id,
            bos_id=trainer.bos_id,
            unk_id=trainer.unk_id,
            add_dummy_prefix=normalizer.add_dummy_prefix,
            byte_fallback=trainer.byte_fallback,
        )

    def _validate(self):
        size = len(self.pieces)
        if not (len(self.scores) == len(self.types) == size):
            raise TokenizerSourceError(
                f"tokenizer piece table: {size} pieces, {len(self.scores)} scores, {len(self.types)} types; "
                "expected one of each per id")
        duplicates = sorted(piece for piece, count in collections.Counter(self.pieces).items() if count > 1)
        if duplicates:
            raise TokenizerSourceError(f"tokenizer piece table: duplicated pieces {duplicates[:5]}")
        expected_specials = {"pad_id": (self.pad_id, PAD_ID, PieceType.CONTROL),
                             "eos_id": (self.eos_id, EOS_ID, PieceType.CONTROL),
                             "bos_id": (self.bos_id, BOS_ID, PieceType.CONTROL),
                             "unk_id": (self.unk_id, UNK_ID, PieceType.UNKNOWN)}
        for name, (found, expected, piece_type) in expected_specials.items():
            if found != expected:
                raise TokenizerSourceError(f"tokenizer piece table: {name} is {found}, Needle expects {expected}")
            if found >= size or self.types[found] != piece_type:
                raise TokenizerSourceError(
                    f"tokenizer piece table: id {found} ({name}) should be a {piece_type.name} piece")
        markers = self.pieces[FIRST_CHAT_MARKER_ID:FIRST_CHAT_MARKER_ID + len(CHAT_MARKERS)]
        marker_types = self.types[FIRST_CHAT_MARKER_ID:FIRST_CHAT_MARKER_ID + len(CHAT_MARKERS)]
        if markers != CHAT_MARKERS or any(kind != PieceType.USER_DEFINED for kind in marker_types):
            raise TokenizerSourceError(
                f"tokenizer piece table: ids {FIRST_CHAT_MARKER_ID}-{FIRST_CHAT_MARKER_ID + len(CHAT_MARKERS) - 1} "
                f"should be the user-defined chat markers {list(CHAT_MARKERS)}, found {list(markers)}")
        if self.byte_fallback:
            byte_pieces = {piece for piece, kind in zip(self.pieces, self.types) if kind == PieceType.BYTE}
            missing = [_byte_piece(value) for value in range(NUM_BYTE_PIECES) if _byte_piece(value) not in byte_pieces]
            if missing:
                raise TokenizerSourceError(
                    f"tokenizer piece table: byte_fallback is on but {len(missing)} byte pieces are missing "
                    f"(first {missing[0]})")
        if SPACE_SYMBOL not in self.pieces:
            raise TokenizerSourceError(f"tokenizer piece table: the space piece {SPACE_SYMBOL!r} is missing")


class NeedleTokenizerConverter:
    """Turns a `PieceTable` into a `tokenizers.Tokenizer` with SentencePiece's exact behaviour.

    Mirrors transformers' `SpmConverter` layout (vocab, normaliser, decoder, post-processor),
    but works from a piece table rather than a slow tokenizer, and keeps what that converter
    loses for Needle: runs of spaces, byte fallback and the dummy prefix before a leading marker.
    """

    def __init__(self, table: PieceTable):
        self.table = table

    def vocab(self):
        return {piece: index for index, piece in enumerate(self.table.pieces)}

    def merges(self):
        """Every (left, right) split of a normal piece whose halves are normal pieces, best first.

        SentencePiece can merge any adjacent pair whose concatenation is a normal piece, choosing
        the highest-scoring result; ties go to the lower id, which is the training order.
        """
        normal = {piece for piece, kind in zip(self.table.pieces, self.table.types) if kind == PieceType.NORMAL}
        ranked = sorted((index for index, kind in enumerate(self.table.types) if kind == PieceType.NORMAL),
                        key=lambda index: (-self.table.scores[index], index))
        merges = []
        for index in ranked:
            piece = self.table.pieces[index]
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    merges.append((left, right))
        return merges

    def model(self):
        return models.BPE(
            vocab=self.vocab(),
            merges=self.merges(),
            unk_token=self.table.pieces[self.table.unk_id],
            fuse_unk=True,
            byte_fallback=self.table.byte_fallback,
        )

    def user_defined_pieces(self):
        return [piece for piece, kind in zip(self.table.pieces, self.table.types) if kind == PieceType.USER_DEFINED]

    def normalizer(self):
        """Escape spaces as "▁", prepend the dummy-prefix "▁", and tell template markers from message text.

        `tokenizers` normalises the text of `normalized=True` added tokens with this same
        normaliser before matching them, so the prefix must not reach a marker's own text: a "▁"
        that stands in front of nothing but one marker is removed. (Hence a text that *is*
        exactly one marker encodes as just that marker, where SentencePiece would emit "▁"
        first; every longer text gets SentencePiece's ids.)

        Message text cannot produce a marker (see `chat_template.MESSAGE_TEXT_ESCAPE`): each marker
        in the text is matched in the form " <marker>", with a raw space that no normalised text
        holds (spaces are "▁" by then), and only the raw markers get it. The chat template writes
        "<" + ESCAPE where message text has a "<" that starts a marker or a special token's text, or
        is followed by ESCAPE already; the last step takes one ESCAPE out after each such "<", so the
        message text is tokenized as exactly its own characters, as ordinary text.
        """
        escape_spaces = normalizers.Replace(" ", SPACE_SYMBOL)
        steps = []
        if self.table.add_dummy_prefix:
            lone_marker = "|".join(re.escape(piece) for piece in self.user_defined_pieces())
            # Oniguruma (Ruby syntax): \A and \z anchor the whole string; ^ and $ would match at lines.
            prefix_before_lone_marker = Regex(rf"\A{SPACE_SYMBOL}(?=(?:{lone_marker})\z)")
            steps += [normalizers.Prepend(SPACE_SYMBOL), escape_spaces,
                      normalizers.Replace(prefix_before_lone_marker, "")]
        else:
            steps.append(escape_spaces)
        steps += [normalizers.Replace(piece, MARKER_MATCH_PREFIX + piece) for piece in self.user_defined_pieces()]
        tails = "|".join(re.escape(text[1:]) for text in self.escaped_texts())
        steps.append(normalizers.Replace(Regex(f"<{MESSAGE_TEXT_ESCAPE}(?={MESSAGE_TEXT_ESCAPE}|{tails})"), "<"))
        return normalizers.Sequence(steps)

    def escaped_texts(self):
        """The texts message text must not spell: the markers and the special tokens' literals."""
        specials = [self.table.pieces[i] for i in (self.table.pad_id, self.table.eos_id, self.table.bos_id, self.table.unk_id)]
        texts = self.user_defined_pieces() + specials
        bad = [text for text in texts if not text.startswith("<")]
        if bad:
            raise TokenizerSourceError(f"tokenizer piece table: markers and special tokens must start with '<', got {bad}")
        return texts

    def decoder(self):
        # tokenizers >= 0.23 hands a matched marker to the decoder in its normalised form " <marker>".
        steps = [decoders.Replace(MARKER_MATCH_PREFIX + "<", "<"), decoders.Replace(SPACE_SYMBOL, " "), decoders.ByteFallback(), decoders.Fuse()]
        if self.table.add_dummy_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        return decoders.Sequence(steps)

    def post_processor(self):
        bos = self.table.pieces[self.table.bos_id]
        eos = self.table.pieces[self.table.eos_id]
        return processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 $B:1 {eos}:1",
            special_tokens=[(bos, self.table.bos_id), (eos, self.table.eos_id)],
        )

    def special_tokens(self):
        """pad, eos, bos and unk: matched in raw text before normalisation, hidden by skip_special_tokens."""
        ids = (self.table.pad_id, self.table.eos_id, self.table.bos_id, self.table.unk_id)
        return [AddedToken(self.table.pieces[index], normalized=False, special=True) for index in ids]

    def user_defined_tokens(self):
        """The chat markers: matched after normalisation, decoded as text; the turn markers flagged special."""
        return [AddedToken(piece, normalized=True, special=piece in TURN_MARKERS) for piece in self.user_defined_pieces()]

    def converted(self) -> Tokenizer:
        tokenizer = Tokenizer(self.model())
        tokenizer.normalizer = self.normalizer()
        tokenizer.decoder = self.decoder()
        tokenizer.post_processor = self.post_processor()
        tokenizer.add_special_tokens(self.special_tokens())
        tokenizer.add_tokens(self.user_defined_tokens())
        return tokenizer


def _as_piece_table(source):
    if isinstance(source, PieceTable):
        return source
    if isinstance(source, Mapping):
        return PieceTable.from_mapping(source)
    if isinstance(source, (str, os.PathLike)):
        return PieceTable.from_sentencepiece(os.fspath(source))
    raise TypeError(
        f"tokenizer source: expected a SentencePiece .model path, a PieceTable or a piece-table mapping, "
        f"got {type(source).__name__}")


def _check_prompt_target_boundary(table):
    """Refuse a vocabulary on which the chat template could not reproduce the reference's ids.

    The reference encodes prompt and target separately; the template joins them with a space,
    i.e. "...assistant\n" + "▁" + "<think>" or "<tool_call>". That equals the two separate
    encodings only if BPE cannot merge the "▁" into the prompt's final "\n", which holds unless
    some normal piece ends in "\n▁" (never, when SentencePiece splits pieces at whitespace).
    """
    crossing = [piece for piece, kind in zip(table.pieces, table.types)
                if kind == PieceType.NORMAL and piece.endswith("\n" + SPACE_SYMBOL)]
    if crossing:
        raise TokenizerSourceError(
            f"tokenizer piece table: normal pieces {crossing[:5]} end in a newline followed by '▁', so "
            "the chat template's prompt/target boundary would not tokenize like the reference")


def sentencepiece_tokenizer_settings(source, *, chat_template=NEEDLE_CHAT_TEMPLATE):
    """(the `tokenizers.Tokenizer`, the fast tokenizer's keyword settings) built from a Needle vocabulary.

    Args:
        source: as `build_fast_tokenizer`'s.
        chat_template: as `build_fast_tokenizer`'s.
    """
    table = _as_piece_table(source)
    if chat_template == NEEDLE_CHAT_TEMPLATE:
        _check_prompt_target_boundary(table)
    settings = dict(
        bos_token=table.pieces[table.bos_id],
        eos_token=table.pieces[table.eos_id],
        unk_token=table.pieces[table.unk_id],
        pad_token=table.pieces[table.pad_id],
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        # Needle takes no token type ids (generate(**inputs) would refuse them), and batched
        # generation with a decoder-only model wants the padding on the left.
        model_input_names=["input_ids", "attention_mask"],
        padding_side="left",
    )
    return NeedleTokenizerConverter(table).converted(), settings
