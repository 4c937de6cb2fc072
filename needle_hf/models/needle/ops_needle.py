"""PyTorch Needle 2's numerical building blocks: norms, RoPE, Sinkhorn, the Walsh transform, the
engram hash and the architecture's constant tables.

Each is the PyTorch side of a helper `specification_needle` names (the Flax model defines the same
names with the same arguments in `ops_flax_needle`); shapes use its axis legend.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_torchdynamo_compiling

from .configuration_needle import NeedleConfig
from .numerics import (
    CAUSAL_QUERY_ROWS,
    ENGRAM_HASH_PRIME,
    ENGRAM_HASH_SHIFT,
    SINKHORN_ITERATIONS,
    SINKHORN_LINEAR_SPACE_MAX_SPREAD,
    UINT32_MASK,
    causal_query_blocks,
    engram_table_orders,
    engram_table_seeds,
    hyper_connection_offsets,
    rope_inverse_frequencies,
    walsh_factor_sizes,
    walsh_matrix,
)
from .norms_needle import rms_unit, zero_centred_rms_norm  # noqa: F401  (re-exported: the twin ops table)
from .specification_needle import walsh_operand_names


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE: ``[x1 cos - x2 sin, x2 cos + x1 sin]``, computed in float32.

    Written as ``x * cos + [-x2, x1] * sin`` with each table repeated over both halves: the same
    products and sums, bit for bit (negation is exact), in 5 tensor ops instead of 8.
    x: [B, heads, T, H] (N query or K key heads); cos, sin: [B, 1, T, H] float32 (each half the same).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def grouped_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    *,
    plain_causal: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` kernel with the key/value heads shared by their query groups
    (``enable_gqa``) instead of repeated: with a mask, transformers repeats them for every call, a
    copy of the whole cache per layer and step. The same numbers (PyTorch's CPU kernel groups the
    heads itself). Used on the CPU (`cpu_grouped_sdpa`).

    query: [B, N, T, H]; key, value: [B, K, S, H]; attention_mask: additive [B, 1, T, S'] (S' >= S).
    plain_causal: the mask is the plain causal one over S = T keys (`NeedleStepInputs.plain_causal`):
    query rows [a, a + CAUSAL_QUERY_ROWS) then run as one kernel call over keys [0, a + rows) only, so
    the keys above the diagonal are not read (PyTorch's CPU kernel takes keys in blocks of 512 and
    skips none in a prompt of a few hundred tokens). Masked keys weigh exactly 0 either way: the same
    numbers up to float32 summation order.
    Returns (output [B, T, N, H], None). Other keyword arguments of the interface are not read.
    """
    length = query.shape[2]
    options = dict(dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    if plain_causal and attention_mask is not None and key.shape[-2] == length > CAUSAL_QUERY_ROWS:
        blocks = [F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, :end], value[:, :, :end],
                                                 attn_mask=attention_mask[:, :, start:end, :end], **options)
                  for start, end in causal_query_blocks(length)]
        return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[-2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         is_causal=attention_mask is None and length > 1, **options)
    return out.transpose(1, 2).contiguous(), None


def cpu_grouped_sdpa(attention_interface: Callable, query: torch.Tensor, *, plain_causal: bool = False) -> Callable:
    """`grouped_sdpa_attention_forward` (told ``plain_causal``) in place of transformers' own ``sdpa``
    kernel for CPU tensors outside a traced graph; any other kernel (eager, flex, one registered under
    the name ``sdpa``) is returned unchanged."""
    if attention_interface is not sdpa_attention_forward or query.device.type != "cpu":
        return attention_interface
    if is_torchdynamo_compiling() or torch.compiler.is_exporting():
        return attention_interface
    return functools.partial(grouped_sdpa_attention_forward, plain_causal=plain_causal) if plain_causal \
        else grouped_sdpa_attention_forward


def rope_tables(position_ids: torch.Tensor, inverse_frequencies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 RoPE ``cos, sin`` [..., H] of integer ``position_ids`` [...], each half the same (see `apply_rotary`)."""
    angles = position_ids.float()[..., None] * inverse_frequencies  # [..., H / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cos(angles), torch.sin(angles)


def shift_right(x: torch.Tensor, offset: int) -> torch.Tensor:
    """``x[:, t - offset]`` along axis 1, zero (False) where ``t < offset``."""
    if offset == 0:
        return x
    filler = torch.zeros_like(x[:, :offset])
    return torch.cat([filler, x[:, : max(x.shape[1] - offset, 0)]], dim=1)[:, : x.shape[1]]


def log_space_sinkhorn(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """Sinkhorn normalisation of [..., L, L] float32 logits as the reference states it: each round
    subtracts the logsumexp over rows, then over columns; the result is ``exp`` of the final logits."""
    log_k = logits
    for _ in range(iterations):
        log_k = log_k - torch.logsumexp(log_k, dim=-1, keepdim=True)
        log_k = log_k - torch.logsumexp(log_k, dim=-2, keepdim=True)
    return torch.exp(log_k)


def sinkhorn(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """Doubly-stochastic [..., L, L] float32 matrices: `log_space_sinkhorn`, computed in linear space.

    Subtracting a row's logsumexp from its logits is dividing ``exp(logits)`` by the row's sum, so
    ``k = exp(logits - max)`` normalised by row sums, then column sums, per round, is the same
    computation in exact arithmetic. It takes 2 tensor ops per half-round instead of about 9 (a
    logsumexp is max, subtract, exp, sum, log, add, with infinity guards); the routing matrices are
    tiny ([B, T, 4, 4], 20 rounds in each of 27 layers), so op count is all their cost in decoding.

    Linear space could underflow where one matrix's logits spread far (see
    ``SINKHORN_LINEAR_SPACE_MAX_SPREAD``); such matrices take the log-space result. Run eagerly, the
    spread is read back to the host and log space is computed only when some matrix needs it; in a
    traced graph (`torch.compile`, `torch.export`) both are computed and `torch.where` picks per
    matrix, so the graph has no data-dependent branch. Either way each matrix gets the same numbers.

    Without autograd or tracing, a few CPU matrices (a decoding step's) take `_host_sinkhorn`: the
    same normalisation in float64 NumPy, within float32 rounding of the path above (a dozen tensor
    ops cost more than the whole loop on the host).
    """
    traced = is_torchdynamo_compiling() or torch.compiler.is_exporting()
    if not traced and _host_sinkhorn_applies(logits):
        host = _host_sinkhorn(logits.detach().numpy(), iterations)
        if host is not None:
            return torch.from_numpy(host)
    shifted = logits - logits.amax(dim=(-2, -1), keepdim=True)  # each matrix's largest logit at 0
    spread = -shifted.amin(dim=(-2, -1), keepdim=True)  # [..., 1, 1]
    if not traced and (not shifted.numel() or spread.max().item() <= SINKHORN_LINEAR_SPACE_MAX_SPREAD):
        return _linear_space_sinkhorn(shifted, iterations)
    if not traced and bool((spread > SINKHORN_LINEAR_SPACE_MAX_SPREAD).all()):
        return log_space_sinkhorn(logits, iterations)
    # Entries that underflow to 0 only occur in matrices that take the log-space result; the floor
    # keeps their (discarded) linear-space rows free of 0 / 0, so gradients through `where` stay finite.
    linear = _linear_space_sinkhorn(shifted, iterations, floor=torch.finfo(torch.float32).tiny)
    return torch.where(spread <= SINKHORN_LINEAR_SPACE_MAX_SPREAD, linear, log_space_sinkhorn(logits, iterations))


# Most matrices `_host_sinkhorn` takes: its cost grows with their number, the tensor ops' hardly.
HOST_SINKHORN_MAX_MATRICES = 16


def _host_sinkhorn_applies(logits: torch.Tensor) -> bool:
    """Whether ``logits`` [..., L, L] may take `_host_sinkhorn`: float32 on the CPU, no gradient
    recorded, at most `HOST_SINKHORN_MAX_MATRICES` matrices."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and not (logits.requires_grad and torch.is_grad_enabled())
        and 0 < logits.numel() <= HOST_SINKHORN_MAX_MATRICES * logits.shape[-1] * logits.shape[-2]
    )


def _host_sinkhorn(logits: np.ndarray, iterations: int) -> Union[np.ndarray, None]:
    """`sinkhorn` of float32 ``logits`` [..., L, L] in float64 NumPy as scaling vectors, or None where a
    matrix's spread exceeds ``SINKHORN_LINEAR_SPACE_MAX_SPREAD`` (those take the log-space path).

    With ``k = exp(logits - max)``, each round's matrix is ``diag(r) k diag(c)``: normalising rows
    sets ``r = 1 / (k c)``, normalising columns then sets ``c = 1 / (k^T r)`` (``c`` starts at ones).
    Two [L, L] x [L] products a round instead of normalising the whole matrix twice.
    """
    k = logits.astype(np.float64)
    k = k - k.max(axis=(-2, -1), keepdims=True)
    if -k.min() > SINKHORN_LINEAR_SPACE_MAX_SPREAD:
        return None
    k = np.exp(k)  # [..., L, L]
    k_t = np.swapaxes(k, -1, -2)
    c = np.ones(k.shape[:-1] + (1,))  # [..., L, 1] column scalings
    for _ in range(iterations):
        r = 1.0 / (k @ c)  # [..., L, 1] row scalings
        c = 1.0 / (k_t @ r)
    return (r * k * np.swapaxes(c, -1, -2)).astype(np.float32)


def _linear_space_sinkhorn(shifted: torch.Tensor, iterations: int, floor: float = 0.0) -> torch.Tensor:
    """Row then column normalisation of ``exp(shifted)`` (entries floored at ``floor``), ``iterations`` rounds."""
    k = torch.exp(shifted)
    if floor:
        k = k.clamp_min(floor)
    for _ in range(iterations):
        k = k / k.sum(dim=-1, keepdim=True)
        k = k / k.sum(dim=-2, keepdim=True)
    return k


def walsh_transform(z: torch.Tensor, walsh: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``z @ walsh_matrix(W)`` over the last axis. ``walsh``: the [W, W] matrix, or its Kronecker factors
    (W_a [a, a], W_b [b, b]) (`numerics.walsh_factor_sizes`) for two small products instead of one
    product with the matrix (`NeedleModel.walsh` picks which)."""
    if isinstance(walsh, torch.Tensor):
        return z @ walsh
    walsh_a, walsh_b = walsh
    a, b = walsh_a.shape[0], walsh_b.shape[0]
    z = z.reshape(*z.shape[:-1], a, b) @ walsh_b  # [..., a, b]
    return (walsh_a @ z).reshape(*z.shape[:-2], a * b)  # W_a is symmetric: W_a^T Z = W_a Z


def architecture_constant(name: str, config: NeedleConfig) -> np.ndarray:
    """A constant table of the architecture: ``walsh`` [W, W] (the MLPs' orthonormal Walsh-Hadamard
    matrix), ``walsh_a`` [a, a] and ``walsh_b`` [b, b] (its Kronecker factors,
    `numerics.walsh_factor_sizes`), ``rope_inverse_frequencies`` [H // 2], ``pre_offsets`` /
    ``post_offsets`` [layers, L] (hyper-connection lane ownership)."""
    if name == "walsh":
        return walsh_matrix(config.hadamard_size)
    if name in ("walsh_a", "walsh_b"):
        return walsh_matrix(walsh_factor_sizes(config.hadamard_size)[name == "walsh_b"])
    if name == "rope_inverse_frequencies":
        return rope_inverse_frequencies(config.head_dim, config.rope_theta)
    if name in ("pre_offsets", "post_offsets"):
        offsets = hyper_connection_offsets(config.num_hidden_layers, config.hyper_connection_lanes)
        return offsets[0] if name == "pre_offsets" else offsets[1]
    raise KeyError(f"no constant table named {name!r}")


def walsh_operand(
    config: NeedleConfig, table: Callable[[str], torch.Tensor]
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """What the MLPs' `walsh_transform` reads, from ``table(name)`` (an `architecture_constant`): the
    Kronecker factors (two small products, ~10x fewer multiply-adds than the [W, W] matrix), or with
    deploy numerics the matrix, whose order of summation the reference's 4-bit KV levels were rounded from."""
    operand = tuple(table(name) for name in walsh_operand_names(deploy_numerics=bool(config.deploy_numerics)))
    return operand[0] if len(operand) == 1 else operand


def lane_mean(lanes: torch.Tensor) -> torch.Tensor:
    """Mean over the hyper-connection lanes [B, T, L, D] -> [B, T, D], accumulated in float32."""
    return lanes.float().mean(dim=2).to(lanes.dtype)


def engram_hash_indices(tokens: torch.Tensor, orders, num_heads: int, slots: int) -> torch.Tensor:
    """Hash-table rows [B, T, tables] of the n-grams ending at each position (tokens before the start are 0).

    32-bit FNV-style hash in int64 arithmetic: a state below 2**32 times the prime stays below 2**63.
    All tables are hashed together (integer arithmetic, so exactly as one at a time): token ``t - back``
    is folded into the tables whose order exceeds ``back``.
    """
    tokens = tokens.long()
    device = tokens.device
    seeds = torch.tensor(engram_table_seeds(len(orders), num_heads), dtype=torch.long, device=device)  # [tables]
    table_orders = torch.tensor(engram_table_orders(orders, num_heads), device=device)  # [tables]
    acc = seeds.expand(*tokens.shape, -1)  # [B, T, tables]
    for back in range(max(orders)):
        folded = ((acc ^ shift_right(tokens, back)[..., None]) * ENGRAM_HASH_PRIME) & UINT32_MASK
        acc = folded if back < min(orders) else torch.where(table_orders > back, folded, acc)
    acc = acc ^ (acc >> ENGRAM_HASH_SHIFT)
    return acc % slots
