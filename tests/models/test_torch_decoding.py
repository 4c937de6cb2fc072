"""PyTorch Needle decoding through transformers' caches and attention functions.

The engram state travels in the KV cache (`NeedleEngramCacheLayer`), so a `DynamicCache` or a
`StaticCache` is the whole decoding state: cropped, reordered or compiled, it gives the logits of
the full forward. Every attention implementation gives the same logits.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from needle_reference import TINY_NATIVE_CONFIG, make_native_params
from transformers import DynamicCache, StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleEngramCacheLayer, NeedleForCausalLM
from needle_hf.models.needle.weight_names import native_to_hf

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread

CACHE_ARGUMENT = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
TOLERANCE = 1e-5  # float32, the same model on two paths
NO_EOS = dict(eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def params() -> dict:
    return make_native_params(TINY_NATIVE_CONFIG, seed=5)


def make_model(params: dict, attn_implementation: str = "sdpa") -> NeedleForCausalLM:
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, use_contrastive_head=True, use_confidence_head=True)
    model = NeedleForCausalLM._from_config(config, attn_implementation=attn_implementation)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(params, config).items()}, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def model(params) -> NeedleForCausalLM:
    return make_model(params)


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(1, TINY_NATIVE_CONFIG["vocab_size"], (batch, length)))


def left_padded(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i left-padded by i tokens (pad id 0) and its attention mask."""
    ids = tokens(batch, length, seed)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : row % length] = 0
    return ids * mask, mask


def feed(model, ids, mask, chunks, cache):
    """Logits of ``ids`` fed in chunks through ``cache``; nothing but the cache passes between steps."""
    pieces, start = [], 0
    for size in chunks:
        out = model(ids[:, start : start + size], attention_mask=mask[:, : start + size], **{CACHE_ARGUMENT: cache})
        cache = getattr(out, CACHE_ARGUMENT)
        pieces.append(out.logits)
        start += size
    return torch.cat(pieces, dim=1), cache


def real_difference(a, b, mask) -> float:
    real = mask.bool()
    return (a[real] - b[real]).abs().max().item()


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_a_cache_alone_carries_the_decoding_state(model, cache_kind):
    ids, mask = left_padded(2, 26, seed=1)
    cache = DynamicCache() if cache_kind == "dynamic" else StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        stepwise, cache = feed(model, ids, mask, [5, 3] + [1] * 18, cache)
    assert real_difference(stepwise, full, mask) <= TOLERANCE
    engram_layer = cache.layers[model.config.engram_layers[0]]
    assert isinstance(engram_layer, NeedleEngramCacheLayer)
    assert torch.equal(engram_layer.engram_ids[:, :26], ids)


def test_cropping_the_cache_rolls_the_engram_state_back(model):
    ids = tokens(1, 24, seed=2)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        _, cache = feed(model, ids[:, :20], mask[:, :20], [20], DynamicCache())
        cache.crop(-6)  # drop the last 6 tokens (a rejected speculation, say)
        out = model(ids[:, 14:], attention_mask=mask, **{CACHE_ARGUMENT: cache})
    assert (out.logits - full[:, 14:]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("batch", [1, 8])
def test_static_cache_generate_gives_the_dynamic_cache_tokens(model, batch):
    ids, mask = left_padded(batch, 7, seed=3)
    options = dict(max_new_tokens=12, do_sample=False, **NO_EOS)
    with torch.no_grad():
        dynamic = model.generate(ids, attention_mask=mask, **options)
        static = model.generate(ids, attention_mask=mask, cache_implementation="static", **options)
    assert static.shape == (batch, 19)
    assert torch.equal(static, dynamic)


def test_beam_search_reorders_the_engram_state(model):
    prompt = tokens(2, 5, seed=4)
    options = dict(max_new_tokens=14, num_beams=3, do_sample=False, **NO_EOS)
    with torch.no_grad():
        cached = model.generate(prompt, **options)
        uncached = model.generate(prompt, use_cache=False, **options)
    assert torch.equal(cached, uncached)


def test_generating_past_max_position_embeddings_is_refused(model):
    limit = model.config.max_position_embeddings
    with torch.no_grad(), pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(tokens(1, limit - 2, seed=6), max_new_tokens=5, do_sample=False, **NO_EOS)


def test_eager_sdpa_and_flex_attention_give_the_same_logits(params, model):
    ids, mask = left_padded(3, 20, seed=7)
    implementations = {"sdpa": model, "eager": make_model(params, "eager"), "flex_attention": make_model(params, "flex_attention")}
    logits, cached = {}, {}
    with torch.no_grad():
        for name, each in implementations.items():
            assert each.config._attn_implementation == name
            logits[name] = each(ids, attention_mask=mask, use_cache=False).logits
            cached[name] = feed(each, ids, mask, [12] + [1] * 8, DynamicCache())[0]
    for name in ("eager", "flex_attention"):
        assert real_difference(logits[name], logits["sdpa"], mask) <= TOLERANCE, name
        assert real_difference(cached[name], logits["sdpa"], mask) <= TOLERANCE, name


def test_attention_probabilities_are_on_the_autograd_path(params):
    eager = make_model(params, "eager")
    out = eager(tokens(1, 9, seed=8), use_cache=False, output_attentions=True)
    probabilities = out.attentions[0]
    assert probabilities.shape == (1, eager.config.num_attention_heads, 9, 9)
    probabilities.retain_grad()
    out.logits.sum().backward()
    assert probabilities.grad is not None and probabilities.grad.abs().sum() > 0


def test_every_attention_module_knows_its_cache_layer(model):
    indices = [layer.self_attn.layer_idx for layer in model.model.layers]
    assert indices == list(range(model.config.num_hidden_layers))
    assert model._supports_sdpa and model._supports_flex_attn


# --------------------------------------------------------------------------------------------------
# Compilation and export


def test_sinkhorn_has_no_data_dependent_branch_and_matches_the_reference():
    """Matrices spread too far for linear space (200 nats) beside ordinary ones (8): one traced graph
    gives the reference's log-space rounds for both, as the eager function does."""
    import jax.numpy as jnp
    from needle.model.architecture import _sinkhorn

    from needle_hf.models.needle.modeling_needle import sinkhorn

    rng = np.random.default_rng(3)
    logits = np.concatenate([rng.uniform(0, 8, (3, 4, 4)), rng.uniform(0, 200, (3, 4, 4))]).astype(np.float32)
    expected = np.asarray(_sinkhorn(jnp.asarray(logits)))
    traced = torch.compile(sinkhorn, fullgraph=True, backend="aot_eager")(torch.from_numpy(logits))
    assert np.abs(traced.numpy() - expected).max() <= 1e-6
    assert np.abs(sinkhorn(torch.from_numpy(logits)).numpy() - expected).max() <= 1e-6


class StaticDecodeStep(torch.nn.Module):
    """One decoding step over a filled `StaticCache`, its tensors registered as buffers (what
    `torch.export` needs to see their in-place updates as buffer mutations)."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache
        for index, layer in enumerate(cache.layers):
            for name in ("keys", "values", "engram_ids", "cumulative_length"):
                value = getattr(layer, name, None)
                if isinstance(value, torch.Tensor):
                    self.register_buffer(f"layer{index}_{name}", value, persistent=False)

    def forward(self, input_ids, attention_mask, cache_position):
        for name, value in self.named_buffers():
            index, attribute = name[len("layer") :].split("_", 1)
            setattr(self.cache.layers[int(index)], attribute, value)
        out = self.model(input_ids, attention_mask=attention_mask, cache_position=cache_position, **{CACHE_ARGUMENT: self.cache})
        return out.logits


def filled_static_cache(model, ids, mask, prompt_length: int, max_cache_len: int):
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    model(ids[:, :prompt_length], attention_mask=mask[:, :prompt_length], cache_position=torch.arange(prompt_length), **{CACHE_ARGUMENT: cache})
    return cache


def test_static_decode_step_compiles_as_one_graph(model):
    ids, mask = left_padded(2, 16, seed=9)
    static_mask = torch.nn.functional.pad(mask, (0, 8))
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        cache = filled_static_cache(model, ids, mask, 10, 24)
        step = torch.compile(model, fullgraph=True, backend="aot_eager")
        for position in range(10, 16):
            visible = static_mask.clone()
            visible[:, position + 1 :] = 0
            out = step(ids[:, position : position + 1], attention_mask=visible, cache_position=torch.tensor([position]), **{CACHE_ARGUMENT: cache})
            assert (out.logits[:, 0] - full[:, position]).abs().max().item() <= TOLERANCE
    assert model._can_compile_fullgraph


def test_compiled_static_generate_compiles_one_program_per_layer_variant():
    """`generate(cache_implementation="static", compile_config=...)` on the CPU: the decoding steps run
    each decoder layer as a program traced by `torch.export` and compiled by inductor
    (`get_compiled_call`), one program for every layer (with an engram site or without) however deep
    the model, called with each layer's own parameters; the tokens are the eager ones, at one row
    (one-row products as inductor reductions) and at several."""
    from transformers import CompileConfig

    config = NeedleConfig.from_needle_config(dict(TINY_NATIVE_CONFIG, num_layers=6))  # engram layers 0 and 2
    torch.manual_seed(0)
    model = NeedleForCausalLM._from_config(config).eval()
    options = dict(max_new_tokens=6, do_sample=False, **NO_EOS)
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    with torch.no_grad():
        for ids, mask in (left_padded(2, 7, seed=3), (tokens(1, 5, seed=2), torch.ones(1, 5, dtype=torch.long))):
            eager = model.generate(ids, attention_mask=mask, **options)
            compiled = model.generate(ids, attention_mask=mask, cache_implementation="static",
                                      compile_config=compile_config, **options)
            assert torch.equal(compiled, eager)
    assert len(model._compiled_call.programs) == 2  # one per input shape: two rows, one row


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_steps_give_the_eager_scores_when_the_first_layer_has_no_engram_site(backend):
    """The program every layer calls is traced from the first layer; when that layer has no engram site
    its engram key and value are zeros, and they must stay two inputs (traced as one, the value would
    read the key in the layers that have a site). Every step's scores equal the eager ones to 1e-4."""
    from transformers import CompileConfig

    native = dict(TINY_NATIVE_CONFIG, engram_layers=(1, 2))
    config = NeedleConfig.from_needle_config(native, use_contrastive_head=True, use_confidence_head=True)
    model = NeedleForCausalLM._from_config(config)
    hf = native_to_hf(make_native_params(native, seed=7), config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()}, strict=True)
    model.eval()
    ids, mask = left_padded(2, 7, seed=6)
    options = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, **NO_EOS)
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, **options)
        compiled = model.generate(ids, attention_mask=mask, cache_implementation="static",
                                  compile_config=CompileConfig(fullgraph=True, dynamic=False, backend=backend),
                                  **options)
    assert model._compiled_call.programs  # the steps ran the traced program
    assert torch.equal(compiled.sequences, eager.sequences)
    for want, got in zip(eager.scores, compiled.scores):
        assert (want - got).abs().max().item() <= 1e-4


def test_compiled_steps_follow_weights_changed_in_place_and_replaced_modules(params):
    """The compiled decoding step reads each layer's parameters when it runs: after weights change in
    place (a training step, `load_state_dict`) and after a PEFT adapter replaces a projection, the next
    compiled `generate` gives the eager tokens of the model as it now is."""
    from peft import LoraConfig, get_peft_model
    from transformers import CompileConfig

    model = make_model(params)
    ids = tokens(1, 7, seed=4)
    options = dict(max_new_tokens=5, do_sample=False, cache_implementation="static",
                   compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager"), **NO_EOS)
    eager_options = {k: v for k, v in options.items() if k not in ("cache_implementation", "compile_config")}
    with torch.no_grad():
        before = model.generate(ids, **options)
        assert torch.equal(before, model.generate(ids, **eager_options))
        logits_before = model(ids).logits
        generator = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            for weight in (layer.self_attn.q_proj.weight, layer.self_attn.o_proj.weight):
                weight.copy_(torch.randn(weight.shape, generator=generator))
        after = model.generate(ids, **options)
        assert torch.equal(after, model.generate(ids, **eager_options))
        assert (model(ids).logits - logits_before).abs().max().item() > 1e-2  # the change matters
        programs = len(model._compiled_call.programs)

        adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        logits_plain = model(ids).logits
        with adapted.disable_adapter():
            assert (model(ids).logits - logits_plain).abs().max().item() > 1e-3  # the adapter matters
        assert torch.equal(model.generate(ids, **options), model.generate(ids, **eager_options))
    assert len(model._compiled_call.programs) == programs + 1  # the adapted layers' own parameter table


class Prefill(torch.nn.Module):
    """The prefill forward as a module to export: (ids, mask) -> logits, no cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids, attention_mask=attention_mask, use_cache=False).logits


def test_exported_prefill_and_decode_step_give_the_eager_logits(model):
    ids, mask = left_padded(2, 12, seed=10)

    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        exported = torch.export.export(Prefill(model), (ids, mask))
        assert (exported.module()(ids, mask) - full).abs().max().item() <= TOLERANCE

        cache = filled_static_cache(model, ids, mask, 11, 16)
        step_mask = torch.nn.functional.pad(mask, (0, 4))
        step_inputs = (ids[:, 11:12], step_mask, torch.tensor([11]))
        exported_step = torch.export.export(StaticDecodeStep(model, cache), step_inputs)
        logits = exported_step.module()(*step_inputs)
    assert (logits[:, 0] - full[:, 11]).abs().max().item() <= TOLERANCE


def test_the_pre_5_cache_name_warns_only_where_it_is_old(model):
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        model(tokens(1, 6, seed=11), past_key_values=DynamicCache())
    warned = any(issubclass(w.category, FutureWarning) and "pass it as `cache`" in str(w.message) for w in record)
    assert warned == (CACHE_ARGUMENT == "cache")


def test_onnx_export_runs_in_onnxruntime_with_the_exact_engram_hash():
    """`torch.onnx.export(dynamo=True)` of the prefill (one layer, to keep the export short) runs in
    onnxruntime within 1e-4 of eager; the 32-bit n-gram hash, exported alone, gives exactly the
    numpy statement's rows."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from needle_hf.models.needle.modeling_needle import engram_hash_indices
    from needle_hf.models.needle.numerics import engram_indices_numpy

    config = NeedleConfig(
        vocab_size=8192, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        max_position_embeddings=64, engram_layers=(0,), engram_slots=8191, use_mtp_head=False,
    )
    torch.manual_seed(0)
    model = NeedleForCausalLM(config).eval()

    class Hash(torch.nn.Module):
        def forward(self, input_ids):
            return engram_hash_indices(input_ids, config.engram_orders, config.engram_num_heads, config.engram_slots)

    ids = torch.from_numpy(np.random.default_rng(12).integers(1, 8192, (2, 14)))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, use_cache=False).logits
        programs = {
            "prefill": torch.onnx.export(Prefill(model), (ids, mask), dynamo=True, verbose=False),
            "hash": torch.onnx.export(Hash(), (ids,), dynamo=True, verbose=False),
        }
    results = {}
    for name, program in programs.items():
        session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
        feeds = [ids.numpy(), mask.numpy()][: len(session.get_inputs())]
        results[name] = session.run(None, {i.name: x for i, x in zip(session.get_inputs(), feeds)})[0]
    real = mask.bool().numpy()
    assert np.abs(results["prefill"] - eager.numpy())[real].max() <= 1e-4
    expected = engram_indices_numpy(ids.numpy(), config.engram_orders, config.engram_num_heads, config.engram_slots)
    np.testing.assert_array_equal(results["hash"], expected)
