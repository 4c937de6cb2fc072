"""The Hadamard MLP of Flax Needle 2: diagonal scalings around two Walsh-Hadamard transforms, the
input zero padded to the Hadamard width (a power of two). PyTorch twin: `hadamard_mlp_needle`.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from .configuration_needle import NeedleConfig
from .numerics import HADAMARD_DIAG_HIDDEN_INIT, HADAMARD_DIAG_IN_INIT, HADAMARD_DIAG_OUT_INIT
from .ops_flax_needle import walsh_operand, walsh_transform


class FlaxNeedleHadamardMLP(nn.Module):
    """`(diag_out * silu(diag_hidden * (diag_in * x) W) W)[:D]` with W the orthonormal Walsh matrix."""

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        n, d = self.config.hadamard_size, self.config.hidden_size
        diag_in = self.param("diag_in", nn.initializers.constant(HADAMARD_DIAG_IN_INIT), (n,)).astype(self.dtype)
        diag_hidden = self.param("diag_hidden", nn.initializers.constant(HADAMARD_DIAG_HIDDEN_INIT), (n,)).astype(self.dtype)
        diag_out = self.param("diag_out", nn.initializers.constant(HADAMARD_DIAG_OUT_INIT), (n,)).astype(self.dtype)
        z = jnp.pad(x, ((0, 0), (0, 0), (0, n - d))) if n > d else x
        walsh = walsh_operand(self.config, z.dtype)
        z = walsh_transform(diag_in * z, walsh)
        z = walsh_transform(nn.silu(diag_hidden * z), walsh)
        return (diag_out * z)[..., :d]


__all__ = ["FlaxNeedleHadamardMLP"]
