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
the mean of their cell" in float64 (`needle_hf.numerics.gaussian_lloyd_max`, which the models'
deployment numerics share). Ternary (3 levels) uses the analytic {-c, 0, +c}, c = 1.2240064.

Every step is float32 numpy in the order written above (the same products and sums, so the same
roundings), on arrays laid out as the reference's exporter lays them out (see `cact_writer`), so
that no stride-dependent kernel choice can round differently. That is what makes the packed
indices and norms equal the reference's byte for byte.

Mixed precision ("bits maps") names tensors by a canonical prefix (`attn.q_proj`, `engram0.tables`,
`embedding`, `mhc_phi_pre`, ...); see `parse_bits_map`.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from needle_hf.numerics import CQ_WEIGHT_GROUP, cq_levels, walsh_matrix

from .cact import CODEBOOK_BITS, TERNARY_LEVEL, TERNARY_RECORD_BITS

DEFAULT_GROUP = CQ_WEIGHT_GROUP
# How bits maps and the reference spell ternary (log2(3), rounded).
TERNARY_BITS = 1.58
SUPPORTED_BITS = (*CODEBOOK_BITS, TERNARY_BITS)
# Level index of a ternary code -> the 2-bit field ("crumb") stored: sign-extended, 3 0 1 read as -1 0 +1.
_TERNARY_LEVEL_TO_CRUMB = np.array([3, 0, 1], np.uint32)


class BitsMapError(ValueError):
    """A bits-map specification that cannot be used; the message names the entry."""


@functools.cache
def levels_for(bits, group: int = DEFAULT_GROUP) -> np.ndarray:
    """The float32 level set of a width (2, 3, 4 or `TERNARY_BITS`) for groups of `group`."""
    if bits == TERNARY_BITS:
        unit = np.array([-TERNARY_LEVEL, 0.0, TERNARY_LEVEL])
    elif bits in CODEBOOK_BITS:
        return cq_levels(bits, group)
    else:
        raise ValueError(f"CQ width {bits}: expected one of {SUPPORTED_BITS} ({TERNARY_BITS} = ternary)")
    return (unit / np.sqrt(group)).astype(np.float32)


def header_codebooks(group: int = DEFAULT_GROUP) -> np.ndarray:
    """The codebooks a `.cact` header carries: the 2-, 3- and 4-bit level sets concatenated, float32."""
    return np.concatenate([levels_for(bits, group) for bits in CODEBOOK_BITS]).astype(np.float32)


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
    levels = levels_for(bits, group)
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


# --------------------------------------------------------------------------------------------------
# Bits maps.

# Rewrites, applied in order, that turn an exported tensor name ("layer03.q_proj",
# "engram0.tables") or a native parameter path ("stack/layers/block/self_attn/q_proj/kernel",
# "engrams_0/embedding") into the canonical name bits maps match on ("attn.q_proj", "engram0.tables").
_CANONICAL_REWRITES = (
    (re.compile(r"^layer\d+\."), "attn."),
    (re.compile(r"^engrams?_?(\d+)[./]?"), r"engram\1."),
    (re.compile(r"^stack/"), ""),
    (re.compile(re.escape("layers/block/self_attn/")), "attn."),
    (re.compile(re.escape("mtp_block/self_attn/")), "mtp."),
    (re.compile(r"/kernel$"), ""),
    (re.compile(r"^embedding/embedding$"), "embedding"),
    (re.compile(r"^(engram\d+\.)embedding$"), r"\1tables"),
    (re.compile("/"), "."),
)


def canonical_tensor_name(name: str) -> str:
    """The name a bits map matches against (see `_CANONICAL_REWRITES`)."""
    for pattern, replacement in _CANONICAL_REWRITES:
        name = pattern.sub(replacement, name)
    return name


def _width(text: str, entry: str):
    try:
        value = float(text)
    except ValueError:
        raise BitsMapError(f"bits map entry {entry!r}: width {text!r} is not a number") from None
    if value == TERNARY_BITS:
        return TERNARY_BITS
    if not value.is_integer() or "." in text.strip():
        raise BitsMapError(f"bits map entry {entry!r}: width {text!r}, expected one of 2, 3, 4 or {TERNARY_BITS}")
    return int(value)


def parse_bits_map(spec: str) -> tuple[dict, object]:
    """Parse "prefix=bits,...,default=bits" into ({canonical prefix: bits}, default bits).

    Prefixes may be canonical names ("attn.q_proj", "engram", "embedding", "mhc_phi") or native
    paths, which are canonicalised; a later entry for the same prefix replaces an earlier one.
    Widths: 2, 3, 4, or 1.58 for ternary. A `default` entry is required.
    """
    prefixes, default = {}, None
    for entry in str(spec or "").split(","):
        if not entry.strip():
            continue
        if "=" not in entry:
            raise BitsMapError(f"bits map {spec!r}: entry {entry.strip()!r} is not of the form name=bits")
        name, text = (part.strip() for part in entry.split("=", 1))
        width = _width(text, entry.strip())
        if width not in SUPPORTED_BITS:
            raise BitsMapError(f"bits map {spec!r}: width {width} for {name!r}, expected one of 2, 3, 4 or {TERNARY_BITS}")
        if name == "default":
            default = width
        else:
            prefixes[canonical_tensor_name(name)] = width
    if default is None:
        raise BitsMapError(f"bits map {spec!r} has no default=<bits> entry (every other tensor needs a width)")
    return prefixes, default


def bits_for(tensor_name: str, prefixes: dict, default):
    """The width of an exported tensor: the longest matching canonical prefix, else the default."""
    canonical = canonical_tensor_name(tensor_name)
    matches = [prefix for prefix in prefixes if canonical.startswith(prefix)]
    return prefixes[max(matches, key=len)] if matches else default
