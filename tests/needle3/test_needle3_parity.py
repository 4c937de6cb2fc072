"""Needle 3 against the reference (cactus-needle 3.2.8): a checkpoint written by the reference's own
writer, converted by `needle-hf convert`, loaded through the Auto classes. Every architectural option
is on (see `ALL_OPTIONS_NATIVE_CONFIG`), every leaf perturbed; float32 throughout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from needle3_reference import (
    ALL_OPTIONS_NATIVE_CONFIG,
    PLAIN_NATIVE_CONFIG,
    make_native_params,
    reference_greedy,
    reference_head,
    reference_logits,
    write_reference_checkpoint,
)

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory, one_cpu_thread):
    """(native params, HF model loaded from the converted folder, conversion report)."""
    from transformers import AutoModelForCausalLM

    from needle_hf.conversion.convert import convert

    folder = tmp_path_factory.mktemp("needle3")
    params = make_native_params(ALL_OPTIONS_NATIVE_CONFIG, seed=3)
    write_reference_checkpoint(folder / "model.safetensors", params, ALL_OPTIONS_NATIVE_CONFIG)
    result = convert(folder / "model.safetensors", folder / "hf")
    model = AutoModelForCausalLM.from_pretrained(folder / "hf").eval()
    return params, model, result.report


@pytest.fixture(scope="module")
def tokens():
    """Two sequences of 17 ids (longer than every window and conv reach)."""
    return np.random.default_rng(11).integers(3, ALL_OPTIONS_NATIVE_CONFIG["vocab_size"], (2, 17))


def test_converted_model_reproduces_reference_logits(converted, tokens):
    params, model, _ = converted
    expected = reference_logits(ALL_OPTIONS_NATIVE_CONFIG, params, tokens)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens), use_cache=False).logits.numpy()
    assert logits.shape == (2, 17, ALL_OPTIONS_NATIVE_CONFIG["out_vocab"])
    assert np.abs(logits - expected).max() <= TOLERANCE
    assert np.abs(expected).max() > 0.5  # the comparison is not between near-zero logits


@pytest.mark.parametrize("head", ["embedding", "confidence", "router"])
def test_probe_heads_reproduce_reference(converted, tokens, head):
    params, model, _ = converted
    padded = tokens.copy()
    padded[1, -4:] = 0  # pad tokens are invisible to the heads
    expected = reference_head(ALL_OPTIONS_NATIVE_CONFIG, params, padded, head)
    with torch.no_grad():
        found = getattr(model, head)(torch.from_numpy(padded)).numpy()
    assert found.shape == expected.shape
    assert np.abs(found - expected).max() <= TOLERANCE


def test_cached_steps_match_full_forward(converted, tokens):
    """Prefill 5 tokens, then one token per step: the cache carries keys, conv taps and engram state,
    and sliding-window layers keep only what a later query can see."""
    _, model, _ = converted
    ids = torch.from_numpy(tokens)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids[:, :5], attention_mask=mask[:, :5])
        cache, steps = out.past_key_values, [out.logits]
        for t in range(5, ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache)
            steps.append(out.logits)
    assert torch.cat(steps, dim=1).sub(full).abs().max().item() <= TOLERANCE
    window = ALL_OPTIONS_NATIVE_CONFIG["sliding_window"]
    kept = [layer.keys.shape[2] for layer in cache.layers]
    assert kept == [window - 1, window - 1, ids.shape[1], window - 1, window - 1]  # layer 2 is global


def test_greedy_generation_matches_reference_run_generate(converted):
    params, model, _ = converted
    prompt = [17, 4, 250, 99, 31, 8]
    expected = reference_greedy(ALL_OPTIONS_NATIVE_CONFIG, params, prompt, max_new_tokens=12)
    ids = torch.tensor([[model.config.bos_token_id, *prompt]])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    if model.config.eos_token_id in generated:
        generated = generated[: generated.index(model.config.eos_token_id)]
    assert len(expected) == 12  # no early EOS: twelve greedy steps compared
    assert generated == expected


def test_conversion_report_records_the_logit_check(converted):
    _, _, report = converted
    assert report["verification"]["max_abs_logit_diff"] <= TOLERANCE
    assert report["output"]["parameters"] == sum(p.numel() for p in converted[1].parameters())


def test_plain_attention_checkpoint(tmp_path, one_cpu_thread):
    """No window, no conv taps, no seed stride, full output head: the options off also match."""
    from needle_hf.conversion.needle3 import convert_needle3
    from transformers import AutoModelForCausalLM

    params = make_native_params(PLAIN_NATIVE_CONFIG, seed=5, with_heads=False)
    write_reference_checkpoint(tmp_path / "plain.safetensors", params, PLAIN_NATIVE_CONFIG)
    convert_needle3(tmp_path / "plain.safetensors", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = np.random.default_rng(2).integers(3, PLAIN_NATIVE_CONFIG["vocab_size"], (1, 11))
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens), use_cache=False).logits.numpy()
    assert np.abs(logits - reference_logits(PLAIN_NATIVE_CONFIG, params, tokens)).max() <= TOLERANCE


def test_export_gives_back_the_reference_checkpoint(converted, tmp_path):
    """`needle-hf export` of the converted folder: a checkpoint the reference's own loader reads, with
    every tensor of the original, bit for bit, and the same resolved config."""
    from needle.model.architecture import TransformerConfig
    from needle.model.checkpoints import flatten
    from needle.model.run import load_checkpoint

    from needle_hf.cli import main

    params, model, _ = converted
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    assert main(["export", str(folder), str(tmp_path / "back.safetensors")]) == 0
    loaded, config = load_checkpoint(str(tmp_path / "back.safetensors"))
    original, back = flatten(params), flatten(loaded)
    assert set(back) == set(original)
    assert all(np.array_equal(back[name], original[name]) for name in original)
    expected = TransformerConfig.from_saved(dict(ALL_OPTIONS_NATIVE_CONFIG))
    for field in ("d_model", "num_heads", "num_kv_heads", "qk_head_dim", "v_head_dim", "sliding_window", "global_layers",
                  "engram_seed_heads", "engram_layers", "qkv_conv_taps", "out_vocab", "ladder_widths", "mhc_lanes"):
        assert getattr(config, field) == getattr(expected, field), field


@pytest.fixture(scope="module")
def flax_twin(converted, tmp_path_factory):
    """The Flax twin of the converted model, read from the PyTorch-layout folder by `FlaxAutoModelForCausalLM`."""
    from transformers import FlaxAutoModelForCausalLM

    from needle_hf.models.needle3.modeling_flax_needle3 import FlaxNeedle3ForCausalLM

    folder = tmp_path_factory.mktemp("needle3_flax")
    converted[1].save_pretrained(folder)
    model = FlaxAutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(model, FlaxNeedle3ForCausalLM)
    return model


def test_flax_twin_reproduces_reference_logits(converted, flax_twin, tokens):
    """The Flax twin reads the same PyTorch-layout folder, with padding in the second row."""
    params, model, _ = converted
    expected = reference_logits(ALL_OPTIONS_NATIVE_CONFIG, params, tokens)
    assert np.abs(np.asarray(flax_twin(tokens).logits) - expected).max() <= TOLERANCE
    mask = np.ones_like(tokens)
    mask[1, :3] = 0
    with torch.no_grad():
        torch_logits = model(torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask), use_cache=False).logits
    found = np.asarray(flax_twin(tokens, attention_mask=mask).logits)
    assert np.abs(found - torch_logits.numpy()).max() <= TOLERANCE


def test_flax_cached_steps_match_full_forward(flax_twin, tokens):
    """Prefill 5 tokens into a cache of 20 slots, then one token per step, left padding in the second
    row: the cache carries keys, conv taps and engram state, and sliding-window layers read only their band."""
    mask = np.ones_like(tokens)
    mask[1, :3] = 0
    full = np.asarray(flax_twin(tokens, attention_mask=mask).logits)
    out = flax_twin(tokens[:, :5], attention_mask=mask[:, :5], past_key_values=flax_twin.init_cache(2, 20))
    steps = [np.asarray(out.logits)]
    for t in range(5, tokens.shape[1]):
        out = flax_twin(tokens[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=out.past_key_values)
        steps.append(np.asarray(out.logits))
    assert np.abs(np.concatenate(steps, axis=1) - full).max() <= TOLERANCE
    assert int(out.past_key_values["seen"]) == tokens.shape[1]


def test_flax_greedy_generation_matches_reference_and_torch(converted, flax_twin):
    """`generate` (jit-compiled, one token per step on the cache) emits the reference's greedy tokens,
    and the PyTorch twin's on a left-padded batch."""
    params, model, _ = converted
    prompt = [17, 4, 250, 99, 31, 8]
    expected = reference_greedy(ALL_OPTIONS_NATIVE_CONFIG, params, prompt, max_new_tokens=12)
    ids = np.array([[model.config.bos_token_id, *prompt]])
    generated = np.asarray(flax_twin.generate(ids, max_new_tokens=12, do_sample=False).sequences)[0, ids.shape[1] :]
    assert generated.tolist() == expected
    batch = np.array([[0, 0, 2, 40, 7, 133], [2, 5, 260, 31, 77, 12]])
    mask = (np.arange(6) >= np.array([[2], [0]])).astype(np.int64)
    flax_tokens = np.asarray(flax_twin.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False).sequences)
    with torch.no_grad():
        torch_tokens = model.generate(torch.from_numpy(batch), attention_mask=torch.from_numpy(mask), max_new_tokens=8,
                                      do_sample=False, pad_token_id=0).numpy()
    eos = model.config.eos_token_id
    for row_flax, row_torch in zip(flax_tokens[:, 6:], torch_tokens[:, 6:]):
        stop = row_torch.tolist().index(eos) + 1 if eos in row_torch.tolist() else len(row_torch)
        assert row_flax[:stop].tolist() == row_torch[:stop].tolist()


@pytest.mark.parametrize("head", ["embedding", "confidence", "router"])
def test_flax_probe_heads_reproduce_reference(converted, flax_twin, tokens, head):
    params, _, _ = converted
    padded = tokens.copy()
    padded[1, -4:] = 0  # pad tokens are invisible to the heads
    expected = reference_head(ALL_OPTIONS_NATIVE_CONFIG, params, padded, head)
    found = np.asarray(getattr(flax_twin, head)(padded))
    assert found.shape == expected.shape
    assert np.abs(found - expected).max() <= TOLERANCE


def test_flax_twin_saves_the_folder_the_torch_twin_reads(converted, flax_twin, tokens, tmp_path):
    """Flax `save_pretrained` writes the PyTorch-layout folder back: the PyTorch twin reads it to the same logits."""
    from transformers import AutoModelForCausalLM

    flax_twin.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(torch.from_numpy(tokens)).logits, converted[1](torch.from_numpy(tokens)).logits)
