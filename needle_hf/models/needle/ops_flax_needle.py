"""Flax Needle 2's numerical building blocks: norms, RoPE, Sinkhorn, the Walsh transform and the
engram hash.

Each is the Flax side of a helper `specification_needle` names (the PyTorch model defines the same
names with the same arguments in `ops_needle`); shapes use its axis legend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .configuration_needle import NeedleConfig
from .numerics import (
    ENGRAM_HASH_PRIME,
    ENGRAM_HASH_SHIFT,
    SINKHORN_ITERATIONS,
    SINKHORN_LINEAR_SPACE_MAX_SPREAD,
    engram_table_orders,
    engram_table_seeds,
    walsh_factor_sizes,
    walsh_matrix,
)
from .norms_flax_needle import rms_unit, zero_centred_rms_norm  # noqa: F401  (re-exported: the twin ops table)
from .specification_needle import walsh_operand_names


def normal_initializer(std: float):
    return jax.nn.initializers.normal(stddev=std)


def _log_space_round(_, log_k):
    log_k = log_k - jax.nn.logsumexp(log_k, axis=-1, keepdims=True)
    return log_k - jax.nn.logsumexp(log_k, axis=-2, keepdims=True)


def _linear_space_round(_, k):
    # Sums over the (static, small) lane axes as explicit adds of slices: elementwise only, so XLA
    # fuses a whole round into one loop, where reductions would each be a kernel of their own.
    n = k.shape[-1]
    k = k / sum(k[..., :, j : j + 1] for j in range(n))
    return k / sum(k[..., i : i + 1, :] for i in range(n))


def log_space_sinkhorn(logits: jnp.ndarray, iterations: int = SINKHORN_ITERATIONS) -> jnp.ndarray:
    """The reference's Sinkhorn of [..., L, L] float32 logits: ``iterations`` rounds that subtract the
    logsumexp over rows, then over columns; the result is exp of the final logits."""
    return jnp.exp(jax.lax.fori_loop(0, iterations, _log_space_round, logits))


def sinkhorn(logits: jnp.ndarray, iterations: int = SINKHORN_ITERATIONS) -> jnp.ndarray:
    """Doubly-stochastic routing [..., L, L] from float32 logits: the reference's log-space Sinkhorn
    (subtract the logsumexp over rows, then over columns, ``iterations`` rounds, then exp).

    Computed in linear space, the same in exact arithmetic: subtracting a row's logsumexp is dividing
    `exp(logits)` by the row's sum. A round is then one fused loop instead of about a dozen kernels,
    which is most of a decoding step's lane-mixing cost. Logits spread wider than
    `SINKHORN_LINEAR_SPACE_MAX_SPREAD` (where linear space could underflow) take the log-space path.
    """
    shifted = logits - jnp.max(logits, axis=(-2, -1), keepdims=True)  # each matrix's largest logit at 0
    return jax.lax.cond(
        jnp.min(shifted, initial=0.0) < -SINKHORN_LINEAR_SPACE_MAX_SPREAD,
        lambda: log_space_sinkhorn(logits, iterations),
        lambda: jax.lax.fori_loop(0, iterations, _linear_space_round, jnp.exp(shifted)),
    )


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Half-split RoPE `[x1 cos - x2 sin, x2 cos + x1 sin]`. x [B, T, heads, H] (N query or K key heads); cos/sin [B, T, H / 2] float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_tables(position_ids: jnp.ndarray, inverse_frequencies) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin [B, T, H / 2] float32 for integer positions [B, T] (`numerics.rope_inverse_frequencies`)."""
    angles = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def shift_right(x: jnp.ndarray, offset: int, *, fill=0) -> jnp.ndarray:
    """x[:, t - offset] along axis 1, `fill` before the start."""
    if offset == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (offset, 0)
    return jnp.pad(x, pad, constant_values=fill)[:, : x.shape[1]]


def engram_hash_indices(tokens: jnp.ndarray, orders, num_heads: int, slots: int) -> jnp.ndarray:
    """Hash-table rows [B, C, tables] for token ids [B, C] (uint32 FNV-style n-gram hash)."""
    tokens = tokens.astype(jnp.uint32)
    rows = []
    for seed, order in zip(engram_table_seeds(len(orders), num_heads), engram_table_orders(orders, num_heads)):
        acc = jnp.full_like(tokens, jnp.uint32(seed))
        for j in range(order):
            acc = (acc ^ shift_right(tokens, j)) * jnp.uint32(ENGRAM_HASH_PRIME)
        acc = acc ^ (acc >> jnp.uint32(ENGRAM_HASH_SHIFT))
        rows.append((acc % jnp.uint32(slots)).astype(jnp.int32))
    return jnp.stack(rows, axis=-1)


def walsh_operand(config: NeedleConfig, dtype) -> jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]:
    """What the MLPs' `walsh_transform` reads, in ``dtype``: the [W, W] Walsh matrix or its Kronecker
    factors, as `specification_needle.walsh_operand_names` states."""
    n = config.hadamard_size
    a, b = walsh_factor_sizes(n)
    tables = {"walsh": n, "walsh_a": a, "walsh_b": b}
    names = walsh_operand_names(deploy_numerics=bool(config.deploy_numerics))
    operand = tuple(jnp.asarray(walsh_matrix(tables[name]), dtype) for name in names)
    return operand[0] if len(operand) == 1 else operand


def walsh_transform(z: jnp.ndarray, walsh) -> jnp.ndarray:
    """`z @ walsh_matrix(W)` over the last axis. ``walsh``: the [W, W] matrix, or its Kronecker factors
    (W_a [a, a], W_b [b, b]) (`numerics.walsh_factor_sizes`) for two small products (`walsh_operand`)."""
    if not isinstance(walsh, tuple):
        return z @ walsh
    walsh_a, walsh_b = walsh
    a, b = walsh_a.shape[0], walsh_b.shape[0]
    z = z.reshape(*z.shape[:-1], a, b) @ walsh_b  # [..., a, b]
    return (walsh_a @ z).reshape(*z.shape[:-2], a * b)  # W_a is symmetric: W_a^T Z = W_a Z
