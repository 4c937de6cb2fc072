"""The Flax twin's KV cache layout, shared by the model and its MTP speculative decoding."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class LayerKVCache(NamedTuple):
    """One layer's keys [B, K, H, S] and values [B, K, S, H], and the position where new tokens go.

    Keys are stored transposed so that every attention product runs along the cache's minor axis S:
    a one-token step's score sums then reduce over H, a major axis, which XLA vectorises (summing
    over a minor H is slower; benchmarks/README.md), and longer inputs' score matmuls read the keys without a transpose.
    """

    keys: jnp.ndarray
    values: jnp.ndarray
    write_index: jnp.ndarray


__all__ = ["LayerKVCache"]
