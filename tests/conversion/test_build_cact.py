"""`needle-hf build`: an HF folder -> the `.cact` the reference's `write_export` writes, byte for byte.

Each HF folder is converted (`needle-hf convert`) from a reference checkpoint whose every leaf is
perturbed; the reference then exports the same native tree with its own `write_export` (its
tokenizer class around the session's SentencePiece model, its `effective_kv_window`), and the
two files must be identical.
"""

import numpy as np
import pytest

from needle_hf.cli import main
from needle_hf import numerics
from needle_hf.conversion.cact import read_cact_tensors
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config, write_native_checkpoint
from spm_fixture import FIXTURE_VOCAB_SIZE

# Deployment metadata the header must carry: a window below the KV budget's, 4-bit KV, and the
# weight_bits map the build falls back to when no width is given.
CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE, kv_window=64, kv_bits=4, weight_bits="attn.out_proj=2,default=3")
PLAIN_CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE)
MIXED = "attn.q_proj=3,attn.v_proj=1.58,engram=2,mhc_phi_res=2,default=4"
HEADS = ("contrastive_head", "confidence_head")

# variant -> (build arguments, write_export arguments)
WITH_HEADS = {
    "config_weight_bits": ([], dict(bits_map="attn.out_proj=2,default=3")),
    "w4": (["--bits", "4"], dict(bits=4)),
    "w3": (["--bits", "3"], dict(bits=3)),
    "w2": (["--bits", "2"], dict(bits=2)),
    "mixed_with_ternary": (["--bits-map", MIXED], dict(bits_map=MIXED)),
    "ternary": (["--bits-map", "default=1.58"], dict(bits_map="default=1.58")),
}


def _convert(tmp_path_factory, native, params, spm, name):
    folder = tmp_path_factory.mktemp(name)
    checkpoint = folder / "native.pkl"
    write_native_checkpoint(checkpoint, params, native)
    assert main(["convert", str(checkpoint), str(folder / "hf"), "--tokenizer", str(spm)]) == 0
    return folder / "hf"


@pytest.fixture(scope="module")
def params():
    return make_native_params(CONFIG, seed=5, with_heads=True)


@pytest.fixture(scope="module")
def plain_params(params):
    return {key: value for key, value in params.items() if key not in HEADS}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, params, needle_spm_model):
    return _convert(tmp_path_factory, CONFIG, params, needle_spm_model, "heads")


@pytest.fixture(scope="module")
def plain_hf_dir(tmp_path_factory, plain_params, needle_spm_model):
    return _convert(tmp_path_factory, PLAIN_CONFIG, plain_params, needle_spm_model, "plain")


@pytest.fixture(scope="module")
def reference_tokenizer(needle_spm_model):
    from needle.model.tokenizer import SANTokenizer

    return SANTokenizer(str(needle_spm_model))


def _reference_blob(path, params, native, tokenizer, **kwargs):
    """What `needle build` writes: write_export with the reference's derived window."""
    from needle.model.architecture import effective_kv_window
    from needle.model.export import write_export

    config = reference_config(native)
    write_export(params, config, str(path), tokenizer=tokenizer, kv_window=effective_kv_window(config), **kwargs)
    return path.read_bytes()


def _build(hf_dir, out, *args):
    assert main(["build", str(hf_dir), str(out), *map(str, args)]) == 0
    return out.read_bytes()


@pytest.mark.parametrize("variant", sorted(WITH_HEADS))
def test_build_equals_reference_write_export_byte_for_byte(variant, hf_dir, params, reference_tokenizer, tmp_path):
    arguments, reference_kwargs = WITH_HEADS[variant]
    ours = _build(hf_dir, tmp_path / "ours.cact", *arguments)
    reference = _reference_blob(tmp_path / "reference.cact", params, CONFIG, reference_tokenizer, **reference_kwargs)
    assert len(ours) == len(reference)
    assert ours == reference


def test_build_without_heads_and_with_the_budget_window(plain_hf_dir, plain_params, reference_tokenizer, tmp_path):
    ours = _build(plain_hf_dir, tmp_path / "ours.cact")
    assert ours == _reference_blob(tmp_path / "reference.cact", plain_params, PLAIN_CONFIG, reference_tokenizer, bits=4)
    geometry, _ = read_cact_tensors(tmp_path / "ours.cact")
    assert (geometry.kv_window, geometry.kv_bits) == (160, 8)  # the KV budget's floor; int8 KV


def test_tokenizer_options(plain_hf_dir, plain_params, reference_tokenizer, needle_spm_model, tmp_path):
    reference = _reference_blob(tmp_path / "reference.cact", plain_params, PLAIN_CONFIG, reference_tokenizer, bits=2)
    assert _build(plain_hf_dir, tmp_path / "model.cact", "--bits", 2, "--tokenizer", needle_spm_model) == reference
    # The tokenizer taken over from an existing blob.
    assert _build(plain_hf_dir, tmp_path / "reuse.cact", "--bits", 2, "--tokenizer", tmp_path / "model.cact") == reference
    no_tokenizer = _reference_blob(tmp_path / "bare_reference.cact", plain_params, PLAIN_CONFIG, None, bits=2)
    assert _build(plain_hf_dir, tmp_path / "bare.cact", "--bits", 2, "--no-tokenizer") == no_tokenizer


def test_reader_reads_the_build_back_as_the_reference_dequantizes_it(hf_dir, tmp_path):
    from needle.model.export import read_export

    _build(hf_dir, tmp_path / "ours.cact", "--bits-map", MIXED)
    meta, expected = read_export(str(tmp_path / "ours.cact"))
    geometry, ours = read_cact_tensors(tmp_path / "ours.cact")
    assert (geometry.kv_window, geometry.kv_bits) == (meta["kv_window"], meta["kv_bits"]) == (64, 4)
    assert len(ours) == len(expected)
    for (record, got), want in zip(ours, expected):
        if isinstance(want, (bytes, bytearray)):
            assert got == want
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=record.name)


def test_codebooks_equal_the_reference_fit():
    from needle.model.quantize import _cq_codebook_np

    for bits in (2, 3, 4, numerics.TERNARY_BITS):
        for group in (32, 128):
            assert numerics.cq_levels(bits, group).tobytes() == _cq_codebook_np(bits, group).tobytes()


def test_bits_map_names_follow_the_reference():
    from needle.model.quantize import _bits_for, parse_bits_map

    spec = "stack/layers/block/self_attn/q_proj/kernel=2,engrams_1/embedding=3,attn.k_proj=1.58,embedding=3,default=4"
    ours, theirs = numerics.parse_bits_map(spec, engram_sites=2), parse_bits_map(spec)
    assert ours == theirs
    names = ["embedding", "layer00.q_proj", "layer02.k_proj", "layer01.out_proj", "mhc_phi_pre",
             "engram0.tables", "engram1.tables", "engram1.key_proj"]
    assert [numerics.bits_for(n, *ours) for n in names] == [_bits_for(n, *theirs) for n in names]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--bits-map", "attn.q_proj=2"], "no default=<bits> entry"),
        (["--bits-map", "attn.q_proj=5,default=4"], "width 5"),
        (["--bits-map", "attn.q_proj,default=4"], "not of the form name=bits"),
        (["--bits", "5"], "--bits 5, expected one of 2, 3, 4"),
        (["--bits", "4", "--bits-map", "default=4"], "not both"),
    ],
)
def test_bad_options_are_one_line_and_leave_no_file(arguments, message, plain_hf_dir, tmp_path, capsys):
    out = tmp_path / "out.cact"
    assert main(["build", str(plain_hf_dir), str(out), *arguments]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("needle-hf build: error:") and message in error
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_without_overwrite(plain_hf_dir, tmp_path, capsys):
    out = tmp_path / "out.cact"
    out.write_bytes(b"keep")
    assert main(["build", str(plain_hf_dir), str(out)]) == 1
    assert "pass --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"keep"
    assert main(["build", str(plain_hf_dir), str(out), "--overwrite", "--bits", "2"]) == 0
    assert out.read_bytes()[:4] == (0x05E12A83).to_bytes(4, "little")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.cact"]


def test_tokenizer_json_with_reordered_merges_asks_for_the_model(plain_hf_dir, tmp_path, capsys):
    import json
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(plain_hf_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["merges"][:2] = spec["model"]["merges"][1::-1]
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    assert main(["build", str(folder), str(tmp_path / "out.cact")]) == 1
    assert "pass the original tokenizer.model with --tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out.cact").exists()


def test_bfloat16_folder_builds_what_the_reference_builds_from_bfloat16_weights(tmp_path, plain_params, needle_spm_model,
                                                                                  reference_tokenizer):
    import ml_dtypes

    checkpoint = tmp_path / "native.pkl"
    write_native_checkpoint(checkpoint, plain_params, PLAIN_CONFIG)
    assert main(["convert", str(checkpoint), str(tmp_path / "hf"), "--tokenizer", str(needle_spm_model),
                 "--dtype", "bfloat16"]) == 0
    rounded = _cast_tree(plain_params, ml_dtypes.bfloat16)
    reference = _reference_blob(tmp_path / "reference.cact", rounded, PLAIN_CONFIG, reference_tokenizer, bits=3)
    assert _build(tmp_path / "hf", tmp_path / "ours.cact", "--bits", 3) == reference


def _cast_tree(tree, dtype):
    return {k: _cast_tree(v, dtype) if isinstance(v, dict) else np.asarray(v).astype(dtype) for k, v in tree.items()}


@pytest.mark.full_size
def test_needle2_geometry_builds_byte_for_byte(tmp_path):
    from needle_reference import BASE_NATIVE_CONFIG

    params = make_native_params(BASE_NATIVE_CONFIG, seed=8, with_heads=True)
    checkpoint = tmp_path / "native.pkl"
    write_native_checkpoint(checkpoint, params, BASE_NATIVE_CONFIG)
    assert main(["convert", str(checkpoint), str(tmp_path / "hf")]) == 0
    checkpoint.unlink()
    reference = _reference_blob(tmp_path / "reference.cact", params, BASE_NATIVE_CONFIG, None, bits=4)
    del params
    assert _build(tmp_path / "hf", tmp_path / "ours.cact", "--no-tokenizer") == reference
    geometry, _ = read_cact_tensors(tmp_path / "ours.cact")
    assert geometry.kv_window == 704  # the 11.5 MB KV budget at the Needle 2 geometry


@pytest.mark.parametrize("head", HEADS)
def test_build_with_one_head(head, tmp_path_factory, params, needle_spm_model, reference_tokenizer, tmp_path):
    one_head = {key: value for key, value in params.items() if key not in set(HEADS) - {head}}
    folder = _convert(tmp_path_factory, PLAIN_CONFIG, one_head, needle_spm_model, head)
    ours = _build(folder, tmp_path / "ours.cact", "--bits", 4)
    assert ours == _reference_blob(tmp_path / "reference.cact", one_head, PLAIN_CONFIG, reference_tokenizer, bits=4)
