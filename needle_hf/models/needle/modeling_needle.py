"""PyTorch Needle 2 (Cactus Compute's Simple Attention Network) for Hugging Face Transformers.

The forward pass reproduces the reference implementation (cactus-needle 2.x) step by step:

1. ``x0 = E[tokens] * sqrt(D)``.
2. Engram memory: each engram site hashes the n-grams ending at every position into its tables,
   projects the fetched rows to a key and a value, and smooths the value with a causal dilated
   convolution. The layer that owns the site adds ``sigmoid(<u, key> / sqrt(D)) * value`` to its
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
cast back to the compute dtype (the dtype of the parameters), logits are float32. The axis letters,
each op's numerical choice, the attention rule and the helper names and argument orders are those of
`specification_needle`, which the Flax model follows too.

This file ships as remote code next to saved weights, so it imports only flat relative modules of
its folder and nothing from jax.

Layout: the attention kernel and the per-call step inputs, then the layers (attention, MLP, block,
hyper-connections, engram, MTP head), then `NeedlePreTrainedModel`, the backbone `NeedleModel` and
`NeedleForCausalLM`. Beside it: `ops_needle` (norms, RoPE, Sinkhorn, Walsh transform, engram hash),
`masking_needle` (attention masks, packed sequences, engram lookback), `heads_needle` (tied logits,
probe-pooling heads), `generation_needle` (`generate` and its checks), `loading_needle` (strict
loading), `cache_needle` (the KV cache and engram state across transformers versions),
`compiled_decoding_needle` (the compiled static-cache decoding step). Their public names are
importable from here too.

Version notes (transformers 4.57 and 5.x):
- The cache's name (``past_key_values`` / ``cache``): see `cache_needle`.
- Attention runs through transformers' attention-function interface (eager, sdpa, flex_attention).
- The output head ``lm_head`` is a bias-less ``nn.Linear`` whose weight is ``model.embed_tokens.weight``
  (tied through transformers' machinery: `_tied_weights_keys` is a list of tied names on 4.57, a
  ``{tied: source}`` dict on 5.x). The state dict shows the alias ``lm_head.weight``; saved files
  hold the one tensor of the weight table (`weight_names.py`), and `load_state_dict` accepts a state
  dict with or without the alias. Logits stay float32 (``hidden.float() @ lm_head.weight.float().T``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_torchdynamo_compiling

from .cache_needle import (
    BASE_CACHE_OUTPUT_FIELD,
    CACHE_OUTPUT_FIELD,
    NeedleEngramCacheLayer,
    is_static_cache,
    layer_caches,
    merge_cache_arguments,
    static_cache_length,
)
from .compiled_decoding_needle import NeedleCompiledParts
from .configuration_needle import NeedleConfig
from .deploy_numerics import (  # deploy numerics hooks
    forward_on_training_weights,
    quantize_activations,
    quantize_kv,
    training_weights,
)
from .loading_needle import fill_tied_alias, raise_unless_exact
from .masking_needle import (
    PackedLayout,
    attention_allowed,
    attention_sees_from_4d,
    check_engram_lookback,
    default_position_ids,
    engram_lookback,
    flex_block_mask,
    packed_lookback,
    packed_segment_ids,
    segment_ids_from_cu_seq_lens,
)
from .numerics import (
    ATTENTION_GATE_INIT,
    CONTRASTIVE_TEMPERATURE_INIT,
    ENGRAM_FIRST_TAP_INIT,
    HADAMARD_DIAG_HIDDEN_INIT,
    HADAMARD_DIAG_IN_INIT,
    HADAMARD_DIAG_OUT_INIT,
    HYPER_CONNECTION_ALPHA_INIT,
    HYPER_CONNECTION_RES_BIAS_INIT,
    NORM_WEIGHT_INIT,
    TIED_WEIGHTS,
    engram_table_orders,
)
from .ops_needle import (
    apply_rotary,
    architecture_constant,
    cpu_grouped_sdpa,
    engram_hash_indices,
    lane_mean,
    log_space_sinkhorn,
    rope_tables,
    shift_right,
    sinkhorn,
    walsh_operand,
    walsh_transform,
)
from .norms_needle import NeedleRMSNorm, rms_unit, zero_centred_rms_norm
from .generation_needle import NeedleGenerationMixin, check_prompt_ids
from .heads_needle import NeedleConfidenceHead, NeedleContrastiveHead, probe_pool, tied_logits
from .specification_needle import (
    NeedleWeightsError,  # the one exception of both twins' strict loading
    attention_window_option,
    embedding_scale,
)

# transformers copies only a model file's own relative imports out of a local folder
# (trust_remote_code=True): the modules that the modules above import are named here too.
from .mtp_option import pop_mtp_option  # noqa: F401  (generation_needle)
from .speculative import mtp_generate  # noqa: F401  (generation_needle)
from .weight_names import cq_weight_bits  # noqa: F401  (deploy_numerics reads the QAT widths)


# transformers 5.x looks attention functions up with a default (`get_interface`); 4.57 indexes them.
_ATTENTION_INTERFACE_LOOKUP = hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface")

# Tied weights as the installed transformers spells them: 5.x maps each tied name to its source,
# 4.57 lists the names it ties to `get_input_embeddings()`.
_TIED_WEIGHTS_KEYS = (
    dict(TIED_WEIGHTS) if hasattr(PreTrainedModel, "get_expanded_tied_weights_keys") else list(TIED_WEIGHTS)
)


# --------------------------------------------------------------------------------------------------
# Numerical building blocks


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's attention: float32 scores and softmax, probabilities cast to the value dtype.

    query: [B, N, T, H]; key, value: [B, K, S, H]; attention_mask: additive [B, 1, T, S].
    Returns (output [B, T, N, H], probabilities [B, N, T, S] float32, on the autograd path).
    Query head h reads key/value head h // G (G = N / K): the queries of a group are stacked against their
    one key/value head ([B, K, G * T, H]) rather than the keys and values repeated per head.
    Other keyword arguments of the attention-function interface are not used by this kernel.
    """
    batch, heads, length, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[-2]
    grouped = query.float().reshape(batch, kv_heads, -1, head_dim)  # [B, K, G * T, H]
    scores = torch.matmul(grouped, key.float().transpose(-1, -2)).view(batch, heads, length, keys) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., :keys].float()
    probs = scores.softmax(dim=-1)
    weights = F.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    out = torch.matmul(weights.view(batch, kv_heads, -1, keys), value)  # [B, K, G * T, H]
    return out.view(batch, heads, length, head_dim).transpose(1, 2).contiguous(), probs


@dataclass
class NeedleStepInputs:
    """Tensors derived once per forward call and shared by every layer (and the MTP block).

    key_visible: [B, S] bool, which key positions are real text (S = past + T, or a static cache's length).
    attention_mask: [B, 1, T, S] additive mask in the compute dtype (0 allowed, the dtype's minimum not);
        for flex attention the same mask as a `BlockMask`.
    cos, sin: [B, 1, T, H] float32 RoPE tables of the new positions (both halves the same).
    cache_position: [T] positions of the new tokens in the cache (where their keys are written).
    walsh: [W, W] Walsh-Hadamard matrix (compute dtype), or its Kronecker factors (`walsh_transform`).
    pre_offsets, post_offsets: [layers, L] float32 lane-ownership offsets of the hyper-connection
        logits (`numerics.hyper_connection_offsets`).
    attention_implementation: the attention function to use instead of the config's (a compiled
        decoding step runs sdpa as the same grouped products as eager, see `_DecoderLayerStep`).
    engram_lookback: [B, T, R] bool, whether new token t sees the position k before it
        (`engram_lookback`), for packed sequences and 4-D masks; None: read from ``key_visible`` (a
        position sees every visible position before it).
    packed_layout: a packed batch's sequences one per row (`PackedLayout`); attention then runs over
        that layout, and ``attention_mask`` is its [Q, 1, M, M] mask.
    """

    key_visible: torch.Tensor
    attention_mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cache_position: torch.Tensor
    walsh: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
    pre_offsets: torch.Tensor
    post_offsets: torch.Tensor
    attention_implementation: Optional[str] = None
    engram_lookback: Optional[torch.Tensor] = None
    packed_layout: Optional[PackedLayout] = None


# --------------------------------------------------------------------------------------------------
# Modules


class NeedleResidualLinear(nn.Linear):
    """A projection that writes into the residual stream (attention output, engram value).

    Only its initialisation differs: N(0, 0.02 / sqrt(2 L)) as in the reference, instead of N(0, 0.02).
    """


class NeedleAttention(nn.Module):
    """Grouped-query self-attention with q/k norms, half-split RoPE and a sigmoid output gate.

    The attention product runs through transformers' attention-function interface as in
    ``models/llama``: ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
    eager_attention_forward)`` on 5.x, `eager_attention_forward` or
    ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` on 4.57. transformers reads this file
    for those forms before `set_attn_implementation` switches the kernel of a loaded model.
    """

    is_causal = True

    def __init__(self, config: NeedleConfig, layer_idx: Optional[int]):
        super().__init__()
        self.config = config  # deploy numerics hook
        self.layer_idx = layer_idx  # index into the KV cache (the MTP block: into its own cache)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.head_dim**-0.5
        self.attention_dropout = 0.0
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
        cache: Optional[Union[Cache, CacheLayerMixin]] = None,
        **attention_kwargs,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: [B, T, D] (normed) -> ([B, T, D], attention probabilities [B, N, T, S] or None).

        ``cache``: the model's KV cache, or this layer's own layer of it (a static cache's, see
        `NeedleModel.forward`: then the layer index is not read, and one compiled layer serves all).

        ``attention_kwargs`` go to the attention function unchanged (e.g. ``output_attentions``, the
        varlen arguments of flash/paged kernels); `NeedleModel.forward` names the ones it passes.
        """
        batch, length, _ = x.shape
        x = quantize_activations(x, self.config)  # deploy numerics hook
        q, k, v, gate = self.q_proj(x), self.k_proj(x), self.v_proj(x), self.gate_proj(x)
        q = q.reshape(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # [B, N, T, H]
        k = k.reshape(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, K, T, H]
        v = v.reshape(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, K, T, H]
        q = apply_rotary(self.q_norm(q), step.cos, step.sin)
        k = apply_rotary(self.k_norm(k), step.cos, step.sin)
        k, v = quantize_kv(k, v, self.config)  # deploy numerics hook
        # `cache_position` places the keys in a static cache on 4.57 (5.x layers count themselves).
        if isinstance(cache, CacheLayerMixin):
            k, v = cache.update(k, v, {"cache_position": step.cache_position})  # [B, K, S, H]
        elif cache is not None and self.layer_idx is not None:
            k, v = cache.update(k, v, self.layer_idx, {"cache_position": step.cache_position})  # [B, K, S, H]

        attention_interface: Callable = eager_attention_forward
        if step.attention_implementation is not None:  # a compiled decoding step's own choice
            if step.attention_implementation != "eager":
                attention_interface = ALL_ATTENTION_FUNCTIONS[step.attention_implementation]
        elif _ATTENTION_INTERFACE_LOOKUP:  # transformers 5.x
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
        elif self.config._attn_implementation != "eager":  # transformers 4.57
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        if step.attention_implementation is None:
            attention_interface = cpu_grouped_sdpa(attention_interface, q)
        layout = step.packed_layout
        if layout is not None:  # packed sequences one per row: [Q, N, M, H]
            q, k, v = layout.pack(q), layout.pack(k), layout.pack(v)
        out, probs = attention_interface(
            self,
            q,
            k,
            v,
            step.attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **attention_kwargs,
        )
        if layout is not None:
            out = layout.unpack(out, batch)  # [B, T, N, H]
        out = out.reshape(batch, length, -1) * torch.sigmoid(gate)  # [B, T, A]
        out = quantize_activations(out, self.config)  # deploy numerics hook
        return self.o_proj(out), probs


class NeedleHadamardMLP(nn.Module):
    """``z = (d1 * z) H; z = silu(d2 * z) H; out = (d3 * z)[:d]`` with ``z`` zero padded to ``n`` (a power of two)."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        n = config.hadamard_size
        self.hidden_size = config.hidden_size
        self.diag_in = nn.Parameter(torch.ones(n))
        self.diag_hidden = nn.Parameter(torch.ones(n))
        self.diag_out = nn.Parameter(torch.full((n,), HADAMARD_DIAG_OUT_INIT))

    def forward(self, x: torch.Tensor, walsh: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: [B, T, D], walsh: the Walsh matrix or its Kronecker factors (`walsh_transform`) -> [B, T, D]."""
        padding = self.diag_in.shape[0] - self.hidden_size
        z = F.pad(x, (0, padding)) if padding else x  # [B, T, W]
        z = walsh_transform(self.diag_in * z, walsh)
        z = walsh_transform(F.silu(self.diag_hidden * z), walsh)
        return (self.diag_out * z)[..., : self.hidden_size]


class NeedleBlock(nn.Module):
    """One transformer block ``u -> Block(u)`` (the residual stream in and out, [B, T, D]).

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
        **attention_kwargs,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: [B, T, D] -> ([B, T, D], attention probabilities or None)."""
        attended, probs = self.self_attn(self.input_layernorm(x), step, cache=cache, **attention_kwargs)
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

    Every coefficient is computed from the float32 unit-RMS flattened lanes ``x̂`` [B, T, L * D].
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
        self, lanes: torch.Tensor, lane_offsets: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """lanes: [B, T, L, D], lane_offsets: this layer's (pre, post) [L] float32 (`step.pre_offsets[i]`,
        `step.post_offsets[i]`) -> (read weights [B, T, L], write weights [B, T, L], mixing [B, T, L, L]), float32."""
        batch, length, n, width = lanes.shape
        unit = rms_unit(lanes.reshape(batch, length, n * width), self.eps)  # [B, T, L * D]
        pre_offset, post_offset = lane_offsets
        read = torch.sigmoid(
            self._scaled_projection(unit, self.pre_proj, self.pre_alpha) + self.pre_bias.float() + pre_offset
        )
        write = 2 * torch.sigmoid(
            self._scaled_projection(unit, self.post_proj, self.post_alpha) + self.post_bias.float() + post_offset
        )
        mix_logits = self._scaled_projection(unit, self.res_proj, self.res_alpha).view(batch, length, n, n)
        mixing = sinkhorn(mix_logits + self.res_bias.float())
        return read, write, mixing


class NeedleDecoderLayer(NeedleBlock, GradientCheckpointingLayer):
    """A block wrapped in hyper-connections; maps lanes [B, T, L, D] to lanes.

    Tensors that need gradients are positional, so that activation checkpointing
    (`GradientCheckpointingLayer`) recomputes the layer from them.
    """

    def __init__(self, config: NeedleConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.hidden_size = config.hidden_size
        self.hyper_connection = NeedleHyperConnection(config, layer_idx)

    def forward(
        self,
        lanes: torch.Tensor,
        engram_key: Optional[torch.Tensor],
        engram_value: Optional[torch.Tensor],
        step: NeedleStepInputs,
        cache: Optional[Union[Cache, CacheLayerMixin]] = None,
        *,
        lane_offsets: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        **attention_kwargs,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """lanes: [B, T, L, D]; engram_key, engram_value: [B, T, D] of this layer's engram site (or None).

        lane_offsets: this layer's rows of ``step.pre_offsets`` / ``step.post_offsets`` (default: read
        by layer index). `NeedleModel` passes them, and a static cache's own layer as ``cache``, so a
        compiled layer reads no per-layer constant and compiles once for all layers (`get_compiled_call`).
        """
        if lane_offsets is None:
            index = self.hyper_connection.layer_idx
            lane_offsets = (step.pre_offsets[index], step.post_offsets[index])
        read, write, mixing = self.hyper_connection.route(lanes, lane_offsets)
        lanes_f32 = lanes.float()
        # Batched matrix products over (b, s) (what einsum would run, without its per-call planning).
        u = torch.matmul(read[:, :, None, :], lanes_f32)[:, :, 0].to(lanes.dtype)  # [B, T, D]
        x = u
        if engram_key is not None:
            eps = self.hyper_connection.eps
            relevance = (rms_unit(u, eps) * rms_unit(engram_key, eps)).sum(-1) / math.sqrt(self.hidden_size)  # [B, T]
            x = u + (torch.sigmoid(relevance)[..., None] * engram_value.float()).to(u.dtype)
        y, probs = self.block(x, step, cache=cache, **attention_kwargs)
        y = y - u
        mixed = torch.matmul(mixing, lanes_f32) + write[..., None] * y.float()[:, :, None, :]  # [B, T, L, D]
        return mixed.to(lanes.dtype), probs


class NeedleEngram(nn.Module):
    """Hashed n-gram memory of one site: fetched table rows -> (key, convolved value), [B, T, D] each."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        d = config.hidden_size
        self.config = config  # deploy numerics hook
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
        *,
        tap_visible: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) [B, C - first_output, D] of window positions ``first_output..C-1``.

        indices: [B, C, tables] rows of the window's n-grams; ngram_visible: [B, C, tables] whether each
        n-gram lies in the visible text; visible: [B, C] whether each window position is visible.
        The value at ``t`` is ``sum_j taps[j] * v[t - j * dilation]`` over visible earlier positions
        (zero before the window, which starts at the text or reaches back `engram_history` tokens).
        tap_visible: [B, C - first_output, taps], whether output t sees the position tap j reads (packed
        sequences, 4-D masks); None: that position's ``visible``.
        """
        batch, length, _ = indices.shape
        table_ids = torch.arange(self.num_tables, device=indices.device)
        rows = self.tables[table_ids, indices]  # [B, C, tables, sub_dim]
        rows = rows * ngram_visible[..., None].to(rows.dtype)
        fetched = rows.reshape(batch, length, -1).to(dtype)  # [B, C, engram_dim]
        fetched = quantize_activations(fetched, self.config)  # deploy numerics hook
        key = self.key_proj(fetched[:, first_output:])
        # Hidden positions contribute zero to every tap; zeros in front stand for positions before the window.
        reach = self.reach
        value_rows = self.value_proj(fetched)  # [B, C, D]
        if tap_visible is None:
            value_rows = value_rows * visible[..., None].to(dtype)
        value_rows = F.pad(value_rows, (0, 0, reach, 0))  # [B, reach + C, D]
        taps = self.conv_taps.to(dtype)
        value = 0
        for j in range(taps.shape[0]):
            start = reach + first_output - j * self.dilation
            tapped = value_rows[:, start : start + length - first_output]
            if tap_visible is not None:
                tapped = tapped * tap_visible[..., j, None].to(dtype)
            value = value + taps[j] * tapped
        return key, value


def engram_window_memory(
    engrams: nn.ModuleList,
    config: NeedleConfig,
    window_ids: torch.Tensor,
    window_visible: torch.Tensor,
    first_output: int,
    dtype: torch.dtype,
    *,
    lookback: Optional[torch.Tensor] = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Engram (key, value) [B, C - first_output, D] of window positions ``first_output..C-1``, by the
    layer that reads them.

    window_ids: [B, C] token ids; window_visible: [B, C] bool, whether each position is real text
    (positions hidden here contribute zero, exactly like positions before the window).
    lookback: [B, C - first_output, R] whether each output position sees the position k before it
    (`NeedleStepInputs.engram_lookback`: packed sequences, 4-D masks), which then decides its n-grams
    and conv taps; None: every visible earlier position.
    """
    indices = engram_hash_indices(window_ids, config.engram_orders, config.engram_num_heads, config.engram_slots)
    # An n-gram of order o ending at t is visible when its first token, t - (o - 1), is.
    visible_by_order = {order: shift_right(window_visible, order - 1) for order in config.engram_orders}
    tap_visible = None
    if lookback is not None:
        # The output positions see their n-grams' first tokens, and their taps' sources, as lookback says.
        visible_by_order = {
            order: torch.cat([visible[:, :first_output], lookback[..., order - 1]], dim=1)
            for order, visible in visible_by_order.items()
        }
        taps = range(0, config.engram_conv_taps * config.engram_conv_dilation, config.engram_conv_dilation)
        tap_visible = lookback[..., list(taps)]  # [B, C - first_output, taps]
    table_orders = engram_table_orders(config.engram_orders, config.engram_num_heads)
    ngram_visible = torch.stack([visible_by_order[order] for order in table_orders], dim=-1)  # [B, C, tables]
    return {
        layer_idx: engram(indices, ngram_visible, window_visible, first_output, dtype, tap_visible=tap_visible)
        for engram, layer_idx in zip(engrams, config.engram_layers)
    }


class NeedleMultiTokenPrediction(nn.Module):
    """MTP head: ``block(cat(h, norm(E[next] * sqrt(D))) W)`` then a norm; its tied logits predict token t + 2."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        d = config.hidden_size
        self.config = config  # deploy numerics hook
        self.combine_proj = nn.Linear(2 * d, d, bias=False)
        self.embed_norm = NeedleRMSNorm(d, config.rms_norm_eps)
        self.norm = NeedleRMSNorm(d, config.rms_norm_eps)
        # Layer 0 of the MTP's own cache when it drafts while decoding (`speculative.py`); uncached otherwise.
        self.block = NeedleBlock(config, layer_idx=0)

    def forward(
        self, hidden: torch.Tensor, next_embedded: torch.Tensor, step: NeedleStepInputs, cache: Optional[Cache] = None
    ) -> torch.Tensor:
        """hidden: [B, T, D] final-normed backbone output; next_embedded: [B, T, D] float32 ``E[t+1] * sqrt(D)``;
        cache: the MTP block's own one-layer cache of the positions before these (None: the whole text)."""
        combined = torch.cat([hidden, self.embed_norm(next_embedded).to(hidden.dtype)], dim=-1)
        combined = quantize_activations(combined, self.config)  # deploy numerics hook
        return self.norm(self.block.block(self.combine_proj(combined), step, cache=cache)[0])


# --------------------------------------------------------------------------------------------------
# Outputs


@dataclass
class NeedleCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus ``mtp_logits`` [B, T, V] float32 (when requested): ``mtp_logits[:, t]``
    scores token ``t + 2``. The cache field is ``past_key_values`` (transformers 4.x) or ``cache`` (5.x)."""

    mtp_logits: Optional[torch.FloatTensor] = None


def _config_default(value, config, name: str, default):
    """An explicit argument, else the config's attribute (absent in some transformers versions), else ``default``."""
    return value if value is not None else getattr(config, name, default)


def _refuse_inputs_embeds(inputs_embeds):
    if inputs_embeds is not None:
        raise ValueError("Needle reads token ids (its engram memory hashes them): pass input_ids, not inputs_embeds")


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
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    # The additive [B, 1, T, S] mask (padding anywhere, not only on the left) has no varlen form.
    _supports_flash_attn = False
    _supports_flash_attn_2 = False
    _supports_flex_attn = True
    # vLLM's generic Transformers backend serves a model that declares this through its own attention
    # and KV cache, without the engram memory, the hyper-connection lanes or Needle's masks: it would
    # serve Needle wrongly. Needle is served by the `needle_hf.serving.vllm` plugin's model instead.
    _supports_attention_backend = False
    _supports_cache_class = True
    _supports_static_cache = True  # the engram state lives in the cache (`NeedleEngramCacheLayer`)
    _can_compile_fullgraph = True

    def _init_weights(self, module: nn.Module):
        """The reference initialisation: N(0, 0.02) projections, embeddings, tables and probes; residual-stream
        projections N(0, 0.02 / sqrt(2 L)); zero norms and gates; identity-like Hadamard, conv and lane mixing.

        Each module initialises only the parameters it owns directly: transformers 5.x skips modules
        without direct parameters here. Random draws go through `torch.nn.init` (which 5.x guards against
        re-initialising loaded tensors); fixed values through `_init_value`, which checks the same flag.
        """
        std = self.config.initializer_range
        if module is getattr(self, "lm_head", None):
            return  # the tied head's weight is the embedding's, initialised there
        if isinstance(module, NeedleResidualLinear):
            nn.init.normal_(module.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                _init_value(module.bias, 0.0)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, NeedleRMSNorm):
            _init_value(module.weight, NORM_WEIGHT_INIT)
        elif isinstance(module, NeedleHadamardMLP):
            _init_value(module.diag_in, HADAMARD_DIAG_IN_INIT)
            _init_value(module.diag_hidden, HADAMARD_DIAG_HIDDEN_INIT)
            _init_value(module.diag_out, HADAMARD_DIAG_OUT_INIT)
        elif isinstance(module, NeedleBlock):
            _init_value(module.attention_gate, ATTENTION_GATE_INIT)
        elif isinstance(module, NeedleHyperConnection):
            _init_value(module.pre_bias, 0.0)
            _init_value(module.post_bias, 0.0)
            _init_value(module.res_bias, HYPER_CONNECTION_RES_BIAS_INIT * torch.eye(module.lanes))
            for alpha in (module.pre_alpha, module.post_alpha, module.res_alpha):
                _init_value(alpha, HYPER_CONNECTION_ALPHA_INIT)
        elif isinstance(module, NeedleEngram):
            nn.init.normal_(module.tables, mean=0.0, std=std)
            taps = torch.zeros_like(module.conv_taps)
            taps[0] = ENGRAM_FIRST_TAP_INIT
            _init_value(module.conv_taps, taps)
        elif isinstance(module, NeedleContrastiveHead):
            nn.init.normal_(module.probes, mean=0.0, std=std)
            _init_value(module.log_temperature, math.log(CONTRASTIVE_TEMPERATURE_INIT))
        elif isinstance(module, NeedleConfidenceHead):
            nn.init.normal_(module.probes, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, without_heads: bool = False, **kwargs):
        """`PreTrainedModel.from_pretrained`, but strict: every tensor the config implies must be in the
        checkpoint with its exact shape, and no other tensor may be there. Raises `NeedleWeightsError`
        instead of randomly initialising what is missing.

        ``without_heads=True`` builds the model with the optional heads (MTP, contrastive, confidence)
        switched off in its config and leaves any head tensors of the checkpoint unused: the way to
        load a backbone checkpoint (a saved `NeedleModel`) into `NeedleForCausalLM`. The backbone
        itself still loads strictly.
        """
        wants_loading_info = kwargs.pop("output_loading_info", False)
        if kwargs.pop("ignore_mismatched_sizes", False):
            raise ValueError("Needle checkpoints load exactly; `ignore_mismatched_sizes=True` is not supported")
        if without_heads:
            kwargs.update(use_mtp_head=False, use_contrastive_head=False, use_confidence_head=False)
        # Let transformers report shape mismatches (instead of raising its own, version-specific error),
        # then refuse them below together with missing and unexpected tensors.
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path,
            *model_args,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            **kwargs,
        )
        unused = NeedleModel._unused_checkpoint_prefixes if without_heads else ()
        raise_unless_exact(model, loading_info, pretrained_model_name_or_path, unused_prefixes=unused)
        if hasattr(model, "freeze_mtp_head"):
            model.freeze_mtp_head()  # transformers 5.x loads parameters anew, trainable
        return (model, loading_info) if wants_loading_info else model


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
        self.embed_scale = embedding_scale(config.hidden_size)
        # Constants derived from the config, kept out of the state dict: copies per (name, device, dtype).
        self._constant_copies: dict[tuple, torch.Tensor] = {}
        self.gradient_checkpointing = False
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
        """`architecture_constant` ``name`` on ``device`` in ``dtype``, built once per placement."""
        placement = (name, str(device), dtype)
        if placement not in self._constant_copies:
            table = architecture_constant(name, self.config)
            self._constant_copies[placement] = torch.from_numpy(table).to(device=device, dtype=dtype)
        return self._constant_copies[placement]

    def step_inputs(
        self,
        batch: int,
        length: int,
        cache_position: torch.Tensor,
        key_length: int,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        *,
        attention_window: int = 0,
        segment_ids: Optional[torch.Tensor] = None,
        packed_attention: bool = True,
    ) -> NeedleStepInputs:
        """Masks, RoPE tables and constants of a forward call over ``length`` new tokens at ``cache_position``
        [T], attending over ``key_length`` keys (past + T, or a static cache's length);
        ``attention_window``: see `attention_allowed`.

        attention_mask: 2-D [B, S'] (1 = real token, S' <= S), or a custom 4-D [B, 1, T, S]
        (`attention_sees_from_4d`; refused where the engram has no meaning, `check_engram_lookback`).
        segment_ids: [B, T] sequence index of each token of a packed batch (no cached tokens; see
        `NeedleModel.sequence_segments`): a token sees only the earlier tokens of its own sequence.
        packed_attention: run a packed batch's attention over its sequences laid out one per row
        (`PackedLayout`) rather than over [T, T] masks (False: attention probabilities are wanted
        in the batch's own shape).
        """
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        past_length = cache_position[0]
        sees = None  # [B, T, S] bool, only where it is not causal-over-visible-keys
        if attention_mask is None:
            key_visible = torch.ones(batch, key_length, dtype=torch.bool, device=device)
        elif attention_mask.dim() == 4:
            if attention_mask.shape[0] != batch or attention_mask.shape[1] != 1 or attention_mask.shape[2] != length \
                    or attention_mask.shape[3] > key_length:
                raise ValueError(
                    f"a 4-D attention_mask must be [batch, 1, new tokens, past + new tokens]: expected shape "
                    f"{(batch, 1, length, key_length)}, got {tuple(attention_mask.shape)}"
                )
            sees = attention_sees_from_4d(attention_mask.to(device))
            sees = F.pad(sees, (0, key_length - sees.shape[-1]))  # a static cache's free slots
            key_visible = sees.any(dim=1)  # [B, S]: the keys some query sees (padding: none)
        else:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"Needle takes a 2-D attention_mask [batch, past + new tokens] marking real tokens with 1, "
                    f"or a 4-D one [batch, 1, new tokens, past + new tokens], got shape {tuple(attention_mask.shape)}"
                )
            if attention_mask.shape[0] != batch or attention_mask.shape[1] > key_length:
                raise ValueError(
                    f"attention_mask must cover the cached and the new tokens: expected shape {(batch, key_length)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            key_visible = attention_mask.to(device=device, dtype=torch.bool)
            key_visible = F.pad(key_visible, (0, key_length - key_visible.shape[1]))  # a static cache's free slots
        if segment_ids is not None:
            if key_length != length or tuple(segment_ids.shape) != (batch, length):
                raise ValueError(
                    f"packed sequences (segment ids {tuple(segment_ids.shape)}) need a forward over the whole "
                    f"text of shape {(batch, length)} without cached tokens (key length {key_length})"
                )
            segment_ids = segment_ids.to(device)
        traced = is_torchdynamo_compiling() or torch.compiler.is_exporting()
        layout = None
        if segment_ids is not None and sees is None and packed_attention and not traced \
                and self.config._attn_implementation != "flex_attention":
            layout = PackedLayout.of(segment_ids)
        elif segment_ids is not None:
            same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            sees = (sees if sees is not None else causal[None] & key_visible[:, None, :]) & same
        if position_ids is None and segment_ids is not None:  # each packed sequence starts at 0
            index = torch.arange(length, device=device).expand(batch, -1)
            starts = torch.ones_like(segment_ids, dtype=torch.bool)
            starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
            position_ids = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
        elif position_ids is None:
            mask_2d = key_visible.long() if sees is not None else attention_mask
            position_ids = default_position_ids(mask_2d, past_length, length, batch, device)
        inverse_frequencies = self.constant("rope_inverse_frequencies", device, torch.float32)
        cos, sin = rope_tables(position_ids.to(device), inverse_frequencies)  # [B, T, H] each
        lookback = None
        if layout is not None:
            allowed = layout.attention_allowed(attention_window)  # [Q, 1, M, M]
            lookback = packed_lookback(segment_ids, key_visible, self.config.engram_history + 1)
        else:
            allowed = attention_allowed(key_visible, past_length, length, group=1, window=attention_window)  # [B, 1, T, S]
        if sees is not None:
            query_positions = torch.arange(length, device=device) + past_length
            itself = torch.arange(key_length, device=device)[None, :] == query_positions[:, None]  # [T, S]
            allowed = ((sees & allowed[:, 0]) | itself[None])[:, None]  # window and causality still apply
            width = self.config.engram_history + 1
            lookback = engram_lookback(sees, past_length, width)  # [B, T, R]
            if attention_mask is not None and attention_mask.dim() == 4 and not (
                is_torchdynamo_compiling() or torch.compiler.is_exporting()
            ):
                check_engram_lookback(lookback, engram_lookback(key_visible[:, None, :].expand(-1, length, -1),
                                                                past_length, width), self.config)
        if self.config._attn_implementation == "flex_attention":
            attention_mask_4d = flex_block_mask(allowed)
        else:
            attention_mask_4d = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, torch.finfo(dtype).min
            )
        return NeedleStepInputs(
            key_visible=key_visible,
            attention_mask=attention_mask_4d,
            cos=cos[:, None],
            sin=sin[:, None],
            cache_position=cache_position,
            walsh=self.walsh(device, dtype),
            pre_offsets=self.constant("pre_offsets", device, torch.float32),
            post_offsets=self.constant("post_offsets", device, torch.float32),
            engram_lookback=lookback,
            packed_layout=layout,
        )

    def sequence_segments(
        self,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        cu_seq_lens_q: Optional[torch.Tensor],
        cu_seq_lens_k: Optional[torch.Tensor],
        length: int,
        past_length: int,
    ) -> Optional[torch.Tensor]:
        """Sequence index [B, T] of each token when the batch packs several sequences per row, else None.

        A padding-free batch (TRL's ``padding_free=True``, `DataCollatorWithFlattening`) has no
        attention_mask and gives its boundaries as ``position_ids`` restarting at 0 and, for the varlen
        kernels, as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (one flattened row); transformers reads
        packing only there (no mask, no cached tokens), and so does Needle.
        """
        if cu_seq_lens_k is not None and (cu_seq_lens_q is None or not torch.equal(cu_seq_lens_q.cpu(), cu_seq_lens_k.cpu())):
            raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: Needle's attention is self-attention")
        if attention_mask is not None or past_length:
            if cu_seq_lens_q is not None:
                raise ValueError(
                    "cu_seq_lens_q describes a padding-free batch: pass it without attention_mask and without cached tokens"
                )
            return None
        if cu_seq_lens_q is not None:
            segments = segment_ids_from_cu_seq_lens(cu_seq_lens_q, length)
            if position_ids is not None and position_ids.shape[0] != 1:
                raise ValueError(f"cu_seq_lens_q describes one flattened row, got position_ids of shape {tuple(position_ids.shape)}")
            return segments
        return packed_segment_ids(position_ids) if position_ids is not None else None

    def walsh(self, device: torch.device, dtype: torch.dtype) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """What the MLPs' `walsh_transform` reads (`walsh_operand`), on ``device`` in ``dtype``."""
        return walsh_operand(self.config, lambda name: self.constant(name, device, dtype))

    def engram_memory(
        self, input_ids: torch.Tensor, step: NeedleStepInputs, cache: Optional[Cache]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Engram (key, value) [B, T, D] of the new tokens, by the layer that reads them.

        The window is the `engram_history` positions before the new ones (their ids from the cache's
        `NeedleEngramCacheLayer`, none without a cache) and the new ones. Positions hidden by the mask
        (padding) or before the text count as invisible: an n-gram or a conv tap that reaches one
        contributes zero.
        """
        if not self.engrams:
            return {}
        config = self.config
        batch, length = input_ids.shape
        history = self.engram_context_length
        cache_position = step.cache_position
        if cache is None:
            before_ids = input_ids.new_zeros(batch, history)
        else:
            before_ids = self.engram_cache_layer(cache).update_engram_ids(input_ids, cache_position, history)
        positions = torch.cat([cache_position[:1] - history + torch.arange(history, device=input_ids.device), cache_position])
        window_visible = step.key_visible.index_select(1, positions.clamp(min=0)) & (positions >= 0)  # [B, C]
        window_ids = torch.cat([before_ids, input_ids], dim=1)  # [B, C]

        return engram_window_memory(self.engrams, config, window_ids, window_visible, history, self.embed_tokens.weight.dtype,
                                    lookback=step.engram_lookback)

    def engram_cache_layer(self, cache: Cache) -> NeedleEngramCacheLayer:
        """The cache layer that holds the engram state (that of the first engram layer), made a Needle
        layer on first use."""
        index = self.config.engram_layers[0]
        if getattr(cache, "layer_class_to_replicate", None) is not None:
            while len(cache.layers) <= index:
                cache.layers.append(cache.layer_class_to_replicate())
        layer = cache.layers[index]
        if not isinstance(layer, NeedleEngramCacheLayer):
            layer = cache.layers[index] = NeedleEngramCacheLayer.adopt(layer)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 ``E[tokens] * sqrt(D)`` [B, T, D] (the reference scales before casting to the compute dtype)."""
        return self.embed_tokens(input_ids).float() * self.embed_scale

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        attention_window: Optional[int] = None,
        cache_position: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: None = None,
        *,
        cu_seq_lens_q: Optional[torch.Tensor] = None,
        cu_seq_lens_k: Optional[torch.Tensor] = None,
        max_length_q: Optional[int] = None,
        max_length_k: Optional[int] = None,
        seq_idx: Optional[torch.Tensor] = None,
        compiled_parts: Optional[NeedleCompiledParts] = None,
    ) -> Union[BaseModelOutputWithPast, tuple]:
        """Run the backbone on ``input_ids`` [B, T].

        Args:
            attention_mask: [B, past + T] (or [B, max_cache_len] with a static cache), 1 for real tokens
                and 0 for padding (left or right); or a custom 4-D mask [B, 1, T, past + T], boolean
                (True = attend) or additive float (0 = attend), refused where the engram has no meaning
                (`check_engram_lookback`: shared prefixes, trees).
            position_ids: [B, T]; default ``cumsum(attention_mask) - 1`` (or ``past + arange(T)``).
                Without attention_mask and cache, positions that restart (not the previous plus one)
                start a new packed sequence: each sequence attends only to itself and its engram
                n-grams and conv taps stop at its start (`sequence_segments`).
            cu_seq_lens_q, cu_seq_lens_k: [Q + 1] boundaries of the sequences of one flattened row (TRL's
                padding-free collator, `DataCollatorWithFlattening`); they decide the packing when given.
            max_length_q, max_length_k, seq_idx: what those collators add for varlen kernels; implied by
                the boundaries, accepted so that their batches pass to the model unchanged.
            cache: a transformers `DynamicCache` or `StaticCache`, which also carries the engram state
                (`NeedleEngramCacheLayer`); created when ``use_cache`` and none is given.
                ``past_key_values`` is its name before transformers 5.
            cache_position: [T] where the new tokens go in the cache (default: after the cached ones).
            inputs_embeds: only None: PEFT and TRL pass it on every call, but Needle reads token ids
                (its engram memory hashes them).
            output_hidden_states: return ``(x0, lane mean after layer 1, ..., after layer L)``; the
                final-normed output is ``last_hidden_state``.
            output_attentions: return each layer's attention probabilities (eager attention only).
            attention_window: attend to the last ``n`` key slots only (0: all); default
                ``config.attention_window`` (0, full attention). `generate(attention_window=n)` passes it.
            compiled_parts: compiled layers and engram memory to run instead of the modules (what
                `NeedleForCausalLM.get_compiled_call` passes); None runs the modules.
        """
        _refuse_inputs_embeds(inputs_embeds)
        cache = merge_cache_arguments(past_key_values, cache)
        use_cache = _config_default(use_cache, self.config, "use_cache", True)
        output_attentions = _config_default(output_attentions, self.config, "output_attentions", False)
        output_hidden_states = _config_default(output_hidden_states, self.config, "output_hidden_states", False)
        return_dict = _config_default(return_dict, self.config, "return_dict", True)
        if output_attentions and self.config._attn_implementation != "eager":
            raise ValueError(
                f"output_attentions needs eager attention; this model uses {self.config._attn_implementation!r} "
                "(load it with attn_implementation='eager')"
            )
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False  # recomputed layers would write their keys twice
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None

        batch, length = input_ids.shape
        device = input_ids.device
        static = cache is not None and is_static_cache(cache)
        if cache_position is None:
            past = cache.get_seq_length() if cache is not None else 0
            cache_position = torch.arange(length, device=device) + past
        if static:
            key_length = static_cache_length(cache)
        else:
            key_length = (cache.get_seq_length() if cache is not None else 0) + length
            if attention_mask is not None and attention_mask.shape[-1] != key_length:
                expected = (batch, key_length) if attention_mask.dim() != 4 else (batch, 1, length, key_length)
                raise ValueError(
                    f"attention_mask must cover the cached and the new tokens: expected shape {expected}, "
                    f"got {tuple(attention_mask.shape)}"
                )
        window = self.config.attention_window if attention_window is None else attention_window_option(attention_window)
        segments = None
        if cu_seq_lens_q is not None or cu_seq_lens_k is not None or (attention_mask is None and position_ids is not None):
            past_length = 0 if cache is None else int(cache.get_seq_length())
            segments = self.sequence_segments(attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k, length,
                                              past_length)
        step = self.step_inputs(batch, length, cache_position, key_length, attention_mask, position_ids,
                                attention_window=window, segment_ids=segments, packed_attention=not output_attentions)
        hidden, all_hidden, all_attentions = self.forward_with_step_inputs(
            input_ids, step, cache, output_hidden_states=output_hidden_states, output_attentions=output_attentions,
            compiled_parts=compiled_parts,
        )
        output = BaseModelOutputWithPast(
            last_hidden_state=hidden,
            hidden_states=all_hidden,
            attentions=all_attentions,
            **{BASE_CACHE_OUTPUT_FIELD: cache},
        )
        return output if return_dict else output.to_tuple()

    def forward_with_step_inputs(
        self,
        input_ids: torch.Tensor,
        step: NeedleStepInputs,
        cache: Optional[Cache],
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        compiled_parts: Optional[NeedleCompiledParts] = None,
    ) -> tuple[torch.Tensor, Optional[tuple], Optional[tuple]]:
        """The layers over ``input_ids`` [B, T] with the call's `step_inputs` already made (MTP decoding
        shares them with its head) -> (final-normed hidden [B, T, D], hidden states or None, attentions or None).
        ``compiled_parts``: see `forward`."""
        layers = self.layers if compiled_parts is None else compiled_parts.layers
        engram_memory = self.engram_memory if compiled_parts is None else compiled_parts.engram_memory
        x0 = self.embed(input_ids).to(self.embed_tokens.weight.dtype)  # [B, T, D]
        memory = engram_memory(input_ids, step, cache)
        # Contiguous, like every later layer's input: a compiled layer then serves the first one too.
        lanes = x0[:, :, None, :].expand(-1, -1, self.config.hyper_connection_lanes, -1).contiguous()  # [B, T, L, D]

        all_hidden = (x0,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        caches = layer_caches(cache, len(self.layers))
        lane_offsets = zip(step.pre_offsets.unbind(0), step.post_offsets.unbind(0))
        for i, (layer, offsets) in enumerate(zip(layers, lane_offsets)):
            key, value = memory.get(i, (None, None))
            lanes, probs = layer(lanes, key, value, step, cache=caches[i], lane_offsets=offsets,
                                 output_attentions=output_attentions)
            if output_hidden_states:
                all_hidden += (lane_mean(lanes),)
            if output_attentions:
                all_attentions += (probs,)
        return self.norm(lane_mean(lanes)), all_hidden, all_attentions


# --------------------------------------------------------------------------------------------------
# Causal LM with the optional heads


class NeedleForCausalLM(NeedlePreTrainedModel, NeedleGenerationMixin):
    """Needle 2 for generation: the backbone, tied float32 logits, and the optional MTP,
    contrastive and confidence heads (present when the config says so).

    Weight names: ``model.*`` (the backbone), ``mtp.*``, ``contrastive_head.*``, ``confidence_head.*``.
    """

    # `lm_head.weight` is `model.embed_tokens.weight` (config.tie_word_embeddings is always True).
    _tied_weights_keys = _TIED_WEIGHTS_KEYS
    # The forward takes `num_items_in_batch` (so `Trainer` leaves the loss normalisation to it).
    accepts_loss_kwargs = True
    # PreTrainedModel has its own `get_compiled_call` and comes before the mixin in the MRO.
    get_compiled_call = NeedleGenerationMixin.get_compiled_call

    def __init__(self, config: NeedleConfig):
        super().__init__(config)
        self.model = NeedleModel(config)
        # Registered after the backbone, so parameter listings name the shared tensor by its source;
        # built without an initial draw (`skip_init`): its weight is replaced by the embedding's.
        self.lm_head = torch.nn.utils.skip_init(nn.Linear, config.hidden_size, config.vocab_size, bias=False)
        self.mtp = NeedleMultiTokenPrediction(config) if config.use_mtp_head else None
        self.contrastive_head = NeedleContrastiveHead(config) if config.use_contrastive_head else None
        self.confidence_head = NeedleConfidenceHead(config) if config.use_confidence_head else None
        self.post_init()  # ties lm_head.weight to model.embed_tokens.weight
        self._register_load_state_dict_pre_hook(fill_tied_alias, with_module=True)  # public from torch 2.5
        self.freeze_mtp_head()

    def freeze_mtp_head(self) -> None:
        """Fine-tuning leaves the MTP head as it is, as the reference's does (its loss is the next-token
        loss, its adapters sit in the backbone): the head is frozen on construction and loading, so
        Trainer and PEFT count it as not trainable and every trainable weight gets a gradient from the
        default loss. ``model.mtp.requires_grad_()`` trains it (with `NeedleLossMixin(mtp_loss_weight > 0)`,
        whose loss reaches it)."""
        if self.mtp is not None:
            self.mtp.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        """The bias-less output head, whose weight is the token embedding's: logits = hidden @ embed_tokens.weight.T."""
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear):
        self.lm_head = new_embeddings

    def get_decoder(self) -> NeedleModel:
        return self.model

    @property
    def engram_context_length(self) -> int:
        return self.model.engram_context_length

    def tied_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 ``hidden @ E.T``: [B, T, D] -> [B, T, V] (``E`` = ``lm_head.weight`` = the token embedding)."""
        hidden = quantize_activations(hidden, self.config)  # deploy numerics hook
        return tied_logits(hidden, self.lm_head.weight)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        cache_position: Optional[torch.LongTensor] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        return_mtp_logits: bool = False,
        attention_window: Optional[int] = None,
        num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
        shift_labels: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: None = None,
        *,
        cu_seq_lens_q: Optional[torch.Tensor] = None,
        cu_seq_lens_k: Optional[torch.Tensor] = None,
        max_length_q: Optional[int] = None,
        max_length_k: Optional[int] = None,
        seq_idx: Optional[torch.Tensor] = None,
        compiled_parts: Optional[NeedleCompiledParts] = None,
    ) -> Union[NeedleCausalLMOutput, tuple]:
        """Logits [B, T, V] float32 of ``input_ids`` [B, T] (see `NeedleModel.forward` for the inputs).

        Args:
            labels: [B, T] token ids (-100 = ignored); the loss is next-token cross-entropy
                (transformers' `ForCausalLMLoss`: labels shift left by one inside).
            shift_labels: [B, T] labels already aligned with the logits (instead of ``labels``).
            num_items_in_batch: the number of target tokens of the whole (accumulated) batch: the loss
                is then a sum divided by it, so gradient accumulation matches one big batch.
            logits_to_keep: keep the logits of the last ``n`` positions (int, 0 = all) or of the given
                position indices (tensor); applies to ``mtp_logits`` too.
            return_mtp_logits: also return ``mtp_logits`` (``mtp_logits[:, t]`` scores token t + 2);
                only on a forward over the whole text (empty cache). In a packed batch the MTP head
                sees the next token as 0 at each sequence's last position, as at the end of a row.
            cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx: a padding-free batch's
                boundaries (see `NeedleModel.forward`).
            compiled_parts: see `NeedleModel.forward` (`get_compiled_call` passes them).
        """
        forward_arguments = dict(locals())  # deploy numerics hook (first statement: the arguments only)
        qat_weights = training_weights(self)  # deploy numerics hook: QAT reruns on CQ weights
        if qat_weights is not None:  # deploy numerics hook
            return forward_on_training_weights(self, qat_weights, forward_arguments)  # deploy numerics hook
        _refuse_inputs_embeds(inputs_embeds)
        cache = merge_cache_arguments(past_key_values, cache)
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
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            cache_position=cache_position,
            attention_window=attention_window,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            seq_idx=seq_idx,
            compiled_parts=compiled_parts,
        )
        hidden = outputs.last_hidden_state
        keep = _positions_to_keep(logits_to_keep)
        logits = self.tied_logits(hidden[:, keep]) if compiled_parts is None else compiled_parts.output_head(hidden[:, keep])

        mtp_logits = None
        if return_mtp_logits:
            batch, length = input_ids.shape
            positions = torch.arange(length, device=input_ids.device)
            window = self.config.attention_window if attention_window is None else attention_window_option(attention_window)
            segments = None
            if cu_seq_lens_q is not None or (attention_mask is None and position_ids is not None):
                segments = self.model.sequence_segments(attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                                                        length, 0)
            step = self.model.step_inputs(batch, length, positions, length, attention_mask, position_ids,
                                          attention_window=window, segment_ids=segments)
            next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
            if segments is not None:  # a sequence's last token is followed by nothing, as at a row's end
                last = torch.cat([segments[:, 1:] != segments[:, :-1], torch.ones_like(segments[:, :1], dtype=torch.bool)], 1)
                next_ids = next_ids.masked_fill(last, 0)
            predicted = self.mtp(hidden, self.model.embed(next_ids), step)
            mtp_logits = self.tied_logits(predicted[:, keep])

        loss = None
        if labels is not None or shift_labels is not None:
            if logits.shape[1] != input_ids.shape[1]:
                raise ValueError("labels need the logits of every position: leave logits_to_keep at 0")
            loss = self.loss_function(
                logits=logits,
                labels=labels,
                vocab_size=self.config.vocab_size,
                num_items_in_batch=num_items_in_batch,
                shift_labels=shift_labels,
            )

        output = NeedleCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            mtp_logits=mtp_logits,
            **{CACHE_OUTPUT_FIELD: getattr(outputs, BASE_CACHE_OUTPUT_FIELD)},
        )
        return output if return_dict else output.to_tuple()

    # ----------------------------------------------------------------------------------------------
    # Probe-pooling heads

    def _probe_cells(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cells [B, T, L + 1, D] float32 (``x0`` and the lane mean after every layer) and their keep mask [B, T].

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
        return self.cells_from_hidden_states(input_ids, outputs.hidden_states), attention_mask.bool()

    def cells_from_hidden_states(self, input_ids: torch.Tensor, hidden_states: tuple) -> torch.Tensor:
        """The heads' cells [B, T, L + 1, D] float32 from a forward's ``hidden_states`` (``output_hidden_states=True``):
        ``x0`` and the lane mean after every layer. Lets a training step read the heads off its own forward."""
        cells = torch.stack([self.model.embed(input_ids), *[h.float() for h in hidden_states[1:]]], dim=2)
        return cells.detach()  # the heads read a fixed backbone (`specification_needle`)

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
