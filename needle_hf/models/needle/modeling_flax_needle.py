"""Needle 2 in Flax for Hugging Face Transformers (4.57, the last release with Flax models).

Axis letters in shape comments and einsum strings, the numerical choice of each op, the attention
rule (padding rows attend to themselves only, the sliding window) and the names and argument orders
of the helpers are those of `specification_needle`, which the PyTorch model follows too.

Layout, as in transformers' ``modeling_flax_llama``: the attention, the block and the decoder layer,
the layer collection, the backbone module and the causal-LM module, then the `FlaxPreTrainedModel`
wrappers. One concept per module beside it, named as the PyTorch twin's (their public names are
importable from here too): `hyper_connections_flax_needle` (lane routing), `engram_flax_needle` (the
engram memory), `mtp_flax_needle` (the MTP head), `heads_flax_needle` (probe-pooling heads),
`hadamard_mlp_flax_needle`, `projections_flax_needle` (LoRA-capable projections, decoding kernels),
`ops_flax_needle`, `norms_flax_needle`, `masking_flax_needle`, `generation_flax_needle` (`generate`
and its checks), `loading_flax_needle` (strict loading, the compute dtype), `cache_flax_needle` (the
KV cache and the decoding state), `rematerialisation_flax_needle` (gradient checkpointing).

The cache (`init_cache`, a `cache` collection) holds, per layer, keys and values for every position
up to `max_length`; for the engram memory, the last `config.engram_history` tokens with their
validity (an engram output at position t depends on tokens t-11..t) and, per site, the value
projections of the last positions its dilated convolution reads.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.frozen_dict import FrozenDict, freeze, unfreeze
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers.modeling_flax_outputs import FlaxBaseModelOutput, FlaxCausalLMOutput
from transformers.modeling_flax_utils import FlaxPreTrainedModel

from .cache_flax_needle import FlaxNeedleDecodeState, LayerKVCache
from .configuration_needle import NeedleConfig
from .deploy_numerics_flax import (  # deploy numerics hooks
    quantize_activations,
    quantize_kv,
    training_weights,
)
from .engram_flax_needle import FlaxNeedleEngram, FlaxNeedleEngramCollection, add_engram_read, engram_window_memory  # noqa: F401  (re-exported)
from .generation_flax_needle import FlaxNeedleGenerationMixin, check_position_ids, check_prompt_ids  # noqa: F401  (re-exported)
from .hadamard_mlp_flax_needle import FlaxNeedleHadamardMLP
from .heads_flax_needle import FlaxNeedleConfidenceHead, FlaxNeedleContrastiveHead, FlaxNeedleHeadsMixin, probe_pool  # noqa: F401  (re-exported)
from .hyper_connections_flax_needle import FlaxNeedleHyperConnection
from .loading_flax_needle import (
    SAFE_WEIGHTS_NAME,
    auto_class_dtype_request,  # noqa: F401  (re-exported)
    compute_dtype,  # noqa: F401  (re-exported)
    flax_params_to_hf,
    read_checked_weights,
    resolve_config,
)
from .masking_flax_needle import attention_allowed, packed_segment_ids
from .mtp_flax_needle import FlaxNeedleMTPHead, text_mtp_hidden
from .norms_flax_needle import FlaxNeedleRMSNorm, rms_unit, zero_centred_rms_norm  # noqa: F401  (re-exported)
from .numerics import (
    ATTENTION_GATE_INIT,
    CAUSAL_QUERY_ROWS,
    FUSED_QKVG_PROJECTIONS,
    causal_query_blocks,
    hyper_connection_offsets,
    rope_inverse_frequencies,
)
from .ops_flax_needle import (  # noqa: F401  (re-exported: the twin ops table)
    apply_rotary,
    engram_hash_indices,
    log_space_sinkhorn,
    normal_initializer,
    rope_tables,
    shift_right,
    sinkhorn,
    walsh_operand,
    walsh_transform,
)
from .projections_flax_needle import FUSED_QKVG_KERNEL, FlaxNeedleLinear, fused_projections, with_decoding_kernels  # noqa: F401  (re-exported)
from .rematerialisation_flax_needle import rematerialised
from .specification_needle import (  # noqa: F401  (re-exported)
    NeedleWeightsError, check_positions, embedding_scale, logits_to_keep_option, positions_taken, prompt_ids_error,
)

# transformers copies only a model file's own relative imports out of a local folder
# (trust_remote_code=True): the modules that the modules above import are named here too.
from .mtp_option import pop_mtp_option  # noqa: F401  (generation_flax_needle)
from .speculative_flax import mtp_generate  # noqa: F401  (generation_flax_needle)
from .weight_names import check_weights  # noqa: F401  (loading_flax_needle)


@flax.struct.dataclass
class FlaxNeedleCausalLMOutput(FlaxCausalLMOutput):
    """`FlaxCausalLMOutput` plus the multi-token-prediction logits (`mtp_logits[:, t]` predicts token t+2)."""

    mtp_logits: Optional[jnp.ndarray] = None
    past_key_values: Optional[dict] = None


# --------------------------------------------------------------------------------------------------
# Modules


class FlaxNeedleAttention(nn.Module):
    """GQA self-attention with q/k norms, half-split RoPE and a sigmoid output gate."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        # FlaxNeedleLinear rather than nn.Dense: the same parameters, plus LoRA adapters (fine-tuning).
        dense = partial(FlaxNeedleLinear, cfg.hidden_size, dtype=self.dtype, init_std=cfg.initializer_range)
        residual_std = cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers)
        self.q_proj = dense(cfg.attention_dim)
        self.k_proj = dense(cfg.kv_dim)
        self.v_proj = dense(cfg.kv_dim)
        self.gate_proj = dense(cfg.attention_dim)
        self.o_proj = FlaxNeedleLinear(cfg.attention_dim, cfg.hidden_size, dtype=self.dtype, init_std=residual_std)
        self.q_norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)
        self.k_norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)

    def __call__(self, x, cos, sin, key_mask, *, kv_cache: Optional[LayerKVCache] = None, output_attentions: bool = False):
        """x [B, T, D]; key_mask [B, T, S] (True = may attend) -> ([B, T, D], kv_cache, weights).

        weights: the attention probabilities [B, N, T, S] float32 with `output_attentions`, else None.
        """
        cfg = self.config
        b, t, _ = x.shape
        x = quantize_activations(x, cfg)  # deploy numerics hook
        projections = tuple(getattr(self, name) for name in FUSED_QKVG_PROJECTIONS)
        if self.has_variable("params", FUSED_QKVG_KERNEL) and not any(p.has_adapter() for p in projections):
            # Decoding kernels (`with_decoding_kernels`): one matmul for the four projections.
            q, k, v, gate = fused_projections(x, projections, kernel=self.get_variable("params", FUSED_QKVG_KERNEL))
        else:
            q, k, v, gate = (p(x) for p in projections)
        q = self.q_norm(q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim))  # [B, T, N, H]
        k = self.k_norm(k.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim))  # [B, T, K, H]
        v = v.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)  # [B, T, K, H]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
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
            # One token: the scores as products and sums, which XLA fuses into one loop over the cache
            # (a dot reading the cache updated in place inside generate()'s loop once made XLA copy it).
            # [B, K, G, 1, H, 1] * [B, K, 1, 1, H, S], summed over H -> scores [B, K, G, 1, S]
            scores = jnp.sum(q[..., None].astype(jnp.float32) * k[:, :, None, None].astype(jnp.float32), axis=-2)
            probs = jax.nn.softmax(jnp.where(mask, scores / scale, jnp.finfo(jnp.float32).min), axis=-1)
            weights = probs.astype(v.dtype).astype(jnp.float32)
            if b == 1:
                # [B, K, G, 1, S, 1] * [B, K, 1, 1, S, H], summed over S -> [B, K, G, 1, H]
                out = jnp.sum(weights[..., None] * v[:, :, None, None].astype(jnp.float32), axis=-2).astype(v.dtype)
            else:
                # With several rows XLA fuses that sum into the o_proj matmul, a kernel slower than
                # the matmul alone; a dot stays unfused.
                out = jnp.einsum("bkgts,bksh->bkgth", weights, v.astype(jnp.float32)).astype(v.dtype)
        elif kv_cache is not None and not output_attentions and CAUSAL_QUERY_ROWS < t <= k.shape[-1]:
            # A prompt written at the cache's start (`generate`'s first forward, the SDK's prefill) sees
            # only its own keys: its attention runs in blocks of query rows over them; one written
            # later attends over the whole cache.
            out = jax.lax.cond(
                kv_cache.write_index == 0,
                lambda: causal_attention_in_blocks(q, k[..., :t], v[:, :, :t], mask[..., :t], scale),
                lambda: _grouped_attention(q, k, v, mask, scale)[0],
            )
        else:
            out, probs = _grouped_attention(q, k, v, mask, scale)  # [B, K, G, T, H]
        out = out.transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]
        out = out.reshape(b, t, cfg.attention_dim)
        out = out * nn.sigmoid(gate)
        # Query head n = k * G + g, so [B, K, G, T, S] flattens to [B, N, T, S] in head order.
        weights = probs.reshape(b, cfg.num_attention_heads, t, -1) if output_attentions else None
        out = quantize_activations(out, cfg)  # deploy numerics hook
        return self.o_proj(out), kv_cache, weights


def _grouped_attention(q, k, v, mask, scale):
    """q [B, K, G, T, H], k [B, K, H, S], v [B, K, S, H], mask [B, 1, 1, T, S] (True = may attend)
    -> (out [B, K, G, T, H], float32 probabilities [B, K, G, T, S])."""
    scores = jnp.einsum("bkgth,bkhs->bkgts", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(jnp.where(mask, scores / scale, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bkgts,bksh->bkgth", probs.astype(v.dtype), v), probs


def causal_attention_in_blocks(q, k, v, mask, scale):
    """`_grouped_attention`'s output over a causal mask (query t sees no key after t; S = T): query rows
    [a, a + CAUSAL_QUERY_ROWS) attend over keys [0, a + CAUSAL_QUERY_ROWS) only (`causal_query_blocks`),
    whose later keys are masked for all of them. The same numbers up to float32 summation order
    (masked keys weigh exactly 0 either way)."""
    blocks = [_grouped_attention(q[:, :, :, start:end], k[..., :end], v[:, :, :end], mask[..., start:end, :end], scale)[0]
              for start, end in causal_query_blocks(q.shape[3])]
    return jnp.concatenate(blocks, axis=3)


class FlaxNeedleBlock(nn.Module):
    """One transformer block: [engram read] -> attention (gated residual) -> Hadamard MLP."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.input_layernorm = FlaxNeedleRMSNorm(self.config, dtype=self.dtype)
        self.self_attn = FlaxNeedleAttention(self.config, dtype=self.dtype)
        self.post_attention_layernorm = FlaxNeedleRMSNorm(self.config, dtype=self.dtype)
        self.attention_gate = self.param("attention_gate", nn.initializers.constant(ATTENTION_GATE_INIT), ())
        self.pre_feedforward_layernorm = FlaxNeedleRMSNorm(self.config, dtype=self.dtype)
        self.mlp = FlaxNeedleHadamardMLP(self.config, dtype=self.dtype)

    def block(self, u, cos, sin, key_mask, *, engram=None, kv_cache: Optional[LayerKVCache] = None, output_attentions: bool = False):
        """u [B, T, D] -> ([B, T, D], kv_cache, attention weights [B, N, T, S] or None).

        `engram` = (keys, values) [B, T, D]: the engram memory this layer reads, or None.
        """
        if engram is not None:
            u = add_engram_read(u, *engram, self.config.rms_norm_eps)
        attn, kv_cache, weights = self.self_attn(
            self.input_layernorm(u), cos, sin, key_mask, kv_cache=kv_cache, output_attentions=output_attentions
        )
        x = u + nn.sigmoid(self.attention_gate).astype(self.dtype) * self.post_attention_layernorm(attn)
        return x + self.mlp(self.pre_feedforward_layernorm(x)), kv_cache, weights

    def __call__(self, u, cos, sin, key_mask):
        return self.block(u, cos, sin, key_mask)[0]


class FlaxNeedleDecoderLayer(FlaxNeedleBlock):
    """A block wrapped in hyper-connections over `hyper_connection_lanes` residual lanes."""

    def setup(self):
        super().setup()
        self.hyper_connection = FlaxNeedleHyperConnection(self.config)

    def __call__(
        self, lanes, cos, sin, key_mask, lane_offsets, *, engram=None, kv_cache: Optional[LayerKVCache] = None,
        output_attentions: bool = False,
    ):
        """lanes [B, T, L, D] (compute dtype) -> (lanes [B, T, L, D], kv_cache, attention weights or None).

        lane_offsets = (pre, post) [L] float32: this layer's lane-ownership logit offsets.
        """
        b, t, n, d = lanes.shape
        lanes_f32 = lanes.astype(jnp.float32)
        unit = rms_unit(lanes.reshape(b, t, n * d), self.config.rms_norm_eps)  # [B, T, L*D]
        pre, post, routing = self.hyper_connection(unit, *lane_offsets)
        u = jnp.einsum("btl,btld->btd", pre, lanes_f32).astype(self.dtype)
        y, kv_cache, weights = self.block(
            u, cos, sin, key_mask, engram=engram, kv_cache=kv_cache, output_attentions=output_attentions
        )
        y = y - u
        mixed = jnp.einsum("btij,btjd->btid", routing, lanes_f32) + post[..., None] * y.astype(jnp.float32)[:, :, None, :]
        return mixed.astype(self.dtype), kv_cache, weights


class FlaxNeedleLayerCollection(nn.Module):
    """Decoder layers whose parameters are named per layer (`model.layers.{i}.*`).

    The layers run unrolled, each reading its own parameters in place. (A `lax.scan` would compile
    one layer body instead of `num_hidden_layers`, but it needs the parameters stacked: a 140 MB
    copy per call at the Needle 2 size, plus a copy of each layer's slice per step; both cost more
    time than the layers' own matmuls of a decoding step.) All layers are initialised by one vmapped
    init of a standalone decoder layer, so initialising 27 layers costs one layer's compile. The
    cache holds each layer's keys [B, K, H, S] and values [B, K, S, H] as `keys_{i}`/`values_{i}`.
    With `gradient_checkpointing`, each layer's activations are recomputed in the backward pass
    (`rematerialised`) instead of being kept.
    """

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32
    gradient_checkpointing: bool = False

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
    def __call__(
        self, lanes, cos, sin, key_mask, memory, *, cache_index=None, init_cache: bool = False,
        output_hidden_states: bool = False, output_attentions: bool = False,
    ):
        """lanes [B, T, L, D] -> (lanes after the last layer, lane means per layer, attention weights per layer).

        memory: (engram keys, engram values) [sites, B, T, D], or None without engram sites.
        The lane means ([B, T, D] each) and attention weights ([B, N, T, S] each) are tuples with
        `output_hidden_states` / `output_attentions`, else None.
        """
        cfg = self.config
        pre_offsets, post_offsets = hyper_connection_offsets(cfg.num_hidden_layers, cfg.hyper_connection_lanes)
        site_of_layer = {layer: s for s, layer in enumerate(cfg.engram_layers)}
        initial = self._init_all_layers(self.make_rng("params")) if self.is_initializing() else None
        cache_vars = self._kv_cache_variables(lanes, init_cache)
        caching = cache_vars is not None and not init_cache
        layer_module = self._layer()

        def run_layer(params, lora, lanes, offsets, engram, kv, cos, sin, key_mask):
            variables = {"params": params} if lora is None else {"params": params, "lora": lora}
            return layer_module.apply(
                variables, lanes, cos, sin, key_mask, offsets,
                engram=engram, kv_cache=kv, output_attentions=output_attentions,
            )

        if self.gradient_checkpointing:
            run_layer = rematerialised(run_layer, activation_argument=2)  # lanes
        lane_means, attentions = [], []
        for i in range(cfg.num_hidden_layers):
            params = self.param(str(i), lambda rng, i=i: jax.tree.map(lambda leaf: leaf[i], initial))
            s = site_of_layer.get(i)
            engram = None if s is None else (memory[0][s], memory[1][s])
            kv = LayerKVCache(cache_vars[i][0].value, cache_vars[i][1].value, cache_index) if caching else None
            lora = self.get_variable("lora", str(i))  # this layer's LoRA adapters, if any (fine-tuning)
            lanes, kv, weights = run_layer(params, lora, lanes, (pre_offsets[i], post_offsets[i]), engram, kv,
                                           cos, sin, key_mask)
            if caching:
                cache_vars[i][0].value, cache_vars[i][1].value = kv.keys, kv.values
            lane_means.append(jnp.mean(lanes, axis=2))
            attentions.append(weights)
        return (
            lanes,
            tuple(lane_means) if output_hidden_states else None,
            tuple(attentions) if output_attentions else None,
        )


@flax.struct.dataclass
class FlaxNeedleModelOutput(FlaxBaseModelOutput):
    """`FlaxBaseModelOutput` with the decoding cache (the `cache` collection) when decoding with one."""

    past_key_values: Optional[dict] = None


class FlaxNeedleModule(nn.Module):
    """The Needle 2 backbone: embedding, engram memory, hyper-connected decoder layers, final norm."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32
    gradient_checkpointing: bool = False

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=normal_initializer(cfg.initializer_range))
        self.layers = FlaxNeedleLayerCollection(cfg, dtype=self.dtype, gradient_checkpointing=self.gradient_checkpointing)
        self.engrams = FlaxNeedleEngramCollection(cfg, dtype=self.dtype) if cfg.engram_layers else None
        self.norm = FlaxNeedleRMSNorm(cfg, dtype=self.dtype)
        self.decode_state = FlaxNeedleDecodeState(cfg)

    def embed(self, input_ids):
        """Float32 ``E[tokens] * sqrt(D)`` [B, T] -> [B, T, D] (`specification_needle.embedding_scale`)."""
        return self.embed_tokens(input_ids).astype(jnp.float32) * embedding_scale(self.config.hidden_size)

    def __call__(
        self,
        input_ids,
        attention_mask,
        position_ids,
        *,
        segment_ids=None,
        init_cache: bool = False,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
    ):
        """input_ids/attention_mask/position_ids [B, T] (attention_mask [B, S] when decoding with a cache).

        segment_ids [B, T]: sequence index of each token of a packed batch (no cache): a token attends
        only to its own sequence and its engram stops at the sequence's first token.
        hidden_states: (x0, lane mean after each layer), each [B, T, D]; attentions: per layer [B, N, T, S].
        """
        cfg = self.config
        b, t = input_ids.shape
        cache_index, _, context_tokens, context_valid = self.decode_state(input_ids, attention_mask, init_cache=init_cache)
        key_mask = attention_allowed(attention_mask, 0 if cache_index is None else cache_index, t,
                                     window=self.config.attention_window)
        if segment_ids is not None:
            if cache_index is not None or init_cache:
                raise ValueError("segment_ids describe packed sequences of a whole batch: not with a cache")
            key_mask = key_mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        cos, sin = rope_tables(position_ids, rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta))

        x0 = self.embed(input_ids)  # [B, T, D] float32
        memory = engram_window_memory(self.engrams, cfg, context_tokens, context_valid, context_tokens.shape[1] - t,
                                      init_cache=init_cache, segment_ids=segment_ids)
        lanes = jnp.broadcast_to(x0.astype(self.dtype)[:, :, None, :], (b, t, cfg.hyper_connection_lanes, cfg.hidden_size))
        lanes, lane_means, attentions = self.layers(
            lanes, cos, sin, key_mask, memory, cache_index=cache_index, init_cache=init_cache,
            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )
        last = self.norm(jnp.mean(lanes, axis=2))  # [B, T, D]
        hidden_states = (x0,) + lane_means if output_hidden_states else None
        if not return_dict:
            return tuple(v for v in (last, hidden_states, attentions) if v is not None)
        return FlaxNeedleModelOutput(last_hidden_state=last, hidden_states=hidden_states, attentions=attentions)


class FlaxNeedleForCausalLMModule(nn.Module):
    """The backbone with its tied output head, the MTP head and the optional pooling heads."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32
    gradient_checkpointing: bool = False

    def setup(self):
        cfg = self.config
        self.model = FlaxNeedleModule(cfg, dtype=self.dtype, gradient_checkpointing=self.gradient_checkpointing)
        self.mtp = FlaxNeedleMTPHead(cfg, dtype=self.dtype, block_class=FlaxNeedleBlock) if cfg.use_mtp_head else None
        self.contrastive_head = FlaxNeedleContrastiveHead(cfg, dtype=self.dtype) if cfg.use_contrastive_head else None
        self.confidence_head = FlaxNeedleConfidenceHead(cfg, dtype=self.dtype) if cfg.use_confidence_head else None

    def tied_logits(self, hidden):
        """Tied output head in float32 (the token embedding; PyTorch names it `lm_head` too): [B, T, D] -> [B, T, V]."""
        embedding = self.model.variables["params"]["embed_tokens"]["embedding"]
        hidden = quantize_activations(hidden, self.config)  # deploy numerics hook
        return hidden.astype(jnp.float32) @ embedding.T.astype(jnp.float32)

    def __call__(
        self,
        input_ids,
        attention_mask,
        position_ids,
        *,
        segment_ids=None,
        init_cache: bool = False,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        output_mtp_logits: bool = False,
        return_dict: bool = True,
        logits_to_keep: int = 0,
    ):
        outputs = self.model(
            input_ids, attention_mask, position_ids, segment_ids=segment_ids, init_cache=init_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        hidden = outputs.last_hidden_state
        logits = self.tied_logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        mtp_logits = None
        if output_mtp_logits or self.is_initializing():
            mtp_logits = (self.mtp_logits(input_ids, attention_mask, position_ids, hidden, segment_ids=segment_ids)
                          if self.mtp is not None else None)
            if self.is_initializing():
                self._touch_heads(input_ids)
        if not return_dict:
            return tuple(v for v in (logits, mtp_logits, outputs.hidden_states, outputs.attentions) if v is not None)
        return FlaxNeedleCausalLMOutput(
            logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions, mtp_logits=mtp_logits
        )

    def mtp_logits(self, input_ids, attention_mask, position_ids, hidden, *, segment_ids=None):
        """MTP logits [B, T, V] of a full sequence (input_ids and attention_mask both [B, T]); with
        segment_ids (packed sequences) a sequence's last token is followed by nothing, as a row's."""
        return self.tied_logits(text_mtp_hidden(self, input_ids, attention_mask, position_ids, hidden, segment_ids=segment_ids))

    def hidden_and_logits(self, input_ids, attention_mask, position_ids):
        """Final-normed hidden [B, T, D] and logits [B, T, V] (MTP decoding drafts from the hidden states)."""
        hidden = self.model(input_ids, attention_mask, position_ids).last_hidden_state
        return hidden, self.tied_logits(hidden)

    def mtp_draft_logits(self, hidden, next_ids, position_ids, attention_mask, kv_cache: LayerKVCache, pick):
        """MTP logits [B, V] of new position ``pick`` (may be traced) of T at ``kv_cache.write_index``, the
        MTP block over its own cache: hidden [B, T, D] and the ids of the tokens after them [B, T];
        attention_mask [B, S]. -> (logits, kv_cache)."""
        cfg = self.config
        cos, sin = rope_tables(position_ids, rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta))
        key_mask = attention_allowed(attention_mask, kv_cache.write_index, next_ids.shape[1], window=cfg.attention_window)
        predicted, kv_cache = self.mtp.cached(hidden, self.model.embed(next_ids), cos, sin, key_mask, kv_cache=kv_cache)
        return self.tied_logits(jax.lax.dynamic_index_in_dim(predicted, pick, axis=1, keepdims=False)), kv_cache

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
        return jax.lax.stop_gradient(cells), attention_mask.astype(jnp.bool_)

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


class FlaxNeedlePreTrainedModel(FlaxPreTrainedModel):
    """Weight init, cache init and the call interface shared by the Flax Needle models.

    Weights are saved and read as one PyTorch-layout `model.safetensors` (metadata `format: pt`),
    the file the PyTorch model reads too; loading checks every tensor name and shape first
    (`weight_names.check_weights`, raising `NeedleWeightsError`).
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
        *,
        gradient_checkpointing: bool = False,
        _loaded_params: Optional[dict] = None,
    ):
        # `from_pretrained` passes the parameters it read (checked against the weight table), which
        # then stand in for the initial values: no random init is compiled or allocated.
        self._loaded_params = _loaded_params
        module = self.module_class(config=config, dtype=dtype, gradient_checkpointing=gradient_checkpointing)
        super().__init__(config, module, input_shape=input_shape, seed=seed, dtype=dtype, _do_init=_do_init)

    def enable_gradient_checkpointing(self):
        """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
        self._module = self.module_class(config=self.config, dtype=self.dtype, gradient_checkpointing=True)

    def init_weights(self, rng: jax.random.PRNGKey, input_shape: tuple, params: FrozenDict = None) -> FrozenDict:
        if self._loaded_params is not None and params is None:
            return freeze(self._loaded_params)
        input_ids = jnp.zeros(input_shape, dtype="i4")
        attention_mask = jnp.ones_like(input_ids)
        position_ids = jnp.broadcast_to(jnp.arange(input_shape[-1]), input_shape)
        random_params = jax.jit(partial(self.module.init, {"params": rng}, input_ids, attention_mask, position_ids))()["params"]
        if params is None:
            return random_params
        random_params = flatten_dict(unfreeze(random_params))
        params = flatten_dict(unfreeze(params))
        for missing_key in self._missing_keys:
            params[missing_key] = random_params[missing_key]
        self._missing_keys = set()
        return freeze(unflatten_dict(params))

    def save_pretrained(
        self,
        save_directory,
        params=None,
        push_to_hub: bool = False,
        *,
        token=None,
        repo_id: Optional[str] = None,
        commit_message: Optional[str] = None,
        private: Optional[bool] = None,
        safe_serialization: bool = True,
        max_shard_size=None,
    ):
        """Write `config.json`, `generation_config.json` and a PyTorch-layout `model.safetensors`.

        Needle's weights (under 200 MB at the Needle 2 size) are always one safetensors file, so
        `max_shard_size` (accepted because `push_to_hub` passes it) does not split them, and
        `safe_serialization=False` (a msgpack file) is refused.
        """
        from safetensors.numpy import save_file

        if not safe_serialization:
            raise ValueError("Needle saves PyTorch-layout safetensors only; safe_serialization=False is not supported")
        if os.path.isfile(save_directory):
            raise ValueError(f"{save_directory} is a file; save_pretrained needs a directory")
        os.makedirs(save_directory, exist_ok=True)
        if push_to_hub:
            repo_id = repo_id or str(save_directory).rstrip(os.sep).split(os.sep)[-1]
            repo_id = self._create_repo(repo_id, private=private, token=token)
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
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *,
        config: Optional[NeedleConfig] = None,
        dtype=None,
        input_shape: tuple = (1, 1),
        seed: int = 0,
        _do_init: bool = True,
        gradient_checkpointing: bool = False,
        cache_dir=None,
        force_download: bool = False,
        local_files_only: bool = False,
        token=None,
        revision: str = "main",
        subfolder: str = "",
        proxies=None,
        resume_download=None,
        _commit_hash: Optional[str] = None,
        trust_remote_code: Optional[bool] = None,
        adapter_kwargs: Optional[dict] = None,
        _from_auto: bool = False,
        _from_pipeline: Optional[str] = None,
        **config_overrides,
    ):
        """Read a folder or Hub repository holding `config.json` and a PyTorch-layout `model.safetensors`.

        Every tensor is checked against the config first: a missing, unexpected or mis-shaped one
        raises `NeedleWeightsError` instead of being re-initialised. Keyword arguments that are
        `NeedleConfig` fields override the saved config (others raise `TypeError`); a checkpoint
        without the optional heads (a saved `FlaxNeedleModel`) loads into the causal LM with
        `use_mtp_head=False` (and `use_contrastive_head` / `use_confidence_head` False).

        Args:
            dtype: the compute dtype (a JAX/NumPy float dtype or its name; `"auto"` = the dtype the
                folder's config records, float32 if none); parameters keep the dtype they are stored
                in. Default float32, or the dtype the Auto classes pass inside `config` (see
                `compute_dtype`).
            _do_init: False returns `(model, params)` with the parameters outside the model, as
                transformers' Flax models do.
            gradient_checkpointing: recompute layer activations in the backward pass.
            cache_dir, force_download, local_files_only, token, revision, subfolder, proxies,
                _commit_hash: where and how to fetch the files (`transformers.utils.cached_file`).
            resume_download, trust_remote_code, _from_auto, _from_pipeline: passed by the Auto
                classes and pipelines; no effect here (downloads always resume, and this code is the
                installed package's).
            adapter_kwargs: passed by the Auto classes; a PEFT adapter folder is refused (adapters
                load into the PyTorch model).
        """
        from transformers import GenerationConfig
        from transformers.utils import cached_file

        if adapter_kwargs and "_adapter_model_path" in adapter_kwargs:
            raise ValueError(
                f"{adapter_kwargs['_adapter_model_path']} is a PEFT adapter; adapters load into the PyTorch "
                "NeedleForCausalLM (peft), not the Flax model"
            )
        hub_kwargs = dict(
            cache_dir=cache_dir, force_download=force_download, local_files_only=local_files_only,
            token=token, revision=revision, subfolder=subfolder, proxies=proxies, _commit_hash=_commit_hash,
        )
        config, dtype = resolve_config(pretrained_model_name_or_path, config, dtype, config_overrides, hub_kwargs,
                                       caller=f"{cls.__name__}.from_pretrained")
        weights = cached_file(pretrained_model_name_or_path, SAFE_WEIGHTS_NAME, **hub_kwargs)
        params = read_checked_weights(weights, config, prefix=cls._weights_prefix)
        model = cls(
            config, input_shape=input_shape, seed=seed, dtype=dtype, _do_init=_do_init,
            gradient_checkpointing=gradient_checkpointing, _loaded_params=params,
        )
        model._loaded_params = None  # the model holds them now (or the caller does, without init)
        if model.can_generate():
            try:
                model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
            except OSError:  # no generation_config.json: keep the one derived from the config
                pass
        return model if _do_init else (model, freeze(params))

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
        if past_key_values is None:
            # A forward over whole texts: where both twins check the ids, the position ids and the
            # positions taken (`check_prompt_ids`, `check_position_ids`, `check_positions`).
            check_prompt_ids(input_ids, self.config.vocab_size)
            check_position_ids(position_ids, np.shape(input_ids))
        input_ids = jnp.asarray(input_ids, dtype="i4")
        b, t = input_ids.shape
        if past_key_values is None and not isinstance(position_ids, jax.core.Tracer):
            largest = int(np.max(position_ids)) if position_ids is not None and np.size(position_ids) else None
            check_positions(positions_taken(t, largest), self.config.max_position_embeddings)
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), "i4")
        if position_ids is None:
            if past_key_values is not None:
                raise ValueError("pass `position_ids` when decoding with `past_key_values`")
            position_ids = jnp.clip(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
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
        return_dict: Optional[bool] = None,
        *,
        output_mtp_logits: bool = False,
        lora: Optional[dict] = None,
        segment_ids=None,
        logits_to_keep: int = 0,
    ):
        """Run the model on input_ids [B, T] (see the module classes for the outputs).

        ``logits_to_keep``: the causal LM's logits of the last ``n`` positions only ([B, n, V]; 0, the
        default, keeps all), as in the PyTorch model: a prompt's forward in generation needs the last.

        Packed (padding-free) batches: several sequences in a row, given by ``segment_ids`` [B, T]
        (sequence index of each token) or, without attention_mask and cache, by position_ids
        restarting at 0 (transformers' convention, `packed_segment_ids`). Each sequence attends only
        to itself and its engram stops at its first token: its logits are those of the sequence alone.

        `dropout_rng` and `train` belong to the Flax models' calling convention; Needle has no
        dropout, so they change nothing. `attentions` (with `output_attentions`) are the attention
        probabilities per layer, [B, N, T, S] float32. `lora`: LoRA adapters as a `lora` variable
        collection, nested like the params (`{"model": {"layers": {"0": {"self_attn": {"q_proj":
        {"A": [in, r], "B": [r, out]}}}}}}`, B scaled by alpha / r), applied beside the kernels of
        those projections (see `FlaxNeedleLinear`; `needle_hf.finetune.trainer_flax` builds it).
        """
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if output_mtp_logits and past_key_values is not None:
            raise ValueError("MTP logits are computed on a full sequence, not while decoding with a cache")
        if segment_ids is None and attention_mask is None and position_ids is not None and past_key_values is None:
            segment_ids = packed_segment_ids(jnp.asarray(position_ids, "i4"))
        if segment_ids is not None:
            if past_key_values is not None:
                raise ValueError("segment_ids describe packed sequences of a whole batch: not with past_key_values")
            segment_ids = jnp.asarray(segment_ids, "i4")
            options_segments = {"segment_ids": segment_ids}
            if position_ids is None:  # each sequence starts at position 0
                index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
                starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], dtype=jnp.bool_),
                                          segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
                position_ids = index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
        else:
            options_segments = {}
        input_ids, attention_mask, position_ids = self._prepare_call(input_ids, attention_mask, position_ids, past_key_values)
        variables = {"params": params or self.params}
        variables["params"] = training_weights(variables["params"], self.config, train=train)  # deploy numerics hook
        if lora is not None:
            if train and self.config.deploy_numerics:
                # QAT quantises the merged kernel W + s * A @ B, which an adapter beside W never forms.
                raise ValueError("lora: pass the merged params (finetune_flax.merge_lora) to train under deploy numerics")
            variables["lora"] = lora
        options = dict(output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=return_dict)
        logits_to_keep = logits_to_keep_option(logits_to_keep)
        if self.module_class is FlaxNeedleForCausalLMModule:
            options["output_mtp_logits"] = output_mtp_logits
            options["logits_to_keep"] = logits_to_keep
        elif logits_to_keep:
            raise ValueError("logits_to_keep: the bare backbone returns hidden states, not logits")
        if past_key_values is not None:
            variables["cache"] = past_key_values
            outputs, updated = self.module.apply(
                variables, input_ids, attention_mask, position_ids, mutable=["cache"], **options
            )
            cache = unfreeze(updated["cache"])
            if return_dict:
                return outputs.replace(past_key_values=cache)
            return outputs[:1] + (cache,) + outputs[1:]
        return self.module.apply(variables, input_ids, attention_mask, position_ids, **options, **options_segments)


class FlaxNeedleModel(FlaxNeedlePreTrainedModel):
    """The bare Needle 2 backbone; `last_hidden_state` is the final-normed lane mean."""

    module_class = FlaxNeedleModule
    _weights_prefix = "model."


class FlaxNeedleForCausalLM(FlaxNeedleGenerationMixin, FlaxNeedleHeadsMixin, FlaxNeedlePreTrainedModel):
    """Needle 2 with its tied language-model head, the MTP head and (when present) the pooling heads;
    `generate` from `FlaxNeedleGenerationMixin`, the heads' methods from `FlaxNeedleHeadsMixin`."""

    module_class = FlaxNeedleForCausalLMModule


__all__ = ["FlaxNeedleForCausalLM", "FlaxNeedleModel", "FlaxNeedlePreTrainedModel", "FlaxNeedleCausalLMOutput"]
