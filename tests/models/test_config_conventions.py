"""Needle's config and generate options against transformers 5.x's own names (runs on 4.57 and 5.x).

- Needle's MTP self-speculation is ``use_mtp_head``; transformers 5.14+'s own `GenerationConfig.use_mtp`
  (DeepSeek-style MTP, assisted generation through `MTPCandidateGenerator`) is never entered.
- `tie_word_embeddings` and the pad/bos/eos ids are declared by the config and always saved.
- RoPE as `rope_parameters` on 5.x, `rope_theta` on both; no field named like the ones the 5.x cache reads.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from needle_reference import TINY_NATIVE_CONFIG, make_native_params
from transformers import GenerationConfig

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.speculative import MTPGenerateOutput
from needle_hf.models.needle.weight_names import native_to_hf

MAJOR = int(transformers.__version__.split(".")[0])
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=12)
CACHE_NAMES = ("layer_types", "sliding_window", "attention_chunk_size")

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]


@pytest.fixture(scope="module")
def model():
    config = NeedleConfig.from_needle_config(dict(TINY_NATIVE_CONFIG))
    model = NeedleForCausalLM(config)
    params = make_native_params(dict(TINY_NATIVE_CONFIG), 3, with_heads=False)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(params, config).items()}, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.arange(14, 30).unsqueeze(0)


@pytest.fixture
def transformers_mtp_never_runs(monkeypatch):
    """Make transformers 5.x's own MTP candidate generator fail loudly if anything constructs it."""
    if MAJOR < 5:
        return
    from transformers.generation import candidate_generator, utils

    class Refused:
        def __init__(self, *args, **kwargs):
            raise AssertionError("transformers' own use_mtp path was entered")

    monkeypatch.setattr(candidate_generator, "MTPCandidateGenerator", Refused, raising=False)
    monkeypatch.setattr(utils, "MTPCandidateGenerator", Refused, raising=False)


def test_use_mtp_head_drafts_with_needles_head_and_writes_the_greedy_tokens(model, prompt, transformers_mtp_never_runs):
    plain = model.generate(prompt, **GREEDY)
    drafted = model.generate(prompt, use_mtp_head=True, return_dict_in_generate=True, **GREEDY)
    assert isinstance(drafted, MTPGenerateOutput) and drafted.drafted > 0
    assert torch.equal(drafted.sequences, plain)
    # From the generation config too.
    from_config = model.generate(prompt, generation_config=GenerationConfig(use_mtp_head=True, **GREEDY),
                                 return_dict_in_generate=True)
    assert isinstance(from_config, MTPGenerateOutput) and torch.equal(from_config.sequences, plain)


def test_a_model_with_an_mtp_head_does_not_draft_unless_asked(model, prompt, transformers_mtp_never_runs):
    assert model.config.use_mtp_head  # the config's field says the head has weights, nothing more
    assert getattr(model.generation_config, "use_mtp_head", None) is None
    out = model.generate(prompt, return_dict_in_generate=True, **GREEDY)
    assert not isinstance(out, MTPGenerateOutput)


@pytest.mark.skipif(MAJOR < 5, reason="transformers 5.14+ owns `use_mtp`")
def test_transformers_own_use_mtp_is_refused_on_5x(model, prompt, transformers_mtp_never_runs):
    assert "use_mtp" in GenerationConfig().to_dict()  # 5.x's own field, the one Needle must not ride on
    with pytest.raises(ValueError, match="transformers' own multi-token prediction.*use_mtp_head=True"):
        model.generate(prompt, use_mtp=True, **GREEDY)
    with pytest.raises(ValueError, match="use_mtp_head=True"):
        model.generate(prompt, generation_config=GenerationConfig(use_mtp=True, **GREEDY))
    # use_mtp=False is transformers' default and changes nothing.
    assert torch.equal(model.generate(prompt, use_mtp=False, **GREEDY), model.generate(prompt, **GREEDY))


@pytest.mark.skipif(MAJOR >= 5, reason="the alias exists on transformers 4.x only")
def test_use_mtp_is_a_deprecated_alias_on_4x(model, prompt):
    with pytest.warns(FutureWarning, match="use_mtp is deprecated.*use_mtp_head"):
        aliased = model.generate(prompt, use_mtp=True, return_dict_in_generate=True, **GREEDY)
    assert isinstance(aliased, MTPGenerateOutput)
    assert torch.equal(aliased.sequences, model.generate(prompt, use_mtp_head=True, **GREEDY))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model.generate(prompt, use_mtp_head=True, **GREEDY)  # the new name warns nothing


def test_config_json_declares_the_token_ids_and_tied_embeddings(tmp_path):
    config = NeedleConfig.from_needle_config(dict(TINY_NATIVE_CONFIG))
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id, config.tie_word_embeddings) == (0, 2, 1, True)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {key: saved[key] for key in ("pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings")} == {
        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True}
    with pytest.raises(ValueError, match="tie_word_embeddings must be True"):
        NeedleConfig(tie_word_embeddings=False)


def test_rope_parameters_on_5x_and_rope_theta_on_both(tmp_path):
    config = NeedleConfig.from_needle_config(dict(TINY_NATIVE_CONFIG, rope_theta=5000.0))
    assert config.rope_theta == 5000.0
    if MAJOR >= 5:
        assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 5000.0  # what 4.57 reads
    assert ("rope_parameters" in saved) == (MAJOR >= 5)
    assert NeedleConfig.from_pretrained(tmp_path).rope_theta == 5000.0
    # A 5.x-style config (rope_parameters only) loads on either version.
    only_parameters = {key: value for key, value in saved.items() if key != "rope_theta"}
    only_parameters["rope_parameters"] = {"rope_type": "default", "rope_theta": 2500.0}
    assert NeedleConfig.from_dict(only_parameters).rope_theta == 2500.0


@pytest.mark.parametrize("fields, problem", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "plain RoPE"),
    ({"rope_theta": 1000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 2000.0}}, "disagree"),
    ({"rope_parameters": [10000.0]}, "must be a dict"),
])
def test_rope_settings_needle_does_not_have_are_refused(fields, problem):
    with pytest.raises(ValueError, match=problem):
        NeedleConfig(**fields)


def test_no_field_carries_a_name_the_5x_cache_reads(model):
    config = model.config
    assert [name for name in CACHE_NAMES if getattr(config, name, None) is not None] == []
    config_window = NeedleConfig(hidden_size=64, num_hidden_layers=2, engram_layers=(0,), attention_window=8)
    assert [name for name in CACHE_NAMES if getattr(config_window, name, None) is not None] == []
    if MAJOR >= 5:
        from transformers import DynamicCache

        # A transformers cache built from the config is a plain full-attention one, a layer per decoder layer.
        cache = DynamicCache(config=config_window)
        assert {type(layer).__name__ for layer in cache.layers} == {"DynamicLayer"}
