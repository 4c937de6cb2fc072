"""Training hooks of the PyTorch Needle model: activation checkpointing, the loss conventions that
gradient accumulation relies on, and explicit forward arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from needle_reference import TINY_NATIVE_CONFIG, make_native_params

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.weight_names import native_to_hf

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread


@pytest.fixture(scope="module")
def state() -> dict:
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG)
    params = make_native_params(TINY_NATIVE_CONFIG, seed=11)
    params = {k: v for k, v in params.items() if k not in ("contrastive_head", "confidence_head")}
    return {name: torch.from_numpy(value) for name, value in native_to_hf(params, config).items()}


def fresh_model(state: dict) -> NeedleForCausalLM:
    model = NeedleForCausalLM(NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG))
    model.load_state_dict(state, strict=True)
    return model.train()


def batch(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels with a different number of ignored (-100) targets per row."""
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(1, TINY_NATIVE_CONFIG["vocab_size"], (rows, length)))
    labels = ids.clone()
    for row in range(rows):
        labels[row, : 2 + 3 * row] = -100
    return ids, labels


def gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradients_with_activation_checkpointing_equal_those_without(state):
    ids, labels = batch(2, 16, seed=1)
    results = []
    for checkpointing in (False, True):
        model = fresh_model(state)
        if checkpointing:
            # transformers 5 renamed the switch; 4.57 has only the old name.
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        assert model.model.layers[0].gradient_checkpointing is checkpointing
        model(ids, labels=labels).loss.backward()
        results.append(gradients(model))
    plain, checkpointed = results
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_accumulating_micro_batches_with_num_items_in_batch_gives_the_big_batch_gradients(state):
    ids, labels = batch(4, 12, seed=2)
    big = fresh_model(state)
    big(ids, labels=labels).loss.backward()

    accumulated = fresh_model(state)
    targets = int((labels[:, 1:] != -100).sum())
    for row in range(4):
        out = accumulated(ids[row : row + 1], labels=labels[row : row + 1], num_items_in_batch=targets)
        out.loss.backward()
    expected, found = gradients(big), gradients(accumulated)
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-4, atol=1e-7, msg=name)


def test_shift_labels_are_used_as_given(state):
    model = fresh_model(state).eval()
    ids, labels = batch(2, 10, seed=3)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        by_labels = model(ids, labels=labels).loss
        by_shift_labels = model(ids, shift_labels=shifted).loss
    torch.testing.assert_close(by_shift_labels, by_labels)


def test_a_misspelled_argument_is_an_error(state):
    model = fresh_model(state).eval()
    ids, _ = batch(1, 6, seed=4)
    with pytest.raises(TypeError, match="attention_mak"):
        model(ids, attention_mak=torch.ones_like(ids))
    # inputs_embeds exists only as None (PEFT and TRL always pass it); embeddings are refused clearly.
    with pytest.raises(ValueError, match="pass input_ids, not inputs_embeds"):
        model.model(ids, inputs_embeds=torch.zeros(1, 6, model.config.hidden_size))
    model(ids, inputs_embeds=None)


def test_use_cache_is_a_config_field(state):
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, use_cache=False)
    assert config.use_cache is False and NeedleConfig.from_dict(config.to_dict()).use_cache is False
    model = fresh_model(state).eval()
    model.config.use_cache = False
    ids, _ = batch(1, 6, seed=5)
    with torch.no_grad():
        out = model(ids)
    assert (out.cache if "cache" in out else out.past_key_values) is None



def test_generate_runs_on_one_cpu_thread_unless_the_user_chose_threads(state, monkeypatch):
    from transformers import GenerationMixin

    from needle_hf.models.needle import generation_needle

    seen = []
    monkeypatch.setattr(GenerationMixin, "generate", lambda self, *args, **kwargs: seen.append(torch.get_num_threads()))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = fresh_model(state).eval()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(generation_needle, "_THREADS_AT_IMPORT", 2)  # two threads is torch's default here
        model.generate(torch.ones(1, 3, dtype=torch.long))
        assert torch.get_num_threads() == 2  # restored
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice
        model.generate(torch.ones(1, 3, dtype=torch.long))
    finally:
        torch.set_num_threads(1)
    assert seen == [1, 2]
