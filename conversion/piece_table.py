"""The SentencePiece piece table behind a saved Needle `tokenizer.json`.

A `.cact` embeds the tokenizer as SentencePiece's piece table: piece, score and type per id.
`tokenizer.json` (as `tokenization_needle.build_fast_tokenizer` writes it) keeps the pieces, their
ids, the special and user-defined tokens, byte fallback, the dummy prefix and the BPE merges, but
not the scores. The merges are the scores' ranking, though, and SentencePiece's BPE trainer scores
its normal pieces -0, -1, -2, ... in id order. So the table is rebuilt with those scores, and
accepted only if it reproduces the file's merges exactly (then it also tokenizes identically);
otherwise the caller must supply the original `tokenizer.model`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from needle_hf.models.needle.tokenization_needle import SPACE_SYMBOL, NeedleTokenizerConverter, PieceTable, PieceType

_BYTE_PIECE = re.compile(r"^<0x[0-9A-F]{2}>$")


class PieceTableError(ValueError):
    """A tokenizer.json whose SentencePiece piece table cannot be recovered; the message says why."""


def _merge_pair(entry) -> tuple[str, str]:
    # tokenizers writes merges as [left, right] pairs; older files as "left right" strings.
    if isinstance(entry, str):
        left, _, right = entry.partition(" ")
        return left, right
    return tuple(entry)


def piece_table_from_tokenizer_json(path) -> PieceTable:
    """Rebuild the piece table of a Needle `tokenizer.json` (see the module docstring)."""
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec["model"]
        vocab, merges, added = model["vocab"], model["merges"], spec.get("added_tokens", [])
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise PieceTableError(f"{path}: not a tokenizers file with a BPE model ({type(error).__name__}: {error})") from None
    if model.get("type") != "BPE":
        raise PieceTableError(f"{path}: model type {model.get('type')!r}, expected 'BPE' (Needle's SentencePiece BPE)")
    pieces = [None] * len(vocab)
    for piece, index in vocab.items():
        if not 0 <= index < len(vocab) or pieces[index] is not None:
            raise PieceTableError(f"{path}: vocabulary ids are not 0..{len(vocab) - 1}, each once (id {index})")
        pieces[index] = piece
    # Needle's tokenizer.json declares the control pieces (pad, eos, bos) matched in raw text
    # (`normalized: false`) and the chat markers matched after normalisation, some of them flagged
    # special too (the turn markers, hidden by skip_special_tokens): normalisation tells them apart.
    special = {token["id"] for token in added if token.get("special") and not token.get("normalized")}
    user_defined = {token["id"] for token in added if token["id"] not in special}
    unk = vocab.get(model.get("unk_token"))
    byte_fallback = bool(model.get("byte_fallback"))
    types = []
    for index, piece in enumerate(pieces):
        if index == unk:
            types.append(PieceType.UNKNOWN)
        elif index in special:
            types.append(PieceType.CONTROL)
        elif index in user_defined:
            types.append(PieceType.USER_DEFINED)
        elif byte_fallback and _BYTE_PIECE.match(piece):
            types.append(PieceType.BYTE)
        else:
            types.append(PieceType.NORMAL)
    scores, rank = [], 0
    for kind in types:
        if kind == PieceType.NORMAL:
            scores.append(-float(rank))  # the first is -0.0, as SentencePiece writes it
            rank += 1
        else:
            scores.append(0.0)
    normalizers = (spec.get("normalizer") or {}).get("normalizers") or [spec.get("normalizer") or {}]
    dummy = any(step.get("type") == "Prepend" and step.get("prepend") == SPACE_SYMBOL for step in normalizers)
    table = PieceTable(pieces=tuple(pieces), scores=tuple(scores), types=tuple(types),
                       add_dummy_prefix=dummy, byte_fallback=byte_fallback)
    if NeedleTokenizerConverter(table).merges() != [_merge_pair(entry) for entry in merges]:
        raise PieceTableError(
            f"{path}: its BPE merges are not in SentencePiece-trainer order, so the piece scores a .cact needs "
            "cannot be recovered from it; pass the original tokenizer.model with --tokenizer")
    return table
