"""The zero-centred RMS norm both Needle generations use (Flax twin of `norms_needle`).

Shapes: x [..., D]; weight [D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
