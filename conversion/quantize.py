"""Cactus-Quants (CQ) weight quantization, as the `.cact` format stores it, in numpy.

The decoding side lives in `cact.py`; this module is the encoding side and shares its constants.
A logical matrix [out, in] is quantized row by row in groups of `group` consecutive inputs (the
input axis zero-padded to a multiple of `group`):

    rotated = group_values @ H            # H: orthonormal Walsh-Hadamard matrix [group, group]
    norm    = ||rotated||_2               # stored as float16
    index   = nearest level of rotated / norm in the level set (ties go to the lower level)

The level sets are the Lloyd-Max quantizers of a unit Gaussian for 2, 3 and 4 bits, divided by
sqrt(group) (after the rotation a unit-norm group has entries of about that size). They are fitted
deterministically: 400,000 samples of the legacy `RandomState(0)` Gaussian, sorted, started at
the sample quantiles (k + 1/2) / levels, then 200 rounds of "boundaries at the midpoints, levels at
the mean of their cell" in float64 (`needle_hf.models.needle.numerics.gaussian_lloyd_max`, which the models'
deployment numerics share). Ternary (3 levels) uses the analytic {-c, 0, +c}, c = 1.2240064.

Widths, level sets and bits maps (`parse_bits_map`, `bits_for`) are shared with the models'
deployment numerics in `needle_hf.models.needle.numerics`, so a map means the same widths to `needle-hf build` and
to QAT.

Every step is float32 numpy in the order written above (the same products and sums, so the same
roundings), on arrays laid out as the reference's exporter lays them out (see `cact_writer`), so
that no stride-dependent kernel choice can round differently. That is what makes the packed
indices and norms equal the reference's byte for byte.
"""

from __future__ import annotations

import numpy as np

from needle_hf.models.needle.numerics import CQ_CODEBOOK_BITS, CQ_WEIGHT_GROUP, TERNARY_BITS, cq_levels, walsh_matrix

from .cact import TERNARY_RECORD_BITS

DEFAULT_GROUP = CQ_WEIGHT_GROUP
# Level index of a ternary code -> the 2-bit field ("crumb") stored: sign-extended, 3 0 1 read as -1 0 +1.
_TERNARY_LEVEL_TO_CRUMB = np.array([3, 0, 1], np.uint32)


def header_codebooks(group: int = DEFAULT_GROUP) -> np.ndarray:
    """The codebooks a `.cact` header carries: the 2-, 3- and 4-bit level sets concatenated, float32."""
    return np.concatenate([cq_levels(bits, group) for bits in CQ_CODEBOOK_BITS]).astype(np.float32)


def record_bits(bits) -> int:
    """The `bits` field of a CQ directory record (ternary is recorded as 5)."""
    return TERNARY_RECORD_BITS if bits == TERNARY_BITS else int(bits)


def _nearest_level(unit: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the nearest level for every entry; an exact tie goes to the lower level."""
    flat = unit.reshape(-1)
    upper = np.clip(np.searchsorted(levels, flat), 1, len(levels) - 1)
    below, above = levels[upper - 1], levels[upper]
    take_below = np.abs(flat - below) <= np.abs(flat - above)
    return np.where(take_below, upper - 1, upper).reshape(unit.shape).astype(np.uint32)


def _pack_fields(fields: np.ndarray, width: int) -> np.ndarray:
    """[rows, n] fields of `width` (<= 4) bits -> [rows, n * width / 8] bytes, one LSB-first bitstream
    per row. n is a multiple of 8: eight fields fill one little-endian word of `width` bytes."""
    rows, count = fields.shape
    eight = fields.reshape(rows, count // 8, 8).astype(np.uint32)
    words = np.bitwise_or.reduce(eight << (np.arange(8, dtype=np.uint32) * width), axis=-1)
    as_bytes = words.astype("<u4").view(np.uint8).reshape(rows, count // 8, 4)
    return np.ascontiguousarray(as_bytes[..., :width]).reshape(rows, count * width // 8)


def quantize_matrix(matrix: np.ndarray, bits, group: int = DEFAULT_GROUP) -> bytes:
    """The CQ record payload of a logical [out, in] matrix: packed indices, then float16 group norms.

    `matrix` must be laid out as the reference's exporter hands it over (its `bytes` then match).
    """
    levels = cq_levels(bits, group)
    weights = np.asarray(matrix, np.float32)
    rows, columns = weights.shape
    padding = (-columns) % group
    if padding:
        weights = np.pad(weights, ((0, 0), (0, padding)))
    padded = columns + padding
    groups = weights.reshape(rows, padded // group, group).astype(np.float32)  # [out, G, group]
    rotated = groups @ walsh_matrix(group)
    norms = np.sqrt((rotated**2).sum(axis=-1, keepdims=True))  # [out, G, 1]
    unit = rotated / np.maximum(norms, 1e-12)
    indices = _nearest_level(unit, levels).reshape(rows, padded)
    if bits == TERNARY_BITS:
        packed = _pack_fields(_TERNARY_LEVEL_TO_CRUMB[indices], 2)
    else:
        packed = _pack_fields(indices, int(bits))
    return packed.tobytes() + norms[:, :, 0].astype(np.float16).tobytes()
