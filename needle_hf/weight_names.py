"""The one table that maps every native Needle 2 parameter to its Hugging Face name.

Native checkpoints (the reference's Flax tree) keep the 27 decoder layers stacked on a leading axis
(`stack/layers/block/...`, `stack/mhc_*`) and store dense kernels as `(in, out)`. The HF layout has
one tensor per layer, named after the module tree as in transformers' Llama/Gemma
(`model.layers.{i}.self_attn.q_proj.weight`), with PyTorch's `(out, in)` weight layout. Both the
PyTorch and the Flax model build exactly these names (Flax reads `weight` 2-D tensors as transposed
`kernel`s), and every converter goes through `native_to_hf` / `hf_to_native` below.

Table (per layer i; engram site s; `T` = transposed):

| native path                                   | HF name                                              |
|-----------------------------------------------|------------------------------------------------------|
| embedding/embedding                           | model.embed_tokens.weight                            |
| stack/layers/block/ZCRMSNorm_0/scale [i]      | model.layers.{i}.input_layernorm.weight              |
| stack/layers/block/self_attn/q_proj/kernel [i]| model.layers.{i}.self_attn.q_proj.weight (T)         |
|   .../k_proj, v_proj, gate_proj /kernel [i]   | model.layers.{i}.self_attn.{k,v,gate}_proj.weight (T)|
|   .../out_proj/kernel [i]                     | model.layers.{i}.self_attn.o_proj.weight (T)         |
|   .../q_norm/scale, k_norm/scale [i]          | model.layers.{i}.self_attn.{q,k}_norm.weight         |
| stack/layers/block/post_attn_norm/scale [i]   | model.layers.{i}.post_attention_layernorm.weight     |
| stack/layers/block/attn_gate [i]              | model.layers.{i}.attention_gate                      |
| stack/layers/block/pre_hada_norm/scale [i]    | model.layers.{i}.pre_feedforward_layernorm.weight    |
| stack/layers/block/hadamard_mlp/d1, d2, d3 [i]| model.layers.{i}.mlp.diag_in, diag_hidden, diag_out  |
| stack/mhc_phi_{pre,post,res} [i]              | model.layers.{i}.hyper_connection.{pre,post,res}_proj.weight (T) |
| stack/mhc_b_{pre,post,res} [i]                | model.layers.{i}.hyper_connection.{pre,post,res}_bias |
| stack/mhc_a_{pre,post,res} [i]                | model.layers.{i}.hyper_connection.{pre,post,res}_alpha |
| stack/final_norm/scale                        | model.norm.weight                                    |
| engrams_{s}/embedding                         | model.engrams.{s}.tables                             |
| engrams_{s}/key_proj/kernel, value_proj/kernel| model.engrams.{s}.{key,value}_proj.weight (T)        |
| engrams_{s}/taps                              | model.engrams.{s}.conv_taps                          |
| mtp_combine/kernel                            | mtp.combine_proj.weight (T)                          |
| mtp_emb_norm/scale, mtp_final_norm/scale      | mtp.embed_norm.weight, mtp.norm.weight               |
| mtp_block/<block path>                        | mtp.block.<block name> (as a decoder layer)          |
| contrastive_head/probes, proj/kernel, log_temp| contrastive_head.probes, proj.weight (T), log_temperature |
| confidence_head/probes, proj/kernel, proj/bias| confidence_head.probes, proj.weight (T), proj.bias   |

Norm weights keep the reference's zero-centred convention: the effective gain is `1 + weight`.
The output head is tied to `model.embed_tokens.weight` and has no tensor of its own.

This module needs only numpy, so converters run without jax or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np


@dataclass(frozen=True)
class WeightSpec:
    """One parameter: its HF name, its native path and its HF-layout shape for a given config."""

    hf_name: str
    native_path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    transpose: bool = False  # native (in, out) kernel <-> HF (out, in) weight
    layer: int | None = None  # index on the native leading layer axis, when the native leaf is stacked
    group: str = "backbone"  # backbone | mtp | contrastive | confidence

    @property
    def native_shape(self) -> tuple[int, ...]:
        """Shape of this parameter's slice of the native leaf (without the layer axis)."""
        return tuple(reversed(self.hf_shape)) if self.transpose else self.hf_shape


def _block_entries(config) -> list[tuple[str, tuple[str, ...], tuple[int, ...], bool]]:
    """(HF suffix, native suffix, HF shape, transpose) of one decoder block."""
    d, a, kv, hd, n = config.hidden_size, config.attention_dim, config.kv_dim, config.head_dim, config.hadamard_size
    return [
        ("input_layernorm.weight", ("ZCRMSNorm_0", "scale"), (d,), False),
        ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), (a, d), True),
        ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), (kv, d), True),
        ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), (kv, d), True),
        ("self_attn.q_norm.weight", ("self_attn", "q_norm", "scale"), (hd,), False),
        ("self_attn.k_norm.weight", ("self_attn", "k_norm", "scale"), (hd,), False),
        ("self_attn.gate_proj.weight", ("self_attn", "gate_proj", "kernel"), (a, d), True),
        ("self_attn.o_proj.weight", ("self_attn", "out_proj", "kernel"), (d, a), True),
        ("post_attention_layernorm.weight", ("post_attn_norm", "scale"), (d,), False),
        ("attention_gate", ("attn_gate",), (), False),
        ("pre_feedforward_layernorm.weight", ("pre_hada_norm", "scale"), (d,), False),
        ("mlp.diag_in", ("hadamard_mlp", "d1"), (n,), False),
        ("mlp.diag_hidden", ("hadamard_mlp", "d2"), (n,), False),
        ("mlp.diag_out", ("hadamard_mlp", "d3"), (n,), False),
    ]


def _hyper_connection_entries(config) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """(HF suffix, native `stack/` leaf, HF shape, transpose) of one layer's hyper-connection."""
    lanes, width = config.hyper_connection_lanes, config.hyper_connection_lanes * config.hidden_size
    return [
        ("hyper_connection.pre_proj.weight", "mhc_phi_pre", (lanes, width), True),
        ("hyper_connection.post_proj.weight", "mhc_phi_post", (lanes, width), True),
        ("hyper_connection.res_proj.weight", "mhc_phi_res", (lanes * lanes, width), True),
        ("hyper_connection.pre_bias", "mhc_b_pre", (lanes,), False),
        ("hyper_connection.post_bias", "mhc_b_post", (lanes,), False),
        ("hyper_connection.res_bias", "mhc_b_res", (lanes, lanes), False),
        ("hyper_connection.pre_alpha", "mhc_a_pre", (), False),
        ("hyper_connection.post_alpha", "mhc_a_post", (), False),
        ("hyper_connection.res_alpha", "mhc_a_res", (), False),
    ]


def weight_specs(config) -> list[WeightSpec]:
    """Every parameter of a model with this config, in a stable, layer-major order."""
    d, e = config.hidden_size, config.engram_dim
    specs = [WeightSpec("model.embed_tokens.weight", ("embedding", "embedding"), (config.vocab_size, d))]
    block = _block_entries(config)
    hyper = _hyper_connection_entries(config)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for suffix, native, shape, transpose in block:
            specs.append(WeightSpec(prefix + suffix, ("stack", "layers", "block", *native), shape, transpose, layer=i))
        for suffix, native, shape, transpose in hyper:
            specs.append(WeightSpec(prefix + suffix, ("stack", native), shape, transpose, layer=i))
    specs.append(WeightSpec("model.norm.weight", ("stack", "final_norm", "scale"), (d,)))
    for s in range(len(config.engram_layers)):
        prefix, native = f"model.engrams.{s}.", f"engrams_{s}"
        specs += [
            WeightSpec(prefix + "tables", (native, "embedding"), (config.engram_num_tables, config.engram_slots, config.engram_sub_dim)),
            WeightSpec(prefix + "key_proj.weight", (native, "key_proj", "kernel"), (d, e), transpose=True),
            WeightSpec(prefix + "value_proj.weight", (native, "value_proj", "kernel"), (d, e), transpose=True),
            WeightSpec(prefix + "conv_taps", (native, "taps"), (config.engram_conv_taps, d)),
        ]
    if config.use_mtp_head:
        specs += [
            WeightSpec("mtp.combine_proj.weight", ("mtp_combine", "kernel"), (d, 2 * d), transpose=True, group="mtp"),
            WeightSpec("mtp.embed_norm.weight", ("mtp_emb_norm", "scale"), (d,), group="mtp"),
            WeightSpec("mtp.norm.weight", ("mtp_final_norm", "scale"), (d,), group="mtp"),
        ]
        for suffix, native, shape, transpose in block:
            specs.append(WeightSpec("mtp.block." + suffix, ("mtp_block", *native), shape, transpose, group="mtp"))
    if config.use_contrastive_head:
        probes = CONTRASTIVE_PROBES
        specs += [
            WeightSpec("contrastive_head.probes", ("contrastive_head", "probes"), (probes, d), group="contrastive"),
            WeightSpec("contrastive_head.proj.weight", ("contrastive_head", "proj", "kernel"), (config.contrastive_dim, probes * d), transpose=True, group="contrastive"),
            WeightSpec("contrastive_head.log_temperature", ("contrastive_head", "log_temp"), (), group="contrastive"),
        ]
    if config.use_confidence_head:
        probes = CONFIDENCE_PROBES
        specs += [
            WeightSpec("confidence_head.probes", ("confidence_head", "probes"), (probes, d), group="confidence"),
            WeightSpec("confidence_head.proj.weight", ("confidence_head", "proj", "kernel"), (1, probes * d), transpose=True, group="confidence"),
            WeightSpec("confidence_head.proj.bias", ("confidence_head", "proj", "bias"), (1,), group="confidence"),
        ]
    return specs


# Probe counts of the pooling heads (fixed by the architecture).
CONTRASTIVE_PROBES = 4
CONFIDENCE_PROBES = 8

# Top-level native subtrees whose presence tells which optional heads a checkpoint carries.
OPTIONAL_NATIVE_GROUPS = {
    "use_mtp_head": ("mtp_combine", "mtp_emb_norm", "mtp_final_norm", "mtp_block"),
    "use_contrastive_head": ("contrastive_head",),
    "use_confidence_head": ("confidence_head",),
}
OPTIONAL_HF_PREFIXES = {
    "use_mtp_head": "mtp.",
    "use_contrastive_head": "contrastive_head.",
    "use_confidence_head": "confidence_head.",
}


def hf_weight_shapes(config) -> dict[str, tuple[int, ...]]:
    return {spec.hf_name: spec.hf_shape for spec in weight_specs(config)}


class WeightMappingError(ValueError):
    """A tensor is missing, unexpected or of the wrong shape."""


def optional_heads_in_native(params: dict) -> dict[str, bool]:
    """Config flags (`use_mtp_head`, ...) telling which optional heads a native tree carries."""
    return {flag: any(key in params for key in keys) for flag, keys in OPTIONAL_NATIVE_GROUPS.items()}


def optional_heads_in_hf(names) -> dict[str, bool]:
    """Config flags telling which optional heads a set of HF tensor names carries."""
    names = list(names)
    return {flag: any(n.startswith(prefix) for n in names) for flag, prefix in OPTIONAL_HF_PREFIXES.items()}


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    for key, value in tree.items():
        path = prefix + (str(key),)
        if isinstance(value, dict):
            yield from _flatten(value, path)
        else:
            yield path, value


def _check_shape(where: str, expected: tuple[int, ...], found: tuple[int, ...]):
    if tuple(expected) != tuple(found):
        raise WeightMappingError(f"tensor {where}: expected shape {tuple(expected)}, got {tuple(found)}")


def native_to_hf(params: dict, config, *, to_array: Callable = np.asarray, copy: bool = True) -> dict[str, np.ndarray]:
    """Map a native parameter tree to HF-named tensors, strictly.

    Every native leaf must be claimed by the table and every table entry must be present, with the
    shape the config implies; otherwise `WeightMappingError` names the first offending key.
    With `copy=False` the tensors are views of the native arrays (per-layer slices, transposes), for
    a writer that streams them out one at a time without a second copy of the model.
    """
    leaves = {path: value for path, value in _flatten(params)}
    specs = weight_specs(config)
    claimed: set[tuple[str, ...]] = set()
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        where = "/".join(spec.native_path)
        if spec.native_path not in leaves:
            raise WeightMappingError(f"native checkpoint is missing {where} (needed for {spec.hf_name})")
        leaf = to_array(leaves[spec.native_path])
        claimed.add(spec.native_path)
        if spec.layer is not None:
            _check_shape(where, (config.num_hidden_layers, *spec.native_shape), leaf.shape)
            leaf = leaf[spec.layer]
        else:
            _check_shape(where, spec.native_shape, leaf.shape)
        leaf = leaf.T if spec.transpose else leaf
        out[spec.hf_name] = np.array(leaf, order="C") if copy else leaf
    unknown = sorted("/".join(p) for p in leaves if p not in claimed)
    if unknown:
        raise WeightMappingError(
            f"native checkpoint has {len(unknown)} unknown key(s) for this config, first: {unknown[0]}"
            + (f" (and {unknown[1:4]})" if len(unknown) > 1 else "")
        )
    return out


def hf_to_native(tensors: dict, config) -> dict:
    """Map HF-named tensors back to a native parameter tree (layers re-stacked), strictly."""
    specs = weight_specs(config)
    expected = {spec.hf_name for spec in specs}
    unknown = sorted(set(tensors) - expected)
    if unknown:
        raise WeightMappingError(f"unknown tensor {unknown[0]} for this config ({len(unknown)} unknown in all)")
    stacked: dict[tuple[str, ...], list] = {}
    tree: dict = {}

    def put(path, value):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value

    for spec in specs:
        if spec.hf_name not in tensors:
            raise WeightMappingError(f"missing tensor {spec.hf_name}")
        value = np.asarray(tensors[spec.hf_name])
        _check_shape(spec.hf_name, spec.hf_shape, value.shape)
        value = np.array(value.T if spec.transpose else value, order="C")
        if spec.layer is None:
            put(spec.native_path, value)
        else:
            stacked.setdefault(spec.native_path, [None] * config.num_hidden_layers)[spec.layer] = value
    for path, per_layer in stacked.items():
        put(path, np.stack(per_layer))
    return tree
