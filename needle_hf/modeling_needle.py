"""PyTorch Needle 2 (Cactus Compute's Simple Attention Network) for Hugging Face Transformers.

The forward pass reproduces the reference implementation (cactus-needle 2.x) step by step:

1. ``x0 = E[tokens] * sqrt(d)``.
2. Engram memory: each engram site hashes the n-grams ending at every position into its tables,
   projects the fetched rows to a key and a value, and smooths the value with a causal dilated
   convolution. The layer that owns the site adds ``sigmoid(<u, key> / sqrt(d)) * value`` to its
   input.
3. Hyper-connections: the residual stream is ``hyper_connection_lanes`` lanes; every layer reads a
   mix of the lanes, runs the block on it and writes the result back through a Sinkhorn-normalised
   lane-mixing matrix.
4. The block: zero-centred RMS norms (gain ``1 + weight``), grouped-query attention with q/k norms,
   half-split RoPE and a sigmoid output gate, a scalar ``sigmoid(attention_gate)`` on the attention
   branch, and a Hadamard MLP (diagonal scalings around two Walsh-Hadamard transforms).
5. Output: the lane mean, a final norm, logits tied to the token embedding (always float32).

Optional parts: the multi-token-prediction head (``mtp_logits[t]`` predicts token ``t + 2``) and the
probe-pooling heads of tool retrieval (contrastive) and answer confidence.

Numerics follow the reference: norms, hyper-connection routing and engram gates run in float32 and
cast back to the compute dtype (the dtype of the parameters), logits are float32.

This file ships as remote code next to saved weights, so it imports only ``configuration_needle``
and ``numerics`` from this package (relatively) and nothing from jax.

Version notes (transformers 4.57 and 5.x):
- 5.x renamed the cache argument and output field ``past_key_values`` to ``cache``. The forward
  passes accept both names, and the outputs fill whichever field the installed transformers defines
  (`CACHE_OUTPUT_FIELD`).
- The engram needs the tokens that precede the new ones, which a KV cache does not hold. Instead of
  a custom `Cache` subclass (whose reordering hooks differ between versions), `generate()` hands
  them over: `NeedleForCausalLM.prepare_inputs_for_generation` cuts ``engram_context_ids`` (the last
  `NeedleModel.engram_context_length` tokens before the new ones) out of the full ``input_ids`` that
  `GenerationMixin` passes every step. Beam search reorders ``input_ids``, so the context follows
  the beams without a cache hook. Manual cached loops pass ``engram_context_ids`` themselves.
- There is no ``lm_head`` module: logits are ``hidden @ embed_tokens.weight.T``, so the state dict
  holds only the weight table of `weight_names.py`; `get_output_embeddings` returns the embedding.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_needle import NeedleConfig
from .numerics import (
    ENGRAM_HASH_PRIME,
    ENGRAM_HASH_SHIFT,
    SINKHORN_ITERATIONS,
    SINKHORN_LINEAR_SPACE_MAX_SPREAD,
    UINT32_MASK,
    engram_table_orders,
    engram_table_seeds,
    hyper_connection_offsets,
    rope_inverse_frequencies,
    walsh_matrix,
)

# Name of the cache field in transformers' model outputs: `cache` from the 5.x rename on,
# `past_key_values` before. GenerationMixin reads the cache back from this field.
CACHE_OUTPUT_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_BASE_CACHE_OUTPUT_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"

# Reference initialisation constants (cactus-needle `architecture.py`).
HYPER_CONNECTION_ALPHA_INIT = 0.01
HYPER_CONNECTION_RES_BIAS_INIT = 4.0  # res_bias = 4 * identity: lanes start (almost) unmixed
HADAMARD_DIAG_OUT_INIT = 0.02
CONTRASTIVE_TEMPERATURE_INIT = 0.07
# Probe counts of the pooling heads (fixed by the architecture).
CONTRASTIVE_PROBES = 4
CONFIDENCE_PROBES = 8
# Epsilon of the contrastive embedding's L2 normalisation.
CONTRASTIVE_NORM_EPS = 1e-12


class NeedleWeightsError(ValueError):
    """A checkpoint's tensors do not match the model the config describes."""


# --------------------------------------------------------------------------------------------------
# Numerical building blocks


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight) * x / sqrt(mean(x^2) + eps)`` over the last axis, cast back to ``x``'s dtype.

    The mean of squares is float32; ``1 + weight`` and its product with ``x`` happen in the
    parameter/input dtype before the float32 division, as in the reference (this matters for fp16
    checkpoints).
    """
    x_f32 = x.float()
    rms = torch.sqrt((x_f32 * x_f32).mean(dim=-1, keepdim=True) + eps)  # x * x: pow(2) bit for bit, cheaper
    return (((1 + weight) * x) / rms).to(x.dtype)


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Float32 ``x / sqrt(mean(x^2) + eps)`` over the last axis, no gain."""
    x = x.float()
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE: ``[x1 cos - x2 sin, x2 cos + x1 sin]``, computed in float32.

    Written as ``x * cos + [-x2, x1] * sin`` with each table repeated over both halves: the same
    products and sums, bit for bit (negation is exact), in 5 tensor ops instead of 8.
    x: [B, heads, S, head_dim]; cos, sin: [B, 1, S, head_dim] float32 (each half the same).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rotary_tables(positions: torch.Tensor, inverse_frequencies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 RoPE ``cos, sin`` [..., hd] of integer ``positions`` [...], each half the same (see `apply_rotary`)."""
    angles = positions.float()[..., None] * inverse_frequencies  # [..., hd/2]
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cos(angles), torch.sin(angles)


def shift_right(x: torch.Tensor, offset: int) -> torch.Tensor:
    """``x[:, t - offset]`` along axis 1, zero (False) where ``t < offset``."""
    if offset == 0:
        return x
    filler = torch.zeros_like(x[:, :offset])
    return torch.cat([filler, x[:, : max(x.shape[1] - offset, 0)]], dim=1)[:, : x.shape[1]]


def log_space_sinkhorn(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """Sinkhorn normalisation of [..., n, n] float32 logits as the reference states it: each round
    subtracts the logsumexp over rows, then over columns; the result is ``exp`` of the final logits."""
    log_k = logits
    for _ in range(iterations):
        log_k = log_k - torch.logsumexp(log_k, dim=-1, keepdim=True)
        log_k = log_k - torch.logsumexp(log_k, dim=-2, keepdim=True)
    return torch.exp(log_k)


def sinkhorn(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """Doubly-stochastic [..., n, n] float32 matrices: `log_space_sinkhorn`, computed in linear space.

    Subtracting a row's logsumexp from its logits is dividing ``exp(logits)`` by the row's sum, so
    ``k = exp(logits - max)`` normalised by row sums, then column sums, per round, is the same
    computation in exact arithmetic. It takes 2 tensor ops per half-round instead of about 9 (a
    logsumexp is max, subtract, exp, sum, log, add, with infinity guards); the routing matrices are
    tiny ([B, S, 4, 4], 20 rounds in each of 27 layers), so op count is all their cost in decoding.
    (Updating row and column scaling vectors with `bmm` instead is as few ops, but a batched matmul
    opens an OpenMP parallel region per call, which costs far more than the arithmetic whenever
    more than one thread is set.)

    Linear space could underflow where one matrix's logits spread far (see
    ``SINKHORN_LINEAR_SPACE_MAX_SPREAD``); wider logits take the log-space path (checking the spread
    reads one number back to the host).
    """
    shifted = logits - logits.amax(dim=(-2, -1), keepdim=True)  # each matrix's largest logit at 0
    if shifted.numel() and shifted.min().item() < -SINKHORN_LINEAR_SPACE_MAX_SPREAD:
        return log_space_sinkhorn(logits, iterations)
    k = torch.exp(shifted)
    for _ in range(iterations):
        k = k / k.sum(dim=-1, keepdim=True)
        k = k / k.sum(dim=-2, keepdim=True)
    return k


def lane_mean(lanes: torch.Tensor) -> torch.Tensor:
    """Mean over the hyper-connection lanes [B, S, L, d] -> [B, S, d], accumulated in float32."""
    return lanes.float().mean(dim=2).to(lanes.dtype)


def engram_hash_indices(tokens: torch.Tensor, orders, num_heads: int, slots: int) -> torch.Tensor:
    """Hash-table rows [B, T, tables] of the n-grams ending at each position (tokens before the start are 0).

    32-bit FNV-style hash in int64 arithmetic: a state below 2**32 times the prime stays below 2**63.
    All tables are hashed together (integer arithmetic, so exactly as one at a time): token ``t - back``
    is folded into the tables whose order exceeds ``back``.
    """
    tokens = tokens.long()
    device = tokens.device
    seeds = torch.tensor(engram_table_seeds(len(orders), num_heads), dtype=torch.long, device=device)  # [tables]
    table_orders = torch.tensor(engram_table_orders(orders, num_heads), device=device)  # [tables]
    acc = seeds.expand(*tokens.shape, -1)  # [B, T, tables]
    for back in range(max(orders)):
        folded = ((acc ^ shift_right(tokens, back)[..., None]) * ENGRAM_HASH_PRIME) & UINT32_MASK
        acc = folded if back < min(orders) else torch.where(table_orders > back, folded, acc)
    acc = acc ^ (acc >> ENGRAM_HASH_SHIFT)
    return acc % slots


def attention_allowed(key_visible: torch.Tensor, past_length: int, query_length: int, group: int) -> torch.Tensor:
    """Boolean attention mask [B, 1, group * S, past + S]: causal, restricted to visible keys.

    A query may always attend to itself, so that the rows of padding positions (which see no visible
    key) stay finite; real positions are unaffected because they see themselves anyway.
    The [S, past + S] rows repeat ``group`` times: one copy per query head that shares a key/value
    head (`NeedleAttention` stacks those heads' queries, rows ordered (head in group, position)).
    """
    device = key_visible.device
    query_positions = torch.arange(query_length, device=device) + past_length  # [S]
    key_positions = torch.arange(key_visible.shape[1], device=device)  # [K]
    causal = key_positions[None, :] <= query_positions[:, None]  # [S, K]
    itself = key_positions[None, :] == query_positions[:, None]  # [S, K]
    allowed = (causal[None] & key_visible[:, None, :]) | itself[None]  # [B, S, K]
    return allowed.repeat(1, group, 1)[:, None]  # [B, 1, group * S, K]


def default_position_ids(
    attention_mask: Optional[torch.Tensor], past_length: int, length: int, batch: int, device
) -> torch.Tensor:
    """Positions [B, S] of the new tokens: ``cumsum(mask) - 1`` over the whole mask (padding does not
    advance the position), or ``past_length + arange(S)`` without a mask."""
    if attention_mask is None:
        return (torch.arange(length, device=device) + past_length)[None].expand(batch, -1)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, -length:]


@dataclass
class NeedleStepInputs:
    """Tensors derived once per forward call and shared by every layer (and the MTP block).

    key_visible: [B, past + S] bool, which positions are real (not padding).
    allowed: [B, 1, group * S, past + S] bool attention mask (see `attention_allowed`).
    attention_bias: the same mask as an additive bias in the compute dtype (0 allowed, -inf not),
        built once here instead of by `scaled_dot_product_attention` in every layer.
    cos, sin: [B, 1, S, head_dim] float32 RoPE tables of the new positions (both halves the same).
    walsh: [n, n] Walsh-Hadamard matrix (compute dtype).
    pre_offsets, post_offsets: [layers, L] float32 lane-ownership offsets of the hyper-connection
        logits (`numerics.hyper_connection_offsets`).
    """

    key_visible: torch.Tensor
    allowed: torch.Tensor
    attention_bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    walsh: torch.Tensor
    pre_offsets: torch.Tensor
    post_offsets: torch.Tensor


# --------------------------------------------------------------------------------------------------
# Modules


class NeedleRMSNorm(nn.Module):
    """Zero-centred RMS norm: the gain is ``1 + weight`` (weight initialised to 0)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gain=1+weight"


class NeedleResidualLinear(nn.Linear):
    """A projection that writes into the residual stream (attention output, engram value).

    Only its initialisation differs: N(0, 0.02 / sqrt(2 L)) as in the reference, instead of N(0, 0.02).
    """


class NeedleAttention(nn.Module):
    """Grouped-query self-attention with q/k norms, half-split RoPE and a sigmoid output gate."""

    def __init__(self, config: NeedleConfig, layer_idx: Optional[int]):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx  # index into the KV cache; None for the (uncached) MTP block
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, a, kv = config.hidden_size, config.attention_dim, config.kv_dim
        self.q_proj = nn.Linear(d, a, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.gate_proj = nn.Linear(d, a, bias=False)
        self.o_proj = NeedleResidualLinear(a, d, bias=False)
        self.q_norm = NeedleRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = NeedleRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        step: NeedleStepInputs,
        cache: Optional[Cache] = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: [B, S, d] (normed) -> ([B, S, d], attention probabilities [B, H, S, past + S] or None)."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, S, hd]
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, S, hd]
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, S, hd]
        q = apply_rotary(self.q_norm(q), step.cos, step.sin)
        k = apply_rotary(self.k_norm(k), step.cos, step.sin)
        if cache is not None and self.layer_idx is not None:
            k, v = cache.update(k, v, self.layer_idx)  # [B, KV, past + S, hd]

        # Query head h reads key/value head h // group. Stacking each group's queries as rows,
        # [B, KV, group * S, hd], lets every key/value head serve its group where it lies, instead of
        # copying the whole cache `group` times per layer and step (`step.allowed` repeats to match).
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, self.num_kv_heads, group * length, self.head_dim)

        probs = None
        if self.config._attn_implementation == "sdpa" and not need_weights:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=step.attention_bias)
        else:
            # Eager: float32 scores and softmax, probabilities cast to the value dtype (as the reference).
            scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.head_dim**-0.5
            scores = scores.masked_fill(~step.allowed, torch.finfo(torch.float32).min)
            probs = scores.softmax(dim=-1)  # [B, KV, group * S, past + S]
            out = torch.matmul(probs.to(v.dtype), v)
            probs = probs.view(batch, self.num_heads, length, -1)  # [B, H, S, past + S]
        out = out.view(batch, self.num_heads, length, self.head_dim).transpose(1, 2).reshape(batch, length, -1)
        out = out * torch.sigmoid(self.gate_proj(x))  # [B, S, attention_dim]
        return self.o_proj(out), (probs if need_weights else None)


class NeedleHadamardMLP(nn.Module):
    """``z = (d1 * z) H; z = silu(d2 * z) H; out = (d3 * z)[:d]`` with ``z`` zero padded to ``n`` (a power of two)."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        n = config.hadamard_size
        self.hidden_size = config.hidden_size
        self.diag_in = nn.Parameter(torch.ones(n))
        self.diag_hidden = nn.Parameter(torch.ones(n))
        self.diag_out = nn.Parameter(torch.full((n,), HADAMARD_DIAG_OUT_INIT))

    def forward(self, x: torch.Tensor, walsh: torch.Tensor) -> torch.Tensor:
        """x: [B, S, d], walsh: [n, n] -> [B, S, d]."""
        padding = walsh.shape[0] - self.hidden_size
        z = F.pad(x, (0, padding)) if padding else x  # [B, S, n]
        z = (self.diag_in * z) @ walsh
        z = F.silu(self.diag_hidden * z) @ walsh
        return (self.diag_out * z)[..., : self.hidden_size]


class NeedleBlock(nn.Module):
    """One transformer block ``u -> Block(u)`` (the residual stream in and out, [B, S, d]).

    Decoder layers extend it with hyper-connections; the MTP head uses it as is.
    """

    def __init__(self, config: NeedleConfig, layer_idx: Optional[int]):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = NeedleRMSNorm(d, eps)
        self.self_attn = NeedleAttention(config, layer_idx)
        self.post_attention_layernorm = NeedleRMSNorm(d, eps)
        self.attention_gate = nn.Parameter(torch.zeros(()))
        self.pre_feedforward_layernorm = NeedleRMSNorm(d, eps)
        self.mlp = NeedleHadamardMLP(config)

    def block(
        self,
        x: torch.Tensor,
        step: NeedleStepInputs,
        cache: Optional[Cache] = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: [B, S, d] -> ([B, S, d], attention probabilities or None)."""
        attended, probs = self.self_attn(self.input_layernorm(x), step, cache=cache, need_weights=need_weights)
        # sigmoid in the parameter dtype, then cast (the reference's `_gate`).
        gate = torch.sigmoid(self.attention_gate).to(x.dtype)
        x = x + gate * self.post_attention_layernorm(attended)
        x = x + self.mlp(self.pre_feedforward_layernorm(x), step.walsh)
        return x, probs

    def forward(self, x: torch.Tensor, step: NeedleStepInputs) -> torch.Tensor:
        return self.block(x, step)[0]


class NeedleHyperConnection(nn.Module):
    """Lane routing of one layer: how much of each lane the block reads (pre), how much of the block
    output each lane receives (post), and the doubly-stochastic lane mixing (res).

    Every coefficient is computed from the float32 unit-RMS flattened lanes ``x̂`` [B, S, lanes * d].
    """

    def __init__(self, config: NeedleConfig, layer_idx: int):
        super().__init__()
        lanes = config.hyper_connection_lanes
        width = lanes * config.hidden_size
        self.lanes = lanes
        self.eps = config.rms_norm_eps
        self.pre_proj = nn.Linear(width, lanes, bias=False)
        self.post_proj = nn.Linear(width, lanes, bias=False)
        self.res_proj = nn.Linear(width, lanes * lanes, bias=False)
        self.pre_bias = nn.Parameter(torch.zeros(lanes))
        self.post_bias = nn.Parameter(torch.zeros(lanes))
        self.res_bias = nn.Parameter(HYPER_CONNECTION_RES_BIAS_INIT * torch.eye(lanes))
        self.pre_alpha = nn.Parameter(torch.tensor(HYPER_CONNECTION_ALPHA_INIT))
        self.post_alpha = nn.Parameter(torch.tensor(HYPER_CONNECTION_ALPHA_INIT))
        self.res_alpha = nn.Parameter(torch.tensor(HYPER_CONNECTION_ALPHA_INIT))
        # Layer i owns lane i mod lanes: fixed logit offsets (not parameters), `step.pre_offsets[i]`.
        self.layer_idx = layer_idx

    @staticmethod
    def _scaled_projection(unit: torch.Tensor, proj: nn.Linear, alpha: torch.Tensor) -> torch.Tensor:
        """``alpha * (x̂ @ W.T)`` in float32."""
        return alpha.float() * F.linear(unit, proj.weight.float())

    def route(
        self, lanes: torch.Tensor, step: NeedleStepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """lanes: [B, S, L, d] -> (read weights [B, S, L], write weights [B, S, L], mixing [B, S, L, L]), float32."""
        batch, length, n, width = lanes.shape
        unit = rms_unit(lanes.reshape(batch, length, n * width), self.eps)  # [B, S, L * d]
        pre_offset, post_offset = step.pre_offsets[self.layer_idx], step.post_offsets[self.layer_idx]  # [L]
        read = torch.sigmoid(
            self._scaled_projection(unit, self.pre_proj, self.pre_alpha) + self.pre_bias.float() + pre_offset
        )
        write = 2 * torch.sigmoid(
            self._scaled_projection(unit, self.post_proj, self.post_alpha) + self.post_bias.float() + post_offset
        )
        mix_logits = self._scaled_projection(unit, self.res_proj, self.res_alpha).view(batch, length, n, n)
        mixing = sinkhorn(mix_logits + self.res_bias.float())
        return read, write, mixing


class NeedleDecoderLayer(NeedleBlock):
    """A block wrapped in hyper-connections; maps lanes [B, S, L, d] to lanes."""

    def __init__(self, config: NeedleConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.hidden_size = config.hidden_size
        self.hyper_connection = NeedleHyperConnection(config, layer_idx)

    def forward(
        self,
        lanes: torch.Tensor,
        step: NeedleStepInputs,
        cache: Optional[Cache] = None,
        engram: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """lanes: [B, S, L, d]; engram: (key, value) [B, S, d] of this layer's engram site, if any."""
        read, write, mixing = self.hyper_connection.route(lanes, step)
        lanes_f32 = lanes.float()
        # Batched matrix products over (b, s) (what einsum would run, without its per-call planning).
        u = torch.matmul(read[:, :, None, :], lanes_f32)[:, :, 0].to(lanes.dtype)  # [B, S, d]
        x = u
        if engram is not None:
            key, value = engram
            eps = self.hyper_connection.eps
            relevance = (rms_unit(u, eps) * rms_unit(key, eps)).sum(-1) / math.sqrt(self.hidden_size)  # [B, S]
            x = u + (torch.sigmoid(relevance)[..., None] * value.float()).to(u.dtype)
        y, probs = self.block(x, step, cache=cache, need_weights=need_weights)
        y = y - u
        mixed = torch.matmul(mixing, lanes_f32) + write[..., None] * y.float()[:, :, None, :]  # [B, S, L, d]
        return mixed.to(lanes.dtype), probs


class NeedleEngram(nn.Module):
    """Hashed n-gram memory of one site: fetched table rows -> (key, convolved value), [B, T, d] each."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        d = config.hidden_size
        self.num_tables = config.engram_num_tables
        self.dilation = config.engram_conv_dilation
        self.reach = config.engram_conv_reach
        self.tables = nn.Parameter(torch.zeros(config.engram_num_tables, config.engram_slots, config.engram_sub_dim))
        self.key_proj = nn.Linear(config.engram_dim, d, bias=False)
        self.value_proj = NeedleResidualLinear(config.engram_dim, d, bias=False)
        taps = torch.zeros(config.engram_conv_taps, d)
        taps[0] = 1.0
        self.conv_taps = nn.Parameter(taps)

    def forward(
        self,
        indices: torch.Tensor,
        ngram_visible: torch.Tensor,
        visible: torch.Tensor,
        first_output: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) [B, T - first_output, d] of window positions ``first_output..T-1``.

        indices: [B, T, tables] rows of the window's n-grams; ngram_visible: [B, T, tables] whether each
        n-gram lies in the visible text; visible: [B, T] whether each window position is visible.
        The value at ``t`` is ``sum_j taps[j] * v[t - j * dilation]`` over visible earlier positions
        (zero before the window, which starts at the text or reaches back `engram_history` tokens).
        """
        batch, length, _ = indices.shape
        table_ids = torch.arange(self.num_tables, device=indices.device)
        rows = self.tables[table_ids, indices]  # [B, T, tables, sub_dim]
        rows = rows * ngram_visible[..., None].to(rows.dtype)
        fetched = rows.reshape(batch, length, -1).to(dtype)  # [B, T, engram_dim]
        key = self.key_proj(fetched[:, first_output:])
        # Hidden positions contribute zero to every tap; zeros in front stand for positions before the window.
        reach = self.reach
        value_rows = self.value_proj(fetched) * visible[..., None].to(dtype)  # [B, T, d]
        value_rows = F.pad(value_rows, (0, 0, reach, 0))  # [B, reach + T, d]
        taps = self.conv_taps.to(dtype)
        value = 0
        for j in range(taps.shape[0]):
            start = reach + first_output - j * self.dilation
            value = value + taps[j] * value_rows[:, start : start + length - first_output]
        return key, value


def engram_window_memory(
    engrams: nn.ModuleList,
    config: NeedleConfig,
    window_ids: torch.Tensor,
    window_visible: torch.Tensor,
    first_output: int,
    dtype: torch.dtype,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Engram (key, value) [B, T - first_output, d] of window positions ``first_output..T-1``, by the
    layer that reads them.

    window_ids: [B, T] token ids; window_visible: [B, T] bool, whether each position is real text
    (positions hidden here contribute zero, exactly like positions before the window).
    """
    indices = engram_hash_indices(window_ids, config.engram_orders, config.engram_num_heads, config.engram_slots)
    # An n-gram of order o ending at t is visible when its first token, t - (o - 1), is.
    visible_by_order = {order: shift_right(window_visible, order - 1) for order in config.engram_orders}
    table_orders = engram_table_orders(config.engram_orders, config.engram_num_heads)
    ngram_visible = torch.stack([visible_by_order[order] for order in table_orders], dim=-1)  # [B, T, tables]
    return {
        layer_idx: engram(indices, ngram_visible, window_visible, first_output, dtype)
        for engram, layer_idx in zip(engrams, config.engram_layers)
    }


def tied_logits(hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
    """Float32 ``hidden @ E.T``: [..., d] -> [..., V] (the output head is the token embedding)."""
    return hidden.float() @ embedding_weight.float().T


class NeedleMultiTokenPrediction(nn.Module):
    """MTP head: ``block(cat(h, norm(E[next] * sqrt(d))) W)`` then a norm; its tied logits predict token t + 2."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        d = config.hidden_size
        self.combine_proj = nn.Linear(2 * d, d, bias=False)
        self.embed_norm = NeedleRMSNorm(d, config.rms_norm_eps)
        self.norm = NeedleRMSNorm(d, config.rms_norm_eps)
        self.block = NeedleBlock(config, layer_idx=None)

    def forward(self, hidden: torch.Tensor, next_embedded: torch.Tensor, step: NeedleStepInputs) -> torch.Tensor:
        """hidden: [B, S, d] final-normed backbone output; next_embedded: [B, S, d] float32 ``E[t+1] * sqrt(d)``."""
        combined = torch.cat([hidden, self.embed_norm(next_embedded).to(hidden.dtype)], dim=-1)
        return self.norm(self.block(self.combine_proj(combined), step))


def probe_pool(cells: torch.Tensor, keep: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """Attention pooling of every (position, layer) cell by learned probes.

    cells: [B, T, L + 1, d] float32; keep: [B, T] bool; probes: [K, d] -> [B, K * d] float32.
    """
    batch, length, depth, width = cells.shape
    flat = cells.reshape(batch, length * depth, width)
    keep = keep.repeat_interleave(depth, dim=1)  # position-major, like the cells
    scores = torch.einsum("bcd,kd->bkc", flat, probes.float()) / math.sqrt(width)
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    weights = scores.softmax(dim=-1)
    return torch.einsum("bkc,bcd->bkd", weights, flat).reshape(batch, -1)


class NeedleContrastiveHead(nn.Module):
    """Tool-retrieval embedding: probe pooling, a projection, L2 normalisation, plus a learned log-temperature."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        self.probes = nn.Parameter(torch.zeros(CONTRASTIVE_PROBES, config.hidden_size))
        self.proj = nn.Linear(CONTRASTIVE_PROBES * config.hidden_size, config.contrastive_dim, bias=False)
        self.log_temperature = nn.Parameter(torch.tensor(math.log(CONTRASTIVE_TEMPERATURE_INIT)))

    def forward(self, cells: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        projected = self.proj(probe_pool(cells, keep, self.probes).to(dtype))  # [B, C]
        norm = torch.sqrt(projected.float().pow(2).sum(-1, keepdim=True) + CONTRASTIVE_NORM_EPS)
        return projected / norm.to(projected.dtype)


class NeedleConfidenceHead(nn.Module):
    """Answer-confidence logit: probe pooling and an affine map to one float32 logit per sequence."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        self.probes = nn.Parameter(torch.zeros(CONFIDENCE_PROBES, config.hidden_size))
        self.proj = nn.Linear(CONFIDENCE_PROBES * config.hidden_size, 1, bias=True)

    def forward(self, cells: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.proj(probe_pool(cells, keep, self.probes).to(dtype))[..., 0].float()


# --------------------------------------------------------------------------------------------------
# Outputs


@dataclass
class NeedleCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus ``mtp_logits`` [B, S, V] float32 (when requested): ``mtp_logits[:, t]``
    scores token ``t + 2``. The cache field is ``past_key_values`` (transformers 4.x) or ``cache`` (5.x)."""

    mtp_logits: Optional[torch.FloatTensor] = None


def _config_default(value, config, name: str, default):
    """An explicit argument, else the config's attribute (absent in some transformers versions), else ``default``."""
    return value if value is not None else getattr(config, name, default)


def _merge_cache_arguments(past_key_values, cache) -> Optional[Cache]:
    """Accept the cache under its 4.x name (`past_key_values`) or its 5.x name (`cache`)."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("pass the KV cache once, as `past_key_values` or as `cache`, not both")
    found = cache if cache is not None else past_key_values
    if found is not None and not isinstance(found, Cache):
        raise TypeError(
            f"Needle needs a transformers `Cache` (e.g. DynamicCache) as its KV cache, got {type(found).__name__}; "
            "legacy tuple caches are not supported"
        )
    return found


# --------------------------------------------------------------------------------------------------
# Pretrained-model plumbing


def _init_value(tensor: torch.Tensor, value) -> None:
    """Set a deterministic initial value, unless transformers marked the tensor as loaded from a checkpoint."""
    if getattr(tensor, "_is_hf_initialized", False):
        return
    with torch.no_grad():
        tensor.copy_(torch.as_tensor(value, dtype=tensor.dtype).expand_as(tensor))


class NeedlePreTrainedModel(PreTrainedModel):
    config_class = NeedleConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["NeedleDecoderLayer"]
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flash_attn_2 = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _supports_cache_class = True
    _supports_static_cache = False  # the engram context rides along with `input_ids`, see the module docstring
    _can_compile_fullgraph = False

    def _init_weights(self, module: nn.Module):
        """The reference initialisation: N(0, 0.02) projections, embeddings, tables and probes; residual-stream
        projections N(0, 0.02 / sqrt(2 L)); zero norms and gates; identity-like Hadamard, conv and lane mixing.

        Each module initialises only the parameters it owns directly: transformers 5.x skips modules
        without direct parameters here. Random draws go through `torch.nn.init` (which 5.x guards against
        re-initialising loaded tensors); fixed values through `_init_value`, which checks the same flag.
        """
        std = self.config.initializer_range
        if isinstance(module, NeedleResidualLinear):
            nn.init.normal_(module.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                _init_value(module.bias, 0.0)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, NeedleRMSNorm):
            _init_value(module.weight, 0.0)
        elif isinstance(module, NeedleHadamardMLP):
            _init_value(module.diag_in, 1.0)
            _init_value(module.diag_hidden, 1.0)
            _init_value(module.diag_out, HADAMARD_DIAG_OUT_INIT)
        elif isinstance(module, NeedleBlock):
            _init_value(module.attention_gate, 0.0)
        elif isinstance(module, NeedleHyperConnection):
            _init_value(module.pre_bias, 0.0)
            _init_value(module.post_bias, 0.0)
            _init_value(module.res_bias, HYPER_CONNECTION_RES_BIAS_INIT * torch.eye(module.lanes))
            for alpha in (module.pre_alpha, module.post_alpha, module.res_alpha):
                _init_value(alpha, HYPER_CONNECTION_ALPHA_INIT)
        elif isinstance(module, NeedleEngram):
            nn.init.normal_(module.tables, mean=0.0, std=std)
            taps = torch.zeros_like(module.conv_taps)
            taps[0] = 1.0
            _init_value(module.conv_taps, taps)
        elif isinstance(module, NeedleContrastiveHead):
            nn.init.normal_(module.probes, mean=0.0, std=std)
            _init_value(module.log_temperature, math.log(CONTRASTIVE_TEMPERATURE_INIT))
        elif isinstance(module, NeedleConfidenceHead):
            nn.init.normal_(module.probes, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, but strict: every tensor the config implies must be in the
        checkpoint with its exact shape, and no other tensor may be there. Raises `NeedleWeightsError`
        instead of randomly initialising what is missing.
        """
        wants_loading_info = kwargs.pop("output_loading_info", False)
        if kwargs.pop("ignore_mismatched_sizes", False):
            raise ValueError("Needle checkpoints load exactly; `ignore_mismatched_sizes=True` is not supported")
        # Let transformers report shape mismatches (instead of raising its own, version-specific error),
        # then refuse them below together with missing and unexpected tensors.
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path,
            *model_args,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            **kwargs,
        )
        _raise_unless_exact(model, loading_info, pretrained_model_name_or_path)
        return (model, loading_info) if wants_loading_info else model


def _local_checkpoint_shape(source, name: str) -> Optional[tuple]:
    """Shape of tensor ``name`` in the safetensors files of a local folder (None when not found there)."""
    if not os.path.isdir(str(source)):
        return None
    for file_name in sorted(os.listdir(source)):
        if file_name.endswith(".safetensors"):
            with safe_open(os.path.join(source, file_name), framework="pt") as handle:
                if name in handle.keys():
                    return tuple(handle.get_slice(name).get_shape())
    return None


def _raise_unless_exact(model: PreTrainedModel, loading_info: dict, source) -> None:
    missing = sorted(loading_info.get("missing_keys") or [])
    unused_prefixes = getattr(model, "_unused_checkpoint_prefixes", ())
    unexpected = sorted(
        name for name in loading_info.get("unexpected_keys") or [] if not name.startswith(unused_prefixes)
    )
    expected_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    mismatched = []
    for entry in loading_info.get("mismatched_keys") or []:
        # transformers 5.x reports (name, checkpoint shape, model shape); 4.57 reports the name only.
        if isinstance(entry, (tuple, list)):
            name, found = entry[0], tuple(entry[1])
        else:
            name, found = entry, _local_checkpoint_shape(source, entry)
        mismatched.append(f"{name}: expected {expected_shapes.get(name)}, got {found or 'a different shape'}")
    if not (missing or unexpected or mismatched):
        return

    def listing(names):
        shown = ", ".join(names[:5])
        return shown + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {listing(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) of the wrong shape: {listing(sorted(mismatched))}")
    hint = ""
    if any(name.startswith(("mtp.", "contrastive_head.", "confidence_head.")) for name in missing + unexpected):
        hint = (
            " The optional heads present must agree with use_mtp_head / use_contrastive_head /"
            " use_confidence_head in config.json."
        )
    raise NeedleWeightsError(
        f"{type(model).__name__}.from_pretrained({str(source)!r}): the checkpoint does not match the config: "
        + "; ".join(problems)
        + "."
        + hint
    )


# --------------------------------------------------------------------------------------------------
# Backbone


class NeedleModel(NeedlePreTrainedModel):
    """The Needle backbone: embedding, engram memory, hyper-connected decoder layers and the final norm.

    Weight names: ``embed_tokens.weight``, ``layers.{i}.*``, ``norm.weight``, ``engrams.{s}.*``.
    """

    # A NeedleForCausalLM checkpoint also holds the heads, which the bare backbone leaves unused.
    # (Not `_keys_to_ignore_on_load_unexpected`: transformers 5.x copies that onto every model that
    # contains this one, which would let NeedleForCausalLM ignore head tensors its config lacks.)
    _unused_checkpoint_prefixes = ("mtp.", "contrastive_head.", "confidence_head.")

    def __init__(self, config: NeedleConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([NeedleDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = NeedleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.engrams = nn.ModuleList([NeedleEngram(config) for _ in config.engram_layers])
        self.embed_scale = math.sqrt(config.hidden_size)
        # Constants derived from the config, kept out of the state dict: copies per (name, device, dtype).
        self._constant_copies: dict[tuple, torch.Tensor] = {}
        self.post_init()

    @property
    def engram_context_length(self) -> int:
        """Tokens before the new ones that the engram reads (`NeedleConfig.engram_history`)."""
        return self.config.engram_history

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.embed_tokens = value

    def constant(self, name: str, device, dtype) -> torch.Tensor:
        """A constant table of the architecture on ``device`` in ``dtype``, built once per placement:
        ``walsh`` [n, n] (the MLPs' orthonormal Walsh-Hadamard matrix), ``rope_inverse_frequencies``
        [head_dim // 2], ``pre_offsets`` / ``post_offsets`` [layers, L] (hyper-connection lane ownership)."""
        placement = (name, str(device), dtype)
        if placement not in self._constant_copies:
            config = self.config
            if name == "walsh":
                table = walsh_matrix(config.hadamard_size)
            elif name == "rope_inverse_frequencies":
                table = rope_inverse_frequencies(config.head_dim, config.rope_theta)
            elif name in ("pre_offsets", "post_offsets"):
                offsets = hyper_connection_offsets(config.num_hidden_layers, config.hyper_connection_lanes)
                table = offsets[0] if name == "pre_offsets" else offsets[1]
            else:
                raise KeyError(f"no constant table named {name!r}")
            self._constant_copies[placement] = torch.from_numpy(table).to(device=device, dtype=dtype)
        return self._constant_copies[placement]

    def step_inputs(
        self,
        batch: int,
        length: int,
        past_length: int,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
    ) -> NeedleStepInputs:
        """Masks, RoPE tables and the Walsh matrix of a forward call over ``length`` new tokens."""
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        total = past_length + length
        if attention_mask is None:
            key_visible = torch.ones(batch, total, dtype=torch.bool, device=device)
        else:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"Needle takes a 2-D attention_mask [batch, past + new tokens] marking real tokens with 1, "
                    f"got shape {tuple(attention_mask.shape)}"
                )
            if tuple(attention_mask.shape) != (batch, total):
                raise ValueError(
                    f"attention_mask must cover the cached and the new tokens: expected shape {(batch, total)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            key_visible = attention_mask.to(device=device, dtype=torch.bool)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, past_length, length, batch, device)
        inverse_frequencies = self.constant("rope_inverse_frequencies", device, torch.float32)
        cos, sin = rotary_tables(position_ids.to(device), inverse_frequencies)  # [B, S, hd] each
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        allowed = attention_allowed(key_visible, past_length, length, group)
        # What scaled_dot_product_attention turns a boolean mask into (`torch.where(mask, 0, -inf)`).
        attention_bias = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=device).masked_fill_(allowed, 0.0)
        return NeedleStepInputs(
            key_visible=key_visible,
            allowed=allowed,
            attention_bias=attention_bias,
            cos=cos[:, None],
            sin=sin[:, None],
            walsh=self.constant("walsh", device, dtype),
            pre_offsets=self.constant("pre_offsets", device, torch.float32),
            post_offsets=self.constant("post_offsets", device, torch.float32),
        )

    def engram_memory(
        self,
        input_ids: torch.Tensor,
        key_visible: torch.Tensor,
        past_length: int,
        engram_context_ids: Optional[torch.Tensor],
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Engram (key, value) [B, S, d] of the new tokens, by the layer that reads them.

        Positions hidden by the mask (padding) count as invisible: an n-gram or a conv tap that reaches
        one contributes zero, exactly like one that reaches before the start of the text.
        """
        if not self.engrams:
            return {}
        config = self.config
        batch, length = input_ids.shape
        if past_length == 0:
            if engram_context_ids is not None and engram_context_ids.numel() > 0:
                raise ValueError(
                    "engram_context_ids was given but the cache is empty: there is no text before input_ids"
                )
            window_ids, window_visible, first_new = input_ids, key_visible, 0
        else:
            needed = min(past_length, self.engram_context_length)
            if engram_context_ids is None or engram_context_ids.shape[1] < needed:
                found = "none" if engram_context_ids is None else f"{engram_context_ids.shape[1]} tokens"
                raise ValueError(
                    f"decoding with a cache of {past_length} tokens needs engram_context_ids, the last {needed} token "
                    f"ids before input_ids (the engram hashes n-grams across that boundary); found {found}. "
                    "generate() passes them automatically."
                )
            if engram_context_ids.shape[0] != batch:
                raise ValueError(
                    f"engram_context_ids has batch size {engram_context_ids.shape[0]}, input_ids {batch}"
                )
            context = engram_context_ids[:, engram_context_ids.shape[1] - needed :].to(input_ids.device)
            window_ids = torch.cat([context, input_ids], dim=1)
            window_visible = key_visible[:, past_length - needed :]
            first_new = needed

        return engram_window_memory(
            self.engrams, config, window_ids, window_visible, first_new, self.embed_tokens.weight.dtype
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 ``E[tokens] * sqrt(d)`` [B, S, d] (the reference scales before casting to the compute dtype)."""
        return self.embed_tokens(input_ids).float() * self.embed_scale

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        engram_context_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        **kwargs,
    ) -> Union[BaseModelOutputWithPast, tuple]:
        """Run the backbone on ``input_ids`` [B, S].

        Args:
            attention_mask: [B, past + S], 1 for real tokens and 0 for padding (left or right).
            position_ids: [B, S]; default ``cumsum(attention_mask) - 1`` (or ``past + arange(S)``).
            past_key_values / cache: a transformers `Cache` (the 4.x / 5.x name); created when
                ``use_cache`` and none is given.
            engram_context_ids: [B, >= min(past, engram_context_length)] the token ids right before
                ``input_ids``; required once the cache is not empty (`generate` passes them).
            output_hidden_states: return ``(x0, lane mean after layer 1, ..., after layer L)``; the
                final-normed output is ``last_hidden_state``.
            output_attentions: return each layer's attention probabilities (computed eagerly).

        Other keyword arguments that `generate` passes along (``cache_position``, ...) are ignored:
        positions come from the cache length and the mask.
        """
        if inputs_embeds is not None:
            raise ValueError(
                "Needle reads token ids (its engram memory hashes them): pass input_ids, not inputs_embeds"
            )
        if input_ids is None:
            raise ValueError("input_ids is required")
        cache = _merge_cache_arguments(past_key_values, cache)
        use_cache = _config_default(use_cache, self.config, "use_cache", True)
        output_attentions = _config_default(output_attentions, self.config, "output_attentions", False)
        output_hidden_states = _config_default(output_hidden_states, self.config, "output_hidden_states", False)
        return_dict = _config_default(return_dict, self.config, "return_dict", True)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        batch, length = input_ids.shape
        past_length = cache.get_seq_length() if cache is not None else 0
        step = self.step_inputs(batch, length, past_length, attention_mask, position_ids)
        dtype = self.embed_tokens.weight.dtype

        x0 = self.embed(input_ids).to(dtype)  # [B, S, d]
        memory = self.engram_memory(input_ids, step.key_visible, past_length, engram_context_ids)
        lanes = x0[:, :, None, :].expand(-1, -1, self.config.hyper_connection_lanes, -1)  # [B, S, L, d]

        all_hidden = (x0,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for i, layer in enumerate(self.layers):
            lanes, probs = layer(lanes, step, cache=cache, engram=memory.get(i), need_weights=output_attentions)
            if output_hidden_states:
                all_hidden += (lane_mean(lanes),)
            if output_attentions:
                all_attentions += (probs,)
        hidden = self.norm(lane_mean(lanes))

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden,
            hidden_states=all_hidden,
            attentions=all_attentions,
            **{_BASE_CACHE_OUTPUT_FIELD: cache if use_cache else None},
        )
        return output if return_dict else output.to_tuple()


# --------------------------------------------------------------------------------------------------
# Causal LM with the optional heads


class NeedleForCausalLM(NeedlePreTrainedModel, GenerationMixin):
    """Needle 2 for generation: the backbone, tied float32 logits, and the optional MTP,
    contrastive and confidence heads (present when the config says so).

    Weight names: ``model.*`` (the backbone), ``mtp.*``, ``contrastive_head.*``, ``confidence_head.*``.
    """

    # The output head is the token embedding itself (no lm_head tensor), so nothing needs tying.
    _tied_weights_keys = None

    def __init__(self, config: NeedleConfig):
        super().__init__(config)
        self.model = NeedleModel(config)
        self.mtp = NeedleMultiTokenPrediction(config) if config.use_mtp_head else None
        self.contrastive_head = NeedleContrastiveHead(config) if config.use_contrastive_head else None
        self.confidence_head = NeedleConfidenceHead(config) if config.use_confidence_head else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Embedding:
        """The output projection is tied to the token embedding: logits = hidden @ embed_tokens.weight.T."""
        return self.model.embed_tokens

    def set_output_embeddings(self, new_embeddings: nn.Embedding):
        self.model.embed_tokens = new_embeddings

    def get_decoder(self) -> NeedleModel:
        return self.model

    @property
    def engram_context_length(self) -> int:
        return self.model.engram_context_length

    def tied_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 ``hidden @ E.T``: [B, S, d] -> [B, S, V]."""
        return tied_logits(hidden, self.model.embed_tokens.weight)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        return_mtp_logits: bool = False,
        engram_context_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        **kwargs,
    ) -> Union[NeedleCausalLMOutput, tuple]:
        """Logits [B, S, V] float32 of ``input_ids`` [B, S] (see `NeedleModel.forward` for the inputs).

        Args:
            labels: [B, S] token ids (-100 = ignored); the loss is next-token cross-entropy.
            logits_to_keep: keep the logits of the last ``n`` positions (int, 0 = all) or of the given
                position indices (tensor); applies to ``mtp_logits`` too.
            return_mtp_logits: also return ``mtp_logits`` (``mtp_logits[:, t]`` scores token t + 2);
                only on a forward over the whole text (empty cache).
        """
        cache = _merge_cache_arguments(past_key_values, cache)
        return_dict = _config_default(return_dict, self.config, "return_dict", True)
        if return_mtp_logits and self.mtp is None:
            raise ValueError("this model has no MTP head (config.use_mtp_head is False)")
        if return_mtp_logits and cache is not None and cache.get_seq_length() > 0:
            raise ValueError("mtp_logits need the whole text: call with an empty cache (the MTP block is not cached)")

        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            engram_context_ids=engram_context_ids,
        )
        hidden = outputs.last_hidden_state
        keep = _positions_to_keep(logits_to_keep)
        logits = self.tied_logits(hidden[:, keep])

        mtp_logits = None
        if return_mtp_logits:
            batch, length = input_ids.shape
            step = self.model.step_inputs(batch, length, 0, attention_mask, position_ids)
            next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
            predicted = self.mtp(hidden, self.model.embed(next_ids), step)
            mtp_logits = self.tied_logits(predicted[:, keep])

        loss = None
        if labels is not None:
            if logits.shape[1] != input_ids.shape[1]:
                raise ValueError("labels need the logits of every position: leave logits_to_keep at 0")
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )

        output = NeedleCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            mtp_logits=mtp_logits,
            **{CACHE_OUTPUT_FIELD: getattr(outputs, _BASE_CACHE_OUTPUT_FIELD)},
        )
        return output if return_dict else output.to_tuple()

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """`GenerationMixin`'s preparation, plus ``engram_context_ids``: the tokens right before the ones
        this step feeds, cut from the full ``input_ids`` (already reordered by beam search)."""
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        step_ids = model_inputs.get("input_ids")
        if step_ids is not None and step_ids.shape[1] < input_ids.shape[1]:
            preceding = input_ids[:, : input_ids.shape[1] - step_ids.shape[1]]
            model_inputs["engram_context_ids"] = preceding[:, -self.engram_context_length :]
        return model_inputs

    # ----------------------------------------------------------------------------------------------
    # Probe-pooling heads

    def _probe_cells(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cells [B, T, L + 1, d] float32 (``x0`` and the lane mean after every layer) and their keep mask [B, T].

        Without an attention_mask, padding is ``input_ids == pad_token_id``. Positions are 0..T-1 as in
        the reference (RoPE is relative, so left padding does not change the result).
        """
        if attention_mask is None:
            attention_mask = (input_ids != self.config.pad_token_id).long()
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
            output_hidden_states=True,
            return_dict=True,
        )
        layers = [h.float() for h in outputs.hidden_states[1:]]
        cells = torch.stack([self.model.embed(input_ids), *layers], dim=2)
        return cells, attention_mask.bool()

    def contrastive_embedding(
        self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tool-retrieval embedding: (L2-normalised [B, contrastive_dim], log_temperature scalar)."""
        if self.contrastive_head is None:
            raise ValueError("this model has no contrastive head (config.use_contrastive_head is False)")
        cells, keep = self._probe_cells(input_ids, attention_mask)
        embedding = self.contrastive_head(cells, keep, self.model.embed_tokens.weight.dtype)
        return embedding, self.contrastive_head.log_temperature

    def confidence_logit(
        self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Answer-confidence logit [B] float32."""
        if self.confidence_head is None:
            raise ValueError("this model has no confidence head (config.use_confidence_head is False)")
        cells, keep = self._probe_cells(input_ids, attention_mask)
        return self.confidence_head(cells, keep, self.model.embed_tokens.weight.dtype)


def _positions_to_keep(logits_to_keep: Union[int, torch.Tensor]) -> Union[slice, torch.Tensor]:
    if isinstance(logits_to_keep, int):
        return slice(-logits_to_keep, None) if logits_to_keep > 0 else slice(None)
    return logits_to_keep


__all__ = ["NeedlePreTrainedModel", "NeedleModel", "NeedleForCausalLM", "NeedleCausalLMOutput", "NeedleWeightsError"]
