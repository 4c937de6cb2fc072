"""PyTorch Needle 3 (cactus-needle 3.x): `Needle3Model`, `Needle3ForCausalLM` and `Needle3Cache`.

Axis letters of the shape comments and einsum strings:

  B batch               T new (query) positions       S key positions (kept past + new)
  D hidden width        N query heads                 K key/value heads     G query heads per kv head
  H query/key head dim  U value head dim              L hyper-connection lanes (I, J as matrix rows/cols)
  E engram input width  W Monarch MLP width (a power of two >= D)
  C probe cells per position (layers + 1)   P probes per cell   Q pooling queries

Dtype policy, as the reference states it: every RMS statistic, the attention softmax, the lane
routing (hyper-connections) and the logits are float32; everything else runs in the parameter dtype.

One code path serves a whole sequence and a cached step: every op that reaches back in time (the
Q/K/V convolution, the engram hash and its value convolution, attention) reads its history from a
`Needle3Cache`, which an uncached forward starts empty. Visibility of an earlier position is always
"that key is visible to this query": the 2-D attention mask (padding is invisible), causality, and,
on a sliding-window layer, distance < window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from ..needle.numerics import (
    ENGRAM_HASH_PRIME,
    ENGRAM_HASH_SEED,
    ENGRAM_HASH_SHIFT,
    SINKHORN_ITERATIONS,
    UINT32_MASK,
    hyper_connection_offsets,
    rope_inverse_frequencies,
    walsh_matrix,
)
from ..needle.norms_needle import NeedleRMSNorm, rms_unit, zero_centred_rms_norm
from .configuration_needle3 import Needle3Config

# Seeds of the Monarch MLP's two fixed permutations (`RandomState(seed).permutation`); with split
# permutations the upper half uses `seed + MLP_UPPER_HALF_SEED_OFFSET`.
MLP_PERMUTATION_SEEDS = (11, 13)
MLP_UPPER_HALF_SEED_OFFSET = 977
# Initial values of the embedding head's temperature and bias (log 10, -10).
EMBEDDING_TEMPERATURE_INIT = 10.0
EMBEDDING_BIAS_INIT = -10.0
EMBEDDING_NORM_EPS = 1e-12


# --------------------------------------------------------------------------------------------------
# Numerical building blocks


def log_space_sinkhorn(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """[..., L, L] float32 logits -> doubly stochastic matrix: rounds of row then column logsumexp."""
    log_k = logits
    for _ in range(iterations):
        log_k = log_k - torch.logsumexp(log_k, dim=-1, keepdim=True)
        log_k = log_k - torch.logsumexp(log_k, dim=-2, keepdim=True)
    return torch.exp(log_k)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE ``[x1 cos - x2 sin, x2 cos + x1 sin]``; x [B, heads, T, H], cos/sin [T, H/2] float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def visible_at_offset(key_mask: torch.Tensor, positions: torch.Tensor, offset: int, window: int = 0) -> torch.Tensor:
    """Whether position ``t - offset`` is visible to the query at absolute position t: [B, T] bool.

    key_mask [B, S_all] (every absolute position so far), positions [T]; window > 0 also requires
    offset < window (a sliding-window layer's band).
    """
    source = positions - offset
    if window and offset >= window:
        return torch.zeros(key_mask.shape[0], positions.shape[0], dtype=torch.bool, device=key_mask.device)
    seen = key_mask[:, source.clamp(min=0)]
    return seen & (source >= 0)[None, :]


def causal_taps(history: torch.Tensor, new: torch.Tensor, taps: torch.Tensor, tap_ok: list, dilation: int) -> torch.Tensor:
    """Depthwise causal convolution over time: ``out[t] = sum_j taps[j] * x[t - dilation * j] * ok_j[t]``.

    history [B, R, C] holds the R = dilation * (taps - 1) inputs before `new` [B, T, C] (zeros before
    the start); taps [n, C]; tap_ok[j] [B, T] bool (None: always visible). Returns [B, T, C].
    """
    full = torch.cat([history, new], dim=1)  # [B, R+T, C]
    reach, length = history.shape[1], new.shape[1]
    out = None
    for j in range(taps.shape[0]):
        start = reach - dilation * j
        shifted = full[:, start : start + length]
        if tap_ok[j] is not None:
            shifted = shifted * tap_ok[j][..., None].to(shifted.dtype)
        term = taps[j] * shifted
        out = term if out is None else out + term
    return out


def engram_hash_indices(tokens: torch.Tensor, length: int, config: Needle3Config) -> torch.Tensor:
    """Hash-table rows [B, T, tables] of the last `length` positions of tokens [B, h + T], where the
    h = max(orders) - 1 leading tokens are history (0 before the start).

    Table k = order_index * heads + head starts from ``SEED * (order_index * stride + head + 1)``,
    folds in the `order` most recent tokens with ``(acc ^ token) * PRIME`` (32 bits) and mixes
    ``acc ^= acc >> 15``; the row is ``acc mod slots``. int64 holds every product (< 2^57).
    """
    history = tokens.shape[1] - length
    tokens = tokens.long()
    rows = []
    for order_index, order in enumerate(config.engram_orders):
        for head in range(config.engram_num_heads):
            seed = (ENGRAM_HASH_SEED * (order_index * config.engram_seed_stride + head + 1)) & UINT32_MASK
            acc = torch.full((tokens.shape[0], length), seed, dtype=torch.long, device=tokens.device)
            for j in range(order):
                acc = ((acc ^ tokens[:, history - j : history - j + length]) * ENGRAM_HASH_PRIME) & UINT32_MASK
            acc = acc ^ (acc >> ENGRAM_HASH_SHIFT)
            rows.append(acc % config.engram_slots)
    return torch.stack(rows, dim=-1)


def mlp_permutations(config: Needle3Config) -> tuple[np.ndarray, np.ndarray]:
    """The Monarch MLP's two fixed permutations [W] (output i reads input perm[i])."""
    size = config.mlp_size
    if config.mlp_split_permutations:
        half = size // 2
        return tuple(
            np.concatenate([
                np.random.RandomState(seed).permutation(half),
                half + np.random.RandomState(seed + MLP_UPPER_HALF_SEED_OFFSET).permutation(half),
            ])
            for seed in MLP_PERMUTATION_SEEDS
        )
    return tuple(np.random.RandomState(seed).permutation(size) for seed in MLP_PERMUTATION_SEEDS)


def kronecker_apply(z: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """z [..., a*b] as matrices Z [..., a, b] -> leftᵀ Z right, flattened: z @ (left ⊗ right)."""
    lead = z.shape[:-1]
    z = z.reshape(*lead, left.shape[0], right.shape[0])
    z = torch.einsum("...ij,ik,jl->...kl", z, left, right)
    return z.reshape(*lead, left.shape[0] * right.shape[0])


# --------------------------------------------------------------------------------------------------
# Cache


@dataclass
class Needle3LayerCache:
    """One layer's decoding state: kept keys/values (post-norm, post-RoPE) from absolute position
    `start` on, and the last `qkv_conv_taps - 1` pre-convolution Q/K/V projections."""

    keys: Optional[torch.Tensor] = None  # [B, K, S, H]
    values: Optional[torch.Tensor] = None  # [B, K, S, U]
    start: int = 0
    conv_history: Optional[tuple] = None  # ([B, R, N*H], [B, R, K*H], [B, R, K*U])


class Needle3Cache:
    """Decoding state of a Needle 3 model: everything a step needs that earlier positions produced.

    - per layer: keys and values (a sliding-window layer keeps only the last `window - 1`
      positions: no later query can see older ones) and the Q/K/V convolution history;
    - per engram site: the last `dilation * (taps - 1)` pre-convolution value projections;
    - the last `max(orders) - 1` tokens (the engram hash's history);
    - `seen`: positions consumed so far.
    """

    def __init__(self, config: Needle3Config):
        self.config = config
        self.seen = 0
        self.layers = [Needle3LayerCache() for _ in range(config.num_hidden_layers)]
        self.engram_history: list[Optional[torch.Tensor]] = [None] * len(config.engram_layers)  # [B, R, D]
        self.token_history: Optional[torch.Tensor] = None  # [B, max(orders) - 1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def __len__(self) -> int:
        return len(self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep row `beam_idx[i]` as row i of every batched tensor (beam search's reorder, in place).

        beam_idx [B'] indexes the current batch rows; every piece of state follows it: keys, values
        and Q/K/V conv histories per layer, the engram histories and the hash's last tokens."""
        def pick(tensor):
            return None if tensor is None else tensor.index_select(0, beam_idx.to(tensor.device))

        for layer in self.layers:
            layer.keys, layer.values = pick(layer.keys), pick(layer.values)
            if layer.conv_history is not None:
                layer.conv_history = tuple(pick(part) for part in layer.conv_history)
        self.engram_history = [pick(history) for history in self.engram_history]
        self.token_history = pick(self.token_history)


def _history(stored: Optional[torch.Tensor], batch: int, length: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """The stored history [B, length, width], or zeros when nothing is stored yet."""
    if stored is not None:
        return stored
    return like.new_zeros(batch, length, width)


def _tail(full: torch.Tensor, length: int) -> torch.Tensor:
    """The last `length` positions of full [B, S, ...] (an empty [B, 0, ...] for length 0)."""
    return full[:, full.shape[1] - length :] if length else full[:, :0]


# --------------------------------------------------------------------------------------------------
# Modules


Needle3RMSNorm = NeedleRMSNorm  # the same zero-centred norm as Needle 2's


class Needle3ResidualLinear(nn.Linear):
    """A projection into the residual stream (initialised with std / sqrt(2 * layers))."""


@dataclass
class Needle3StepInputs:
    """What every layer of one forward reads besides its lanes."""

    positions: torch.Tensor  # [T] absolute positions of the new tokens
    key_mask: torch.Tensor  # [B, S_all] bool, every absolute position so far
    cos: torch.Tensor  # [T, H/2] float32
    sin: torch.Tensor
    cache: Needle3Cache
    engram_keys: list  # per site [B, T, D]
    engram_values: list


class Needle3Attention(nn.Module):
    """Grouped-query attention with separate query/key (H) and value (U) head widths, a causal
    depthwise convolution over time on Q, K and V (taps limited by the layer's own mask), per-head
    zero-centred RMS norm on q and k, half-split RoPE and a sigmoid output gate."""

    def __init__(self, config: Needle3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)
        d = config.hidden_size
        self.q_proj = nn.Linear(d, config.query_dim, bias=False)
        self.k_proj = nn.Linear(d, config.key_dim, bias=False)
        self.v_proj = nn.Linear(d, config.value_dim, bias=False)
        self.gate_proj = nn.Linear(d, config.output_dim, bias=False)
        self.o_proj = Needle3ResidualLinear(config.output_dim, d, bias=False)
        self.q_norm = Needle3RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = Needle3RMSNorm(config.head_dim, config.rms_norm_eps)
        taps = config.qkv_conv_taps
        if taps:
            self.q_conv_taps = nn.Parameter(torch.zeros(taps, config.query_dim))
            self.k_conv_taps = nn.Parameter(torch.zeros(taps, config.key_dim))
            self.v_conv_taps = nn.Parameter(torch.zeros(taps, config.value_dim))

    def _convolve(self, q, k, v, step: Needle3StepInputs):
        """Q/K/V convolution over time; updates the layer's convolution history."""
        taps = self.config.qkv_conv_taps
        layer = step.cache.layers[self.layer_idx]
        batch, reach = q.shape[0], taps - 1
        stored = layer.conv_history or (None, None, None)
        histories = [_history(s, batch, reach, x.shape[-1], x) for s, x in zip(stored, (q, k, v))]
        tap_ok = [None] + [visible_at_offset(step.key_mask, step.positions, j, self.window) for j in range(1, taps)]
        out = [
            causal_taps(h, x, w, tap_ok, 1)
            for h, x, w in zip(histories, (q, k, v), (self.q_conv_taps, self.k_conv_taps, self.v_conv_taps))
        ]
        layer.conv_history = tuple(_tail(torch.cat([h, x], dim=1), reach) for h, x in zip(histories, (q, k, v)))
        return out

    def forward(self, a: torch.Tensor, step: Needle3StepInputs) -> torch.Tensor:
        """a [B, T, D] (normed) -> [B, T, D]."""
        cfg = self.config
        batch, length, _ = a.shape
        heads, kv_heads, hd, vd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.value_head_dim
        q, k, v = self.q_proj(a), self.k_proj(a), self.v_proj(a)  # [B, T, N*H], [B, T, K*H], [B, T, K*U]
        if cfg.qkv_conv_taps:
            q, k, v = self._convolve(q, k, v, step)
        q = self.q_norm(q.view(batch, length, heads, hd).transpose(1, 2))  # [B, N, T, H]
        k = self.k_norm(k.view(batch, length, kv_heads, hd).transpose(1, 2))  # [B, K, T, H]
        v = v.view(batch, length, kv_heads, vd).transpose(1, 2)  # [B, K, T, U]
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)

        layer = step.cache.layers[self.layer_idx]
        if layer.keys is not None:
            k = torch.cat([layer.keys, k], dim=2)
            v = torch.cat([layer.values, v], dim=2)
        start = layer.start if layer.keys is not None else int(step.positions[0])
        key_positions = torch.arange(start, start + k.shape[2], device=a.device)  # [S]
        allowed = step.key_mask[:, key_positions][:, None, :] & (key_positions[None, None, :] <= step.positions[None, :, None])
        if self.window:
            allowed = allowed & (step.positions[None, :, None] - key_positions[None, None, :] < self.window)
        # [B, T, S]. A query that sees no key (a padding position) reads nothing: its output is
        # zero, whatever the cache holds (the reference never reads such a position's output).

        groups = heads // kv_heads
        qg = q.view(batch, kv_heads, groups, length, hd).float()
        scores = torch.einsum("bkgth,bksh->bkgts", qg, k.float()) / math.sqrt(hd)  # [B, K, G, T, S]
        scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(torch.float32).min)
        weights = torch.softmax(scores, dim=-1) * allowed.any(-1)[:, None, None, :, None]
        out = torch.einsum("bkgts,bksu->btkgu", weights, v.float()).to(a.dtype)  # [B, T, K, G, U]
        out = out.reshape(batch, length, heads * vd)

        keep = k.shape[2] if not self.window else min(k.shape[2], self.window - 1)
        layer.keys, layer.values = k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]
        layer.start = start + k.shape[2] - keep

        out = out * torch.sigmoid(self.gate_proj(a))
        return self.o_proj(out)


class Needle3MonarchMLP(nn.Module):
    """Monarch-style MLP over W = next power of two >= D (zero padded): three stages z -> z (A ⊗ B)
    of learned Kronecker factors A [a, a], B [b, b] (initialised to Walsh matrices), with diagonals,
    a SiLU whose input is scaled by a low-rank per-token gain ``1 + softmax(x V) U``, and two fixed
    seeded permutations; output ``diag_out * z`` cut to D."""

    def __init__(self, config: Needle3Config):
        super().__init__()
        self.config = config
        size, (a, b), rank = config.mlp_size, config.mlp_factor_sizes, config.mlp_gain_rank
        for stage in (1, 2, 3):
            self.register_parameter(f"stage{stage}_left", nn.Parameter(torch.from_numpy(walsh_matrix(a).copy())))
            self.register_parameter(f"stage{stage}_right", nn.Parameter(torch.from_numpy(walsh_matrix(b).copy())))
        self.diag_in = nn.Parameter(torch.ones(size))
        self.diag_hidden = nn.Parameter(torch.ones(size))
        self.bias_hidden = nn.Parameter(torch.zeros(size))
        self.diag_mid = nn.Parameter(torch.ones(size))
        self.diag_out = nn.Parameter(torch.full((size,), 0.02))
        self.gain_in_proj = nn.Linear(config.hidden_size, rank, bias=False)  # cond_v
        self.gain_out_proj = nn.Linear(rank, size, bias=False)  # cond_u
        for name, table in self.constant_tables().items():
            self.register_buffer(name, torch.from_numpy(table), persistent=False)

    def constant_tables(self) -> dict:
        """The fixed permutations (int64 [W] each), as non-persistent buffers."""
        first, second = mlp_permutations(self.config)
        return {"permutation_1": first.astype(np.int64), "permutation_2": second.astype(np.int64)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        d, size = self.config.hidden_size, self.config.mlp_size
        gain = 1 + self.gain_out_proj(torch.softmax(self.gain_in_proj(x), dim=-1))  # [B, T, W]
        z = F.pad(x, (0, size - d)) if size > d else x  # [B, T, W]
        z = kronecker_apply(self.diag_in * z, self.stage1_left, self.stage1_right)[..., self.permutation_1]
        z = F.silu(self.diag_hidden * gain * z + self.bias_hidden)
        z = kronecker_apply(z, self.stage2_left, self.stage2_right)[..., self.permutation_2]
        z = kronecker_apply(self.diag_mid * z, self.stage3_left, self.stage3_right)
        return (self.diag_out * z)[..., :d]


class Needle3HyperConnection(nn.Module):
    """Routing of one layer between the L residual lanes (as in Needle 2)."""

    def __init__(self, config: Needle3Config):
        super().__init__()
        lanes, width = config.hyper_connection_lanes, config.hyper_connection_lanes * config.hidden_size
        self.lanes = lanes
        self.pre_proj = nn.Linear(width, lanes, bias=False)
        self.post_proj = nn.Linear(width, lanes, bias=False)
        self.res_proj = nn.Linear(width, lanes * lanes, bias=False)
        self.pre_bias = nn.Parameter(torch.zeros(lanes))
        self.post_bias = nn.Parameter(torch.zeros(lanes))
        self.res_bias = nn.Parameter(4.0 * torch.eye(lanes))
        self.pre_alpha = nn.Parameter(torch.tensor(0.01))
        self.post_alpha = nn.Parameter(torch.tensor(0.01))
        self.res_alpha = nn.Parameter(torch.tensor(0.01))


class Needle3DecoderLayer(nn.Module):
    def __init__(self, config: Needle3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.engram_sites = [s for s, layer in enumerate(config.engram_layers) if layer == layer_idx]
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Needle3RMSNorm(d, eps)
        self.self_attn = Needle3Attention(config, layer_idx)
        self.post_attention_layernorm = Needle3RMSNorm(d, eps)
        self.attention_gate = nn.Parameter(torch.zeros(()))
        self.pre_feedforward_layernorm = Needle3RMSNorm(d, eps)
        self.mlp = Needle3MonarchMLP(config)
        self.hyper_connection = Needle3HyperConnection(config)
        for name, table in self.constant_tables().items():
            self.register_buffer(name, torch.from_numpy(table), persistent=False)

    def constant_tables(self) -> dict:
        """Lane ownership offsets of this layer's routing (float32 [L] each)."""
        pre, post = hyper_connection_offsets(self.config.num_hidden_layers, self.config.hyper_connection_lanes)
        return {"pre_offset": pre[self.layer_idx].copy(), "post_offset": post[self.layer_idx].copy()}

    def block(self, x: torch.Tensor, step: Needle3StepInputs) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]: engram read, gated attention, Monarch MLP."""
        eps, d = self.config.rms_norm_eps, self.config.hidden_size
        for site in self.engram_sites:
            key, value = step.engram_keys[site], step.engram_values[site]
            alpha = torch.sigmoid((rms_unit(x, eps) * rms_unit(key, eps)).sum(-1) / math.sqrt(d))  # [B, T]
            x = x + (alpha[..., None] * value.float()).to(x.dtype)
        skip = x
        attended = self.self_attn(self.input_layernorm(x), step)
        x = skip + torch.sigmoid(self.attention_gate).to(x.dtype) * self.post_attention_layernorm(attended)
        return x + self.mlp(self.pre_feedforward_layernorm(x))

    def forward(self, lanes: torch.Tensor, step: Needle3StepInputs) -> torch.Tensor:
        """lanes [B, T, L, D] -> [B, T, L, D]."""
        hc, eps = self.hyper_connection, self.config.rms_norm_eps
        batch, length, count, width = lanes.shape
        lanes_f32 = lanes.float()
        unit = rms_unit(lanes.reshape(batch, length, count * width), eps)  # [B, T, L*D]
        pre = torch.sigmoid(hc.pre_alpha * F.linear(unit, hc.pre_proj.weight.float()) + hc.pre_bias + self.pre_offset)
        u = torch.einsum("btl,btld->btd", pre, lanes_f32).to(lanes.dtype)
        y = self.block(u, step) - u
        post = 2 * torch.sigmoid(hc.post_alpha * F.linear(unit, hc.post_proj.weight.float()) + hc.post_bias + self.post_offset)
        res = F.linear(unit, hc.res_proj.weight.float()).view(batch, length, count, count)
        mix = log_space_sinkhorn(hc.res_alpha * res + hc.res_bias)  # [B, T, I, J]
        out = torch.einsum("btij,btjd->btid", mix, lanes_f32) + post[..., None] * y.float()[:, :, None, :]
        return out.to(lanes.dtype)


class Needle3Engram(nn.Module):
    """Hashed n-gram memory of one site: table rows -> key and (dilated causal conv of) value."""

    def __init__(self, config: Needle3Config):
        super().__init__()
        self.config = config
        self.tables = nn.Parameter(torch.zeros(config.engram_num_tables, config.engram_slots, config.engram_sub_dim))
        self.key_proj = nn.Linear(config.engram_dim, config.hidden_size, bias=False)
        self.value_proj = Needle3ResidualLinear(config.engram_dim, config.hidden_size, bias=False)
        taps = torch.zeros(config.engram_conv_taps, config.hidden_size)
        taps[0] = 1.0
        self.conv_taps = nn.Parameter(taps)

    def forward(self, rows: torch.Tensor, row_ok: torch.Tensor, tap_ok: list, history: Optional[torch.Tensor]):
        """rows [B, T, tables] and row_ok [B, T, tables] -> (key, value) [B, T, D] each, and the new value history."""
        cfg = self.config
        table_index = torch.arange(cfg.engram_num_tables, device=rows.device)
        fetched = self.tables[table_index, rows] * row_ok[..., None].to(self.tables.dtype)  # [B, T, tables, sub]
        e = fetched.reshape(*rows.shape[:2], cfg.engram_dim)  # [B, T, E]
        key, value = self.key_proj(e), self.value_proj(e)
        reach = cfg.engram_conv_dilation * (cfg.engram_conv_taps - 1)
        history = _history(history, rows.shape[0], reach, cfg.hidden_size, value)
        convolved = causal_taps(history, value, self.conv_taps, tap_ok, cfg.engram_conv_dilation)
        return key, convolved, _tail(torch.cat([history, value], dim=1), reach)


def probe_pool(cells, keep, probes, gain, query, row_bias, eps: float) -> torch.Tensor:
    """Two-level attention pooling of cells [B, T, C, D] (float32) into [B, Q*D].

    Per cell row c, P probes attend over the visible positions (keep [B, T]); the pooled vectors
    (rms-normalised, times gain [C, P]) are then attended by Q queries over all (c, p) with bias
    row_bias [Q, C, P].
    """
    batch, _, rows, width = cells.shape
    scores = torch.einsum("btcd,cpd->bcpt", cells, probes.float()) / math.sqrt(width)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    pooled = torch.einsum("bcpt,btcd->bcpd", torch.softmax(scores, dim=-1), cells)
    pooled = rms_unit(pooled, eps) * gain.float()[None, :, :, None]  # [B, C, P, D]
    logits = torch.einsum("bcpd,qd->bqcp", pooled, query.float()) / math.sqrt(width) + row_bias.float()[None]
    weights = torch.softmax(logits.reshape(batch, query.shape[0], -1), dim=-1)  # [B, Q, C*P]
    out = torch.einsum("bqm,bmd->bqd", weights, pooled.reshape(batch, -1, width))
    return out.reshape(batch, -1)


class Needle3ProbeHead(nn.Module):
    """Probe pooling over every layer's lane mean, then a projection (the embedding, confidence and router heads)."""

    def __init__(self, config: Needle3Config, name: str, out_features: int, *, bias: bool):
        super().__init__()
        probes, queries = getattr(config, f"{name}_probes"), getattr(config, f"{name}_queries")
        rows, d = config.probe_rows, config.hidden_size
        self.eps = config.rms_norm_eps
        self.probes = nn.Parameter(torch.zeros(rows, probes, d))
        self.gain = nn.Parameter(torch.ones(rows, probes))
        self.query = nn.Parameter(torch.zeros(queries, d))
        self.row_bias = nn.Parameter(torch.zeros(queries, rows, probes))
        self.proj = nn.Linear(queries * d, out_features, bias=bias)

    def forward(self, cells: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        pooled = probe_pool(cells, keep, self.probes, self.gain, self.query, self.row_bias, self.eps)
        return self.proj(pooled.to(self.proj.weight.dtype))


class Needle3EmbeddingHead(Needle3ProbeHead):
    def __init__(self, config: Needle3Config):
        super().__init__(config, "embedding", config.embedding_dim, bias=False)
        self.log_temperature = nn.Parameter(torch.tensor(math.log(EMBEDDING_TEMPERATURE_INIT)))
        self.bias = nn.Parameter(torch.tensor(EMBEDDING_BIAS_INIT))

    def forward(self, cells: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """-> unit-norm embeddings [B, embedding_dim]."""
        p = super().forward(cells, keep)
        norm = torch.sqrt((p.float() ** 2).sum(-1, keepdim=True) + EMBEDDING_NORM_EPS)
        return p / norm.to(p.dtype)


# --------------------------------------------------------------------------------------------------
# Models


@dataclass
class Needle3ModelOutput(ModelOutput):
    last_hidden_state: Optional[torch.Tensor] = None
    cache: Optional[Needle3Cache] = None
    hidden_states: Optional[tuple] = None

    @property
    def past_key_values(self) -> Optional[Needle3Cache]:
        return self.cache


@dataclass
class Needle3CausalLMOutput(ModelOutput):
    """`cache` is the field `generate` reads back from transformers 5.24 on, `past_key_values` the one
    before: both hold the same `Needle3Cache`."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    cache: Optional[Needle3Cache] = None
    past_key_values: Optional[Needle3Cache] = None
    hidden_states: Optional[tuple] = None


class Needle3PreTrainedModel(PreTrainedModel):
    config_class = Needle3Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Needle3DecoderLayer"]

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own `Needle3Cache` (conv and engram state besides keys)

    def _init_weights(self, module: nn.Module):
        """The reference initialisation: N(0, 0.02) projections, embeddings, tables, probes and queries;
        residual projections N(0, 0.02 / sqrt(2 L)); the constants each module sets in its constructor."""
        std = self.config.initializer_range
        if isinstance(module, Needle3ResidualLinear):
            nn.init.normal_(module.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, Needle3Engram):
            nn.init.normal_(module.tables, mean=0.0, std=std)
        elif isinstance(module, Needle3ProbeHead):
            nn.init.normal_(module.probes, mean=0.0, std=std)
            nn.init.normal_(module.query, mean=0.0, std=std)
        elif isinstance(module, Needle3MonarchMLP):
            # Applied after its children (nn.Module.apply order): the gain starts at exactly 1.
            nn.init.zeros_(module.gain_out_proj.weight)
        # Constant tables are non-persistent buffers: transformers 5 builds the model on the meta
        # device and leaves their values to this hook.
        with torch.no_grad():
            for name, table in module.constant_tables().items() if hasattr(module, "constant_tables") else ():
                getattr(module, name).copy_(torch.from_numpy(table))


class Needle3Model(Needle3PreTrainedModel):
    """The Needle 3 backbone: token ids -> final normed hidden states [B, T, D]."""

    def __init__(self, config: Needle3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Needle3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.engrams = nn.ModuleList(Needle3Engram(config) for _ in config.engram_layers)
        self.norm = Needle3RMSNorm(config.hidden_size, config.rms_norm_eps)
        for name, table in self.constant_tables().items():
            self.register_buffer(name, torch.from_numpy(table), persistent=False)
        self.post_init()

    def constant_tables(self) -> dict:
        """RoPE inverse frequencies (float32 [H/2])."""
        return {"rope_inverse_frequencies": rope_inverse_frequencies(self.config.head_dim, self.config.rope_theta)}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.embed_tokens = value

    def _engram_memory(self, input_ids, step: Needle3StepInputs):
        """Per site (key, value) [B, T, D] for the new tokens; updates the cache's engram state."""
        cfg, cache = self.config, step.cache
        if not cfg.engram_layers:
            return [], []
        history = max(cfg.engram_orders) - 1
        tokens = input_ids
        if history:
            stored = cache.token_history if cache.token_history is not None else input_ids.new_zeros(input_ids.shape[0], history)
            tokens = torch.cat([stored, input_ids], dim=1)
            cache.token_history = _tail(tokens, history)
        rows = engram_hash_indices(tokens, input_ids.shape[1], cfg)  # [B, T, tables]
        row_ok = torch.stack(
            [visible_at_offset(step.key_mask, step.positions, order - 1)
             for order in cfg.engram_orders for _ in range(cfg.engram_num_heads)], dim=-1)
        tap_ok = [visible_at_offset(step.key_mask, step.positions, j * cfg.engram_conv_dilation)
                  for j in range(cfg.engram_conv_taps)]
        keys, values = [], []
        for site, engram in enumerate(self.engrams):
            key, value, cache.engram_history[site] = engram(rows, row_ok, tap_ok, cache.engram_history[site])
            keys.append(key)
            values.append(value)
        return keys, values

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[Needle3Cache] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
    ) -> Needle3ModelOutput:
        """input_ids [B, T]; attention_mask [B, past + T] (1 = visible; every position so far, as
        `generate` passes it); past_key_values from an earlier call. Returns the final hidden states
        [B, T, D], the cache (when `use_cache`), and with `output_hidden_states` the embeddings and
        every layer's lane mean (the probe heads' cells)."""
        if return_dict is False:
            raise ValueError("Needle3Model returns a ModelOutput; return_dict=False is not supported")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values if past_key_values is not None else Needle3Cache(self.config)
        batch, length = input_ids.shape
        past = cache.seen
        device = input_ids.device
        if attention_mask is None:
            key_mask = torch.ones(batch, past + length, dtype=torch.bool, device=device)
        else:
            if attention_mask.shape != (batch, past + length):
                raise ValueError(
                    f"attention_mask: expected shape {(batch, past + length)} (every position so far: {past} cached "
                    f"+ {length} new), got {tuple(attention_mask.shape)}")
            key_mask = attention_mask.bool()
        positions = torch.arange(past, past + length, device=device)
        angles = positions.float()[:, None] * self.rope_inverse_frequencies  # [T, H/2]
        step = Needle3StepInputs(positions, key_mask, torch.cos(angles), torch.sin(angles), cache, [], [])
        step.engram_keys, step.engram_values = self._engram_memory(input_ids, step)

        x0 = self.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)
        lanes = x0[:, :, None, :].expand(batch, length, self.config.hyper_connection_lanes, x0.shape[-1])
        hidden = [x0] if output_hidden_states else None
        for layer in self.layers:
            lanes = layer(lanes, step)
            if output_hidden_states:
                hidden.append(lanes.mean(dim=2))
        cache.seen = past + length
        return Needle3ModelOutput(
            last_hidden_state=self.norm(lanes.mean(dim=2)),
            cache=cache if use_cache else None,
            hidden_states=tuple(hidden) if output_hidden_states else None,
        )


class Needle3FullVocabularyScores:
    """A logits processor: scores [B, out_vocab] -> [B, vocab_size], the missing columns -inf."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        missing = self.vocab_size - scores.shape[-1]
        if missing <= 0:
            return scores
        return torch.cat([scores, scores.new_full((*scores.shape[:-1], missing), float("-inf"))], dim=-1)


class Needle3ForCausalLM(Needle3PreTrainedModel, GenerationMixin):
    """Needle 3 with its tied output head (the first `out_vocab` embedding rows) and the optional
    embedding, confidence and router heads."""

    def __init__(self, config: Needle3Config):
        super().__init__(config)
        self.model = Needle3Model(config)
        if config.use_embedding_head:
            self.embedding_head = Needle3EmbeddingHead(config)
        if config.use_confidence_head:
            self.confidence_head = Needle3ProbeHead(config, "confidence", 1, bias=True)
        if config.use_router_head:
            self.router_head = Needle3ProbeHead(config, "router", 3, bias=True)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.model.embed_tokens = value

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, T, out_vocab] of final hidden states [B, T, D] (the tied head)."""
        head = self.model.embed_tokens.weight[: self.config.output_vocab_size]
        return hidden.float() @ head.float().T

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[Needle3Cache] = None,
        use_cache: Optional[bool] = None,
        labels: Optional[torch.LongTensor] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        cache_position: Optional[torch.LongTensor] = None,
        cache: Optional[Needle3Cache] = None,
    ) -> Needle3CausalLMOutput:
        """Logits [B, T, out_vocab] float32; with `labels` [B, T] (-100 ignored) the next-token loss.
        The cache comes in as `past_key_values` or `cache` (transformers 5.24+'s name), not both;
        `cache_position`, when given (by `generate`), must continue it."""
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the cache once: as `past_key_values` or as `cache`")
        past_key_values = past_key_values if past_key_values is not None else cache
        if cache_position is not None and past_key_values is not None and int(cache_position[0]) != past_key_values.seen:
            raise ValueError(f"cache_position starts at {int(cache_position[0])}, the cache holds {past_key_values.seen} positions")
        out = self.model(
            input_ids, attention_mask=attention_mask, past_key_values=past_key_values, use_cache=use_cache,
            output_hidden_states=output_hidden_states, return_dict=return_dict)
        logits = self.output_logits(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return Needle3CausalLMOutput(loss=loss, logits=logits, cache=out.cache, past_key_values=out.cache,
                                     hidden_states=out.hidden_states)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=None,
                                      cache_position=None, cache=None, **generation_state):
        """The tokens the cache has not seen yet (all of them on the first step). The rest of
        `generate`'s bookkeeping (`position_ids` and the like) does not apply: positions follow
        the cache, as in the reference."""
        past_key_values = past_key_values if past_key_values is not None else cache
        if past_key_values is not None:
            input_ids = input_ids[:, past_key_values.seen :]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values,
                "use_cache": use_cache}

    def ladder(self, depth: int) -> "Needle3ForCausalLM":
        """The ladder's nested sub-model of `depth` layers (early exit): a new model with
        `config.ladder_config(depth)` and copies of this model's weights: the kept layers
        (`config.ladder_layers(depth)`) renumbered, the engram sites of kept layers, the embedding and
        final norm, and the probe heads' pooling rows of the embeddings and the kept layers."""
        kept = self.config.ladder_layers(depth)
        rung = type(self)(self.config.ladder_config(depth))
        new_layer = {str(layer): str(i) for i, layer in enumerate(kept)}
        sites = [site for site, layer in enumerate(self.config.engram_layers) if layer in kept]
        new_site = {str(site): str(i) for i, site in enumerate(sites)}
        rows = torch.tensor([0, *(layer + 1 for layer in kept)])
        state = {}
        for name, tensor in self.state_dict().items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                if parts[2] not in new_layer:
                    continue
                parts[2] = new_layer[parts[2]]
            elif parts[:2] == ["model", "engrams"]:
                if parts[2] not in new_site:
                    continue
                parts[2] = new_site[parts[2]]
            elif parts[0].endswith("_head") and parts[-1] in ("probes", "gain"):
                tensor = tensor.index_select(0, rows.to(tensor.device))
            elif parts[0].endswith("_head") and parts[-1] == "row_bias":
                tensor = tensor.index_select(1, rows.to(tensor.device))
            state[".".join(parts)] = tensor.clone()
        rung.load_state_dict(state, strict=True)
        return rung.to(device=self.device, dtype=self.dtype).train(self.training)

    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     **model_kwargs):
        """transformers' beam search, which reads `vocab_size` columns of scores: the output head's
        `out_vocab` columns are widened first (rows past `out_vocab` can never be chosen)."""
        from transformers import LogitsProcessorList

        widened = LogitsProcessorList([Needle3FullVocabularyScores(self.config.vocab_size), *logits_processor])
        return super()._beam_search(input_ids, widened, stopping_criteria, generation_config, synced_gpus,
                                    **model_kwargs)

    # ----------------------------------------------------------------------------------------------
    # Probe heads: cells are the embeddings and every layer's lane mean, computed with padding
    # (pad_token_id) invisible; `window` > 0 also limits every layer to the last `window` positions.
    def _cells(self, input_ids: torch.LongTensor):
        keep = input_ids != self.config.pad_token_id
        out = self.model(input_ids, attention_mask=keep, use_cache=False, output_hidden_states=True)
        return torch.stack(out.hidden_states, dim=2).float(), keep  # [B, T, C, D]

    def _head(self, name: str):
        head = getattr(self, name, None)
        if head is None:
            raise ValueError(f"this model has no {name} (its config has use_{name}=False)")
        return head

    def embedding(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Unit-norm text embeddings [B, embedding_dim]."""
        return self._head("embedding_head")(*self._cells(input_ids))

    def confidence(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Confidence logits [B] (float32)."""
        return self._head("confidence_head")(*self._cells(input_ids))[..., 0].float()

    def router(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Router logits [B, 3] (float32)."""
        return self._head("router_head")(*self._cells(input_ids)).float()
