"""The Needle 3 tokenizer: Needle 2's SentencePiece conversion with Needle 3's 16 chat markers.

Needle 3 keeps Needle 2's SentencePiece BPE (pad 0, eos 1, bos 2, unk 3, byte fallback, identity
normalisation, dummy prefix) and its prompt format, and adds six user-defined markers after Needle 2's
ten: ids 4-19 are the 16 markers below. The fast tokenizer is Needle 2's converter (which treats every
user-defined piece as a marker); the chat template is Needle 2's, escaping all 16 markers where they
appear in message text.
"""

from __future__ import annotations

from ..needle.chat_template import _TEMPLATE, CHAT_MARKERS, FIRST_CHAT_MARKER_ID, MESSAGE_TEXT_ESCAPE
from ..needle.tokenization_needle import (
    PieceType,
    TokenizerSourceError,
    _as_piece_table,
    _check_prompt_target_boundary,
    build_fast_tokenizer,
)

# Needle 2's ten markers (ids 4-13), then Needle 3's context, extract and schema pairs (ids 14-19).
NEEDLE3_CHAT_MARKERS = (
    *CHAT_MARKERS,
    "<context>", "</context>", "<extract>", "</extract>", "<schema>", "</schema>",
)
NEEDLE3_CHAT_TEMPLATE = _TEMPLATE.replace("@ESCAPE@", MESSAGE_TEXT_ESCAPE).replace(
    "@MARKERS@", "[" + ", ".join(f'"{marker}"' for marker in NEEDLE3_CHAT_MARKERS) + "]"
)


def build_needle3_tokenizer(source, *, model_max_length=None):
    """A `NeedleTokenizerFast` for a Needle 3 SentencePiece model (path or piece table).

    Raises `TokenizerSourceError` naming the ids when ids 4-19 are not the 16 user-defined markers.
    """
    table = _as_piece_table(source)
    last = FIRST_CHAT_MARKER_ID + len(NEEDLE3_CHAT_MARKERS)
    markers = tuple(table.pieces[FIRST_CHAT_MARKER_ID:last])
    kinds = table.types[FIRST_CHAT_MARKER_ID:last]
    if markers != NEEDLE3_CHAT_MARKERS or any(kind != PieceType.USER_DEFINED for kind in kinds):
        raise TokenizerSourceError(
            f"tokenizer piece table: ids {FIRST_CHAT_MARKER_ID}-{last - 1} should be the user-defined Needle 3 chat "
            f"markers {list(NEEDLE3_CHAT_MARKERS)}, found {list(markers)}")
    _check_prompt_target_boundary(table)
    return build_fast_tokenizer(table, model_max_length=model_max_length, chat_template=NEEDLE3_CHAT_TEMPLATE)
