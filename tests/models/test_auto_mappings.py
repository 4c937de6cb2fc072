"""The Auto mappings hold the model classes themselves, and the Flax base model and causal LM load
each other's saved folders (what transformers' Flax model tests check with the mappings' classes)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import needle_hf
from flax_support import random_tokens, write_hf_folder
from needle_reference import TINY_NATIVE_CONFIG, make_native_params
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.weight_names import NeedleWeightsError
from transformers import (
    FLAX_MODEL_FOR_CAUSAL_LM_MAPPING,
    FLAX_MODEL_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_MAPPING,
    AutoModelForCausalLM,
    FlaxAutoModel,
    FlaxAutoModelForCausalLM,
)


def test_auto_mappings_hold_the_model_classes():
    assert MODEL_FOR_CAUSAL_LM_MAPPING[NeedleConfig] is needle_hf.NeedleForCausalLM
    assert MODEL_MAPPING[NeedleConfig] is needle_hf.NeedleModel
    assert FLAX_MODEL_FOR_CAUSAL_LM_MAPPING[NeedleConfig] is needle_hf.FlaxNeedleForCausalLM
    assert FLAX_MODEL_MAPPING[NeedleConfig] is needle_hf.FlaxNeedleModel
    # What libraries iterate over, too.
    assert needle_hf.NeedleForCausalLM in MODEL_FOR_CAUSAL_LM_MAPPING.values()
    assert (NeedleConfig, needle_hf.FlaxNeedleModel) in FLAX_MODEL_MAPPING.items()
    assert MODEL_FOR_CAUSAL_LM_MAPPING.get(NeedleConfig, None) is needle_hf.NeedleForCausalLM
    assert AutoModelForCausalLM._model_mapping[NeedleConfig] is needle_hf.NeedleForCausalLM


def _tiny_config(**overrides) -> NeedleConfig:
    return NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, **overrides)


def _flat(params) -> dict:
    return {path: np.asarray(leaf) for path, leaf in flatten_dict(params).items()}


@pytest.mark.parametrize("use_mtp_head", [False, True], ids=["no-heads", "mtp-head"])
def test_saved_base_model_loads_into_the_causal_lm_and_back(tmp_path, use_mtp_head):
    config = _tiny_config(use_mtp_head=use_mtp_head)
    base_class, head_class = FLAX_MODEL_MAPPING[NeedleConfig], FLAX_MODEL_FOR_CAUSAL_LM_MAPPING[NeedleConfig]
    base = base_class(config, seed=3)
    base.save_pretrained(tmp_path / "base")
    if use_mtp_head:
        # A base-model folder has no head tensors: strict loading names them and the option.
        with pytest.raises(NeedleWeightsError, match=r"missing tensor mtp\..*use_mtp_head=False"):
            head_class.from_pretrained(tmp_path / "base")
    head = head_class.from_pretrained(tmp_path / "base", use_mtp_head=False)
    assert head.config.use_mtp_head is False
    base_flat, from_head = _flat(base.params), _flat(head.params[head.base_model_prefix])
    assert base_flat.keys() == from_head.keys()
    assert all(np.array_equal(base_flat[k], from_head[k]) for k in base_flat)

    head.save_pretrained(tmp_path / "head")
    reread = FlaxAutoModel.from_pretrained(tmp_path / "head")
    assert type(reread) is needle_hf.FlaxNeedleModel
    back = _flat(reread.params)
    assert all(np.array_equal(base_flat[k], back[k]) for k in base_flat)


def test_unknown_from_pretrained_argument_is_refused(tmp_path):
    _tiny_config().save_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['use_mtp_haed'\]"):
        needle_hf.FlaxNeedleForCausalLM.from_pretrained(tmp_path, use_mtp_haed=False)


def test_do_init_false_returns_the_checkpoint_params(tmp_path):
    params = make_native_params(TINY_NATIVE_CONFIG, 4)
    write_hf_folder(tmp_path, TINY_NATIVE_CONFIG, params)
    loaded = FlaxAutoModelForCausalLM.from_pretrained(tmp_path)
    model, model_params = FlaxAutoModelForCausalLM.from_pretrained(tmp_path, _do_init=False)
    assert isinstance(model, needle_hf.FlaxNeedleForCausalLM)
    with pytest.raises(ValueError, match="_do_init"):
        model.params  # noqa: B018  (the parameters live outside the model)
    expected, got = _flat(loaded.params), _flat(model_params)
    assert expected.keys() == got.keys()
    assert all(np.array_equal(expected[k], got[k]) for k in expected)
    tokens = random_tokens(2, 1, 9, TINY_NATIVE_CONFIG["vocab_size"])
    np.testing.assert_array_equal(
        np.asarray(model(tokens, params=model_params).logits), np.asarray(loaded(tokens).logits)
    )
    # The shapes the model declares are the checkpoint's.
    shapes = jax.tree.map(lambda leaf: leaf.shape, model.params_shape_tree)
    assert jax.tree.map(lambda leaf: leaf.shape, model_params) == shapes
