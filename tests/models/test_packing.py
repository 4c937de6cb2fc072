"""Packed (padding-free) batches and custom 4-D attention masks on the PyTorch model.

A packed row (TRL's ``padding_free=True``, `DataCollatorWithFlattening`: position_ids restarting at 0,
no attention_mask, optionally ``cu_seq_lens_*``) gives each sequence the logits, MTP logits, loss and
gradients it has in a padded batch; a 4-D mask gives what its 2-D equivalent gives, and a mask under
which the engram would read tokens its query does not see is refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.finetune.trainer import needle_causal_lm_loss
from needle_hf.models.needle.modeling_needle import CACHE_OUTPUT_FIELD, NeedleForCausalLM

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread

# Two engram sites, three layers: a sequence longer than the engram's reach (11) exercises every tap.
TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            max_position_embeddings=128, engram_layers=(0, 2), engram_slots=64)
TOLERANCE = 1e-5  # float32
VOCAB = TINY["vocab_size"]


def perturbed_model(attn_implementation: str, seed: int = 0) -> NeedleForCausalLM:
    """A float32 tiny model with every parameter moved off its initial value (norms, gates, taps too)."""
    torch.manual_seed(seed)
    model = NeedleForCausalLM._from_config(NeedleConfig(**TINY), attn_implementation=attn_implementation)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def model(request) -> NeedleForCausalLM:
    return perturbed_model(request.param)


def padded_and_packed(sequences: list[torch.Tensor]) -> tuple[dict, dict]:
    """The same sequences as a right-padded batch (input_ids, attention_mask) and as one packed row
    (input_ids, position_ids restarting at 0), each with labels (-100 on padding / first tokens)."""
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    packed_ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    packed_labels = packed_ids.masked_fill(positions == 0, -100)
    return (dict(input_ids=ids, attention_mask=mask, labels=labels),
            dict(input_ids=packed_ids, position_ids=positions, labels=packed_labels))


def unpack(packed: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(packed[0].split(lengths))


def random_sequences(lengths: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def test_packed_row_gives_each_sequence_its_padded_logits_and_mtp_logits(model):
    lengths = [13, 5, 20, 1, 2]
    padded, packed = padded_and_packed(random_sequences(lengths, seed=0))
    with torch.no_grad():
        expected = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], return_mtp_logits=True)
        found = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], return_mtp_logits=True)
    for row, (logits, mtp_logits) in enumerate(zip(unpack(found.logits, lengths), unpack(found.mtp_logits, lengths))):
        n = lengths[row]
        torch.testing.assert_close(logits, expected.logits[row, :n], rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(mtp_logits, expected.mtp_logits[row, :n], rtol=0, atol=TOLERANCE)


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_packing_is_the_padded_batch_for_any_lengths(lengths, seed):
    model = PROPERTY_MODEL
    padded, packed = padded_and_packed(random_sequences(lengths, seed))
    with torch.no_grad():
        expected = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        found = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
    for row, logits in enumerate(unpack(found, lengths)):
        torch.testing.assert_close(logits, expected[row, : lengths[row]], rtol=0, atol=TOLERANCE)


PROPERTY_MODEL = perturbed_model("sdpa", seed=1)


def test_a_sequence_reads_nothing_of_the_sequence_packed_before_it(model):
    """The engram's n-grams and conv taps reach 11 tokens back: changing every token of the first
    sequence leaves the second's logits as they are (its start looks like the start of a text)."""
    first, second = random_sequences([16, 14], seed=3)
    positions = torch.cat([torch.arange(16), torch.arange(14)])[None]
    with torch.no_grad():
        one = model(input_ids=torch.cat([first, second])[None], position_ids=positions).logits[0, 16:]
        other = model(input_ids=torch.cat([(first + 7) % VOCAB + 1, second])[None], position_ids=positions).logits[0, 16:]
        alone = model(input_ids=second[None]).logits[0]
    torch.testing.assert_close(one, other, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(one, alone, rtol=0, atol=TOLERANCE)


def test_packed_loss_and_gradients_equal_the_padded_batch():
    lengths = [9, 17, 4]
    padded, packed = padded_and_packed(random_sequences(lengths, seed=4))
    results = []
    for batch in (padded, packed):
        model = perturbed_model("sdpa").train()
        model.mtp.requires_grad_(True)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        outputs = model(**inputs, return_mtp_logits=True)
        loss = needle_causal_lm_loss(outputs.logits, batch["labels"], mtp_logits=outputs.mtp_logits,
                                     mtp_loss_weight=0.5, position_ids=batch.get("position_ids"))
        labels_loss = model(**batch).loss  # the model's own loss (transformers' ForCausalLMLoss)
        loss.backward()
        results.append((loss.detach(), labels_loss.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, own_a, grads_a), (loss_b, own_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(own_b, own_a, rtol=0, atol=TOLERANCE)
    assert grads_a.keys() == grads_b.keys() and "mtp.combine_proj.weight" in grads_a
    for name, grad in grads_a.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert float((grads_b[name] - grad).abs().max() / scale) < 1e-4, name


def test_flattening_collator_batches_with_cu_seq_lens_are_packed_rows(model):
    """`DataCollatorWithFlattening` with the varlen kwargs (cu_seq_lens_q/k, max_length_q/k, seq_idx
    on 5.x): the model takes the batch as the collator makes it."""
    from transformers import DataCollatorWithFlattening

    lengths = [7, 12, 3]
    sequences = random_sequences(lengths, seed=5)
    options = dict(return_flash_attn_kwargs=True)
    collator = DataCollatorWithFlattening(**options, return_tensors="pt")
    batch = collator([{"input_ids": s.tolist()} for s in sequences])
    assert "attention_mask" not in batch and "cu_seq_lens_q" in batch
    padded, packed = padded_and_packed(sequences)
    with torch.no_grad():
        found = model(**batch).logits
        expected = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        # The boundaries alone decide: the same row with positions 0..S-1 and cu_seq_lens_q.
        by_boundaries = model(input_ids=batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"],
                              cu_seq_lens_k=batch["cu_seq_lens_k"]).logits
    torch.testing.assert_close(found, expected, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(by_boundaries, expected, rtol=0, atol=TOLERANCE)
    assert torch.equal(batch["labels"], packed["labels"])


def test_inconsistent_boundaries_are_refused(model):
    ids = torch.randint(1, VOCAB, (1, 10))
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must rise from 0 to the row length 10"):
        model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 9]), cu_seq_lens_k=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal cu_seq_lens_q"):
        model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 10]), cu_seq_lens_k=torch.tensor([0, 5, 10]))
    with pytest.raises(ValueError, match="without attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cu_seq_lens_q=torch.tensor([0, 4, 10]))


# --------------------------------------------------------------------------------------------------
# Custom 4-D masks


def causal_4d(mask_2d: torch.Tensor, past: int = 0) -> torch.Tensor:
    """The boolean [B, 1, S, past + S] mask equivalent to a 2-D padding mask [B, past + S]."""
    keys = mask_2d.shape[1]
    queries = torch.arange(past, keys)
    causal = torch.arange(keys)[None, :] <= queries[:, None]  # [S, K]
    return (causal[None] & mask_2d.bool()[:, None, :])[:, None]


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_4d_mask_gives_the_logits_of_its_2d_equivalent(model, kind):
    ids = torch.randint(1, VOCAB, (3, 18), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, 12:] = 0  # right padding
    mask_4d = causal_4d(mask)
    if kind == "additive":
        mask_4d = torch.zeros(mask_4d.shape).masked_fill(~mask_4d, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, return_mtp_logits=True)
        found = model(input_ids=ids, attention_mask=mask_4d, return_mtp_logits=True)
    real = mask.bool()
    torch.testing.assert_close(found.logits[real], expected.logits[real], rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(found.mtp_logits[real], expected.mtp_logits[real], rtol=0, atol=TOLERANCE)


def test_4d_mask_decoding_step_over_a_cache_gives_the_2d_steps_logits(model):
    from transformers import DynamicCache

    ids = torch.randint(1, VOCAB, (2, 15), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    results = []
    for as_4d in (False, True):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids[:, :12], attention_mask=mask[:, :12], **{CACHE_OUTPUT_FIELD: cache}, use_cache=True)
            step_mask = causal_4d(mask, past=12) if as_4d else mask
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, 12:]
            results.append(model(input_ids=ids[:, 12:], attention_mask=step_mask, position_ids=positions,
                                 **{CACHE_OUTPUT_FIELD: cache}, use_cache=True).logits)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=TOLERANCE)


def test_block_diagonal_4d_mask_is_the_packed_row(model):
    lengths = [8, 13]
    _, packed = padded_and_packed(random_sequences(lengths, seed=8))
    segments = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))
    block = (segments[:, None] == segments[None, :]) & torch.ones(21, 21, dtype=torch.bool).tril()
    with torch.no_grad():
        expected = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        found = model(input_ids=packed["input_ids"], attention_mask=block[None, None],
                      position_ids=packed["position_ids"]).logits
    torch.testing.assert_close(found, expected, rtol=0, atol=TOLERANCE)


def test_shared_prefix_mask_is_refused_where_the_engram_would_read_a_sibling(model):
    """transformers' shared-prefix batch: three endings after one prefix, each ending seeing the prefix
    but not the endings before it. The engram of the third ending would hash the second ending's token
    as its predecessor, so the mask has no Needle meaning."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    allowed = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(1, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with pytest.raises(ValueError, match=r"query 4 of row 0 sees .* but not a real token between them"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]]))


def test_4d_masks_of_other_kinds_are_refused_with_what_was_expected(model):
    ids = torch.randint(1, VOCAB, (1, 6))
    allowed = causal_4d(torch.ones_like(ids))
    with pytest.raises(ValueError, match="must be boolean .* or additive float"):
        model(input_ids=ids, attention_mask=allowed.long())
    with pytest.raises(ValueError, match="no additive attention biases"):
        model(input_ids=ids, attention_mask=allowed.float() * 0.5)
    with pytest.raises(ValueError, match=r"expected shape \(1, 1, 6, 6\)"):
        model(input_ids=ids, attention_mask=allowed[:, :, :, :5].expand(1, 1, 6, 5).transpose(2, 3))


def test_trl_sft_trainer_padding_free_loss_equals_the_padded_loss(tmp_path, demo_tokenizer):
    """TRL's `SFTTrainer(padding_free=True)` on the demo data: the batch of the same examples gives the
    padded batch's loss, through TRL's own loss and through `NeedleSFTTrainer`'s, and a short run trains."""
    from trl import SFTConfig, SFTTrainer

    from needle_hf.demo.data import make_demo_examples
    from needle_hf.finetune.data import conversations_dataset
    from needle_hf.finetune.trainer_trl import NeedleSFTTrainer

    dataset = conversations_dataset(make_demo_examples(6, seed=1))
    config = NeedleConfig(**dict(TINY, vocab_size=demo_tokenizer.vocab_size if hasattr(demo_tokenizer, "vocab_size")
                                 else len(demo_tokenizer), max_position_embeddings=512))
    losses = {}
    for trainer_class in (SFTTrainer, NeedleSFTTrainer):
        for padding_free in (False, True):
            torch.manual_seed(0)
            model = NeedleForCausalLM(config)
            args = SFTConfig(output_dir=str(tmp_path / f"{trainer_class.__name__}-{padding_free}"), report_to=[],
                             per_device_train_batch_size=6, max_steps=2, learning_rate=1e-3, bf16=False,
                             assistant_only_loss=True, max_length=None, padding_free=padding_free,
                             use_cpu=True, save_strategy="no", logging_steps=1)
            trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=demo_tokenizer)
            rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
            batch = trainer.data_collator(rows)
            assert ("attention_mask" in batch) is not padding_free
            model.eval()
            with torch.no_grad():
                losses[trainer_class.__name__, padding_free] = float(trainer.compute_loss(model, dict(batch)))
            if padding_free:
                model.train()
                trainer.train()
                assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)
    for name in ("SFTTrainer", "NeedleSFTTrainer"):
        assert abs(losses[name, True] - losses[name, False]) <= TOLERANCE, losses


def test_attention_probabilities_of_a_packed_row_stay_within_each_sequence():
    """Asked for attention probabilities, a packed row attends over its own [S, S] mask (not over its
    sequences laid out one per row): the same logits, and no weight across a boundary."""
    model = perturbed_model("eager")
    lengths = [6, 9]
    _, packed = padded_and_packed(random_sequences(lengths, seed=9))
    with torch.no_grad():
        laid_out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        dense = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], output_attentions=True)
    torch.testing.assert_close(dense.logits, laid_out, rtol=0, atol=TOLERANCE)
    for probabilities in dense.attentions:
        assert probabilities.shape == (1, TINY["num_attention_heads"], 15, 15)
        assert float(probabilities[..., 6:, :6].abs().max()) == 0.0
