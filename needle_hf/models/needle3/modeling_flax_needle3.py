"""Flax Needle 3: `FlaxNeedle3ForCausalLM`, the full-sequence forward (transformers 4.57 with jax/flax).

The parameter tree is the PyTorch model's, name for name (layers named "0", "1", ...), and every
tensor keeps the PyTorch layout (a projection's `weight` is [out, in], applied as `x @ weight.T`), so
one `model.safetensors` loads into both twins without a key map. Axis letters and the dtype policy are
those of `modeling_needle3.py`. The decoding state is a plain pytree (`empty_cache`): the keys and
values at their absolute slots, the Q/K/V convolution and engram histories and the hash's last
tokens, so `generate` (FlaxGenerationMixin, jit-compiled) runs one token per step.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.core.frozen_dict import freeze
from transformers.modeling_flax_outputs import FlaxBaseModelOutput, FlaxCausalLMOutput
from transformers.modeling_flax_utils import FlaxPreTrainedModel

from ..needle.numerics import (
    ENGRAM_HASH_PRIME,
    ENGRAM_HASH_SEED,
    ENGRAM_HASH_SHIFT,
    SINKHORN_ITERATIONS,
    UINT32_MASK,
    hyper_connection_offsets,
    rope_inverse_frequencies,
)
# transformers copies a local folder's remote code one relative import deep from the module it loads:
# the file the weight table reads Needle 2's hyper-connection entries from is a direct import here too.
from ..needle.weight_names import _hyper_connection_entries  # noqa: F401
from ..needle.specification_needle import NeedleWeightsError  # noqa: F401  (what weight_names imports: see above)
from ..needle.norms_flax_needle import rms_unit, zero_centred_rms_norm
from .configuration_needle3 import Needle3Config
from .modeling_needle3 import EMBEDDING_NORM_EPS, mlp_permutations
from .weight_names_needle3 import HEAD_NAMES, Needle3WeightsError, weight_specs


def linear(x, weight):
    """x [..., in] @ weight[out, in]ᵀ (the PyTorch layout)."""
    return x @ weight.T.astype(x.dtype)


def visible_at_offset(key_mask, positions, offset, window=0):
    """[B, T]: whether position ``t - offset`` is visible to the query at absolute position t.

    key_mask [B, S] (every absolute position the cache can hold), positions [T]; window > 0 also
    requires offset < window (a sliding-window layer's band).
    """
    if window and offset >= window:
        return jnp.zeros((key_mask.shape[0], positions.shape[0]), bool)
    source = positions - offset
    return key_mask[:, jnp.clip(source, 0)] & (source >= 0)[None, :]


def causal_taps(history, new, taps, tap_ok, dilation):
    """``out[t] = sum_j taps[j] * x[t - dilation j] * ok_j[t]`` over history [B, R, C] then new [B, T, C].

    R = dilation * (taps - 1) inputs come before `new` (zeros before the start); taps [n, C];
    tap_ok[j] [B, T] bool or None (always visible). Returns [B, T, C].
    """
    full = jnp.concatenate([history, new], axis=1)  # [B, R+T, C]
    reach, length = history.shape[1], new.shape[1]
    out = None
    for j in range(taps.shape[0]):
        start = reach - dilation * j
        shifted = full[:, start : start + length]
        if tap_ok[j] is not None:
            shifted = shifted * tap_ok[j][..., None].astype(shifted.dtype)
        term = taps[j] * shifted
        out = term if out is None else out + term
    return out


def _tail(history, new):
    """The last R = history.shape[1] positions of history then new (the next call's history)."""
    reach = history.shape[1]
    return jnp.concatenate([history, new], axis=1)[:, history.shape[1] + new.shape[1] - reach :]


def engram_hash_indices(tokens, length, config: Needle3Config):
    """Hash-table rows [B, T, tables] of the last `length` positions of tokens [B, h + T], whose
    h = max(orders) - 1 leading tokens are history (0 before the start); see the PyTorch twin.
    uint32 arithmetic wraps as the reference's 32-bit hash does."""
    history = tokens.shape[1] - length
    u = tokens.astype(jnp.uint32)
    rows = []
    for order_index, order in enumerate(config.engram_orders):
        for head in range(config.engram_num_heads):
            seed = (ENGRAM_HASH_SEED * (order_index * config.engram_seed_stride + head + 1)) & UINT32_MASK
            acc = jnp.full((tokens.shape[0], length), seed, jnp.uint32)
            for j in range(order):
                acc = (acc ^ u[:, history - j : history - j + length]) * jnp.uint32(ENGRAM_HASH_PRIME)
            acc = acc ^ (acc >> jnp.uint32(ENGRAM_HASH_SHIFT))
            rows.append((acc % jnp.uint32(config.engram_slots)).astype(jnp.int32))
    return jnp.stack(rows, axis=-1)


def kronecker_apply(z, left, right):
    lead = z.shape[:-1]
    z = z.reshape(*lead, left.shape[0], right.shape[0])
    z = jnp.einsum("...ij,ik,jl->...kl", z, left, right)
    return z.reshape(*lead, left.shape[0] * right.shape[0])


def log_space_sinkhorn(logits, iterations=SINKHORN_ITERATIONS):
    log_k = logits
    for _ in range(iterations):
        log_k = log_k - jax.nn.logsumexp(log_k, axis=-1, keepdims=True)
        log_k = log_k - jax.nn.logsumexp(log_k, axis=-2, keepdims=True)
    return jnp.exp(log_k)


def apply_rotary(x, cos, sin):
    """x [B, heads, T, H]; cos, sin [T, H/2] float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


_normal = nn.initializers.normal(0.02)


def empty_cache(config: Needle3Config, batch: int, length: int, dtype=jnp.float32) -> dict:
    """The decoding state of a Flax Needle 3 model before any token, for up to `length` positions.

    - ``seen``: positions consumed so far (int32 scalar; new tokens go to ``seen``, ``seen + 1``, ...);
    - ``tokens`` [B, max(orders) - 1]: the engram hash's history;
    - ``layers[i]``: ``keys`` [B, K, S, H] and ``values`` [B, K, S, U] (post-norm, post-RoPE, slot =
      absolute position; a sliding-window layer reads only the slots its band allows) and ``conv``,
      the last ``qkv_conv_taps - 1`` pre-convolution Q, K and V projections;
    - ``engrams[site]`` [B, dilation * (taps - 1), D]: the last pre-convolution value projections.
    """
    reach = max(config.qkv_conv_taps - 1, 0)
    layers = {
        str(i): {
            "keys": jnp.zeros((batch, config.num_key_value_heads, length, config.head_dim), dtype),
            "values": jnp.zeros((batch, config.num_key_value_heads, length, config.value_head_dim), dtype),
            "conv": tuple(jnp.zeros((batch, reach, width), dtype)
                          for width in (config.query_dim, config.key_dim, config.value_dim)),
        }
        for i in range(config.num_hidden_layers)
    }
    engram_reach = config.engram_conv_dilation * (config.engram_conv_taps - 1)
    return {
        "seen": jnp.zeros((), jnp.int32),
        "tokens": jnp.zeros((batch, max(config.engram_orders) - 1), jnp.int32),
        "layers": layers,
        "engrams": {str(s): jnp.zeros((batch, engram_reach, config.hidden_size), dtype)
                    for s in range(len(config.engram_layers))},
    }


def probe_pool(cells, keep, probes, gain, query, row_bias, eps):
    """Two-level attention pooling of cells [B, T, C, D] (float32) into [B, Q*D]; see the PyTorch twin."""
    batch, _, _, width = cells.shape
    scores = jnp.einsum("btcd,cpd->bcpt", cells, probes.astype(jnp.float32)) / math.sqrt(width)
    scores = jnp.where(keep[:, None, None, :], scores, -jnp.inf)
    pooled = jnp.einsum("bcpt,btcd->bcpd", jax.nn.softmax(scores, axis=-1), cells)
    pooled = rms_unit(pooled, eps) * gain.astype(jnp.float32)[None, :, :, None]  # [B, C, P, D]
    logits = jnp.einsum("bcpd,qd->bqcp", pooled, query.astype(jnp.float32)) / math.sqrt(width) + row_bias[None]
    weights = jax.nn.softmax(logits.reshape(batch, query.shape[0], -1), axis=-1)  # [B, Q, C*P]
    return jnp.einsum("bqm,bmd->bqd", weights, pooled.reshape(batch, -1, width)).reshape(batch, -1)


class FlaxNeedle3ProbeHead(nn.Module):
    """The embedding, confidence or router head: probe pooling over cells, then a projection."""

    config: Needle3Config
    head: str  # "embedding", "confidence" or "router"

    @nn.compact
    def __call__(self, cells, keep):
        """cells [B, T, C, D] float32, keep [B, T] bool -> unit-norm [B, embedding_dim] (embedding),
        [B] (confidence) or [B, 3] (router) float32."""
        cfg, prefix = self.config, f"{self.head}_head."
        p = {spec.hf_name[len(prefix):]: self.param(spec.hf_name[len(prefix):], _normal, spec.hf_shape)
             for spec in weight_specs(cfg) if spec.hf_name.startswith(prefix)}
        pooled = probe_pool(cells, keep, p["probes"], p["gain"], p["query"], p["row_bias"], cfg.rms_norm_eps)
        out = linear(pooled, p["proj.weight"]).astype(jnp.float32)
        if self.head == "embedding":
            return out / jnp.sqrt(jnp.sum(out * out, axis=-1, keepdims=True) + EMBEDDING_NORM_EPS)
        out = out + p["proj.bias"]
        return out[..., 0] if self.head == "confidence" else out


class FlaxNeedle3Layer(nn.Module):
    """One decoder layer (hyper-connection routing around the block), PyTorch parameter names."""

    config: Needle3Config
    layer_idx: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, lanes, step, layer_cache):
        """lanes [B, T, L, D] -> (lanes [B, T, L, D], this layer's updated cache entry)."""
        cfg, i = self.config, self.layer_idx
        shapes = {spec.hf_name[len(f"model.layers.{i}."):]: spec.hf_shape for spec in weight_specs(cfg)
                  if spec.hf_name.startswith(f"model.layers.{i}.")}
        p = {name: self.param(name, _normal, shape) for name, shape in shapes.items()}
        eps, d = cfg.rms_norm_eps, cfg.hidden_size
        batch, length, count, width = lanes.shape
        lanes_f32 = lanes.astype(jnp.float32)
        unit = rms_unit(lanes.reshape(batch, length, count * width), eps)  # [B, T, L*D]
        pre_off, post_off = (jnp.asarray(o[i]) for o in hyper_connection_offsets(cfg.num_hidden_layers, count))
        hc = "hyper_connection."
        pre = jax.nn.sigmoid(p[hc + "pre_alpha"] * linear(unit, p[hc + "pre_proj.weight"]) + p[hc + "pre_bias"] + pre_off)
        u = jnp.einsum("btl,btld->btd", pre, lanes_f32).astype(lanes.dtype)

        # Block: engram read, gated attention, Monarch MLP.
        x = u
        for site, layer in enumerate(cfg.engram_layers):
            if layer == i:
                key, value = step["engram_kv"][site]
                alpha = jax.nn.sigmoid(jnp.sum(rms_unit(x, eps) * rms_unit(key, eps), -1) / math.sqrt(d))
                x = x + (alpha[..., None] * value.astype(jnp.float32)).astype(x.dtype)
        skip = x
        a = zero_centred_rms_norm(x, p["input_layernorm.weight"], eps)
        attended, layer_cache = self._attention(a, p, step, layer_cache)
        x = skip + jax.nn.sigmoid(p["attention_gate"]).astype(x.dtype) * zero_centred_rms_norm(
            attended, p["post_attention_layernorm.weight"], eps)
        x = x + self._mlp(zero_centred_rms_norm(x, p["pre_feedforward_layernorm.weight"], eps), p)
        y = x - u

        post = 2 * jax.nn.sigmoid(p[hc + "post_alpha"] * linear(unit, p[hc + "post_proj.weight"]) + p[hc + "post_bias"] + post_off)
        res = linear(unit, p[hc + "res_proj.weight"]).reshape(batch, length, count, count)
        mix = log_space_sinkhorn(p[hc + "res_alpha"] * res + p[hc + "res_bias"])
        out = jnp.einsum("btij,btjd->btid", mix, lanes_f32) + post[..., None] * y.astype(jnp.float32)[:, :, None, :]
        return out.astype(lanes.dtype), layer_cache

    def _attention(self, a, p, step, layer_cache):
        """a [B, T, D] (normed) -> ([B, T, D], updated cache entry). Keys go to their absolute slots."""
        cfg = self.config
        window = cfg.layer_window(self.layer_idx)
        positions, key_mask = step["positions"], step["key_mask"]  # [T], [B, S]
        batch, length, _ = a.shape
        heads, kv_heads, hd, vd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.value_head_dim
        q, k, v = (linear(a, p[f"self_attn.{n}_proj.weight"]) for n in "qkv")  # [B, T, N*H], [B, T, K*H], [B, T, K*U]
        conv = layer_cache["conv"]
        if cfg.qkv_conv_taps:
            tap_ok = [None] + [visible_at_offset(key_mask, positions, j, window) for j in range(1, cfg.qkv_conv_taps)]
            new = (q, k, v)
            q, k, v = (causal_taps(h.astype(x.dtype), x, p[f"self_attn.{n}_conv_taps"], tap_ok, 1)
                       for h, x, n in zip(conv, new, "qkv"))
            conv = tuple(_tail(h.astype(x.dtype), x).astype(h.dtype) for h, x in zip(conv, new))
        q = zero_centred_rms_norm(q.reshape(batch, length, heads, hd).transpose(0, 2, 1, 3), p["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = zero_centred_rms_norm(k.reshape(batch, length, kv_heads, hd).transpose(0, 2, 1, 3), p["self_attn.k_norm.weight"], cfg.rms_norm_eps)
        v = v.reshape(batch, length, kv_heads, vd).transpose(0, 2, 1, 3)  # [B, K, T, U]
        q, k = apply_rotary(q, step["cos"], step["sin"]), apply_rotary(k, step["cos"], step["sin"])
        seen = step["seen"]
        keys = jax.lax.dynamic_update_slice(layer_cache["keys"], k.astype(layer_cache["keys"].dtype), (0, 0, seen, 0))
        values = jax.lax.dynamic_update_slice(layer_cache["values"], v.astype(layer_cache["values"].dtype), (0, 0, seen, 0))
        key_positions = jnp.arange(keys.shape[2])  # [S]
        allowed = key_mask[:, None, :] & (key_positions[None, None, :] <= positions[None, :, None])  # [B, T, S]
        if window:
            allowed = allowed & (positions[None, :, None] - key_positions[None, None, :] < window)
        groups = heads // kv_heads
        qg = q.reshape(batch, kv_heads, groups, length, hd).astype(jnp.float32)
        scores = jnp.einsum("bkgth,bksh->bkgts", qg, keys.astype(jnp.float32)) / math.sqrt(hd)
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1) * jnp.any(allowed, -1)[:, None, None, :, None]
        out = jnp.einsum("bkgts,bksu->btkgu", weights, values.astype(jnp.float32)).astype(a.dtype)
        out = out.reshape(batch, length, heads * vd) * jax.nn.sigmoid(linear(a, p["self_attn.gate_proj.weight"]))
        return linear(out, p["self_attn.o_proj.weight"]), {"keys": keys, "values": values, "conv": conv}

    def _mlp(self, x, p):
        cfg = self.config
        first, second = (jnp.asarray(perm) for perm in mlp_permutations(cfg))
        gain = 1 + linear(jax.nn.softmax(linear(x, p["mlp.gain_in_proj.weight"]), axis=-1), p["mlp.gain_out_proj.weight"])
        pad = cfg.mlp_size - cfg.hidden_size
        z = jnp.pad(x, ((0, 0), (0, 0), (0, pad))) if pad else x
        z = kronecker_apply(p["mlp.diag_in"] * z, p["mlp.stage1_left"], p["mlp.stage1_right"])[..., first]
        z = jax.nn.silu(p["mlp.diag_hidden"] * gain * z + p["mlp.bias_hidden"])
        z = kronecker_apply(z, p["mlp.stage2_left"], p["mlp.stage2_right"])[..., second]
        z = kronecker_apply(p["mlp.diag_mid"] * z, p["mlp.stage3_left"], p["mlp.stage3_right"])
        return (p["mlp.diag_out"] * z)[..., : cfg.hidden_size]


class FlaxNeedle3Module(nn.Module):
    """Token ids -> final hidden states, float32 logits [B, T, out_vocab] (the tied head), the updated
    cache and the requested probe heads' outputs. PyTorch parameter names.

    One code path serves a whole sequence and a cached step, as in the PyTorch twin: without a cache
    the forward starts from `empty_cache` of the sequence's own length.
    """

    config: Needle3Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids, key_mask, cache=None, *, heads: tuple = ()):
        """input_ids [B, T]; key_mask [B, S] bool over every slot of the cache (S = T without one);
        heads: names of the probe heads to run (their cells are the embeddings and every layer's lane
        mean). Returns (hidden [B, T, D], logits [B, T, out_vocab], cache, {head: output})."""
        cfg = self.config
        batch, length = input_ids.shape
        if cache is None:
            cache = empty_cache(cfg, batch, length, self.dtype)
        seen = cache["seen"]
        positions = seen + jnp.arange(length)  # [T] absolute positions
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta))
        embed = self.param("model.embed_tokens.weight", _normal, (cfg.vocab_size, cfg.hidden_size))
        step = {"positions": positions, "key_mask": key_mask, "seen": seen, "cos": jnp.cos(angles),
                "sin": jnp.sin(angles), "engram_kv": []}
        new_cache = {"seen": seen + length, "tokens": cache["tokens"], "layers": {}, "engrams": {}}
        if cfg.engram_layers:
            tokens = jnp.concatenate([cache["tokens"], input_ids.astype(jnp.int32)], axis=1)  # [B, h + T]
            new_cache["tokens"] = _tail(cache["tokens"], input_ids.astype(jnp.int32))
            rows = engram_hash_indices(tokens, length, cfg)  # [B, T, tables]
            row_ok = jnp.stack([visible_at_offset(key_mask, positions, order - 1) for order in cfg.engram_orders
                                for _ in range(cfg.engram_num_heads)], axis=-1)
            tap_ok = [visible_at_offset(key_mask, positions, j * cfg.engram_conv_dilation)
                      for j in range(cfg.engram_conv_taps)]
            for site in range(len(cfg.engram_layers)):
                prefix = f"model.engrams.{site}."
                shapes = {s.hf_name: s.hf_shape for s in weight_specs(cfg) if s.hf_name.startswith(prefix)}
                p = {name[len(prefix):]: self.param(name, _normal, shape) for name, shape in shapes.items()}
                fetched = p["tables"][jnp.arange(cfg.engram_num_tables), rows] * row_ok[..., None]
                e = fetched.reshape(batch, length, cfg.engram_dim).astype(self.dtype)
                value, history = linear(e, p["value_proj.weight"]), cache["engrams"][str(site)].astype(self.dtype)
                convolved = causal_taps(history, value, p["conv_taps"], tap_ok, cfg.engram_conv_dilation)
                new_cache["engrams"][str(site)] = _tail(history, value).astype(cache["engrams"][str(site)].dtype)
                step["engram_kv"].append((linear(e, p["key_proj.weight"]), convolved))
        x0 = (embed[input_ids] * math.sqrt(cfg.hidden_size)).astype(self.dtype)
        lanes = jnp.broadcast_to(x0[:, :, None, :], (batch, length, cfg.hyper_connection_lanes, cfg.hidden_size))
        cells = [x0]
        for i in range(cfg.num_hidden_layers):
            layer = FlaxNeedle3Layer(cfg, i, self.dtype, name=f"layer_{i}")
            lanes, new_cache["layers"][str(i)] = layer(lanes, step, cache["layers"][str(i)])
            cells.append(jnp.mean(lanes, axis=2))
        norm = self.param("model.norm.weight", nn.initializers.zeros, (cfg.hidden_size,))
        hidden = zero_centred_rms_norm(jnp.mean(lanes, axis=2), norm, cfg.rms_norm_eps)
        logits = hidden.astype(jnp.float32) @ embed[: cfg.output_vocab_size].astype(jnp.float32).T
        if heads:
            stacked = jnp.stack(cells, axis=2).astype(jnp.float32)  # [B, T, C, D]
            keep = key_mask[:, :length]
            heads = {name: FlaxNeedle3ProbeHead(cfg, name, name=f"{name}_head")(stacked, keep) for name in heads}
        return hidden, logits, new_cache, dict(heads) if heads else {}


def enabled_heads(config: Needle3Config) -> tuple:
    return tuple(name for name in HEAD_NAMES if getattr(config, f"use_{name}_head"))


def _module_tree(state: dict, config: Needle3Config) -> dict:
    """HF state dict -> this module's parameter tree (layer tensors under `layer_{i}`, head tensors
    under `<name>_head`, each with its suffix)."""
    tree: dict = {}
    for name, value in state.items():
        if name.startswith("model.layers."):
            index, suffix = name[len("model.layers."):].split(".", 1)
            tree.setdefault(f"layer_{index}", {})[suffix] = value
        elif name.split(".", 1)[0] in {f"{head}_head" for head in HEAD_NAMES}:
            head, suffix = name.split(".", 1)
            tree.setdefault(head, {})[suffix] = value
        else:
            tree[name] = value
    return tree


def _hf_state(tree) -> dict:
    """This module's parameter tree -> HF state dict (the inverse of `_module_tree`)."""
    state = {}
    for key, value in tree.items():
        if key.startswith("layer_"):
            state.update({f"model.layers.{key[len('layer_'):]}.{suffix}": v for suffix, v in value.items()})
        elif isinstance(value, dict) or hasattr(value, "items"):
            state.update({f"{key}.{suffix}": v for suffix, v in value.items()})
        else:
            state[key] = value
    return state


@flax.struct.dataclass
class FlaxNeedle3CausalLMOutput(FlaxCausalLMOutput):
    """`FlaxCausalLMOutput` plus the decoding state (`empty_cache`'s layout) after this call."""

    past_key_values: Optional[dict] = None


class FlaxNeedle3PreTrainedModel(FlaxPreTrainedModel):
    """Weight loading (strict, against the weight table) and the call interface of the Flax Needle 3 models."""

    config_class = Needle3Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    module_class = FlaxNeedle3Module

    def __init__(self, config: Needle3Config, input_shape=(1, 1), seed: int = 0, dtype=jnp.float32, _do_init: bool = True,
                 *, _loaded_params: Optional[dict] = None):
        self._loaded_params = _loaded_params
        super().__init__(config, self.module_class(config=config, dtype=dtype), input_shape=input_shape, seed=seed,
                         dtype=dtype, _do_init=_do_init)

    def init_weights(self, rng, input_shape, params=None):
        if self._loaded_params is not None:
            return freeze(self._loaded_params)
        ids = jnp.zeros(input_shape, jnp.int32)
        return self.module.init(rng, ids, jnp.ones(input_shape, bool), heads=enabled_heads(self.config))["params"]

    def init_cache(self, batch_size: int, max_length: int) -> dict:
        """An empty decoding state for up to `max_length` positions (see `empty_cache`)."""
        return empty_cache(self.config, batch_size, max_length, self.dtype)

    def _run(self, input_ids, attention_mask, params, past_key_values, heads=()):
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids: expected [batch, tokens], got shape {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        slots = length if past_key_values is None else past_key_values["layers"]["0"]["keys"].shape[2]
        if attention_mask is None:
            key_mask = jnp.ones((batch, slots), bool)
        else:
            key_mask = jnp.asarray(attention_mask).astype(bool)
            if key_mask.shape[0] != batch or not length <= key_mask.shape[1] <= slots:
                raise ValueError(
                    f"attention_mask: expected [{batch}, n] with {length} <= n <= {slots} (the positions so far, up "
                    f"to the cache's {slots} slots), got {tuple(key_mask.shape)}")
            # Slots past the mask hold no key yet: causality hides them, whatever the mask says.
            key_mask = jnp.pad(key_mask, ((0, 0), (0, slots - key_mask.shape[1])), constant_values=True)
        return self.module.apply({"params": params or self.params}, input_ids, key_mask, past_key_values, heads=heads)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *, config: Optional[Needle3Config] = None, dtype=jnp.float32,
                        cache_dir=None, force_download: bool = False, local_files_only: bool = False, token=None,
                        revision: str = "main", subfolder: str = "", proxies=None, _commit_hash: Optional[str] = None,
                        trust_remote_code: Optional[bool] = None, _from_auto: bool = False,
                        _from_pipeline: Optional[str] = None, resume_download=None, adapter_kwargs: Optional[dict] = None):
        """Read a folder (or Hub repository) holding `config.json` and the PyTorch-layout
        `model.safetensors`; every tensor is checked against the weight table first (a missing,
        unexpected or mis-shaped one raises `Needle3WeightsError` naming it). `trust_remote_code`,
        `_from_auto`, `_from_pipeline` and `resume_download` are passed by the Auto classes and change nothing;
        a PEFT adapter folder (`adapter_kwargs`) is refused."""
        from safetensors.numpy import load_file
        from transformers.utils import cached_file

        if adapter_kwargs and "_adapter_model_path" in adapter_kwargs:
            raise ValueError(f"{adapter_kwargs['_adapter_model_path']} is a PEFT adapter: adapters load into the PyTorch "
                             "Needle3ForCausalLM (peft), not the Flax model")
        hub_kwargs = dict(cache_dir=cache_dir, force_download=force_download, local_files_only=local_files_only,
                          token=token, revision=revision, subfolder=subfolder, proxies=proxies, _commit_hash=_commit_hash)
        if config is None:
            config = Needle3Config.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        weights = cached_file(pretrained_model_name_or_path, "model.safetensors", **hub_kwargs)
        state = load_file(weights)
        if state and not any(name.startswith("model.") for name in state):
            state = {f"model.{name}": value for name, value in state.items()}  # saved by Needle3Model
        expected = {spec.hf_name: spec.hf_shape for spec in weight_specs(config)}
        for name in sorted(set(state) | set(expected)):
            if name not in expected:
                raise Needle3WeightsError(f"{weights}: tensor {name!r} is not a Needle 3 parameter of this config")
            if name not in state:
                raise Needle3WeightsError(f"{weights}: missing tensor {name!r}")
            if tuple(state[name].shape) != tuple(expected[name]):
                raise Needle3WeightsError(f"{weights}: tensor {name}: expected {expected[name]}, got {tuple(state[name].shape)}")
        params = _module_tree({name: jnp.asarray(np.asarray(value, np.float32)) for name, value in state.items()}, config)
        model = cls(config, dtype=dtype, _loaded_params=params)
        model._loaded_params = None
        return model

    def save_pretrained(self, save_directory, params=None):
        """`config.json` and a PyTorch-layout `model.safetensors` (the folder both twins read)."""
        from safetensors.numpy import save_file

        os.makedirs(save_directory, exist_ok=True)
        self.config.architectures = ["Needle3ForCausalLM"]
        self.config.save_pretrained(save_directory)
        state = {name: np.asarray(value) for name, value in _hf_state(params if params is not None else self.params).items()}
        save_file(state, os.path.join(save_directory, "model.safetensors"), metadata={"format": "pt"})


class FlaxNeedle3Model(FlaxNeedle3PreTrainedModel):
    """The Needle 3 backbone: `last_hidden_state` [B, T, D], the final-normed lane mean."""

    def __call__(self, input_ids, attention_mask=None, params=None):
        hidden, _, _, _ = self._run(input_ids, attention_mask, params, None)
        return FlaxBaseModelOutput(last_hidden_state=hidden)


class FlaxNeedle3ForCausalLM(FlaxNeedle3PreTrainedModel):
    """Flax Needle 3 with its tied output head, a decoding cache for `generate`, and the probe heads
    the checkpoint has (`embedding`, `confidence`, `router`)."""

    def __call__(self, input_ids, attention_mask=None, params=None, past_key_values: Optional[dict] = None):
        """input_ids [B, T] -> `logits` [B, T, out_vocab] float32. With `past_key_values` (from
        `init_cache` or an earlier call) the tokens continue the cache, `attention_mask` covers the
        positions so far ([B, past + T] or the cache's full length), and the output carries the
        updated cache."""
        _, logits, cache, _ = self._run(input_ids, attention_mask, params, past_key_values)
        return FlaxNeedle3CausalLMOutput(logits=logits, past_key_values=cache if past_key_values is not None else None)

    def prepare_inputs_for_generation(self, input_ids, max_length, attention_mask: Optional[jax.Array] = None):
        batch_size, prompt_length = input_ids.shape
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({prompt_length} tokens) plus new tokens reach {max_length} positions, more than "
                f"max_position_embeddings={self.config.max_position_embeddings}; shorten the prompt or max_new_tokens")
        extended_mask = jnp.ones((batch_size, max_length), jnp.int32)
        if attention_mask is not None:
            extended_mask = jax.lax.dynamic_update_slice(extended_mask, jnp.asarray(attention_mask, jnp.int32), (0, 0))
        return {"past_key_values": self.init_cache(batch_size, max_length), "attention_mask": extended_mask}

    def update_inputs_for_generation(self, model_outputs, model_kwargs):
        model_kwargs["past_key_values"] = model_outputs.past_key_values
        return model_kwargs

    def _head(self, name: str, input_ids, params):
        if not getattr(self.config, f"use_{name}_head"):
            raise ValueError(f"this model has no {name}_head (its config has use_{name}_head=False)")
        ids = jnp.asarray(input_ids, jnp.int32)
        keep = ids != self.config.pad_token_id  # padding (pad_token_id) is invisible, as in the reference
        return self.module.apply({"params": params or self.params}, ids, keep, heads=(name,))[3][name]

    def embedding(self, input_ids, params=None):
        """Unit-norm text embeddings [B, embedding_dim] (float32)."""
        return self._head("embedding", input_ids, params)

    def confidence(self, input_ids, params=None):
        """Confidence logits [B] (float32)."""
        return self._head("confidence", input_ids, params)

    def router(self, input_ids, params=None):
        """Router logits [B, 3] (float32)."""
        return self._head("router", input_ids, params)


__all__ = ["FlaxNeedle3ForCausalLM", "FlaxNeedle3Model", "FlaxNeedle3PreTrainedModel", "FlaxNeedle3CausalLMOutput"]
