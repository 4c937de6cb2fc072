"""The multi-token-prediction head of Flax Needle 2: from the backbone's final hidden state at t and the
embedding of token t + 1, a decoder block predicts token t + 2. `speculative_flax` drafts with it.
PyTorch twin: `mtp_needle`.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from .cache_flax_needle import LayerKVCache
from .configuration_needle import NeedleConfig
from .deploy_numerics_flax import quantize_activations  # deploy numerics hook
from .norms_flax_needle import FlaxNeedleRMSNorm
from .masking_flax_needle import attention_allowed
from .numerics import rope_inverse_frequencies
from .ops_flax_needle import normal_initializer, rope_tables


class FlaxNeedleMTPHead(nn.Module):
    """Multi-token prediction: from h_t and the embedding of token t+1, predict token t+2."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32
    block_class: type = None  # the decoder block (`modeling_flax_needle.FlaxNeedleBlock`)

    def setup(self):
        cfg = self.config
        self.embed_norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)
        self.combine_proj = nn.Dense(cfg.hidden_size, use_bias=False, dtype=self.dtype, kernel_init=normal_initializer(cfg.initializer_range))
        self.block = self.block_class(cfg, dtype=self.dtype)
        self.norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)

    def __call__(self, hidden, next_token_embeddings, cos, sin, key_mask):
        """hidden [B, T, D] (final-normed), next_token_embeddings [B, T, D] -> [B, T, D]."""
        return self.cached(hidden, next_token_embeddings, cos, sin, key_mask, kv_cache=None)[0]

    def cached(self, hidden, next_token_embeddings, cos, sin, key_mask, *, kv_cache: Optional[LayerKVCache]):
        """As `__call__`, the block attending over its own cache (MTP decoding) -> ([B, T, D], kv_cache)."""
        combined = jnp.concatenate([hidden, self.embed_norm(next_token_embeddings).astype(hidden.dtype)], axis=-1)
        combined = quantize_activations(combined, self.config)  # deploy numerics hook
        m = self.combine_proj(combined)
        out, kv_cache, _ = self.block.block(m, cos, sin, key_mask, kv_cache=kv_cache)
        return self.norm(out), kv_cache


def text_mtp_hidden(causal_lm: nn.Module, input_ids, attention_mask, position_ids, hidden, *, segment_ids=None):
    """The MTP head's output [B, T, D] over a whole text (``causal_lm.mtp``, inside its apply): input_ids,
    attention_mask and position_ids [B, T], ``hidden`` [B, T, D] the backbone's final-normed output;
    with segment_ids (packed sequences) a sequence's last token is followed by nothing, as a row's."""
    cfg = causal_lm.config
    if input_ids.shape[1] != attention_mask.shape[1]:
        raise ValueError("MTP logits are computed on a full sequence, not while decoding with a cache")
    next_ids = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))
    cos, sin = rope_tables(position_ids, rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta))
    key_mask = attention_allowed(attention_mask, 0, input_ids.shape[1], window=cfg.attention_window)
    if segment_ids is not None:
        key_mask = key_mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        next_ids = jnp.where(jnp.pad(segment_ids[:, 1:], ((0, 0), (0, 1)), constant_values=-1) == segment_ids,
                             next_ids, 0)
    return causal_lm.mtp(hidden, causal_lm.model.embed(next_ids), cos, sin, key_mask)


__all__ = ["FlaxNeedleMTPHead", "text_mtp_hidden"]
