"""The shortcuts a PyTorch decoding step takes against the general ops they stand for.

A single-token step spends most of its time dispatching tiny ops, so two ops have a second path for
that case: `sinkhorn` computes a few no-grad CPU matrices in float64 NumPy, and the CPU attention
runs transformers' ``sdpa`` with the key/value heads shared by their query groups instead of
repeated. Each must give the general path's numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from needle_hf.models.needle import ops_needle
from needle_hf.models.needle.numerics import SINKHORN_LINEAR_SPACE_MAX_SPREAD

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread


def _general_sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """`sinkhorn` on its tensor path (what autograd and traced graphs run)."""
    with torch.enable_grad():
        return ops_needle.sinkhorn(logits.clone().requires_grad_(), iterations).detach()


@st.composite
def _routing_logits(draw):
    """[matrices, L, L] float32 logits: unit-scale entries times a scale of up to 60 (spreads past
    `SINKHORN_LINEAR_SPACE_MAX_SPREAD` included), shifted by an offset of up to +-1000."""
    matrices = draw(st.integers(1, ops_needle.HOST_SINKHORN_MAX_MATRICES))
    lanes = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 4.0, 12.0, 20.0, 40.0, 60.0]))
    offset = draw(st.floats(-1000.0, 1000.0))
    unit = np.random.default_rng(seed).standard_normal((matrices, lanes, lanes))
    return (unit * scale + offset).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(logits=_routing_logits(), iterations=st.sampled_from([1, 3, 20]))
def test_host_sinkhorn_equals_the_tensor_path_and_log_space(logits, iterations):
    """No-grad CPU matrices (the host path) match the tensor path within 1e-6, and where the spread
    keeps them in linear space, float64 log-space Sinkhorn within 1e-6."""
    x = torch.from_numpy(logits)
    with torch.no_grad():
        fast = ops_needle.sinkhorn(x, iterations)
    assert fast.dtype == torch.float32 and fast.shape == x.shape
    np.testing.assert_allclose(fast.numpy(), _general_sinkhorn(x, iterations).numpy(), atol=1e-6, rtol=0)
    spread = np.ptp(logits.astype(np.float64), axis=(-2, -1))
    linear = spread <= SINKHORN_LINEAR_SPACE_MAX_SPREAD
    exact = ops_needle.log_space_sinkhorn(x.double(), iterations).float().numpy()
    np.testing.assert_allclose(fast.numpy()[linear], exact[linear], atol=1e-6, rtol=0)


def test_host_sinkhorn_serves_no_grad_cpu_steps_only(monkeypatch):
    """A decoding step's matrices skip the tensor loop; a graph that records gradients and a batch of
    many matrices (a prompt's) keep it, and gradients flow."""
    tensor_path = []
    linear = ops_needle._linear_space_sinkhorn
    monkeypatch.setattr(ops_needle, "_linear_space_sinkhorn",
                        lambda *args, **kwargs: tensor_path.append(1) or linear(*args, **kwargs))
    step = torch.randn(1, 1, 4, 4)
    with torch.no_grad():
        ops_needle.sinkhorn(step)
    assert tensor_path == []
    ops_needle.sinkhorn(torch.randn(1, 64, 4, 4))
    assert tensor_path == [1]
    needs_grad = step.clone().requires_grad_()
    ops_needle.sinkhorn(needs_grad).sum(-1)[..., 0].sum().backward()
    assert tensor_path == [1, 1] and needs_grad.grad is not None and torch.isfinite(needs_grad.grad).all()


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@settings(max_examples=25, deadline=None)
@given(new=st.integers(1, 9), past=st.integers(0, 40), groups=st.sampled_from([1, 2, 4]),
       hidden=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_grouped_sdpa_equals_transformers_sdpa(new, past, groups, hidden, seed):
    """Key/value heads shared by their query group give the numbers of heads repeated per query head,
    with a causal mask that also hides the first ``hidden`` keys (left padding); the grouped kernel is
    also given it wider than the keys (a static cache's), as transformers 4.57's kernel accepts it."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, head_dim, keys = 2, 16, past + new
    query = torch.randn(1, kv_heads * groups, new, head_dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, keys, head_dim, generator=generator) for _ in range(2))
    allowed = torch.ones(new, keys + 3, dtype=torch.bool).tril(past)
    allowed[:, : min(hidden, past)] = False
    mask = torch.zeros(1, 1, new, keys + 3).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    module = _Module(groups)
    want, _ = sdpa_attention_forward(module, query, key, value, mask[..., :keys], scaling=head_dim**-0.5)
    got, probabilities = ops_needle.grouped_sdpa_attention_forward(module, query, key, value, mask,
                                                                     scaling=head_dim**-0.5)
    assert probabilities is None and got.shape == (1, new, kv_heads * groups, head_dim)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)


def test_cpu_attention_takes_the_grouped_kernel_in_place_of_transformers_sdpa_only():
    query = torch.zeros(1, 2, 1, 4)
    assert ops_needle.cpu_grouped_sdpa(sdpa_attention_forward, query) is ops_needle.grouped_sdpa_attention_forward
    registered = lambda *args, **kwargs: sdpa_attention_forward(*args, **kwargs)  # noqa: E731  (a user's own "sdpa")
    assert ops_needle.cpu_grouped_sdpa(registered, query) is registered
    assert ops_needle.cpu_grouped_sdpa(ops_needle.grouped_sdpa_attention_forward, query.to("meta")) is not None
    assert ops_needle.cpu_grouped_sdpa(sdpa_attention_forward, query.to("meta")) is sdpa_attention_forward


def test_a_cached_sdpa_model_decodes_through_the_grouped_kernel_with_eager_s_logits(monkeypatch):
    """A tiny sdpa model's prefill and decoding steps run the grouped kernel (one call per layer and
    forward) and give the eager kernel's logits."""
    from needle_reference import TINY_NATIVE_CONFIG, make_native_params
    from transformers import DynamicCache

    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
    from needle_hf.models.needle.weight_names import native_to_hf

    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, use_contrastive_head=True, use_confidence_head=True)
    model = NeedleForCausalLM._from_config(config, attn_implementation="sdpa")
    params = make_native_params(TINY_NATIVE_CONFIG, seed=5)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(params, config).items()}, strict=True)
    model.eval()
    calls = []
    grouped = ops_needle.grouped_sdpa_attention_forward
    monkeypatch.setattr(ops_needle, "grouped_sdpa_attention_forward",
                        lambda *args, **kwargs: calls.append(1) or grouped(*args, **kwargs))
    ids = torch.randint(1, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0

    def decode():
        cache, steps = DynamicCache(config=config), []
        with torch.no_grad():
            steps.append(model(input_ids=ids[:, :6], attention_mask=mask[:, :6], cache=cache).logits)
            for t in (6, 7):
                steps.append(model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits)
        return steps

    grouped_steps = decode()
    assert len(calls) == 3 * config.num_hidden_layers
    model.set_attn_implementation("eager")
    for got, want in zip(grouped_steps, decode()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
