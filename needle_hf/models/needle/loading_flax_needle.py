"""Strict loading of Flax Needle 2 weights from PyTorch-layout safetensors, and the Flax parameter
tree under the weight table's names (`weight_names`): every tensor the config names, no other, each
of its shape (`NeedleWeightsError` otherwise)."""

from __future__ import annotations

import numpy as np
from flax.core.frozen_dict import unfreeze
from flax.traverse_util import flatten_dict, unflatten_dict

from .configuration_needle import NeedleConfig
from .numerics import TIED_WEIGHTS
from .weight_names import (
    HEAD_PREFIXES,
    NeedleWeightsError,
    check_tied_values,
    check_weights,
    hf_weight_shapes,
    without_tied_aliases,
)


SAFE_WEIGHTS_NAME = "model.safetensors"


def _hf_name(flax_path: tuple[str, ...], prefix: str) -> tuple[str, bool]:
    """(HF tensor name, whether the tensor is the transpose) of a Flax parameter path.

    Flax names follow the HF module tree; only the leaf differs: a Dense `kernel` [in, out] is the
    transposed PyTorch `weight` [out, in], and the token embedding's `embedding` is its `weight`.
    """
    *modules, leaf = flax_path
    if leaf in ("kernel", "embedding"):
        return prefix + ".".join((*modules, "weight")), leaf == "kernel"
    return prefix + ".".join(flax_path), False


def _flax_path(hf_name: str, ndim: int, prefix: str) -> tuple[tuple[str, ...], bool]:
    """Inverse of `_hf_name`: every 2-D `weight` of the table is a Dense kernel but the embedding's."""
    *modules, leaf = hf_name[len(prefix):].split(".")
    if leaf == "weight" and ndim == 2:
        is_embedding = modules[-1:] == ["embed_tokens"]
        return (*modules, "embedding" if is_embedding else "kernel"), not is_embedding
    return (*modules, leaf), False


def flax_params_to_hf(params, config: NeedleConfig, *, prefix: str = "") -> dict[str, np.ndarray]:
    """Flax parameters -> HF-named PyTorch-layout numpy tensors (Dense kernels transposed).

    `prefix` is prepended to every name ("model." for the bare backbone). The result is checked
    against the weight-name table, so a layout drift raises instead of writing a bad file.
    """
    tensors = {}
    for path, leaf in flatten_dict(unfreeze(params)).items():
        name, transposed = _hf_name(path, prefix)
        leaf = np.asarray(leaf.T if transposed else leaf)
        tensors[name] = np.ascontiguousarray(leaf) if leaf.ndim else leaf
    check_weights(
        {k: v.shape for k, v in tensors.items()}, hf_weight_shapes(config, prefix=prefix), where="model parameters"
    )
    return tensors


def read_checked_weights(weights: str, config: NeedleConfig, *, prefix: str) -> dict:
    """The Flax parameter tree of a PyTorch-layout safetensors file, after checking every name and shape.

    The bare backbone (`prefix` "model.") reads the backbone of a causal-LM file and leaves its heads.
    """
    from safetensors import safe_open

    with safe_open(weights, framework="flax") as handle:
        layout = (handle.metadata() or {}).get("format")
        if layout != "pt":
            raise NeedleWeightsError(
                f"{weights}: expected PyTorch-layout safetensors (metadata format 'pt'), found format {layout!r}"
            )
        stored = set(handle.keys())
        # A tied alias (`lm_head.weight`, written by a tool that stores tied tensors twice) names the
        # embedding again: checked equal to it, then left unread.
        if stored & TIED_WEIGHTS.keys():
            pairs = [name for name in (*TIED_WEIGHTS, *TIED_WEIGHTS.values()) if name in stored]
            check_tied_values({name: np.asarray(handle.get_tensor(name)) for name in pairs}, where=weights)
        found = without_tied_aliases({name: tuple(handle.get_slice(name).get_shape()) for name in stored})
        check_weights(
            found,
            hf_weight_shapes(config, prefix=prefix),
            where=weights,
            ignore_unexpected_prefixes=HEAD_PREFIXES if prefix else (),
        )
        params = {}
        for name, shape in found.items():
            if name.startswith(prefix):
                path, transposed = _flax_path(name, len(shape), prefix)
                tensor = handle.get_tensor(name)
                params[path] = tensor.T if transposed else tensor
    return unflatten_dict(params)
