"""Which keys each query of Flax Needle 2 attends to (`specification_needle.attention_rule`), and the
sequences of a packed (padding-free) batch."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from .ops_flax_needle import shift_right
from .specification_needle import attention_rule


def packed_segment_ids(position_ids: jnp.ndarray) -> jnp.ndarray:
    """Sequence index [B, T] of each token of a row that packs sequences: a position that is not its
    predecessor's plus one starts a sequence (transformers' and TRL's convention; torch twin:
    `modeling_needle.packed_segment_ids`). A row of consecutive positions is one sequence."""
    starts = jnp.concatenate(
        [jnp.ones_like(position_ids[:, :1], dtype=jnp.bool_), position_ids[:, 1:] != position_ids[:, :-1] + 1], axis=1
    )
    return jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1


def same_segment_back(segment_ids: Optional[jnp.ndarray], offset: int) -> Optional[jnp.ndarray]:
    """[B, T] bool: position t - offset lies in t's sequence (None without segments)."""
    if segment_ids is None:
        return None
    return shift_right(segment_ids, offset, fill=-1) == segment_ids


def attention_allowed(key_visible: jnp.ndarray, past_length, query_length: int, *, window: int = 0) -> jnp.ndarray:
    """Boolean attention mask [B, T, S]: causal, restricted to visible keys, and always the query itself.

    With ``window = n > 0`` a query sees only the last ``n`` key slots (`config.attention_window`,
    see `kv_window.py`).

    key_visible [B, S] (True = real token; S = cache length when decoding); the T queries sit at
    positions past_length .. past_length + T - 1 (past_length may be traced). A query attending to
    itself keeps padding rows (which see no visible key) finite and independent of other positions.
    """
    query_positions = past_length + jnp.arange(query_length)  # [T]
    key_positions = jnp.arange(key_visible.shape[1])  # [S]
    return attention_rule(
        query_positions[:, None], key_positions[None, :], key_visible.astype(jnp.bool_)[:, None, :], window=window
    )
