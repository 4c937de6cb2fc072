"""Beam search on the Needle 3 PyTorch model: `generate` reorders every piece of the cache (keys,
values, Q/K/V conv histories, engram histories, the hash's last tokens) with its beams, so beam
search through the cache picks the tokens beam search without a cache picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from needle_hf.models.needle3 import Needle3Config
from needle_hf.models.needle3.modeling_needle3 import Needle3Cache

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

# Every option on, odd geometry (MLP padded 40 -> 64, 3 lanes, window 3, one global layer).
CONFIG = dict(
    vocab_size=120, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, head_dim=6,
    value_head_dim=10, sliding_window=3, global_layers=[1], qkv_conv_taps=3, engram_orders=[2, 3], engram_heads=2,
    engram_seed_heads=3, engram_slots=53, engram_layers=[0, 2], hyper_connection_lanes=3, out_vocab=100,
    ladder_widths=[20],
)


@pytest.fixture(scope="module")
def model(one_cpu_thread):
    """A `Needle3ForCausalLM` from the Auto classes with every parameter perturbed (seeded)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(Needle3Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.add_(torch.randn_like(parameter) * (0.05 if "embed" in name or "tables" in name else 0.2))
    return model


def _filled_cache(model, ids):
    cache = Needle3Cache(model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return cache


def test_reorder_cache_moves_every_piece_of_state(model):
    """After reorder_cache(idx), the cache equals the cache of the reordered batch, and the next
    step's logits equal the reordered batch's."""
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.integers(3, CONFIG["vocab_size"], (3, 7)))
    order = torch.tensor([2, 2, 0])
    cache = _filled_cache(model, ids)
    cache.reorder_cache(order)
    expected = _filled_cache(model, ids[order])
    for got, want in zip(cache.layers, expected.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)
        for part, part_want in zip(got.conv_history, want.conv_history):
            torch.testing.assert_close(part, part_want, atol=1e-5, rtol=0)
    for got, want in zip(cache.engram_history, expected.engram_history):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(cache.token_history, expected.token_history)
    step = torch.from_numpy(rng.integers(3, CONFIG["vocab_size"], (3, 1)))
    with torch.no_grad():
        got = model(step, past_key_values=cache, use_cache=True).logits
        want = model(step, past_key_values=expected, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("padding", [0, 2])
def test_beam_search_through_the_cache_equals_beam_search_without_it(model, padding):
    """generate(num_beams=3) with the cache gives the sequences and scores it gives with
    use_cache=False (every step a full forward), left padding included."""
    rng = np.random.default_rng(11 + padding)
    ids = torch.from_numpy(rng.integers(3, CONFIG["vocab_size"], (2, 6)))
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    options = dict(attention_mask=mask, num_beams=3, do_sample=False, max_new_tokens=6, num_return_sequences=3,
                   output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **options)
        full = model.generate(ids, use_cache=False, **options)
    assert cached.sequences.shape[1] > ids.shape[1]
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(cached.sequences_scores, full.sequences_scores, atol=1e-4, rtol=0)
