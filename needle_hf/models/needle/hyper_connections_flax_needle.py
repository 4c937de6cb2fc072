"""Hyper-connections of Flax Needle 2: each layer's routing of the ``hyper_connection_lanes`` lanes of
the residual stream (how much of each lane its block reads, how much of the block's output each lane
receives, and the Sinkhorn-normalised lane mixing). PyTorch twin: `hyper_connections_needle`.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax.numpy as jnp

from .configuration_needle import NeedleConfig
from .numerics import HYPER_CONNECTION_ALPHA_INIT, HYPER_CONNECTION_RES_BIAS_INIT
from .ops_flax_needle import sinkhorn
from .projections_flax_needle import FlaxNeedleLinear, fused_projections


class FlaxNeedleHyperConnection(nn.Module):
    """Per-layer lane mixing weights: pre-mix (lanes -> block input), post-mix, and residual routing."""

    config: NeedleConfig

    def setup(self):
        cfg = self.config
        lanes = cfg.hyper_connection_lanes
        linear = partial(FlaxNeedleLinear, lanes * cfg.hidden_size, dtype=jnp.float32, init_std=cfg.initializer_range)
        self.pre_proj = linear(lanes)
        self.post_proj = linear(lanes)
        self.res_proj = linear(lanes * lanes)
        self.pre_bias = self.param("pre_bias", nn.initializers.zeros, (lanes,))
        self.post_bias = self.param("post_bias", nn.initializers.zeros, (lanes,))
        self.res_bias = self.param("res_bias", lambda key, shape: HYPER_CONNECTION_RES_BIAS_INIT * jnp.eye(lanes), (lanes, lanes))
        alpha = nn.initializers.constant(HYPER_CONNECTION_ALPHA_INIT)
        self.pre_alpha = self.param("pre_alpha", alpha, ())
        self.post_alpha = self.param("post_alpha", alpha, ())
        self.res_alpha = self.param("res_alpha", alpha, ())

    def __call__(self, lanes_flat_unit, pre_offset, post_offset):
        """lanes_flat_unit [B, T, L*D] float32 -> (pre [B, T, L], post [B, T, L], routing [B, T, L, L])."""
        f32 = lambda p: jnp.asarray(p, jnp.float32)  # noqa: E731
        b, t, _ = lanes_flat_unit.shape
        n = self.config.hyper_connection_lanes
        pre_logits, post_logits, routing_logits = fused_projections(lanes_flat_unit, (self.pre_proj, self.post_proj, self.res_proj))
        pre = nn.sigmoid(f32(self.pre_alpha) * pre_logits + f32(self.pre_bias) + pre_offset)
        post = 2 * nn.sigmoid(f32(self.post_alpha) * post_logits + f32(self.post_bias) + post_offset)
        routing_logits = f32(self.res_alpha) * routing_logits.reshape(b, t, n, n) + f32(self.res_bias)
        return pre, post, sinkhorn(routing_logits)


__all__ = ["FlaxNeedleHyperConnection"]
