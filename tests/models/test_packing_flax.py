"""Packed (padding-free) batches on the Flax model: the twin of `test_packing.py`'s PyTorch tests.

A row of several sequences (segment_ids, or position_ids restarting at 0 without attention_mask) gives
each sequence its padded logits, MTP logits and fine-tuning loss (<= 1e-5, float32), and the same
logits as the PyTorch model on the same weights.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.finetune.trainer_flax import make_loss_function
from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM, packed_segment_ids

TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            max_position_embeddings=128, engram_layers=(0, 2), engram_slots=64)
TOLERANCE = 1e-5
LENGTHS = [13, 5, 20, 1]


@pytest.fixture(scope="module")
def model() -> FlaxNeedleForCausalLM:
    model = FlaxNeedleForCausalLM(NeedleConfig(**TINY), seed=0)
    leaves, tree = jax.tree_util.tree_flatten(model.params)
    rng = np.random.default_rng(0)
    model.params = jax.tree_util.tree_unflatten(
        tree, [leaf + rng.normal(0, 0.05, leaf.shape).astype(np.float32) for leaf in leaves])
    return model


def batches(lengths, seed: int = 0):
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(1, TINY["vocab_size"], n) for n in lengths]
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    mask = np.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    packed = np.concatenate(sequences)[None].astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32)
    padded = dict(input_ids=ids, attention_mask=mask, labels=np.where(mask == 1, ids, -100))
    flat = dict(input_ids=packed, position_ids=positions, labels=np.where(positions == 0, -100, packed))
    return padded, flat


def unpack(packed: np.ndarray, lengths) -> list[np.ndarray]:
    return np.split(np.asarray(packed[0]), np.cumsum(lengths)[:-1])


def test_packed_row_gives_each_sequence_its_padded_logits_and_mtp_logits(model):
    padded, flat = batches(LENGTHS)
    expected = model(padded["input_ids"], attention_mask=padded["attention_mask"], output_mtp_logits=True)
    by_positions = model(flat["input_ids"], position_ids=flat["position_ids"], output_mtp_logits=True)
    segments = packed_segment_ids(flat["position_ids"])
    by_segments = model(flat["input_ids"], segment_ids=segments, output_mtp_logits=True)
    for found in (by_positions, by_segments):
        for row, (logits, mtp) in enumerate(zip(unpack(found.logits, LENGTHS), unpack(found.mtp_logits, LENGTHS))):
            n = LENGTHS[row]
            np.testing.assert_allclose(logits, np.asarray(expected.logits[row, :n]), rtol=0, atol=TOLERANCE)
            np.testing.assert_allclose(mtp, np.asarray(expected.mtp_logits[row, :n]), rtol=0, atol=TOLERANCE)


def test_packed_fine_tuning_loss_and_gradients_equal_the_padded_batch(model):
    padded, flat = batches([9, 17, 4], seed=1)
    loss_fn = make_loss_function(model, lora_scale=None, mtp_loss_weight=0.5)
    loss_and_grads = jax.jit(jax.value_and_grad(loss_fn))
    loss_a, grads_a = loss_and_grads(model.params, None, padded)
    loss_b, grads_b = loss_and_grads(model.params, None, flat)
    assert abs(float(loss_a) - float(loss_b)) <= TOLERANCE
    for a, b in zip(jax.tree_util.tree_leaves(grads_a), jax.tree_util.tree_leaves(grads_b)):
        scale = max(float(np.abs(a).max()), 1e-6)
        assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) / scale < 1e-4


def test_packed_logits_equal_the_pytorch_twins(model, tmp_path):
    import torch

    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    _, flat = batches(LENGTHS, seed=2)
    flax_logits = np.asarray(model(flat["input_ids"], position_ids=flat["position_ids"]).logits)
    model.save_pretrained(tmp_path)  # PyTorch-layout safetensors, read by both twins
    torch_model = NeedleForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch_logits = torch_model(input_ids=torch.from_numpy(flat["input_ids"]).long(),
                                   position_ids=torch.from_numpy(flat["position_ids"]).long()).logits.numpy()
    np.testing.assert_allclose(torch_logits, flax_logits, rtol=0, atol=1e-4)
