"""Reader of `.cact` blobs, the Needle 2 deployment format, back into a native parameter tree.

A `.cact` holds the whole model for the Cactus runtime: a 120-byte header with the geometry, the
shared Cactus-Quants codebooks, a directory of nameless records and 64-byte aligned tensor data.
The format is specified in the docstring of the reference's `needle/model/export.py`; in brief
(all little-endian):

    header     29 x u32 + f32: tag 0x05E12A83, num_tensors, codebook_len, kv_window, kv_bits,
               vocab, d_model, num_heads, num_kv_heads, num_layers, head_dim, max_seq_len,
               hada_n, mhc_lanes, engram_slots, engram_sub_dim, num_engram_tables,
               engram_conv_taps, engram_conv_dilation, num_orders, orders[4], num_sites,
               sites[4], rope_theta (f32)
    codebooks  codebook_len x f32: the 2-, 3- and 4-bit level sets (4 | 8 | 16), already divided
               by sqrt(group)
    directory  num_tensors x 44 bytes: u8 dtype, u8 ndim, u16 pad, u32 shape[4], u64 offset,
               u64 nbytes, u32 group, u32 bits; dtype 1 FP16, 2 FP32, 3 CQ, 4 RAW
    data       one blob per record, each starting at a multiple of 64

Records are positional: embedding; per layer [norm_in, q, k, v, q_norm, k_norm, gate, out,
post_norm, attn_gate, pre_hada, d1, d2, d3]; the nine hyper-connection tensors (a, b, then phi
for pre, post, res); per engram site [tables, key_proj, value_proj, taps]; final_norm; optionally
a heads manifest and one (probes, proj, bias) triple per head; optionally the RAW tokenizer.

Matrices are stored transposed to [out, in] (the reduction axis contiguous). A CQ matrix is
quantized in groups of `group` consecutive inputs of a row, the input axis zero-padded to a
multiple of `group`: each group is stored as `group` codebook indices packed LSB-first into one
bitstream per row (`bits` bits each), followed by all groups' L2 norms in float16. A group is
rebuilt as `(levels[idx] * norm) @ H`, H the orthonormal Walsh-Hadamard matrix of size `group`.
Record bits 5 means ternary: 2-bit fields ("crumbs") 3, 0, 1 for the levels -c, 0, +c, with
c = 1.2240064 / sqrt(group) (the three-level Lloyd-Max quantizer of a unit Gaussian).

The lossy part is the quantization itself; reading it back is exact, so `read_cact` reproduces
the reference's own dequantization. What the blob does not hold: the multi-token-prediction head
(never exported) and the contrastive head's `log_temp` (a training-only temperature, filled with
the reference's initial value and listed in `CactModel.filled_defaults`).

Two choices the specification leaves open:
- The contrastive head has no bias in the reference, and the exporter writes zeros in its slot.
  A non-zero bias would shift the embeddings and has no place in the model, so it is refused
  (`CactFormatError`) rather than dropped.
- CQ levels are read from the header, which holds one set, scaled by 1/sqrt(group) for the group
  size of the export. Blobs whose 2-4-bit records use more than one group size are refused.
  (Ternary levels are analytic, so ternary records may use any group size.)
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from needle_hf.models.needle.numerics import CQ_CODEBOOK_BITS, TERNARY_BITS, cq_levels, walsh_matrix

CACT_TAG = 0x05E12A83
HEADER = struct.Struct("<29If")
RECORD = struct.Struct("<BBHIIIIQQII")
BLOB_ALIGNMENT = 64

FP16, FP32, CQ, RAW = 1, 2, 3, 4
DTYPE_NAMES = {FP16: "FP16", FP32: "FP32", CQ: "CQ", RAW: "RAW"}

# Header codebooks: the level sets for these widths, concatenated in this order.
CODEBOOK_BITS = CQ_CODEBOOK_BITS
CODEBOOK_LENGTH = sum(1 << bits for bits in CODEBOOK_BITS)
TERNARY_RECORD_BITS = 5
# Ternary crumb value -> level index in (-c, 0, +c); crumb 2 is never written.
_TERNARY_CRUMB_TO_LEVEL = np.array([1, 2, -1, 0], np.int8)
CQ_RECORD_BITS = (2, 3, 4, TERNARY_RECORD_BITS)

# The architecture's fixed engram convolution width.
ENGRAM_CONV_TAPS = 4
# KV-cache widths a blob may ask for: 2-4 bit CQ, or 8 and up (the reference treats >= 8 as int8).
QUANTIZED_KV_BITS = (2, 3, 4)
MAX_ORDERS = MAX_SITES = 4

# Upper bound on every header size: far above any Needle model, low enough that nothing sized by a
# header field is built before the records it implies are checked against the file.
MAX_GEOMETRY_VALUE = 1 << 24
# Largest CQ group (the reference exports 128): its Walsh matrix (group^2 float32) stays at 4 MiB.
MAX_CQ_GROUP = 1024
# Records per layer and around the layers (embedding; 3 + 3 + 3 hyper-connection tensors; final_norm).
RECORDS_PER_LAYER = 14
RECORDS_OUTSIDE_LAYERS = 11
RECORDS_PER_ENGRAM_SITE = 4

# Probe heads: manifest code -> (native subtree, probes).
HEAD_CODES = {1: ("contrastive_head", 4), 2: ("confidence_head", 8)}
# The contrastive head's training temperature is not exported; the reference initialises it to log(0.07).
CONTRASTIVE_LOG_TEMP_INIT = math.log(0.07)

# RAW tokenizer blob: header (n_pieces, pad, eos, bos, unk, add_dummy_prefix, byte_fallback, pad)
# and one (score, type, surface length) record per piece, followed by the surface's UTF-8 bytes.
TOKENIZER_HEADER = struct.Struct("<IIIIIBBH")
TOKENIZER_PIECE = struct.Struct("<fBH")
PIECE_TYPES = {0: "normal", 1: "unknown", 2: "control", 3: "user_defined", 4: "byte"}


class CactFormatError(ValueError):
    """The file is not a well-formed `.cact` blob; the message names what is wrong and where."""


@dataclass(frozen=True)
class CactGeometry:
    """The header of a `.cact` blob (names as in the format's specification)."""

    num_tensors: int
    codebook_len: int
    kv_window: int
    kv_bits: int
    vocab_size: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    head_dim: int
    max_seq_len: int
    hada_n: int
    mhc_lanes: int
    engram_slots: int
    engram_sub_dim: int
    num_engram_tables: int
    engram_conv_taps: int
    engram_conv_dilation: int
    engram_orders: tuple[int, ...]
    engram_layers: tuple[int, ...]
    rope_theta: float

    @property
    def attn_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def engram_heads(self) -> int:
        return self.num_engram_tables // len(self.engram_orders)


@dataclass(frozen=True)
class CactRecord:
    """One directory record, with the name of the tensor it holds at its position."""

    index: int
    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    group: int
    bits: int

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, f"unknown({self.dtype})")


@dataclass
class CactModel:
    """A `.cact` blob read back into native (reference) form.

    Attributes:
        geometry: the header.
        config: a native config dict for `NeedleConfig.from_needle_config` (pass
            `use_mtp_head=False`: a blob has no MTP weights).
        params: the native parameter tree (float32), as the reference's Flax tree minus `mtp_*`.
        tokenizer_table: the parsed piece table (see `parse_tokenizer_table`) or None.
        records: the directory, in blob order.
        heads: native names of the probe heads present, in manifest order.
        filled_defaults: native paths not stored in the blob and filled with the reference's
            initial value (only the contrastive head's `log_temp`).
    """

    geometry: CactGeometry
    config: dict
    params: dict
    tokenizer_table: dict | None
    records: tuple[CactRecord, ...]
    heads: tuple[str, ...] = ()
    filled_defaults: tuple[str, ...] = field(default_factory=tuple)


# --------------------------------------------------------------------------------------------------
# Detection and header.


def is_cact(path) -> bool:
    """Whether the file at `path` starts with the `.cact` tag."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == struct.pack("<I", CACT_TAG)


def _fail(source, message):
    raise CactFormatError(f"{source}: {message}")


def _parse_geometry(data: bytes, source) -> CactGeometry:
    if len(data) < 4:
        _fail(source, f"not a .cact blob: {len(data)} byte(s), too short even for the tag 0x{CACT_TAG:08X}")
    if data[:4] != struct.pack("<I", CACT_TAG):
        _fail(source, f"not a .cact blob: tag 0x{struct.unpack_from('<I', data)[0]:08X}, expected 0x{CACT_TAG:08X}")
    if len(data) < HEADER.size:
        _fail(source, f"truncated: {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    fields = HEADER.unpack_from(data, 0)
    (_, num_tensors, codebook_len, kv_window, kv_bits, vocab, d_model, num_heads, num_kv_heads, num_layers,
     head_dim, max_seq_len, hada_n, lanes, slots, sub_dim, tables, taps, dilation) = fields[:19]
    num_orders, orders4, num_sites, sites4, rope_theta = fields[19], fields[20:24], fields[24], fields[25:29], fields[29]
    if not 1 <= num_orders <= MAX_ORDERS:
        _fail(source, f"header: num_engram_orders {num_orders}, expected 1..{MAX_ORDERS}")
    if num_sites > MAX_SITES:
        _fail(source, f"header: num_engram_sites {num_sites}, expected at most {MAX_SITES}")
    geometry = CactGeometry(
        num_tensors=num_tensors, codebook_len=codebook_len, kv_window=kv_window, kv_bits=kv_bits,
        vocab_size=vocab, d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads,
        num_layers=num_layers, head_dim=head_dim, max_seq_len=max_seq_len, hada_n=hada_n, mhc_lanes=lanes,
        engram_slots=slots, engram_sub_dim=sub_dim, num_engram_tables=tables, engram_conv_taps=taps,
        engram_conv_dilation=dilation, engram_orders=tuple(orders4[:num_orders]),
        engram_layers=tuple(sites4[:num_sites]), rope_theta=float(rope_theta),
    )
    _check_geometry(geometry, source)
    return geometry


def _check_geometry(g: CactGeometry, source):
    positive = ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "head_dim", "max_seq_len",
                "mhc_lanes", "engram_slots", "engram_sub_dim", "num_engram_tables")
    for name in positive:
        if not 0 < getattr(g, name) <= MAX_GEOMETRY_VALUE:
            _fail(source, f"header: {name} is {getattr(g, name)}, expected 1..{MAX_GEOMETRY_VALUE}")
    if g.kv_window > MAX_GEOMETRY_VALUE:
        _fail(source, f"header: kv_window is {g.kv_window}, expected 0..{MAX_GEOMETRY_VALUE}")
    checks = [
        (g.codebook_len == CODEBOOK_LENGTH,
         f"codebook_len {g.codebook_len}, expected {CODEBOOK_LENGTH} (levels for bits {CODEBOOK_BITS})"),
        (g.num_heads % g.num_kv_heads == 0, f"num_kv_heads {g.num_kv_heads} does not divide num_heads {g.num_heads}"),
        (g.head_dim % 2 == 0, f"head_dim {g.head_dim} is odd (RoPE rotates half-dimensions)"),
        (g.hada_n == 1 << (g.d_model - 1).bit_length(),
         f"hada_n {g.hada_n}, expected {1 << (g.d_model - 1).bit_length()} (next power of two >= d_model {g.d_model})"),
        (all(order >= 1 for order in g.engram_orders), f"engram_orders {g.engram_orders} must be >= 1"),
        (g.num_engram_tables % len(g.engram_orders) == 0,
         f"num_engram_tables {g.num_engram_tables} is not a multiple of the {len(g.engram_orders)} engram orders"),
        (g.engram_sub_dim == g.d_model // g.num_engram_tables,
         f"engram_sub_dim {g.engram_sub_dim}, expected d_model // num_engram_tables = {g.d_model // g.num_engram_tables}"),
        (g.engram_conv_taps == ENGRAM_CONV_TAPS, f"engram_conv_taps {g.engram_conv_taps}, expected {ENGRAM_CONV_TAPS}"),
        (g.engram_conv_dilation == max(g.engram_orders),
         f"engram_conv_dilation {g.engram_conv_dilation}, expected max(engram_orders) = {max(g.engram_orders)}"),
        (len(set(g.engram_layers)) == len(g.engram_layers) and all(s < g.num_layers for s in g.engram_layers),
         f"engram sites {g.engram_layers} must be distinct layers below num_layers {g.num_layers}"),
        (g.kv_bits in QUANTIZED_KV_BITS or g.kv_bits >= 8, f"kv_bits {g.kv_bits}, expected 2, 3, 4 or >= 8"),
        (math.isfinite(g.rope_theta) and g.rope_theta > 0, f"rope_theta {g.rope_theta} is not a positive number"),
    ]
    for ok, message in checks:
        if not ok:
            _fail(source, f"header: {message}")


def _parse_codebooks(data: bytes, g: CactGeometry, source) -> dict[int, np.ndarray]:
    end = HEADER.size + 4 * g.codebook_len
    if len(data) < end:
        _fail(source, f"truncated: the codebooks end at byte {end}, the file has {len(data)} bytes")
    flat = np.frombuffer(data, "<f4", g.codebook_len, HEADER.size).astype(np.float32)
    codebooks, start = {}, 0
    for bits in CODEBOOK_BITS:
        levels = flat[start : start + (1 << bits)]
        start += 1 << bits
        if not (np.all(np.isfinite(levels)) and np.all(np.diff(levels) > 0)):
            _fail(source, f"header: the {bits}-bit codebook {levels.tolist()} is not finite and strictly increasing")
        codebooks[bits] = levels
    return codebooks


# --------------------------------------------------------------------------------------------------
# The positional layout: which tensor each record holds and the shape it must have.


@dataclass(frozen=True)
class _Slot:
    name: str
    shape: tuple  # stored shape; None marks a width the header does not fix (a head's output width)


def _layer_slots(g: CactGeometry, layer: int) -> list[_Slot]:
    d, a, kv, hd, n = g.d_model, g.attn_dim, g.num_kv_heads * g.head_dim, g.head_dim, g.hada_n
    shapes = (("norm_in", (d,)), ("q_proj", (a, d)), ("k_proj", (kv, d)), ("v_proj", (kv, d)),
              ("q_norm", (hd,)), ("k_norm", (hd,)), ("gate_proj", (a, d)), ("out_proj", (d, a)),
              ("post_norm", (d,)), ("attn_gate", (1,)), ("pre_hada", (d,)), ("d1", (n,)), ("d2", (n,)), ("d3", (n,)))
    return [_Slot(f"layer{layer:02d}.{name}", shape) for name, shape in shapes]


def _backbone_slots(g: CactGeometry) -> list[_Slot]:
    """Every record from the embedding through final_norm."""
    layers, lanes, d = g.num_layers, g.mhc_lanes, g.d_model
    slots = [_Slot("embedding", (g.vocab_size, d))]
    for layer in range(layers):
        slots += _layer_slots(g, layer)
    slots += [_Slot(f"mhc_a_{kind}", (layers,)) for kind in ("pre", "post", "res")]
    slots += [_Slot("mhc_b_pre", (layers, lanes)), _Slot("mhc_b_post", (layers, lanes)),
              _Slot("mhc_b_res", (layers, lanes, lanes))]
    # phi (L, lanes*d, outputs) is stored as rows (L*outputs, lanes*d).
    slots += [_Slot("mhc_phi_pre", (layers * lanes, lanes * d)), _Slot("mhc_phi_post", (layers * lanes, lanes * d)),
              _Slot("mhc_phi_res", (layers * lanes * lanes, lanes * d))]
    engram_dim = g.num_engram_tables * g.engram_sub_dim
    for site in range(len(g.engram_layers)):
        slots += [
            _Slot(f"engram{site}.tables", (g.num_engram_tables * g.engram_slots, g.engram_sub_dim)),
            _Slot(f"engram{site}.key_proj", (d, engram_dim)),
            _Slot(f"engram{site}.value_proj", (d, engram_dim)),
            _Slot(f"engram{site}.taps", (g.engram_conv_taps, d)),
        ]
    slots.append(_Slot("final_norm", (d,)))
    return slots


def _head_slots(g: CactGeometry, codes: list[int]) -> list[_Slot]:
    slots = [_Slot("heads.manifest", (len(codes),))]
    for code in codes:
        name, probes = HEAD_CODES[code]
        out = None if name == "contrastive_head" else 1
        slots += [_Slot(f"{name}.probes", (probes, g.d_model)), _Slot(f"{name}.proj", (out, probes * g.d_model)),
                  _Slot(f"{name}.bias", (out,))]
    return slots


# --------------------------------------------------------------------------------------------------
# Directory and record checks.


def _read_directory(data: bytes, g: CactGeometry, source) -> tuple[list[tuple], int]:
    start = HEADER.size + 4 * g.codebook_len
    end = start + RECORD.size * g.num_tensors
    if len(data) < end:
        _fail(source, f"truncated: the directory of {g.num_tensors} records ends at byte {end}, "
                      f"the file has {len(data)} bytes")
    return [RECORD.unpack_from(data, start + i * RECORD.size) for i in range(g.num_tensors)], end


def _record(index: int, name: str, raw: tuple, source) -> CactRecord:
    dtype, ndim, _pad, *shape4, offset, nbytes, group, bits = raw
    if ndim > len(shape4):
        _fail(source, f"record {index} ({name}): ndim {ndim}, the directory holds at most {len(shape4)} dimensions")
    return CactRecord(index, name, dtype, tuple(shape4[:ndim]), offset, nbytes, group, bits)


def _cq_row_bytes(in_padded: int, bits: int) -> int:
    return in_padded * (2 if bits == TERNARY_RECORD_BITS else bits) // 8


def _expected_nbytes(rec: CactRecord, where: str) -> int:
    count = math.prod(rec.shape)
    if rec.dtype == FP16:
        return 2 * count
    if rec.dtype == FP32:
        return 4 * count
    # CQ
    if len(rec.shape) != 2:
        raise CactFormatError(f"{where}: a CQ record must be a 2-D [out, in] matrix, has shape {rec.shape}")
    if rec.bits not in CQ_RECORD_BITS:
        raise CactFormatError(f"{where}: CQ bits {rec.bits}, expected one of {CQ_RECORD_BITS} (5 = ternary)")
    if rec.group < 8 or rec.group & (rec.group - 1) or rec.group > MAX_CQ_GROUP:
        raise CactFormatError(f"{where}: CQ group size {rec.group}, expected a power of two in 8..{MAX_CQ_GROUP}")
    rows, columns = rec.shape
    in_padded = -(-columns // rec.group) * rec.group
    return rows * _cq_row_bytes(in_padded, rec.bits) + rows * (in_padded // rec.group) * 2


def _check_record(rec: CactRecord, slot: _Slot | None, file_size: int, data_start: int, source):
    """`slot` None means the record must be the RAW tokenizer."""
    where = f"{source}: record {rec.index} ({rec.name})"
    if rec.dtype not in DTYPE_NAMES:
        raise CactFormatError(f"{where}: unknown dtype code {rec.dtype} (known: "
                              + ", ".join(f"{code} {name}" for code, name in DTYPE_NAMES.items()) + ")")
    if slot is None:
        if rec.dtype != RAW:
            raise CactFormatError(f"{where}: expected the RAW tokenizer, found a {rec.dtype_name} record")
    else:
        if rec.dtype == RAW:
            raise CactFormatError(f"{where}: RAW record where a tensor belongs (only the last record may be RAW)")
        expected = slot.shape
        if len(rec.shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, rec.shape)):
            shown = tuple("?" if e is None else e for e in expected)
            raise CactFormatError(f"{where}: shape {rec.shape}, expected {shown} from the header geometry")
        if any(s == 0 for s in rec.shape):
            raise CactFormatError(f"{where}: empty shape {rec.shape}")
        size = _expected_nbytes(rec, where)
        if rec.nbytes != size:
            detail = f" at {rec.bits} bits, group {rec.group}" if rec.dtype == CQ else ""
            raise CactFormatError(f"{where}: {rec.nbytes} bytes, expected {size} for a {rec.dtype_name} {rec.shape}{detail}")
    if rec.offset % BLOB_ALIGNMENT:
        raise CactFormatError(f"{where}: offset {rec.offset} is not {BLOB_ALIGNMENT}-byte aligned")
    if rec.offset < data_start:
        raise CactFormatError(f"{where}: offset {rec.offset} points into the header/directory, which ends at {data_start} "
                              "(a corrupt offset, or a wrong num_tensors in the header)")
    if rec.offset + rec.nbytes > file_size:
        raise CactFormatError(f"{where}: bytes [{rec.offset}, {rec.offset + rec.nbytes}) lie past the end of the "
                              f"file ({file_size} bytes); the blob is truncated or the offset is corrupt")


def _check_no_overlap(records: list[CactRecord], data: bytes, source):
    ordered = sorted(records, key=lambda r: r.offset)
    for before, after in zip(ordered, ordered[1:]):
        if before.offset + before.nbytes > after.offset:
            _fail(source, f"records {before.index} ({before.name}) and {after.index} ({after.name}) overlap")
    end = ordered[-1].offset + ordered[-1].nbytes
    trailing = data[end:]
    if len(trailing) >= BLOB_ALIGNMENT or trailing.strip(b"\0"):
        _fail(source, f"{len(trailing)} byte(s) after the last record (which ends at {end}) belong to no record; "
                      f"the header's num_tensors {len(records)} is too small or the file has trailing data")


def _layout(data: bytes, g: CactGeometry, raw_records: list[tuple], data_start: int, source) -> tuple[list[CactRecord], list[int]]:
    """Name every record after its position and check it; returns (records, head codes)."""
    count = g.num_tensors
    # Counted before the slots are listed: the directory (which fits in the file) bounds the list.
    backbone_count = RECORDS_OUTSIDE_LAYERS + RECORDS_PER_LAYER * g.num_layers + RECORDS_PER_ENGRAM_SITE * len(g.engram_layers)
    has_tokenizer = count > backbone_count and raw_records[-1][0] == RAW
    extra = count - backbone_count - int(has_tokenizer)
    if extra < 0 or (extra and (extra < 4 or (extra - 1) % 3)):
        _fail(source, f"header says {count} tensors, which does not fit a model with {g.num_layers} layers and "
                      f"{len(g.engram_layers)} engram sites: {backbone_count} backbone tensors, then optionally a "
                      f"heads manifest with 3 tensors per head, then optionally the RAW tokenizer")
    backbone = _backbone_slots(g)
    records = [_record(i, slot.name, raw_records[i], source) for i, slot in enumerate(backbone)]
    for rec, slot in zip(records, backbone):
        _check_record(rec, slot, len(data), data_start, source)
    codes: list[int] = []
    if extra:
        num_heads = (extra - 1) // 3
        manifest = _record(len(backbone), "heads.manifest", raw_records[len(backbone)], source)
        _check_record(manifest, _Slot("heads.manifest", (num_heads,)), len(data), data_start, source)
        values = _decode_float(data, manifest)
        codes = [int(v) for v in values]
        if (not np.array_equal(values, np.asarray(codes, np.float32)) or any(c not in HEAD_CODES for c in codes)
                or codes != sorted(set(codes))):
            _fail(source, f"record {manifest.index} (heads.manifest): head codes {values.tolist()}, expected "
                          f"distinct increasing codes from {sorted(HEAD_CODES)} (1 contrastive, 2 confidence)")
    tail_slots = (_head_slots(g, codes) if codes else []) + ([None] if has_tokenizer else [])
    for index, slot in enumerate(tail_slots, start=len(backbone)):
        rec = _record(index, "tokenizer" if slot is None else slot.name, raw_records[index], source)
        _check_record(rec, slot, len(data), data_start, source)
        records.append(rec)
    _check_no_overlap(records, data, source)
    return records, codes


# --------------------------------------------------------------------------------------------------
# Decoding.


def _decode_float(data: bytes, rec: CactRecord) -> np.ndarray:
    dtype = "<f2" if rec.dtype == FP16 else "<f4"
    count = math.prod(rec.shape)
    return np.frombuffer(data, dtype, count, rec.offset).astype(np.float32).reshape(rec.shape)


def _unpack_fields(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    """[rows, bytes] LSB-first bitstreams -> [rows, count] unsigned fields of `width` (<= 4) bits.

    Eight consecutive fields fill exactly `width` bytes; read those as one little-endian word
    (zero-extended to 32 bits) and shift each field out of it. `count` is a multiple of 8.
    """
    rows = packed.shape[0]
    chunks = packed.reshape(rows, count // 8, width)
    words = np.zeros((rows, count // 8, 4), np.uint8)
    words[..., :width] = chunks
    words = words.view("<u4")  # [rows, count // 8, 1]
    shifts = np.arange(0, 8 * width, width, dtype=np.uint32)
    fields = (words >> shifts) & np.uint32((1 << width) - 1)  # [rows, count // 8, 8]
    return fields.astype(np.uint8).reshape(rows, count)


def _decode_cq(data: bytes, rec: CactRecord, codebooks: dict[int, np.ndarray], source) -> np.ndarray:
    rows, columns = rec.shape
    group = rec.group
    in_padded = -(-columns // group) * group
    groups = in_padded // group
    row_bytes = _cq_row_bytes(in_padded, rec.bits)
    packed = np.frombuffer(data, np.uint8, rows * row_bytes, rec.offset).reshape(rows, row_bytes)
    norms = np.frombuffer(data, "<f2", rows * groups, rec.offset + rows * row_bytes).astype(np.float32)
    if rec.bits == TERNARY_RECORD_BITS:
        crumbs = _unpack_fields(packed, 2, in_padded)
        indices = _TERNARY_CRUMB_TO_LEVEL[crumbs]
        if np.any(indices < 0):
            _fail(source, f"record {rec.index} ({rec.name}): ternary crumb value 2, which the format never writes")
        levels = cq_levels(TERNARY_BITS, group)
    else:
        indices = _unpack_fields(packed, rec.bits, in_padded)
        levels = codebooks[rec.bits]
    unit = levels[indices].reshape(rows, groups, group)  # [out, groups, group]
    rotated = unit * norms.reshape(rows, groups, 1)
    weights = (rotated @ walsh_matrix(group)).reshape(rows, in_padded)  # H is symmetric and orthonormal
    return np.ascontiguousarray(weights[:, :columns])


def _decode(data: bytes, rec: CactRecord, codebooks, source) -> np.ndarray:
    values = _decode_cq(data, rec, codebooks, source) if rec.dtype == CQ else _decode_float(data, rec)
    if not np.all(np.isfinite(values)):
        _fail(source, f"record {rec.index} ({rec.name}): non-finite values")
    return values


def parse_tokenizer_table(blob: bytes, *, expected_pieces: int | None = None, where: str = "tokenizer") -> dict:
    """Parse the RAW tokenizer record into a piece table.

    Returns:
        dict with `pieces` (list[str]), `scores` (list[float]), `types` (list[int]: 0 normal,
        1 unknown, 2 control, 3 user-defined, 4 byte), `pad_id`, `eos_id`, `bos_id`, `unk_id`,
        `add_dummy_prefix`, `byte_fallback`.
    """
    if len(blob) < TOKENIZER_HEADER.size:
        raise CactFormatError(f"{where}: {len(blob)} bytes, shorter than its {TOKENIZER_HEADER.size}-byte header")
    count, pad, eos, bos, unk, dummy, byte_fallback, _ = TOKENIZER_HEADER.unpack_from(blob, 0)
    if expected_pieces is not None and count != expected_pieces:
        raise CactFormatError(f"{where}: {count} pieces, expected the vocabulary size {expected_pieces}")
    for name, token in (("pad", pad), ("eos", eos), ("bos", bos), ("unk", unk)):
        if token >= count:
            raise CactFormatError(f"{where}: {name} id {token} is outside the {count} pieces")
    pieces, scores, types = [], [], []
    offset = TOKENIZER_HEADER.size
    for piece_id in range(count):
        if offset + TOKENIZER_PIECE.size > len(blob):
            raise CactFormatError(f"{where}: piece {piece_id} starts past the end of the record ({len(blob)} bytes)")
        score, kind, length = TOKENIZER_PIECE.unpack_from(blob, offset)
        offset += TOKENIZER_PIECE.size
        if kind not in PIECE_TYPES:
            raise CactFormatError(f"{where}: piece {piece_id} has unknown type {kind}")
        if offset + length > len(blob):
            raise CactFormatError(f"{where}: piece {piece_id} text runs past the end of the record")
        try:
            pieces.append(blob[offset : offset + length].decode("utf-8"))
        except UnicodeDecodeError as error:
            raise CactFormatError(f"{where}: piece {piece_id} is not valid UTF-8 ({error})") from None
        scores.append(float(score))
        types.append(kind)
        offset += length
    if offset != len(blob):
        raise CactFormatError(f"{where}: {len(blob) - offset} unexpected byte(s) after the last piece")
    return {"pieces": pieces, "scores": scores, "types": types, "pad_id": pad, "eos_id": eos, "bos_id": bos,
            "unk_id": unk, "add_dummy_prefix": bool(dummy), "byte_fallback": bool(byte_fallback)}


def _read(path) -> tuple[CactGeometry, list[CactRecord], list[int], bytes, dict]:
    path = Path(path)
    data = path.read_bytes()
    geometry = _parse_geometry(data, path)
    codebooks = _parse_codebooks(data, geometry, path)
    raw_records, data_start = _read_directory(data, geometry, path)
    records, codes = _layout(data, geometry, raw_records, data_start, path)
    codebook_groups = {rec.group for rec in records if rec.dtype == CQ and rec.bits in CODEBOOK_BITS}
    if len(codebook_groups) > 1:
        # The header holds one set of levels, scaled by 1/sqrt(group) for one group size.
        _fail(path, f"CQ records use several group sizes {sorted(codebook_groups)}; the header codebooks fit only one")
    return geometry, records, codes, data, codebooks


def read_cact_tensors(path) -> tuple[CactGeometry, list[tuple[CactRecord, np.ndarray | bytes]]]:
    """Every record of a `.cact` blob in blob order, dequantized to float32 in its stored layout
    (matrices [out, in]); the RAW tokenizer stays bytes. Raises `CactFormatError` on a malformed blob."""
    geometry, records, _, data, codebooks = _read(path)
    tensors = [(rec, data[rec.offset : rec.offset + rec.nbytes] if rec.dtype == RAW else _decode(data, rec, codebooks, path))
               for rec in records]
    return geometry, tensors


# --------------------------------------------------------------------------------------------------
# Stored layout -> native tree.

# Per-layer records -> native path under stack/layers/block, and whether the stored matrix is a
# transposed kernel.
_LAYER_TO_NATIVE = {
    "norm_in": (("ZCRMSNorm_0", "scale"), False),
    "q_proj": (("self_attn", "q_proj", "kernel"), True),
    "k_proj": (("self_attn", "k_proj", "kernel"), True),
    "v_proj": (("self_attn", "v_proj", "kernel"), True),
    "q_norm": (("self_attn", "q_norm", "scale"), False),
    "k_norm": (("self_attn", "k_norm", "scale"), False),
    "gate_proj": (("self_attn", "gate_proj", "kernel"), True),
    "out_proj": (("self_attn", "out_proj", "kernel"), True),
    "post_norm": (("post_attn_norm", "scale"), False),
    "attn_gate": (("attn_gate",), False),
    "pre_hada": (("pre_hada_norm", "scale"), False),
    "d1": (("hadamard_mlp", "d1"), False),
    "d2": (("hadamard_mlp", "d2"), False),
    "d3": (("hadamard_mlp", "d3"), False),
}


def _put(tree: dict, path: tuple[str, ...], value: np.ndarray):
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _native_params(g: CactGeometry, stored: dict[str, np.ndarray], codes: list[int], source) -> tuple[dict, list[str]]:
    params: dict = {}
    layers = g.num_layers
    _put(params, ("embedding", "embedding"), stored["embedding"])
    for suffix, (path, transposed) in _LAYER_TO_NATIVE.items():
        per_layer = [stored[f"layer{i:02d}.{suffix}"] for i in range(layers)]
        if transposed:
            per_layer = [matrix.T for matrix in per_layer]
        if suffix == "attn_gate":
            per_layer = [gate.reshape(()) for gate in per_layer]  # stored (1,), a scalar per layer
        _put(params, ("stack", "layers", "block", *path), np.stack(per_layer))
    for kind in ("pre", "post", "res"):
        _put(params, ("stack", f"mhc_a_{kind}"), stored[f"mhc_a_{kind}"])
        _put(params, ("stack", f"mhc_b_{kind}"), stored[f"mhc_b_{kind}"])
        rows = stored[f"mhc_phi_{kind}"]  # [L * outputs, lanes * d]
        phi = rows.reshape(layers, rows.shape[0] // layers, rows.shape[1]).transpose(0, 2, 1)
        _put(params, ("stack", f"mhc_phi_{kind}"), np.ascontiguousarray(phi))  # [L, lanes * d, outputs]
    _put(params, ("stack", "final_norm", "scale"), stored["final_norm"])
    for site in range(len(g.engram_layers)):
        prefix = f"engram{site}."
        tables = stored[prefix + "tables"].reshape(g.num_engram_tables, g.engram_slots, g.engram_sub_dim)
        _put(params, (f"engrams_{site}", "embedding"), tables)
        _put(params, (f"engrams_{site}", "key_proj", "kernel"), stored[prefix + "key_proj"].T)
        _put(params, (f"engrams_{site}", "value_proj", "kernel"), stored[prefix + "value_proj"].T)
        _put(params, (f"engrams_{site}", "taps"), stored[prefix + "taps"])
    filled = []
    for code in codes:
        name, _ = HEAD_CODES[code]
        _put(params, (name, "probes"), stored[f"{name}.probes"])
        _put(params, (name, "proj", "kernel"), stored[f"{name}.proj"].T)
        bias = stored[f"{name}.bias"]
        if name == "confidence_head":
            _put(params, (name, "proj", "bias"), bias)
        else:
            # The reference's contrastive projection has no bias; the exporter writes zeros. A
            # non-zero one would change the embeddings and has no place in the model: refuse it.
            if np.any(bias != 0):
                _fail(source, f"contrastive_head.bias is non-zero (max |b| = {np.abs(bias).max():.3g}); "
                              "the Needle 2 contrastive head has no bias, so this blob cannot be represented")
            _put(params, (name, "log_temp"), np.asarray(CONTRASTIVE_LOG_TEMP_INIT, np.float32))
            filled.append(f"{name}/log_temp")
    return params, filled


def _native_config(g: CactGeometry, stored: dict[str, np.ndarray], codes: list[int]) -> dict:
    config = {
        "vocab_size": g.vocab_size,
        "d_model": g.d_model,
        "attn_dim": g.attn_dim,
        "num_heads": g.num_heads,
        "num_kv_heads": g.num_kv_heads,
        "num_layers": g.num_layers,
        "max_seq_len": g.max_seq_len,
        "rope_theta": g.rope_theta,
        "engram_orders": g.engram_orders,
        "engram_heads": g.engram_heads,
        "engram_slots": g.engram_slots,
        "engram_layers": g.engram_layers,
        "mhc_lanes": g.mhc_lanes,
        # The exporter writes the window the runtime should use (the checkpoint's, or one sized
        # from the KV budget), so this may differ from the training config's 0.
        "kv_window": g.kv_window,
        "kv_bits": g.kv_bits,
    }
    if 1 in codes:
        config["contrastive_dim"] = int(stored["contrastive_head.proj"].shape[0])
    return config


def read_cact(path) -> CactModel:
    """Read a `.cact` blob into a native config, a float32 native parameter tree and its tokenizer.

    Every structural property is checked before any tensor is decoded; a malformed blob raises
    `CactFormatError` naming the record and the problem.
    """
    geometry, records, codes, data, codebooks = _read(path)
    stored: dict[str, np.ndarray] = {}
    tokenizer_table = None
    for rec in records:
        if rec.dtype == RAW:
            blob = data[rec.offset : rec.offset + rec.nbytes]
            tokenizer_table = parse_tokenizer_table(
                blob, expected_pieces=geometry.vocab_size, where=f"{path}: record {rec.index} (tokenizer)")
        else:
            stored[rec.name] = _decode(data, rec, codebooks, path)
    params, filled = _native_params(geometry, stored, codes, path)
    return CactModel(
        geometry=geometry,
        config=_native_config(geometry, stored, codes),
        params=params,
        tokenizer_table=tokenizer_table,
        records=tuple(records),
        heads=tuple(HEAD_CODES[code][0] for code in codes),
        filled_defaults=tuple(filled),
    )
