"""The PyTorch and the Flax model, op by op, on the same inputs.

The twins share no array code, only `specification_needle`: the helper names and argument orders it
lists, the attention rule, the position and prompt checks. Each test here feeds one op (or one
layer, with the same weights in both) the same inputs, drawn by Hypothesis where the inputs have a
shape worth searching (lengths, offsets, windows, padding, spreads), and compares the outputs.
`test_ops_parity.py` pins the same ops to the NumPy statement.
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from needle_reference import TINY_NATIVE_CONFIG

from needle_hf.models.needle import modeling_flax_needle as flax_twin
from needle_hf.models.needle import modeling_needle as torch_twin
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.numerics import SINKHORN_LINEAR_SPACE_MAX_SPREAD, rope_inverse_frequencies
from needle_hf.models.needle.specification_needle import TWIN_HELPERS, attention_rule

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # conftest: torch on one thread

TOLERANCE = 2e-5  # float32, two frameworks
OPS = settings(max_examples=15, deadline=None)


def _np(value) -> np.ndarray:
    return value.detach().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _close(torch_value, flax_value, tol: float = TOLERANCE):
    np.testing.assert_allclose(_np(torch_value), _np(flax_value), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def config() -> NeedleConfig:
    return NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, use_contrastive_head=True, use_confidence_head=True)


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn at random (random init leaves norms, gates and biases at 0 or 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return module.eval()


def _flax_params(module: torch.nn.Module) -> dict:
    """The torch module's parameters as the Flax twin names them (`nn.Linear` weight -> kernel, transposed)."""
    tree: dict = {}
    for name, parameter in module.named_parameters():
        *owner_path, leaf = name.split(".")
        owner = module.get_submodule(".".join(owner_path))
        value = parameter.detach().numpy()
        if isinstance(owner, torch.nn.Linear) and leaf == "weight":
            leaf, value = "kernel", value.T
        node = tree
        for part in owner_path:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return {"params": tree}


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------------------------------
# Names and argument orders


@pytest.mark.parametrize("name", TWIN_HELPERS)
def test_both_twins_define_each_helper_with_the_same_arguments(name):
    def positional(function) -> list[str]:
        return [
            p.name for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

    assert positional(getattr(torch_twin, name)) == positional(getattr(flax_twin, name))


# --------------------------------------------------------------------------------------------------
# Element-wise and table ops


@OPS
@given(seed=st.integers(0, 2**16), width=st.sampled_from([8, 24, 64]), scale=st.floats(0.01, 100.0),
       eps=st.sampled_from([1e-6, 1e-5]))
def test_rms_norms(seed, width, scale, eps):
    x = (_rng(seed).standard_normal((2, 3, width)) * scale).astype(np.float32)
    weight = (_rng(seed + 1).standard_normal(width) * 0.3).astype(np.float32)
    _close(torch_twin.rms_unit(torch.from_numpy(x), eps), flax_twin.rms_unit(jnp.asarray(x), eps))
    _close(
        torch_twin.zero_centred_rms_norm(torch.from_numpy(x), torch.from_numpy(weight), eps),
        flax_twin.zero_centred_rms_norm(jnp.asarray(x), jnp.asarray(weight), eps),
    )


@OPS
@given(seed=st.integers(0, 2**16), width=st.sampled_from([8, 24, 64]), scale=st.floats(0.01, 100.0))
def test_engram_read(seed, width, scale):
    u, key, value = ((_rng(seed + i).standard_normal((2, 3, width)) * scale).astype(np.float32) for i in range(3))
    _close(torch_twin.add_engram_read(*map(torch.from_numpy, (u, key, value)), 1e-6),
           flax_twin.add_engram_read(*map(jnp.asarray, (u, key, value)), 1e-6), tol=1e-4 * max(scale, 1.0))


@OPS
@given(seed=st.integers(0, 2**16), start=st.integers(0, 4000), head_dim=st.sampled_from([8, 16, 64]))
def test_rope_tables_and_rotation(seed, start, head_dim):
    length, heads = 5, 2
    inverse = rope_inverse_frequencies(head_dim, 10_000.0)
    positions = np.arange(start, start + length)[None]  # [B, T]
    x = _rng(seed).standard_normal((1, length, heads, head_dim)).astype(np.float32)  # [B, T, N, H]

    torch_cos, torch_sin = torch_twin.rope_tables(torch.from_numpy(positions), torch.from_numpy(inverse))  # [B, T, H]
    flax_cos, flax_sin = flax_twin.rope_tables(jnp.asarray(positions), inverse)  # [B, T, H/2]
    _close(torch_cos[..., : head_dim // 2], flax_cos)
    _close(torch_cos[..., head_dim // 2:], flax_cos)  # both halves the same in torch
    _close(torch_sin[..., : head_dim // 2], flax_sin)

    rotated = torch_twin.apply_rotary(torch.from_numpy(x).transpose(1, 2), torch_cos[:, None], torch_sin[:, None])
    _close(rotated.transpose(1, 2), flax_twin.apply_rotary(jnp.asarray(x), flax_cos, flax_sin), tol=1e-4)


@OPS
@given(seed=st.integers(0, 2**16), spread=st.sampled_from([1.0, 10.0, SINKHORN_LINEAR_SPACE_MAX_SPREAD * 2]),
       iterations=st.sampled_from([1, 5, 20]))
def test_sinkhorn_both_paths(seed, spread, iterations):
    logits = (_rng(seed).uniform(-1, 1, (2, 3, 4, 4)) * spread / 2).astype(np.float32)
    _close(torch_twin.sinkhorn(torch.from_numpy(logits), iterations),
           flax_twin.sinkhorn(jnp.asarray(logits), iterations), tol=1e-5)
    _close(torch_twin.log_space_sinkhorn(torch.from_numpy(logits), iterations),
           flax_twin.log_space_sinkhorn(jnp.asarray(logits), iterations), tol=1e-5)


@OPS
@given(seed=st.integers(0, 2**16), length=st.integers(1, 12), offset=st.integers(0, 14))
def test_shift_right_and_engram_hash(seed, length, offset):
    tokens = _rng(seed).integers(0, 8192, (2, length))
    _close(torch_twin.shift_right(torch.from_numpy(tokens), offset), flax_twin.shift_right(jnp.asarray(tokens), offset))
    orders, heads, slots = (2, 3), 2, 1021
    np.testing.assert_array_equal(
        _np(torch_twin.engram_hash_indices(torch.from_numpy(tokens), orders, heads, slots)),
        _np(flax_twin.engram_hash_indices(jnp.asarray(tokens), orders, heads, slots)),
    )


@pytest.mark.parametrize("deploy_numerics", [False, True])
def test_walsh_operand_and_transform(config, deploy_numerics):
    config = NeedleConfig(**{**config.to_dict(), "deploy_numerics": deploy_numerics})
    z = _rng(3).standard_normal((2, 3, config.hadamard_size)).astype(np.float32)
    torch_operand = torch_twin.walsh_operand(config, lambda name: torch.from_numpy(
        torch_twin.architecture_constant(name, config)))
    flax_operand = flax_twin.walsh_operand(config, jnp.float32)
    assert isinstance(torch_operand, tuple) == isinstance(flax_operand, tuple) == (not deploy_numerics)
    _close(torch_twin.walsh_transform(torch.from_numpy(z), torch_operand),
           flax_twin.walsh_transform(jnp.asarray(z), flax_operand), tol=1e-5)


@OPS
@given(seed=st.integers(0, 2**16), past=st.integers(0, 6), length=st.integers(1, 5), window=st.integers(0, 4))
def test_attention_mask_follows_the_one_rule(seed, past, length, window):
    keys = past + length
    visible = _rng(seed).random((2, keys)) < 0.7  # padding anywhere
    torch_mask = torch_twin.attention_allowed(torch.from_numpy(visible), past, length, 1, window=window)[:, 0]
    flax_mask = flax_twin.attention_allowed(jnp.asarray(visible), past, length, window=window)
    np.testing.assert_array_equal(_np(torch_mask), _np(flax_mask))
    rule = attention_rule(np.arange(past, keys)[:, None], np.arange(keys)[None, :], visible[:, None, :], window=window)
    np.testing.assert_array_equal(_np(flax_mask), rule)
    assert rule[:, np.arange(length), past + np.arange(length)].all()  # every query sees itself


@OPS
@given(seed=st.integers(0, 2**16), length=st.integers(1, 6), probes=st.integers(1, 4))
def test_probe_pool(seed, length, probes):
    cells = _rng(seed).standard_normal((2, length, 3, 8)).astype(np.float32)
    keep = np.ones((2, length), bool)
    keep[1, : length // 2] = False  # left padding
    weights = _rng(seed + 1).standard_normal((probes, 8)).astype(np.float32)
    _close(torch_twin.probe_pool(torch.from_numpy(cells), torch.from_numpy(keep), torch.from_numpy(weights)),
           flax_twin.probe_pool(jnp.asarray(cells), jnp.asarray(keep), jnp.asarray(weights)), tol=1e-5)


@pytest.mark.parametrize("prompt", [
    np.zeros((2, 3), np.float32),  # not integers
    np.zeros((3,), np.int64),  # not [batch, tokens]
    np.array([[1, 2, 9000]]),  # an id past the vocabulary
    np.array([[-1, 2]]),  # a negative id
])
def test_prompt_checks_refuse_alike(config, prompt):
    with pytest.raises(ValueError) as torch_error:
        torch_twin.check_prompt_ids(torch.from_numpy(prompt), config.vocab_size)
    with pytest.raises(ValueError) as flax_error:
        flax_twin.check_prompt_ids(jnp.asarray(prompt), config.vocab_size)
    # The same message but for how each framework spells a dtype.
    assert str(torch_error.value).split(" found ")[0] == str(flax_error.value).split(" found ")[0]


# --------------------------------------------------------------------------------------------------
# Layers with the same weights


@OPS
@given(seed=st.integers(0, 2**16))
def test_hadamard_mlp(config, seed):
    mlp = _perturbed(torch_twin.NeedleHadamardMLP(config), seed)
    x = _rng(seed).standard_normal((2, 4, config.hidden_size)).astype(np.float32)
    walsh = torch_twin.walsh_operand(config, lambda name: torch.from_numpy(torch_twin.architecture_constant(name, config)))
    with torch.no_grad():
        want = mlp(torch.from_numpy(x), walsh)
    got = flax_twin.FlaxNeedleHadamardMLP(config).apply(_flax_params(mlp), jnp.asarray(x))
    _close(want, got, tol=1e-4)


@OPS
@given(seed=st.integers(0, 2**16), layer=st.integers(0, 1))
def test_hyper_connection_routing(config, seed, layer):
    lanes = config.hyper_connection_lanes
    hyper = _perturbed(torch_twin.NeedleHyperConnection(config, layer), seed)
    x = _rng(seed).standard_normal((2, 3, lanes, config.hidden_size)).astype(np.float32)  # [B, T, L, D]
    pre_offsets, post_offsets = (torch.from_numpy(torch_twin.architecture_constant(name, config))[layer]
                                 for name in ("pre_offsets", "post_offsets"))
    with torch.no_grad():
        want = hyper.route(torch.from_numpy(x), (pre_offsets, post_offsets))  # read, write, mixing
    unit = flax_twin.rms_unit(jnp.asarray(x).reshape(2, 3, -1), config.rms_norm_eps)  # [B, T, L * D]
    got = flax_twin.FlaxNeedleHyperConnection(config).apply(
        _flax_params(hyper), unit, jnp.asarray(pre_offsets.numpy()), jnp.asarray(post_offsets.numpy())
    )
    for torch_part, flax_part in zip(want, got):
        _close(torch_part, flax_part, tol=1e-5)


@OPS
@given(seed=st.integers(0, 2**16), length=st.integers(1, 6), padding=st.integers(0, 3), window=st.integers(0, 3))
def test_attention_layer(config, seed, length, padding, window):
    attention = _perturbed(torch_twin.NeedleAttention(config, layer_idx=None), seed)
    x = _rng(seed).standard_normal((1, length, config.hidden_size)).astype(np.float32)
    visible = np.arange(length)[None] >= min(padding, length - 1)  # left padding, one real token at least
    positions = np.clip(np.cumsum(visible, -1) - 1, 0, None)
    inverse = rope_inverse_frequencies(config.head_dim, config.rope_theta)

    cos, sin = torch_twin.rope_tables(torch.from_numpy(positions), torch.from_numpy(inverse))  # [B, T, H]
    allowed = torch_twin.attention_allowed(torch.from_numpy(visible), 0, length, 1, window=window)  # [B, 1, T, S]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    step = torch_twin.NeedleStepInputs(
        key_visible=torch.from_numpy(visible), attention_mask=additive, cos=cos[:, None], sin=sin[:, None],
        cache_position=torch.arange(length), walsh=None, pre_offsets=None, post_offsets=None,
        attention_implementation="eager",
    )
    with torch.no_grad():
        want, want_probabilities = attention(torch.from_numpy(x), step)

    flax_cos, flax_sin = flax_twin.rope_tables(jnp.asarray(positions), inverse)
    key_mask = flax_twin.attention_allowed(jnp.asarray(visible), 0, length, window=window)
    got, _, got_probabilities = flax_twin.FlaxNeedleAttention(config).apply(
        _flax_params(attention), jnp.asarray(x), flax_cos, flax_sin, key_mask, output_attentions=True
    )
    _close(want, got, tol=1e-4)
    _close(want_probabilities, got_probabilities, tol=1e-5)


@OPS
@given(seed=st.integers(0, 2**16), length=st.integers(1, 5))
def test_probe_pooling_heads(config, seed, length):
    depth = config.num_hidden_layers + 1
    cells = _rng(seed).standard_normal((2, length, depth, config.hidden_size)).astype(np.float32)
    keep = np.ones((2, length), bool)
    keep[0, 0] = length == 1  # a padded position where there is another to read

    contrastive = _perturbed(torch_twin.NeedleContrastiveHead(config), seed)
    confidence = _perturbed(torch_twin.NeedleConfidenceHead(config), seed + 1)
    with torch.no_grad():
        want_embedding = contrastive(torch.from_numpy(cells), torch.from_numpy(keep), torch.float32)
        want_logit = confidence(torch.from_numpy(cells), torch.from_numpy(keep), torch.float32)
    got_embedding, got_temperature = flax_twin.FlaxNeedleContrastiveHead(config).apply(
        _flax_params(contrastive), jnp.asarray(cells), jnp.asarray(keep))
    got_logit = flax_twin.FlaxNeedleConfidenceHead(config).apply(
        _flax_params(confidence), jnp.asarray(cells), jnp.asarray(keep))
    _close(want_embedding, got_embedding, tol=1e-5)
    _close(contrastive.log_temperature, got_temperature)
    _close(want_logit, got_logit, tol=1e-4)


def test_embedding_is_scaled_in_float32_in_both(config):
    embedding = (_rng(4).standard_normal((config.vocab_size, config.hidden_size)) * 0.3).astype(np.float32)
    ids = _rng(5).integers(0, config.vocab_size, (2, 6))
    backbone = torch_twin.NeedleModel(config)
    with torch.no_grad():
        backbone.embed_tokens.weight.copy_(torch.from_numpy(embedding))
    backbone = backbone.to(torch.bfloat16)  # the scale is applied after the cast to float32, in both
    want = backbone.embed(torch.from_numpy(ids))
    got = flax_twin.FlaxNeedleModule(config, dtype=jnp.bfloat16).apply(
        {"params": {"embed_tokens": {"embedding": jnp.asarray(embedding, jnp.bfloat16)}}}, jnp.asarray(ids),
        method="embed",
    )
    assert want.dtype == torch.float32 and got.dtype == jnp.float32
    _close(want, got, tol=0)
