"""Deployment numerics in PyTorch: what the Needle engine computes from a `.cact`, as fake quantisation.

With ``config.deploy_numerics`` the PyTorch model calls these functions at the engine's
quantisation points (the Flax twin, `deploy_numerics_flax`, has the same names and arguments):

- `quantize_activations`: int8 (``act_bits``) per-row absmax fake quantisation of the block's
  attention input, the attention output, the engram rows, the final hidden state (before the tied
  logits) and the MTP combiner input;
- `quantize_kv`: CQ quantisation of each key and value row (groups of `CQ_KV_GROUP` along head_dim)
  when ``kv_bits`` < 8, as the engine's cache stores them;
- `training_weights`: in training mode, every CQ-stored weight (`is_cq_weight`) replaced by its CQ
  fake quantisation at its width (`weight_names.cq_weight_bits`: the ``weight_bits`` map's widths,
  ternary included, else `DEFAULT_WEIGHT_BITS`), the QAT of the reference's fine-tuning. A PEFT LoRA layer is quantised as merged (``W + delta``), as the engine
  stores it.

Every fake quantisation is straight-through: the forward value is the quantised one, the gradient
is the identity's. Arithmetic is float32 in the order the reference writes it (the same divisions,
roundings and float16 norms), so values equal the reference's ``quant=True`` forward.

Shapes: [..., W] is any tensor quantised along its last axis W; G = groups, g = group size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

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


def _straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """The value of `quantized`, the gradient of `x`."""
    return x + (quantized - x).detach()


def absmax_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-row quantisation to `bits` (scale = row absmax / (2**(bits-1) - 1)), dequantised.

    x: [..., W] -> [..., W] in x's dtype (no gradient path; see `fake_quant_rows`).
    """
    qmax = 2 ** (bits - 1) - 1
    rows = x.float()
    absmax = rows.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    # Times the float32 reciprocal, not divided: XLA compiles the reference's `absmax / qmax` so.
    scale = torch.where(absmax > 0, absmax * (1.0 / qmax), torch.ones_like(absmax))
    return (torch.round(rows / scale).clamp(-qmax - 1, qmax) * scale).to(x.dtype)


def cq_dequantized(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """CQ round trip along the last axis (zero padded to whole groups), as the engine decodes it.

    Each group is rotated by the orthonormal Walsh matrix, split into its L2 norm (kept as float16)
    and unit direction, the direction snapped to the nearest level (ties to the lower), rotated back.
    x: [..., W] -> [..., W] in x's dtype.
    """
    levels = torch.tensor(cq_levels(bits, group), device=x.device)  # [2**bits]
    walsh = torch.tensor(cq_walsh_matrix(group), device=x.device)  # [g, g]
    width = x.shape[-1]
    padding = (-width) % group
    padded = F.pad(x, (0, padding)) if padding else x
    groups = padded.reshape(*padded.shape[:-1], -1, group).float()  # [..., G, g]
    rotated = groups @ walsh
    norms = torch.sqrt(torch.sum(rotated**2, dim=-1, keepdim=True))  # [..., G, 1]
    unit = (rotated / torch.clamp_min(norms, CQ_NORM_FLOOR)).reshape(-1)
    upper = torch.clamp(torch.searchsorted(levels, unit), 1, levels.shape[0] - 1)
    below, above = levels[upper - 1], levels[upper]
    nearest = torch.where(torch.abs(unit - below) <= torch.abs(unit - above), below, above)
    restored = (nearest.reshape(groups.shape) * norms.half().float()) @ walsh
    return restored.reshape(padded.shape).to(x.dtype)[..., :width]


def fake_quant_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`absmax_rows` with a straight-through gradient."""
    return _straight_through(x, absmax_rows(x, bits))


def cq_fake_quant(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """`cq_dequantized` with a straight-through gradient."""
    return _straight_through(x, cq_dequantized(x, bits, group))


# --------------------------------------------------------------------------------------------------
# The hooks the model calls


def quantize_activations(x: torch.Tensor, config: NeedleConfig) -> torch.Tensor:
    """Activations [..., W] entering a quantised matmul: fake-quantised rows under deploy numerics."""
    return fake_quant_rows(x, config.act_bits) if config.deploy_numerics else x


def quantize_kv(
    keys: torch.Tensor, values: torch.Tensor, config: NeedleConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [..., head_dim] as a `kv_bits` CQ cache holds them (unchanged at 8 bits and up)."""
    bits = kv_cache_bits(config)
    if bits is None:
        return keys, values
    return cq_fake_quant(keys, bits, CQ_KV_GROUP), cq_fake_quant(values, bits, CQ_KV_GROUP)


def _lora_deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{base weight name: delta}`` of the active, unmerged PEFT LoRA layers in `model`."""
    deltas = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")):
            continue
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            continue
        active = [a for a in module.active_adapters if a in getattr(module, "lora_A", {})]
        if active:
            deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a) for a in active)
    return deltas


def training_weights(model: torch.nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """The weights a QAT forward of `model` runs on, by parameter name, or None when it runs on its own.

    None unless ``config.deploy_numerics`` and `model.training`, and inside the QAT forward itself
    (there the embedding is already the substituted tensor, not a Parameter). Each CQ-stored weight W
    becomes ``W + stopgrad(CQ(W + delta) - (W + delta))``, delta = the LoRA update PEFT adds beside
    it (0 without PEFT): the layer's output is then that of the quantised merged weight, and the
    gradient reaches W, or the adapter, unchanged (straight-through).
    """
    config = model.config
    if not (config.deploy_numerics and model.training):
        return None
    if not isinstance(model.get_input_embeddings().weight, torch.nn.Parameter):
        return None
    deltas = _lora_deltas(model)
    widths = cq_weight_bits(config)
    weights = {}
    for name, weight in model.named_parameters():
        hf_name = name.replace(".base_layer.", ".")
        if hf_name not in widths:
            continue
        with torch.no_grad():
            merged = weight + deltas[name] if name in deltas else weight
            correction = cq_dequantized(merged, widths[hf_name], CQ_WEIGHT_GROUP) - merged
        weights[name] = weight + correction
    return weights


def forward_on_training_weights(model: torch.nn.Module, weights: dict, arguments: dict):
    """Run ``model.forward(**arguments)`` with `weights` substituted (``arguments``: the forward's
    ``locals()``, taken first thing; ``self`` and ``kwargs`` are unpacked)."""
    arguments = dict(arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", None) or {}
    return torch.func.functional_call(model, weights, (), {**arguments, **extra})
