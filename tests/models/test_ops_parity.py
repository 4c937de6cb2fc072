"""Each op of both twins against its numpy statement (`conversion/native_forward.py`).

The PyTorch and the Flax model share no array code, only the spec; these tests pin every op with
a closed form (norms, RoPE, both Sinkhorn paths, the engram hash, the Walsh transform, the padding
mask, probe pooling) to the same numpy statement, on inputs where the ops differ from their
neighbours (perturbed weights, padding at both ends, a cache offset).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conversion import native_forward as numpy_ops
from needle_hf import modeling_flax_needle as flax_ops
from needle_hf import modeling_needle as torch_ops
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.numerics import (
    SINKHORN_LINEAR_SPACE_MAX_SPREAD,
    rope_inverse_frequencies,
    walsh_factor_sizes,
    walsh_matrix,
)

F32_TOL = 2e-6
EPS = 1e-6


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _close(got, want, tol=F32_TOL):
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_norms():
    x = _rng().standard_normal((2, 5, 24)).astype(np.float32) * 3
    weight = _rng(1).standard_normal(24).astype(np.float32) * 0.3
    want_unit = numpy_ops.rms_unit(x, EPS)
    want_norm = numpy_ops.zero_centred_rms_norm(x, weight, EPS)
    _close(torch_ops.rms_unit(torch.from_numpy(x), EPS), want_unit)
    _close(flax_ops.rms_unit(jnp.asarray(x), EPS), want_unit)
    _close(torch_ops.zero_centred_rms_norm(torch.from_numpy(x), torch.from_numpy(weight), EPS), want_norm)
    _close(flax_ops.zero_centred_rms_norm(jnp.asarray(x), jnp.asarray(weight), EPS), want_norm)


def test_rotary_embedding():
    batch, length, heads, head_dim, theta = 2, 7, 3, 16, 10_000.0
    x = _rng(2).standard_normal((batch, length, heads, head_dim)).astype(np.float32)
    positions = np.stack([np.arange(length), np.arange(length) + 40])  # [B, T], the second row cached
    angles = numpy_ops.rope_angles(positions, head_dim, theta)  # [B, T, H/2]
    want = np.stack([numpy_ops.apply_rotary(x[i : i + 1], np.cos(angles[i]), np.sin(angles[i]))[0] for i in range(batch)])

    cos, sin = flax_ops.rope_tables(jnp.asarray(positions), rope_inverse_frequencies(head_dim, theta))
    _close(cos, np.cos(angles))
    _close(flax_ops.apply_rotary(jnp.asarray(x), cos, sin), want)

    # torch: x [B, heads, S, H], tables [B, 1, S, H] with both halves the same.
    full = lambda table: torch.from_numpy(np.concatenate([table, table], -1)[:, None])  # noqa: E731
    got = torch_ops.apply_rotary(torch.from_numpy(x).transpose(1, 2), full(np.cos(angles)), full(np.sin(angles)))
    _close(got.transpose(1, 2), want, tol=1e-5)


@pytest.mark.parametrize("spread", [8.0, 200.0], ids=["linear-space", "log-space"])
def test_sinkhorn_both_paths(spread):
    """Spread 8 takes the linear-space form, 200 (past SINKHORN_LINEAR_SPACE_MAX_SPREAD) the log-space one."""
    logits = _rng(3).uniform(0.0, spread, size=(2, 5, 4, 4)).astype(np.float32)
    assert (np.ptp(logits, axis=(-2, -1)).max() > SINKHORN_LINEAR_SPACE_MAX_SPREAD) == (spread > 30)
    want = numpy_ops.sinkhorn(logits.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(want.sum(-2), 1.0, atol=1e-5)  # each round ends normalising the columns
    for got in (
        torch_ops.sinkhorn(torch.from_numpy(logits)),
        torch_ops.log_space_sinkhorn(torch.from_numpy(logits)),
        jax.jit(flax_ops.sinkhorn)(jnp.asarray(logits)),
        jax.jit(flax_ops.log_space_sinkhorn)(jnp.asarray(logits)),
    ):
        _close(got, want, tol=1e-6)


def test_engram_hash():
    tokens = _rng(4).integers(0, 8192, (3, 30))
    want = numpy_ops.engram_hash_indices(tokens, (2, 3), 2, 97)
    assert len(np.unique(want)) > 50  # the hash spreads
    np.testing.assert_array_equal(torch_ops.engram_hash_indices(torch.from_numpy(tokens), (2, 3), 2, 97).numpy(), want)
    np.testing.assert_array_equal(np.asarray(flax_ops.engram_hash_indices(jnp.asarray(tokens), (2, 3), 2, 97)), want)


def _torch_walsh_factors(width: int) -> tuple:
    return tuple(torch.from_numpy(walsh_matrix(m)) for m in walsh_factor_sizes(width))


@pytest.mark.parametrize("width", [16, 32, 512])
def test_walsh_transform(width):
    # The Sylvester matrix in closed form: W[i, j] = (-1)^popcount(i & j) / sqrt(n).
    i, j = np.meshgrid(np.arange(width), np.arange(width), indexing="ij")
    parity = np.vectorize(lambda v: bin(v).count("1") % 2)(i & j)
    np.testing.assert_array_equal(walsh_matrix(width), ((-1.0) ** parity / np.sqrt(width)).astype(np.float32))
    z = _rng(5).standard_normal((2, 3, width)).astype(np.float32)
    want = numpy_ops.walsh_transform(z)
    flax_factors = tuple(jnp.asarray(walsh_matrix(m)) for m in walsh_factor_sizes(width))
    _close(flax_ops.walsh_transform(jnp.asarray(z), flax_factors), want, tol=1e-5)
    _close(flax_ops.walsh_transform(jnp.asarray(z), jnp.asarray(walsh_matrix(width))), want, tol=1e-5)
    _close(torch_ops.walsh_transform(torch.from_numpy(z), _torch_walsh_factors(width)), want, tol=1e-5)
    _close(torch_ops.walsh_transform(torch.from_numpy(z), torch.from_numpy(walsh_matrix(width))), want, tol=1e-5)


def test_hadamard_mlp():
    config = NeedleConfig(vocab_size=32, hidden_size=24, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, engram_layers=())
    n = config.hadamard_size  # 32: the input is zero padded from 24
    diags = {name: _rng(k).standard_normal(n).astype(np.float32) for k, name in enumerate(("d1", "d2", "d3"))}
    x = _rng(6).standard_normal((2, 3, 24)).astype(np.float32)
    forward = numpy_ops._NativeForward({}, config, numpy_ops.float32_leaf)
    want = forward.hadamard_mlp(x, lambda *path: diags[path[-1]])

    flax_params = {"diag_in": diags["d1"], "diag_hidden": diags["d2"], "diag_out": diags["d3"]}
    got = flax_ops.FlaxNeedleHadamardMLP(config).apply({"params": flax_params}, jnp.asarray(x))
    _close(got, want, tol=1e-5)

    mlp = torch_ops.NeedleHadamardMLP(config)
    with torch.no_grad():
        for name, key in (("diag_in", "d1"), ("diag_hidden", "d2"), ("diag_out", "d3")):
            getattr(mlp, name).copy_(torch.from_numpy(diags[key]))
        _close(mlp(torch.from_numpy(x), torch.from_numpy(walsh_matrix(n))), want, tol=1e-5)
        _close(mlp(torch.from_numpy(x), _torch_walsh_factors(n)), want, tol=1e-5)


@pytest.mark.parametrize("past_length", [0, 3])
def test_padding_masks(past_length):
    """Causal, visible keys only, and padding rows attend to themselves (and nothing else)."""
    key_visible = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 1]], bool)  # left and inner/right padding
    query_length = key_visible.shape[1] - past_length
    want = numpy_ops.attention_allowed(key_visible, past_length, query_length)  # [B, T, S]
    keys = np.arange(key_visible.shape[1])
    for b in range(2):
        for t in range(query_length):
            position = past_length + t
            expected = ((keys <= position) & key_visible[b]) | (keys == position)
            assert want[b, t].tolist() == expected.tolist()
    if past_length == 0:
        assert want[0, 0].tolist() == (keys == 0).tolist()  # a left-padding row reads only itself
    np.testing.assert_array_equal(np.asarray(flax_ops.attention_allowed(jnp.asarray(key_visible), past_length, query_length)), want)
    group = 2
    got = torch_ops.attention_allowed(torch.from_numpy(key_visible), past_length, query_length, group).numpy()
    assert got.shape == (2, 1, group * query_length, key_visible.shape[1])
    for g in range(group):  # one copy per query head that shares a kv head
        np.testing.assert_array_equal(got[:, 0, g * query_length : (g + 1) * query_length], want)


def test_probe_pooling():
    cells = _rng(7).standard_normal((2, 5, 4, 8)).astype(np.float32)
    keep = np.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], bool)
    probes = _rng(8).standard_normal((3, 8)).astype(np.float32)
    want = numpy_ops.probe_pool(cells, keep, probes)
    assert want.shape == (2, 3 * 8)
    changed = cells.copy()
    changed[0, 3:] += 100.0  # hidden positions do not count
    np.testing.assert_allclose(numpy_ops.probe_pool(changed, keep, probes)[0], want[0], atol=1e-6)
    _close(torch_ops.probe_pool(torch.from_numpy(cells), torch.from_numpy(keep), torch.from_numpy(probes)), want, tol=1e-5)
    _close(flax_ops.probe_pool(jnp.asarray(cells), jnp.asarray(keep), jnp.asarray(probes)), want, tol=1e-5)
