"""The engine's sliding KV window (`attention_window`) against the reference's windowed decoding.

The reference's `decode.py` runs `forward_cached` with ``kv_window``: a prompt longer than the
window, then greedy steps through its cache. Both HF models, given the same window, must match its
prompt logits and its greedy continuation (logits of every step, fp32 <= 1e-4); without a window
they attend to everything (and then differ from the windowed reference, so the window is real).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from flax_support import random_tokens, write_hf_folder
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.generation.kv_window import engine_kv_window, kv_budget_window
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.weight_names import native_to_hf

NATIVE = dict(TINY_NATIVE_CONFIG)
WINDOW = 12
PROMPT = 30  # > WINDOW: most keys fall out of the window
NEW_TOKENS = 6
TOLERANCE = 1e-4


pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]


@pytest.fixture(scope="module")
def params():
    return make_native_params(NATIVE, seed=5, with_heads=False)


@pytest.fixture(scope="module")
def prompt():
    return random_tokens(7, 1, PROMPT, NATIVE["vocab_size"])


@pytest.fixture(scope="module")
def reference(params, prompt):
    """(prompt logits [T, V], greedy tokens, logits of each greedy step [N, V]) of decode.py with kv_window."""
    import jax.numpy as jnp
    from needle.model.architecture import precompute_rope_freqs
    from needle.model.decode import _f32, decode_cfg, forward_cached, init_kv_cache

    config = reference_config(NATIVE)
    length = PROMPT + NEW_TOKENS
    dcfg = decode_cfg(config, kv_window=WINDOW)
    k_cache, v_cache = init_kv_cache(config, 1, length)
    cos, sin = precompute_rope_freqs(config.d_model // config.num_heads, length, config.rope_theta)
    history = jnp.zeros((1, length), jnp.int32).at[0, :PROMPT].set(jnp.asarray(prompt[0]))
    valid = jnp.ones((1, length), bool)
    weights = _f32(params)
    logits, k_cache, v_cache = forward_cached(weights, dcfg, jnp.asarray(prompt), k_cache, v_cache,
                                              jnp.asarray(0, jnp.int32), cos, sin, None, False, history, valid, None)
    prompt_logits = np.asarray(logits[0])
    tokens, steps = [int(np.argmax(prompt_logits[-1]))], []
    for pos in range(PROMPT, PROMPT + NEW_TOKENS - 1):
        history = history.at[0, pos].set(tokens[-1])
        logits, k_cache, v_cache = forward_cached(weights, dcfg, jnp.asarray([[tokens[-1]]], jnp.int32), k_cache,
                                                  v_cache, jnp.asarray(pos, jnp.int32), cos, sin, None, False,
                                                  history, valid, None)
        steps.append(np.asarray(logits[0, -1]))
        tokens.append(int(np.argmax(steps[-1])))
    return prompt_logits, tokens, np.stack(steps)


def _torch_model(params, **overrides):
    config = NeedleConfig.from_needle_config(NATIVE, **overrides)
    model = NeedleForCausalLM(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(params, config).items()}, strict=True)
    return model.eval()


def test_pytorch_window_matches_the_reference_prompt_and_cached_decoding(params, prompt, reference):
    prompt_logits, tokens, step_logits = reference
    model = _torch_model(params)
    ids = torch.from_numpy(prompt).long()
    with torch.no_grad():
        windowed = model(ids, attention_window=WINDOW).logits[0].numpy()
        full = model(ids).logits[0].numpy()
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_window=WINDOW,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    np.testing.assert_allclose(windowed, prompt_logits, atol=TOLERANCE)
    assert np.abs(full[WINDOW:] - prompt_logits[WINDOW:]).max() > 1e-2  # the default attends to everything
    np.testing.assert_allclose(full[:WINDOW], prompt_logits[:WINDOW], atol=TOLERANCE)
    assert out.sequences[0, PROMPT:].tolist() == tokens
    cached = torch.stack(out.logits[1:], dim=1)[0].numpy()
    np.testing.assert_allclose(cached, step_logits, atol=TOLERANCE)


def test_pytorch_window_from_the_config(params, prompt, reference):
    model = _torch_model(params, attention_window=WINDOW)
    with torch.no_grad():
        logits = model(torch.from_numpy(prompt).long()).logits[0].numpy()
    np.testing.assert_allclose(logits, reference[0], atol=TOLERANCE)


@pytest.mark.skipif(not hasattr(transformers, "FlaxPreTrainedModel"), reason="transformers 5 has no Flax")
def test_flax_window_matches_the_reference_prompt_and_cached_decoding(params, prompt, reference, tmp_path):
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    prompt_logits, tokens, step_logits = reference
    config = write_hf_folder(tmp_path, NATIVE, params)
    config.attention_window = WINDOW
    model = FlaxNeedleForCausalLM.from_pretrained(tmp_path, config=config)
    np.testing.assert_allclose(np.asarray(model(prompt).logits[0]), prompt_logits, atol=TOLERANCE)
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert np.asarray(out.sequences)[0, PROMPT:].tolist() == tokens
    # The windowed forward over the whole continuation equals windowed cached decoding step by step.
    sequence = np.asarray(out.sequences)[:, : PROMPT + NEW_TOKENS - 1]
    np.testing.assert_allclose(np.asarray(model(sequence).logits[0, PROMPT:]), step_logits, atol=TOLERANCE)


def test_engine_window_is_the_budget_capped_kv_window():
    base = NeedleConfig()  # the Needle 2 geometry
    assert kv_budget_window(base) == 704
    assert engine_kv_window(base) == 704
    assert engine_kv_window(NeedleConfig(kv_window=256)) == 256
    assert NeedleConfig().attention_window == 0
    with pytest.raises(ValueError, match="attention_window"):
        NeedleConfig(attention_window=-1)


@pytest.mark.parametrize("options, problem", [
    ({"kv_window": -5}, "kv_window must be in"), ({"kv_window": "256"}, "kv_window must be an integer"),
    ({"kv_window": True}, "kv_window must be an integer"), ({"attention_window": 2.5}, "attention_window must be an integer"),
])
def test_bad_window_options_are_refused_naming_the_field(options, problem):
    with pytest.raises(ValueError, match=problem):
        NeedleConfig(**options)
    for function in (kv_budget_window, engine_kv_window):
        with pytest.raises(TypeError, match="config: expected a NeedleConfig, found dict without num_key_value_heads"):
            function({"kv_window": 256})
