"""Flax generate(): a real cache for attention and engram state, every decoding mode."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flax_support import random_tokens, write_hf_folder
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config
from needle_hf.models.needle.modeling_flax_needle import FUSED_QKVG_KERNEL, FlaxNeedleForCausalLM, with_decoding_kernels
from needle_hf.models.needle.numerics import FUSED_QKVG_PROJECTIONS

NATIVE = dict(TINY_NATIVE_CONFIG, vocab_size=800)  # the fixture tokenizer's vocabulary
F32_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    params = make_native_params(NATIVE, 4)
    folder = tmp_path_factory.mktemp("gen")
    write_hf_folder(folder, NATIVE, params)
    return str(folder), params


@pytest.fixture(scope="module")
def model(checkpoint):
    return FlaxNeedleForCausalLM.from_pretrained(checkpoint[0])


@pytest.fixture(scope="module")
def cached_step(model):
    """One jitted cached forward for the module: each chunk shape compiles once, for every test."""
    return jax.jit(lambda ids, mask, pos, cache: model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache))


def _decode_step_by_step(model, step, tokens, mask, chunks):
    """Logits [B, T, V] computed through the cache (`step`: the `cached_step` fixture), feeding the
    sequence in the given chunk sizes."""
    b, t = tokens.shape
    cache = model.init_cache(b, t)
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    out, start = [], 0
    for size in chunks:
        result = step(tokens[:, start : start + size], mask, positions[:, start : start + size], cache)
        cache = result.past_key_values
        out.append(np.asarray(result.logits))
        start += size
    assert start == t
    return np.concatenate(out, axis=1)


def test_cached_decoding_equals_full_forward_at_every_position(model, cached_step):
    tokens = random_tokens(1, 2, 24, NATIVE["vocab_size"])  # > 11 tokens: past the engram conv reach
    mask = np.ones_like(tokens)
    full = np.asarray(model(tokens).logits)
    stepped = _decode_step_by_step(model, cached_step, tokens, mask, [5] + [1] * 19)
    np.testing.assert_allclose(stepped, full, atol=F32_TOL, rtol=0)
    # Multi-token chunks at offsets 6 and 11 (one longer than the conv reach); sizes 5 and 1 are
    # compiled already.
    chunked = _decode_step_by_step(model, cached_step, tokens, mask, [5, 1, 5, 13])
    np.testing.assert_allclose(chunked, full, atol=F32_TOL, rtol=0)


def test_cached_decoding_with_left_padding_equals_unpadded_rows(model, cached_step):
    long, short = random_tokens(2, 1, 20, NATIVE["vocab_size"])[0], random_tokens(3, 1, 13, NATIVE["vocab_size"])[0]
    tokens = np.zeros((2, 20), np.int32)
    mask = np.zeros((2, 20), np.int32)
    tokens[0], mask[0] = long, 1
    tokens[1, 7:], mask[1, 7:] = short, 1
    stepped = _decode_step_by_step(model, cached_step, tokens, mask, [8] + [1] * 12)
    np.testing.assert_allclose(stepped[0], np.asarray(model(long[None]).logits[0]), atol=F32_TOL, rtol=0)
    np.testing.assert_allclose(stepped[1, 7:], np.asarray(model(short[None]).logits[0]), atol=F32_TOL, rtol=0)


def test_greedy_generate_equals_the_reference_generation(model, checkpoint, needle_spm_model):
    """Token for token against the reference's own greedy generation (needle.model.run.batch_generate)."""
    from needle.model.architecture import SimpleAttentionNetwork
    from needle.model.run import batch_generate
    from needle.model.tokenizer import BOS_ID, SANTokenizer

    _, params = checkpoint
    reference_tokenizer = SANTokenizer(str(needle_spm_model))
    prompts = ["Set an alarm for seven.", "Turn the lights off in the kitchen please", "今天天气很好"]
    new_tokens = 12
    reference = batch_generate(
        SimpleAttentionNetwork(reference_config(NATIVE)), params, reference_tokenizer, prompts,
        max_new_tokens=new_tokens, return_signals=True,
    )
    generate = jax.jit(lambda ids, p: model.generate(ids, params=p, max_new_tokens=new_tokens, do_sample=False).sequences)
    for prompt, expected in zip(prompts, reference):
        ids = np.asarray([[BOS_ID] + reference_tokenizer.encode(prompt)], np.int32)
        ours = [int(t) for t in np.asarray(generate(ids, model.params))[0, ids.shape[1] :]]
        eos = model.generation_config.eos_token_id
        if eos in ours:  # the reference stops before EOS and pads nothing
            ours = ours[: ours.index(eos)]
        assert ours == expected["tokens"], prompt


def test_decoding_kernels_give_the_plain_logits_and_yield_to_lora(model, cached_step):
    """generate() runs on `with_decoding_kernels` (q, k, v and gate kernels in one matmul): the same
    cached-step logits as the plain tree, and a LoRA adapter on a projection still applies."""
    fused = with_decoding_kernels(model.params, model.config)
    attn = fused["model"]["layers"]["1"]["self_attn"]
    np.testing.assert_array_equal(
        attn[FUSED_QKVG_KERNEL],
        np.concatenate([attn[name]["kernel"] for name in FUSED_QKVG_PROJECTIONS], axis=1),
    )
    assert FUSED_QKVG_KERNEL not in model.params["model"]["layers"]["1"]["self_attn"]  # the model's tree is untouched
    tokens = random_tokens(12, 2, 9, NATIVE["vocab_size"])
    mask = np.ones_like(tokens)
    positions = np.broadcast_to(np.arange(9), tokens.shape)

    def decode(params, lora=None):
        cache = model.init_cache(2, 9)
        prefill = model(tokens[:, :8], attention_mask=mask, position_ids=positions[:, :8], past_key_values=cache,
                        params=params, lora=lora)
        step = model(tokens[:, 8:], attention_mask=mask, position_ids=positions[:, 8:],
                     past_key_values=prefill.past_key_values, params=params, lora=lora)
        return np.asarray(prefill.logits), np.asarray(step.logits)

    for plain, derived in zip(decode(model.params), decode(fused)):
        np.testing.assert_allclose(derived, plain, atol=1e-5, rtol=0)
    d, r = model.config.hidden_size, 2
    rng = np.random.default_rng(3)
    adapter = {"A": rng.normal(0, 0.5, (d, r)).astype(np.float32),
               "B": rng.normal(0, 0.5, (r, model.config.attention_dim)).astype(np.float32)}
    lora = {"model": {"layers": {"1": {"self_attn": {"q_proj": adapter}}}}}
    with_adapter = decode(model.params, lora)
    assert np.abs(with_adapter[1] - decode(model.params)[1]).max() > 1e-3  # the adapter changes the logits
    for plain, derived in zip(with_adapter, decode(fused, lora)):
        np.testing.assert_allclose(derived, plain, atol=1e-5, rtol=0)


def test_left_padded_batch_generation_equals_single_rows(model):
    rows = [random_tokens(7, 1, 9, NATIVE["vocab_size"])[0], random_tokens(8, 1, 4, NATIVE["vocab_size"])[0]]
    width = 9
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    batched = np.asarray(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False).sequences)
    for i, row in enumerate(rows):
        alone = np.asarray(model.generate(row[None], max_new_tokens=8, do_sample=False).sequences)
        np.testing.assert_array_equal(batched[i, width:], alone[0, len(row) :])


def test_sampling_is_reproducible_with_the_same_prng_key(model):
    ids = random_tokens(9, 2, 6, NATIVE["vocab_size"])
    sample = jax.jit(
        lambda key: model.generate(ids, do_sample=True, temperature=1.3, top_k=50, top_p=0.9, prng_key=key, max_new_tokens=10).sequences
    )
    first, again = np.asarray(sample(jax.random.PRNGKey(0))), np.asarray(sample(jax.random.PRNGKey(0)))
    other = np.asarray(sample(jax.random.PRNGKey(1)))
    np.testing.assert_array_equal(first, again)
    assert first.shape == (2, 16)
    assert not np.array_equal(first, other)
    assert (first >= 0).all() and (first < NATIVE["vocab_size"]).all()


def test_beam_search_runs_and_respects_max_length_and_eos(model):
    ids = random_tokens(10, 1, 6, NATIVE["vocab_size"])
    # The greedy first token: the argmax of the prompt's last logits (one forward, not a compiled loop).
    first_token = int(np.asarray(model(ids).logits)[0, -1].argmax())
    beams = np.asarray(model.generate(ids, num_beams=3, max_new_tokens=5, do_sample=False).sequences)
    assert beams.shape == (1, 11)
    np.testing.assert_array_equal(beams[0, :6], ids[0])
    # Declaring the greedy first token as EOS ends greedy decoding at once: the rest is padding.
    stopped = np.asarray(model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=first_token, pad_token_id=0).sequences)
    assert stopped[0, 6] == first_token and (stopped[0, 7:] == 0).all()


def test_prompt_plus_new_tokens_beyond_max_positions_raises(model):
    ids = random_tokens(11, 1, 100, NATIVE["vocab_size"])
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        model.generate(ids, max_new_tokens=40)
