"""`.cact` v3: the engine blob of a Needle 3 model (cactus-needle 3.x), read and written.

Layout (little-endian; see `cact.py` for the parts shared with Needle 2's v2 blob: the directory
record, 64-byte aligned blobs, CQ matrices as packed Lloyd-Max indices then float16 group norms, the
RAW tokenizer piece table):

- header `HEADER` (48 u32 + f32 rope_theta): tag 0x05E12A84, num_tensors, codebook_len, kv_window,
  kv_bits, vocab, out_vocab, d_model, num_heads, num_kv_heads, num_layers, qk_head_dim, v_head_dim,
  max_seq_len, mlp width (the power of two >= d), lanes, sliding_window, global-layer bit mask (lo,
  hi), qkv_conv_taps, engram slots, sub_dim, tables, conv taps, conv dilation, seed stride, number
  of orders, orders[4], number of sites, sites[16]; then the 2-, 3- and 4-bit codebooks (float32);
- the records, by position (`slots`): the embedding (CQ); per layer its norms, projections (CQ,
  [out, in]), Q/K/V taps when `qkv_conv_taps` > 0, attention gate, MLP diagonals, bias, Kronecker
  factors and gain matrices (float16); the hyper-connection alphas, biases and projections (CQ,
  [L * outputs, lanes * d]); the MLP's two permutations (float32); per engram site its tables (CQ,
  [tables * slots, sub_dim]), key and value projections (CQ) and taps; the final norm; the probe
  heads when present (a manifest of codes 1 embedding, 2 confidence, 3 router, then per head probes
  (CQ, [(L+1) * k, d]), gain, query (CQ), row_bias, proj (CQ, [out, q * d]), bias (zeros for the
  embedding head), and the router's calibration); then the tokenizer (RAW) when one is packed.

The reference's writer packs CQ at 4 bits only, so `cact3_bytes` writes 4 bits. Reading gives the
dequantised weights (what the engine computes with); the embedding head's temperature and bias are
not in the blob (they do not change its output) and come back at their initial values.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np

from needle_hf.models.needle.numerics import CQ_CODEBOOK_BITS, cq_levels

from . import quantize
from .cact import BLOB_ALIGNMENT, CODEBOOK_LENGTH, CQ, CQ_RECORD_BITS, FP16, FP32, MAX_CQ_GROUP, RAW, RECORD, _decode_cq

CACT3_TAG = 0x05E12A84
HEADER = struct.Struct("<48If")
MAX_ORDERS, MAX_SITES, MAX_LAYERS = 4, 16, 64
WRITER_BITS = 4  # the 3.2.8 writer packs every CQ matrix at 4 bits
HEAD_CODES = {1: "embedding", 2: "confidence", 3: "router"}
ROUTER_CALIBRATION = (0.90, 0.00, 0.60)  # the router head's calibration row the reference writes
EMBEDDING_LOG_TEMPERATURE, EMBEDDING_BIAS = math.log(10.0), -10.0
# Deployment KV window, as the engine sizes it (int8 keys/values with one f32 scale per group).
KV_BUDGET_BYTES = 11 * 1024 * 1024 + 512 * 1024
KV_SCALE_GROUP = 32
KV_WINDOW_MIN = 160

_BLOCK = "stack/layers/block/"
_ATTENTION = _BLOCK + "self_attn/"
_MLP = _BLOCK + "hadamard_mlp/"
_MLP_LEAVES = ("d1", "d2", "b2", "d3", "d4", "w1a", "w1b", "w2a", "w2b", "w3a", "w3b", "cond_v", "cond_u")
_HC_VECTORS = ("mhc_a_pre", "mhc_a_post", "mhc_a_res", "mhc_b_pre", "mhc_b_post", "mhc_b_res")
_HC_MATRICES = ("mhc_phi_pre", "mhc_phi_post", "mhc_phi_res")


class Cact3Error(ValueError):
    """A `.cact` v3 blob or tree that cannot be read or written; the message names the file and record."""


def is_cact3(path) -> bool:
    """Whether `path` is a file starting with the `.cact` v3 tag."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return False
    return len(head) == 4 and struct.unpack("<I", head)[0] == CACT3_TAG


def deployment_kv_window(config) -> int:
    """The KV window the engine runs with: the widest whose cache fits `KV_BUDGET_BYTES` (sliding-window
    layers hold their window, global layers share the rest), capped by the config's `kv_window`."""
    kd, vd = config.key_dim, config.value_dim
    d, layers, sites = config.hidden_size, config.num_hidden_layers, len(config.engram_layers)
    per_layer = kd + vd + (kd // KV_SCALE_GROUP + vd // KV_SCALE_GROUP) * 4
    per_site = d + (d // KV_SCALE_GROUP) * 4
    longest = config.max_position_embeddings
    if config.sliding_window:
        n_global = len(config.global_layers)
        local = min(config.sliding_window, longest)
        fixed = ((layers - n_global) * per_layer + sites * per_site) * local
        if n_global == 0:
            budget = longest if fixed <= KV_BUDGET_BYTES else max(KV_WINDOW_MIN, local)
        else:
            context = (KV_BUDGET_BYTES - fixed) // (n_global * per_layer) // KV_SCALE_GROUP * KV_SCALE_GROUP
            budget = max(KV_WINDOW_MIN, min(context, longest))
    else:
        window = KV_BUDGET_BYTES // (layers * per_layer + sites * per_site) // KV_SCALE_GROUP * KV_SCALE_GROUP
        budget = max(KV_WINDOW_MIN, min(window, longest))
    return min(budget, config.kv_window) if config.kv_window else budget


@dataclass(frozen=True)
class Slot:
    """One record position: its name, dtype (CQ / FP16 / FP32) and logical shape."""

    name: str
    dtype: int
    shape: tuple


def slots(config, heads: tuple = ()) -> list:
    """The records of a blob with this config and these heads (names from `HEAD_CODES`), in order, tokenizer excluded."""
    d, layers, lanes, w = config.hidden_size, config.num_hidden_layers, config.hyper_connection_lanes, config.mlp_size
    a, b = config.mlp_factor_sizes
    taps, rank = config.qkv_conv_taps, config.mlp_gain_rank
    out = [Slot("embedding", CQ, (config.vocab_size, d))]
    for i in range(layers):
        p = f"layer{i:02d}."
        out += [Slot(p + "norm_in", FP16, (d,)), Slot(p + "q_proj", CQ, (config.query_dim, d)),
                Slot(p + "k_proj", CQ, (config.key_dim, d)), Slot(p + "v_proj", CQ, (config.value_dim, d))]
        if taps:
            out += [Slot(p + "q_taps", FP16, (taps, config.query_dim)), Slot(p + "k_taps", FP16, (taps, config.key_dim)),
                    Slot(p + "v_taps", FP16, (taps, config.value_dim))]
        out += [Slot(p + "q_norm", FP16, (config.head_dim,)), Slot(p + "k_norm", FP16, (config.head_dim,)),
                Slot(p + "gate_proj", CQ, (config.output_dim, d)), Slot(p + "out_proj", CQ, (d, config.output_dim)),
                Slot(p + "post_norm", FP16, (d,)), Slot(p + "attn_gate", FP16, (1,)), Slot(p + "pre_hada", FP16, (d,))]
        out += [Slot(p + leaf, FP16, (w,)) for leaf in ("d1", "d2", "b2", "d3", "d4")]
        for stage in ("1", "2", "3"):
            out += [Slot(p + f"w{stage}a", FP16, (a, a)), Slot(p + f"w{stage}b", FP16, (b, b))]
        out += [Slot(p + "cond_v", FP16, (d, rank)), Slot(p + "cond_u", FP16, (rank, w))]
    hc_shapes = {"mhc_a": (layers,), "mhc_b": (layers, lanes)}
    out += [Slot(name, FP16, (layers, lanes, lanes) if name == "mhc_b_res" else hc_shapes[name[:5]]) for name in _HC_VECTORS]
    out += [Slot(name, CQ, (layers * (lanes * lanes if name.endswith("res") else lanes), lanes * d)) for name in _HC_MATRICES]
    out += [Slot("hada_p1", FP32, (w,)), Slot("hada_p2", FP32, (w,))]
    tables, slots_, sub, e = config.engram_num_tables, config.engram_slots, config.engram_sub_dim, config.engram_dim
    for s in range(len(config.engram_layers)):
        out += [Slot(f"engram{s}.tables", CQ, (tables * slots_, sub)), Slot(f"engram{s}.key_proj", CQ, (d, e)),
                Slot(f"engram{s}.value_proj", CQ, (d, e)), Slot(f"engram{s}.taps", FP16, (config.engram_conv_taps, d))]
    out.append(Slot("final_norm", FP16, (d,)))
    if heads:
        out.append(Slot("heads.manifest", FP16, (len(heads),)))
    for name in heads:
        k, q = getattr(config, f"{name}_probes"), getattr(config, f"{name}_queries")
        width = config.embedding_dim if name == "embedding" else {"confidence": 1, "router": 3}[name]
        key, rows = f"{name}_head.", config.probe_rows
        out += [Slot(key + "probes", CQ, (rows * k, d)), Slot(key + "gain", FP16, (rows, k)), Slot(key + "query", CQ, (q, d)),
                Slot(key + "row_bias", FP16, (q, rows, k)), Slot(key + "proj", CQ, (width, q * d)),
                Slot(key + "bias", FP16, (width,))]
        if name == "router":
            out.append(Slot(key + "calibration", FP16, (3,)))
    return out


def _stored(slot: Slot, flat: dict, config) -> np.ndarray:
    """The value of a record, from the native tree (paths joined by "/"), in the layout the blob stores."""
    name = slot.name
    layers, lanes = config.num_hidden_layers, config.hyper_connection_lanes
    if name == "embedding":
        return flat["embedding/embedding"]
    if name.startswith("layer"):
        i, leaf = int(name[5:7]), name[8:]
        native = {"norm_in": _BLOCK + "ZCRMSNorm_0/scale", "post_norm": _BLOCK + "post_attn_norm/scale",
                  "pre_hada": _BLOCK + "pre_hada_norm/scale", "attn_gate": _BLOCK + "attn_gate",
                  "q_norm": _ATTENTION + "q_norm/scale", "k_norm": _ATTENTION + "k_norm/scale"}
        if leaf in native:
            return np.asarray(flat[native[leaf]][i]).reshape(slot.shape)
        if leaf.endswith("_proj"):
            return np.asarray(flat[_ATTENTION + leaf + "/kernel"][i]).T
        if leaf.endswith("_taps"):
            return flat[_ATTENTION + leaf][i]
        return flat[_MLP + leaf][i]
    if name in _HC_VECTORS:
        return flat["stack/" + name]
    if name in _HC_MATRICES:
        phi = np.asarray(flat["stack/" + name])  # [L, lanes*d, outputs]
        return phi.transpose(0, 2, 1).reshape(-1, phi.shape[1])
    if name in ("hada_p1", "hada_p2"):
        from needle_hf.models.needle3.modeling_needle3 import mlp_permutations

        return np.asarray(mlp_permutations(config)[int(name[-1]) - 1], np.float32)
    if name.startswith("engram"):
        site, leaf = name[len("engram"):].split(".")
        prefix = f"engrams_{site}/"
        if leaf == "tables":
            return np.asarray(flat[prefix + "embedding"]).reshape(slot.shape)
        if leaf == "taps":
            return flat[prefix + "taps"]
        return np.asarray(flat[prefix + leaf + "/kernel"]).T
    if name == "final_norm":
        return flat["stack/final_norm/scale"]
    head, leaf = name.split(".")
    if leaf in ("probes", "gain", "query", "row_bias"):
        return np.asarray(flat[f"{head}/{leaf}"]).reshape(slot.shape)
    if leaf == "proj":
        return np.asarray(flat[f"{head}/proj/kernel"]).T
    if leaf == "bias":
        return flat.get(f"{head}/proj/bias", np.zeros(slot.shape, np.float16))
    if leaf == "calibration":
        return flat.get(f"{head}/calibration", np.asarray(ROUTER_CALIBRATION))
    raise KeyError(name)


def _present_heads(flat: dict) -> tuple:
    return tuple(name for name in HEAD_CODES.values() if any(key.startswith(f"{name}_head/") for key in flat))


def _header(config, *, num_tensors: int, kv_window: int) -> bytes:
    orders, sites = tuple(config.engram_orders), tuple(config.engram_layers)
    if len(orders) > MAX_ORDERS or len(sites) > MAX_SITES or config.num_hidden_layers > MAX_LAYERS:
        raise Cact3Error(f"the .cact v3 header holds at most {MAX_LAYERS} layers, {MAX_ORDERS} engram orders and "
                         f"{MAX_SITES} sites; the config has {config.num_hidden_layers}, {orders} and {sites}")
    mask = sum(1 << int(layer) for layer in set(config.global_layers))
    return HEADER.pack(
        CACT3_TAG, num_tensors, CODEBOOK_LENGTH, int(kv_window), int(config.kv_bits or 8), config.vocab_size,
        config.out_vocab, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
        config.num_hidden_layers, config.head_dim, config.value_head_dim, config.max_position_embeddings,
        config.mlp_size, config.hyper_connection_lanes, config.sliding_window, mask & 0xFFFFFFFF, mask >> 32,
        config.qkv_conv_taps, config.engram_slots, config.engram_sub_dim, config.engram_num_tables, config.engram_conv_taps,
        config.engram_conv_dilation, config.engram_seed_heads, len(orders), *(list(orders) + [0] * MAX_ORDERS)[:MAX_ORDERS],
        len(sites), *(list(sites) + [0] * MAX_SITES)[:MAX_SITES], float(config.rope_theta))


def cact3_bytes(flat: dict, config, *, group: int = quantize.DEFAULT_GROUP, tokenizer: Optional[bytes] = None,
                kv_window: int = 0) -> bytes:
    """The `.cact` v3 blob of a native Needle 3 tree (paths joined by "/", the reference's checkpoint
    layout) with this `Needle3Config`: CQ matrices at 4 bits, `tokenizer` (a RAW piece table) last."""
    heads = _present_heads(flat)
    blobs = []
    for slot in slots(config, heads):
        if slot.name == "heads.manifest":
            codes = {name: code for code, name in HEAD_CODES.items()}
            value = np.asarray([codes[name] for name in heads], np.float32)
        else:
            try:
                value = np.asarray(_stored(slot, flat, config), np.float32)
            except KeyError as error:
                raise Cact3Error(f"record {slot.name}: the tree has no tensor {error}") from None
        if value.shape != slot.shape and not (slot.dtype == CQ and value.reshape(-1).size == math.prod(slot.shape)):
            raise Cact3Error(f"record {slot.name}: expected shape {slot.shape}, found {value.shape}")
        value = value.reshape(slot.shape)
        if slot.dtype == CQ:
            blobs.append((slot.dtype, slot.shape, quantize.quantize_matrix(value, WRITER_BITS, group), group, WRITER_BITS))
        elif slot.dtype == FP32:
            blobs.append((FP32, slot.shape, value.astype("<f4").tobytes(), 0, 0))
        else:
            blobs.append((FP16, slot.shape, value.astype("<f2").tobytes(), 0, 0))
    if tokenizer is not None:
        blobs.append((RAW, (), bytes(tokenizer), 0, 0))
    header = _header(config, num_tensors=len(blobs), kv_window=kv_window) + quantize.header_codebooks(group).tobytes()
    position, offsets = len(header) + len(blobs) * RECORD.size, []
    for _, _, payload, _, _ in blobs:
        position = -(-position // BLOB_ALIGNMENT) * BLOB_ALIGNMENT
        offsets.append(position)
        position += len(payload)
    out = bytearray(header)
    for (dtype, shape, payload, grp, bits), offset in zip(blobs, offsets):
        out += RECORD.pack(dtype, len(shape), 0, *(list(shape) + [0, 0, 0, 0])[:4], offset, len(payload), grp, bits)
    for (_, _, payload, _, _), offset in zip(blobs, offsets):
        out += b"\x00" * (offset - len(out))
        out += payload
    return bytes(out)


@dataclass
class Cact3Model:
    """A read `.cact` v3: the resolved config, the native tree (dequantised, float32) and the tokenizer record."""

    config: object
    flat: dict
    native_config: dict
    tokenizer: Optional[bytes]
    kv_window: int


def _fail(source, message):
    raise Cact3Error(f"{source}: {message}")


def read_cact3(path) -> Cact3Model:
    """Read a `.cact` v3 blob strictly: its header, every record's position, dtype and shape against the
    layout its geometry implies, and every value finite. The heads come from the manifest."""
    from needle_hf.models.needle3.configuration_needle3 import Needle3Config
    from needle_hf.models.needle3.modeling_needle3 import mlp_permutations

    source = Path(path)
    data = source.read_bytes()
    if len(data) < HEADER.size or struct.unpack_from("<I", data)[0] != CACT3_TAG:
        _fail(source, f"not a .cact v3 blob (expected tag {CACT3_TAG:#010x} and a {HEADER.size}-byte header)")
    h = HEADER.unpack_from(data)
    num_tensors, codebook_len, kv_window, kv_bits = h[1:5]
    if codebook_len != CODEBOOK_LENGTH:
        _fail(source, f"codebook_len: expected {CODEBOOK_LENGTH}, found {codebook_len}")
    num_orders, num_sites = h[26], h[31]
    if not 1 <= num_orders <= MAX_ORDERS or num_sites > MAX_SITES:
        _fail(source, f"engram orders/sites: expected 1..{MAX_ORDERS} and 0..{MAX_SITES}, found {num_orders}, {num_sites}")
    layers, mask = h[10], h[17] | (h[18] << 32)
    orders, tables = tuple(h[27 : 27 + num_orders]), h[22]
    if tables % num_orders:
        _fail(source, f"engram tables ({tables}) is not a multiple of the {num_orders} orders")
    native = dict(
        vocab_size=h[5], out_vocab=h[6], d_model=h[7], num_heads=h[8], num_kv_heads=h[9], num_layers=layers,
        qk_head_dim=h[11], v_head_dim=h[12], max_seq_len=h[13], mhc_lanes=h[15], sliding_window=h[16],
        global_layers=tuple(i for i in range(layers) if mask >> i & 1), qkv_conv_taps=h[19], engram_slots=h[20],
        engram_heads=tables // num_orders, engram_seed_heads=h[25], engram_orders=orders,
        engram_layers=tuple(h[32 : 32 + num_sites]), rope_theta=float(h[48]), kv_bits=kv_bits, kv_window=kv_window)
    start = HEADER.size + codebook_len * 4
    if len(data) < start + num_tensors * RECORD.size:
        _fail(source, f"the directory of {num_tensors} records runs past the end of the file")
    directory = [RECORD.unpack_from(data, start + i * RECORD.size) for i in range(num_tensors)]
    for index, rec in enumerate(directory):
        if rec[7] + rec[8] > len(data):
            _fail(source, f"record {index}: its {rec[8]} bytes at offset {rec[7]} run past the end of the file "
                          f"({len(data)} bytes)")
    codes = []
    try:
        config = Needle3Config.from_needle_config(native)
    except (TypeError, ValueError) as error:
        _fail(source, f"header geometry: {error}")
    backbone = slots(config)
    manifest_index = len(backbone)
    tokenizer = None
    if directory and directory[-1][0] == RAW:
        rec = directory.pop()
        tokenizer = data[rec[7] : rec[7] + rec[8]]
    if len(directory) > manifest_index:
        rec = directory[manifest_index]
        values = np.frombuffer(data, "<f2", rec[3], rec[7]).astype(np.float32)
        codes = [int(v) for v in values]
        if any(code not in HEAD_CODES for code in codes) or len(set(codes)) != len(codes):
            _fail(source, f"heads.manifest: expected distinct codes of {sorted(HEAD_CODES)}, found {codes}")
        heads = tuple(HEAD_CODES[code] for code in codes)
        # The head geometry is read off the records' shapes: probes (rows * k, d), query (q, d), proj (out, q * d).
        fields = {}
        index = manifest_index + 1
        for name in heads:
            if index + 4 >= len(directory):
                _fail(source, f"heads.manifest names {list(heads)}, but the directory ends before the {name} head's records")
            probes, query, proj = directory[index], directory[index + 2], directory[index + 4]
            fields[f"{name}_probes"] = probes[3] // config.probe_rows
            fields[f"{name}_queries"] = query[3]
            if name == "embedding":
                fields["embedding_dim"] = proj[3]
            index += 7 if name == "router" else 6
        native.update(fields)
        config = Needle3Config.from_needle_config(native, **{f"use_{name}_head": True for name in heads})
    else:
        heads = ()
    layout = slots(config, heads)
    if len(directory) != len(layout):
        _fail(source, f"expected {len(layout)} records for this geometry and heads {list(heads)} (+ tokenizer), "
                      f"found {len(directory)}")
    codebooks: dict = {}  # group -> {bits: levels}
    stored = {}
    for index, (slot, rec) in enumerate(zip(layout, directory)):
        dtype, ndim, shape, offset, nbytes, group, bits = rec[0], rec[1], tuple(rec[3 : 3 + rec[1]]), rec[7], rec[8], rec[9], rec[10]
        if dtype != slot.dtype or shape != slot.shape:
            _fail(source, f"record {index} ({slot.name}): expected {slot.dtype}/{slot.shape}, found {dtype}/{shape}")
        if offset % BLOB_ALIGNMENT or offset + nbytes > len(data):
            _fail(source, f"record {index} ({slot.name}): blob at {offset} (+{nbytes}) is misaligned or past the end")
        if dtype == CQ:
            if bits not in CQ_RECORD_BITS or not 8 <= group <= MAX_CQ_GROUP or group & (group - 1):
                _fail(source, f"record {index} ({slot.name}): CQ bits {bits} / group {group} not supported")
            record = SimpleNamespace(shape=shape, group=group, bits=bits, offset=offset, index=index, name=slot.name)
            if group not in codebooks:
                codebooks[group] = {b: cq_levels(b, group) for b in CQ_CODEBOOK_BITS}
            value = _decode_cq(data, record, codebooks[group], source)
        else:
            width = 2 if dtype == FP16 else 4
            if nbytes != width * math.prod(shape):
                _fail(source, f"record {index} ({slot.name}): expected {width * math.prod(shape)} bytes, found {nbytes}")
            value = np.frombuffer(data, "<f2" if dtype == FP16 else "<f4", math.prod(shape), offset).astype(np.float32)
            value = value.reshape(shape)
        if not np.all(np.isfinite(value)):
            _fail(source, f"record {index} ({slot.name}): non-finite values")
        stored[slot.name] = value
    split = [np.asarray(p, np.float32) for p in mlp_permutations(config)]
    if not all(np.array_equal(stored[f"hada_p{k + 1}"], split[k]) for k in range(2)):
        native["ladder_widths"] = () if native.get("ladder_widths") else (config.hidden_size // 2,)
        config = Needle3Config.from_needle_config(native, **{f"use_{name}_head": True for name in heads})
        again = [np.asarray(p, np.float32) for p in mlp_permutations(config)]
        if not all(np.array_equal(stored[f"hada_p{k + 1}"], again[k]) for k in range(2)):
            _fail(source, "hada_p1/hada_p2: neither the whole-width nor the split MLP permutations")
    return Cact3Model(config, _native_tree(stored, config, heads), config.to_needle_config(), tokenizer, kv_window)


def _native_tree(stored: dict, config, heads: tuple) -> dict:
    """The native flat tree (paths joined by "/") of the decoded records."""
    layers, lanes, d = config.num_hidden_layers, config.hyper_connection_lanes, config.hidden_size
    flat = {"embedding/embedding": stored["embedding"]}

    def stack(leaf, transform=lambda v: v):
        return np.stack([transform(stored[f"layer{i:02d}.{leaf}"]) for i in range(layers)])

    for leaf, native in (("norm_in", _BLOCK + "ZCRMSNorm_0/scale"), ("post_norm", _BLOCK + "post_attn_norm/scale"),
                         ("pre_hada", _BLOCK + "pre_hada_norm/scale"), ("q_norm", _ATTENTION + "q_norm/scale"),
                         ("k_norm", _ATTENTION + "k_norm/scale")):
        flat[native] = stack(leaf)
    flat[_BLOCK + "attn_gate"] = stack("attn_gate", lambda v: v[0])
    for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "out_proj"):
        flat[_ATTENTION + proj + "/kernel"] = stack(proj, lambda v: v.T)
    if config.qkv_conv_taps:
        for taps in ("q_taps", "k_taps", "v_taps"):
            flat[_ATTENTION + taps] = stack(taps)
    for leaf in _MLP_LEAVES:
        flat[_MLP + leaf] = stack(leaf)
    for name in _HC_VECTORS:
        flat["stack/" + name] = stored[name]
    for name in _HC_MATRICES:
        rows = stored[name]
        flat["stack/" + name] = rows.reshape(layers, -1, lanes * d).transpose(0, 2, 1)
    for s in range(len(config.engram_layers)):
        prefix = f"engrams_{s}/"
        flat[prefix + "embedding"] = stored[f"engram{s}.tables"].reshape(
            config.engram_num_tables, config.engram_slots, config.engram_sub_dim)
        flat[prefix + "key_proj/kernel"] = stored[f"engram{s}.key_proj"].T
        flat[prefix + "value_proj/kernel"] = stored[f"engram{s}.value_proj"].T
        flat[prefix + "taps"] = stored[f"engram{s}.taps"]
    flat["stack/final_norm/scale"] = stored["final_norm"]
    for name in heads:
        key, k = f"{name}_head", getattr(config, f"{name}_probes")
        flat[f"{key}/probes"] = stored[f"{key}.probes"].reshape(config.probe_rows, k, d)
        for leaf in ("gain", "query", "row_bias"):
            flat[f"{key}/{leaf}"] = stored[f"{key}.{leaf}"]
        flat[f"{key}/proj/kernel"] = stored[f"{key}.proj"].T
        if name == "embedding":
            flat[f"{key}/log_temp"] = np.asarray(EMBEDDING_LOG_TEMPERATURE, np.float32)
            flat[f"{key}/bias"] = np.asarray(EMBEDDING_BIAS, np.float32)
        else:
            flat[f"{key}/proj/bias"] = stored[f"{key}.bias"]
    return {name: np.array(value, np.float32, order="C") for name, value in flat.items()}


__all__ = ["CACT3_TAG", "Cact3Error", "Cact3Model", "cact3_bytes", "deployment_kv_window", "is_cact3", "read_cact3", "slots"]
