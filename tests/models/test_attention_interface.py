"""The attention kernel is chosen through transformers' attention-function interface.

`set_attn_implementation` switches the kernel of a loaded model (transformers allows it only for a
model file that uses the interface the way `models/llama` does), every kernel gives the same logits,
and vLLM's generic Transformers backend is told it cannot serve Needle.
"""

from __future__ import annotations

import pytest
import torch
from needle_reference import TINY_NATIVE_CONFIG, make_native_params
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM, NeedleModel, NeedlePreTrainedModel
from needle_hf.models.needle.weight_names import native_to_hf

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread

TOLERANCE = 1e-5  # float32, the same weights through two kernels


@pytest.fixture(scope="module")
def model() -> NeedleForCausalLM:
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, use_contrastive_head=True, use_confidence_head=True)
    model = NeedleForCausalLM._from_config(config, attn_implementation="eager")
    params = make_native_params(TINY_NATIVE_CONFIG, seed=11)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(params, config).items()}, strict=True)
    return model.eval()


def _inputs() -> dict:
    ids = torch.randint(1, TINY_NATIVE_CONFIG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the mask reaches the kernel
    return {"input_ids": ids, "attention_mask": mask}


def _counting(kernel, calls: list):
    def counted(*args, **kwargs):
        calls.append(kernel)
        return kernel(*args, **kwargs)

    return counted


@pytest.mark.parametrize("cls", [NeedleForCausalLM, NeedleModel])
def test_transformers_lets_the_kernel_be_switched(cls):
    assert cls._can_set_attn_implementation()


def test_set_attn_implementation_switches_the_kernel_and_keeps_the_logits(model, monkeypatch):
    calls: list = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", _counting(sdpa, calls))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager"
        eager_logits = model(**_inputs(), use_cache=False).logits
        assert calls == []  # eager ran Needle's own kernel

        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
        sdpa_logits = model(**_inputs(), use_cache=False).logits
        assert len(calls) == model.config.num_hidden_layers  # one sdpa call per decoder layer

        calls.clear()
        model.set_attn_implementation("eager")
        model(**_inputs(), use_cache=False)
        assert calls == []  # and back
    torch.testing.assert_close(sdpa_logits, eager_logits, atol=TOLERANCE, rtol=TOLERANCE)


def test_eager_returns_the_attention_probabilities_sdpa_does_not(model):
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(**_inputs(), use_cache=False, output_attentions=True).attentions
        assert all(layer is not None for layer in eager)
        assert torch.allclose(eager[0].sum(-1), torch.ones(()), atol=1e-5)  # softmax rows


def test_vllm_generic_backend_is_not_offered():
    # vLLM's generic Transformers backend runs a model that declares this with vLLM's attention and KV
    # cache and nothing else of its forward: Needle's engram memory, lanes and masks would be lost.
    # Needle is served by its own vLLM model (needle_hf.serving.vllm).
    assert NeedlePreTrainedModel._supports_attention_backend is False
    assert NeedleForCausalLM._supports_attention_backend is False


def test_a_whole_prompt_runs_as_blocks_of_query_rows_with_the_same_logits(model, monkeypatch):
    """A prompt longer than CAUSAL_QUERY_ROWS, unpadded: sdpa on the CPU runs its rows in blocks over
    the keys up to each block's end (`plain_causal`), and gives eager's logits; with left padding the
    mask is not plain causal and sdpa runs over it whole."""
    from needle_hf.models.needle import ops_needle

    length = ops_needle.CAUSAL_QUERY_ROWS + 37
    ids = torch.randint(1, TINY_NATIVE_CONFIG["vocab_size"], (2, length), generator=torch.Generator().manual_seed(5))
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    query_rows: list = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        query_rows.append(query.shape[2])
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(ops_needle.F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        for mask, plain in ((None, True), (torch.ones_like(ids), True), (padded, False)):
            inputs = {"input_ids": ids, "attention_mask": mask}
            step = model.model.call_step_inputs(ids, mask, None, None)
            assert step.plain_causal is plain
            model.set_attn_implementation("eager")
            eager = model(**inputs, use_cache=False).logits
            model.set_attn_implementation("sdpa")
            query_rows.clear()
            blocks = model(**inputs, use_cache=False).logits
            layers = model.config.num_hidden_layers
            assert query_rows == ([ops_needle.CAUSAL_QUERY_ROWS, 37] * layers if plain else [length] * layers)
            torch.testing.assert_close(blocks, eager, atol=TOLERANCE, rtol=TOLERANCE)
        model.set_attn_implementation("eager")


def test_a_decoding_step_is_not_plain_causal(model):
    ids = torch.randint(1, TINY_NATIVE_CONFIG["vocab_size"], (1, 80), generator=torch.Generator().manual_seed(6))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :79], cache=cache, use_cache=True)
        step = model.model.call_step_inputs(ids[:, 79:], None, None, cache)
        assert step.plain_causal is False  # one query over cached keys
        window = model.model.call_step_inputs(ids, None, None, None, attention_window=16)
        assert window.plain_causal is False  # a sliding window is not the plain causal mask
