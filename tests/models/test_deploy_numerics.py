"""Deployment numerics (`NeedleConfig(deploy_numerics=True)`): both models compute the reference's
`quant=True` forward (int8 activations, CQ KV cache) and, when training, its QAT (CQ weights with a
straight-through estimator); evaluation on a built `.cact` is predicted before shipping.

Tiny configs with every leaf perturbed (`needle_reference`); fp32 compare <= 1e-4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax_support import write_hf_folder
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config

from needle_hf import deploy_numerics, deploy_numerics_flax
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.numerics import (
    CQ_KV_GROUP,
    CQ_WEIGHT_GROUP,
    DEFAULT_WEIGHT_BITS,
    TERNARY_BITS,
    is_cq_weight,
)
from needle_hf.models.needle.weight_names import cq_weight_bits, native_to_hf, weight_specs

TOLERANCE = 1e-4
SEQUENCE_LENGTH = 20
# (act_bits, kv_bits): the default engine numerics, a 4-bit KV cache, and narrower widths still.
WIDTHS = [(8, 8), (8, 4), (6, 2)]
WIDTH_IDS = ["a8-kv8", "a8-kv4", "a6-kv2"]


pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # conftest: torch on one thread


PARAMS_SEED = 7


def make_tokens() -> np.ndarray:
    return np.random.default_rng(3).integers(1, TINY_NATIVE_CONFIG["vocab_size"], (2, SEQUENCE_LENGTH)).astype(np.int32)


@pytest.fixture(scope="module")
def native_params() -> dict:
    return make_native_params(TINY_NATIVE_CONFIG, seed=PARAMS_SEED)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return make_tokens()


# A mixed-precision map touching every kind of CQ weight, ternary included (names as the reference's
# bits maps spell them: native/export names, so `attn.out_proj` is HF's `o_proj`).
MIXED_BITS_MAP = "attn.q_proj=2,attn.out_proj=1.58,engram=3,engram1.tables=1.58,mhc_phi_res=2,mtp=2,contrastive_head=2,default=4"


def reference_qat_weights(params: dict, weight_bits: str) -> dict:
    """`finetune_local`'s QAT weights: `cq_ste_mixed_params` for the config's map, else `cq_ste_params` W4."""
    from needle.model import quantize as reference_quantize

    if weight_bits:
        return reference_quantize.cq_ste_mixed_params(params, *reference_quantize.parse_bits_map(weight_bits))
    return reference_quantize.cq_ste_params(params, 4)


@functools.lru_cache(maxsize=None)
def _reference_outputs(act_bits: int, kv_bits: int, weight_bits: str = "") -> dict:
    """The reference's `quant=True` (logits, mtp_logits) for the module's parameters and tokens:
    "eval" on the weights as they are, "qat" on its QAT weights (`reference_qat_weights`, as
    `finetune_local` trains). One compile per width (the reference reads them from globals)."""
    from needle.model import quantize as reference_quantize
    from needle.model.architecture import SimpleAttentionNetwork

    params, tokens = make_native_params(TINY_NATIVE_CONFIG, seed=PARAMS_SEED), make_tokens()
    model = SimpleAttentionNetwork(reference_config(TINY_NATIVE_CONFIG))
    reference_quantize.configure_deploy(act_bits=act_bits, kv_bits=kv_bits)
    try:
        apply = jax.jit(lambda p, t: model.apply({"params": p}, t, quant=True, return_mtp=True))
        outputs = {}
        for name, weights in (("eval", params), ("qat", reference_qat_weights(params, weight_bits))):
            logits, mtp = apply(weights, jnp.asarray(tokens))
            outputs[name] = (np.asarray(logits), np.asarray(mtp))
        return outputs
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
    assert max_difference(flax_value, expected) <= 1e-7
    # A group's norm is stored as float16: torch sums the squares in another order than XLA, and a
    # norm one float32 ulp from a float16 rounding boundary may round the other way. Such a group then
    # differs by one float16 step of its norm (relative 2**-11); every other value is equal.
    differs = np.abs(torch_value - expected) > 1e-7
    np.testing.assert_allclose(torch_value, expected, rtol=2.0**-10, atol=1e-7)
    assert differs.sum() <= group, f"{differs.sum()} values differ: more than one group"


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
def test_both_models_compute_the_reference_quant_forward_and_its_qat(native_params, hf_folder, tokens, act_bits, kv_bits):
    """Eval mode = the reference's `quant=True` forward; training mode = the same on its QAT weights
    (`finetune_local`'s `cq_ste_params` W4 + `quant=True`). Logits and MTP logits, both frameworks."""
    expected = _reference_outputs(act_bits, kv_bits)
    config = deploy_config(act_bits=act_bits, kv_bits=kv_bits)
    model = torch_model(config, native_params)
    ids = torch.from_numpy(tokens).long()
    with torch.no_grad():
        found = {"eval": model.eval()(ids, return_mtp_logits=True), "qat": model.train()(ids, return_mtp_logits=True)}
    assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)  # the substitution is undone

    # A quantised forward is discontinuous: QAT weights one float32 rounding apart (matmuls summed
    # in another order; ours equal the reference's to 1e-6) can move a 6-bit activation or a 2-bit
    # KV level. So QAT is compared at the engine's 8-bit activations, eval everywhere.
    compared = ("eval", "qat") if act_bits == 8 else ("eval",)
    flax = flax_model(config, hf_folder)
    flax_found = jax.jit(
        lambda p, t: {mode: flax(t, params=p, train=mode == "qat", output_mtp_logits=True) for mode in compared}
    )(flax.params, jnp.asarray(tokens))
    for mode in compared:
        logits, mtp_logits = expected[mode]
        for framework, out in (("torch", found[mode]), ("flax", flax_found[mode])):
            assert max_difference(out.logits, logits) <= TOLERANCE, (framework, mode)
            assert max_difference(out.mtp_logits, mtp_logits) <= TOLERANCE, (framework, mode)

    # The switch matters: the full-precision forward is far from the quantised one.
    model.config.deploy_numerics = False
    with torch.no_grad():
        plain = model.eval()(ids).logits
    assert max_difference(plain, expected["eval"][0]) > 100 * TOLERANCE


def test_cq_weight_widths_follow_the_reference_bits_map(native_params):
    """`cq_weight_bits` gives each HF weight the width the reference's QAT gives its native leaf."""
    from needle.model.quantize import _bits_for, parse_bits_map, quant_leaf_names

    config = deploy_config(act_bits=8, kv_bits=8, weight_bits=MIXED_BITS_MAP)
    reference = {name: _bits_for(name, *parse_bits_map(MIXED_BITS_MAP)) for name, _ in quant_leaf_names(native_params)}
    widths = cq_weight_bits(config)
    ours = {"/".join(spec.native_path): widths[spec.hf_name] for spec in weight_specs(config) if spec.hf_name in widths}
    assert ours == reference
    assert set(ours.values()) == {2, 3, 4, TERNARY_BITS}
    assert set(cq_weight_bits(deploy_config(act_bits=8, kv_bits=8)).values()) == {DEFAULT_WEIGHT_BITS}
    with pytest.raises(ValueError, match="weight_bits: bits map 'attn.q_proj=2' has no default"):
        deploy_config(act_bits=8, kv_bits=8, weight_bits="attn.q_proj=2")  # refused by the config itself


def test_qat_under_a_mixed_bits_map_equals_the_reference(native_params, hf_folder, tokens):
    """Training mode with `weight_bits` = a mixed map (2, 3, 4 bits and ternary) = the reference's
    `cq_ste_mixed_params` + `quant=True` forward, logits and MTP logits, both frameworks.

    At the engine's default 8-bit activations and unquantised KV cache: with a 4-bit cache this map
    puts one key of the reference's a float32 rounding from a level boundary (our weights equal its
    QAT weights to 1e-6; the discontinuity is the one explained above)."""
    logits, mtp_logits = _reference_outputs(8, 8, MIXED_BITS_MAP)["qat"]
    config = deploy_config(act_bits=8, kv_bits=8, weight_bits=MIXED_BITS_MAP)
    with torch.no_grad():
        found = torch_model(config, native_params).train()(torch.from_numpy(tokens).long(), return_mtp_logits=True)
    flax = flax_model(config, hf_folder)
    flax_found = jax.jit(lambda p, t: flax(t, params=p, train=True, output_mtp_logits=True))(flax.params, jnp.asarray(tokens))
    for framework, out in (("torch", found), ("flax", flax_found)):
        assert max_difference(out.logits, logits) <= TOLERANCE, framework
        assert max_difference(out.mtp_logits, mtp_logits) <= TOLERANCE, framework
    # The map matters: the uniform 4-bit QAT forward is far from it.
    assert max_difference(_reference_outputs(8, 8)["qat"][0], logits) > 100 * TOLERANCE


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
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)  # the cache carries the engram state
            cache = out.past_key_values
            steps.append(out.logits)
    assert max_difference(torch.cat(steps, dim=1), full) <= TOLERANCE


def test_config_switch_round_trips_and_is_checked(tmp_path):
    config = deploy_config(act_bits=8, kv_bits=4)
    config.save_pretrained(tmp_path)
    assert NeedleConfig.from_pretrained(tmp_path).deploy_numerics is True
    assert NeedleConfig().deploy_numerics is False
    with pytest.raises(ValueError, match=r"act_bits must be in \[2, 25\]"):
        deploy_config(act_bits=1, kv_bits=8)


# --------------------------------------------------------------------------------------------------
# QAT through PEFT, and predicting the shipped `.cact`

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "gate_proj", "o_proj"]


@pytest.mark.parametrize("weight_bits", ["", MIXED_BITS_MAP], ids=["w4", "mixed-map"])
def test_peft_lora_qat_step_quantises_the_merged_weights_and_trains_the_adapter(native_params, tokens, weight_bits):
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = torch_model(deploy_config(act_bits=8, kv_bits=4, weight_bits=weight_bits), native_params)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS))
    with torch.no_grad():  # a trained-looking adapter, so the merged weights differ from the base
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    peft_model.train()
    ids = torch.from_numpy(tokens).long()
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()

    # The forward is the QAT forward of the merged model: CQ(W + scale * B A), not CQ(W) + scale * B A.
    merged = copy.deepcopy(peft_model).merge_and_unload().train()
    for p in merged.parameters():
        p.requires_grad_(True)
        p.grad = None
    merged_loss = merged(ids, labels=ids).loss
    merged_loss.backward()
    assert abs(loss.item() - merged_loss.item()) <= 1e-5

    # Straight through the quantiser: dL/dB = scale * (dL/dW at the quantised merged W) A^T.
    layer = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    scale = layer.scaling["default"]
    weight_grad = merged.model.layers[1].self_attn.q_proj.weight.grad
    expected_b_grad = scale * weight_grad @ layer.lora_A["default"].weight.detach().T
    assert torch.allclose(layer.lora_B["default"].weight.grad, expected_b_grad, rtol=1e-4, atol=1e-6)
    # Every backbone adapter learns (the MTP block's adapters are not in this next-token loss).
    adapter_grads = [p.grad for name, p in peft_model.named_parameters() if "lora_" in name and ".model.layers." in name]
    assert len(adapter_grads) == 2 * len(LORA_TARGETS) * TINY_NATIVE_CONFIG["num_layers"]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in adapter_grads)
    assert all(p.grad is None for name, p in peft_model.named_parameters() if "lora_" not in name)

    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    optimizer.step()
    with torch.no_grad():
        assert peft_model(input_ids=ids, labels=ids).loss.item() < loss.item()


@pytest.mark.parametrize("weight_bits", ["", MIXED_BITS_MAP], ids=["w4", "mixed-map"])
def test_evaluation_under_deploy_numerics_predicts_the_built_cact(native_params, hf_folder, tokens, tmp_path, weight_bits):
    """Eval on the `.cact`'s dequantised weights is predicted by the QAT forward on the original weights
    (same argmax everywhere, over 10x closer than full precision), for the default 4-bit build and for
    a build with the config's mixed map (`--bits-map` = `weight_bits`). What remains is the quantised
    forward's discontinuity: the blob's CQ weights equal ours to float32 rounding except where a value
    sits on a level boundary, and moving one weight by 3e-5 moves the int8 activations downstream."""
    from conversion.build import build_cact
    from conversion.cact import read_cact

    cact_path = tmp_path / "model.cact"
    build_cact(hf_folder, cact_path, **(dict(bits_map=weight_bits) if weight_bits else dict(bits=4)), embed_tokenizer=False)
    shipped = read_cact(cact_path)
    heads = dict(use_mtp_head=False, use_contrastive_head=True, use_confidence_head=True)
    cact_config = NeedleConfig.from_needle_config(shipped.config, deploy_numerics=True, **heads)
    cact_model = NeedleForCausalLM._from_config(cact_config, attn_implementation="eager")
    cact_weights = native_to_hf(shipped.params, cact_config)
    cact_model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in cact_weights.items()}, strict=True)

    original = torch_model(deploy_config(act_bits=8, kv_bits=shipped.config["kv_bits"], weight_bits=weight_bits), native_params)
    ids = torch.from_numpy(tokens).long()
    with torch.no_grad():
        engine = cact_model.eval()(ids).logits
        predicted = original.train()(ids).logits
        original.config.deploy_numerics = False
        full_precision = original.eval()(ids).logits

    # The QAT weights are the blob's CQ tensors, at the same widths.
    widths = cq_weight_bits(original.config)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight", "model.engrams.1.tables"):
        weight = original.get_parameter(name).detach()
        substituted = deploy_numerics.cq_dequantized(weight, widths[name], CQ_WEIGHT_GROUP)
        assert max_difference(substituted, cact_weights[name]) <= 1e-6, name
    predicted_error = max_difference(engine, predicted)
    full_precision_error = max_difference(engine, full_precision)
    assert predicted_error <= 0.1 * full_precision_error
    assert torch.equal(engine.argmax(-1), predicted.argmax(-1))
