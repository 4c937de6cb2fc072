"""Shared-prefix batches: the common prompt run once gives the padded batch's loss and gradients,
the sampler draws every row once per epoch from one prefix group per batch, and `NeedleTrainer`
trains with them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TrainingArguments

from needle_hf.finetune.data import IGNORE_INDEX, FinetuneDataError, NeedlePaddingCollator
from needle_hf.finetune.shared_prefix import (
    PrefixGroupedBatchSampler,
    SharedPrefixCollator,
    conversation_prefix_key,
    shared_prefix_forward,
)
from needle_hf.finetune.trainer import NeedleTrainer, needle_causal_lm_loss
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread

# Two engram sites: a cut closer to the start of the suffix than the engram's reach (11 tokens)
# makes the suffix read prefix ids through the cache.
TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            max_position_embeddings=128, engram_layers=(0, 2), engram_slots=64)
PAD = 0


def perturbed_model(seed: int = 0) -> NeedleForCausalLM:
    """A float32 tiny model with every parameter moved off its initial value (norms, gates, taps too)."""
    torch.manual_seed(seed)
    model = NeedleForCausalLM._from_config(NeedleConfig(**TINY), attn_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


@pytest.fixture(scope="module")
def model() -> NeedleForCausalLM:
    return perturbed_model()


def rows_with_prefix(prefix: list[int], tails: list[tuple[list[int], list[int]]]) -> list[dict]:
    """Rows ``prefix + query + answer``, labelled on the answer only."""
    return [{"input_ids": prefix + query + answer, "labels": [IGNORE_INDEX] * (len(prefix) + len(query)) + answer}
            for query, answer in tails]


def loss_and_gradients(model, batch: dict) -> tuple[float, dict]:
    """The Needle loss of ``batch`` (padded or shared-prefix) and every parameter's gradient."""
    model.zero_grad()
    if "prefix_ids" in batch:
        outputs = shared_prefix_forward(model, prefix_ids=batch["prefix_ids"], input_ids=batch["input_ids"],
                                        attention_mask=batch["attention_mask"])
    else:
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    loss = needle_causal_lm_loss(outputs.logits, batch["labels"])
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


tokens = st.lists(st.integers(1, TINY["vocab_size"] - 1), min_size=1, max_size=8)


@settings(max_examples=12, deadline=None)
@given(prefix=st.lists(st.integers(1, TINY["vocab_size"] - 1), min_size=1, max_size=24),
       tails=st.lists(st.tuples(tokens, tokens), min_size=1, max_size=4))
def test_shared_prefix_batch_gives_the_padded_batchs_loss_and_gradients(model, prefix, tails):
    rows = rows_with_prefix(prefix, tails)
    shared = SharedPrefixCollator(pad_token_id=PAD)(rows)
    # The cut ends before the logit that scores the first answer token, and leaves each row a token.
    assert shared["prefix_ids"].shape[1] >= len(prefix) - 1
    assert all(shared["labels"][row, 0] == IGNORE_INDEX for row in range(len(rows)))
    padded_loss, padded_gradients = loss_and_gradients(model, NeedlePaddingCollator(pad_token_id=PAD)(rows))
    shared_loss, shared_gradients = loss_and_gradients(model, shared)
    assert abs(shared_loss - padded_loss) <= 1e-5 * max(1.0, abs(padded_loss))
    assert padded_gradients.keys() == shared_gradients.keys()
    largest = max(g.abs().max().item() for g in padded_gradients.values())
    for name, gradient in padded_gradients.items():
        assert torch.allclose(shared_gradients[name], gradient, rtol=1e-4, atol=1e-5 * largest), name


def test_collator_cuts_only_the_common_prefix_and_falls_back_without_one():
    rows = rows_with_prefix([5, 6, 7, 8], [([9, 10], [11, 12]), ([9, 13, 14], [15])])
    batch = SharedPrefixCollator(pad_token_id=PAD)(rows)
    assert batch["prefix_ids"].tolist() == [[5, 6, 7, 8, 9]]  # the rows also share the query's first token
    assert batch["input_ids"].tolist() == [[10, 11, 12], [13, 14, 15]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 11, 12], [IGNORE_INDEX, IGNORE_INDEX, 15]]
    # The same answer in two rows: the cut stops before the logit of the first target.
    same = rows_with_prefix([5, 6], [([7], [8, 9]), ([7], [8, 9])])
    assert SharedPrefixCollator(pad_token_id=PAD)(same)["prefix_ids"].tolist() == [[5, 6]]
    unrelated = [{"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3]},
                 {"input_ids": [4, 2, 3], "labels": [IGNORE_INDEX, 2, 3]}]
    batch = SharedPrefixCollator(pad_token_id=PAD)(unrelated)
    assert "prefix_ids" not in batch and batch["input_ids"].tolist() == [[1, 2, 3], [4, 2, 3]]
    # Labelled from the first token (plain language modelling): nothing before it to cut.
    whole = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]},
             {"input_ids": [5, 6, 9], "labels": [IGNORE_INDEX, 6, 9]}]
    batch = SharedPrefixCollator(pad_token_id=PAD)(whole)
    assert "prefix_ids" not in batch
    assert batch["input_ids"].tolist() == NeedlePaddingCollator(pad_token_id=PAD)(whole)["input_ids"].tolist()
    with pytest.raises(FinetuneDataError, match=r"rows\[1\]"):
        SharedPrefixCollator(pad_token_id=PAD)([unrelated[0], {"input_ids": [1, 2], "labels": [1]}])


@given(keys=st.lists(st.sampled_from("abc"), min_size=1, max_size=40), batch_size=st.integers(1, 6),
       seed=st.integers(0, 3))
def test_sampler_draws_each_row_once_per_epoch_from_one_group_per_batch(keys, batch_size, seed):
    sampler = PrefixGroupedBatchSampler(keys, batch_size=batch_size, seed=seed)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert sorted(i for batch in batches for i in batch) == list(range(len(keys)))
        assert all(1 <= len(batch) <= batch_size and len({keys[i] for i in batch}) == 1 for batch in batches)
        epochs.append(batches)
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # the order is a function of seed and epoch


def test_sampler_and_key_refuse_bad_input():
    with pytest.raises(ValueError, match="batch_size"):
        PrefixGroupedBatchSampler(["a"], batch_size=0)
    with pytest.raises(FinetuneDataError, match=r"keys\[1\]"):
        PrefixGroupedBatchSampler(["a", ["unhashable"]], batch_size=2)
    with pytest.raises(FinetuneDataError, match="messages"):
        conversation_prefix_key({"tools": "[]"})
    same_prompt = conversation_prefix_key({"tools": "[1]", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "one"}]})
    assert same_prompt == conversation_prefix_key({"tools": "[1]", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "two"}]})
    assert same_prompt != conversation_prefix_key({"tools": "[2]", "messages": [{"role": "system", "content": "s"}]})


def test_needle_trainer_trains_with_shared_prefix_batches(tmp_path):
    model = perturbed_model(seed=1)
    generator = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(1, 256, (20,), generator=generator).tolist() for _ in range(2)]
    rows, keys = [], []
    for index in range(24):
        query = torch.randint(1, 256, (3,), generator=generator).tolist()
        rows += rows_with_prefix(prefixes[index % 2], [(query, [query[0], query[1]])])  # answer copies the query
        keys.append(index % 2)
    before = NeedleTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    padded = NeedlePaddingCollator(pad_token_id=PAD)(rows)
    with torch.no_grad():
        start = before.compute_loss(model, padded).item()
    trainer = NeedleTrainer(
        model=model,
        args=TrainingArguments(output_dir=str(tmp_path), max_steps=30, learning_rate=3e-3, report_to=[],
                               save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no"),
        train_dataset=rows, data_collator=SharedPrefixCollator(pad_token_id=PAD),
        train_batch_sampler=PrefixGroupedBatchSampler(keys, batch_size=6, seed=0),
    )
    seen = []
    collate = trainer.data_collator
    trainer.data_collator = lambda batch: seen.append(collate(batch)) or seen[-1]
    trainer.train()
    assert all(batch["prefix_ids"].shape[1] >= 20 and batch["input_ids"].shape[0] == 6 for batch in seen)
    with torch.no_grad():
        assert trainer.compute_loss(model, padded).item() < 0.5 * start
    with pytest.raises(ValueError, match="one key per training row"):
        NeedleTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                      train_dataset=rows[:5], data_collator=SharedPrefixCollator(pad_token_id=PAD),
                      train_batch_sampler=PrefixGroupedBatchSampler(keys, batch_size=6)).get_train_dataloader()
    with pytest.raises(ValueError, match="next-token loss only"):
        NeedleTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]),
                      mtp_loss_weight=0.5).compute_loss(model, SharedPrefixCollator(pad_token_id=PAD)(rows[0:4:2]))
