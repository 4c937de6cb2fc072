"""Flax Needle 3: `FlaxNeedle3ForCausalLM`, the full-sequence forward (transformers 4.57 with jax/flax).

The parameter tree is the PyTorch model's, name for name (layers named "0", "1", ...), and every
tensor keeps the PyTorch layout (a projection's `weight` is [out, in], applied as `x @ weight.T`), so
one `model.safetensors` loads into both twins without a key map. Axis letters and the dtype policy are
those of `modeling_needle3.py`. This twin has no decoding cache yet: `generate` is the PyTorch model's.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.core.frozen_dict import freeze
from flax.traverse_util import unflatten_dict
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
from .configuration_needle3 import Needle3Config
from .modeling_needle3 import mlp_permutations
from .weight_names_needle3 import Needle3WeightsError, weight_specs


def zero_centred_rms_norm(x, weight, eps):
    xf = x.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return ((1 + weight) * x / rms).astype(x.dtype)


def rms_unit(x, eps):
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def linear(x, weight):
    """x [..., in] @ weight[out, in]ᵀ (the PyTorch layout)."""
    return x @ weight.T.astype(x.dtype)


def shift_right(x, offset):
    """x[:, t - offset] along axis 1, zero before the start."""
    if offset == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (offset, 0)
    return jnp.pad(x, pad)[:, : x.shape[1]]


def visible_at_offset(key_mask, offset, window=0):
    """[B, T]: position t - offset is visible to query t (key_mask [B, T]; window > 0 needs offset < window)."""
    if window and offset >= window:
        return jnp.zeros_like(key_mask)
    return shift_right(key_mask, offset)


def causal_taps(x, taps, tap_ok, dilation):
    """out[t] = sum_j taps[j] * x[t - dilation j] * ok_j[t]; x [B, T, C], taps [n, C], tap_ok[j] [B, T] or None."""
    out = None
    for j in range(taps.shape[0]):
        shifted = shift_right(x, dilation * j)
        if tap_ok[j] is not None:
            shifted = shifted * tap_ok[j][..., None].astype(shifted.dtype)
        term = taps[j] * shifted
        out = term if out is None else out + term
    return out


def engram_hash_indices(tokens, config: Needle3Config):
    """Rows [B, T, tables] of tokens [B, T] (0 before the start); see the PyTorch twin."""
    u = tokens.astype(jnp.uint32)
    rows = []
    for order_index, order in enumerate(config.engram_orders):
        for head in range(config.engram_num_heads):
            seed = (ENGRAM_HASH_SEED * (order_index * config.engram_seed_stride + head + 1)) & UINT32_MASK
            acc = jnp.full_like(u, jnp.uint32(seed))
            for j in range(order):
                acc = (acc ^ shift_right(u, j)) * jnp.uint32(ENGRAM_HASH_PRIME)
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


class FlaxNeedle3Layer(nn.Module):
    """One decoder layer (hyper-connection routing around the block), PyTorch parameter names."""

    config: Needle3Config
    layer_idx: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, lanes, key_mask, positions, engram_kv):
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
                key, value = engram_kv[site]
                alpha = jax.nn.sigmoid(jnp.sum(rms_unit(x, eps) * rms_unit(key, eps), -1) / math.sqrt(d))
                x = x + (alpha[..., None] * value.astype(jnp.float32)).astype(x.dtype)
        skip = x
        a = zero_centred_rms_norm(x, p["input_layernorm.weight"], eps)
        attended = self._attention(a, p, key_mask, positions)
        x = skip + jax.nn.sigmoid(p["attention_gate"]).astype(x.dtype) * zero_centred_rms_norm(
            attended, p["post_attention_layernorm.weight"], eps)
        x = x + self._mlp(zero_centred_rms_norm(x, p["pre_feedforward_layernorm.weight"], eps), p)
        y = x - u

        post = 2 * jax.nn.sigmoid(p[hc + "post_alpha"] * linear(unit, p[hc + "post_proj.weight"]) + p[hc + "post_bias"] + post_off)
        res = linear(unit, p[hc + "res_proj.weight"]).reshape(batch, length, count, count)
        mix = log_space_sinkhorn(p[hc + "res_alpha"] * res + p[hc + "res_bias"])
        out = jnp.einsum("btij,btjd->btid", mix, lanes_f32) + post[..., None] * y.astype(jnp.float32)[:, :, None, :]
        return out.astype(lanes.dtype)

    def _attention(self, a, p, key_mask, positions):
        cfg = self.config
        window = cfg.layer_window(self.layer_idx)
        batch, length, _ = a.shape
        heads, kv_heads, hd, vd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.value_head_dim
        q, k, v = (linear(a, p[f"self_attn.{n}_proj.weight"]) for n in "qkv")
        if cfg.qkv_conv_taps:
            tap_ok = [None] + [visible_at_offset(key_mask, j, window) for j in range(1, cfg.qkv_conv_taps)]
            q, k, v = (causal_taps(x, p[f"self_attn.{n}_conv_taps"], tap_ok, 1) for x, n in zip((q, k, v), "qkv"))
        q = zero_centred_rms_norm(q.reshape(batch, length, heads, hd).transpose(0, 2, 1, 3), p["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = zero_centred_rms_norm(k.reshape(batch, length, kv_heads, hd).transpose(0, 2, 1, 3), p["self_attn.k_norm.weight"], cfg.rms_norm_eps)
        v = v.reshape(batch, length, kv_heads, vd).transpose(0, 2, 1, 3)
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inverse_frequencies(hd, cfg.rope_theta))
        q, k = apply_rotary(q, jnp.cos(angles), jnp.sin(angles)), apply_rotary(k, jnp.cos(angles), jnp.sin(angles))
        allowed = key_mask[:, None, :] & (positions[None, None, :] <= positions[None, :, None])  # [B, T, S]
        if window:
            allowed = allowed & (positions[None, :, None] - positions[None, None, :] < window)
        groups = heads // kv_heads
        qg = q.reshape(batch, kv_heads, groups, length, hd).astype(jnp.float32)
        scores = jnp.einsum("bkgth,bksh->bkgts", qg, k.astype(jnp.float32)) / math.sqrt(hd)
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1) * jnp.any(allowed, -1)[:, None, None, :, None]
        out = jnp.einsum("bkgts,bksu->btkgu", weights, v.astype(jnp.float32)).astype(a.dtype)
        out = out.reshape(batch, length, heads * vd) * jax.nn.sigmoid(linear(a, p["self_attn.gate_proj.weight"]))
        return linear(out, p["self_attn.o_proj.weight"])

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
    """Token ids -> float32 logits [B, T, out_vocab] (the tied head), PyTorch parameter names."""

    config: Needle3Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids, attention_mask=None):
        cfg = self.config
        batch, length = input_ids.shape
        key_mask = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = jnp.arange(length)
        embed = self.param("model.embed_tokens.weight", _normal, (cfg.vocab_size, cfg.hidden_size))
        engram_kv = []
        if cfg.engram_layers:
            rows = engram_hash_indices(input_ids, cfg)  # [B, T, tables]
            row_ok = jnp.stack([visible_at_offset(key_mask, order - 1) for order in cfg.engram_orders
                                for _ in range(cfg.engram_num_heads)], axis=-1)
            tap_ok = [visible_at_offset(key_mask, j * cfg.engram_conv_dilation) for j in range(cfg.engram_conv_taps)]
            for site in range(len(cfg.engram_layers)):
                prefix = f"model.engrams.{site}."
                shapes = {s.hf_name: s.hf_shape for s in weight_specs(cfg) if s.hf_name.startswith(prefix)}
                p = {name[len(prefix):]: self.param(name, _normal, shape) for name, shape in shapes.items()}
                fetched = p["tables"][jnp.arange(cfg.engram_num_tables), rows] * row_ok[..., None]
                e = fetched.reshape(batch, length, cfg.engram_dim).astype(self.dtype)
                value = causal_taps(linear(e, p["value_proj.weight"]), p["conv_taps"], tap_ok, cfg.engram_conv_dilation)
                engram_kv.append((linear(e, p["key_proj.weight"]), value))
        x0 = (embed[input_ids] * math.sqrt(cfg.hidden_size)).astype(self.dtype)
        lanes = jnp.broadcast_to(x0[:, :, None, :], (batch, length, cfg.hyper_connection_lanes, cfg.hidden_size))
        for i in range(cfg.num_hidden_layers):
            lanes = FlaxNeedle3Layer(cfg, i, self.dtype, name=f"layer_{i}")(lanes, key_mask, positions, engram_kv)
        norm = self.param("model.norm.weight", nn.initializers.zeros, (cfg.hidden_size,))
        hidden = zero_centred_rms_norm(jnp.mean(lanes, axis=2), norm, cfg.rms_norm_eps)
        return hidden.astype(jnp.float32) @ embed[: cfg.output_vocab_size].astype(jnp.float32).T


def _module_tree(state: dict, config: Needle3Config) -> dict:
    """HF state dict -> this module's parameter tree (layer tensors under `layer_{i}` with their suffix)."""
    tree: dict = {}
    for name, value in state.items():
        if name.startswith("model.layers."):
            index, suffix = name[len("model.layers."):].split(".", 1)
            tree.setdefault(f"layer_{index}", {})[suffix] = value
        else:
            tree[name] = value
    return tree


class FlaxNeedle3ForCausalLM(FlaxPreTrainedModel):
    """Flax Needle 3 (full-sequence forward). `from_pretrained` reads a folder's PyTorch-layout
    `model.safetensors` strictly against the weight table (the probe heads are not part of this twin)."""

    config_class = Needle3Config
    base_model_prefix = "model"
    module_class = FlaxNeedle3Module

    def __init__(self, config: Needle3Config, input_shape=(1, 1), seed: int = 0, dtype=jnp.float32, _do_init: bool = True,
                 *, _loaded_params: Optional[dict] = None):
        self._loaded_params = _loaded_params
        super().__init__(config, self.module_class(config=config, dtype=dtype), input_shape=input_shape, seed=seed,
                         dtype=dtype, _do_init=_do_init)

    def init_weights(self, rng, input_shape, params=None):
        if self._loaded_params is not None:
            return freeze(self._loaded_params)
        return self.module.init(rng, jnp.zeros(input_shape, jnp.int32))["params"]

    def __call__(self, input_ids, attention_mask=None, params=None):
        """Float32 logits [B, T, out_vocab]."""
        return self.module.apply({"params": params or self.params}, jnp.asarray(input_ids), attention_mask)

    @classmethod
    def from_pretrained(cls, folder, *, dtype=jnp.float32):
        from safetensors.numpy import load_file

        config = Needle3Config.from_pretrained(folder)
        backbone = [spec for spec in weight_specs(config) if "_head." not in spec.hf_name]
        state = load_file(os.path.join(folder, "model.safetensors"))
        state = {name: value for name, value in state.items() if "_head." not in name}
        expected = {spec.hf_name: spec.hf_shape for spec in backbone}
        for name in sorted(set(state) | set(expected)):
            if name not in expected:
                raise Needle3WeightsError(f"{folder}: tensor {name!r} is not a Needle 3 parameter of this config")
            if name not in state:
                raise Needle3WeightsError(f"{folder}: missing tensor {name!r}")
            if tuple(state[name].shape) != tuple(expected[name]):
                raise Needle3WeightsError(f"{folder}: tensor {name}: expected {expected[name]}, got {tuple(state[name].shape)}")
        params = _module_tree({name: jnp.asarray(np.asarray(value, np.float32)) for name, value in state.items()}, config)
        return cls(config, dtype=dtype, _loaded_params=params)
