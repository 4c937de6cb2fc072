"""The zero-centred RMS norm both Needle generations use (PyTorch): gain ``1 + weight``, mean of squares
in float32. Needle 3's model imports it from here, so it ships in both remote-code folders.

Shapes: x [..., D]; weight [D].
"""

from __future__ import annotations

import torch
from torch import nn


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight) * x / sqrt(mean(x^2) + eps)`` over the last axis, cast back to ``x``'s dtype.

    The mean of squares is float32; ``1 + weight`` and its product with ``x`` happen in the
    parameter/input dtype before the float32 division, as in the reference (this matters for fp16
    checkpoints).
    """
    x_f32 = x.float()
    rms = torch.sqrt((x_f32 * x_f32).mean(dim=-1, keepdim=True) + eps)  # x * x: pow(2) bit for bit, cheaper
    return (((1 + weight) * x) / rms).to(x.dtype)


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Float32 ``x / sqrt(mean(x^2) + eps)`` over the last axis, no gain."""
    x = x.float()
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)


class NeedleRMSNorm(nn.Module):
    """Zero-centred RMS norm: the gain is ``1 + weight`` (weight initialised to 0)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gain=1+weight"
