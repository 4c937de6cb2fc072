"""The one table that maps every native Needle 3 parameter to its Hugging Face name.

A Needle 3 checkpoint (cactus-needle 3.x `.safetensors`) holds the reference's Flax tree with paths
joined by `/`; the decoder layers are stacked on a leading axis (`stack/layers/block/...`,
`stack/mhc_*`) and dense kernels are `(in, out)`. The HF layout has one tensor per layer, named after
the PyTorch module tree, with `(out, in)` weights.

Table (per layer i; engram site s; `T` = transposed; `X` in {q, k, v}):

| native path                                        | HF name                                            |
|----------------------------------------------------|----------------------------------------------------|
| embedding/embedding                                | model.embed_tokens.weight                          |
| stack/layers/block/ZCRMSNorm_0/scale [i]           | model.layers.{i}.input_layernorm.weight            |
| stack/layers/block/self_attn/X_proj/kernel [i]     | model.layers.{i}.self_attn.X_proj.weight (T)       |
| stack/layers/block/self_attn/gate_proj/kernel [i]  | model.layers.{i}.self_attn.gate_proj.weight (T)    |
| stack/layers/block/self_attn/out_proj/kernel [i]   | model.layers.{i}.self_attn.o_proj.weight (T)       |
| stack/layers/block/self_attn/{q,k}_norm/scale [i]  | model.layers.{i}.self_attn.{q,k}_norm.weight       |
| stack/layers/block/self_attn/X_taps [i]            | model.layers.{i}.self_attn.X_conv_taps             |
| stack/layers/block/post_attn_norm/scale [i]        | model.layers.{i}.post_attention_layernorm.weight   |
| stack/layers/block/attn_gate [i]                   | model.layers.{i}.attention_gate                    |
| stack/layers/block/pre_hada_norm/scale [i]         | model.layers.{i}.pre_feedforward_layernorm.weight  |
| stack/layers/block/hadamard_mlp/w{s}a, w{s}b [i]   | model.layers.{i}.mlp.stage{s}_left, stage{s}_right |
| stack/layers/block/hadamard_mlp/d1, d2, b2, d3, d4 | model.layers.{i}.mlp.diag_in, diag_hidden, bias_hidden, diag_mid, diag_out |
| stack/layers/block/hadamard_mlp/cond_v, cond_u [i] | model.layers.{i}.mlp.gain_in_proj.weight, gain_out_proj.weight (T) |
| stack/mhc_phi_{pre,post,res} [i]                   | model.layers.{i}.hyper_connection.{pre,post,res}_proj.weight (T) |
| stack/mhc_b_{pre,post,res}, mhc_a_{...} [i]        | model.layers.{i}.hyper_connection.{pre,post,res}_{bias,alpha} |
| stack/final_norm/scale                             | model.norm.weight                                  |
| engrams_{s}/embedding, key_proj, value_proj, taps  | model.engrams.{s}.tables, key_proj.weight (T), value_proj.weight (T), conv_taps |
| {embedding,confidence,router}_head/probes, gain, query, row_bias | {name}_head.probes, gain, query, row_bias |
| {name}_head/proj/kernel, proj/bias                 | {name}_head.proj.weight (T), proj.bias             |
| embedding_head/log_temp, bias                      | embedding_head.log_temperature, bias               |

Norm weights keep the zero-centred convention (gain `1 + weight`). The output head is the embedding
(no tensor of its own). This module needs only numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..needle.weight_names import _hyper_connection_entries  # the same hyper-connection leaves as Needle 2

HEAD_NAMES = ("embedding", "confidence", "router")
HEAD_OUTPUTS = {"confidence": 1, "router": 3}


class Needle3WeightsError(ValueError):
    """A checkpoint's tensors do not match the table: names the tensor, expected and found."""


@dataclass(frozen=True)
class WeightSpec:
    hf_name: str
    native_path: str
    hf_shape: tuple
    transpose: bool = False
    layer: int | None = None  # index on the native leading layer axis

    @property
    def native_shape(self) -> tuple:
        return tuple(reversed(self.hf_shape)) if self.transpose else self.hf_shape


def _block_entries(config) -> list:
    """(HF suffix, native suffix under stack/layers/block/, HF shape, transpose) of one decoder layer."""
    d, w, (a, b), r = config.hidden_size, config.mlp_size, config.mlp_factor_sizes, config.mlp_gain_rank
    entries = [
        ("input_layernorm.weight", "ZCRMSNorm_0/scale", (d,), False),
        ("self_attn.q_proj.weight", "self_attn/q_proj/kernel", (config.query_dim, d), True),
        ("self_attn.k_proj.weight", "self_attn/k_proj/kernel", (config.key_dim, d), True),
        ("self_attn.v_proj.weight", "self_attn/v_proj/kernel", (config.value_dim, d), True),
        ("self_attn.gate_proj.weight", "self_attn/gate_proj/kernel", (config.output_dim, d), True),
        ("self_attn.o_proj.weight", "self_attn/out_proj/kernel", (d, config.output_dim), True),
        ("self_attn.q_norm.weight", "self_attn/q_norm/scale", (config.head_dim,), False),
        ("self_attn.k_norm.weight", "self_attn/k_norm/scale", (config.head_dim,), False),
    ]
    if config.qkv_conv_taps:
        taps = config.qkv_conv_taps
        entries += [
            ("self_attn.q_conv_taps", "self_attn/q_taps", (taps, config.query_dim), False),
            ("self_attn.k_conv_taps", "self_attn/k_taps", (taps, config.key_dim), False),
            ("self_attn.v_conv_taps", "self_attn/v_taps", (taps, config.value_dim), False),
        ]
    entries += [
        ("post_attention_layernorm.weight", "post_attn_norm/scale", (d,), False),
        ("attention_gate", "attn_gate", (), False),
        ("pre_feedforward_layernorm.weight", "pre_hada_norm/scale", (d,), False),
    ]
    for stage in (1, 2, 3):
        entries += [
            (f"mlp.stage{stage}_left", f"hadamard_mlp/w{stage}a", (a, a), False),
            (f"mlp.stage{stage}_right", f"hadamard_mlp/w{stage}b", (b, b), False),
        ]
    entries += [
        ("mlp.diag_in", "hadamard_mlp/d1", (w,), False),
        ("mlp.diag_hidden", "hadamard_mlp/d2", (w,), False),
        ("mlp.bias_hidden", "hadamard_mlp/b2", (w,), False),
        ("mlp.diag_mid", "hadamard_mlp/d3", (w,), False),
        ("mlp.diag_out", "hadamard_mlp/d4", (w,), False),
        ("mlp.gain_in_proj.weight", "hadamard_mlp/cond_v", (r, d), True),
        ("mlp.gain_out_proj.weight", "hadamard_mlp/cond_u", (w, r), True),
    ]
    return entries


def _head_entries(config, name: str) -> list:
    rows, d = config.probe_rows, config.hidden_size
    probes, queries = getattr(config, f"{name}_probes"), getattr(config, f"{name}_queries")
    out = config.embedding_dim if name == "embedding" else HEAD_OUTPUTS[name]
    key = f"{name}_head"
    entries = [
        WeightSpec(f"{key}.probes", f"{key}/probes", (rows, probes, d)),
        WeightSpec(f"{key}.gain", f"{key}/gain", (rows, probes)),
        WeightSpec(f"{key}.query", f"{key}/query", (queries, d)),
        WeightSpec(f"{key}.row_bias", f"{key}/row_bias", (queries, rows, probes)),
        WeightSpec(f"{key}.proj.weight", f"{key}/proj/kernel", (out, queries * d), transpose=True),
    ]
    if name == "embedding":
        entries += [WeightSpec(f"{key}.log_temperature", f"{key}/log_temp", ()), WeightSpec(f"{key}.bias", f"{key}/bias", ())]
    else:
        entries.append(WeightSpec(f"{key}.proj.bias", f"{key}/proj/bias", (out,)))
    return entries


def weight_specs(config) -> list:
    """Every parameter of a `Needle3ForCausalLM` with this config, layer-major."""
    d = config.hidden_size
    specs = [WeightSpec("model.embed_tokens.weight", "embedding/embedding", (config.vocab_size, d))]
    for i in range(config.num_hidden_layers):
        for suffix, native, shape, transpose in _block_entries(config):
            specs.append(WeightSpec(f"model.layers.{i}.{suffix}", f"stack/layers/block/{native}", shape, transpose, i))
        for suffix, native, shape, transpose in _hyper_connection_entries(config):
            specs.append(WeightSpec(f"model.layers.{i}.{suffix}", f"stack/{native}", shape, transpose, i))
    specs.append(WeightSpec("model.norm.weight", "stack/final_norm/scale", (d,)))
    tables, slots, sub, e = config.engram_num_tables, config.engram_slots, config.engram_sub_dim, config.engram_dim
    for s in range(len(config.engram_layers)):
        specs += [
            WeightSpec(f"model.engrams.{s}.tables", f"engrams_{s}/embedding", (tables, slots, sub)),
            WeightSpec(f"model.engrams.{s}.key_proj.weight", f"engrams_{s}/key_proj/kernel", (d, e), transpose=True),
            WeightSpec(f"model.engrams.{s}.value_proj.weight", f"engrams_{s}/value_proj/kernel", (d, e), transpose=True),
            WeightSpec(f"model.engrams.{s}.conv_taps", f"engrams_{s}/taps", (config.engram_conv_taps, d)),
        ]
    for name in HEAD_NAMES:
        if getattr(config, f"use_{name}_head"):
            specs += _head_entries(config, name)
    return specs


def _contiguous(value: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape (`np.ascontiguousarray` would make a scalar 1-d)."""
    return np.ascontiguousarray(value) if value.ndim else value.copy()


def heads_in_native(flat: Mapping[str, np.ndarray]) -> dict:
    """`use_<head>_head` flags for the heads whose tensors a native flat checkpoint holds."""
    return {f"use_{name}_head": any(key.startswith(f"{name}_head/") for key in flat) for name in HEAD_NAMES}


def native_to_hf(flat: Mapping[str, np.ndarray], config, *, source: str = "checkpoint") -> dict:
    """Native flat tensors {'a/b/c': array} -> HF state dict (numpy), strictly: every tensor the table
    expects must be present with its exact shape, and no other tensor may be there."""
    specs = weight_specs(config)
    expected_native = {spec.native_path for spec in specs}
    unknown = sorted(set(flat) - expected_native)
    if unknown:
        raise Needle3WeightsError(f"{source}: tensor {unknown[0]!r} is not a Needle 3 parameter of this config"
                                  + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    missing = sorted(expected_native - set(flat))
    if missing:
        raise Needle3WeightsError(f"{source}: missing tensor {missing[0]!r}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    out = {}
    for spec in specs:
        value = np.asarray(flat[spec.native_path])
        expected = spec.native_shape if spec.layer is None else (config.num_hidden_layers, *spec.native_shape)
        if tuple(value.shape) != tuple(expected):
            raise Needle3WeightsError(
                f"{source}: tensor {spec.native_path}: expected {tuple(expected)}, got {tuple(value.shape)}")
        if spec.layer is not None:
            value = value[spec.layer]
        if spec.transpose:
            value = value.T
        out[spec.hf_name] = _contiguous(value)
    return out


def hf_to_native(state: Mapping[str, np.ndarray], config) -> dict:
    """HF state dict (numpy) -> native flat tensors, stacking the layers again (strict as above)."""
    specs = weight_specs(config)
    missing = sorted({spec.hf_name for spec in specs} - set(state))
    if missing:
        raise Needle3WeightsError(f"missing tensor {missing[0]!r}")
    unknown = sorted(set(state) - {spec.hf_name for spec in specs})
    if unknown:
        raise Needle3WeightsError(f"tensor {unknown[0]!r} is not a Needle 3 parameter of this config")
    per_path: dict = {}
    for spec in specs:
        value = np.asarray(state[spec.hf_name])
        if tuple(value.shape) != tuple(spec.hf_shape):
            raise Needle3WeightsError(f"tensor {spec.hf_name}: expected {tuple(spec.hf_shape)}, got {tuple(value.shape)}")
        value = value.T if spec.transpose else value
        if spec.layer is None:
            per_path[spec.native_path] = value
        else:
            per_path.setdefault(spec.native_path, [None] * config.num_hidden_layers)[spec.layer] = value
    return {path: _contiguous(np.stack(v) if isinstance(v, list) else v) for path, v in per_path.items()}
