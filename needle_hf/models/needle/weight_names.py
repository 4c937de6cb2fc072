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
The output head is tied to `model.embed_tokens.weight` and has no tensor of its own: the PyTorch
model's `lm_head.weight` is an alias of it (`numerics.TIED_WEIGHTS`), absent from saved files. The
checkers below neither require the alias nor reject it when it has the embedding's shape (a file
written by a tool that stores tied tensors twice); `hf_to_native` checks that it equals the embedding.

This module also holds the one strict checker of tensor names and shapes (`check_weights`) and
its exception (`NeedleWeightsError`), used by both models, the converters and the Hub tools.

This module needs only numpy, so converters run without jax or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from .numerics import CONFIDENCE_PROBES, CONTRASTIVE_PROBES, TIED_WEIGHTS, bits_for, is_cq_weight, weight_bits_map
from .specification_needle import NeedleWeightsError  # the one exception of strict loading


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

# Name prefixes of the optional heads' tensors: the bare backbone leaves them unread.
HEAD_PREFIXES = tuple(OPTIONAL_HF_PREFIXES.values())


def cq_weight_bits(config) -> dict[str, int | float]:
    """HF name -> CQ width of every CQ-stored weight (`is_cq_weight`) of a model with this config.

    The widths of the config's `weight_bits` map (else `DEFAULT_WEIGHT_BITS` everywhere), matched on
    each weight's native path as the reference's QAT matches them, so a layer's weights share their
    stacked leaf's width; `.cact` records ("layer03.q_proj") canonicalise to the same names.
    """
    prefixes, default = weight_bits_map(config.weight_bits, engram_sites=len(config.engram_layers))
    return {
        spec.hf_name: bits_for("/".join(spec.native_path), prefixes, default)
        for spec in weight_specs(config)
        if is_cq_weight(spec.hf_name)
    }


def hf_weight_shapes(config, *, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter of a model with this config (those starting with `prefix`)."""
    return {spec.hf_name: spec.hf_shape for spec in weight_specs(config) if spec.hf_name.startswith(prefix)}


def native_weight_shapes(config) -> dict[str, tuple[int, ...]]:
    """Native path ("stack/layers/block/...") -> shape of every native leaf (stacked leaves with the layer axis)."""
    shapes = {}
    for spec in weight_specs(config):
        layers = () if spec.layer is None else (config.num_hidden_layers,)
        shapes["/".join(spec.native_path)] = (*layers, *spec.native_shape)
    return shapes



# Every name prefix (HF and native) that belongs to an optional head, for the hint of `check_weights`.
_HEAD_NAME_PREFIXES = HEAD_PREFIXES + tuple(
    key for keys in OPTIONAL_NATIVE_GROUPS.values() for key in keys
)


def check_weights(
    found: Mapping[str, Sequence[int]],
    expected: Mapping[str, Sequence[int]],
    *,
    where: str,
    ignore_unexpected_prefixes: Sequence[str] = (),
    described_as: Mapping[str, str] | None = None,
) -> None:
    """Raise `NeedleWeightsError` unless `found` holds exactly the `expected` names with their shapes.

    The message names the first few missing, unexpected and mis-shaped tensors (each kind with its
    count), e.g. `model.safetensors: missing tensor model.norm.weight (1 missing in all); tensor
    model.layers.0.self_attn.q_proj.weight: expected shape (64, 64), got (64, 32)`, and says how the
    optional heads must agree with the config when a head's tensor is among them.

    Args:
        found: name -> shape of what the checkpoint (file, folder or tree) holds.
        expected: name -> shape the config implies (`hf_weight_shapes`, `native_weight_shapes`).
        where: the file, folder or tree checked, first in the message.
        ignore_unexpected_prefixes: names starting with these may be present without being expected
            (the bare backbone reading a causal-LM checkpoint ignores the heads).
        described_as: extra words after a name in the message (native path -> its HF name).
    """
    described_as = described_as or {}

    def name(key: str) -> str:
        return f"{key} ({described_as[key]})" if key in described_as else key

    def first(names: list[str], label: str, noun: str) -> str:
        shown = ", ".join(f"{label}{name(n)}" for n in names[:3])
        return f"{shown} ({len(names)} {noun} in all)"

    # Missing and mis-shaped tensors in the order of `expected` (the table's: embedding, layers, heads).
    missing = [n for n in expected if n not in found]
    unexpected = sorted(
        n for n in set(found) - set(expected) if not n.startswith(tuple(ignore_unexpected_prefixes))
    )
    wrong = [n for n in expected if n in found and tuple(found[n]) != tuple(expected[n])]
    problems = []
    if missing:
        problems.append(first(missing, "missing tensor ", "missing"))
    if unexpected:
        problems.append(first(unexpected, "unexpected tensor ", "unexpected"))
    if wrong:
        shapes = [f"tensor {name(n)}: expected shape {tuple(expected[n])}, got {tuple(found[n])}" for n in wrong[:3]]
        problems.append(", ".join(shapes) + f" ({len(wrong)} of the wrong shape in all)")
    if not problems:
        return
    hint = ""
    if any(n.startswith(_HEAD_NAME_PREFIXES) for n in missing + unexpected):
        hint = (
            ". The optional heads present must agree with use_mtp_head / use_contrastive_head / "
            "use_confidence_head in config.json (a checkpoint without them, such as a saved base model, "
            "loads into the causal LM with those set to False: `from_pretrained(path, use_mtp_head=False, ...)`)"
        )
    raise NeedleWeightsError(f"{where}: " + "; ".join(problems) + hint)


def without_tied_aliases(found: Mapping[str, Sequence[int]]) -> dict[str, Sequence[int]]:
    """`found` (name -> shape) less the tied names (`TIED_WEIGHTS`) that have their source's shape.

    Those name the embedding a second time; one of another shape stays, to be reported as unexpected.
    """
    aliases = {
        tied for tied, source in TIED_WEIGHTS.items()
        if tied in found and source in found and tuple(found[tied]) == tuple(found[source])
    }
    return {name: shape for name, shape in found.items() if name not in aliases}


def check_tied_values(tensors: Mapping[str, np.ndarray], *, where: str) -> None:
    """Raise `NeedleWeightsError` if a tied name present in `tensors` holds other values than its source."""
    for tied, source in TIED_WEIGHTS.items():
        if tied in tensors and source in tensors and not np.array_equal(tensors[tied], tensors[source]):
            raise NeedleWeightsError(
                f"{where}: tensor {tied} differs from {source}; Needle's output head is tied to the token embedding"
            )


def check_hf_weights(found: Mapping[str, Sequence[int]], config, *, where: str) -> None:
    """`check_weights` of HF-named shapes against the whole table for `config` (a tied alias allowed)."""
    found = without_tied_aliases(found)
    if config.num_hidden_layers > len(found):
        # Checked before the table is built: its size follows the config, not the file.
        raise NeedleWeightsError(
            f"{where}: config.json says {config.num_hidden_layers} layers, but the weights hold only {len(found)} tensors"
        )
    check_weights(found, hf_weight_shapes(config), where=where)


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


def native_to_hf(params: dict, config, *, to_array: Callable = np.asarray, copy: bool = True) -> dict[str, np.ndarray]:
    """Map a native parameter tree to HF-named tensors, strictly.

    Every native leaf must be claimed by the table and every table entry must be present, with the
    shape the config implies; otherwise `NeedleWeightsError` (from `check_weights`) names them.
    With `copy=False` the tensors are views of the native arrays (per-layer slices, transposes), for
    a writer that streams them out one at a time without a second copy of the model.
    """
    leaves = {"/".join(path): to_array(value) for path, value in _flatten(params)}
    specs = weight_specs(config)
    check_weights(
        {path: leaf.shape for path, leaf in leaves.items()},
        native_weight_shapes(config),
        where="native checkpoint",
        described_as={
            "/".join(spec.native_path): "for " + (spec.hf_name if spec.layer is None else spec.hf_name.replace(".0.", ".{i}.", 1))
            for spec in specs
            if spec.layer in (None, 0)
        },
    )
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        leaf = leaves["/".join(spec.native_path)]
        leaf = leaf if spec.layer is None else leaf[spec.layer]
        leaf = leaf.T if spec.transpose else leaf
        out[spec.hf_name] = np.array(leaf, order="C") if copy else leaf
    return out


def hf_to_native(tensors: dict, config) -> dict:
    """Map HF-named tensors back to a native parameter tree (layers re-stacked), strictly.

    A tied alias (``lm_head.weight``, as in a PyTorch state dict) must equal the embedding and is dropped.
    """
    tensors = {name: np.asarray(value) for name, value in tensors.items()}
    check_hf_weights({name: value.shape for name, value in tensors.items()}, config, where="HF tensors")
    check_tied_values(tensors, where="HF tensors")
    stacked: dict[tuple[str, ...], list] = {}
    tree: dict = {}

    def put(path, value):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value

    for spec in weight_specs(config):
        value = tensors[spec.hf_name]
        value = np.array(value.T if spec.transpose else value, order="C")
        if spec.layer is None:
            put(spec.native_path, value)
        else:
            stacked.setdefault(spec.native_path, [None] * config.num_hidden_layers)[spec.layer] = value
    for path, per_layer in stacked.items():
        put(path, np.stack(per_layer))
    return tree
