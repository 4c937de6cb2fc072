"""The Hadamard MLP of PyTorch Needle 2: diagonal scalings around two Walsh-Hadamard transforms,
the input zero padded to the Hadamard width (a power of two). Flax twin: `hadamard_mlp_flax_needle`.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_needle import NeedleConfig
from .numerics import HADAMARD_DIAG_OUT_INIT
from .ops_needle import walsh_transform


class NeedleHadamardMLP(nn.Module):
    """``z = (d1 * z) H; z = silu(d2 * z) H; out = (d3 * z)[:d]`` with ``z`` zero padded to ``n`` (a power of two)."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        n = config.hadamard_size
        self.hidden_size = config.hidden_size
        self.diag_in = nn.Parameter(torch.ones(n))
        self.diag_hidden = nn.Parameter(torch.ones(n))
        self.diag_out = nn.Parameter(torch.full((n,), HADAMARD_DIAG_OUT_INIT))

    def forward(self, x: torch.Tensor, walsh: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: [B, T, D], walsh: the Walsh matrix or its Kronecker factors (`walsh_transform`) -> [B, T, D]."""
        padding = self.diag_in.shape[0] - self.hidden_size
        z = F.pad(x, (0, padding)) if padding else x  # [B, T, W]
        z = walsh_transform(self.diag_in * z, walsh)
        z = walsh_transform(F.silu(self.diag_hidden * z), walsh)
        return (self.diag_out * z)[..., : self.hidden_size]


__all__ = ["NeedleHadamardMLP"]
