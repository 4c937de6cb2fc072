"""Framework-free constants and tables shared by the Flax and PyTorch Needle models.

Only numpy: both modeling files import this (relatively, so it also travels as remote code).

Axis letters in shape comments and einsum strings: the legend of `specification_needle`.
"""

from __future__ import annotations

import functools
import re

import numpy as np

# Engram n-gram hash (FNV-style, 32-bit): table k starts from SEED * (k + 1), folds in each of the
# `order` most recent tokens with `(acc ^ token) * PRIME`, then mixes `acc ^= acc >> 15`.
ENGRAM_HASH_SEED = 0x9E3779B9
ENGRAM_HASH_PRIME = 0x01000193
ENGRAM_HASH_SHIFT = 15
UINT32_MASK = 0xFFFFFFFF

# Reference initial values (cactus-needle `architecture.py`); random draws are N(0, initializer_range),
# residual-stream projections (o_proj, engram value_proj) N(0, initializer_range / sqrt(2 * layers)).
NORM_WEIGHT_INIT = 0.0  # zero-centred norms: gain 1 + weight
ATTENTION_GATE_INIT = 0.0
HADAMARD_DIAG_IN_INIT = 1.0
HADAMARD_DIAG_HIDDEN_INIT = 1.0
HADAMARD_DIAG_OUT_INIT = 0.02
HYPER_CONNECTION_ALPHA_INIT = 0.01
HYPER_CONNECTION_RES_BIAS_INIT = 4.0  # res_bias = 4 * identity: lanes start (almost) unmixed
ENGRAM_FIRST_TAP_INIT = 1.0  # conv taps start as the identity: taps[0] = 1, the others 0
CONTRASTIVE_TEMPERATURE_INIT = 0.07  # log_temperature = log(0.07)

# Probe counts of the pooling heads (fixed by the architecture).
CONTRASTIVE_PROBES = 4
CONFIDENCE_PROBES = 8
# Epsilon of the contrastive embedding's L2 normalisation.
CONTRASTIVE_NORM_EPS = 1e-12

# The output head is the token embedding: `lm_head.weight` names the same tensor as
# `model.embed_tokens.weight` (tied, stored once), as {tied name: the tensor it shares}.
TIED_WEIGHTS = {"lm_head.weight": "model.embed_tokens.weight"}

# The attention projections of one input that a Flax decoding step runs as one product
# (`fused_projections`), in the order their outputs are concatenated.
FUSED_QKVG_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj")

# A whole prompt's attention (both twins) runs as blocks of this many query rows, each over the keys
# up to its last row: the keys after it are masked for every row of the block (causality), so
# their scores need not be made. 64 took 0.64-0.72x the time of one whole call at 300-485 tokens in
# PyTorch's CPU kernel, 0.84x at 1000 (one thread; 32 and 128 close).
CAUSAL_QUERY_ROWS = 64


def causal_query_blocks(length: int, rows: int = CAUSAL_QUERY_ROWS) -> list[tuple[int, int]]:
    """The blocks ``(start, end)`` of a ``length``-token prompt's query rows, in order: rows
    [start, end) attend over keys [0, end) (both twins' whole-prompt attention)."""
    return [(start, min(start + rows, length)) for start in range(0, length, rows)]

# Hyper-connection routing: rounds of log-space Sinkhorn normalisation (rows, then columns).
SINKHORN_ITERATIONS = 20
# Widest logit spread (max - min, in nats) of one lane-mixing matrix that the models' Sinkhorn
# normalises in linear space: with spread s every intermediate entry stays above exp(-2 s) / (n - 1)
# (row and column scalings never differ by more than exp(s)), for s = 30 about 3e-27, far above
# float32's smallest normal (1.2e-38). Wider logits take the log-space path.
SINKHORN_LINEAR_SPACE_MAX_SPREAD = 30.0
# Lane ownership offsets: layer i owns lane i mod lanes. Its pre-mix logit gets +4 on the own lane
# and -4 on the others; its post-mix logit 0 on the own lane and -4 on the others.
OWN_LANE_PRE_OFFSET = 4.0
OTHER_LANE_OFFSET = -4.0


def engram_table_seeds(num_orders: int, num_heads: int) -> list[int]:
    """Initial hash state of each table, table k = order_index * num_heads + head."""
    return [(ENGRAM_HASH_SEED * (k + 1)) & UINT32_MASK for k in range(num_orders * num_heads)]


def engram_table_orders(orders, num_heads: int) -> list[int]:
    """n-gram order of each table, in table order."""
    return [order for order in orders for _ in range(num_heads)]


def engram_indices_numpy(tokens: np.ndarray, orders, num_heads: int, slots: int) -> np.ndarray:
    """Hash-table rows [B, T, tables] for token ids [B, T] (tokens before the start count as 0).

    A plain numpy statement of the hash, used by tests to pin both frameworks down.
    """
    tokens = np.asarray(tokens).astype(np.uint64)
    out = []
    for seed, order in zip(engram_table_seeds(len(orders), num_heads), engram_table_orders(orders, num_heads)):
        acc = np.full(tokens.shape, seed, np.uint64)
        for j in range(order):
            shifted = np.zeros_like(tokens)
            shifted[:, j:] = tokens[:, : tokens.shape[1] - j] if j else tokens
            acc = ((acc ^ shifted) * ENGRAM_HASH_PRIME) & UINT32_MASK
        acc ^= acc >> ENGRAM_HASH_SHIFT
        out.append((acc % slots).astype(np.int64))
    return np.stack(out, axis=-1)


def walsh_matrix(n: int) -> np.ndarray:
    """Sylvester-ordered Walsh-Hadamard matrix [n, n] scaled by 1/sqrt(n) (orthonormal); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Walsh matrix size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def walsh_factor_sizes(n: int) -> tuple[int, int]:
    """(a, b) with a * b = n, a >= b, both powers of two: Sylvester's ``walsh_matrix(n)`` is the
    Kronecker product ``walsh_matrix(a) (x) walsh_matrix(b)``, so ``z @ walsh_matrix(n)`` is
    ``W_a^T Z W_b`` with Z = z reshaped [a, b] (both models' ``walsh_transform``): 2 n sqrt(n)
    multiply-adds instead of n^2, and no n x n matrix to read per token (1 MB for n = 512)."""
    a = 1 << (n.bit_length() // 2)
    return a, n // a


def rope_inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """inv_freq[i] = theta^(-2i / head_dim), float32 [head_dim // 2] (half-split RoPE)."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)


def hyper_connection_offsets(num_layers: int, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """(pre_offset, post_offset), each float32 [num_layers, lanes]."""
    own = np.eye(lanes, dtype=np.float32)[np.arange(num_layers) % lanes]
    pre = own * (OWN_LANE_PRE_OFFSET - OTHER_LANE_OFFSET) + OTHER_LANE_OFFSET
    post = (1.0 - own) * OTHER_LANE_OFFSET
    return pre.astype(np.float32), post.astype(np.float32)


# --------------------------------------------------------------------------------------------------
# Cactus-Quants (CQ) and the engine's deployment numerics (`NeedleConfig.deploy_numerics`).
# conversion/quantize.py states the CQ scheme; the models fake-quantise with these same constants.

# Lloyd-Max fit of the CQ level sets: samples of the legacy `RandomState(seed)` unit Gaussian, sorted,
# levels started at the sample quantiles (k + 1/2) / levels, then rounds of "boundaries at the
# midpoints, levels at the mean of their cell" in float64.
CQ_FIT_SAMPLES = 400_000
CQ_FIT_ROUNDS = 200
CQ_FIT_SEED = 0
# Group of consecutive inputs that share one float16 norm in a CQ weight record.
CQ_WEIGHT_GROUP = 128
# Group of a quantised KV-cache row (along head_dim, zero padded).
CQ_KV_GROUP = 64
# Smallest norm a CQ group is divided by.
CQ_NORM_FLOOR = 1e-12
# A KV cache this wide or wider is kept unquantised (int8 and up are exact enough for the engine).
KV_BITS_UNQUANTISED = 8
# CQ width of the weights when `weight_bits` names no map (the engine's default `.cact`).
DEFAULT_WEIGHT_BITS = 4
# Widths with a Lloyd-Max level set (the `.cact` header carries these, in this order), and ternary:
# spelled 1.58 (log2(3), rounded) in bits maps, levels {-c, 0, +c} / sqrt(group).
CQ_CODEBOOK_BITS = (2, 3, 4)
TERNARY_BITS = 1.58
TERNARY_LEVEL = 1.2240064
CQ_WEIGHT_BITS = (*CQ_CODEBOOK_BITS, TERNARY_BITS)
# HF parameter names (PyTorch layout) stored as CQ records: every projection, the token embedding
# and the engram tables; a projection's groups run along its input axis (the last axis in this layout).
CQ_WEIGHT_NAME_SUFFIXES = ("proj.weight", "embed_tokens.weight", ".tables")


@functools.cache
def gaussian_lloyd_max(bits: int) -> np.ndarray:
    """The 2**bits Lloyd-Max levels of a unit Gaussian, float64, increasing (read-only)."""
    count = 1 << bits
    samples = np.sort(np.random.RandomState(CQ_FIT_SEED).randn(CQ_FIT_SAMPLES))
    start = ((np.arange(count) + 0.5) / count * CQ_FIT_SAMPLES).astype(int)
    levels = samples[start].astype(np.float64)
    for _ in range(CQ_FIT_ROUNDS):
        # Samples are sorted, so each cell (midpoint_{k-1}, midpoint_k] is one contiguous run.
        edges = np.searchsorted(samples, (levels[:-1] + levels[1:]) / 2.0, side="right")
        bounds = np.concatenate([[0], edges, [CQ_FIT_SAMPLES]])
        for k in range(count):
            if bounds[k + 1] > bounds[k]:  # an empty cell keeps its level
                levels[k] = samples[bounds[k] : bounds[k + 1]].mean()
    levels = np.sort(levels)
    levels.flags.writeable = False
    return levels


@functools.cache
def cq_levels(bits, group: int) -> np.ndarray:
    """The float32, increasing CQ level set of a width (2, 3, 4 or `TERNARY_BITS`) for groups of `group` (read-only)."""
    if bits == TERNARY_BITS:
        unit = np.array([-TERNARY_LEVEL, 0.0, TERNARY_LEVEL])
    elif isinstance(bits, int) and bits >= 1:  # a KV cache may be 1..7 bits wide, weights 2..4
        unit = gaussian_lloyd_max(bits)
    else:
        raise ValueError(f"CQ width {bits}: expected one of {CQ_WEIGHT_BITS} ({TERNARY_BITS} = ternary)")
    levels = (unit / np.sqrt(group)).astype(np.float32)
    levels.flags.writeable = False
    return levels


@functools.cache
def cq_walsh_matrix(group: int) -> np.ndarray:
    """`walsh_matrix(group)`, computed once (read-only)."""
    matrix = walsh_matrix(group)
    matrix.flags.writeable = False
    return matrix


def is_cq_weight(hf_name: str) -> bool:
    """Whether the engine stores this parameter (HF name, PyTorch layout) as a CQ record."""
    return hf_name.endswith(CQ_WEIGHT_NAME_SUFFIXES)


def kv_cache_bits(config) -> int | None:
    """CQ width of the KV cache the deployed model runs with, or None when it is not quantised."""
    if config.deploy_numerics and config.kv_bits < KV_BITS_UNQUANTISED:
        return config.kv_bits
    return None


# --------------------------------------------------------------------------------------------------
# Bits maps: mixed-precision CQ widths, "prefix=bits,...,default=bits" (`NeedleConfig.weight_bits`,
# `needle-hf build --bits-map`). Entries name tensors by canonical name ("attn.q_proj",
# "engram0.tables", "embedding", "mhc_phi_pre", "mtp.q_proj") or group ("attn", "engram", "mhc_phi",
# `BITS_MAP_GROUPS`); a tensor takes the width of its longest matching name, else the default. `.cact` record names ("layer03.q_proj") and native
# parameter paths ("stack/layers/block/self_attn/q_proj/kernel") canonicalise to the same names, so
# one map means the same widths to the exporter and to QAT (`weight_names.cq_weight_bits`).


class BitsMapError(ValueError):
    """A bits-map specification that cannot be used; the message names the entry."""


# Rewrites, applied in order, that turn a `.cact` record name or a native parameter path into the
# canonical name bits maps match on.
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


# What a bits map may name: whole canonical tensor names of the CQ-stored weights, and the groups
# below. A group takes the tensors whose canonical name starts with it, as prefixes always have
# (`bits_for`); any other name is refused, so a typo never silently leaves a tensor at the default.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "out_proj")
BITS_MAP_TENSORS = (
    "embedding",
    *(f"attn.{name}" for name in _PROJECTIONS),
    "mhc_phi_pre", "mhc_phi_post", "mhc_phi_res",
    *(f"mtp.{name}" for name in _PROJECTIONS),
    "mtp_combine",
    "contrastive_head.proj", "confidence_head.proj",
)
ENGRAM_BITS_MAP_TENSORS = ("tables", "key_proj", "value_proj")  # engram<i>.<name>, one per site
BITS_MAP_GROUPS = {
    "attn": "every layer's five attention projections",
    "mhc_phi": "the three hyper-connection projections",
    "mtp": "the MTP block's projections and its combiner",
    "engram": "every engram site's tables and projections",
    "engram<i>": "engram site i's tables and projections",
    "contrastive_head": "the contrastive head's projection",
    "confidence_head": "the confidence head's projection",
}


def bits_map_names(engram_sites: int) -> tuple[str, ...]:
    """Every name a bits map of a model with `engram_sites` engram sites may use: groups, then tensors."""
    groups = [group for group in BITS_MAP_GROUPS if group != "engram<i>"]
    groups += [f"engram{site}" for site in range(engram_sites)]
    tensors = list(BITS_MAP_TENSORS)
    tensors += [f"engram{site}.{name}" for site in range(engram_sites) for name in ENGRAM_BITS_MAP_TENSORS]
    return (*groups, *tensors)


def parse_bits_map(spec: str, *, engram_sites: int) -> tuple[dict, object]:
    """Parse "name=bits,...,default=bits" into ({canonical name: bits}, default bits).

    Names are whole tensor names or groups (`bits_map_names` for a model with `engram_sites` engram
    sites), given canonically ("attn.q_proj", "engram", "engram0.tables", "embedding", "mhc_phi")
    or as native paths / `.cact` record names, which are canonicalised. Widths: 2, 3, 4, or 1.58 for
    ternary. A `default` entry is required; an empty map, an empty or unknown name and a name given
    twice are refused (`BitsMapError`, listing the valid names).
    """
    if not isinstance(spec, str):
        raise BitsMapError(f"bits map {spec!r}: expected a string \"name=bits,...,default=bits\"")
    names = bits_map_names(engram_sites)
    valid = {canonical_tensor_name(name) for name in names}  # the group "engram0" reads as "engram0."
    listed = f"valid names: {', '.join(names)} (or native paths of those tensors), and default"
    entries = [entry.strip() for entry in spec.split(",")]
    if not any(entries):
        raise BitsMapError(f"bits map {spec!r} is empty; expected \"name=bits,...,default=bits\" ({listed})")
    prefixes, default = {}, None
    for entry in entries:
        if not entry:
            raise BitsMapError(f"bits map {spec!r}: an empty entry (two commas in a row, or a comma at an end)")
        if "=" not in entry:
            raise BitsMapError(f"bits map {spec!r}: entry {entry!r} is not of the form name=bits")
        name, text = (part.strip() for part in entry.split("=", 1))
        if not name:
            raise BitsMapError(f"bits map {spec!r}: entry {entry!r} has an empty name; {listed}")
        width = _width(text, entry)
        if width not in CQ_WEIGHT_BITS:
            raise BitsMapError(f"bits map {spec!r}: width {width} for {name!r}, expected one of 2, 3, 4 or {TERNARY_BITS}")
        if name == "default":
            if default is not None:
                raise BitsMapError(f"bits map {spec!r}: default is given twice; {listed}")
            default = width
            continue
        canonical = canonical_tensor_name(name)
        if canonical not in valid:
            raise BitsMapError(f"bits map {spec!r}: unknown name {name!r}"
                               + (f" (read as {canonical!r})" if canonical != name else "") + f"; {listed}")
        if canonical in prefixes:
            raise BitsMapError(f"bits map {spec!r}: {name!r} is given twice; {listed}")
        prefixes[canonical] = width
    if default is None:
        raise BitsMapError(f"bits map {spec!r} has no default=<bits> entry (every other tensor needs a width)")
    return prefixes, default


def bits_for(tensor_name: str, prefixes: dict, default):
    """The width of a tensor (record name or native path): the longest matching canonical prefix, else the default."""
    canonical = canonical_tensor_name(tensor_name)
    matches = [prefix for prefix in prefixes if canonical.startswith(prefix)]
    return prefixes[max(matches, key=len)] if matches else default


def weight_bits_map(weight_bits: str, *, engram_sites: int) -> tuple[dict, object]:
    """(prefixes, default) of a config's `weight_bits`: its map, or every weight at `DEFAULT_WEIGHT_BITS`."""
    return parse_bits_map(weight_bits, engram_sites=engram_sites) if weight_bits else ({}, DEFAULT_WEIGHT_BITS)
