"""Flax `generate(use_mtp_head=True)`: MTP self-speculation writes exactly the plain greedy tokens, and
samples with the plain sampling distribution.

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
from demo_support import demo_folder  # noqa: F401  (fixture: the demo as a HF folder)
from test_speculative import (GREEDY, PROMPT, SAMPLING, _copying_mtp, _demo_inputs, _joint_counts, _left_padded_batch,
                              _model)
from transformers import AutoModelForCausalLM, AutoTokenizer

from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM


def _flax(torch_model, folder) -> FlaxNeedleForCausalLM:
    torch_model.save_pretrained(folder)
    return FlaxNeedleForCausalLM.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return {copying: _flax(_model(seed=1, copying_mtp=copying), tmp_path_factory.mktemp(f"mtp{copying}"))
            for copying in (False, True)}


def _plain_and_drafted(model, ids, mask, **options):
    """(plain greedy sequences, the `use_mtp_head=True` output), both under `jax.jit`."""
    plain = jax.jit(lambda x, m: model.generate(x, attention_mask=m, do_sample=False, **options).sequences)
    drafted = jax.jit(lambda x, m: model.generate(x, attention_mask=m, do_sample=False, use_mtp_head=True, **options))
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


def test_flax_mtp_sampling_keeps_the_sampling_distribution_and_is_seeded(tiny_models):
    # One 3-token prompt, 4 new tokens: the first from the prompt's forward, then drafts of the copying
    # head, each kept with probability min(1, p/q) (at batch 1 the token after it then comes from the
    # same forward) or rejected (the token drawn from the residual). Decoded as 2000 batch-1 calls
    # (vmapped: every row keeps its own drafts) and as one batch of 2000 (a step keeps two tokens only
    # if every row kept its draft), the joint distribution of the 4 tokens must be that of plain Flax
    # sampling. (Drawing rejections from p instead of the residual fails this with a p-value of 1e-99.)
    from scipy.stats import chi2_contingency

    model = tiny_models[True]
    ids = np.repeat(np.asarray(_left_padded_batch()[0][:1, -3:], np.int32), 2000, axis=0)
    options = dict(max_new_tokens=4, **SAMPLING)
    plain = jax.jit(lambda x, key: model.generate(x, prng_key=key, **options).sequences)
    batched = jax.jit(lambda x, key: model.generate(x, prng_key=key, use_mtp_head=True, **options).sequences)
    one_row = jax.jit(jax.vmap(lambda x, key: model.generate(x[None], prng_key=key, use_mtp_head=True, **options)))
    keys = jax.random.split(jax.random.PRNGKey(1), len(ids))
    rows = one_row(ids, keys)
    samples = [plain(ids, jax.random.PRNGKey(0)), batched(ids, jax.random.PRNGKey(1)), rows.sequences[:, 0]]
    table = _joint_counts(*(torch.tensor(np.asarray(sample)[:, 3:]) for sample in samples))
    assert table.shape[1] > 20  # the test sees a spread distribution, not a few tokens
    assert chi2_contingency(table).pvalue > 1e-3
    drafts, accepted = int(rows.drafted.sum()), int(rows.accepted.sum())
    assert 0.1 * drafts < accepted < 0.9 * drafts  # both paths ran, in many rows
    # A fixed key gives the same tokens again, another key others.
    again = np.asarray(one_row(ids, keys).sequences)
    np.testing.assert_array_equal(again, np.asarray(rows.sequences))
    np.testing.assert_array_equal(np.asarray(batched(ids, jax.random.PRNGKey(1))), np.asarray(samples[1]))
    assert (np.asarray(batched(ids, jax.random.PRNGKey(2))) != np.asarray(samples[1])).any()


def test_flax_generate_refuses_bad_use_mtp_and_prompts_naming_them(tiny_models):
    model = tiny_models[False]
    for options, problem in [
        ({"input_ids": np.ones((1, 3), np.int32), "use_mtp": "yes"}, r"use_mtp: expected True, False or None, found 'yes'"),
        ({"input_ids": np.ones((1, 3), np.float32)}, r"input_ids: expected an integer tensor \[batch, tokens\], found float32"),
        ({"input_ids": np.ones(3, np.int32)}, r"input_ids: expected an integer tensor \[batch, tokens\], found int32 of shape \(3,\)"),
        ({"input_ids": np.full((1, 3), 10**6, np.int32), "use_mtp": True}, r"input_ids: expected ids in \[0, "),
        ({"input_ids": [[1, 2], [3]]}, r"input_ids: expected an integer tensor"),
    ]:
        with pytest.raises(ValueError, match=problem):
            model.generate(**options, max_new_tokens=2, do_sample=False)
