"""Rules both twins apply alike, each test running both on the same input: the wording of a damaged
checkpoint (the one checker of `weight_names`), the position limit (`specification_needle
.check_positions`, at a forward without a cache and at the start of `generate`) and the logits a forward
keeps (`specification_needle.logits_to_keep_option`).

The Flax half runs where transformers 4.x with Flax is installed; under transformers 5 (.venv-v5)
the PyTorch half still holds the exact message the Flax model gives.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import safetensors.numpy
import torch
from hub_support import flax_model_available
from needle_reference import TINY_NATIVE_CONFIG, make_native_params

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.weight_names import NeedleWeightsError, native_to_hf

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread


def _twins(folder) -> dict:
    """How each twin loads ``folder`` (the Flax one where it is installed)."""
    twins = {"torch": NeedleForCausalLM.from_pretrained}
    if flax_model_available():
        from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

        twins["flax"] = FlaxNeedleForCausalLM.from_pretrained
    return twins


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny config and its weight table (HF names -> numpy), saved as a folder."""
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, use_contrastive_head=True, use_confidence_head=True)
    table = native_to_hf(make_native_params(TINY_NATIVE_CONFIG, 0), config)
    folder = tmp_path_factory.mktemp("tiny")
    _write(folder, config, table)
    return config, table, folder


def _write(folder, config: NeedleConfig, tensors: dict) -> None:
    config.save_pretrained(folder)
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


MISSING = "model.layers.1.self_attn.q_proj.weight"
RESHAPED = "model.layers.2.self_attn.k_proj.weight"  # [K * H, D] = (32, 64)
DAMAGES = {
    "missing": ({MISSING: None}, f"missing tensor {MISSING} (1 missing in all)"),
    "unexpected": ({"model.layers.0.extra": np.zeros(3, np.float32)}, "unexpected tensor model.layers.0.extra (1 unexpected in all)"),
    "wrong-shape": (
        {RESHAPED: np.zeros((64, 64), np.float32)},
        f"tensor {RESHAPED}: expected shape (32, 64), got (64, 64) (1 of the wrong shape in all)",
    ),
    "all-three": (
        {MISSING: None, "model.layers.0.extra": np.zeros(3, np.float32), RESHAPED: np.zeros((64, 64), np.float32)},
        f"missing tensor {MISSING} (1 missing in all); unexpected tensor model.layers.0.extra (1 unexpected in all); "
        f"tensor {RESHAPED}: expected shape (32, 64), got (64, 64) (1 of the wrong shape in all)",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_both_twins_word_a_damaged_checkpoint_alike(checkpoint, tmp_path, damage):
    config, table, _ = checkpoint
    edits, problems = DAMAGES[damage]
    damaged = {name: tensor for name, tensor in table.items() if edits.get(name, tensor) is not None}
    damaged.update({name: tensor for name, tensor in edits.items() if tensor is not None})
    _write(tmp_path, config, damaged)
    expected = f"{tmp_path / 'model.safetensors'}: {problems}"
    for twin, load in _twins(tmp_path).items():
        with pytest.raises(NeedleWeightsError) as error:
            load(tmp_path)
        assert str(error.value) == expected, twin


def test_both_twins_refuse_a_text_beyond_the_positions_at_a_forward_and_at_generate(checkpoint):
    config, _, folder = checkpoint
    limit = config.max_position_embeddings
    too_long = np.random.default_rng(0).integers(1, config.vocab_size, size=(1, limit + 1))
    prompt = too_long[:, : limit - 4]
    message = f"the text reaches {limit + 1} positions, more than max_position_embeddings={limit}"
    torch_model = NeedleForCausalLM.from_pretrained(folder).eval()
    flax_model = _twins(folder)["flax"](folder) if "flax" in _twins(folder) else None
    with torch.no_grad():
        # A forward without a cache: its tokens.
        with pytest.raises(ValueError, match=message):
            torch_model(torch.from_numpy(too_long))
        with pytest.raises(ValueError, match=message):
            torch_model.model(torch.from_numpy(too_long), use_cache=False)
        assert torch_model(torch.from_numpy(too_long[:, :limit]), use_cache=False).logits.shape[1] == limit
        # The start of generate: the prompt and the new tokens it may add, before any decoding.
        with pytest.raises(ValueError, match=message):
            torch_model.generate(torch.from_numpy(prompt), max_new_tokens=5, do_sample=False)
    if flax_model is not None:
        with pytest.raises(ValueError, match=message):
            flax_model(too_long)
        with pytest.raises(ValueError, match=message):
            flax_model.generate(prompt, max_new_tokens=5)


def test_a_packed_row_counts_the_positions_of_its_sequences_in_both_twins(checkpoint):
    config, _, folder = checkpoint
    limit = config.max_position_embeddings
    ids = np.random.default_rng(1).integers(1, config.vocab_size, size=(1, limit + 20))
    # Two packed sequences of `limit` and 20 tokens: the row is longer than the positions, its sequences are not.
    packed = np.concatenate([np.arange(limit), np.arange(20)])[None]
    message = f"the text reaches {limit + 1} positions, more than max_position_embeddings={limit}"
    torch_model = NeedleForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch_model(torch.from_numpy(ids), position_ids=torch.from_numpy(packed)).logits.shape[1] == limit + 20
        with pytest.raises(ValueError, match=message):  # a sequence reaching position `limit`
            torch_model(torch.from_numpy(ids), position_ids=torch.from_numpy(packed + 1))
    twins = _twins(folder)
    if "flax" in twins:
        flax_model = twins["flax"](folder)
        assert flax_model(ids, position_ids=packed).logits.shape[1] == limit + 20
        with pytest.raises(ValueError, match=message):
            flax_model(ids, position_ids=packed + 1)


def _bad_whole_text_inputs(config) -> list:
    """(input_ids, position_ids, the message both twins give) for a forward over whole texts."""
    ids = np.random.default_rng(2).integers(1, config.vocab_size, size=(2, 6))
    positions = np.broadcast_to(np.arange(6), (2, 6))
    v = config.vocab_size
    return [
        (ids + v, None, rf"input_ids: expected ids in \[0, {v}\) \(config.vocab_size\), found {ids.min() + v}..{ids.max() + v}"),
        (ids - v, None, rf"input_ids: expected ids in \[0, {v}\) \(config.vocab_size\), found {ids.min() - v}\.\.{ids.max() - v}"),
        (ids.astype(np.float32), None, r"input_ids: expected an integer tensor \[batch, tokens\], found float32 of shape \(2, 6\)"),
        (ids[None], None, r"input_ids: expected an integer tensor \[batch, tokens\], found int64 of shape \(1, 2, 6\)"),
        (ids[:, :0], None, r"input_ids: expected at least one token a row, found int64 of shape \(2, 0\)"),
        (ids, positions - 2, r"position_ids: expected positions >= 0, found -2"),
        (ids, positions.astype(np.float32), r"position_ids: expected an integer tensor \[2, 6\] \(or \[1, 6\]\) like input_ids, found float32 of shape \(2, 6\)"),
        (ids, positions[:, :4], r"position_ids: expected an integer tensor \[2, 6\] \(or \[1, 6\]\) like input_ids, found int64 of shape \(2, 4\)"),
    ]


def test_both_twins_refuse_ids_and_positions_that_are_no_text_at_a_forward(checkpoint):
    """Ids outside the vocabulary, float or misshapen ids and position ids, negative positions: the same
    message from both twins (the dtype named as each framework names it), before any layer runs."""
    config, _, folder = checkpoint
    torch_model = NeedleForCausalLM.from_pretrained(folder).eval()
    twins = _twins(folder)
    flax_model = twins["flax"](folder) if "flax" in twins else None
    for ids, positions, message in _bad_whole_text_inputs(config):
        torch_message = message.replace("found float32", "found torch.float32").replace("found int64", "found torch.int64")
        with torch.no_grad(), pytest.raises(ValueError, match=torch_message):
            torch_model(torch.from_numpy(np.ascontiguousarray(ids)),
                        position_ids=None if positions is None else torch.from_numpy(np.ascontiguousarray(positions)))
        if flax_model is not None:
            with pytest.raises(ValueError, match=message):
                flax_model(ids, position_ids=positions)
    ids = torch.from_numpy(_bad_whole_text_inputs(config)[0][0] - config.vocab_size)
    with torch.no_grad():  # [1, T] positions serve every row, as in transformers
        assert torch_model(ids, position_ids=torch.arange(6)[None]).logits.shape == (2, 6, config.vocab_size)
        with pytest.raises(ValueError, match=r"labels: expected integer token ids of shape \(2, 6\) like input_ids"):
            torch_model(ids, labels=ids[:, :4])
        with pytest.raises(ValueError, match=r"shift_labels: expected integer token ids of shape \(2, 6\)"):
            torch_model(ids, shift_labels=ids.float())


def test_both_twins_keep_the_same_logits_and_refuse_the_same_logits_to_keep(checkpoint):
    """``logits_to_keep``: the last n positions' logits in both twins (0 keeps all); a negative, float,
    bool or string value is refused with the same message (`specification_needle.logits_to_keep_option`).
    The PyTorch twin also takes a 1-D integer tensor of positions, as transformers' models do."""
    config, _, folder = checkpoint
    ids = np.random.default_rng(3).integers(1, config.vocab_size, size=(2, 7))
    torch_model = NeedleForCausalLM.from_pretrained(folder).eval()
    twins = _twins(folder)
    flax_model = twins["flax"](folder) if "flax" in twins else None
    message = r"logits_to_keep: expected an int >= 0 \(0 keeps all\)"
    with torch.no_grad():
        whole = torch_model(torch.from_numpy(ids)).logits.numpy()
        for keep in (0, 1, 3):
            kept = torch_model(torch.from_numpy(ids), logits_to_keep=keep).logits.numpy()
            np.testing.assert_allclose(kept, whole[:, -keep:] if keep else whole, atol=1e-6)
        picked = torch_model(torch.from_numpy(ids), logits_to_keep=torch.tensor([0, 4])).logits.numpy()
        np.testing.assert_allclose(picked, whole[:, [0, 4]], atol=1e-6)
        for bad in (-1, 1.5, True, "1"):
            with pytest.raises(ValueError, match=rf"{message}, found {re.escape(repr(bad))}$"):
                torch_model(torch.from_numpy(ids), logits_to_keep=bad)
        for bad, found in ((torch.tensor([0.0, 4.0]), r"torch.float32 of shape \(2,\)"),
                           (torch.tensor([[0, 4]]), r"torch.int64 of shape \(1, 2\)")):
            with pytest.raises(ValueError, match=rf"{message} or a 1-D integer tensor of positions, found {found}"):
                torch_model(torch.from_numpy(ids), logits_to_keep=bad)
    if flax_model is not None:
        for keep in (1, 3):
            kept = np.asarray(flax_model(ids, logits_to_keep=keep).logits)
            np.testing.assert_allclose(kept, whole[:, -keep:], atol=1e-4)
        for bad in (-1, 1.5, True, "1"):
            with pytest.raises(ValueError, match=rf"{message}, found {re.escape(repr(bad))}$"):
                flax_model(ids, logits_to_keep=bad)
