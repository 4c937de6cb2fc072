"""FlaxNeedleForCausalLM computes what the reference Needle 2 computes."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import needle_hf  # noqa: F401  (registers the Auto classes)
from flax_support import random_tokens, write_hf_folder
from needle_reference import (
    BASE_NATIVE_CONFIG,
    TINY_NATIVE_CONFIG,
    make_native_params,
    reference_heads,
    reference_logits,
)
from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM, FlaxNeedleModel, sinkhorn
from needle_hf.models.needle.weight_names import NeedleWeightsError, hf_weight_shapes
from transformers import FlaxAutoModelForCausalLM

SEEDS = (0, 1, 2)
F32_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """{seed: (folder, native params)} for the tiny config, every leaf perturbed."""
    out = {}
    for seed in SEEDS:
        params = make_native_params(TINY_NATIVE_CONFIG, seed)
        folder = tmp_path_factory.mktemp(f"tiny{seed}")
        write_hf_folder(folder, TINY_NATIVE_CONFIG, params)
        out[seed] = (str(folder), params)
    return out


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    return FlaxNeedleForCausalLM.from_pretrained(tiny_checkpoints[0][0])


def _forward(model, tokens, attention_mask=None):
    fn = jax.jit(lambda p, t, m: model(t, attention_mask=m, params=p, output_mtp_logits=True, output_hidden_states=True))
    mask = np.ones_like(tokens) if attention_mask is None else attention_mask
    return fn(model.params, tokens, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_logits_mtp_and_heads_match_reference_fp32(tiny_checkpoints, seed):
    folder, params = tiny_checkpoints[seed]
    model = FlaxNeedleForCausalLM.from_pretrained(folder)
    tokens = random_tokens(seed, 2, 21, TINY_NATIVE_CONFIG["vocab_size"])
    out = _forward(model, tokens)
    ref_logits, ref_mtp = reference_logits(TINY_NATIVE_CONFIG, params, tokens)
    assert np.abs(ref_logits).max() > 1.0  # the check is not vacuous
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=F32_TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out.mtp_logits), ref_mtp, atol=F32_TOL, rtol=0)

    ref_embedding, ref_confidence = reference_heads(TINY_NATIVE_CONFIG, params, tokens)
    embedding, log_temperature = model.contrastive_embedding(tokens)
    np.testing.assert_allclose(np.asarray(embedding), ref_embedding, atol=F32_TOL, rtol=0)
    np.testing.assert_allclose(float(log_temperature), params["contrastive_head"]["log_temp"], rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(model.confidence_logit(tokens)), ref_confidence, atol=F32_TOL, rtol=0)


def test_hidden_states_are_the_reference_hidden_cells(tiny_checkpoints):
    from needle.model.architecture import SimpleAttentionNetwork

    from needle_reference import reference_config

    folder, params = tiny_checkpoints[1]
    model = FlaxNeedleForCausalLM.from_pretrained(folder)
    tokens = random_tokens(5, 1, 12, TINY_NATIVE_CONFIG["vocab_size"])
    out = _forward(model, tokens)
    ref = SimpleAttentionNetwork(reference_config(TINY_NATIVE_CONFIG))
    cells = ref.apply({"params": params}, jnp.asarray(tokens), method=ref.hidden_cells)  # [B, T, L+1, D]
    ours = np.stack([np.asarray(h) for h in out.hidden_states], axis=2)
    assert ours.shape == cells.shape
    np.testing.assert_allclose(ours, np.asarray(cells), atol=F32_TOL, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_rows_equal_unpadded_sequences(tiny_model, side):
    vocab = TINY_NATIVE_CONFIG["vocab_size"]
    rows = [random_tokens(11, 1, 19, vocab)[0], random_tokens(12, 1, 7, vocab)[0]]
    width = max(len(r) for r in rows)
    tokens = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), np.int32)
    for i, row in enumerate(rows):
        sl = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        tokens[i, sl], mask[i, sl] = row, 1
    batched = np.asarray(_forward(tiny_model, tokens, mask).logits)
    for i, row in enumerate(rows):
        alone = np.asarray(_forward(tiny_model, row[None]).logits[0])
        sl = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        np.testing.assert_allclose(batched[i, sl], alone, atol=F32_TOL, rtol=0)


def test_bf16_argmax_agrees_with_reference_bf16(tiny_checkpoints):
    folder, params = tiny_checkpoints[2]
    model = FlaxNeedleForCausalLM.from_pretrained(folder, dtype=jnp.bfloat16)
    tokens = random_tokens(21, 4, 64, TINY_NATIVE_CONFIG["vocab_size"])
    ours = np.asarray(_forward(model, tokens).logits)
    ref, _ = reference_logits(dict(TINY_NATIVE_CONFIG, dtype="bfloat16"), params, tokens)
    agreement = (ours.argmax(-1) == ref.argmax(-1)).mean()
    assert agreement >= 0.99, agreement
    assert np.abs(ours - ref).max() < 0.1


def test_fp16_params_keep_their_dtype_and_track_fp32(tiny_checkpoints, tmp_path):
    """Released checkpoints may hold fp16 params; they load as fp16 and compute close to fp32."""
    _, params = tiny_checkpoints[0]
    write_hf_folder(tmp_path, TINY_NATIVE_CONFIG, params, dtype=np.float16)
    model = FlaxNeedleForCausalLM.from_pretrained(tmp_path)
    assert model.params["model"]["norm"]["weight"].dtype == jnp.float16
    tokens = random_tokens(3, 2, 16, TINY_NATIVE_CONFIG["vocab_size"])
    ours = np.asarray(_forward(model, tokens).logits)
    fp16_params = jax.tree.map(lambda a: np.asarray(a, np.float16), params)
    ref, _ = reference_logits(TINY_NATIVE_CONFIG, fp16_params, tokens)
    np.testing.assert_allclose(ours, ref, atol=F32_TOL, rtol=0)


def test_save_load_round_trip_is_bit_exact(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors" in files and "config.json" in files and "flax_model.msgpack" not in files
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        assert f.metadata()["format"] == "pt"
        assert set(f.keys()) == set(hf_weight_shapes(tiny_model.config))
    reloaded = FlaxAutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(reloaded, FlaxNeedleForCausalLM)
    before = jax.tree_util.tree_leaves_with_path(tiny_model.params)
    after = dict(jax.tree_util.tree_leaves_with_path(reloaded.params))
    assert len(before) == len(after)
    for path, leaf in before:
        assert np.array_equal(np.asarray(leaf), np.asarray(after[path])), path


def test_base_model_reads_the_backbone_of_a_causal_lm_folder(tiny_checkpoints):
    folder, _ = tiny_checkpoints[0]
    lm = FlaxNeedleForCausalLM.from_pretrained(folder)
    base = FlaxNeedleModel.from_pretrained(folder)
    tokens = random_tokens(4, 1, 9, TINY_NATIVE_CONFIG["vocab_size"])
    hidden = np.asarray(base(tokens).last_hidden_state)
    embedding = np.asarray(lm.params["model"]["embed_tokens"]["embedding"])
    np.testing.assert_allclose(hidden @ embedding.T, np.asarray(lm(tokens).logits), atol=F32_TOL, rtol=0)


def test_loading_works_with_torch_blocked(tiny_checkpoints):
    folder, _ = tiny_checkpoints[0]
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, needle_hf\n"
        "from transformers import FlaxAutoModelForCausalLM\n"
        f"m = FlaxAutoModelForCausalLM.from_pretrained({folder!r})\n"
        "assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print(type(m).__name__, np.asarray(m(np.array([[5, 6, 7]])).logits).shape)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FlaxNeedleForCausalLM (1, 3, 512)" in done.stdout


def _rewrite_weights(folder, edit):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"), "missing tensor model.layers.1.self_attn.q_proj.weight"),
        (lambda t: t.update({"model.layers.0.extra": np.zeros(3, np.float32)}), "unexpected tensor model.layers.0.extra"),
        (
            lambda t: t.update({"model.layers.2.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}),
            "model.layers.2.self_attn.k_proj.weight: expected shape (32, 64), got (64, 64)",
        ),
        (
            lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}),
            "tensor lm_head.weight differs from model.embed_tokens.weight",
        ),
    ],
)
def test_bad_weights_raise_instead_of_reinitialising(tiny_checkpoints, tmp_path, edit, message):
    folder, params = tiny_checkpoints[0]
    write_hf_folder(tmp_path, TINY_NATIVE_CONFIG, params)
    _rewrite_weights(tmp_path, edit)
    with pytest.raises(NeedleWeightsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FlaxNeedleForCausalLM.from_pretrained(tmp_path)


def test_a_file_that_also_stores_the_tied_head_loads_like_one_that_does_not(tiny_checkpoints, tiny_model, tmp_path):
    folder, params = tiny_checkpoints[0]
    write_hf_folder(tmp_path, TINY_NATIVE_CONFIG, params)
    _rewrite_weights(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    model = FlaxNeedleForCausalLM.from_pretrained(tmp_path)
    ids = np.array([[5, 6, 7, 8]])
    np.testing.assert_array_equal(np.asarray(model(ids).logits), np.asarray(tiny_model(ids).logits))


def test_flax_format_safetensors_are_refused(tiny_checkpoints, tmp_path):
    folder, params = tiny_checkpoints[0]
    write_hf_folder(tmp_path, TINY_NATIVE_CONFIG, params)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "flax"})
    with pytest.raises(NeedleWeightsError, match="format 'pt'"):
        FlaxNeedleForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("spread", [8.0, 200.0], ids=["linear-space", "log-space"])
def test_sinkhorn_matches_the_reference_rounds(spread):
    """Lane mixing as the reference computes it (20 log-space rounds), also for logits spread too far
    (> 30) for `sinkhorn`'s linear-space form, where it falls back to log space."""
    from needle.model.architecture import _sinkhorn

    logits = jnp.asarray(np.random.default_rng(3).uniform(0.0, spread, size=(2, 5, 4, 4)).astype(np.float32))
    assert np.max(np.abs(np.asarray(jax.jit(sinkhorn)(logits)) - np.asarray(_sinkhorn(logits)))) <= 1e-6


def test_over_long_input_raises():
    from needle_hf.models.needle.configuration_needle import NeedleConfig

    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG)
    model = FlaxNeedleForCausalLM(config, _do_init=False)
    with pytest.raises(ValueError, match="more than max_position_embeddings=128"):
        model(np.ones((1, 129), np.int32), params={})


@pytest.mark.full_size
def test_needle2_geometry_matches_reference(tmp_path):
    params = make_native_params(BASE_NATIVE_CONFIG, 7)
    config = write_hf_folder(tmp_path, BASE_NATIVE_CONFIG, params)
    assert sum(int(np.prod(s)) for s in hf_weight_shapes(config).values()) == 44_938_997 + 4 * 512 + 512 * 4 * 128 + 1 + 8 * 512 + 8 * 512 + 1
    model = FlaxNeedleForCausalLM.from_pretrained(tmp_path)
    tokens = random_tokens(8, 1, 48, 8192)
    out = _forward(model, tokens)
    ref_logits, ref_mtp = reference_logits(BASE_NATIVE_CONFIG, params, tokens)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=F32_TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out.mtp_logits), ref_mtp, atol=F32_TOL, rtol=0)
    ref_embedding, ref_confidence = reference_heads(BASE_NATIVE_CONFIG, params, tokens)
    np.testing.assert_allclose(np.asarray(model.contrastive_embedding(tokens)[0]), ref_embedding, atol=F32_TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(model.confidence_logit(tokens)), ref_confidence, atol=F32_TOL, rtol=0)


def test_attention_outputs_are_the_probabilities_of_each_layer(tiny_model):
    config = tiny_model.config
    tokens = random_tokens(6, 2, 10, TINY_NATIVE_CONFIG["vocab_size"])
    mask = np.ones_like(tokens)
    mask[1, :3] = 0  # left padding
    out = jax.jit(lambda p, t, m: tiny_model(t, attention_mask=m, params=p, output_attentions=True))(tiny_model.params, tokens, mask)
    assert len(out.attentions) == config.num_hidden_layers
    for weights in out.attentions:
        weights = np.asarray(weights)
        assert weights.shape == (2, config.num_attention_heads, 10, 10)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
        assert np.all(np.triu(weights, k=1) == 0)  # causal
        assert np.all(weights[1, :, 3:, :3] == 0)  # padding keys are never read
        np.testing.assert_allclose(weights[1, :, :3], np.broadcast_to(np.eye(10)[:3], weights[1, :, :3].shape))  # pad rows: themselves
    assert tiny_model(tokens, attention_mask=mask).attentions is None
    # One cached decoding step gives the last row of the full forward's attention.
    prompt = tokens[:1, :9]
    cache = tiny_model.init_cache(1, 10)
    mask10 = np.ones((1, 10), np.int32)
    positions = np.arange(9)[None]
    step = tiny_model(prompt, attention_mask=mask10, position_ids=positions, past_key_values=cache)
    step = tiny_model(tokens[:1, 9:], attention_mask=mask10, position_ids=np.array([[9]]),
                      past_key_values=step.past_key_values, output_attentions=True)
    full = tiny_model(tokens[:1], output_attentions=True)
    for cached, whole in zip(step.attentions, full.attentions):
        np.testing.assert_allclose(np.asarray(cached)[:, :, 0], np.asarray(whole)[:, :, -1], atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_checkpoints):
    folder, _ = tiny_checkpoints[1]
    plain = FlaxNeedleForCausalLM.from_pretrained(folder)
    checkpointed = FlaxNeedleForCausalLM.from_pretrained(folder, gradient_checkpointing=True)
    enabled = FlaxNeedleForCausalLM.from_pretrained(folder)
    enabled.enable_gradient_checkpointing()
    tokens = random_tokens(9, 2, 12, TINY_NATIVE_CONFIG["vocab_size"])

    def loss(model, params):
        logits = model(tokens[:, :-1], params=params).logits
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)
        return -jnp.mean(picked)

    def compiled_gradient(model):
        return jax.jit(jax.grad(lambda p: loss(model, p))).lower(model.params).compile()

    plain_gradient = compiled_gradient(plain)
    want = plain_gradient(plain.params)
    plain_temp = plain_gradient.memory_analysis().temp_size_in_bytes
    for model in (checkpointed, enabled):
        assert model.module.gradient_checkpointing
        gradient = compiled_gradient(model)
        # The layers really are rematerialised: the compiled backward keeps less alive at once.
        assert gradient.memory_analysis().temp_size_in_bytes < plain_temp
        got = gradient(model.params)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5, err_msg=str(path))


def test_causal_attention_in_blocks_is_the_whole_attention():
    from needle_hf.models.needle.modeling_flax_needle import _grouped_attention, causal_attention_in_blocks
    from needle_hf.models.needle.numerics import CAUSAL_QUERY_ROWS

    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    batch, kv_heads, groups, length, width = 2, 2, 2, CAUSAL_QUERY_ROWS + 45, 16
    q = jax.random.normal(keys[0], (batch, kv_heads, groups, length, width))
    k = jax.random.normal(keys[1], (batch, kv_heads, width, length))
    v = jax.random.normal(keys[2], (batch, kv_heads, length, width))
    positions = np.arange(length)
    visible = np.ones((batch, length), bool)
    visible[1, :7] = False  # left padding: those rows see themselves only
    allowed = ((positions[None, :] <= positions[:, None])[None] & visible[:, None, :]) | np.eye(length, dtype=bool)[None]
    mask = jnp.asarray(allowed)[:, None, None]  # [B, 1, 1, T, S]
    scale = jnp.sqrt(jnp.float32(width))
    whole, _ = _grouped_attention(q, k, v, mask, scale)
    np.testing.assert_allclose(np.asarray(causal_attention_in_blocks(q, k, v, mask, scale)), np.asarray(whole), atol=1e-5)


def test_a_cached_prompt_longer_than_a_block_gives_the_uncached_logits(tiny_model):
    """A prompt written at the cache's start runs its attention in blocks (`causal_attention_in_blocks`);
    a second chunk written later attends over the whole cache. Both give the uncached forward's logits."""
    from needle_hf.models.needle.numerics import CAUSAL_QUERY_ROWS

    length = CAUSAL_QUERY_ROWS + 36
    tokens = random_tokens(8, 1, length, TINY_NATIVE_CONFIG["vocab_size"])
    whole = np.asarray(_forward(tiny_model, tokens).logits)
    forward = jax.jit(lambda p, t, m, pos, c: tiny_model(t, attention_mask=m, position_ids=pos, params=p, past_key_values=c))
    mask = np.ones((1, 128), np.int32)
    first = forward(tiny_model.params, tokens, mask, np.arange(length)[None], tiny_model.init_cache(1, 128))
    np.testing.assert_allclose(np.asarray(first.logits), whole, atol=F32_TOL, rtol=F32_TOL)
    split = length - CAUSAL_QUERY_ROWS - 1  # the second chunk is still longer than a block
    head = forward(tiny_model.params, tokens[:, :split], mask, np.arange(split)[None], tiny_model.init_cache(1, 128))
    tail = forward(tiny_model.params, tokens[:, split:], mask, np.arange(split, length)[None], head.past_key_values)
    np.testing.assert_allclose(np.asarray(tail.logits), whole[:, split:], atol=F32_TOL, rtol=F32_TOL)


def test_logits_to_keep_keeps_the_last_positions_logits(tiny_model):
    tokens = random_tokens(9, 2, 12, TINY_NATIVE_CONFIG["vocab_size"])
    whole = np.asarray(tiny_model(tokens).logits)
    for keep in (1, 3):
        kept = np.asarray(tiny_model(tokens, logits_to_keep=keep).logits)
        assert kept.shape == (2, keep, TINY_NATIVE_CONFIG["vocab_size"])
        np.testing.assert_allclose(kept, whole[:, -keep:], atol=1e-6)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"logits_to_keep: expected an int >= 0 \(0 keeps all\), found"):
            tiny_model(tokens, logits_to_keep=bad)
