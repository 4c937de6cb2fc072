"""The probe-pooling heads of Flax Needle 2: tool retrieval (contrastive) and answer confidence, with the
causal LM's methods that run them (`FlaxNeedleHeadsMixin`). (The MTP head runs a decoder block:
`mtp_flax_needle`.)"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from .configuration_needle import NeedleConfig
from .numerics import CONFIDENCE_PROBES, CONTRASTIVE_NORM_EPS, CONTRASTIVE_PROBES, CONTRASTIVE_TEMPERATURE_INIT
from .ops_flax_needle import normal_initializer
from .specification_needle import check_positions


def probe_pool(cells: jnp.ndarray, keep: jnp.ndarray, probes: jnp.ndarray) -> jnp.ndarray:
    """Attention pooling of every (position, layer) cell by learned probes, in float32.

    cells [B, T, L + 1, D]; keep [B, T] bool (real tokens); probes [P, D] -> [B, P * D] float32.
    The softmax runs over all T * (L + 1) cells (axis F), position-major.
    """
    b, t, depth, d = cells.shape
    flat = cells.reshape(b, t * depth, d).astype(jnp.float32)  # [B, F, D]
    keep = jnp.repeat(keep.astype(jnp.bool_), depth, axis=1)  # [B, F], position-major like the cells
    scores = jnp.einsum("bfd,pd->bpf", flat, probes.astype(jnp.float32)) / math.sqrt(d)
    weights = jax.nn.softmax(jnp.where(keep[:, None, :], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bpf,bfd->bpd", weights, flat).reshape(b, -1)


def pooled_projection(head: nn.Module, cells, keep, *, num_probes: int, features: int, use_bias: bool):
    """What both probe-pooling heads do first, inside the head's compact call: pool the cells [B, T, L + 1, D]
    by the head's ``probes`` [P, D] (`probe_pool`), then project them with its ``proj`` -> [B, features]
    in the head's dtype."""
    cfg = head.config
    probes = head.param("probes", normal_initializer(cfg.initializer_range), (num_probes, cfg.hidden_size))
    pooled = probe_pool(cells, keep, probes).astype(head.dtype)
    dense = nn.Dense(features, use_bias=use_bias, dtype=head.dtype, kernel_init=normal_initializer(cfg.initializer_range),
                     name="proj")
    return dense(pooled)


class FlaxNeedleContrastiveHead(nn.Module):
    """Tool-retrieval embedding: probe pooling, a projection, L2 normalisation, plus a learned log-temperature."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, cells, keep):
        """-> (unit-norm embedding [B, contrastive_dim], log_temperature scalar)."""
        p = pooled_projection(self, cells, keep, num_probes=CONTRASTIVE_PROBES, features=self.config.contrastive_dim,
                              use_bias=False)
        log_temperature = self.param("log_temperature", nn.initializers.constant(math.log(CONTRASTIVE_TEMPERATURE_INIT)), ())
        norm = jnp.sqrt(jnp.sum(p.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + CONTRASTIVE_NORM_EPS)
        return p / norm.astype(p.dtype), log_temperature


class FlaxNeedleConfidenceHead(nn.Module):
    """Answer-confidence logit: probe pooling and an affine map to one float32 logit per sequence."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, cells, keep):
        """-> confidence logit [B] float32."""
        logit = pooled_projection(self, cells, keep, num_probes=CONFIDENCE_PROBES, features=1, use_bias=True)
        return logit[..., 0].astype(jnp.float32)


class FlaxNeedleHeadsMixin:
    """`FlaxNeedleForCausalLM`'s probe-pooling heads (runs its module's `contrastive_embedding` and
    `confidence_logit`; uses ``module``, ``params``)."""

    def _apply_method(self, method, input_ids, attention_mask, params):
        input_ids = jnp.asarray(input_ids, "i4")
        check_positions(input_ids.shape[1], self.config.max_position_embeddings)  # a forward without a cache
        mask = None if attention_mask is None else jnp.asarray(attention_mask, "i4")
        return self.module.apply({"params": params or self.params}, input_ids, mask, method=method)

    def contrastive_embedding(self, input_ids, attention_mask=None, params=None):
        """Tool-retrieval embedding: (unit-norm [B, contrastive_dim], log_temperature).

        Without `attention_mask`, tokens equal to `pad_token_id` are treated as padding (as the reference does).
        """
        return self._apply_method(type(self.module).contrastive_embedding, input_ids, attention_mask, params)

    def confidence_logit(self, input_ids, attention_mask=None, params=None):
        """Confidence logit [B] (float32) of the confidence head."""
        return self._apply_method(type(self.module).confidence_logit, input_ids, attention_mask, params)


__all__ = ["FlaxNeedleConfidenceHead", "FlaxNeedleContrastiveHead", "FlaxNeedleHeadsMixin", "pooled_projection", "probe_pool"]
