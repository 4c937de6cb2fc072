"""Needle 3 conversion is strict: every tensor goes through the one table; bad input is an error that
names the tensor or field, and leaves no folder behind."""

from __future__ import annotations

import json

import numpy as np
import pytest

from needle3_reference import PLAIN_NATIVE_CONFIG, make_native_params, write_reference_checkpoint
from needle_hf.cli import main
from needle_hf.conversion.needle3 import Needle3ConversionError, convert_needle3, is_needle3_checkpoint
from needle_hf.models.needle3.configuration_needle3 import NATIVE_DEFAULTS, Needle3Config
from needle_hf.models.needle3.weight_names_needle3 import Needle3WeightsError, hf_to_native, native_to_hf, weight_specs


@pytest.fixture(scope="module")
def params():
    return make_native_params(PLAIN_NATIVE_CONFIG, seed=9, with_heads=False)


def _flat(params):
    from needle.model.checkpoints import flatten

    return flatten(params)


def _write(path, params, native=PLAIN_NATIVE_CONFIG, **overrides):
    from needle.model.checkpoints import unflatten

    flat = _flat(params)
    for name, value in overrides.items():
        name = name.replace("__", "/")
        if value is None:
            del flat[name]
        else:
            flat[name] = value
    write_reference_checkpoint(path, unflatten(flat), native)
    return path


def test_table_round_trips_the_native_tree(params):
    flat = _flat(params)
    config = Needle3Config.from_needle_config(PLAIN_NATIVE_CONFIG)
    state = native_to_hf(flat, config)
    assert len(state) == len(weight_specs(config))
    back = hf_to_native(state, config)
    assert set(back) == set(flat)
    assert all(np.array_equal(back[name], flat[name]) for name in flat)


def test_unknown_tensor_is_named(tmp_path, params):
    source = _write(tmp_path / "c.safetensors", params, stack__extra_gate=np.zeros(3, np.float32))
    with pytest.raises(Needle3WeightsError, match="stack/extra_gate"):
        convert_needle3(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_tensor_is_named(tmp_path, params):
    source = _write(tmp_path / "c.safetensors", params, stack__layers__block__hadamard_mlp__cond_u=None)
    with pytest.raises(Needle3WeightsError, match="missing tensor 'stack/layers/block/hadamard_mlp/cond_u'"):
        convert_needle3(source, tmp_path / "out")


def test_misshaped_tensor_names_expected_and_found(tmp_path, params):
    source = _write(tmp_path / "c.safetensors", params, stack__final_norm__scale=np.zeros(31, np.float32))
    with pytest.raises(Needle3WeightsError, match=r"stack/final_norm/scale: expected \(32,\), got \(31,\)"):
        convert_needle3(source, tmp_path / "out")


def test_needle2_config_is_refused(tmp_path, params):
    native = {k: v for k, v in PLAIN_NATIVE_CONFIG.items() if k not in ("qk_head_dim", "v_head_dim")}
    source = _write(tmp_path / "c.safetensors", params, native={**native, "attn_dim": 32})
    with pytest.raises(Needle3ConversionError, match="Needle 2"):
        convert_needle3(source, tmp_path / "out")


def test_wrong_format_version_is_refused(tmp_path, params):
    from safetensors.numpy import save_file

    save_file(_flat(params), str(tmp_path / "c.safetensors"), metadata={"format_version": "1", "config": "{}"})
    with pytest.raises(Needle3ConversionError, match="format_version: expected 2, found '1'"):
        convert_needle3(tmp_path / "c.safetensors", tmp_path / "out")


def test_cli_detects_needle3_and_reports_errors_on_one_line(tmp_path, params, capsys):
    good = _write(tmp_path / "good.safetensors", params)
    plain = tmp_path / "plain.safetensors"
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, np.float32)}, str(plain))
    assert is_needle3_checkpoint(good) and not is_needle3_checkpoint(plain)
    assert main(["convert", str(good), str(tmp_path / "hf")]) == 0
    report = json.loads((tmp_path / "hf" / "conversion_report.json").read_text())
    assert report["verification"]["max_abs_logit_diff"] <= 1e-4
    assert "max |dlogit|" in capsys.readouterr().out
    bad = _write(tmp_path / "bad.safetensors", params, embedding__embedding=np.zeros((3, 3), np.float32))
    assert main(["convert", str(bad), str(tmp_path / "hf2")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("needle-hf convert: error: ")
    assert "embedding/embedding: expected (200, 32), got (3, 3)" in errors[0]
    assert not (tmp_path / "hf2").exists()


def test_missing_saved_fields_resolve_as_the_reference_loader():
    """A saved config without the newer fields reads them as off; the rest take the 3.2.8 defaults."""
    from needle.model.architecture import TransformerConfig

    saved = {"d_model": 64, "num_heads": 4, "num_layers": 3, "engram_layers": [0], "vocab_size": 500}
    config = Needle3Config.from_needle_config(saved)
    reference = TransformerConfig.from_saved(dict(saved))
    assert config.sliding_window == reference.sliding_window == 0
    assert config.head_dim == config.value_head_dim == 16  # 0 resolves to d_model // num_heads
    assert config.qkv_conv_taps == reference.qkv_conv_taps == 0
    assert config.engram_slots == reference.engram_slots == NATIVE_DEFAULTS["engram_slots"]
    assert config.num_key_value_heads == reference.num_kv_heads
    defaults = TransformerConfig()
    assert {k: getattr(defaults, k) for k in NATIVE_DEFAULTS} == {
        k: (tuple(v) if isinstance(v, list) else v) for k, v in NATIVE_DEFAULTS.items()}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "must divide num_attention_heads"),
        ({"head_dim": 5}, "must be even"),
        ({"global_layers": [20]}, "global_layers"),
        ({"engram_layers": [25]}, "engram_layers"),
        ({"out_vocab": 20000}, "out_vocab"),
        ({"ladder_order": [0, 1]}, "ladder_order"),
        ({"sliding_window": -1}, "sliding_window"),
        ({"qkv_conv_taps": True}, "qkv_conv_taps must be an integer"),
    ],
)
def test_config_names_the_inconsistent_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Needle3Config(**fields)
