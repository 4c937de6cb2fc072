"""What transformers' model and generation test mixins check, on a tiny Needle config (4.57 and 5.x).

`ModelTesterMixin` / `GenerationTesterMixin` are not shipped in a wheel; these tests state their
behaviours for Needle: every trainable weight gets a gradient under activation checkpointing (the MTP
head is frozen, as the reference's fine-tuning leaves it), `prepare_inputs_for_generation` hands
`forward` only arguments it takes, the decoding strategies agree with each other, and the two
architectural refusals (untied output head, ``inputs_embeds``) are skips with their reasons, the way
transformers marks a mixin test a model cannot run, beside tests of the refusals' messages.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache, GenerationMixin

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.finetune.trainer import needle_causal_lm_loss
from needle_hf.models.needle.modeling_needle import CACHE_OUTPUT_FIELD, NeedleForCausalLM

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread

TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            max_position_embeddings=128, engram_layers=(0, 2), engram_slots=64)
GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)

UNTIED_HEAD = "Needle ties its output head to the token embedding (config.tie_word_embeddings is always True)"
INPUTS_EMBEDS = "Needle reads token ids, not inputs_embeds: its engram memory hashes the ids of every n-gram"


def tiny_model(attn_implementation: str = "eager", seed: int = 0) -> NeedleForCausalLM:
    torch.manual_seed(seed)
    model = NeedleForCausalLM._from_config(NeedleConfig(**TINY), attn_implementation=attn_implementation)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> NeedleForCausalLM:
    return tiny_model()


def prompt(batch: int = 2, length: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] and a left-padded attention mask (the first row starts 3 tokens later)."""
    ids = torch.randint(1, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :3] = 0
        ids[0, :3] = 0
    return ids, mask


# --------------------------------------------------------------------------------------------------
# Training


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_every_trainable_weight_gets_a_gradient_under_activation_checkpointing(use_reentrant):
    model = tiny_model().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.model.layers[0].gradient_checkpointing
    ids, mask = prompt()
    model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    without = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert without == []
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in model.mtp.named_parameters(prefix="mtp")}
    mtp_size = sum(p.numel() for p in model.mtp.parameters())
    assert model.num_parameters(only_trainable=True) == model.num_parameters() - mtp_size


def test_mtp_head_stays_frozen_through_saving_and_loading_and_trains_when_asked(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = NeedleForCausalLM.from_pretrained(tmp_path)
    assert not any(p.requires_grad for p in loaded.mtp.parameters())
    assert all(p.requires_grad for p in loaded.model.parameters())
    loaded.mtp.requires_grad_(True)
    loaded.train()
    ids, mask = prompt()
    outputs = loaded(input_ids=ids, attention_mask=mask, return_mtp_logits=True)
    needle_causal_lm_loss(outputs.logits, ids, mtp_logits=outputs.mtp_logits, mtp_loss_weight=0.5).backward()
    assert all(p.grad is not None for p in loaded.mtp.parameters())


# --------------------------------------------------------------------------------------------------
# Generation


def forward_arguments(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_prepared_generation_inputs_are_forward_arguments_and_run(model, cache_implementation):
    """What `prepare_inputs_for_generation` returns for a prefill and for a decoding step goes into
    `forward` as it is (no internal keyword: the engram's state travels in the cache)."""
    ids, mask = prompt()
    if cache_implementation == "static":
        from transformers import StaticCache

        try:
            cache = StaticCache(config=model.config, max_cache_len=16)
        except TypeError:  # transformers 4.57 also wants the batch size
            cache = StaticCache(config=model.config, max_batch_size=2, max_cache_len=16)
    else:
        cache = DynamicCache()
    cache_position = torch.arange(ids.shape[1])
    inputs = model.prepare_inputs_for_generation(ids, attention_mask=mask, use_cache=True, cache_position=cache_position,
                                                 **{CACHE_OUTPUT_FIELD: cache})
    assert set(inputs) <= forward_arguments(model), set(inputs) - forward_arguments(model)
    with torch.no_grad():
        first = model(**inputs)
    next_ids = torch.cat([ids, first.logits[:, -1:].argmax(-1)], dim=1)
    next_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    # 5.x says how many tokens are new (`next_sequence_length`); 4.57 reads it off cache_position.
    step_length = {"next_sequence_length": 1} if "next_sequence_length" in inspect.signature(
        GenerationMixin.prepare_inputs_for_generation).parameters else {}
    inputs = model.prepare_inputs_for_generation(next_ids, attention_mask=next_mask, use_cache=True,
                                                 cache_position=cache_position[-1:] + 1, **step_length,
                                                 **{CACHE_OUTPUT_FIELD: getattr(first, CACHE_OUTPUT_FIELD)})
    assert set(inputs) <= forward_arguments(model), set(inputs) - forward_arguments(model)
    assert inputs["input_ids"].shape == (2, 1)
    with torch.no_grad():
        step = model(**inputs).logits[:, -1]
        whole = model(input_ids=next_ids, attention_mask=next_mask).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=0, atol=1e-5)


def test_greedy_with_and_without_a_cache_and_with_a_static_cache_agree(model):
    ids, mask = prompt()
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, **GREEDY)
        uncached = model.generate(ids, attention_mask=mask, use_cache=False, **GREEDY)
        static = model.generate(ids, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert torch.equal(cached, uncached) and torch.equal(cached, static)


def test_left_padding_leaves_the_generated_tokens_as_they_are(model):
    ids, mask = prompt()
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **GREEDY)[0, ids.shape[1]:]
        alone = model.generate(ids[:1, 3:], attention_mask=mask[:1, 3:], **GREEDY)[0, ids.shape[1] - 3:]
    assert torch.equal(batched, alone)


def test_dict_outputs_hold_scores_logits_hidden_states_and_attentions(model):
    ids, mask = prompt()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True,
                             output_logits=True, output_hidden_states=True, output_attentions=True, **GREEDY)
    steps = GREEDY["max_new_tokens"]
    assert len(out.scores) == len(out.logits) == len(out.hidden_states) == len(out.attentions) == steps
    assert out.logits[0].shape == (2, TINY["vocab_size"])
    assert len(out.hidden_states[0]) == TINY["num_hidden_layers"] + 1
    assert out.attentions[0][0].shape == (2, TINY["num_attention_heads"], ids.shape[1], ids.shape[1])
    assert out.attentions[1][0].shape == (2, TINY["num_attention_heads"], 1, ids.shape[1] + 1)
    assert isinstance(getattr(out, CACHE_OUTPUT_FIELD), DynamicCache)


def test_generation_continues_from_the_returned_cache(model):
    ids, mask = prompt()
    with torch.no_grad():
        whole = model.generate(ids, attention_mask=mask, **dict(GREEDY, max_new_tokens=6))
        first = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **dict(GREEDY, max_new_tokens=3))
        grown_mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)
        rest = model.generate(first.sequences, attention_mask=grown_mask, **dict(GREEDY, max_new_tokens=3),
                              **{CACHE_OUTPUT_FIELD: getattr(first, CACHE_OUTPUT_FIELD)})
    assert torch.equal(rest, whole)


def test_sampling_and_beam_search_run_with_their_output_shapes(model):
    ids, mask = prompt()
    with torch.no_grad():
        torch.manual_seed(0)
        sampled = model.generate(ids, attention_mask=mask, do_sample=True, top_k=8, num_return_sequences=3,
                                 max_new_tokens=4, pad_token_id=0, eos_token_id=None)
        beams = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, do_sample=False,
                               return_dict_in_generate=True, output_scores=True, max_new_tokens=4, pad_token_id=0,
                               eos_token_id=None)
        beam_sampled = model.generate(ids, attention_mask=mask, num_beams=2, do_sample=True, max_new_tokens=4,
                                      pad_token_id=0, eos_token_id=None)
    assert sampled.shape == (6, ids.shape[1] + 4)
    assert beams.sequences.shape == (4, ids.shape[1] + 4) and beams.sequences_scores.shape == (4,)
    assert beam_sampled.shape == (2, ids.shape[1] + 4)


def test_assisted_decoding_gives_the_greedy_tokens(model):
    ids, mask = prompt(batch=1)
    options = dict(GREEDY, eos_token_id=1)  # candidate generators read an end token
    with torch.no_grad():
        greedy = model.generate(ids, attention_mask=mask, **options)
        assisted = model.generate(ids, attention_mask=mask, assistant_model=tiny_model(seed=1), **options)
        lookup = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=2, **options)
    assert torch.equal(assisted, greedy) and torch.equal(lookup, greedy)


# --------------------------------------------------------------------------------------------------
# Architectural refusals: skipped as transformers skips a mixin test a model cannot run, and tested


@pytest.mark.skip(reason=INPUTS_EMBEDS)
def test_inputs_embeds():
    """ModelTesterMixin.test_inputs_embeds: forward from embeddings instead of ids."""


@pytest.mark.skip(reason=INPUTS_EMBEDS)
def test_generate_from_inputs_embeds():
    """GenerationTesterMixin.test_generate_from_inputs_embeds."""


@pytest.mark.skip(reason=UNTIED_HEAD)
def test_resize_embeddings_untied():
    """ModelTesterMixin.test_resize_embeddings_untied: resizing a model whose output head is untied."""


@pytest.mark.skip(reason=UNTIED_HEAD)
def test_load_save_without_tied_weights():
    """ModelTesterMixin.test_load_save_without_tied_weights."""


def test_the_refusals_say_why(model):
    ids, _ = prompt()
    with pytest.raises(ValueError, match="pass input_ids, not inputs_embeds"):
        model(input_ids=ids, inputs_embeds=model.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="tie_word_embeddings must be True"):
        NeedleConfig(**TINY, tie_word_embeddings=False)
