"""Hyper-connections of PyTorch Needle 2: the residual stream as ``hyper_connection_lanes`` lanes, and
each layer's routing of them (how much of each lane its block reads, how much of the block's output
each lane receives, and the Sinkhorn-normalised lane mixing). Flax twin: `hyper_connections_flax_needle`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_needle import NeedleConfig
from .norms_needle import rms_unit
from .numerics import HYPER_CONNECTION_ALPHA_INIT, HYPER_CONNECTION_RES_BIAS_INIT
from .ops_needle import sinkhorn


class NeedleHyperConnection(nn.Module):
    """Lane routing of one layer: how much of each lane the block reads (pre), how much of the block
    output each lane receives (post), and the doubly-stochastic lane mixing (res).

    Every coefficient is computed from the float32 unit-RMS flattened lanes ``x̂`` [B, T, L * D].
    """

    def __init__(self, config: NeedleConfig, layer_idx: int):
        super().__init__()
        lanes = config.hyper_connection_lanes
        width = lanes * config.hidden_size
        self.lanes = lanes
        self.eps = config.rms_norm_eps
        self.pre_proj = nn.Linear(width, lanes, bias=False)
        self.post_proj = nn.Linear(width, lanes, bias=False)
        self.res_proj = nn.Linear(width, lanes * lanes, bias=False)
        self.pre_bias = nn.Parameter(torch.zeros(lanes))
        self.post_bias = nn.Parameter(torch.zeros(lanes))
        self.res_bias = nn.Parameter(HYPER_CONNECTION_RES_BIAS_INIT * torch.eye(lanes))
        self.pre_alpha = nn.Parameter(torch.tensor(HYPER_CONNECTION_ALPHA_INIT))
        self.post_alpha = nn.Parameter(torch.tensor(HYPER_CONNECTION_ALPHA_INIT))
        self.res_alpha = nn.Parameter(torch.tensor(HYPER_CONNECTION_ALPHA_INIT))
        # Layer i owns lane i mod lanes: fixed logit offsets (not parameters), `step.pre_offsets[i]`.
        self.layer_idx = layer_idx

    @staticmethod
    def _scaled_projection(unit: torch.Tensor, proj: nn.Linear, alpha: torch.Tensor) -> torch.Tensor:
        """``alpha * (x̂ @ W.T)`` in float32."""
        return alpha.float() * F.linear(unit, proj.weight.float())

    def route(
        self, lanes: torch.Tensor, lane_offsets: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """lanes: [B, T, L, D], lane_offsets: this layer's (pre, post) [L] float32 (`step.pre_offsets[i]`,
        `step.post_offsets[i]`) -> (read weights [B, T, L], write weights [B, T, L], mixing [B, T, L, L]), float32."""
        batch, length, n, width = lanes.shape
        unit = rms_unit(lanes.reshape(batch, length, n * width), self.eps)  # [B, T, L * D]
        pre_offset, post_offset = lane_offsets
        read = torch.sigmoid(
            self._scaled_projection(unit, self.pre_proj, self.pre_alpha) + self.pre_bias.float() + pre_offset
        )
        write = 2 * torch.sigmoid(
            self._scaled_projection(unit, self.post_proj, self.post_alpha) + self.post_bias.float() + post_offset
        )
        mix_logits = self._scaled_projection(unit, self.res_proj, self.res_alpha).view(batch, length, n, n)
        mixing = sinkhorn(mix_logits + self.res_bias.float())
        return read, write, mixing


__all__ = ["NeedleHyperConnection"]
