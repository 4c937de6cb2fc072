"""Bits maps and deployment widths under hostile input.

Bits maps (`--bits-map`, `weight_bits`) name whole tensors or documented groups: generated maps are
accepted exactly when every name is valid, and then give each tensor the width the reference's
prefix matching gives it; anything else is a `BitsMapError` listing the valid names, a one-line
`needle-hf build` error, and a load error naming config.json and `weight_bits`. `act_bits` and
`kv_bits` are accepted exactly in the ranges the deployment numerics compute (checked both ways
at the boundary, and the forward finite there).
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from needle_hf.cli import main
from needle_hf.models.needle.configuration_needle import ACT_BITS_RANGE, KV_BITS_UNQUANTISED, KV_CQ_BITS, MAX_FIELD_VALUE, NeedleConfig
from needle_hf.models.needle.numerics import (
    BITS_MAP_GROUPS,
    BitsMapError,
    bits_for,
    bits_map_names,
    canonical_tensor_name,
    is_cq_weight,
    parse_bits_map,
)
from needle_hf.models.needle.weight_names import weight_specs

from test_cli import checkpoint, hf_folder, params  # noqa: E402,F401  (fixtures)

SITES = 2
VALID = bits_map_names(SITES)
VALID_CANONICAL = {canonical_tensor_name(name) for name in VALID}
WIDTHS = st.sampled_from(["2", "3", "4", "1.58"])
# Names a user might write: valid ones, near misses (truncations, case, other sites), native paths, junk.
NEAR_MISSES = ["attn.o", "attn.q", "Attn.q_proj", "attn.q_proj.weight", "engram2", "engram9.tables", "engrams",
               "mhc", "mhc_phi_", "mtp.o_proj", "layers", "embed", "embedding.weight", "default2", " ", "attn.",
               "model.layers.0.self_attn.q_proj.weight"]
NATIVE = ["stack/layers/block/self_attn/q_proj/kernel", "engrams_1/embedding", "stack/mhc_phi_pre", "layer03.k_proj"]
NAMES = st.one_of(st.sampled_from(VALID), st.sampled_from(NEAR_MISSES), st.sampled_from(NATIVE),
                  st.text(alphabet="abcdefghijklmnopqrstuvwxyz._/0123456789", max_size=12).filter(lambda name: name != "default"))


def test_the_valid_names_are_the_cq_weights_of_a_full_model():
    """Whole names = the canonical names of every CQ-stored weight of a model with every head (one table)."""
    config = NeedleConfig(num_hidden_layers=3, engram_layers=[0, 2], use_mtp_head=True, use_contrastive_head=True,
                          use_confidence_head=True)
    stored = {canonical_tensor_name("/".join(spec.native_path)) for spec in weight_specs(config)
              if is_cq_weight(spec.hf_name)}
    groups = {name for name in bits_map_names(SITES) if name in BITS_MAP_GROUPS or name.startswith("engram")
              and "." not in name}
    assert set(bits_map_names(SITES)) - groups == stored
    for group in groups:
        assert any(name.startswith(group) for name in stored), group


@settings(max_examples=400, deadline=None)
@given(entries=st.lists(st.tuples(NAMES, WIDTHS), max_size=5), default=st.one_of(st.none(), WIDTHS),
       separator=st.sampled_from([",", ", ", " ,"]))
def test_a_map_is_accepted_exactly_when_every_name_is_valid(entries, default, separator):
    parts = [f"{name}={width}" for name, width in entries] + ([f"default={default}"] if default else [])
    spec = separator.join(parts)
    canonical = [canonical_tensor_name(name.strip()) for name, _ in entries]
    valid = (default is not None and all(name.strip() and name in VALID_CANONICAL for name in canonical)
             and len(set(canonical)) == len(canonical))
    if valid:
        prefixes, parsed_default = parse_bits_map(spec, engram_sites=SITES)
        assert set(prefixes) == set(canonical) and parsed_default == (1.58 if default == "1.58" else int(default))
        return
    with pytest.raises(BitsMapError) as failure:
        parse_bits_map(spec, engram_sites=SITES)
    message = str(failure.value)
    if default is not None or any(name not in VALID_CANONICAL for name in canonical) or not parts:
        assert "valid names: attn, mhc_phi, mtp, engram" in message and "engram1.value_proj" in message, message


@settings(max_examples=150, deadline=None)
@given(chosen=st.lists(st.sampled_from(VALID), unique=True, max_size=6), widths=st.lists(WIDTHS, min_size=7, max_size=7))
def test_valid_maps_give_every_tensor_the_reference_width(chosen, widths):
    """Two paths that must agree: our exact-name parse + match, and the reference's prefix match."""
    from needle.model.quantize import _bits_for, parse_bits_map as reference_parse

    spec = ",".join([f"{name}={width}" for name, width in zip(chosen, widths)] + [f"default={widths[-1]}"])
    ours, theirs = parse_bits_map(spec, engram_sites=SITES), reference_parse(spec)
    config = NeedleConfig(num_hidden_layers=3, engram_layers=[0, 2], use_mtp_head=True, use_contrastive_head=True,
                          use_confidence_head=True)
    for spec_entry in weight_specs(config):
        if is_cq_weight(spec_entry.hf_name):
            path = "/".join(spec_entry.native_path)
            assert bits_for(path, *ours) == _bits_for(path, *theirs), (spec, path)


@pytest.mark.parametrize("spec, message", [
    ("", "is empty"),
    (",", "is empty"),
    ("attn.o=2,default=4", "unknown name 'attn.o'"),
    ("=3,default=4", "has an empty name"),
    ("attn.q_proj=2,,default=4", "an empty entry"),
    ("engram2=2,default=4", "unknown name 'engram2'"),
    ("attn=2,attn=3,default=4", "'attn' is given twice"),
    ("default=4,default=3", "default is given twice"),
])
def test_build_refuses_a_bad_bits_map_listing_the_valid_names(hf_folder, tmp_path, capsys, spec, message):
    capsys.readouterr()
    assert main(["build", str(hf_folder), str(tmp_path / "out.cact"), "--bits-map", spec]) == 1
    captured = capsys.readouterr().err
    lines = [line for line in captured.splitlines() if line.startswith("needle-hf build: error:")]
    assert len(lines) == 1 and "Traceback" not in captured and message in lines[0], captured
    if "empty entry" not in message:
        assert "valid names:" in lines[0]
    assert not (tmp_path / "out.cact").exists()


@pytest.mark.parametrize("value, message", [
    ("attn.o=2,default=4", "unknown name 'attn.o'"),
    ("attn.q_proj=2", "no default"),
    (",", "is empty"),
    ("attn.q_proj=5,default=4", "width 5"),
    (7, "weight_bits must be a string"),
])
def test_a_bad_weight_bits_fails_at_load_naming_config_json(hf_folder, tmp_path, capsys, value, message):
    from transformers import AutoConfig

    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    config = json.loads((folder / "config.json").read_text())
    config["weight_bits"] = value
    (folder / "config.json").write_text(json.dumps(config))
    for load in (NeedleConfig.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(ValueError) as failure:
            load(str(folder))
        assert "config.json" in str(failure.value) and "weight_bits" in str(failure.value), failure.value
        assert message in str(failure.value)
    for argv in (["export", folder, tmp_path / "out.pkl"], ["build", folder, tmp_path / "out.cact"]):
        capsys.readouterr()
        assert main([str(part) for part in argv]) == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "config.json" in line and "weight_bits" in line and message in line, line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]


# ------------------------------------------------------------------------------------------------
# act_bits and kv_bits.


def _kv_supported(bits: int) -> bool:
    return bits in KV_CQ_BITS or KV_BITS_UNQUANTISED <= bits <= MAX_FIELD_VALUE


@settings(max_examples=300, deadline=None)
@given(act_bits=st.one_of(st.integers(-4, 70), st.integers(min_value=2**20, max_value=2**40)),
       kv_bits=st.one_of(st.integers(-4, 70), st.integers(min_value=2**20, max_value=2**40)),
       deploy=st.booleans())
def test_config_accepts_exactly_the_supported_widths(act_bits, kv_bits, deploy):
    accepted = ACT_BITS_RANGE[0] <= act_bits <= ACT_BITS_RANGE[1] and _kv_supported(kv_bits)
    if accepted:
        config = NeedleConfig(act_bits=act_bits, kv_bits=kv_bits, deploy_numerics=deploy)
        assert (config.act_bits, config.kv_bits) == (act_bits, kv_bits)
        return
    with pytest.raises(ValueError, match="act_bits|kv_bits"):
        NeedleConfig(act_bits=act_bits, kv_bits=kv_bits, deploy_numerics=deploy)


@pytest.mark.parametrize("field, value", [("act_bits", 1), ("act_bits", 26), ("act_bits", 64), ("act_bits", 1 << 24),
                                          ("kv_bits", 1), ("kv_bits", 5), ("kv_bits", 7), ("kv_bits", 0)])
def test_an_unsupported_width_in_config_json_fails_at_load(hf_folder, tmp_path, capsys, field, value):
    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"config.json: Invalid NeedleConfig: {field}"):
        NeedleConfig.from_pretrained(str(folder))
    capsys.readouterr()
    assert main(["export", str(folder), str(tmp_path / "out.pkl")]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "config.json" in line and field in line and str(value) in line, line


@pytest.mark.parametrize("act_bits, kv_bits", [(ACT_BITS_RANGE[0], KV_CQ_BITS[0]), (ACT_BITS_RANGE[1], KV_CQ_BITS[-1]),
                                               (ACT_BITS_RANGE[1], KV_BITS_UNQUANTISED)])
def test_the_forward_is_finite_at_the_boundary_widths(hf_folder, act_bits, kv_bits):
    from needle_hf import NeedleForCausalLM

    model = NeedleForCausalLM.from_pretrained(str(hf_folder), torch_dtype=torch.float32,
                                              deploy_numerics=True, act_bits=act_bits, kv_bits=kv_bits).eval()
    tokens = torch.from_numpy(np.random.default_rng(0).integers(4, 800, (2, 9)))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    assert torch.isfinite(logits).all()


def test_the_widest_activation_grid_is_exact_in_float32_and_the_next_is_not():
    """Why act_bits stops at 25: the absmax levels +-(2**(bits-1) - 1) are float32 integers up to 2**24."""
    from needle_hf.models.needle.deploy_numerics import absmax_rows

    widest = 2 ** (ACT_BITS_RANGE[1] - 1) - 1
    assert float(np.float32(widest)) == widest and float(np.float32(2 * widest + 1)) != 2 * widest + 1
    rows = torch.from_numpy(np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32))
    quantised = absmax_rows(rows, ACT_BITS_RANGE[1])
    assert torch.isfinite(quantised).all() and (quantised - rows).abs().max() <= rows.abs().max() / widest
