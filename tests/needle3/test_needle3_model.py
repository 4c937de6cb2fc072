"""The Needle 3 PyTorch model on its own (no reference needed; runs under transformers 4.57 and 5.x):
cached decoding against the full forward for any chunking, `generate` through the cache, the
sliding windows' memory, Auto-class round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from needle_hf.models.needle3 import Needle3Config

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

TOLERANCE = 1e-4
# Every option on, odd geometry (MLP padded 40 -> 64, 3 lanes, window 3, one global layer).
CONFIG = dict(
    vocab_size=120, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, head_dim=6,
    value_head_dim=10, sliding_window=3, global_layers=[1], qkv_conv_taps=3, engram_orders=[2, 3], engram_heads=2,
    engram_seed_heads=3, engram_slots=53, engram_layers=[0, 2], hyper_connection_lanes=3, out_vocab=100,
    ladder_widths=[20], use_confidence_head=True,
)


@pytest.fixture(scope="module")
def model(one_cpu_thread):
    """A `Needle3ForCausalLM` from the Auto classes with every parameter perturbed (seeded)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Needle3Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.add_(torch.randn_like(parameter) * (0.05 if "embed" in name or "tables" in name else 0.2))
    return model


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    length=st.integers(min_value=2, max_value=14),
    padding=st.integers(min_value=0, max_value=3),
)
def test_any_chunking_matches_the_full_forward(model, data, length, padding):
    """Feeding the sequence in arbitrary chunks through the cache gives the full forward's logits."""
    rng = np.random.default_rng(length * 7 + padding)
    ids = torch.from_numpy(rng.integers(3, CONFIG["vocab_size"], (2, length)))
    mask = torch.ones_like(ids)
    mask[1, : min(padding, length - 1)] = 0
    cuts = sorted(data.draw(st.sets(st.integers(min_value=1, max_value=length - 1), max_size=4)))
    full = _logits(model, ids, mask)
    cache, pieces = None, []
    with torch.no_grad():
        for start, end in zip([0, *cuts], [*cuts, length]):
            out = model(ids[:, start:end], attention_mask=mask[:, :end], past_key_values=cache)
            cache = out.past_key_values
            pieces.append(out.logits)
    assert torch.cat(pieces, dim=1).sub(full).abs().max().item() <= TOLERANCE
    assert cache.get_seq_length() == length


def test_generate_decodes_one_token_per_step_through_the_cache(model, monkeypatch):
    ids = torch.tensor([[2, 15, 88, 41, 7, 63]])
    lengths = []
    forward = model.model.forward

    def spy(input_ids, **kwargs):
        lengths.append(input_ids.shape[1])
        return forward(input_ids, **kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert lengths == [6, 1, 1, 1, 1, 1]
    new = out[0, ids.shape[1] :]
    assert torch.equal(_logits(model, out[:, :-1])[0, ids.shape[1] - 1 :].argmax(-1), new)


def test_sliding_window_layers_keep_only_visible_keys(model):
    with torch.no_grad():
        cache = model(torch.arange(3, 14)[None], use_cache=True).past_key_values
    window = CONFIG["sliding_window"]
    assert [layer.keys.shape[2] for layer in cache.layers] == [window - 1, 11, window - 1, window - 1]
    assert [layer.start for layer in cache.layers] == [11 - (window - 1), 0, 11 - (window - 1), 11 - (window - 1)]


def test_logits_cover_out_vocab_rows_of_the_tied_embedding(model):
    ids = torch.tensor([[2, 5, 6]])
    with torch.no_grad():
        out = model.model(ids, use_cache=False)
        logits = model(ids, use_cache=False).logits
    assert logits.shape == (1, 3, CONFIG["out_vocab"])
    expected = out.last_hidden_state.float() @ model.model.embed_tokens.weight[: CONFIG["out_vocab"]].T
    assert torch.allclose(logits, expected)


def test_labels_give_the_next_token_loss(model):
    ids = torch.tensor([[2, 5, 6, 9, 4]])
    with torch.no_grad():
        out = model(ids, labels=ids, use_cache=False)
    expected = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    assert torch.allclose(out.loss, expected)


def test_save_and_reload_through_auto_classes(model, tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "needle3"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[2, 33, 4, 71, 9, 9, 12]])
    assert torch.equal(_logits(reloaded, ids), _logits(model, ids))
    backbone = AutoModel.from_pretrained(tmp_path)
    assert type(backbone).__name__ == "Needle3Model"


def test_engram_hash_matches_the_numpy_statement():
    """With no seed stride the Needle 3 hash is Needle 2's (`numerics.engram_indices_numpy`)."""
    from needle_hf.models.needle3.modeling_needle3 import engram_hash_indices
    from needle_hf.models.needle.numerics import engram_indices_numpy

    config = Needle3Config(**{**CONFIG, "engram_seed_heads": 0})
    tokens = np.random.default_rng(4).integers(0, 2**31, (2, 9))
    history = max(config.engram_orders) - 1
    padded = torch.cat([torch.zeros(2, history, dtype=torch.long), torch.from_numpy(tokens)], dim=1)
    found = engram_hash_indices(padded, 9, config).numpy()
    expected = engram_indices_numpy(tokens, config.engram_orders, config.engram_num_heads, config.engram_slots)
    assert np.array_equal(found, expected)


def test_confidence_head_ignores_padding(model):
    ids = torch.tensor([[2, 15, 88, 41, 0, 0]])
    with torch.no_grad():
        padded = model.confidence(ids)
        unpadded = model.confidence(ids[:, :4])
    assert torch.allclose(padded, unpadded, atol=1e-5)
