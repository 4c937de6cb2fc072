"""`needle-hf convert` and `needle-hf export`, end to end against the reference.

Sources are made the reference's way (its parameter tree with every leaf perturbed, pickled as it
pickles them; `.cact` blobs from its own `write_export`); the checks use its forward pass, its
`read_export` dequantization, its `load_checkpoint` and its `write_export`. Every conversion goes
through the command-line entry point `needle_hf.cli.main`.
"""

import hashlib
import json
import math

import numpy as np
import pytest
import sentencepiece
from safetensors import safe_open

import needle_hf
from needle_hf.cli import main
from needle_hf.conversion.cact import read_cact_tensors
from needle_hf.models.needle.weight_names import native_to_hf, weight_specs
from needle_reference import (
    BASE_NATIVE_CONFIG,
    TINY_NATIVE_CONFIG,
    make_native_params,
    reference_config,
    reference_heads,
    reference_logits,
    write_native_checkpoint,
)
from spm_fixture import FIXTURE_VOCAB_SIZE

# The tiny geometry with the fixture tokenizer's vocabulary.
CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE)
LOGIT_TOLERANCE = 1e-4
TEXTS = (
    "Set an alarm for 7:30 tomorrow and text Bob that I'm late.",
    "Le café est très chaud; 今天天气很好 🎉",
    "columns    aligned\twith\n\nspaces ",
    '<tool_call>[{"name":"set_alarm","arguments":{"hour":7}}]</tool_call><|im_end|>',
    "fraktur 𝔘𝔫𝔦 needs byte fallback",
)


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _read_safetensors(path):
    with safe_open(str(path), framework="numpy") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata()


def _tokens(seed, shape, vocab):
    return np.random.default_rng(seed).integers(4, vocab, shape).astype(np.int32)


def _convert(*args):
    assert main(["convert", *map(str, args)]) == 0


@pytest.fixture(scope="module")
def params():
    return make_native_params(CONFIG, seed=7, with_heads=True)


@pytest.fixture(scope="module")
def checkpoint(params, tmp_path_factory):
    path = tmp_path_factory.mktemp("source") / "needle2-tiny.pkl"
    write_native_checkpoint(path, params, CONFIG, step=1234)
    return path


@pytest.fixture(scope="module")
def converted(checkpoint, needle_spm_model, tmp_path_factory):
    """The checkpoint converted as float32, its logits checked with the Flax model (`--verify-with auto`)."""
    out = tmp_path_factory.mktemp("converted") / "needle2-hf"
    _convert(checkpoint, out, "--tokenizer", needle_spm_model, "--verify-with", "auto")
    return out


@pytest.fixture(scope="module")
def flax_model(converted):
    from transformers import FlaxAutoModelForCausalLM

    return FlaxAutoModelForCausalLM.from_pretrained(str(converted))


# ------------------------------------------------------------------------------------------------
# .pkl -> HF


def _jitted(model, method: str, **kwargs):
    """A model method compiled once (eager Flax calls re-trace the layer scan every time)."""
    import jax

    return jax.jit(lambda params, tokens: getattr(model, method)(tokens, params=params, **kwargs))


def test_converted_flax_logits_equal_the_reference(flax_model, params):
    tokens = _tokens(0, (2, 20), CONFIG["vocab_size"])
    expected_logits, expected_mtp = reference_logits(CONFIG, params, tokens)
    outputs = _jitted(flax_model, "__call__", output_mtp_logits=True)(flax_model.params, tokens)
    np.testing.assert_allclose(np.asarray(outputs.logits), expected_logits, rtol=0, atol=LOGIT_TOLERANCE)
    np.testing.assert_allclose(np.asarray(outputs.mtp_logits), expected_mtp, rtol=0, atol=LOGIT_TOLERANCE)


def test_converted_heads_equal_the_reference(flax_model, params):
    tokens = _tokens(1, (2, 12), CONFIG["vocab_size"])
    tokens[1, -3:] = 0  # trailing padding: the heads pool over real tokens only
    expected_embedding, expected_confidence = reference_heads(CONFIG, params, tokens)
    embedding, log_temperature = _jitted(flax_model, "contrastive_embedding")(flax_model.params, tokens)
    np.testing.assert_allclose(np.asarray(embedding), expected_embedding, rtol=0, atol=LOGIT_TOLERANCE)
    assert np.float32(log_temperature) == params["contrastive_head"]["log_temp"]
    confidence = _jitted(flax_model, "confidence_logit")(flax_model.params, tokens)
    np.testing.assert_allclose(np.asarray(confidence), expected_confidence, rtol=0, atol=LOGIT_TOLERANCE)


def test_folder_holds_config_generation_config_and_the_native_tensors(converted, params):
    from transformers import AutoConfig, GenerationConfig

    from needle_hf.models.needle.remote_code import remote_code_files

    # The model code every Auto class needs (the modeling files and their imports, recursively), the
    # weights, the configs, the tokenizer, the chat template and the conversion report; nothing else.
    code = {path.name for paths in remote_code_files().values() for path in paths}
    assert {"configuration_needle.py", "modeling_needle.py", "modeling_flax_needle.py", "specification_needle.py",
            "weight_names.py"} <= code
    assert sorted(p.name for p in converted.iterdir()) == sorted(code | {
        "chat_template.jinja", "config.json", "conversion_report.json", "generation_config.json", "model.safetensors",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"})
    config = AutoConfig.from_pretrained(str(converted))
    assert config.model_type == "needle2" and config.architectures == ["NeedleForCausalLM"]
    assert json.loads((converted / "config.json").read_text())["dtype"] == "float32"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 3, FIXTURE_VOCAB_SIZE)
    assert config.use_mtp_head and config.use_contrastive_head and config.use_confidence_head
    generation = GenerationConfig.from_pretrained(str(converted))
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (2, 1, 0)

    tensors, metadata = _read_safetensors(converted / "model.safetensors")
    assert metadata == {"format": "pt"}
    expected = native_to_hf(params, config)
    assert sorted(tensors) == sorted(spec.hf_name for spec in weight_specs(config)) == sorted(expected)
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32 and tensors[name].shape == value.shape, name
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


def test_report_records_provenance_and_the_measured_parity(converted, checkpoint):
    report = json.loads((converted / "conversion_report.json").read_text())
    assert report["converter"] == {"name": "needle-hf", "version": needle_hf.__version__}
    source = report["source"]
    assert source["sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    assert (source["format"], source["step"], source["run"], source["dtype"]) == ("native-checkpoint", 1234, {"stage": "test"}, "float32")
    output = report["output"]
    assert output["tensors"] == 102 and output["safetensors_bytes"] == (converted / "model.safetensors").stat().st_size
    verification = report["verification"]
    assert verification["tensors_bit_exact"] and verification["backend"] == "flax"
    assert 0 <= verification["max_abs_logit_diff"] <= verification["tolerance"] < 1e-3
    assert 0 <= verification["max_abs_mtp_logit_diff"] <= verification["tolerance"]
    assert verification["output_dtype_rounding_max_abs_logit_change"] is None  # float32 -> float32
    assert report["tokenizer"]["vocab_size"] == FIXTURE_VOCAB_SIZE


def test_tokenizer_from_model_file_gives_sentencepiece_ids(converted, needle_spm_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    processor = sentencepiece.SentencePieceProcessor(model_file=needle_spm_model)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == [2] + processor.encode(text), text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "wake me at 7"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_bfloat16_output_holds_the_rounded_tensors_and_records_the_rounding(checkpoint, params, needle_spm_model, tmp_path):
    import ml_dtypes

    out = tmp_path / "bf16"
    _convert(checkpoint, out, "--tokenizer", needle_spm_model, "--dtype", "bfloat16", "--verify-with", "torch")
    tensors, _ = _read_safetensors(out / "model.safetensors")
    config = needle_hf.NeedleConfig.from_pretrained(str(out))
    for name, value in native_to_hf(params, config).items():
        assert tensors[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(tensors[name].view(np.uint16), value.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    verification = json.loads((out / "conversion_report.json").read_text())["verification"]
    assert verification["backend"] == "torch" and verification["max_abs_logit_diff"] <= verification["tolerance"]
    assert 0 < verification["output_dtype_rounding_max_abs_logit_change"] < 0.5


def test_float16_checkpoint_stays_float16_by_default(params, tmp_path):
    half = {path: value for path, value in _leaves(params)}
    tree: dict = {}
    for path, value in half.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value.astype(np.float16)
    source = tmp_path / "averaged-fp16.pkl"
    write_native_checkpoint(source, tree, CONFIG)
    out = tmp_path / "fp16"
    _convert(source, out)
    tensors, _ = _read_safetensors(out / "model.safetensors")
    assert {value.dtype for value in tensors.values()} == {np.dtype(np.float16)}
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["output"]["dtype"] == report["source"]["dtype"] == "float16"
    assert report["verification"] == {"tensors_bit_exact": True, "max_abs_logit_diff": None}


# ------------------------------------------------------------------------------------------------
# .cact -> HF

# HF name suffix -> the record of a layer that holds it (record names as `read_cact_tensors` gives them).
_LAYER_RECORDS = {
    "input_layernorm.weight": "norm_in", "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "self_attn.gate_proj.weight": "gate_proj", "self_attn.o_proj.weight": "out_proj",
    "post_attention_layernorm.weight": "post_norm", "pre_feedforward_layernorm.weight": "pre_hada",
    "mlp.diag_in": "d1", "mlp.diag_hidden": "d2", "mlp.diag_out": "d3",
}


def _reference_dequantized_hf_tensors(blob, config):
    """The HF tensors the reference's `read_export` implies: its values, named by record position."""
    from needle.model.export import read_export

    _, reference_values = read_export(str(blob))
    _, records = read_cact_tensors(blob)
    stored = {record.name: value for (record, _), value in zip(records, reference_values)
              if not isinstance(value, (bytes, bytearray))}
    lanes = config.hyper_connection_lanes
    hf = {"model.embed_tokens.weight": stored["embedding"], "model.norm.weight": stored["final_norm"]}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        hf.update({prefix + name: stored[f"layer{layer:02d}.{record}"] for name, record in _LAYER_RECORDS.items()})
        hf[prefix + "attention_gate"] = stored[f"layer{layer:02d}.attn_gate"].reshape(())
        for kind, rows in (("pre", lanes), ("post", lanes), ("res", lanes * lanes)):
            hf[prefix + f"hyper_connection.{kind}_proj.weight"] = stored[f"mhc_phi_{kind}"][layer * rows:(layer + 1) * rows]
            hf[prefix + f"hyper_connection.{kind}_bias"] = stored[f"mhc_b_{kind}"][layer]
            hf[prefix + f"hyper_connection.{kind}_alpha"] = stored[f"mhc_a_{kind}"][layer]
    for site in range(len(config.engram_layers)):
        prefix = f"model.engrams.{site}."
        hf[prefix + "tables"] = stored[f"engram{site}.tables"].reshape(config.engram_num_tables, config.engram_slots, -1)
        hf[prefix + "key_proj.weight"] = stored[f"engram{site}.key_proj"]
        hf[prefix + "value_proj.weight"] = stored[f"engram{site}.value_proj"]
        hf[prefix + "conv_taps"] = stored[f"engram{site}.taps"]
    for head in ("contrastive_head", "confidence_head"):
        hf[f"{head}.probes"] = stored[f"{head}.probes"]
        hf[f"{head}.proj.weight"] = stored[f"{head}.proj"]
    hf["confidence_head.proj.bias"] = stored["confidence_head.bias"]
    hf["contrastive_head.log_temperature"] = np.float32(math.log(0.07))  # not in a blob: the reference's initial value
    return hf


@pytest.mark.parametrize("bits, group, verify", [(4, 128, "--verify-with=flax"), (2, 32, None)])
def test_cact_weights_equal_the_reference_dequantization(params, needle_spm_model, tmp_path, bits, group, verify):
    from needle.model.export import write_export
    from needle.model.tokenizer import SANTokenizer

    blob = tmp_path / f"needle2-w{bits}.cact"
    write_export(params, reference_config(CONFIG), str(blob), bits=bits, group=group, tokenizer=SANTokenizer(str(needle_spm_model)))
    out = tmp_path / "hf"
    _convert(blob, out, *([verify] if verify else []))
    tensors, _ = _read_safetensors(out / "model.safetensors")
    config = needle_hf.NeedleConfig.from_pretrained(str(out))
    assert not config.use_mtp_head and config.use_contrastive_head and config.use_confidence_head
    expected = _reference_dequantized_hf_tensors(blob, config)
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32, name
        np.testing.assert_allclose(tensors[name], value, rtol=0, atol=1e-6, err_msg=name)
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["source"]["format"] == "cact" and report["source"]["filled_defaults"] == ["contrastive_head/log_temp"]
    assert report["tokenizer"]["source"] == f"embedded in {blob.name}"
    if verify == "--verify-with=flax":
        assert report["verification"]["max_abs_logit_diff"] <= report["verification"]["tolerance"]
        assert report["verification"]["max_abs_mtp_logit_diff"] is None


def test_tokenizer_embedded_in_cact_gives_sentencepiece_ids(params, needle_spm_model, tmp_path):
    from needle.model.export import write_export
    from needle.model.tokenizer import SANTokenizer
    from transformers import AutoTokenizer

    blob = tmp_path / "with-tokenizer.cact"
    write_export(params, reference_config(CONFIG), str(blob), bits=4, tokenizer=SANTokenizer(str(needle_spm_model)))
    out = tmp_path / "hf"
    _convert(blob, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    processor = sentencepiece.SentencePieceProcessor(model_file=needle_spm_model)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == [2] + processor.encode(text), text


# ------------------------------------------------------------------------------------------------
# HF -> .pkl


def test_export_loads_in_the_reference_with_every_tensor_identical(converted, params, needle_spm_model, tmp_path):
    from needle.model.export import read_export, write_export
    from needle.model.run import load_checkpoint
    from needle.model.tokenizer import SANTokenizer

    exported = tmp_path / "exported.pkl"
    assert main(["export", str(converted), str(exported)]) == 0
    loaded, config = load_checkpoint(str(exported))
    got, want = dict(_leaves(loaded)), dict(_leaves(params))
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        assert isinstance(got[path], np.ndarray) and got[path].dtype == value.dtype, path
        np.testing.assert_array_equal(got[path], value, err_msg="/".join(path))
    original = reference_config(CONFIG)
    for field in ("vocab_size", "d_model", "attn_dim", "num_heads", "num_kv_heads", "num_layers", "max_seq_len",
                  "contrastive_dim", "rope_theta", "engram_orders", "engram_heads", "engram_slots", "engram_layers",
                  "mhc_lanes", "kv_window", "kv_bits", "act_bits", "weight_bits"):
        assert getattr(config, field) == getattr(original, field), field

    # The reference's exporter accepts it, and ships exactly what it ships from the original checkpoint.
    tokenizer = SANTokenizer(str(needle_spm_model))
    from_export, from_original = tmp_path / "from-export.cact", tmp_path / "from-original.cact"
    write_export(loaded, config, str(from_export), bits=4, tokenizer=tokenizer)
    write_export(params, original, str(from_original), bits=4, tokenizer=tokenizer)
    assert from_export.read_bytes() == from_original.read_bytes()
    assert len(read_export(str(from_export))[1]) > 0


# ------------------------------------------------------------------------------------------------
# The Needle 2 geometry.


@pytest.mark.full_size
def test_needle2_geometry_converts_with_reference_parity_and_exports_back(tmp_path):
    from needle.model.run import load_checkpoint

    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    params = make_native_params(BASE_NATIVE_CONFIG, seed=3, with_heads=True)
    source = tmp_path / "needle2-base.pkl"
    write_native_checkpoint(source, params, BASE_NATIVE_CONFIG)
    out = tmp_path / "hf"
    _convert(source, out, "--verify-with", "flax")
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["output"]["parameters"] == 44_938_997 + 264_193 + 8_193  # plus both probe heads
    assert report["verification"]["max_abs_logit_diff"] <= report["verification"]["tolerance"]

    model = FlaxNeedleForCausalLM.from_pretrained(str(out))
    tokens = _tokens(2, (1, 24), 8192)
    expected_logits, expected_mtp = reference_logits(BASE_NATIVE_CONFIG, params, tokens)
    outputs = _jitted(model, "__call__", output_mtp_logits=True)(model.params, tokens)
    np.testing.assert_allclose(np.asarray(outputs.logits), expected_logits, rtol=0, atol=LOGIT_TOLERANCE)
    np.testing.assert_allclose(np.asarray(outputs.mtp_logits), expected_mtp, rtol=0, atol=LOGIT_TOLERANCE)
    expected_embedding, expected_confidence = reference_heads(BASE_NATIVE_CONFIG, params, tokens)
    embedding, _ = _jitted(model, "contrastive_embedding")(model.params, tokens)
    np.testing.assert_allclose(np.asarray(embedding), expected_embedding, rtol=0, atol=LOGIT_TOLERANCE)
    confidence = _jitted(model, "confidence_logit")(model.params, tokens)
    np.testing.assert_allclose(np.asarray(confidence), expected_confidence, rtol=0, atol=LOGIT_TOLERANCE)

    exported = tmp_path / "exported.pkl"
    assert main(["export", str(out), str(exported)]) == 0
    loaded, _ = load_checkpoint(str(exported))
    got = dict(_leaves(loaded))
    for path, value in _leaves(params):
        np.testing.assert_array_equal(got[path], value, err_msg="/".join(path))


# ------------------------------------------------------------------------------------------------
# The streamed safetensors writer and its byte-for-byte check.


def test_streamed_safetensors_read_back_by_safetensors_and_checked_byte_for_byte(tmp_path):
    import ml_dtypes
    from safetensors import safe_open

    from needle_hf.conversion.safetensors_stream import (
        SafetensorsMismatchError,
        check_safetensors_bytes,
        write_safetensors,
    )

    rng = np.random.default_rng(0)
    stacked = rng.standard_normal((3, 5, 7)).astype(np.float32)
    tensors = {
        "b.transposed_view": stacked[1].T,  # non-contiguous: written in C order of the view
        "a.half": rng.standard_normal(6).astype(np.float16),
        "c.bf16": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
        "d.scalar": np.asarray(0.5, np.float32),
    }
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert sorted(handle.keys()) == sorted(tensors)
        for name, want in tensors.items():
            got = handle.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got.astype(np.float32), np.asarray(want, np.float32))
    check_safetensors_bytes(path, tensors, metadata={"format": "pt"})

    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # last byte of the last tensor in name order
    path.write_bytes(bytes(data))
    with pytest.raises(SafetensorsMismatchError, match="tensor d.scalar does not read back bit-exactly"):
        check_safetensors_bytes(path, tensors, metadata={"format": "pt"})
    with pytest.raises(SafetensorsMismatchError, match="header"):
        check_safetensors_bytes(path, {**tensors, "e.extra": np.zeros(1, np.float32)}, metadata={"format": "pt"})
