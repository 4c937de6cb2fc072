"""Ladder early exit on Needle 3 against the reference (cactus-needle 3.2.8): the sub-model of
`depth` layers (`Needle3ForCausalLM.ladder`) reproduces the reference's forward on
`ladder_slice(params, config, depth)` under `ladder_config(config, depth)`; float32, every leaf
perturbed, every option on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from needle3_reference import ALL_OPTIONS_NATIVE_CONFIG, make_native_params, write_reference_checkpoint

from needle_hf.models.needle3 import Needle3Config

TOLERANCE = 1e-4
# A non-default layer order: the rungs keep (0, 2), (0, 2, 4) (no engram site left), (0, 1, 2, 4).
ORDERED_NATIVE_CONFIG = {**ALL_OPTIONS_NATIVE_CONFIG, "ladder_order": (2, 0, 4, 1, 3)}


def _converted(folder, native, seed):
    from transformers import AutoModelForCausalLM

    from needle_hf.conversion.convert import convert

    params = make_native_params(native, seed=seed)
    write_reference_checkpoint(folder / "model.safetensors", params, native)
    convert(folder / "model.safetensors", folder / "hf")
    return params, AutoModelForCausalLM.from_pretrained(folder / "hf").eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory, one_cpu_thread):
    """{name: (native config, native params, HF model)} for the default and a set ladder_order."""
    out = {}
    for seed, (name, native) in enumerate((("default", ALL_OPTIONS_NATIVE_CONFIG), ("ordered", ORDERED_NATIVE_CONFIG))):
        params, model = _converted(tmp_path_factory.mktemp(name), native, seed + 5)
        out[name] = (native, params, model)
    return out


def _reference_rung(native, params, depth, tokens, head=None):
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig, ladder_config, ladder_slice

    config = TransformerConfig(**native)
    rung_config = ladder_config(config, depth)
    rung_params = ladder_slice(params, config, depth)
    model = SimpleAttentionNetwork(rung_config)
    method = getattr(model, f"forward_{head}") if head else None
    kwargs = {"method": method} if method else {}
    return rung_config, np.asarray(model.apply({"params": rung_params}, jnp.asarray(tokens, jnp.int32), **kwargs), np.float32)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(13).integers(3, ALL_OPTIONS_NATIVE_CONFIG["vocab_size"], (2, 17))


@pytest.mark.parametrize(("name", "depth"), [("default", 2), ("default", 3), ("ordered", 2), ("ordered", 3), ("ordered", 4)])
def test_ladder_rung_reproduces_reference_slice(converted, tokens, name, depth):
    native, params, model = converted[name]
    rung_config, expected = _reference_rung(native, params, depth, tokens)
    rung = model.ladder(depth)
    assert rung.config.num_hidden_layers == depth
    assert tuple(rung.config.global_layers) == tuple(rung_config.global_layers)
    assert tuple(rung.config.engram_layers) == tuple(rung_config.engram_layers)
    assert tuple(rung.config.ladder_order) == tuple(rung_config.ladder_order)
    with torch.no_grad():
        logits = rung(torch.from_numpy(tokens), use_cache=False).logits.numpy()
        full = model(torch.from_numpy(tokens), use_cache=False).logits.numpy()
    assert np.abs(logits - expected).max() <= TOLERANCE
    assert np.abs(logits - full).max() > 1e-2  # the rung is a different network from the full model


@pytest.mark.parametrize("head", ["embedding", "confidence", "router"])
def test_ladder_rung_heads_reproduce_reference(converted, tokens, head):
    native, params, model = converted["ordered"]
    _, expected = _reference_rung(native, params, 4, tokens, head)
    with torch.no_grad():
        got = getattr(model.ladder(4), head)(torch.from_numpy(tokens)).numpy()
    assert np.abs(got.reshape(expected.shape) - expected).max() <= TOLERANCE


def test_ladder_rung_decodes_through_its_cache(converted, tokens):
    """The rung is an ordinary model: greedy generate through its cache equals step-by-step argmax."""
    _, _, model = converted["ordered"]
    rung = model.ladder(3)
    ids = torch.from_numpy(tokens[:1, :8])
    with torch.no_grad():
        out = rung.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
        sequence = ids
        for _ in range(4):
            step = rung(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, step], dim=1)
    assert torch.equal(out, sequence)


@pytest.mark.parametrize("depth", [1, 5, 0, "3", True])
def test_ladder_depth_out_of_range_is_refused(converted, depth):
    _, _, model = converted["default"]
    with pytest.raises(ValueError, match=r"ladder depth: expected an integer in \[2, 4\].*num_hidden_layers=5"):
        model.ladder(depth)


def test_default_ladder_order_bisects_the_depth():
    config = Needle3Config(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                           num_hidden_layers=9, global_layers=[], engram_layers=[])
    from needle.model.architecture import ladder_order

    assert config.ladder_layer_order() == tuple(ladder_order(9))
    assert config.ladder_layers(3) == (0, 4, 8)
