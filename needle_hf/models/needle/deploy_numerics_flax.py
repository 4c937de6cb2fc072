"""Deployment numerics in JAX: the Flax twin of `deploy_numerics` (same names, arguments, semantics).

With ``config.deploy_numerics`` the Flax model calls `quantize_activations` and `quantize_kv` at the
engine's quantisation points, and the wrapper's ``train=True`` call runs on `training_weights`
(CQ fake-quantised weights, the QAT of the reference's fine-tuning; LoRA through a params
transform is merged before, so it is quantised as merged). Straight-through gradients everywhere;
float32 arithmetic in the reference's order.

Shapes: [..., W] is any array quantised along its last axis W; G = groups, g = group size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from .configuration_needle import NeedleConfig
from .numerics import (
    CQ_KV_GROUP,
    CQ_NORM_FLOOR,
    CQ_WEIGHT_GROUP,
    cq_levels,
    cq_walsh_matrix,
    kv_cache_bits,
)
from .weight_names import cq_weight_bits


def _straight_through(x: jnp.ndarray, quantized: jnp.ndarray) -> jnp.ndarray:
    """The value of `quantized`, the gradient of `x`."""
    return x + jax.lax.stop_gradient(quantized - x)


def absmax_rows(x: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Symmetric per-row quantisation to `bits` (scale = row absmax / (2**(bits-1) - 1)), dequantised.

    x: [..., W] -> [..., W] in x's dtype.
    """
    qmax = 2 ** (bits - 1) - 1
    rows = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)  # [..., 1]
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
    return (jnp.clip(jnp.round(rows / scale), -qmax - 1, qmax) * scale).astype(x.dtype)


def cq_dequantized(x: jnp.ndarray, bits: int, group: int) -> jnp.ndarray:
    """CQ round trip along the last axis (zero padded to whole groups); see `deploy_numerics.cq_dequantized`.

    x: [..., W] -> [..., W] in x's dtype.
    """
    levels = jnp.asarray(cq_levels(bits, group))  # [2**bits]
    walsh = jnp.asarray(cq_walsh_matrix(group))  # [g, g]
    width = x.shape[-1]
    padding = (-width) % group
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padding)]) if padding else x
    groups = padded.reshape(*padded.shape[:-1], -1, group).astype(jnp.float32)  # [..., G, g]
    rotated = groups @ walsh
    norms = jnp.sqrt(jnp.sum(rotated**2, axis=-1, keepdims=True))  # [..., G, 1]
    unit = (rotated / jnp.maximum(norms, CQ_NORM_FLOOR)).reshape(-1)
    upper = jnp.clip(jnp.searchsorted(levels, unit), 1, levels.shape[0] - 1)
    below, above = levels[upper - 1], levels[upper]
    nearest = jnp.where(jnp.abs(unit - below) <= jnp.abs(unit - above), below, above)
    restored = (nearest.reshape(groups.shape) * norms.astype(jnp.float16).astype(jnp.float32)) @ walsh
    return restored.reshape(padded.shape).astype(x.dtype)[..., :width]


def fake_quant_rows(x: jnp.ndarray, bits: int) -> jnp.ndarray:
    """`absmax_rows` with a straight-through gradient."""
    return _straight_through(x, absmax_rows(x, bits))


def cq_fake_quant(x: jnp.ndarray, bits: int, group: int) -> jnp.ndarray:
    """`cq_dequantized` with a straight-through gradient."""
    return _straight_through(x, cq_dequantized(x, bits, group))


# --------------------------------------------------------------------------------------------------
# The hooks the model calls


def quantize_activations(x: jnp.ndarray, config: NeedleConfig) -> jnp.ndarray:
    """Activations [..., W] entering a quantised matmul: fake-quantised rows under deploy numerics."""
    return fake_quant_rows(x, config.act_bits) if config.deploy_numerics else x


def quantize_kv(keys: jnp.ndarray, values: jnp.ndarray, config: NeedleConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Keys and values [..., head_dim] as a `kv_bits` CQ cache holds them (unchanged at 8 bits and up)."""
    bits = kv_cache_bits(config)
    if bits is None:
        return keys, values
    return cq_fake_quant(keys, bits, CQ_KV_GROUP), cq_fake_quant(values, bits, CQ_KV_GROUP)


def _hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """(HF name, whether the leaf is a [in, out] kernel) of a Flax parameter path."""
    if path[-1] == "kernel":
        return ".".join(path[:-1] + ("weight",)), True
    if path[-1] == "embedding":
        return ".".join(path[:-1] + ("weight",)), False
    return ".".join(path), False


def training_weights(params, config: NeedleConfig, *, train: bool):
    """The parameters a forward runs on: `params` itself, or with ``train`` under deploy numerics every
    CQ-stored weight CQ fake-quantised at its `cq_weight_bits` width (straight-through; kernels
    [in, out] grouped along ``in``).

    `params` is the (possibly prefix-less) parameter tree of the module being applied.
    """
    if not (train and config.deploy_numerics):
        return params
    widths = cq_weight_bits(config)
    flat = flatten_dict(params)
    for path, leaf in flat.items():
        hf_name, is_kernel = _hf_name(path)
        # The backbone's names lack the "model." prefix when the bare model is applied.
        bits = widths.get(hf_name, widths.get("model." + hf_name))
        if bits is None or getattr(leaf, "ndim", 0) < 2:
            continue
        if is_kernel:
            flat[path] = cq_fake_quant(leaf.T, bits, CQ_WEIGHT_GROUP).T
        else:
            flat[path] = cq_fake_quant(leaf, bits, CQ_WEIGHT_GROUP)
    return unflatten_dict(flat)
