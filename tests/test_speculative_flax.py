"""Flax `generate(use_mtp=True)`: MTP self-speculation writes exactly the plain greedy tokens.

The models come from the PyTorch tests' builders (`test_speculative`), saved and read back by the
Flax model: a random MTP head (every draft rejected), the copying head (every draft kept on the
random model, which repeats one token), and the demo with the copying head, whose drafts hold on
"11:11" and fail elsewhere, so rejections (engram state stepped back) and acceptances interleave.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from test_pipeline import demo_folder  # noqa: F401  (fixture: the demo as a HF folder)
from test_speculative import GREEDY, PROMPT, _copying_mtp, _demo_inputs, _left_padded_batch, _model
from transformers import AutoModelForCausalLM, AutoTokenizer

from needle_hf.modeling_flax_needle import FlaxNeedleForCausalLM


def _flax(torch_model, folder) -> FlaxNeedleForCausalLM:
    torch_model.save_pretrained(folder)
    return FlaxNeedleForCausalLM.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return {copying: _flax(_model(seed=1, copying_mtp=copying), tmp_path_factory.mktemp(f"mtp{copying}"))
            for copying in (False, True)}


def _plain_and_drafted(model, ids, mask, **options):
    """(plain greedy sequences, the `use_mtp=True` output), both under `jax.jit`."""
    plain = jax.jit(lambda x, m: model.generate(x, attention_mask=m, do_sample=False, **options).sequences)
    drafted = jax.jit(lambda x, m: model.generate(x, attention_mask=m, do_sample=False, use_mtp=True, **options))
    return np.asarray(plain(ids, mask)), drafted(ids, mask)


@pytest.mark.parametrize("copying_mtp", [False, True], ids=["every-draft-rejected", "every-draft-accepted"])
def test_flax_mtp_speculation_writes_the_greedy_tokens(tiny_models, copying_mtp):
    ids, mask = (np.asarray(a, np.int32) for a in _left_padded_batch())
    options = {k: v for k, v in GREEDY.items() if k != "do_sample"}
    # The left-padded batch also stops at an EOS: the token row 0 repeats (it ends there, the others go on).
    eos = int(_model(seed=1, copying_mtp=False).generate(torch.from_numpy(ids[:1]), **GREEDY)[0, PROMPT])
    for batch in ((1, 3) if copying_mtp else (3,)):  # (compiling costs more than decoding here)
        batch_options = options if batch == 1 else {**options, "eos_token_id": eos}
        plain, out = _plain_and_drafted(tiny_models[copying_mtp], ids[:batch], mask[:batch], **batch_options)
        np.testing.assert_array_equal(np.asarray(out.sequences), plain)
        assert int(out.drafted) > 0 and plain.shape[1] == PROMPT + GREEDY["max_new_tokens"]
        if copying_mtp:
            assert int(out.accepted) == int(out.drafted) and int(out.forwards) <= GREEDY["max_new_tokens"] // 2
        else:
            assert int(out.accepted) == 0
        if batch == 3:
            assert (plain[0, PROMPT + 1 :] == GREEDY["pad_token_id"]).all() and (plain[1:, -1] != eos).all()


def test_flax_mtp_speculation_after_rejections_and_acceptances_on_the_demo(demo_folder, tmp_path):  # noqa: F811
    model = _flax(_copying_mtp(AutoModelForCausalLM.from_pretrained(demo_folder)), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(demo_folder)
    batch = _demo_inputs(tokenizer, ["Wake me up at 11:11 tomorrow."])
    ids, mask = np.asarray(batch["input_ids"], np.int32), np.asarray(batch["attention_mask"], np.int32)
    plain, out = _plain_and_drafted(model, ids[:1], mask[:1], max_new_tokens=48)
    np.testing.assert_array_equal(np.asarray(out.sequences), plain)
    assert 0 < int(out.accepted) < int(out.drafted)


def test_flax_mtp_speculation_refuses_sampling(tiny_models):
    ids = np.asarray(_left_padded_batch()[0][:1], np.int32)
    with pytest.raises(ValueError, match="do_sample must be False"):
        tiny_models[True].generate(ids, use_mtp=True, do_sample=True, max_new_tokens=4)
