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
its folder and nothing from jax (and imports directly every module those import: transformers copies
only a model file's own relative imports out of a local folder).

Layout, as in ``models/llama``: the attention kernel and `NeedleAttention`, the block and the
decoder layer, `NeedlePreTrainedModel`, the backbone `NeedleModel` and `NeedleForCausalLM`. One
concept per module beside it (their public names are importable from here too): `step_inputs_needle`
(the tensors one call derives: masks, RoPE tables), `hyper_connections_needle` (lane routing),
`engram_needle` (the engram memory), `hadamard_mlp_needle`, `mtp_needle` (the MTP head),
`heads_needle` (tied logits, probe-pooling heads), `projections_needle`, `ops_needle`, `norms_needle`,
`masking_needle`, `generation_needle`, `loading_needle`, `cache_needle` (the KV cache and engram state
across transformers versions: ``past_key_values`` / ``cache``), `compiled_decoding_needle`.

The output head ``lm_head`` is a bias-less ``nn.Linear`` whose weight is ``model.embed_tokens.weight``
(`_tied_weights_keys`: a list on 4.57, a ``{tied: source}`` dict on 5.x). Saved files hold the one
tensor of the weight table (`weight_names.py`); `load_state_dict` accepts a state dict with or without
the alias ``lm_head.weight``. Logits stay float32 (``hidden.float() @ lm_head.weight.float().T``).
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
    NeedleEngramCacheLayer,  # noqa: F401  (re-exported)
    layer_caches,
    merge_cache_arguments,
)
from .compiled_decoding_needle import NeedleCompiledParts
from .configuration_needle import NeedleConfig
from .deploy_numerics import (  # deploy numerics hooks
    forward_on_training_weights,
    quantize_activations,
    quantize_kv,
    training_weights,
)
from .engram_needle import NeedleEngram, NeedleEngramMemoryMixin, add_engram_read, engram_window_memory  # noqa: F401  (re-exported)
from .generation_needle import NeedleGenerationMixin, check_position_ids, check_prompt_ids  # noqa: F401  (re-exported)
from .generation_needle import is_integer_tensor, tensor_description
from .heads_needle import NeedleConfidenceHead, NeedleContrastiveHead, NeedleHeadsMixin, probe_pool, tied_logits  # noqa: F401  (re-exported)
from .hadamard_mlp_needle import NeedleHadamardMLP
from .hyper_connections_needle import NeedleHyperConnection
from .loading_needle import fill_tied_alias, from_pretrained_strictly
from .masking_needle import (  # noqa: F401  (re-exported)
    PackedLayout, attention_allowed, attention_sees_from_4d, check_engram_lookback, default_position_ids,
    engram_lookback, flex_block_mask, largest_position, packed_lookback, packed_segment_ids,
    segment_ids_from_cu_seq_lens,
)
from .mtp_needle import NeedleMultiTokenPrediction, text_mtp_hidden
from .norms_needle import NeedleRMSNorm, rms_unit, zero_centred_rms_norm  # noqa: F401  (re-exported)
from .numerics import (
    ATTENTION_GATE_INIT, CONTRASTIVE_TEMPERATURE_INIT, ENGRAM_FIRST_TAP_INIT, HADAMARD_DIAG_HIDDEN_INIT,
    HADAMARD_DIAG_IN_INIT, HADAMARD_DIAG_OUT_INIT, HYPER_CONNECTION_ALPHA_INIT, HYPER_CONNECTION_RES_BIAS_INIT,
    NORM_WEIGHT_INIT, TIED_WEIGHTS,
)
from .ops_needle import (  # noqa: F401  (re-exported: the twin ops table)
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
from .projections_needle import NeedleResidualLinear
from .specification_needle import (
    NeedleWeightsError,  # the one exception of both twins' strict loading
    check_positions,
    embedding_scale,
    logits_to_keep_option,
    positions_taken,
)
from .step_inputs_needle import NeedleStepInputs, NeedleStepInputsMixin

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


# --------------------------------------------------------------------------------------------------
# Modules


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
            attention_interface = cpu_grouped_sdpa(attention_interface, q, plain_causal=step.plain_causal)
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
        x = u if engram_key is None else add_engram_read(u, engram_key, engram_value, self.hyper_connection.eps)
        y, probs = self.block(x, step, cache=cache, **attention_kwargs)
        y = y - u
        mixed = torch.matmul(mixing, lanes_f32)  # [B, T, L, D]
        mixed.addcmul_(write[..., None], y.float()[:, :, None, :])  # in place: no second [B, T, L, D] tensor
        return mixed.to(lanes.dtype), probs


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
        return from_pretrained_strictly(super().from_pretrained, pretrained_model_name_or_path, *model_args,
                                        without_heads=without_heads, **kwargs)


# --------------------------------------------------------------------------------------------------
# Backbone


class NeedleModel(NeedlePreTrainedModel, NeedleStepInputsMixin, NeedleEngramMemoryMixin):
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
        if cache is None and not (is_torchdynamo_compiling() or torch.compiler.is_exporting()):
            # A forward over whole texts: where both twins check the ids, the position ids and the
            # positions taken (`check_prompt_ids`, `check_position_ids`, `check_positions`).
            check_prompt_ids(input_ids, self.config.vocab_size)
            check_position_ids(position_ids, input_ids.shape)
            taken = positions_taken(input_ids.shape[1], largest_position(position_ids, cu_seq_lens_q))
            check_positions(taken, self.config.max_position_embeddings)
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False  # recomputed layers would write their keys twice
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None

        step = self.call_step_inputs(input_ids, attention_mask, position_ids, cache, cache_position=cache_position,
                                     attention_window=attention_window, cu_seq_lens_q=cu_seq_lens_q,
                                     cu_seq_lens_k=cu_seq_lens_k, packed_attention=not output_attentions)
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


class NeedleForCausalLM(NeedlePreTrainedModel, NeedleGenerationMixin, NeedleHeadsMixin):
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
        self.mtp = NeedleMultiTokenPrediction(config, block_class=NeedleBlock) if config.use_mtp_head else None
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
            logits_to_keep: keep the logits of the last ``n`` positions (int >= 0, 0 = all) or of the
                given position indices (a 1-D integer tensor [K]); applies to ``mtp_logits`` too.
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
        keep = _positions_to_keep(logits_to_keep)

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
        logits = self.tied_logits(hidden[:, keep]) if compiled_parts is None else compiled_parts.output_head(hidden[:, keep])

        mtp_logits = None
        if return_mtp_logits:
            predicted = text_mtp_hidden(self, input_ids, hidden, attention_mask, position_ids, attention_window=attention_window,
                                        cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
            mtp_logits = self.tied_logits(predicted[:, keep])

        loss = None
        if labels is not None or shift_labels is not None:
            if logits.shape[1] != input_ids.shape[1]:
                raise ValueError("labels need the logits of every position: leave logits_to_keep at 0")
            for name, value in (("labels", labels), ("shift_labels", shift_labels)):
                if value is not None and (not is_integer_tensor(value) or value.shape != input_ids.shape):
                    raise ValueError(f"{name}: expected integer token ids of shape {tuple(input_ids.shape)} like "
                                     f"input_ids (-100: no target), found {tensor_description(value)}")
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


def _positions_to_keep(logits_to_keep: Union[int, torch.Tensor]) -> Union[slice, torch.Tensor]:
    """The positions whose logits the causal LM returns: the last ``n`` (an int, checked as the Flax twin
    checks it, `logits_to_keep_option`; 0 keeps all), or the indices of a 1-D integer tensor [K]."""
    if isinstance(logits_to_keep, torch.Tensor):
        if not is_integer_tensor(logits_to_keep) or logits_to_keep.dim() != 1:
            raise ValueError("logits_to_keep: expected an int >= 0 (0 keeps all) or a 1-D integer tensor of "
                             f"positions, found {tensor_description(logits_to_keep)}")
        return logits_to_keep
    keep = logits_to_keep_option(logits_to_keep)
    return slice(-keep, None) if keep else slice(None)


__all__ = ["NeedlePreTrainedModel", "NeedleModel", "NeedleForCausalLM", "NeedleCausalLMOutput", "NeedleWeightsError"]
