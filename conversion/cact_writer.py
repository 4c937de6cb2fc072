"""Writer of `.cact` blobs: a native parameter tree -> the bytes the reference's exporter writes.

The layout is the one `cact.py` reads (and documents): its header struct, record struct, slot
order and shapes are used here as they are, so reader and writer cannot drift apart. For each
slot, in order:

- CQ matrices (`quantize.quantize_matrix`): the embedding, every attention projection, the three
  hyper-connection projections and each engram site's tables, key and value projections. Kernels
  are stored transposed, [out, in]; the hyper-connection projections [L, lanes*d, outputs] as rows
  [L*outputs, lanes*d]; the engram tables [tables*slots, sub_dim].
- float16 vectors for everything else (norms, gates, Hadamard diagonals, mixing biases/alphas, taps).
- the probe heads when the tree has them (a manifest of codes, then probes, proj [out, P*d] and bias
  per head, all float16; the contrastive head has no bias and gets zeros).
- the tokenizer's piece table as the RAW record, when one is given.

Matrices reach the quantizer in the layout the reference's exporter gives it (a transposed view of
the native (in, out) kernel, a reshaped copy of the hyper-connection weights), so the float32 work
sees the very same operands.

The header's `kv_window` is the deployment window (`deployment_kv_window`), `kv_bits` the config's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from needle_hf.models.needle.chat_template import CHAT_MARKERS
from needle_hf.models.needle.numerics import CQ_WEIGHT_BITS, TERNARY_BITS, bits_for, parse_bits_map
from needle_hf.models.needle.tokenization_needle import PieceTable, PieceType

from . import quantize
from .atomic_output import check_output_outside_inputs, clean_debris, errors_name, publish_file, staging_path
from .cact import (
    _LAYER_TO_NATIVE,
    BLOB_ALIGNMENT,
    CACT_TAG,
    CODEBOOK_LENGTH,
    CQ,
    ENGRAM_CONV_TAPS,
    FP16,
    HEAD_CODES,
    HEADER,
    MAX_ORDERS,
    MAX_SITES,
    RAW,
    RECORD,
    TOKENIZER_HEADER,
    TOKENIZER_PIECE,
    CactGeometry,
    _backbone_slots,
    _head_slots,
)

# Deployment KV window: the engine sizes its sliding window so the whole KV cache (int8 keys and
# values with one f32 scale per group of KV_SCALE_GROUP, for every layer, plus each engram site's
# cached values) fits KV_BUDGET_BYTES; never below KV_WINDOW_MIN, never beyond max_seq_len.
KV_BUDGET_BYTES = 11 * 1024 * 1024 + 512 * 1024
KV_SCALE_GROUP = 32
KV_WINDOW_MIN = 160

# Native paths (under stack/layers/block) of the per-layer records that are CQ matrices.
_CQ_LAYER_RECORDS = {"q_proj", "k_proj", "v_proj", "gate_proj", "out_proj"}
_CQ_ENGRAM_RECORDS = {"tables", "key_proj", "value_proj"}


class CactWriteError(ValueError):
    """The tree or the options cannot be written as a `.cact`; the message names the tensor or option."""


def deployment_kv_window(config) -> int:
    """The sliding KV window the engine runs a `.cact` with: the config's `kv_window` when it is set
    and smaller, else the widest window whose KV cache fits the budget (see the constants)."""
    kv = config.num_key_value_heads * config.head_dim
    d, layers, sites = config.hidden_size, config.num_hidden_layers, len(config.engram_layers)
    bytes_per_position = layers * (2 * kv + 2 * (kv // KV_SCALE_GROUP) * 4) + sites * (d + (d // KV_SCALE_GROUP) * 4)
    window = KV_BUDGET_BYTES // bytes_per_position // KV_SCALE_GROUP * KV_SCALE_GROUP
    budget = max(KV_WINDOW_MIN, min(window, config.max_position_embeddings))
    return min(budget, config.kv_window) if config.kv_window else budget


def _geometry(config, *, kv_window: int) -> CactGeometry:
    orders, sites = tuple(config.engram_orders), tuple(config.engram_layers)
    if len(orders) > MAX_ORDERS or len(sites) > MAX_SITES:
        raise CactWriteError(f"the .cact header holds at most {MAX_ORDERS} engram orders and {MAX_SITES} sites; "
                             f"the config has orders {orders} and sites {sites}")
    return CactGeometry(
        num_tensors=0, codebook_len=CODEBOOK_LENGTH, kv_window=int(kv_window), kv_bits=int(config.kv_bits or 8),
        vocab_size=config.vocab_size, d_model=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, num_layers=config.num_hidden_layers, head_dim=config.head_dim,
        max_seq_len=config.max_position_embeddings, hada_n=config.hadamard_size, mhc_lanes=config.hyper_connection_lanes,
        engram_slots=config.engram_slots, engram_sub_dim=config.engram_sub_dim,
        num_engram_tables=config.engram_num_tables, engram_conv_taps=ENGRAM_CONV_TAPS,
        engram_conv_dilation=config.engram_conv_dilation, engram_orders=orders, engram_layers=sites,
        rope_theta=float(config.rope_theta),
    )


def _header(g: CactGeometry, group: int) -> bytes:
    def padded(values):
        return list(values) + [0] * (MAX_ORDERS - len(values))

    fields = [CACT_TAG] + [getattr(g, f.name) for f in dataclasses.fields(g)][:18]
    fields += [len(g.engram_orders), *padded(g.engram_orders), len(g.engram_layers), *padded(g.engram_layers), g.rope_theta]
    return HEADER.pack(*fields) + quantize.header_codebooks(group).tobytes()


@dataclasses.dataclass
class _Blob:
    name: str
    dtype: int
    shape: tuple[int, ...]
    data: bytes
    group: int = 0
    bits: int = 0


def _fp16(name: str, value) -> _Blob:
    source = np.asarray(value)
    with np.errstate(over="ignore"):  # reported just below, naming the tensor
        half = np.asarray(source, np.float16)
    if not np.all(np.isfinite(half)) and np.all(np.isfinite(source.astype(np.float32))):
        raise CactWriteError(f"tensor {name}: values up to {np.abs(source.astype(np.float32)).max():.4g} overflow "
                             "float16, the width .cact stores it in")
    return _Blob(name, FP16, half.shape, half.tobytes())


def _cq(name: str, matrix, width, group: int) -> _Blob:
    matrix = np.asarray(matrix)
    if not np.all(np.isfinite(matrix.astype(np.float32))):
        raise CactWriteError(f"tensor {name}: non-finite values cannot be quantized")
    return _Blob(name, CQ, matrix.shape, quantize.quantize_matrix(matrix, width, group), group, quantize.record_bits(width))


def _stored_value(name: str, params: dict, g: CactGeometry):
    """(array in stored layout, whether it is a CQ matrix) of the record `name`."""
    stack = params["stack"]
    if name == "embedding":
        return params["embedding"]["embedding"], True
    if name.startswith("layer"):
        layer, suffix = name[len("layer"):].split(".", 1)
        path, transposed = _LAYER_TO_NATIVE[suffix]
        leaf = stack["layers"]["block"]
        for key in path:
            leaf = leaf[key]
        value = np.asarray(leaf[int(layer)])
        if suffix == "attn_gate":
            value = value.reshape(1)
        return (value.T if transposed else value), suffix in _CQ_LAYER_RECORDS
    if name.startswith("mhc_phi_"):
        phi = np.asarray(stack[name])  # [L, lanes * d, outputs]
        layers, width, outputs = phi.shape
        return phi.transpose(0, 2, 1).reshape(layers * outputs, width), True
    if name.startswith("mhc_"):
        return np.asarray(stack[name]), False
    if name == "final_norm":
        return stack["final_norm"]["scale"], False
    if name.startswith("engram"):
        site, part = name[len("engram"):].split(".", 1)
        engram = params[f"engrams_{site}"]
        if part == "tables":
            return np.asarray(engram["embedding"]).reshape(g.num_engram_tables * g.engram_slots, g.engram_sub_dim), True
        if part == "taps":
            return engram["taps"], False
        return np.asarray(engram[part]["kernel"]).T, True
    raise KeyError(name)


def _head_value(name: str, params: dict):
    head, part = name.rsplit(".", 1)
    node = params[head]
    if part == "probes":
        return node["probes"]
    kernel = np.asarray(node["proj"]["kernel"]).T  # [out, probes * d]
    if part == "proj":
        return kernel
    return node["proj"]["bias"] if "bias" in node["proj"] else np.zeros(kernel.shape[0], np.float16)


def _check_shape(name: str, expected, found):
    found = tuple(found)
    if len(expected) != len(found) or any(e is not None and e != f for e, f in zip(expected, found)):
        shown = tuple("?" if e is None else e for e in expected)
        raise CactWriteError(f"tensor {name}: shape {found}, expected {shown} for this config")


def tokenizer_record(table: PieceTable, *, markers=CHAT_MARKERS) -> bytes:
    """The RAW tokenizer record of a piece table. As the reference writes it, only the chat markers
    (`markers`: Needle 2's by default) keep the user-defined type; any other user-defined piece is
    recorded as a normal one."""
    out = bytearray(TOKENIZER_HEADER.pack(len(table.pieces), table.pad_id, table.eos_id, table.bos_id, table.unk_id,
                                          int(table.add_dummy_prefix), int(table.byte_fallback), 0))
    markers = set(markers)
    for piece, score, kind in zip(table.pieces, table.scores, table.types):
        if kind == PieceType.USER_DEFINED and piece not in markers:
            kind = PieceType.NORMAL
        text = piece.encode("utf-8")
        out += TOKENIZER_PIECE.pack(score, int(kind), len(text)) + text
    return bytes(out)


def cact_bytes(params: dict, config, *, bits=4, bits_map: str | None = None, group: int = quantize.DEFAULT_GROUP,
               tokenizer: PieceTable | None = None, kv_window: int | None = None) -> bytes:
    """The `.cact` blob of a native parameter tree.

    Args:
        params: the native tree (as the reference saves it; `mtp_*` subtrees are not exported and
            `contrastive_head`/`confidence_head` are written when present).
        config: the model's `NeedleConfig`.
        bits: CQ width of every quantized matrix (2, 3, 4, or `TERNARY_BITS`), unless
            `bits_map` is given.
        bits_map: per-tensor widths, "name=bits,...,default=bits" (see `needle_hf.models.needle.numerics.parse_bits_map`).
        group: CQ group size (a power of two).
        tokenizer: the piece table to embed as the RAW record, or None for a blob without one.
        kv_window: the header's window; default `deployment_kv_window(config)`.
    """
    if group < 8 or group & (group - 1):
        raise CactWriteError(f"CQ group size {group}, expected a power of two >= 8")
    if bits_map:
        prefixes, default = parse_bits_map(bits_map, engram_sites=len(config.engram_layers))
    else:
        if bits not in CQ_WEIGHT_BITS:
            raise CactWriteError(f"bits {bits}, expected one of 2, 3, 4 or {TERNARY_BITS} (ternary)")
        prefixes, default = {}, bits
    if tokenizer is not None and len(tokenizer.pieces) != config.vocab_size:
        raise CactWriteError(f"the tokenizer has {len(tokenizer.pieces)} pieces, the model's vocab_size is {config.vocab_size}")
    g = _geometry(config, kv_window=deployment_kv_window(config) if kv_window is None else kv_window)

    blobs = []
    for slot in _backbone_slots(g):
        value, quantized = _stored_value(slot.name, params, g)
        _check_shape(slot.name, slot.shape, np.shape(value))
        width = bits_for(slot.name, prefixes, default)
        blobs.append(_cq(slot.name, value, width, group) if quantized else _fp16(slot.name, value))
    codes = [code for code, (head, _) in sorted(HEAD_CODES.items()) if head in params]
    if codes:
        slots = _head_slots(g, codes)
        blobs.append(_fp16(slots[0].name, np.asarray(codes, np.float16)))
        for slot in slots[1:]:
            value = _head_value(slot.name, params)
            _check_shape(slot.name, slot.shape, np.shape(value))
            blobs.append(_fp16(slot.name, value))
    if tokenizer is not None:
        blobs.append(_Blob("tokenizer", RAW, (), tokenizer_record(tokenizer)))

    header = _header(dataclasses.replace(g, num_tensors=len(blobs)), group)
    position, offsets = len(header) + RECORD.size * len(blobs), []
    for blob in blobs:
        position = -(-position // BLOB_ALIGNMENT) * BLOB_ALIGNMENT
        offsets.append(position)
        position += len(blob.data)
    out = bytearray(header)
    for blob, offset in zip(blobs, offsets):
        shape4 = list(blob.shape) + [0] * (4 - len(blob.shape))
        out += RECORD.pack(blob.dtype, len(blob.shape), 0, *shape4, offset, len(blob.data), blob.group, blob.bits)
    for blob, offset in zip(blobs, offsets):
        out += bytes(offset - len(out))
        out += blob.data
    return bytes(out)


def write_atomically(path, data: bytes, *, inputs: dict, command: str, check=None) -> Path:
    """Write `data` to `path` through a staging file beside it: `path` is either untouched or complete.

    `inputs` (label -> path) are what the writing command read: `path` must lie outside each of them
    (`atomic_output.check_output_outside_inputs`). `check`, if given, is called with the staged
    file's path before it replaces `path`; an exception from it leaves `path` untouched. Staging and
    debris follow `atomic_output`; a failure names `path`, not the staging file.
    """
    path = Path(path)
    check_output_outside_inputs(path, inputs, command=command)
    clean_debris(path)
    staging = staging_path(path)
    try:
        with errors_name(path, staging):
            with open(staging, "xb") as handle:
                handle.write(data)
            if check is not None:
                check(staging)
            publish_file(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return path
