"""The `.cact` reader: exact parity with the reference's own reader, the native tree it rebuilds,
and clear errors on damaged blobs. Blobs are written by the reference exporter."""

import math
import struct

import numpy as np
import pytest

from needle_hf import NeedleConfig
from needle_hf.conversion import SourceFormat, UnknownSourceFormatError, detect_source_format
from needle_hf.conversion.cact import CactFormatError, is_cact, read_cact, read_cact_tensors
from needle_hf.conversion.native_checkpoint import is_native_checkpoint
from needle_hf.models.needle.weight_names import native_to_hf, optional_heads_in_native, weight_specs
from needle_reference import (
    BASE_NATIVE_CONFIG,
    TINY_NATIVE_CONFIG,
    make_native_params,
    reference_config,
    write_native_checkpoint,
)
from spm_fixture import FIXTURE_VOCAB_SIZE

# The tiny geometry with the fixture tokenizer's vocabulary (the exporter requires them to agree).
CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE)
MIXED_BITS = "attn.q_proj=3,attn.v_proj=1.58,engram=2,default=4"  # 1.58 = ternary
HEADER_BYTES = 120
CODEBOOK_FLOATS = 28
RECORD_BYTES = 44
# Directory record fields: u8 dtype, u8 ndim, u16 pad, u32 shape[4], u64 offset, u64 nbytes, u32 group, u32 bits.
RECORD_FIELD_OFFSET = {"dtype": 0, "shape0": 4, "offset": 20, "nbytes": 28}

# (export kwargs, heads kept, tokenizer) per variant.
VARIANTS = {
    "w4_tokenizer": (dict(bits=4, kv_window=160), ("contrastive_head", "confidence_head"), True),
    "w2_group32": (dict(bits=2, group=32), ("contrastive_head", "confidence_head"), False),
    "mixed_ternary": (dict(bits_map=MIXED_BITS), ("contrastive_head", "confidence_head"), True),
    "contrastive_only": (dict(bits=4), ("contrastive_head",), False),
    "no_heads": (dict(bits=3), (), False),
}


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _is_quantized_leaf(path) -> bool:
    """The leaves the exporter stores as CQ codes (the probe heads stay FP16)."""
    if path[0] in ("contrastive_head", "confidence_head"):
        return False
    return path[-1] in ("kernel", "embedding") or path[-1].startswith("mhc_phi")


def _without(params, dropped):
    return {key: value for key, value in params.items() if key not in dropped}


@pytest.fixture(scope="module")
def params():
    return make_native_params(CONFIG, seed=11, with_heads=True)


@pytest.fixture(scope="module")
def tokenizer(needle_spm_model):
    """The reference's tokenizer class around the session's Needle-style SentencePiece model (conftest)."""
    from needle.model.tokenizer import SANTokenizer

    return SANTokenizer(str(needle_spm_model))


@pytest.fixture(scope="module")
def blobs(params, tokenizer, tmp_path_factory):
    """variant -> (path, the params that were exported)."""
    from needle.model.export import write_export

    folder = tmp_path_factory.mktemp("cact")
    out = {}
    for name, (kwargs, heads, with_tokenizer) in VARIANTS.items():
        exported = _without(params, {"contrastive_head", "confidence_head"} - set(heads))
        path = folder / f"{name}.cact"
        write_export(exported, reference_config(CONFIG), str(path), tokenizer=tokenizer if with_tokenizer else None, **kwargs)
        out[name] = (path, exported)
    return out


# ------------------------------------------------------------------------------------------------
# Parity with the reference reader.


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tensors_equal_reference_read_export(blobs, variant):
    from needle.model.export import read_export

    path, _ = blobs[variant]
    meta, expected = read_export(str(path))
    geometry, ours = read_cact_tensors(path)
    assert len(ours) == len(expected) == geometry.num_tensors
    for (record, got), want in zip(ours, expected):
        if isinstance(want, (bytes, bytearray)):
            assert got == want and record.name == "tokenizer"
            continue
        assert got.dtype == np.float32 and got.shape == want.shape, record.name
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=record.name)
    for field in ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "head_dim", "max_seq_len",
                  "hada_n", "mhc_lanes", "engram_slots", "engram_sub_dim", "num_engram_tables", "engram_conv_taps",
                  "engram_conv_dilation", "engram_orders", "engram_layers", "rope_theta", "kv_window", "kv_bits"):
        assert getattr(geometry, field) == meta[field], field


def test_record_bits_follow_the_bits_map(blobs):
    _, tensors = read_cact_tensors(blobs["mixed_ternary"][0])
    bits = {record.name: record.bits for record, _ in tensors if record.dtype == 3}
    assert bits["layer01.q_proj"] == 3
    assert bits["layer01.v_proj"] == 5  # ternary
    assert bits["engram1.tables"] == bits["engram0.key_proj"] == 2
    assert bits["layer01.k_proj"] == bits["embedding"] == bits["mhc_phi_res"] == 4


# ------------------------------------------------------------------------------------------------
# The native tree.


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_tree_holds_every_exported_leaf_fp16_ones_exactly(blobs, variant):
    path, exported = blobs[variant]
    original = dict(_leaves(exported))
    model = read_cact(path)
    got = dict(_leaves(model.params))
    assert sorted(got) == sorted(path for path in original if not path[0].startswith("mtp_"))
    for leaf_path, value in got.items():
        name = "/".join(leaf_path)
        assert value.dtype == np.float32 and value.shape == original[leaf_path].shape, name
        if leaf_path == ("contrastive_head", "log_temp"):
            assert value == np.float32(math.log(0.07))  # not in the blob: the reference's initial value
        elif not _is_quantized_leaf(leaf_path):
            np.testing.assert_array_equal(value, original[leaf_path].astype(np.float16).astype(np.float32), err_msg=name)
    assert model.filled_defaults == (("contrastive_head/log_temp",) if "contrastive_head" in model.heads else ())


def test_quantized_leaves_equal_the_reference_native_layout_quantizer(blobs):
    """The reference's own quantizer, applied to the native tree (CQ 2/3/4-bit and ternary here),
    gives the same values as our dequantized, re-laid-out blob: every transpose and reshape is right."""
    import jax
    from needle.model.quantize import cq_mixed_params, parse_bits_map

    path, exported = blobs["mixed_ternary"]
    bits_map, default_bits = parse_bits_map(MIXED_BITS)
    quantize = jax.jit(lambda tree: cq_mixed_params(tree, bits_map, default_bits, group_size=128))
    expected = dict(_leaves(jax.tree.map(np.asarray, quantize(exported))))
    checked = 0
    for leaf_path, value in _leaves(read_cact(path).params):
        if _is_quantized_leaf(leaf_path):
            np.testing.assert_allclose(value, expected[leaf_path], rtol=0, atol=1e-6, err_msg="/".join(leaf_path))
            checked += 1
    assert checked == 1 + 5 + 3 + 3 * 2  # embedding, 5 attention kernels, 3 phi, 3 per engram site


def test_quantized_kernels_stay_close_to_the_originals(blobs):
    """Relative error of the dequantized CQ leaves: ~0.1 at 4 bits, ~0.34 at 2 bits."""
    limits = {"w4_tokenizer": 0.12, "w2_group32": 0.38}
    for variant, limit in limits.items():
        path, exported = blobs[variant]
        original = dict(_leaves(exported))
        for leaf_path, value in _leaves(read_cact(path).params):
            if _is_quantized_leaf(leaf_path):
                reference = original[leaf_path]
                error = np.linalg.norm(value - reference) / np.linalg.norm(reference)
                assert error < limit, (variant, "/".join(leaf_path), error)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_tree_maps_to_hf_names(blobs, variant):
    path, exported = blobs[variant]
    model = read_cact(path)
    flags = optional_heads_in_native(model.params)
    assert not flags["use_mtp_head"]
    assert model.heads == tuple(head for head in ("contrastive_head", "confidence_head") if head in exported)
    config = NeedleConfig.from_needle_config(model.config, **flags)
    assert (config.vocab_size, config.hidden_size, config.attention_dim, config.num_hidden_layers) == (800, 64, 64, 3)
    assert (config.engram_layers, config.engram_orders, config.engram_num_tables, config.engram_slots) == ([0, 2], [2, 3], 2, 64)
    if flags["use_contrastive_head"]:
        assert config.contrastive_dim == CONFIG["contrastive_dim"]
    hf = native_to_hf(model.params, config)
    assert sorted(hf) == sorted(spec.hf_name for spec in weight_specs(config))
    # Every HF tensor is the blob's stored tensor (HF weights are [out, in] like the blob), sliced per layer.
    _, tensors = read_cact_tensors(path)
    stored = {record.name: value for record, value in tensors}
    expected = {"model.embed_tokens.weight": stored["embedding"], "model.norm.weight": stored["final_norm"]}
    per_layer = {"input_layernorm.weight": "norm_in", "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj",
                 "self_attn.v_proj.weight": "v_proj", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
                 "self_attn.gate_proj.weight": "gate_proj", "self_attn.o_proj.weight": "out_proj",
                 "post_attention_layernorm.weight": "post_norm", "pre_feedforward_layernorm.weight": "pre_hada",
                 "mlp.diag_in": "d1", "mlp.diag_hidden": "d2", "mlp.diag_out": "d3"}
    lanes = CONFIG.get("mhc_lanes", 4)
    for layer in range(3):
        prefix = f"model.layers.{layer}."
        expected.update({prefix + hf_name: stored[f"layer{layer:02d}.{name}"] for hf_name, name in per_layer.items()})
        expected[prefix + "attention_gate"] = stored[f"layer{layer:02d}.attn_gate"].reshape(())
        for kind, rows in (("pre", lanes), ("post", lanes), ("res", lanes * lanes)):
            expected[prefix + f"hyper_connection.{kind}_proj.weight"] = stored[f"mhc_phi_{kind}"][layer * rows : (layer + 1) * rows]
            expected[prefix + f"hyper_connection.{kind}_bias"] = stored[f"mhc_b_{kind}"][layer]
            expected[prefix + f"hyper_connection.{kind}_alpha"] = stored[f"mhc_a_{kind}"][layer]
    for site in range(2):
        prefix = f"model.engrams.{site}."
        expected[prefix + "tables"] = stored[f"engram{site}.tables"].reshape(config.engram_num_tables, config.engram_slots, -1)
        expected[prefix + "key_proj.weight"] = stored[f"engram{site}.key_proj"]
        expected[prefix + "value_proj.weight"] = stored[f"engram{site}.value_proj"]
        expected[prefix + "conv_taps"] = stored[f"engram{site}.taps"]
    for head in model.heads:
        expected[f"{head}.probes"] = stored[f"{head}.probes"]
        expected[f"{head}.proj.weight"] = stored[f"{head}.proj"]
    if "confidence_head" in model.heads:
        expected["confidence_head.proj.bias"] = stored["confidence_head.bias"]
    if "contrastive_head" in model.heads:
        expected["contrastive_head.log_temperature"] = np.float32(math.log(0.07))
    assert sorted(expected) == sorted(hf)
    for name, value in expected.items():
        np.testing.assert_array_equal(hf[name], value, err_msg=name)


def test_config_carries_header_metadata(blobs):
    model = read_cact(blobs["w4_tokenizer"][0])
    assert model.config["kv_window"] == 160 and model.config["kv_bits"] == 8
    assert model.config["rope_theta"] == 100000.0
    assert model.config["engram_heads"] == 1


def test_tokenizer_table_matches_sentencepiece(blobs, tokenizer):
    from needle.model.export import parse_tokenizer_blob

    model = read_cact(blobs["w4_tokenizer"][0])
    table = model.tokenizer_table
    sp = tokenizer.sp
    assert len(table["pieces"]) == sp.GetPieceSize() == FIXTURE_VOCAB_SIZE
    assert table["pieces"] == [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
    assert table["scores"] == [float(np.float32(sp.GetScore(i))) for i in range(sp.GetPieceSize())]
    assert (table["pad_id"], table["eos_id"], table["bos_id"], table["unk_id"]) == (0, 1, 2, 3)
    assert table["add_dummy_prefix"] and table["byte_fallback"]
    assert table["types"][:4] == [2, 2, 2, 1]  # pad/eos/bos control, unk unknown
    assert table["types"][4:14] == [3] * 10  # the chat markers are user-defined symbols
    assert table["pieces"][4] == "<|im_start|>"
    assert sum(kind == 4 for kind in table["types"]) == 256  # byte fallback pieces
    _, tensors = read_cact_tensors(blobs["w4_tokenizer"][0])
    assert table == parse_tokenizer_blob(tensors[-1][1])
    assert read_cact(blobs["w2_group32"][0]).tokenizer_table is None


@pytest.mark.full_size
def test_needle2_geometry_blob_reads_exactly(tmp_path):
    """The released geometry (27 layers, d=512, 8192 vocab, 2 hash heads per order): parity and mapping."""
    from needle.model.export import read_export, write_export

    exported = make_native_params(BASE_NATIVE_CONFIG, seed=5, with_heads=True)
    path = tmp_path / "base.cact"
    write_export(exported, reference_config(BASE_NATIVE_CONFIG), str(path), bits=4)
    _, expected = read_export(str(path))
    geometry, ours = read_cact_tensors(path)
    assert geometry.num_tensors == len(expected) == 1 + 14 * 27 + 9 + 4 * 2 + 1 + 7
    for (record, got), want in zip(ours, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=record.name)
    model = read_cact(path)
    config = NeedleConfig.from_needle_config(model.config, **optional_heads_in_native(model.params))
    assert (config.hidden_size, config.num_hidden_layers, config.engram_num_heads, config.engram_num_tables) == (512, 27, 2, 4)
    assert config.vocab_size == 8192 and config.engram_slots == 8192 and config.engram_layers == [2, 15]
    hf = native_to_hf(model.params, config)
    # 44,938,997 parameters, minus the MTP head (1,577,089), plus both probe heads (264,193 + 8,193).
    assert sum(value.size for value in hf.values()) == 43_634_294
    original = dict(_leaves(exported))
    for leaf_path, value in _leaves(model.params):
        if not _is_quantized_leaf(leaf_path) and leaf_path != ("contrastive_head", "log_temp"):
            np.testing.assert_array_equal(value, original[leaf_path].astype(np.float16).astype(np.float32))


# ------------------------------------------------------------------------------------------------
# Damaged blobs.


@pytest.fixture(scope="module")
def good_blob(blobs):
    path = blobs["w4_tokenizer"][0]
    _, tensors = read_cact_tensors(path)
    return path.read_bytes(), [record for record, _ in tensors]


def _patched(data: bytes, position: int, fmt: str, value) -> bytes:
    buffer = bytearray(data)
    struct.pack_into(fmt, buffer, position, value)
    return bytes(buffer)


def _record_field(index: int, field: str) -> int:
    return HEADER_BYTES + 4 * CODEBOOK_FLOATS + RECORD_BYTES * index + RECORD_FIELD_OFFSET[field]


def _read_bytes(tmp_path, data: bytes):
    path = tmp_path / "damaged.cact"
    path.write_bytes(data)
    return read_cact(path)


def test_truncation_is_reported_at_every_cut(good_blob, tmp_path):
    data, records = good_blob
    directory_end = HEADER_BYTES + 4 * CODEBOOK_FLOATS + RECORD_BYTES * len(records)
    cuts = {
        0: "tag",
        3: "tag",
        60: "shorter than the 120-byte header",
        HEADER_BYTES + 40: "codebooks end",
        directory_end - 10: "directory",
        records[0].offset + 17: r"record 0 \(embedding\).*past the end",
        records[30].offset + 1: "past the end",
        len(data) // 2: "past the end",
        len(data) - 1: r"\(tokenizer\).*past the end",
    }
    for cut, message in cuts.items():
        with pytest.raises(CactFormatError, match=message):
            _read_bytes(tmp_path, data[:cut])


def test_bad_tag(good_blob, tmp_path):
    data, _ = good_blob
    with pytest.raises(CactFormatError, match="not a .cact blob: tag 0xDEADBEEF, expected 0x05E12A83"):
        _read_bytes(tmp_path, _patched(data, 0, "<I", 0xDEADBEEF))


def test_offset_past_end_of_file(good_blob, tmp_path):
    data, records = good_blob
    past_the_end = -(-len(data) // 64) * 64 + 64  # aligned, so only the bounds check can object
    damaged = _patched(data, _record_field(5, "offset"), "<Q", past_the_end)
    with pytest.raises(CactFormatError, match=rf"record 5 \({records[5].name}\): bytes .* lie past the end"):
        _read_bytes(tmp_path, damaged)


def test_unknown_dtype_code(good_blob, tmp_path):
    data, records = good_blob
    with pytest.raises(CactFormatError, match=r"record 7 \(layer00.gate_proj\): unknown dtype code 9"):
        _read_bytes(tmp_path, _patched(data, _record_field(7, "dtype"), "<B", 9))


@pytest.mark.parametrize(
    "delta, message",
    [
        (-2, "header says 67 tensors, which does not fit a model with 3 layers and 2 engram sites"),
        (+1, "header says 70 tensors, which does not fit a model with 3 layers and 2 engram sites"),
        # 74 would fit four heads, but the longer directory then overlaps the first tensor.
        (+5, r"record 0 \(embedding\): offset \d+ points into the header/directory.*wrong num_tensors"),
    ],
)
def test_wrong_tensor_count(good_blob, tmp_path, delta, message):
    data, records = good_blob
    damaged = _patched(data, 4, "<I", len(records) + delta)
    with pytest.raises(CactFormatError, match=message):
        _read_bytes(tmp_path, damaged)


def test_a_count_one_short_does_not_drop_the_tokenizer(good_blob, tmp_path):
    """One record fewer would leave the tokenizer's bytes unclaimed at the end: refused, not dropped."""
    data, records = good_blob
    with pytest.raises(CactFormatError, match=r"byte\(s\) after the last record .* num_tensors .* too small"):
        _read_bytes(tmp_path, _patched(data, 4, "<I", len(records) - 1))


def test_inconsistent_records_are_reported(good_blob, tmp_path):
    data, records = good_blob
    cases = [
        (_patched(data, _record_field(1, "shape0"), "<I", 65), r"record 1 \(layer00.norm_in\): shape \(65,\), expected \(64,\)"),
        (_patched(data, _record_field(0, "nbytes"), "<Q", records[0].nbytes + 2),
         r"record 0 \(embedding\): \d+ bytes, expected \d+ for a CQ \(800, 64\) at 4 bits, group 128"),
        (_patched(data, _record_field(3, "offset"), "<Q", records[3].offset + 8), "not 64-byte aligned"),
        (_patched(data, _record_field(3, "offset"), "<Q", records[2].offset), "overlap"),
        (_patched(data, _record_field(3, "offset"), "<Q", 64), "points into the header/directory"),
        (_patched(data, 4 * 12, "<I", 128), "hada_n 128, expected 64"),
        (_patched(data, 4 * 2, "<I", 30), "codebook_len 30, expected 28"),
        (_patched(data, HEADER_BYTES + 4, "<f", -5.0), "2-bit codebook .* strictly increasing"),
    ]
    for damaged, message in cases:
        with pytest.raises(CactFormatError, match=message):
            _read_bytes(tmp_path, damaged)


def test_corrupt_head_manifest_and_contrastive_bias(good_blob, tmp_path):
    data, records = good_blob
    manifest = next(r for r in records if r.name == "heads.manifest")
    with pytest.raises(CactFormatError, match=r"heads.manifest\): head codes \[3.0, 2.0\]"):
        _read_bytes(tmp_path, _patched(data, manifest.offset, "<e", 3.0))
    bias = next(r for r in records if r.name == "contrastive_head.bias")
    with pytest.raises(CactFormatError, match="contrastive_head.bias is non-zero"):
        _read_bytes(tmp_path, _patched(data, bias.offset, "<e", 0.5))
    norm = next(r for r in records if r.name == "layer01.q_norm")
    with pytest.raises(CactFormatError, match=r"record \d+ \(layer01.q_norm\): non-finite values"):
        _read_bytes(tmp_path, _patched(data, norm.offset, "<e", float("inf")))
    tokenizer = records[-1]
    with pytest.raises(CactFormatError, match="tokenizer.*801 pieces, expected the vocabulary size 800"):
        _read_bytes(tmp_path, _patched(data, tokenizer.offset, "<I", 801))


def test_invalid_ternary_code_is_reported(blobs, tmp_path):
    path = blobs["mixed_ternary"][0]
    _, tensors = read_cact_tensors(path)
    ternary = next(record for record, _ in tensors if record.bits == 5)
    with pytest.raises(CactFormatError, match=rf"\({ternary.name}\): ternary crumb value 2"):
        _read_bytes(tmp_path, _patched(path.read_bytes(), ternary.offset, "<B", 0b10101010))


# ------------------------------------------------------------------------------------------------
# Detection by content.


def test_detect_source_format_by_content(blobs, params, tmp_path):
    from safetensors.numpy import save_file

    cact_path = blobs["w4_tokenizer"][0]
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(cact_path.read_bytes())
    assert is_cact(renamed) and detect_source_format(renamed) == SourceFormat.CACT
    assert not is_native_checkpoint(renamed)

    pkl = tmp_path / "model.cact"  # a misleading extension: content decides
    write_native_checkpoint(pkl, params, CONFIG)
    assert not is_cact(pkl) and is_native_checkpoint(pkl)
    assert detect_source_format(pkl) == SourceFormat.NATIVE_CHECKPOINT

    safetensors_path = tmp_path / "model.safetensors"
    save_file({"model.norm.weight": np.zeros(4, np.float32)}, str(safetensors_path))
    assert detect_source_format(safetensors_path) == SourceFormat.SAFETENSORS

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "needle2"}')
    assert detect_source_format(hf_dir) == SourceFormat.HF_DIRECTORY

    unknown = tmp_path / "notes.txt"
    unknown.write_text("hello")
    with pytest.raises(UnknownSourceFormatError, match="unrecognised content"):
        detect_source_format(unknown)
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    with pytest.raises(UnknownSourceFormatError, match="without config.json"):
        detect_source_format(empty_dir)
    with pytest.raises(FileNotFoundError):
        detect_source_format(tmp_path / "missing")
