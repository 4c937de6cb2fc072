"""NeedleConfig geometry and the native <-> HF weight-name table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from needle_reference import BASE_NATIVE_CONFIG, TINY_NATIVE_CONFIG, make_native_params, reference_config
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.numerics import engram_indices_numpy, hyper_connection_offsets, walsh_matrix
from needle_hf.models.needle.weight_names import (
    NeedleWeightsError,
    check_hf_weights,
    hf_to_native,
    hf_weight_shapes,
    native_to_hf,
    optional_heads_in_native,
)


def test_defaults_are_the_needle2_geometry_and_its_parameter_count():
    config = NeedleConfig()
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (512, 8, 4, 27)
    assert config.vocab_size == 8192 and config.engram_layers == [2, 15] and config.hyper_connection_lanes == 4
    # The advertised 45M: the reference's `base` preset has 44,938,997 parameters (MTP included).
    assert sum(int(np.prod(s)) for s in hf_weight_shapes(config).values()) == 44_938_997


def test_from_needle_config_resolves_missing_fields_against_native_defaults():
    config = NeedleConfig.from_needle_config({"d_model": 256, "num_layers": 4, "engram_layers": [1, 3], "flash": False, "dtype": "float32"})
    native = reference_config({"d_model": 256, "num_layers": 4, "engram_layers": (1, 3)})
    assert config.hidden_size == native.d_model == 256
    assert config.attention_dim == native.attn_dim == 256
    assert config.num_attention_heads == native.num_heads and config.num_key_value_heads == native.num_kv_heads
    assert config.rope_theta == native.rope_theta and config.max_position_embeddings == native.max_seq_len
    assert config.engram_orders == list(native.engram_orders) and config.engram_slots == native.engram_slots
    from needle.model.architecture import engram_geometry

    orders, heads, sub_dim = engram_geometry(native)
    assert (config.engram_num_heads, config.engram_sub_dim) == (heads, sub_dim)


def test_native_config_round_trip():
    config = NeedleConfig.from_needle_config(BASE_NATIVE_CONFIG)
    again = NeedleConfig.from_needle_config(config.to_needle_config())
    assert again.to_dict() == config.to_dict()
    json.dumps(config.to_needle_config())  # plain data


def test_an_empty_native_config_is_the_unusable_reference_default():
    # The reference's defaults (12 layers, engram layer 15) fail in the reference too.
    with pytest.raises(ValueError, match=r"engram_layers \[2, 15\] must lie in \[0, num_hidden_layers=12\)"):
        NeedleConfig.from_needle_config({})


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_attention_heads": 6}, "num_key_value_heads \\(4\\) must divide num_attention_heads \\(6\\)"),
        ({"num_attention_heads": 7, "num_key_value_heads": 7}, "must divide attention_dim"),
        ({"engram_layers": (2, 40)}, "engram_layers"),
        ({"engram_layers": (3, 3)}, "duplicates"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"engram_orders": ()}, "engram_orders"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ],
)
def test_invalid_geometry_raises_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        NeedleConfig(**fields)


def test_weight_table_round_trips_a_native_tree_exactly():
    params = make_native_params(TINY_NATIVE_CONFIG, 0)
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, **optional_heads_in_native(params))
    tensors = native_to_hf(params, config)
    assert set(tensors) == set(hf_weight_shapes(config))
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    np.testing.assert_array_equal(
        tensors["model.layers.2.self_attn.o_proj.weight"], params["stack"]["layers"]["block"]["self_attn"]["out_proj"]["kernel"][2].T
    )
    np.testing.assert_array_equal(tensors["model.layers.1.attention_gate"], params["stack"]["layers"]["block"]["attn_gate"][1])
    back = hf_to_native(tensors, config)

    def leaves(tree, prefix=()):
        for k, v in tree.items():
            yield from leaves(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), v)]

    original, restored = dict(leaves(params)), dict(leaves(back))
    assert original.keys() == restored.keys()
    for path, value in original.items():
        assert np.array_equal(value, restored[path]), path


def test_the_tied_head_alias_is_neither_required_nor_rejected_but_must_equal_the_embedding():
    params = make_native_params(TINY_NATIVE_CONFIG, 0)
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, **optional_heads_in_native(params))
    tensors = native_to_hf(params, config)
    embedding = tensors["model.embed_tokens.weight"]
    # A PyTorch state dict names the tied head too (`lm_head.weight`, the same values): accepted, dropped.
    with_alias = hf_to_native({**tensors, "lm_head.weight": embedding.copy()}, config)
    np.testing.assert_array_equal(with_alias["embedding"]["embedding"], embedding)
    check_hf_weights({name: value.shape for name, value in tensors.items()}, config, where="table")
    with pytest.raises(NeedleWeightsError, match=r"HF tensors: tensor lm_head\.weight differs from model\.embed_tokens"):
        hf_to_native({**tensors, "lm_head.weight": embedding + 1}, config)
    shapes = {name: value.shape for name, value in tensors.items()}
    with pytest.raises(NeedleWeightsError, match=r"unexpected tensor lm_head\.weight"):
        check_hf_weights({**shapes, "lm_head.weight": (3, 4)}, config, where="folder")


def test_weight_table_rejects_unknown_missing_and_misshapen_native_keys():
    params = make_native_params(TINY_NATIVE_CONFIG, 0, with_heads=False)
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG)
    params["stack"]["mystery"] = np.zeros(3, np.float32)
    with pytest.raises(NeedleWeightsError, match="unexpected tensor stack/mystery"):
        native_to_hf(params, config)
    del params["stack"]["mystery"]
    del params["engrams_1"]["taps"]
    with pytest.raises(NeedleWeightsError, match="missing tensor engrams_1/taps"):
        native_to_hf(params, config)
    params["engrams_1"]["taps"] = np.zeros((4, 32), np.float32)
    with pytest.raises(NeedleWeightsError, match=r"tensor engrams_1/taps \(for model\.engrams\.1\.conv_taps\): expected shape \(4, 64\), got \(4, 32\)"):
        native_to_hf(params, config)


def test_shared_numerics_match_the_reference():
    import jax.numpy as jnp
    from needle.model.architecture import _walsh_matrix, engram_indices

    tokens = np.random.default_rng(0).integers(0, 8192, (2, 30))
    np.testing.assert_array_equal(engram_indices_numpy(tokens, (2, 3), 2, 8192), np.asarray(engram_indices(jnp.asarray(tokens), (2, 3), 2, 8192)))
    np.testing.assert_allclose(walsh_matrix(512), np.asarray(_walsh_matrix(512)), atol=0)
    pre, post = hyper_connection_offsets(6, 4)
    lane = np.eye(4)[np.arange(6) % 4]
    np.testing.assert_array_equal(pre, 8 * lane - 4)
    np.testing.assert_array_equal(post, -4 * (1 - lane))
