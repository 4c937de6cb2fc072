"""The zero-centred RMS norm both Needle generations use (Flax twin of `norms_needle`), and Needle 2's
norm layer `FlaxNeedleRMSNorm`.

Shapes: x [..., D]; weight [D].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from transformers import PretrainedConfig

from .numerics import NORM_WEIGHT_INIT


def zero_centred_rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """`(1 + weight) * x / sqrt(mean(x^2) + eps)` over the last axis, cast back to x's dtype.

    The mean of squares is float32; `1 + weight` and its product with x are in the parameter/input
    dtype before the float32 division, as in the reference.
    """
    xf = x.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return ((1 + weight) * x / rms).astype(x.dtype)


def rms_unit(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x / rms(x) over the last axis, in float32, no gain."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class FlaxNeedleRMSNorm(nn.Module):
    """Zero-centred RMSNorm: `(1 + weight) * x / rms(x)`; `weight` starts at 0."""

    config: PretrainedConfig  # reads rms_norm_eps
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.constant(NORM_WEIGHT_INIT), (x.shape[-1],))
        return zero_centred_rms_norm(x, weight, self.config.rms_norm_eps).astype(self.dtype)
