"""Hyper-connections of PyTorch Needle 2: the residual stream as ``hyper_connection_lanes`` lanes, and
each layer's routing of them (how much of each lane its block reads, how much of the block's output
each lane receives, and the Sinkhorn-normalised lane mixing). Flax twin: `hyper_connections_flax_needle`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_needle import NeedleConfig
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

    def route(
        self, lanes: torch.Tensor, lane_offsets: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """lanes: [B, T, L, D], lane_offsets: this layer's (pre, post) [L] float32 (`step.pre_offsets[i]`,
        `step.post_offsets[i]`) -> (read weights [B, T, L], write weights [B, T, L], mixing [B, T, L, L]), float32."""
        batch, length, n, width = lanes.shape
        flat = lanes.reshape(batch, length, n * width).float()  # [B, T, L * D]
        # x̂ @ W.T is (x @ W.T) / rms(x) row by row: the three projections read the lanes once, as one
        # product, and neither x̂ nor x * x [B, T, L * D] is made (two passes over a prompt's lanes fewer).
        mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / (n * width)  # [B, T, 1]
        weights = torch.cat([self.pre_proj.weight, self.post_proj.weight, self.res_proj.weight]).float()
        projected = F.linear(flat, weights) * torch.rsqrt(mean_square + self.eps)  # [B, T, 2L + L * L]
        pre, post, res = projected.split([n, n, n * n], dim=-1)
        pre_offset, post_offset = lane_offsets
        read = torch.sigmoid(self.pre_alpha.float() * pre + self.pre_bias.float() + pre_offset)
        write = 2 * torch.sigmoid(self.post_alpha.float() * post + self.post_bias.float() + post_offset)
        mix_logits = (self.res_alpha.float() * res).view(batch, length, n, n)
        mixing = sinkhorn(mix_logits + self.res_bias.float())
        return read, write, mixing


__all__ = ["NeedleHyperConnection"]
