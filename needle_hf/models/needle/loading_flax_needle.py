"""Strict loading of Flax Needle 2 weights from PyTorch-layout safetensors, and the Flax parameter
tree under the weight table's names (`weight_names`): every tensor the config names, no other, each
of its shape (`NeedleWeightsError` otherwise); the compute dtype `from_pretrained` resolves."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
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


_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def auto_class_dtype_request(config_dtype) -> bool:
    """Whether a config's `dtype` is a Flax Auto class's `dtype=` argument rather than the weight dtype
    config.json records (a name, or the torch dtype 4.57 turns that name into)."""
    return config_dtype is not None and not isinstance(config_dtype, str) and type(config_dtype).__module__ != "torch"


def compute_dtype(dtype, *, config_dtype=None):
    """The Flax compute dtype for `from_pretrained`, from every spelling users and the Auto classes use.

    transformers 4.57's `FlaxAutoModel*.from_pretrained(path, dtype=jnp.bfloat16)` hands `dtype` to
    `AutoConfig`, which keeps it as the config attribute `dtype`; the model class then sees it only
    there (`config_dtype`), so a JAX/NumPy dtype found on the config is the caller's request.

    Args:
        dtype: None (float32, or the Auto classes' request), `"auto"` (the config's recorded weight
            dtype, float32 if none), a JAX/NumPy dtype, or a name (`"bfloat16"`, `"torch.bfloat16"`).
        config_dtype: the config's `dtype` attribute.

    Returns:
        The `jnp.dtype`; a dtype outside float32/bfloat16/float16 raises `ValueError`.
    """
    if dtype is None:
        dtype = config_dtype if auto_class_dtype_request(config_dtype) else jnp.float32
    elif isinstance(dtype, str) and dtype == "auto":
        dtype = config_dtype or jnp.float32
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, str) or type(dtype).__module__ == "torch" else None
    try:
        resolved = jnp.dtype(name if name is not None else dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(_FLOAT_DTYPES)} (or \"auto\"), got {dtype!r}")
    return resolved


def resolve_config(source, config: Optional[NeedleConfig], dtype, config_overrides: dict, hub_kwargs: dict, *,
                   caller: str) -> tuple[NeedleConfig, jnp.dtype]:
    """(config, compute dtype) of a Flax `from_pretrained(source, config=..., dtype=..., **config_overrides)`:
    the folder's config (or the one given) with the overrides that are `NeedleConfig` fields applied;
    any other keyword raises `TypeError` naming ``caller``. See `compute_dtype` for ``dtype``."""
    if config is None:
        config, unused = NeedleConfig.from_pretrained(
            source, return_unused_kwargs=True, **hub_kwargs, **config_overrides
        )
    dtype = compute_dtype(dtype, config_dtype=getattr(config, "dtype", None))
    if config is not None:
        config_dict = config.to_dict()
        if auto_class_dtype_request(getattr(config, "dtype", None)):
            # the Auto classes' `dtype=` (a JAX dtype, not a weight dtype name): taken above
            config_dict.pop("dtype", None)
            config_dict.pop("torch_dtype", None)
        config = NeedleConfig.from_dict(config_dict)
        unused = {k: v for k, v in config_overrides.items() if not hasattr(config, k)}
        for key, value in config_overrides.items():
            if key not in unused:
                setattr(config, key, value)
    if unused:
        raise TypeError(
            f"{caller} got unexpected keyword argument(s) {sorted(unused)} "
            "(neither loading options nor NeedleConfig fields)"
        )
    return config, dtype
