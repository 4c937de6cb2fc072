"""Needle 2 in Flax for Hugging Face Transformers (4.57, the last release with Flax models).

Axis letters in shape comments and einsum strings:
  B batch, T query positions, S key positions, D hidden (d_model), A attention width,
  N query heads, K key/value heads, G query heads per kv head, H head_dim, L hyper-connection lanes,
  C context positions of the engram window, E engram input width, V vocabulary.

Numerics (one choice per op, matching the reference):
  * every RMS statistic is taken in float32; ZCRMSNorm returns `(1 + w) * x / sqrt(mean(x^2) + eps)`
    cast to the compute dtype, with `1 + w` formed in the parameter dtype;
  * projections run in the compute dtype (`dtype`); attention scores and softmax in float32, the
    probabilities cast to the compute dtype before they weight the values;
  * the Hadamard MLP's Walsh matrix is applied as its two Kronecker factors (`walsh_transform`),
    equal to the full matmul up to float32 rounding;
  * hyper-connection mixing, Sinkhorn routing and the engram gate run in float32; the lanes are
    stored in the compute dtype between layers;
  * logits are `float32(h) @ E^T`.

The cache (`init_cache`, a `cache` collection) holds, per layer, keys and values for every position
up to `max_length`; for the engram memory, the last `config.engram_history` tokens with their
validity (an engram output at position t depends on tokens t-11..t) and, per site, the value
projections of the last positions its dilated convolution reads.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import NamedTuple, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.frozen_dict import FrozenDict, freeze, unfreeze
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers.modeling_flax_outputs import FlaxBaseModelOutput, FlaxCausalLMOutput
from transformers.modeling_flax_utils import FlaxPreTrainedModel

from .configuration_needle import NeedleConfig
from .deploy_numerics_flax import (  # deploy numerics hooks
    quantize_activations,
    quantize_kv,
    training_weights,
)
from .weight_names import WeightMappingError, hf_weight_shapes
from .numerics import (
    ENGRAM_HASH_PRIME,
    ENGRAM_HASH_SHIFT,
    SINKHORN_ITERATIONS,
    SINKHORN_LINEAR_SPACE_MAX_SPREAD,
    engram_table_orders,
    engram_table_seeds,
    hyper_connection_offsets,
    rope_inverse_frequencies,
    walsh_matrix,
)

CONTRASTIVE_PROBES = 4
CONFIDENCE_PROBES = 8


@flax.struct.dataclass
class FlaxNeedleCausalLMOutput(FlaxCausalLMOutput):
    """`FlaxCausalLMOutput` plus the multi-token-prediction logits (`mtp_logits[:, t]` predicts token t+2)."""

    mtp_logits: Optional[jnp.ndarray] = None
    past_key_values: Optional[dict] = None


def _normal(std: float):
    return jax.nn.initializers.normal(stddev=std)


# --------------------------------------------------------------------------------------------------
# Shared math


def rms_unit(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x / rms(x) over the last axis, in float32, no gain."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def _log_space_round(_, log_k):
    log_k = log_k - jax.nn.logsumexp(log_k, axis=-1, keepdims=True)
    return log_k - jax.nn.logsumexp(log_k, axis=-2, keepdims=True)


def _linear_space_round(_, k):
    # Sums over the (static, small) lane axes as explicit adds of slices: elementwise only, so XLA
    # fuses a whole round into one loop, where reductions would each be a kernel of their own.
    n = k.shape[-1]
    k = k / sum(k[..., :, j : j + 1] for j in range(n))
    return k / sum(k[..., i : i + 1, :] for i in range(n))


def sinkhorn(logits: jnp.ndarray) -> jnp.ndarray:
    """Doubly-stochastic routing [..., L, L] from float32 logits: the reference's log-space Sinkhorn
    (subtract the logsumexp over rows, then over columns, `SINKHORN_ITERATIONS` rounds, then exp).

    Computed in linear space, the same in exact arithmetic: subtracting a row's logsumexp is dividing
    `exp(logits)` by the row's sum. A round is then one fused loop instead of about a dozen kernels,
    which is most of a decoding step's lane-mixing cost. Logits spread wider than
    `SINKHORN_LINEAR_SPACE_MAX_SPREAD` (where linear space could underflow) take the log-space path.
    """
    shifted = logits - jnp.max(logits, axis=(-2, -1), keepdims=True)  # each matrix's largest logit at 0
    return jax.lax.cond(
        jnp.min(shifted, initial=0.0) < -SINKHORN_LINEAR_SPACE_MAX_SPREAD,
        lambda: jnp.exp(jax.lax.fori_loop(0, SINKHORN_ITERATIONS, _log_space_round, logits)),
        lambda: jax.lax.fori_loop(0, SINKHORN_ITERATIONS, _linear_space_round, jnp.exp(shifted)),
    )


class LayerKVCache(NamedTuple):
    """One layer's keys [B, K, H, S] and values [B, K, S, H], and the position where new tokens go.

    Keys are stored transposed so that every attention product runs along the cache's minor axis S:
    a one-token step's score sums then reduce over H, a major axis, which XLA vectorises (summing
    over a minor H is 3x slower), and longer inputs' score matmuls read the keys without a transpose.
    """

    keys: jnp.ndarray
    values: jnp.ndarray
    write_index: jnp.ndarray


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Half-split rotary embedding. x [B, T, heads, H]; cos/sin [B, T, H/2] float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_tables(position_ids: jnp.ndarray, head_dim: int, theta: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin [B, T, H/2] float32 for integer positions [B, T]."""
    angles = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(rope_inverse_frequencies(head_dim, theta))
    return jnp.cos(angles), jnp.sin(angles)


def shift_right(x: jnp.ndarray, offset: int, fill=0) -> jnp.ndarray:
    """x[:, t - offset] along axis 1, `fill` before the start."""
    if offset == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (offset, 0)
    return jnp.pad(x, pad, constant_values=fill)[:, : x.shape[1]]


def engram_hash_indices(tokens: jnp.ndarray, orders, num_heads: int, slots: int) -> jnp.ndarray:
    """Hash-table rows [B, C, tables] for token ids [B, C] (uint32 FNV-style n-gram hash)."""
    tokens = tokens.astype(jnp.uint32)
    rows = []
    for seed, order in zip(engram_table_seeds(len(orders), num_heads), engram_table_orders(orders, num_heads)):
        acc = jnp.full_like(tokens, jnp.uint32(seed))
        for j in range(order):
            acc = (acc ^ shift_right(tokens, j)) * jnp.uint32(ENGRAM_HASH_PRIME)
        acc = acc ^ (acc >> jnp.uint32(ENGRAM_HASH_SHIFT))
        rows.append((acc % jnp.uint32(slots)).astype(jnp.int32))
    return jnp.stack(rows, axis=-1)


# --------------------------------------------------------------------------------------------------
# Modules


class FlaxNeedleRMSNorm(nn.Module):
    """Zero-centred RMSNorm: `(1 + weight) * x / rms(x)`; `weight` starts at 0."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.zeros, (x.shape[-1],))
        xf = x.astype(jnp.float32)
        rms = jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.config.rms_norm_eps)
        return ((1 + weight) * x / rms).astype(self.dtype)


class FlaxNeedleLinear(nn.Module):
    """Bias-free projection `x @ kernel`, kernel [in, out] named like `nn.Dense`'s (`.../kernel`).

    The kernel is declared in `setup`, so a parent can also read it (`.kernel`) and run several
    projections of one input as a single matmul (`fused_projections`).
    """

    in_features: int
    out_features: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    def setup(self):
        self.kernel = self.param("kernel", _normal(self.init_std), (self.in_features, self.out_features))

    def __call__(self, x):
        return x.astype(self.dtype) @ self.kernel.astype(self.dtype)


def fused_projections(x, projections) -> list:
    """[p(x) for p in projections] (FlaxNeedleLinear layers of one input) as a single matmul.

    Worth it for narrow projections: a decoding step reads a few-column kernel inefficiently, and
    one wider matmul reads all of them in one pass. Concatenating the kernels is a copy, but inside
    a decoding loop (generate's `while_loop`) XLA hoists it out of the loop.
    """
    kernel = jnp.concatenate([p.kernel for p in projections], axis=1)
    out = x.astype(projections[0].dtype) @ kernel.astype(projections[0].dtype)
    return jnp.split(out, np.cumsum([p.out_features for p in projections])[:-1].tolist(), axis=-1)


class FlaxNeedleAttention(nn.Module):
    """GQA self-attention with q/k norms, half-split RoPE and a sigmoid output gate."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        dense = partial(nn.Dense, use_bias=False, dtype=self.dtype, kernel_init=_normal(cfg.initializer_range))
        residual_std = cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers)
        self.q_proj = dense(cfg.attention_dim)
        self.k_proj = dense(cfg.kv_dim)
        self.v_proj = dense(cfg.kv_dim)
        self.gate_proj = dense(cfg.attention_dim)
        self.o_proj = dense(cfg.hidden_size, kernel_init=_normal(residual_std))
        self.q_norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)
        self.k_norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)

    def __call__(self, x, cos, sin, key_mask, kv_cache: Optional[LayerKVCache] = None):
        """x [B, T, D]; key_mask [B, T, S] (True = may attend) -> ([B, T, D], updated kv_cache)."""
        cfg = self.config
        b, t, _ = x.shape
        x = quantize_activations(x, cfg)  # deploy numerics hook
        # (Fusing these four projections into one matmul speeds a decoding step up, but the
        # concatenated kernels are an 86 MB copy per generate() call at the Needle 2 size, which
        # costs as much as it saves at 64 new tokens.)
        q = self.q_norm(self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim))  # [B, T, N, H]
        k = self.k_norm(self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim))  # [B, T, K, H]
        v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)  # [B, T, K, H]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = quantize_kv(k, v, cfg)  # deploy numerics hook
        k, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [B, K, H, T], [B, K, T, H]: the cache layout
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        q = q.reshape(b, t, cfg.num_key_value_heads, groups, cfg.head_dim).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
        scale = jnp.sqrt(jnp.float32(cfg.head_dim))
        mask = key_mask[:, None, None]  # [B, 1, 1, T, S]
        if kv_cache is not None:
            # Write the new positions in place, then attend over this layer's whole cache.
            start = kv_cache.write_index
            k = jax.lax.dynamic_update_slice(kv_cache.keys, k.astype(kv_cache.keys.dtype), (0, 0, 0, start))
            v = jax.lax.dynamic_update_slice(kv_cache.values, v.astype(kv_cache.values.dtype), (0, 0, start, 0))
            kv_cache = kv_cache._replace(keys=k, values=v)
        if t == 1:
            # One token: products and sums that XLA fuses into two loops over the cache. (A dot that
            # reads a cache updated in place inside generate()'s loop makes XLA copy the cache, before
            # or after the update, which costs more than these loops.)
            scores = jnp.sum(q[..., None].astype(jnp.float32) * k[:, :, None, None].astype(jnp.float32), axis=-2)
            probs = jax.nn.softmax(jnp.where(mask, scores / scale, jnp.finfo(jnp.float32).min), axis=-1)
            weights = probs.astype(v.dtype).astype(jnp.float32)
            out = jnp.sum(weights[..., None] * v[:, :, None, None].astype(jnp.float32), axis=-2).astype(v.dtype)
        else:
            scores = jnp.einsum("bkgth,bkhs->bkgts", q, k, preferred_element_type=jnp.float32)
            probs = jax.nn.softmax(jnp.where(mask, scores / scale, jnp.finfo(jnp.float32).min), axis=-1)
            out = jnp.einsum("bkgts,bksh->bkgth", probs.astype(v.dtype), v)  # [B, K, G, T, H]
        out = out.transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]
        out = out.reshape(b, t, cfg.attention_dim)
        out = out * nn.sigmoid(self.gate_proj(x))
        out = quantize_activations(out, cfg)  # deploy numerics hook
        return self.o_proj(out), kv_cache


def walsh_transform(z: jnp.ndarray) -> jnp.ndarray:
    """`z @ walsh_matrix(n)` over the last axis (n a power of two), as two small matmuls.

    The Sylvester matrix factors as a Kronecker product, W_n = W_a (x) W_b with n = a * b, so
    z W_n = W_a^T Z W_b for Z = z reshaped [a, b]: 2 * n * sqrt(n) multiply-adds instead of n^2, and
    no n x n matrix to stream per token (1 MB for n = 512).
    """
    n = z.shape[-1]
    a = 1 << ((n.bit_length() - 1 + 1) // 2)
    b = n // a
    walsh_a, walsh_b = (jnp.asarray(walsh_matrix(m), z.dtype) for m in (a, b))
    z = jnp.einsum("...ij,jl->...il", z.reshape(*z.shape[:-1], a, b), walsh_b)
    return jnp.einsum("...il,ik->...kl", z, walsh_a).reshape(*z.shape[:-2], n)


class FlaxNeedleHadamardMLP(nn.Module):
    """`(diag_out * silu(diag_hidden * (diag_in * x) W) W)[:D]` with W the orthonormal Walsh matrix."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        n, d = self.config.hadamard_size, self.config.hidden_size
        diag_in = self.param("diag_in", nn.initializers.ones, (n,)).astype(self.dtype)
        diag_hidden = self.param("diag_hidden", nn.initializers.ones, (n,)).astype(self.dtype)
        diag_out = self.param("diag_out", nn.initializers.constant(0.02), (n,)).astype(self.dtype)
        z = jnp.pad(x, ((0, 0), (0, 0), (0, n - d))) if n > d else x
        z = walsh_transform(diag_in * z)
        z = walsh_transform(nn.silu(diag_hidden * z))
        return (diag_out * z)[..., :d]


class FlaxNeedleBlock(nn.Module):
    """One transformer block: [engram read] -> attention (gated residual) -> Hadamard MLP."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.input_layernorm = FlaxNeedleRMSNorm(self.config, dtype=self.dtype)
        self.self_attn = FlaxNeedleAttention(self.config, dtype=self.dtype)
        self.post_attention_layernorm = FlaxNeedleRMSNorm(self.config, dtype=self.dtype)
        self.attention_gate = self.param("attention_gate", nn.initializers.zeros, ())
        self.pre_feedforward_layernorm = FlaxNeedleRMSNorm(self.config, dtype=self.dtype)
        self.mlp = FlaxNeedleHadamardMLP(self.config, dtype=self.dtype)

    def block(self, u, cos, sin, key_mask, engram=None, kv_cache: Optional[LayerKVCache] = None):
        """u [B, T, D] -> ([B, T, D], kv_cache).

        `engram` = (keys, values) [B, T, D]: the engram memory this layer reads, or None.
        """
        if engram is not None:
            engram_keys, engram_values = engram
            eps = self.config.rms_norm_eps
            alpha = nn.sigmoid(
                jnp.sum(rms_unit(u, eps) * rms_unit(engram_keys, eps), axis=-1, keepdims=True)
                / math.sqrt(self.config.hidden_size)
            )  # [B, T, 1]
            u = u + (alpha * engram_values.astype(jnp.float32)).astype(u.dtype)
        attn, kv_cache = self.self_attn(self.input_layernorm(u), cos, sin, key_mask, kv_cache=kv_cache)
        x = u + nn.sigmoid(self.attention_gate).astype(self.dtype) * self.post_attention_layernorm(attn)
        return x + self.mlp(self.pre_feedforward_layernorm(x)), kv_cache

    def __call__(self, u, cos, sin, key_mask):
        return self.block(u, cos, sin, key_mask)[0]


class FlaxNeedleHyperConnection(nn.Module):
    """Per-layer lane mixing weights: pre-mix (lanes -> block input), post-mix, and residual routing."""

    config: NeedleConfig

    def setup(self):
        cfg = self.config
        lanes = cfg.hyper_connection_lanes
        linear = partial(FlaxNeedleLinear, lanes * cfg.hidden_size, dtype=jnp.float32, init_std=cfg.initializer_range)
        self.pre_proj = linear(lanes)
        self.post_proj = linear(lanes)
        self.res_proj = linear(lanes * lanes)
        self.pre_bias = self.param("pre_bias", nn.initializers.zeros, (lanes,))
        self.post_bias = self.param("post_bias", nn.initializers.zeros, (lanes,))
        self.res_bias = self.param("res_bias", lambda key, shape: 4.0 * jnp.eye(lanes), (lanes, lanes))
        self.pre_alpha = self.param("pre_alpha", nn.initializers.constant(0.01), ())
        self.post_alpha = self.param("post_alpha", nn.initializers.constant(0.01), ())
        self.res_alpha = self.param("res_alpha", nn.initializers.constant(0.01), ())

    def __call__(self, lanes_flat_unit, pre_offset, post_offset):
        """lanes_flat_unit [B, T, L*D] float32 -> (pre [B, T, L], post [B, T, L], routing [B, T, L, L])."""
        f32 = lambda p: jnp.asarray(p, jnp.float32)  # noqa: E731
        b, t, _ = lanes_flat_unit.shape
        n = self.config.hyper_connection_lanes
        pre_logits, post_logits, routing_logits = fused_projections(lanes_flat_unit, (self.pre_proj, self.post_proj, self.res_proj))
        pre = nn.sigmoid(f32(self.pre_alpha) * pre_logits + f32(self.pre_bias) + pre_offset)
        post = 2 * nn.sigmoid(f32(self.post_alpha) * post_logits + f32(self.post_bias) + post_offset)
        routing_logits = f32(self.res_alpha) * routing_logits.reshape(b, t, n, n) + f32(self.res_bias)
        return pre, post, sinkhorn(routing_logits)


class FlaxNeedleDecoderLayer(FlaxNeedleBlock):
    """A block wrapped in hyper-connections over `hyper_connection_lanes` residual lanes."""

    def setup(self):
        super().setup()
        self.hyper_connection = FlaxNeedleHyperConnection(self.config)

    def __call__(self, lanes, cos, sin, key_mask, lane_offsets, engram=None, kv_cache: Optional[LayerKVCache] = None):
        """lanes [B, T, L, D] (compute dtype) -> (lanes [B, T, L, D], kv_cache).

        lane_offsets = (pre, post) [L] float32: this layer's lane-ownership logit offsets.
        """
        b, t, n, d = lanes.shape
        lanes_f32 = lanes.astype(jnp.float32)
        unit = rms_unit(lanes.reshape(b, t, n * d), self.config.rms_norm_eps)  # [B, T, L*D]
        pre, post, routing = self.hyper_connection(unit, *lane_offsets)
        u = jnp.einsum("btl,btld->btd", pre, lanes_f32).astype(self.dtype)
        y, kv_cache = self.block(u, cos, sin, key_mask, engram=engram, kv_cache=kv_cache)
        y = y - u
        mixed = jnp.einsum("btij,btjd->btid", routing, lanes_f32) + post[..., None] * y.astype(jnp.float32)[:, :, None, :]
        return mixed.astype(self.dtype), kv_cache


class FlaxNeedleEngram(nn.Module):
    """Hashed n-gram memory for one engram site: keys and (dilated-conv) values per position.

    The values convolve the value projections of the last `config.engram_conv_reach` positions,
    which the caller keeps (the cache does, when decoding), so only new positions are projected.
    """

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.tables = self.param(
            "tables", _normal(cfg.initializer_range), (cfg.engram_num_tables, cfg.engram_slots, cfg.engram_sub_dim)
        )
        dense = partial(nn.Dense, cfg.hidden_size, use_bias=False, dtype=self.dtype)
        self.key_proj = dense(kernel_init=_normal(cfg.initializer_range))
        self.value_proj = dense(kernel_init=_normal(cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers)))
        self.conv_taps = self.param(
            "conv_taps", lambda key, shape: jnp.zeros(shape).at[0].set(1.0), (cfg.engram_conv_taps, cfg.hidden_size)
        )

    def __call__(self, indices, ngram_visible, tap_visible, past_projected):
        """Keys and values of T new positions.

        indices, ngram_visible [B, T, tables]; tap_visible [taps, B, T] (is the position each tap
        reads visible); past_projected [B, reach, D]: value projections of the positions before
        these -> (keys [B, T, D], values [B, T, D], value projections of the last `reach` positions).
        """
        cfg = self.config
        b, t, num_tables = indices.shape
        reach = past_projected.shape[1]
        rows = self.tables[jnp.arange(num_tables), indices]  # [B, T, tables, sub]
        rows = rows * ngram_visible[..., None]
        e = rows.reshape(b, t, num_tables * cfg.engram_sub_dim).astype(self.dtype)  # [B, T, E]
        e = quantize_activations(e, cfg)  # deploy numerics hook
        keys = self.key_proj(e)
        projected = jnp.concatenate([past_projected.astype(self.dtype), self.value_proj(e)], axis=1)  # [B, reach + T, D]
        taps = self.conv_taps.astype(self.dtype)
        values = sum(
            taps[j] * projected[:, reach - j * cfg.engram_conv_dilation :][:, :t] * tap_visible[j][..., None]
            for j in range(cfg.engram_conv_taps)
        )
        return keys, values, projected[:, t:]


class FlaxNeedleLayerCollection(nn.Module):
    """Decoder layers whose parameters are named per layer (`model.layers.{i}.*`).

    The layers run unrolled, each reading its own parameters in place. (A `lax.scan` would compile
    one layer body instead of `num_hidden_layers`, but it needs the parameters stacked: a 140 MB
    copy per call at the Needle 2 size, plus a copy of each layer's slice per step; both cost more
    time than the layers' own matmuls of a decoding step.) All layers are initialised by one vmapped
    init of a standalone decoder layer, so initialising 27 layers costs one layer's compile. The
    cache holds each layer's keys [B, K, H, S] and values [B, K, S, H] as `keys_{i}`/`values_{i}`.
    """

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def _layer(self) -> FlaxNeedleDecoderLayer:
        return FlaxNeedleDecoderLayer(self.config, dtype=self.dtype, parent=None)

    def _init_all_layers(self, rng):
        """Initial parameters of every layer, stacked on a leading layer axis."""
        cfg = self.config
        lanes = jnp.zeros((1, 1, cfg.hyper_connection_lanes, cfg.hidden_size), self.dtype)
        rope = jnp.zeros((1, 1, cfg.head_dim // 2), jnp.float32)
        offsets = (jnp.zeros((cfg.hyper_connection_lanes,)), jnp.zeros((cfg.hyper_connection_lanes,)))
        key_mask = jnp.ones((1, 1, 1), bool)
        init_one = lambda r: self._layer().init(r, lanes, rope, rope, key_mask, offsets)["params"]  # noqa: E731
        return unfreeze(jax.jit(jax.vmap(init_one))(jax.random.split(rng, cfg.num_hidden_layers)))

    def _kv_cache_variables(self, lanes, init_cache: bool):
        """Per-layer (keys, values) cache variables, or None when not decoding with a cache."""
        cfg = self.config
        if not (init_cache or self.has_variable("cache", "keys_0")):
            return None
        b, s = lanes.shape[:2]  # at init_cache, T is the cache length
        kv, h = cfg.num_key_value_heads, cfg.head_dim
        return [
            (self.variable("cache", f"keys_{i}", jnp.zeros, (b, kv, h, s), self.dtype),
             self.variable("cache", f"values_{i}", jnp.zeros, (b, kv, s, h), self.dtype))
            for i in range(cfg.num_hidden_layers)
        ]

    @nn.compact
    def __call__(self, lanes, cos, sin, key_mask, memory, *, cache_index=None, init_cache: bool = False, output_hidden_states: bool = False):
        """lanes [B, T, L, D] -> (lanes after the last layer, lane means [layers, B, T, D] or None).

        memory: (engram keys, engram values) [sites, B, T, D], or None without engram sites.
        """
        cfg = self.config
        pre_offsets, post_offsets = hyper_connection_offsets(cfg.num_hidden_layers, cfg.hyper_connection_lanes)
        site_of_layer = {layer: s for s, layer in enumerate(cfg.engram_layers)}
        initial = self._init_all_layers(self.make_rng("params")) if self.is_initializing() else None
        cache_vars = self._kv_cache_variables(lanes, init_cache)
        caching = cache_vars is not None and not init_cache
        layer_module = self._layer()
        lane_means = []
        for i in range(cfg.num_hidden_layers):
            params = self.param(str(i), lambda rng, i=i: jax.tree.map(lambda leaf: leaf[i], initial))
            s = site_of_layer.get(i)
            engram = None if s is None else (memory[0][s], memory[1][s])
            kv = LayerKVCache(cache_vars[i][0].value, cache_vars[i][1].value, cache_index) if caching else None
            lanes, kv = layer_module.apply(
                {"params": params}, lanes, cos, sin, key_mask, (pre_offsets[i], post_offsets[i]), engram=engram, kv_cache=kv
            )
            if caching:
                cache_vars[i][0].value, cache_vars[i][1].value = kv.keys, kv.values
            if output_hidden_states:
                lane_means.append(jnp.mean(lanes, axis=2))
        return lanes, (jnp.stack(lane_means) if output_hidden_states else None)


class FlaxNeedleEngramCollection(nn.Module):
    """Engram sites named "0", "1", ... so parameters read `model.engrams.{s}.*`.

    When decoding with a cache, each site keeps the value projections of the last
    `config.engram_conv_reach` positions as `projected_values_{s}` [B, reach, D].
    """

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, indices, ngram_visible, tap_visible, *, init_cache: bool = False):
        """(keys, values) [sites, B, T, D] for T new positions (inputs as `FlaxNeedleEngram`, without the past)."""
        cfg = self.config
        shape = (indices.shape[0], cfg.engram_conv_reach, cfg.hidden_size)
        keys, values = [], []
        for s in range(len(cfg.engram_layers)):
            name = f"projected_values_{s}"
            state = None
            if init_cache or self.has_variable("cache", name):
                state = self.variable("cache", name, jnp.zeros, shape, self.dtype)
            past = jnp.zeros(shape, self.dtype) if state is None or init_cache else state.value
            k, v, projected = FlaxNeedleEngram(cfg, dtype=self.dtype, name=str(s))(indices, ngram_visible, tap_visible, past)
            if state is not None and not init_cache:
                state.value = projected
            keys.append(k)
            values.append(v)
        return jnp.stack(keys), jnp.stack(values)


@flax.struct.dataclass
class FlaxNeedleModelOutput(FlaxBaseModelOutput):
    past_key_values: Optional[dict] = None


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


class FlaxNeedleModule(nn.Module):
    """The Needle 2 backbone: embedding, engram memory, hyper-connected decoder layers, final norm."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=_normal(cfg.initializer_range))
        self.layers = FlaxNeedleLayerCollection(cfg, dtype=self.dtype)
        self.engrams = FlaxNeedleEngramCollection(cfg, dtype=self.dtype) if cfg.engram_layers else None
        self.norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)
        self.decode_state = FlaxNeedleDecodeState(cfg)

    def embed(self, input_ids):
        """Token embedding scaled by sqrt(D), in the parameter dtype. [B, T] -> [B, T, D]."""
        return self.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)

    def _engram_memory(self, context_tokens, context_valid, new_tokens: int, init_cache: bool):
        """(keys, values) [sites, B, new_tokens, D] for the last `new_tokens` of the context [B, C]."""
        cfg = self.config
        if self.engrams is None:
            return None
        orders, heads = cfg.engram_orders, cfg.engram_num_heads
        new = lambda x: x[:, x.shape[1] - new_tokens :]  # noqa: E731  (the new positions of a context array)
        # Invisible (padded) positions hash as token 0, like positions before the start.
        indices = engram_hash_indices(jnp.where(context_valid, context_tokens, 0), orders, heads, cfg.engram_slots)
        ngram_visible = jnp.stack(
            [shift_right(context_valid, o - 1, fill=False) for o in engram_table_orders(orders, heads)], -1
        )
        tap_visible = jnp.stack(
            [new(shift_right(context_valid, j * cfg.engram_conv_dilation, fill=False)) for j in range(cfg.engram_conv_taps)]
        )
        return self.engrams(new(indices), new(ngram_visible), tap_visible, init_cache=init_cache)

    def key_mask(self, attention_mask, query_length: int, cache_index):
        """Which keys each query may see: [B, T, S] from a [B, S] padding mask (S = cache length when decoding)."""
        keys = attention_mask.shape[1]
        start = 0 if cache_index is None else cache_index
        query_pos = start + jnp.arange(query_length)
        causal = jnp.arange(keys)[None, :] <= query_pos[:, None]  # [T, S]
        return causal[None] & attention_mask.astype(jnp.bool_)[:, None, :]

    def __call__(
        self,
        input_ids,
        attention_mask,
        position_ids,
        *,
        init_cache: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
    ):
        """input_ids/attention_mask/position_ids [B, T] (attention_mask [B, S] when decoding with a cache)."""
        cfg = self.config
        b, t = input_ids.shape
        cache_index, _, context_tokens, context_valid = self.decode_state(input_ids, attention_mask, init_cache=init_cache)
        key_mask = self.key_mask(attention_mask, t, cache_index)
        cos, sin = rope_tables(position_ids, cfg.head_dim, cfg.rope_theta)

        x0 = self.embed(input_ids)  # [B, T, D], parameter dtype
        memory = self._engram_memory(context_tokens, context_valid, t, init_cache)
        lanes = jnp.broadcast_to(x0.astype(self.dtype)[:, :, None, :], (b, t, cfg.hyper_connection_lanes, cfg.hidden_size))
        lanes, lane_means = self.layers(
            lanes, cos, sin, key_mask, memory,
            cache_index=cache_index, init_cache=init_cache, output_hidden_states=output_hidden_states,
        )
        last = self.norm(jnp.mean(lanes, axis=2))  # [B, T, D]
        hidden_states = (x0,) + tuple(lane_means) if output_hidden_states else None
        if not return_dict:
            return (last, hidden_states) if output_hidden_states else (last,)
        return FlaxNeedleModelOutput(last_hidden_state=last, hidden_states=hidden_states)


class FlaxNeedleMTPHead(nn.Module):
    """Multi-token prediction: from h_t and the embedding of token t+1, predict token t+2."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.embed_norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)
        self.combine_proj = nn.Dense(cfg.hidden_size, use_bias=False, dtype=self.dtype, kernel_init=_normal(cfg.initializer_range))
        self.block = FlaxNeedleBlock(cfg, dtype=self.dtype)
        self.norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)

    def __call__(self, hidden, next_token_embeddings, cos, sin, key_mask):
        """hidden [B, T, D] (final-normed), next_token_embeddings [B, T, D] -> [B, T, D]."""
        combined = jnp.concatenate([hidden, self.embed_norm(next_token_embeddings)], axis=-1)
        combined = quantize_activations(combined, self.config)  # deploy numerics hook
        m = self.combine_proj(combined)
        return self.norm(self.block(m, cos, sin, key_mask))


def probe_pool(cells, probes, keep, dtype):
    """Attention pooling of hidden cells by learned probes.

    cells [B, T, Lc, D] (Lc = layers + 1); probes [P, D]; keep [B, T] (1 = real token) -> [B, P*D].
    Softmax over every (position, layer) cell, in float32.
    """
    b, t, lc, d = cells.shape
    cells = cells.reshape(b, t * lc, d).astype(jnp.float32)
    scores = jnp.einsum("bcd,pd->bpc", cells, probes.astype(jnp.float32)) / math.sqrt(d)
    keep = jnp.repeat(keep, lc, axis=1)
    scores = jnp.where(keep[:, None, :] > 0, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bpc,bcd->bpd", weights, cells).reshape(b, -1).astype(dtype)


class FlaxNeedleContrastiveHead(nn.Module):
    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, cells, keep):
        """-> (unit-norm embedding [B, contrastive_dim], log_temperature scalar)."""
        cfg = self.config
        probes = self.param("probes", _normal(cfg.initializer_range), (CONTRASTIVE_PROBES, cfg.hidden_size))
        pooled = probe_pool(cells, probes, keep, self.dtype)
        p = nn.Dense(cfg.contrastive_dim, use_bias=False, dtype=self.dtype, kernel_init=_normal(cfg.initializer_range), name="proj")(pooled)
        log_temperature = self.param("log_temperature", nn.initializers.constant(math.log(0.07)), ())
        norm = jnp.sqrt(jnp.sum(p.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + 1e-12)
        return p / norm.astype(p.dtype), log_temperature


class FlaxNeedleConfidenceHead(nn.Module):
    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, cells, keep):
        """-> confidence logit [B] float32."""
        cfg = self.config
        probes = self.param("probes", _normal(cfg.initializer_range), (CONFIDENCE_PROBES, cfg.hidden_size))
        pooled = probe_pool(cells, probes, keep, self.dtype)
        logit = nn.Dense(1, use_bias=True, dtype=self.dtype, kernel_init=_normal(cfg.initializer_range), name="proj")(pooled)
        return logit[..., 0].astype(jnp.float32)


class FlaxNeedleForCausalLMModule(nn.Module):
    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.model = FlaxNeedleModule(cfg, dtype=self.dtype)
        self.mtp = FlaxNeedleMTPHead(cfg, dtype=self.dtype) if cfg.use_mtp_head else None
        self.contrastive_head = FlaxNeedleContrastiveHead(cfg, dtype=self.dtype) if cfg.use_contrastive_head else None
        self.confidence_head = FlaxNeedleConfidenceHead(cfg, dtype=self.dtype) if cfg.use_confidence_head else None

    def logits(self, hidden):
        """Tied output head in float32: [B, T, D] -> [B, T, V]."""
        embedding = self.model.variables["params"]["embed_tokens"]["embedding"]
        hidden = quantize_activations(hidden, self.config)  # deploy numerics hook
        return hidden.astype(jnp.float32) @ embedding.T.astype(jnp.float32)

    def __call__(
        self,
        input_ids,
        attention_mask,
        position_ids,
        *,
        init_cache: bool = False,
        output_hidden_states: bool = False,
        output_mtp_logits: bool = False,
        return_dict: bool = True,
    ):
        outputs = self.model(
            input_ids, attention_mask, position_ids, init_cache=init_cache, output_hidden_states=output_hidden_states
        )
        hidden = outputs.last_hidden_state
        logits = self.logits(hidden)
        mtp_logits = None
        if output_mtp_logits or self.is_initializing():
            mtp_logits = self.mtp_logits(input_ids, attention_mask, position_ids, hidden) if self.mtp is not None else None
            if self.is_initializing():
                self._touch_heads(input_ids)
        if not return_dict:
            return tuple(v for v in (logits, mtp_logits, outputs.hidden_states) if v is not None)
        return FlaxNeedleCausalLMOutput(logits=logits, hidden_states=outputs.hidden_states, mtp_logits=mtp_logits)

    def mtp_logits(self, input_ids, attention_mask, position_ids, hidden):
        if self.has_variable("cache", "cached_key") or input_ids.shape[1] != attention_mask.shape[1]:
            raise ValueError("MTP logits are computed on a full sequence, not while decoding with a cache")
        cfg = self.config
        next_ids = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))
        cos, sin = rope_tables(position_ids, cfg.head_dim, cfg.rope_theta)
        key_mask = self.model.key_mask(attention_mask, input_ids.shape[1], None)
        return self.logits(self.mtp(hidden, self.model.embed(next_ids), cos, sin, key_mask))

    def _touch_heads(self, input_ids):
        if self.contrastive_head is not None:
            self.contrastive_embedding(input_ids, None)
        if self.confidence_head is not None:
            self.confidence_logit(input_ids, None)

    def hidden_cells(self, input_ids, attention_mask):
        """[x0, lane mean after each layer] -> cells [B, T, layers + 1, D] and the keep mask [B, T]."""
        if attention_mask is None:
            attention_mask = (input_ids != self.config.pad_token_id).astype(jnp.int32)
        b, t = input_ids.shape
        position_ids = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        outputs = self.model(input_ids, attention_mask, position_ids, output_hidden_states=True)
        cells = jnp.stack(outputs.hidden_states, axis=2)
        return jax.lax.stop_gradient(cells), attention_mask.astype(jnp.float32)

    def contrastive_embedding(self, input_ids, attention_mask):
        if self.contrastive_head is None:
            raise ValueError("this checkpoint has no contrastive head (config.use_contrastive_head is False)")
        return self.contrastive_head(*self.hidden_cells(input_ids, attention_mask))

    def confidence_logit(self, input_ids, attention_mask):
        if self.confidence_head is None:
            raise ValueError("this checkpoint has no confidence head (config.use_confidence_head is False)")
        return self.confidence_head(*self.hidden_cells(input_ids, attention_mask))


# --------------------------------------------------------------------------------------------------
# HF wrappers


SAFE_WEIGHTS_NAME = "model.safetensors"


def flax_params_to_hf(params, config: NeedleConfig, *, prefix: str = "") -> dict[str, np.ndarray]:
    """Flax parameters -> HF-named PyTorch-layout numpy tensors (Dense kernels transposed).

    `prefix` is prepended to every name ("model." for the bare backbone). The result is checked
    against the weight-name table, so a layout drift raises instead of writing a bad file.
    """
    tensors = {}
    for path, leaf in flatten_dict(unfreeze(params)).items():
        name = prefix + ".".join(path)
        leaf = np.asarray(leaf)
        if path[-1] == "kernel":
            name, leaf = name[: -len("kernel")] + "weight", leaf.T
        elif path[-1] == "embedding":
            name = name[: -len("embedding")] + "weight"
        tensors[name] = np.ascontiguousarray(leaf) if leaf.ndim else leaf
    expected = hf_weight_shapes(config)
    if prefix:
        expected = {k: v for k, v in expected.items() if k.startswith(prefix)}
    check_tensor_shapes({k: v.shape for k, v in tensors.items()}, expected, where="model parameters")
    return tensors


def check_tensor_shapes(found: dict, expected: dict, *, where: str, allow_extra_prefixes=()):
    """Raise `WeightMappingError` naming the first missing, unexpected or mis-shaped tensor."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise WeightMappingError(f"{where}: missing tensor {missing[0]} ({len(missing)} missing in all)")
    unexpected = sorted(k for k in set(found) - set(expected) if not k.startswith(tuple(allow_extra_prefixes)))
    if unexpected:
        raise WeightMappingError(f"{where}: unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected in all)")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise WeightMappingError(f"{where}: tensor {name}: expected shape {tuple(shape)}, got {tuple(found[name])}")


class FlaxNeedlePreTrainedModel(FlaxPreTrainedModel):
    """Weight init, cache init and the call interface shared by the Flax Needle models.

    Weights are saved and read as one PyTorch-layout `model.safetensors` (metadata `format: pt`),
    the file the PyTorch model reads too; loading checks every tensor name and shape first.
    """

    config_class = NeedleConfig
    base_model_prefix = "model"
    module_class: nn.Module = None
    # Name prefix of this class's tensors inside a causal-LM weight file.
    _weights_prefix = ""

    def __init__(
        self,
        config: NeedleConfig,
        input_shape: tuple = (1, 1),
        seed: int = 0,
        dtype: jnp.dtype = jnp.float32,
        _do_init: bool = True,
        _weights_will_load: bool = False,
        **kwargs,
    ):
        # When `from_pretrained` is about to overwrite every parameter (it has checked the file holds
        # them all), the initial values only give names and shapes: zeros from `eval_shape` skip
        # compiling a random init.
        self._weights_will_load = _weights_will_load
        module = self.module_class(config=config, dtype=dtype, **kwargs)
        super().__init__(config, module, input_shape=input_shape, seed=seed, dtype=dtype, _do_init=_do_init)

    def init_weights(self, rng: jax.random.PRNGKey, input_shape: tuple, params: FrozenDict = None) -> FrozenDict:
        input_ids = jnp.zeros(input_shape, dtype="i4")
        attention_mask = jnp.ones_like(input_ids)
        position_ids = jnp.broadcast_to(jnp.arange(input_shape[-1]), input_shape)
        init = partial(self.module.init, {"params": rng}, input_ids, attention_mask, position_ids)
        if self._weights_will_load and params is None:
            shapes = jax.eval_shape(init)["params"]
            return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)
        random_params = jax.jit(init)()["params"]
        if params is None:
            return random_params
        random_params = flatten_dict(unfreeze(random_params))
        params = flatten_dict(unfreeze(params))
        for missing_key in self._missing_keys:
            params[missing_key] = random_params[missing_key]
        self._missing_keys = set()
        return freeze(unflatten_dict(params))

    def save_pretrained(self, save_directory, params=None, push_to_hub: bool = False, token=None, **kwargs):
        """Write `config.json`, `generation_config.json` and a PyTorch-layout `model.safetensors`."""
        from safetensors.numpy import save_file

        if os.path.isfile(save_directory):
            raise ValueError(f"{save_directory} is a file; save_pretrained needs a directory")
        kwargs.pop("safe_serialization", None)
        kwargs.pop("max_shard_size", None)
        os.makedirs(save_directory, exist_ok=True)
        if push_to_hub:
            commit_message = kwargs.pop("commit_message", None)
            repo_id = kwargs.pop("repo_id", str(save_directory).rstrip(os.sep).split(os.sep)[-1])
            repo_id = self._create_repo(repo_id, token=token, **kwargs)
            files_timestamps = self._get_files_timestamps(save_directory)
        self.config.architectures = [type(self).__name__[len("Flax"):]]
        if self._auto_class is not None:
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(self, save_directory, config=self.config)
        self.config.save_pretrained(save_directory)
        if self.can_generate():
            self.generation_config.save_pretrained(save_directory)
        tensors = flax_params_to_hf(params if params is not None else self.params, self.config, prefix=self._weights_prefix)
        save_file(tensors, os.path.join(save_directory, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        stale = os.path.join(save_directory, "flax_model.msgpack")
        if os.path.exists(stale):
            os.remove(stale)
        if push_to_hub:
            self._upload_modified_files(
                save_directory, repo_id, files_timestamps, commit_message=commit_message, token=token
            )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        """Load like any Flax model, after checking every tensor of `model.safetensors` against the config.

        A missing, unexpected or mis-shaped tensor raises `WeightMappingError` instead of being
        silently re-initialised.
        """
        from safetensors import safe_open
        from transformers.utils import cached_file

        hub_keys = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
        hub_kwargs = {k: kwargs[k] for k in hub_keys if k in kwargs}
        if not isinstance(config, NeedleConfig):
            config = NeedleConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        weights = cached_file(pretrained_model_name_or_path, SAFE_WEIGHTS_NAME, **hub_kwargs)
        with safe_open(weights, framework="numpy") as f:
            if (f.metadata() or {}).get("format") != "pt":
                raise WeightMappingError(
                    f"{weights}: expected PyTorch-layout safetensors (metadata format 'pt'), "
                    f"found format {(f.metadata() or {}).get('format')!r}"
                )
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        expected = hf_weight_shapes(config)
        if cls._weights_prefix:
            # The bare backbone reads the backbone tensors of a causal-LM file and ignores its heads.
            expected = {k: v for k, v in expected.items() if k.startswith(cls._weights_prefix)}
            found = {k: v for k, v in found.items() if k.startswith(cls._weights_prefix)}
        check_tensor_shapes(found, expected, where=str(weights))
        kwargs.setdefault("_weights_will_load", True)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)

    def init_cache(self, batch_size: int, max_length: int):
        """An empty `cache` collection for decoding up to `max_length` positions."""
        input_ids = jnp.zeros((batch_size, max_length), jnp.int32)
        attention_mask = jnp.ones_like(input_ids)
        position_ids = jnp.broadcast_to(jnp.arange(max_length), input_ids.shape)
        variables = jax.eval_shape(
            lambda: self.module.init(jax.random.PRNGKey(0), input_ids, attention_mask, position_ids, init_cache=True)
        )
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), unfreeze(variables["cache"]))

    def _prepare_call(self, input_ids, attention_mask, position_ids, past_key_values):
        input_ids = jnp.asarray(input_ids, dtype="i4")
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), "i4")
        if position_ids is None:
            if past_key_values is not None:
                raise ValueError("pass `position_ids` when decoding with `past_key_values`")
            position_ids = jnp.clip(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
        if past_key_values is None and t > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {t} tokens exceeds max_position_embeddings={self.config.max_position_embeddings}"
            )
        return input_ids, jnp.asarray(attention_mask, "i4"), jnp.asarray(position_ids, "i4")

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        params: Optional[dict] = None,
        past_key_values: Optional[dict] = None,
        dropout_rng: jax.random.PRNGKey = None,
        train: bool = False,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        output_mtp_logits: bool = False,
        return_dict: Optional[bool] = None,
    ):
        if output_attentions:
            raise NotImplementedError("Needle does not return attention weights")
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        input_ids, attention_mask, position_ids = self._prepare_call(input_ids, attention_mask, position_ids, past_key_values)
        variables = {"params": params or self.params}
        variables["params"] = training_weights(variables["params"], self.config, train=train)  # deploy numerics hook
        kwargs = dict(output_hidden_states=output_hidden_states, return_dict=return_dict)
        if self.module_class is FlaxNeedleForCausalLMModule:
            kwargs["output_mtp_logits"] = output_mtp_logits
        if past_key_values is not None:
            variables["cache"] = past_key_values
            outputs, updated = self.module.apply(
                variables, input_ids, attention_mask, position_ids, mutable=["cache"], **kwargs
            )
            cache = unfreeze(updated["cache"])
            if return_dict:
                return outputs.replace(past_key_values=cache) if hasattr(outputs, "replace") else outputs
            return outputs[:1] + (cache,) + outputs[1:]
        return self.module.apply(variables, input_ids, attention_mask, position_ids, **kwargs)


class FlaxNeedleModel(FlaxNeedlePreTrainedModel):
    """The bare Needle 2 backbone; `last_hidden_state` is the final-normed lane mean."""

    module_class = FlaxNeedleModule
    _weights_prefix = "model."


class FlaxNeedleForCausalLM(FlaxNeedlePreTrainedModel):
    """Needle 2 with its tied language-model head, the MTP head and (when present) the pooling heads."""

    module_class = FlaxNeedleForCausalLMModule

    def prepare_inputs_for_generation(self, input_ids, max_length, attention_mask: Optional[jax.Array] = None):
        batch_size, prompt_length = input_ids.shape
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({prompt_length} tokens) plus new tokens reach {max_length} positions, more than "
                f"max_position_embeddings={self.config.max_position_embeddings}; shorten the prompt or max_new_tokens"
            )
        past_key_values = self.init_cache(batch_size, max_length)
        extended_mask = jnp.ones((batch_size, max_length), dtype="i4")
        if attention_mask is not None:
            position_ids = jnp.clip(attention_mask.cumsum(axis=-1) - 1, 0)
            extended_mask = jax.lax.dynamic_update_slice(extended_mask, attention_mask.astype("i4"), (0, 0))
        else:
            position_ids = jnp.broadcast_to(jnp.arange(prompt_length, dtype="i4")[None, :], (batch_size, prompt_length))
        return {"past_key_values": past_key_values, "attention_mask": extended_mask, "position_ids": position_ids}

    def update_inputs_for_generation(self, model_outputs, model_kwargs):
        model_kwargs["past_key_values"] = model_outputs.past_key_values
        model_kwargs["position_ids"] = model_kwargs["position_ids"][:, -1:] + 1
        return model_kwargs

    def _apply_method(self, method, input_ids, attention_mask, params):
        input_ids = jnp.asarray(input_ids, "i4")
        mask = None if attention_mask is None else jnp.asarray(attention_mask, "i4")
        return self.module.apply({"params": params or self.params}, input_ids, mask, method=method)

    def contrastive_embedding(self, input_ids, attention_mask=None, params=None):
        """Tool-retrieval embedding: (unit-norm [B, contrastive_dim], log_temperature).

        Without `attention_mask`, tokens equal to `pad_token_id` are treated as padding (as the reference does).
        """
        return self._apply_method(FlaxNeedleForCausalLMModule.contrastive_embedding, input_ids, attention_mask, params)

    def confidence_logit(self, input_ids, attention_mask=None, params=None):
        """Confidence logit [B] (float32) of the confidence head."""
        return self._apply_method(FlaxNeedleForCausalLMModule.confidence_logit, input_ids, attention_mask, params)


__all__ = ["FlaxNeedleForCausalLM", "FlaxNeedleModel", "FlaxNeedlePreTrainedModel", "FlaxNeedleCausalLMOutput"]
