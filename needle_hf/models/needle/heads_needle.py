"""The output heads of PyTorch Needle 2 that read the backbone without a block of their own: the tied
language-model logits and the probe-pooling heads of tool retrieval (contrastive) and answer
confidence. (The MTP head runs a decoder block and lives with the layers in `modeling_needle`.)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .configuration_needle import NeedleConfig
from .numerics import CONFIDENCE_PROBES, CONTRASTIVE_NORM_EPS, CONTRASTIVE_PROBES, CONTRASTIVE_TEMPERATURE_INIT


def tied_logits(hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
    """Float32 ``hidden @ E.T``: [..., D] -> [..., V] (the output head is the token embedding)."""
    return hidden.float() @ embedding_weight.float().T


def probe_pool(cells: torch.Tensor, keep: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """Attention pooling of every (position, layer) cell by learned probes.

    cells: [B, T, L + 1, D] float32; keep: [B, T] bool; probes: [P, D] -> [B, P * D] float32.
    """
    batch, length, depth, width = cells.shape
    flat = cells.reshape(batch, length * depth, width)
    keep = keep.repeat_interleave(depth, dim=1)  # position-major, like the cells
    scores = torch.einsum("bcd,kd->bkc", flat, probes.float()) / math.sqrt(width)
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    weights = scores.softmax(dim=-1)
    return torch.einsum("bkc,bcd->bkd", weights, flat).reshape(batch, -1)


class NeedleContrastiveHead(nn.Module):
    """Tool-retrieval embedding: probe pooling, a projection, L2 normalisation, plus a learned log-temperature."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        self.probes = nn.Parameter(torch.zeros(CONTRASTIVE_PROBES, config.hidden_size))
        self.proj = nn.Linear(CONTRASTIVE_PROBES * config.hidden_size, config.contrastive_dim, bias=False)
        self.log_temperature = nn.Parameter(torch.tensor(math.log(CONTRASTIVE_TEMPERATURE_INIT)))

    def forward(self, cells: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        projected = self.proj(probe_pool(cells, keep, self.probes).to(dtype))  # [B, C]
        norm = torch.sqrt(projected.float().pow(2).sum(-1, keepdim=True) + CONTRASTIVE_NORM_EPS)
        return projected / norm.to(projected.dtype)


class NeedleConfidenceHead(nn.Module):
    """Answer-confidence logit: probe pooling and an affine map to one float32 logit per sequence."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        self.probes = nn.Parameter(torch.zeros(CONFIDENCE_PROBES, config.hidden_size))
        self.proj = nn.Linear(CONFIDENCE_PROBES * config.hidden_size, 1, bias=True)

    def forward(self, cells: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.proj(probe_pool(cells, keep, self.probes).to(dtype))[..., 0].float()
