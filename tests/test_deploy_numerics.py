"""Deployment numerics (`NeedleConfig(deploy_numerics=True)`): both models compute the reference's
`quant=True` forward (int8 activations, CQ KV cache) and, when training, its QAT (CQ weights with a
straight-through estimator); evaluation on a built `.cact` is predicted before shipping.

Tiny configs with every leaf perturbed (`needle_reference`); fp32 compare <= 1e-4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax_support import write_hf_folder
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config

from needle_hf import deploy_numerics, deploy_numerics_flax
from needle_hf.configuration_needle import NeedleConfig
from needle_hf.modeling_flax_needle import FlaxNeedleForCausalLM
from needle_hf.modeling_needle import NeedleForCausalLM
from needle_hf.numerics import CQ_KV_GROUP, CQ_WEIGHT_GROUP, is_cq_weight
from needle_hf.weight_names import native_to_hf, weight_specs

TOLERANCE = 1e-4
SEQUENCE_LENGTH = 20
# (act_bits, kv_bits): the default engine numerics, a 4-bit KV cache, and narrower widths still.
WIDTHS = [(8, 8), (8, 4), (6, 2)]
WIDTH_IDS = ["a8-kv8", "a8-kv4", "a6-kv2"]


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def native_params() -> dict:
    return make_native_params(TINY_NATIVE_CONFIG, seed=7)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(3).integers(1, TINY_NATIVE_CONFIG["vocab_size"], (2, SEQUENCE_LENGTH)).astype(np.int32)


def reference_quant_logits(params: dict, tokens: np.ndarray, *, act_bits: int, kv_bits: int, qat_bits=None):
    """(logits, mtp_logits) of the reference's `quant=True` forward; with `qat_bits`, on its QAT
    weights (`cq_ste_params`, as `finetune_local` trains)."""
    from needle.model import quantize as reference_quantize
    from needle.model.architecture import SimpleAttentionNetwork

    model = SimpleAttentionNetwork(reference_config(TINY_NATIVE_CONFIG))
    reference_quantize.configure_deploy(act_bits=act_bits, kv_bits=kv_bits)
    try:
        if qat_bits is not None:
            params = reference_quantize.cq_ste_params(params, qat_bits)
        apply = jax.jit(lambda p, t: model.apply({"params": p}, t, quant=True, return_mtp=True))
        logits, mtp = apply(params, jnp.asarray(tokens))
        return np.asarray(logits), np.asarray(mtp)
    finally:
        reference_quantize.configure_deploy(act_bits=8, kv_bits=8)


def deploy_config(*, act_bits: int, kv_bits: int, **overrides) -> NeedleConfig:
    return NeedleConfig.from_needle_config(
        TINY_NATIVE_CONFIG, use_contrastive_head=True, use_confidence_head=True,
        deploy_numerics=True, act_bits=act_bits, kv_bits=kv_bits, **overrides,
    )


def torch_model(config: NeedleConfig, params: dict) -> NeedleForCausalLM:
    model = NeedleForCausalLM._from_config(config, attn_implementation="eager")
    state = {name: torch.from_numpy(np.array(value)) for name, value in native_to_hf(params, config).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, native_params):
    folder = tmp_path_factory.mktemp("deploy_numerics")
    write_hf_folder(folder, TINY_NATIVE_CONFIG, native_params)
    return folder


def flax_model(config: NeedleConfig, folder) -> FlaxNeedleForCausalLM:
    return FlaxNeedleForCausalLM.from_pretrained(folder, config=config)


def max_difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --------------------------------------------------------------------------------------------------
# The ops, against the reference's own


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_activation_fake_quant_equals_the_reference(bits):
    from needle.model import quantize as reference_quantize

    x = np.random.default_rng(bits).normal(0, 2, (3, 5, 96)).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero row keeps scale 1
    expected = np.asarray(reference_quantize.fake_quant(jnp.asarray(x), x.shape[-1], bits))
    assert np.array_equal(deploy_numerics.absmax_rows(torch.from_numpy(x), bits).numpy(), expected)
    assert np.array_equal(np.asarray(deploy_numerics_flax.absmax_rows(jnp.asarray(x), bits)), expected)


@pytest.mark.parametrize("bits,group,width", [(4, CQ_WEIGHT_GROUP, 256), (2, CQ_WEIGHT_GROUP, 200), (3, CQ_KV_GROUP, 16), (5, CQ_KV_GROUP, 64)])
def test_cq_round_trip_equals_the_reference(bits, group, width):
    from needle.model import quantize as reference_quantize

    x = np.random.default_rng(width).normal(0, 0.05, (4, 3, width)).astype(np.float32)
    expected = np.asarray(reference_quantize.cq_quantize(jnp.asarray(x), bits, group))
    torch_value = deploy_numerics.cq_dequantized(torch.from_numpy(x), bits, group).numpy()
    flax_value = np.asarray(deploy_numerics_flax.cq_dequantized(jnp.asarray(x), bits, group))
    assert max_difference(torch_value, expected) <= 1e-7
    assert max_difference(flax_value, expected) <= 1e-7


def test_fake_quant_gradients_are_straight_through():
    x = torch.randn(2, 7, 64, requires_grad=True)
    upstream = torch.randn(2, 7, 64)
    for fn in (lambda t: deploy_numerics.fake_quant_rows(t, 8), lambda t: deploy_numerics.cq_fake_quant(t, 4, 64)):
        (grad,) = torch.autograd.grad((fn(x) * upstream).sum(), x)
        assert torch.equal(grad, upstream)
    xj, uj = jnp.asarray(x.detach().numpy()), jnp.asarray(upstream.numpy())
    for fn in (lambda t: deploy_numerics_flax.fake_quant_rows(t, 8), lambda t: deploy_numerics_flax.cq_fake_quant(t, 4, 64)):
        assert np.array_equal(np.asarray(jax.grad(lambda t: jnp.sum(fn(t) * uj))(xj)), np.asarray(uj))


def test_cq_weights_are_the_tensors_the_reference_quantises(native_params):
    """`is_cq_weight` (HF names) picks exactly the leaves the reference's QAT and exporter quantise."""
    from needle.model.quantize import quant_leaf_names

    config = deploy_config(act_bits=8, kv_bits=8)
    reference = {name for name, _ in quant_leaf_names(native_params)}
    ours = {"/".join(spec.native_path) for spec in weight_specs(config) if is_cq_weight(spec.hf_name)}
    assert ours == reference


# --------------------------------------------------------------------------------------------------
# Whole models


@pytest.mark.parametrize("act_bits,kv_bits", WIDTHS, ids=WIDTH_IDS)
def test_torch_eval_equals_the_reference_quant_forward(native_params, tokens, act_bits, kv_bits):
    expected, expected_mtp = reference_quant_logits(native_params, tokens, act_bits=act_bits, kv_bits=kv_bits)
    model = torch_model(deploy_config(act_bits=act_bits, kv_bits=kv_bits), native_params)
    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), return_mtp_logits=True)
    assert max_difference(out.logits, expected) <= TOLERANCE
    assert max_difference(out.mtp_logits, expected_mtp) <= TOLERANCE
    # The switch matters: full precision is far from the quantised forward.
    plain, _ = reference_quant_logits(native_params, tokens, act_bits=16, kv_bits=8)
    assert max_difference(expected, plain) > 100 * TOLERANCE


@pytest.mark.parametrize("act_bits,kv_bits", WIDTHS, ids=WIDTH_IDS)
def test_flax_eval_equals_the_reference_quant_forward(native_params, hf_folder, tokens, act_bits, kv_bits):
    expected, expected_mtp = reference_quant_logits(native_params, tokens, act_bits=act_bits, kv_bits=kv_bits)
    model = flax_model(deploy_config(act_bits=act_bits, kv_bits=kv_bits), hf_folder)
    out = jax.jit(lambda p, t: model(t, params=p, output_mtp_logits=True))(model.params, jnp.asarray(tokens))
    assert max_difference(out.logits, expected) <= TOLERANCE
    assert max_difference(out.mtp_logits, expected_mtp) <= TOLERANCE


@pytest.mark.parametrize("act_bits,kv_bits", [(8, 8), (8, 4)], ids=["a8-kv8", "a8-kv4"])
def test_training_forward_equals_the_reference_qat_forward(native_params, hf_folder, tokens, act_bits, kv_bits):
    """Training mode runs on CQ W4 weights, as the reference's `finetune_local` (cq_ste_params + quant)."""
    expected, expected_mtp = reference_quant_logits(native_params, tokens, act_bits=act_bits, kv_bits=kv_bits, qat_bits=4)
    config = deploy_config(act_bits=act_bits, kv_bits=kv_bits)
    model = torch_model(config, native_params).train()
    out = model(torch.from_numpy(tokens).long(), return_mtp_logits=True)
    assert max_difference(out.logits.detach(), expected) <= TOLERANCE
    assert max_difference(out.mtp_logits.detach(), expected_mtp) <= TOLERANCE
    assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)  # the substitution is undone

    flax = flax_model(config, hf_folder)
    flax_out = jax.jit(lambda p, t: flax(t, params=p, train=True, output_mtp_logits=True))(flax.params, jnp.asarray(tokens))
    assert max_difference(flax_out.logits, expected) <= TOLERANCE
    assert max_difference(flax_out.mtp_logits, expected_mtp) <= TOLERANCE


def test_qat_gradients_flow_straight_through_the_weights(native_params, hf_folder, tokens):
    """d loss / d W of the QAT forward is the gradient at the quantised weights, in both frameworks."""
    config = deploy_config(act_bits=8, kv_bits=4)
    ids = torch.from_numpy(tokens).long()
    model = torch_model(config, native_params).train()
    model(ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    # The same forward on weights that already are the quantised ones, in eval mode (no substitution).
    frozen = torch_model(config, native_params)
    with torch.no_grad():
        for name, weight in frozen.named_parameters():
            if is_cq_weight(name):
                weight.copy_(deploy_numerics.cq_dequantized(weight, 4, CQ_WEIGHT_GROUP))
    frozen(ids, labels=ids).loss.backward()
    for name, p in frozen.named_parameters():
        if p.grad is None:  # the heads take no part in the loss
            assert grads[name] is None, name
            continue
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-7), name
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0

    flax = flax_model(config, hf_folder)

    def loss(params):
        logits = flax(jnp.asarray(tokens), params=params, train=True).logits[:, :-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens)[:, 1:, None], -1))

    flax_grads = jax.jit(jax.grad(loss))(flax.params)
    q_kernel = np.asarray(flax_grads["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"])
    torch_q = grads["model.layers.0.self_attn.q_proj.weight"].numpy().T
    assert max_difference(q_kernel, torch_q) <= 1e-4 * np.abs(torch_q).max()


def test_cached_decoding_equals_the_full_forward_under_deploy_numerics(native_params, tokens):
    """The KV cache holds the quantised keys and values, so decoding step by step changes nothing."""
    model = torch_model(deploy_config(act_bits=8, kv_bits=4), native_params)
    ids = torch.from_numpy(tokens).long()
    with torch.no_grad():
        full = model(ids).logits
        prefix = model(ids[:, :12], use_cache=True)
        cache, steps = prefix.past_key_values, [prefix.logits]
        for t in range(12, SEQUENCE_LENGTH):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True,
                        engram_context_ids=ids[:, max(0, t - model.engram_context_length) : t])
            cache = out.past_key_values
            steps.append(out.logits)
    assert max_difference(torch.cat(steps, dim=1), full) <= TOLERANCE


def test_config_switch_round_trips_and_is_checked(tmp_path):
    config = deploy_config(act_bits=8, kv_bits=4)
    config.save_pretrained(tmp_path)
    assert NeedleConfig.from_pretrained(tmp_path).deploy_numerics is True
    assert NeedleConfig().deploy_numerics is False
    with pytest.raises(ValueError, match="act_bits >= 2"):
        deploy_config(act_bits=1, kv_bits=8)
