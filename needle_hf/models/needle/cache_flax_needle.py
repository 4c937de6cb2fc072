"""The Flax twin's decoding cache: the KV cache layout (shared by the model and its MTP speculative
decoding) and the decoding position and engram token history (`FlaxNeedleDecodeState`)."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from .configuration_needle import NeedleConfig


class LayerKVCache(NamedTuple):
    """One layer's keys [B, K, H, S] and values [B, K, S, H], and the position where new tokens go.

    Keys are stored transposed so that every attention product runs along the cache's minor axis S:
    a one-token step's score sums then reduce over H, a major axis, which XLA vectorises (summing
    over a minor H is slower; benchmarks/README.md), and longer inputs' score matmuls read the keys without a transpose.
    """

    keys: jnp.ndarray
    values: jnp.ndarray
    write_index: jnp.ndarray


class FlaxNeedleDecodeState(nn.Module):
    """Decoding position and engram token history, kept in the `cache` collection.

    Returns, for the T new tokens: the cache index of the first one (None without a cache), their
    validity [B, T], and the engram context (tokens, validity) [B, C] = history + new tokens.
    """

    config: NeedleConfig

    @nn.compact
    def __call__(self, input_ids, attention_mask, *, init_cache: bool = False):
        b, t = input_ids.shape
        if not (init_cache or self.has_variable("cache", "cache_index")):
            valid = attention_mask.astype(jnp.bool_)
            return None, valid, input_ids, valid
        history = self.config.engram_history
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        past_tokens = self.variable("cache", "engram_tokens", jnp.zeros, (b, history), jnp.int32)
        past_valid = self.variable("cache", "engram_valid", jnp.zeros, (b, history), jnp.bool_)
        start = index.value
        if init_cache:
            valid = attention_mask[:, :t].astype(jnp.bool_)
        else:
            valid = jax.lax.dynamic_slice(attention_mask, (0, start), (b, t)).astype(jnp.bool_)
        context_tokens = jnp.concatenate([past_tokens.value, input_ids.astype(jnp.int32)], axis=1)  # [B, C]
        context_valid = jnp.concatenate([past_valid.value, valid], axis=1)
        if init_cache:
            return None, valid, context_tokens, context_valid
        index.value = start + t
        past_tokens.value = context_tokens[:, context_tokens.shape[1] - history :]
        past_valid.value = context_valid[:, context_valid.shape[1] - history :]
        return start, valid, context_tokens, context_valid


__all__ = ["FlaxNeedleDecodeState", "LayerKVCache"]
