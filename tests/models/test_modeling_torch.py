"""The PyTorch Needle 2 model against the reference (cactus-needle 2.x) and against itself.

Parity tests load reference-shaped parameters (every leaf perturbed, see `needle_reference`) through
`native_to_hf` into `NeedleForCausalLM` and compare float32 outputs with the reference's. The other
tests check the behaviour transformers users rely on: padding, the KV cache, `generate()`, attention
implementations, half precision, and strict `save_pretrained` / `from_pretrained` round trips.
"""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from needle_reference import (
    BASE_NATIVE_CONFIG,
    TINY_NATIVE_CONFIG,
    make_native_params,
    reference_heads,
    reference_logits,
)

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import (
    NeedleForCausalLM,
    NeedleModel,
    NeedleWeightsError,
    engram_hash_indices,
    sinkhorn,
)
from needle_hf.models.needle.numerics import engram_indices_numpy
from needle_hf.models.needle.weight_names import hf_weight_shapes, native_to_hf

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread

PARITY_TOLERANCE = 1e-4  # max |logit difference| against the reference, float32
SEEDS = (0, 1, 2)
# A second tiny geometry whose width (48) is not a power of two: the Hadamard MLP zero-pads to 64,
# head_dim is 12 and there are two hash heads per n-gram order.
ODD_WIDTH_NATIVE_CONFIG = dict(
    vocab_size=384,
    d_model=48,
    num_heads=4,
    num_kv_heads=1,
    num_layers=2,
    max_seq_len=64,
    engram_layers=(1,),
    engram_heads=2,
    engram_slots=32,
    contrastive_dim=8,
    dtype="float32",
)
SEQUENCE_LENGTH = 24  # > 11 = the engram's reach (n-gram + dilated conv), so every path is exercised
NO_EOS = dict(eos_token_id=None, pad_token_id=0)  # generate exactly max_new_tokens


def hf_config(native: dict) -> NeedleConfig:
    return NeedleConfig.from_needle_config(native, use_contrastive_head=True, use_confidence_head=True)


def torch_model(native: dict, params: dict, attn_implementation: str = "sdpa") -> NeedleForCausalLM:
    """A float32 model holding the reference parameters, loaded strictly through the weight table."""
    config = hf_config(native)
    model = NeedleForCausalLM._from_config(config, attn_implementation=attn_implementation)
    state = {name: torch.from_numpy(value) for name, value in native_to_hf(params, config).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def write_checkpoint(folder, native: dict, tensors: dict) -> None:
    """A Hugging Face folder: config.json and a PyTorch-layout model.safetensors."""
    hf_config(native).save_pretrained(folder)
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def random_tokens(batch: int, length: int, seed: int, vocab_size: int = TINY_NATIVE_CONFIG["vocab_size"]) -> np.ndarray:
    """Token ids in [1, vocab) (0 is padding)."""
    return np.random.default_rng(seed).integers(1, vocab_size, size=(batch, length))


def max_difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.fixture(scope="module")
def tiny_params() -> dict:
    return {seed: make_native_params(TINY_NATIVE_CONFIG, seed) for seed in SEEDS}


@pytest.fixture(scope="module")
def tiny_model(tiny_params) -> NeedleForCausalLM:
    return torch_model(TINY_NATIVE_CONFIG, tiny_params[0])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_params):
    folder = tmp_path_factory.mktemp("tiny_checkpoint")
    write_checkpoint(folder, TINY_NATIVE_CONFIG, native_to_hf(tiny_params[0], hf_config(TINY_NATIVE_CONFIG)))
    return folder


# --------------------------------------------------------------------------------------------------
# Weight names


@pytest.mark.parametrize(
    "overrides",
    [
        dict(use_contrastive_head=True, use_confidence_head=True),
        dict(use_mtp_head=False),
        dict(engram_layers=()),
    ],
    ids=["all-heads", "no-mtp", "no-engram"],
)
def test_state_dict_is_exactly_the_weight_table(overrides):
    config = NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, **overrides)
    model = NeedleForCausalLM(config)
    state = model.state_dict()
    # The weight table, plus `lm_head.weight`: the tied head, the embedding's own storage.
    assert state.pop("lm_head.weight").data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert {name: tuple(t.shape) for name, t in state.items()} == hf_weight_shapes(config)
    assert {name for name, _ in model.named_parameters()} == set(hf_weight_shapes(config))

    backbone = NeedleModel(config).state_dict()
    prefix = "model."
    shapes = hf_weight_shapes(config)
    expected = {name[len(prefix) :]: shape for name, shape in shapes.items() if name.startswith(prefix)}
    assert {name: tuple(t.shape) for name, t in backbone.items()} == expected


def test_fresh_model_follows_the_reference_initialisation():
    config = hf_config(TINY_NATIVE_CONFIG)
    state = NeedleForCausalLM(config).state_dict()
    lanes, residual_std = config.hyper_connection_lanes, 0.02 / np.sqrt(2 * config.num_hidden_layers)
    assert torch.all(state["model.layers.1.input_layernorm.weight"] == 0)
    assert torch.all(state["model.layers.1.self_attn.k_norm.weight"] == 0)
    assert state["model.layers.1.attention_gate"].item() == 0
    assert torch.all(state["model.layers.1.mlp.diag_in"] == 1)
    assert torch.allclose(state["model.layers.1.mlp.diag_out"], torch.tensor(0.02))
    assert torch.equal(state["model.layers.1.hyper_connection.res_bias"], 4 * torch.eye(lanes))
    assert state["model.layers.1.hyper_connection.post_alpha"].item() == pytest.approx(0.01)
    assert torch.equal(state["model.engrams.0.conv_taps"][0], torch.ones(config.hidden_size))
    assert torch.all(state["model.engrams.0.conv_taps"][1:] == 0)
    assert state["contrastive_head.log_temperature"].item() == pytest.approx(np.log(0.07))
    assert state["model.layers.0.self_attn.q_proj.weight"].std().item() == pytest.approx(0.02, rel=0.15)
    assert state["model.layers.0.self_attn.o_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.15)
    assert state["mtp.combine_proj.weight"].std().item() == pytest.approx(0.02, rel=0.15)


# --------------------------------------------------------------------------------------------------
# The output head: a bias-less `lm_head` tied to the embedding


def test_output_head_is_a_bias_less_linear_sharing_the_embedding():
    model = NeedleForCausalLM(hf_config(TINY_NATIVE_CONFIG))
    head = model.get_output_embeddings()
    assert head is model.lm_head and isinstance(head, torch.nn.Linear) and head.bias is None
    assert head.weight is model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings is True
    with pytest.raises(ValueError, match="tie_word_embeddings must be True"):
        NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, tie_word_embeddings=False)


def test_saved_file_holds_the_tied_head_once_and_the_tie_survives_loading_and_resizing(tiny_folder, tmp_path):
    model = NeedleForCausalLM.from_pretrained(tiny_folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    saved = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in saved and set(saved) == set(hf_weight_shapes(model.config))
    reloaded = NeedleForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight

    vocab = model.config.vocab_size
    reloaded.resize_token_embeddings(vocab + 8, mean_resizing=False)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert reloaded.lm_head.weight.shape == (vocab + 8, model.config.hidden_size)
    ids = torch.from_numpy(random_tokens(1, 6, seed=3))
    with torch.no_grad():
        before, after = model(ids).logits, reloaded(ids).logits
    assert after.shape == (1, 6, vocab + 8) and after.dtype == torch.float32
    torch.testing.assert_close(after[..., :vocab], before, rtol=0, atol=0)


def test_gradients_of_the_input_and_output_uses_meet_in_the_one_tensor(tiny_params):
    model = torch_model(TINY_NATIVE_CONFIG, tiny_params[0]).train()
    ids = torch.from_numpy(random_tokens(2, 10, seed=4))
    model(ids, labels=ids).loss.backward()
    assert model.lm_head.weight.grad is model.model.embed_tokens.weight.grad
    # The same loss with the two uses as separate tensors: the tied gradient is their sum.
    embedding = model.model.embed_tokens.weight.detach()
    separate = {"model.embed_tokens.weight": embedding.clone().requires_grad_(),
                "lm_head.weight": embedding.clone().requires_grad_()}
    loss = torch.func.functional_call(model, separate, (ids,), {"labels": ids}, tie_weights=False).loss
    loss.backward()
    total = separate["model.embed_tokens.weight"].grad + separate["lm_head.weight"].grad
    assert separate["lm_head.weight"].grad.abs().sum() > 0 and separate["model.embed_tokens.weight"].grad.abs().sum() > 0
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, total, rtol=1e-5, atol=1e-8)


def test_state_dicts_load_with_or_without_the_tied_alias_but_not_an_untied_head(tiny_params, tmp_path):
    config = hf_config(TINY_NATIVE_CONFIG)
    table = {name: torch.from_numpy(value) for name, value in native_to_hf(tiny_params[0], config).items()}
    with_alias = NeedleForCausalLM(config)
    with_alias.load_state_dict({**table, "lm_head.weight": table["model.embed_tokens.weight"].clone()}, strict=True)
    assert with_alias.lm_head.weight is with_alias.model.embed_tokens.weight
    untied = {**table, "lm_head.weight": table["model.embed_tokens.weight"] + 1}
    with pytest.raises(NeedleWeightsError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        NeedleForCausalLM(config).load_state_dict(untied, strict=True)
    write_checkpoint(tmp_path, TINY_NATIVE_CONFIG, {name: value.numpy() for name, value in untied.items()})
    with pytest.raises(NeedleWeightsError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        NeedleForCausalLM.from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------------
# Parity with the reference


@pytest.mark.parametrize("seed", SEEDS)
def test_logits_and_mtp_logits_match_the_reference(tiny_params, seed):
    params = tiny_params[seed]
    model = torch_model(TINY_NATIVE_CONFIG, params)
    tokens = random_tokens(2, SEQUENCE_LENGTH, seed)
    # The same (all-ones) mask argument as the padded test below, so the reference compiles once.
    expected, expected_mtp = reference_logits(TINY_NATIVE_CONFIG, params, tokens, np.ones_like(tokens))
    with torch.no_grad():
        out = model(torch.from_numpy(tokens), use_cache=False, return_mtp_logits=True)
    assert out.logits.dtype == torch.float32 and out.mtp_logits.dtype == torch.float32
    assert max_difference(out.logits, expected) <= PARITY_TOLERANCE
    assert max_difference(out.mtp_logits, expected_mtp) <= PARITY_TOLERANCE


def test_odd_width_model_matches_the_reference():
    params = make_native_params(ODD_WIDTH_NATIVE_CONFIG, seed=7)
    model = torch_model(ODD_WIDTH_NATIVE_CONFIG, params)
    assert model.config.hadamard_size == 64 and model.config.engram_num_tables == 4
    tokens = random_tokens(2, SEQUENCE_LENGTH, seed=7, vocab_size=ODD_WIDTH_NATIVE_CONFIG["vocab_size"])
    expected, expected_mtp = reference_logits(ODD_WIDTH_NATIVE_CONFIG, params, tokens)
    with torch.no_grad():
        out = model(torch.from_numpy(tokens), use_cache=False, return_mtp_logits=True)
    assert max_difference(out.logits, expected) <= PARITY_TOLERANCE
    assert max_difference(out.mtp_logits, expected_mtp) <= PARITY_TOLERANCE


@pytest.mark.parametrize("spread", [8.0, 200.0], ids=["linear-space", "log-space"])
def test_sinkhorn_matches_the_reference_rounds(spread):
    """Lane mixing as the reference computes it (20 log-space rounds), also for logits spread too far
    (> 30) for `sinkhorn`'s linear-space form, where it falls back to log space."""
    import jax.numpy as jnp
    from needle.model.architecture import _sinkhorn

    logits = np.random.default_rng(3).uniform(0.0, spread, size=(2, 5, 4, 4)).astype(np.float32)
    expected = np.asarray(_sinkhorn(jnp.asarray(logits)))
    assert max_difference(sinkhorn(torch.from_numpy(logits)), expected) <= 1e-6


@pytest.mark.parametrize(("orders", "heads"), [((2, 3), 2), ((1, 2, 4), 3)])
def test_engram_hash_matches_the_numpy_statement(orders, heads):
    """All tables hashed at once give each table's own n-gram hash (the numpy statement is checked
    against the reference in test_config_and_weight_names)."""
    tokens = random_tokens(2, 30, seed=4)
    hashed = engram_hash_indices(torch.from_numpy(tokens), orders, heads, 97)
    np.testing.assert_array_equal(hashed.numpy(), engram_indices_numpy(tokens, orders, heads, 97))


def padded_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row 0 left-padded by 5, row 1 right-padded by 7 (pad id 0), and the matching attention mask."""
    tokens = random_tokens(2, SEQUENCE_LENGTH, seed)
    mask = np.ones_like(tokens)
    mask[0, :5] = 0
    mask[1, SEQUENCE_LENGTH - 7 :] = 0
    return tokens * mask, mask


@pytest.mark.parametrize("seed", SEEDS)
def test_contrastive_and_confidence_heads_match_the_reference(tiny_params, seed):
    params = tiny_params[seed]
    model = torch_model(TINY_NATIVE_CONFIG, params)
    tokens, _ = padded_batch(seed)  # the heads read padding from the pad id, as the reference does
    expected_embedding, expected_confidence = reference_heads(TINY_NATIVE_CONFIG, params, tokens)
    with torch.no_grad():
        embedding, log_temperature = model.contrastive_embedding(torch.from_numpy(tokens))
        confidence = model.confidence_logit(torch.from_numpy(tokens))
    assert embedding.shape == (2, TINY_NATIVE_CONFIG["contrastive_dim"]) and confidence.shape == (2,)
    assert confidence.dtype == torch.float32
    assert max_difference(embedding, expected_embedding) <= PARITY_TOLERANCE
    assert max_difference(confidence, expected_confidence) <= PARITY_TOLERANCE
    assert log_temperature.item() == pytest.approx(float(params["contrastive_head"]["log_temp"]))


def test_padded_logits_match_the_reference(tiny_params, tiny_model):
    tokens, mask = padded_batch(seed=11)
    expected, expected_mtp = reference_logits(TINY_NATIVE_CONFIG, tiny_params[0], tokens, mask)
    with torch.no_grad():
        out = tiny_model(
            torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask), use_cache=False, return_mtp_logits=True
        )
    real = mask.astype(bool)
    assert max_difference(out.logits.numpy()[real], expected[real]) <= PARITY_TOLERANCE
    assert max_difference(out.mtp_logits.numpy()[real], expected_mtp[real]) <= PARITY_TOLERANCE


# --------------------------------------------------------------------------------------------------
# Padding, hidden states, attention implementations


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_give_the_logits_of_the_unpadded_sequence(tiny_model, side):
    sequence = torch.from_numpy(random_tokens(1, 17, seed=3))
    padding = torch.zeros(1, 6, dtype=torch.long)
    padded = torch.cat([padding, sequence] if side == "left" else [sequence, padding], dim=1)
    mask = (padded != 0).long()
    batch = torch.cat([padded, torch.from_numpy(random_tokens(1, 23, seed=4))])  # a full row beside it
    batch_mask = torch.cat([mask, torch.ones(1, 23, dtype=torch.long)])
    real = slice(6, None) if side == "left" else slice(None, 17)
    with torch.no_grad():
        alone = tiny_model(sequence, use_cache=False, return_mtp_logits=True)
        padded_out = tiny_model(batch, attention_mask=batch_mask, use_cache=False, return_mtp_logits=True)
    assert max_difference(padded_out.logits[0, real], alone.logits[0]) <= PARITY_TOLERANCE
    assert max_difference(padded_out.mtp_logits[0, real], alone.mtp_logits[0]) <= PARITY_TOLERANCE


def test_hidden_states_are_the_embedding_and_each_layers_lane_mean(tiny_model):
    ids = torch.from_numpy(random_tokens(2, 12, seed=5))
    with torch.no_grad():
        out = tiny_model.model(ids, use_cache=False, output_hidden_states=True)
    config = tiny_model.config
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    embedding = tiny_model.model.embed_tokens.weight[ids] * config.hidden_size**0.5
    assert torch.allclose(out.hidden_states[0], embedding)
    assert torch.allclose(tiny_model.model.norm(out.hidden_states[-1]), out.last_hidden_state)


def test_sdpa_and_eager_attention_agree(tiny_params, tiny_model):
    eager = torch_model(TINY_NATIVE_CONFIG, tiny_params[0], attn_implementation="eager")
    assert tiny_model.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    tokens, mask = padded_batch(seed=13)
    ids, attention_mask = torch.from_numpy(tokens), torch.from_numpy(mask)
    with torch.no_grad():
        by_sdpa = tiny_model(ids, attention_mask=attention_mask, use_cache=False).logits
        by_eager = eager(ids, attention_mask=attention_mask, use_cache=False, output_attentions=True)
    assert max_difference(by_sdpa, by_eager.logits) <= 1e-5
    assert len(by_eager.attentions) == eager.config.num_hidden_layers
    assert by_eager.attentions[0].shape == (2, eager.config.num_attention_heads, SEQUENCE_LENGTH, SEQUENCE_LENGTH)


# --------------------------------------------------------------------------------------------------
# KV cache


CACHE_ARGUMENT = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cached_decode(model, ids: torch.Tensor, mask: torch.Tensor, chunks: list[int], cache=None) -> torch.Tensor:
    """Logits of ``ids`` fed in chunks through one cache (a DynamicCache unless given): the cache
    carries the engram state, nothing else is passed between steps."""
    pieces, start = [], 0
    for size in chunks:
        out = model(
            ids[:, start : start + size],
            attention_mask=mask[:, : start + size],
            use_cache=True,
            **{CACHE_ARGUMENT: cache},
        )
        cache = getattr(out, CACHE_ARGUMENT)
        pieces.append(out.logits)
        start += size
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_cached_decoding_matches_the_full_forward(tiny_params, attn_implementation):
    model = torch_model(TINY_NATIVE_CONFIG, tiny_params[1], attn_implementation=attn_implementation)
    length = 28
    ids = torch.from_numpy(random_tokens(2, length, seed=21))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in row 0
    ids = ids * mask
    chunks = [4, 3] + [1] * (length - 7)  # prefill, a multi-token step, then 21 single tokens
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        stepwise = cached_decode(model, ids, mask, chunks)
    real = mask.bool()
    assert max_difference(stepwise[real], full[real]) <= PARITY_TOLERANCE
    assert max_difference(stepwise[:, 12:][real[:, 12:]], full[:, 12:][real[:, 12:]]) <= PARITY_TOLERANCE


# --------------------------------------------------------------------------------------------------
# generate()


def test_greedy_generate_equals_an_argmax_loop_over_the_full_forward(tiny_model):
    prompt = torch.from_numpy(random_tokens(2, 5, seed=8))
    with torch.no_grad():
        generated = tiny_model.generate(prompt, max_new_tokens=20, do_sample=False, **NO_EOS)
        expected = prompt
        for _ in range(20):
            logits = tiny_model(expected, use_cache=False).logits
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, expected)


def test_beam_search_with_the_cache_equals_beam_search_without(tiny_model):
    prompt = torch.from_numpy(random_tokens(2, 5, seed=9))
    options = dict(max_new_tokens=16, num_beams=2, do_sample=False, **NO_EOS)
    with torch.no_grad():
        cached = tiny_model.generate(prompt, **options)
        uncached = tiny_model.generate(prompt, use_cache=False, **options)
    assert cached.shape == (2, 21)
    assert torch.equal(cached, uncached)


def test_sampling_is_reproducible_from_the_seed(tiny_model):
    prompt = torch.from_numpy(random_tokens(1, 5, seed=10))
    options = dict(max_new_tokens=16, do_sample=True, top_k=0, **NO_EOS)
    runs = []
    with torch.no_grad():
        for seed, use_cache in [(3, True), (3, True), (3, False), (4, True)]:
            torch.manual_seed(seed)
            runs.append(tiny_model.generate(prompt, use_cache=use_cache, **options))
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0], runs[2])  # the cache changes nothing
    assert not torch.equal(runs[0], runs[3])


def test_generation_stops_at_eos_and_at_max_new_tokens(tiny_model):
    prompt = torch.from_numpy(random_tokens(1, 5, seed=12))
    with torch.no_grad():
        free = tiny_model.generate(prompt, max_new_tokens=12, do_sample=False, **NO_EOS)
        assert free.shape == (1, 17)
        new_tokens = free[0, 5:].tolist()
        stop_token = new_tokens[6]
        stop_at = new_tokens.index(stop_token)  # its first occurrence
        stopped = tiny_model.generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=stop_token, pad_token_id=0
        )
    assert stopped[0, 5:].tolist() == new_tokens[: stop_at + 1]


def test_left_padded_batch_generates_like_single_rows(tiny_model):
    short, long = random_tokens(1, 4, seed=14), random_tokens(1, 9, seed=15)
    batch = np.zeros((2, 9), np.int64)
    batch[0, 5:], batch[1] = short[0], long[0]
    mask = (batch != 0).astype(np.int64)
    options = dict(max_new_tokens=14, do_sample=False, **NO_EOS)
    with torch.no_grad():
        together = tiny_model.generate(torch.from_numpy(batch), attention_mask=torch.from_numpy(mask), **options)
        alone_short = tiny_model.generate(torch.from_numpy(short), **options)
        alone_long = tiny_model.generate(torch.from_numpy(long), **options)
    assert torch.equal(together[0, 5:], alone_short[0])
    assert torch.equal(together[1], alone_long[0])


# --------------------------------------------------------------------------------------------------
# Loading, saving, precision


def test_save_and_reload_is_bit_exact(tiny_folder, tmp_path):
    model = NeedleForCausalLM.from_pretrained(tiny_folder)
    config = model.config
    assert config.use_contrastive_head and config.use_confidence_head
    model.save_pretrained(tmp_path)
    saved = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert {name: value.shape for name, value in saved.items()} == hf_weight_shapes(config)
    reloaded = NeedleForCausalLM.from_pretrained(tmp_path)
    original, again = model.state_dict(), reloaded.state_dict()
    assert original.keys() == again.keys()
    assert all(torch.equal(original[name], again[name]) for name in original)
    written = safetensors.numpy.load_file(str(tiny_folder / "model.safetensors"))
    assert all(np.array_equal(original[name].numpy(), value) for name, value in written.items())


def test_backbone_loads_from_a_causal_lm_checkpoint(tiny_folder, tiny_model):
    backbone = NeedleModel.from_pretrained(tiny_folder).eval()
    ids = torch.from_numpy(random_tokens(1, 10, seed=16))
    with torch.no_grad():
        alone = backbone(ids, use_cache=False).last_hidden_state
        inside = tiny_model.model(ids, use_cache=False).last_hidden_state
    assert torch.equal(alone, inside)


def test_backbone_checkpoint_loads_into_the_causal_lm_only_with_heads_off(tiny_folder, tiny_model, tmp_path):
    NeedleModel.from_pretrained(tiny_folder).save_pretrained(tmp_path)
    with pytest.raises(NeedleWeightsError, match=r"missing tensor mtp\..*use_mtp_head"):
        NeedleForCausalLM.from_pretrained(tmp_path)
    causal_lm = NeedleForCausalLM.from_pretrained(tmp_path, without_heads=True).eval()
    config = causal_lm.config
    assert causal_lm.mtp is None and not (config.use_mtp_head or config.use_contrastive_head or config.use_confidence_head)
    ids = torch.from_numpy(random_tokens(1, 10, seed=18))
    with torch.no_grad():
        assert torch.equal(causal_lm(ids, use_cache=False).logits, tiny_model(ids, use_cache=False).logits)
    # A causal-LM checkpoint with heads loads the same way, its head tensors left unused.
    assert NeedleForCausalLM.from_pretrained(tiny_folder, without_heads=True).mtp is None


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"),
            r"missing tensor.*model\.layers\.1\.self_attn\.q_proj\.weight",
        ),
        (
            lambda t: t.update({"model.norm.weight": np.zeros(65, np.float32)}),
            r"tensor model\.norm\.weight: expected shape \(64,\), got \(65,\)",
        ),
        (
            lambda t: t.update({"model.layers.0.extra": np.zeros(3, np.float32)}),
            r"unexpected tensor.*model\.layers\.0\.extra",
        ),
        (
            lambda t: [t.pop(name) for name in [n for n in t if n.startswith("confidence_head.")]],
            r"missing tensor.*confidence_head\..*use_confidence_head",
        ),
    ],
    ids=["missing", "wrong-shape", "unexpected", "head-absent"],
)
def test_loading_an_inexact_checkpoint_raises(tiny_params, tmp_path, damage, message):
    tensors = native_to_hf(tiny_params[0], hf_config(TINY_NATIVE_CONFIG))
    damage(tensors)
    write_checkpoint(tmp_path, TINY_NATIVE_CONFIG, tensors)
    with pytest.raises(NeedleWeightsError, match=message):
        NeedleForCausalLM.from_pretrained(tmp_path)


def test_loading_refuses_head_tensors_the_config_does_not_declare(tiny_params, tmp_path):
    tensors = native_to_hf(tiny_params[0], hf_config(TINY_NATIVE_CONFIG))
    write_checkpoint(tmp_path, TINY_NATIVE_CONFIG, tensors)
    NeedleConfig.from_needle_config(TINY_NATIVE_CONFIG, use_contrastive_head=True).save_pretrained(tmp_path)
    with pytest.raises(NeedleWeightsError, match=r"unexpected tensor.*confidence_head\..*use_confidence_head"):
        NeedleForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 0.08), (torch.float16, 0.01)])
def test_half_precision_agrees_with_float32(tiny_folder, tiny_model, dtype, tolerance):
    model = NeedleForCausalLM.from_pretrained(tiny_folder, dtype=dtype).eval()
    assert all(p.dtype == dtype for p in model.parameters())
    ids = torch.from_numpy(random_tokens(4, 64, seed=17))
    with torch.no_grad():
        reduced = model(ids, use_cache=False).logits
        full = tiny_model(ids, use_cache=False).logits
        generated = model.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, **NO_EOS)
    assert reduced.dtype == torch.float32
    assert max_difference(reduced, full) <= tolerance  # max |logit| is about 4
    agreement = (reduced.argmax(-1) == full.argmax(-1)).float().mean().item()
    assert agreement >= 0.99
    assert generated.shape == (1, 12)


# --------------------------------------------------------------------------------------------------
# The Needle 2 geometry


@pytest.mark.full_size
def test_needle2_geometry_matches_the_reference_full_and_cached():
    params = make_native_params(BASE_NATIVE_CONFIG, seed=0)
    model = torch_model(BASE_NATIVE_CONFIG, params)
    # The reference's `base` preset has 44,938,997 parameters (backbone and MTP head, the advertised "45M").
    heads = ("contrastive_head.", "confidence_head.")
    assert sum(p.numel() for name, p in model.named_parameters() if not name.startswith(heads)) == 44_938_997
    tokens = random_tokens(1, 20, seed=0, vocab_size=model.config.vocab_size)
    expected, expected_mtp = reference_logits(BASE_NATIVE_CONFIG, params, tokens)
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        out = model(ids, use_cache=False, return_mtp_logits=True)
        stepwise = cached_decode(model, ids, torch.ones_like(ids), [8] + [1] * 12)
    assert max_difference(out.logits, expected) <= PARITY_TOLERANCE
    assert max_difference(out.mtp_logits, expected_mtp) <= PARITY_TOLERANCE
    assert max_difference(stepwise, expected) <= PARITY_TOLERANCE
