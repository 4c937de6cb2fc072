"""Fine-tuning the Flax model with optax: its loss and LoRA gradients equal the reference's and the
PyTorch model's on the same batch, and jit train steps (LoRA and full) lower the held-out loss."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from finetune_support import (  # noqa: F401  (fast_tokenizer, parity_case: fixtures)
    EXAMPLES,
    FINETUNE_NATIVE_CONFIG,
    GRADIENT_TOLERANCE,
    HF_PROJECTION,
    LOSS_TOLERANCE,
    PARITY_ALPHA,
    PARITY_MTP_LOSS_WEIGHT,
    PARITY_RANK,
    fast_tokenizer,
    max_relative_difference,
    parity_case,
    peft_model_with_the_parity_adapter,
)
from flax_support import write_hf_folder

from needle_hf.demo.data import make_demo_examples
from needle_hf.finetune.data import NeedlePaddingCollator, conversations_dataset, tokenize_conversations
from needle_hf.finetune.trainer_flax import finetune_optimizer, init_lora, make_loss_function, make_train_step
from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM
from needle_hf.models.needle.tokenization_needle import PAD_ID

RANK, ALPHA = PARITY_RANK, PARITY_ALPHA
MTP_LOSS_WEIGHT = PARITY_MTP_LOSS_WEIGHT


@pytest.fixture(scope="module")
def flax_model(parity_case, tmp_path_factory):
    folder = tmp_path_factory.mktemp("finetune_flax")
    write_hf_folder(folder, FINETUNE_NATIVE_CONFIG, parity_case["params"])
    return FlaxNeedleForCausalLM.from_pretrained(folder)


def numpy_batch(fast_tokenizer, examples, *, pad_to_multiple_of=1):
    rows = tokenize_conversations(conversations_dataset(examples), fast_tokenizer)
    collate = NeedlePaddingCollator(pad_token_id=PAD_ID, return_tensors="np", pad_to_multiple_of=pad_to_multiple_of)
    return collate(list(rows))


def flax_layout(lora: dict) -> dict:
    """Reference adapter (layers stacked) -> per-layer Flax paths."""
    return {("model", "layers", str(layer), "self_attn", HF_PROJECTION[path[-2]], "kernel"):
            {"A": ab["A"][layer], "B": ab["B"][layer]}
            for path, ab in lora.items() for layer in range(ab["A"].shape[0])}


def reference_layout(grads: dict, lora: dict) -> dict:
    return {path: {m: np.stack([np.asarray(grads[("model", "layers", str(layer), "self_attn",
                                                  HF_PROJECTION[path[-2]], "kernel")][m])
                                for layer in range(ab["A"].shape[0])]) for m in ("A", "B")}
            for path, ab in lora.items()}


def test_flax_loss_and_lora_gradients_equal_the_reference_and_pytorch(flax_model, parity_case, fast_tokenizer):
    from needle_hf.finetune.trainer import needle_causal_lm_loss

    lora = parity_case["lora"]
    batch = numpy_batch(fast_tokenizer, EXAMPLES)
    assert (batch["input_ids"] == parity_case["ids"]).all()
    expected_loss = parity_case["next_token_loss"] + MTP_LOSS_WEIGHT * parity_case["mtp_loss"]

    loss_fn = make_loss_function(flax_model, lora_scale=ALPHA / RANK, mtp_loss_weight=MTP_LOSS_WEIGHT)
    loss, grads = jax.value_and_grad(loss_fn)(jax.tree.map(np.asarray, flax_layout(lora)), flax_model.params, batch)
    assert abs(float(loss) - expected_loss) <= LOSS_TOLERANCE
    assert max_relative_difference(reference_layout(grads, lora), parity_case["gradients"]) <= GRADIENT_TOLERANCE

    peft_model = peft_model_with_the_parity_adapter(parity_case)
    torch_batch = {k: torch.from_numpy(v) for k, v in batch.items()}
    with torch.no_grad():
        outputs = peft_model(input_ids=torch_batch["input_ids"], attention_mask=torch_batch["attention_mask"],
                             return_mtp_logits=True)
    torch_loss = needle_causal_lm_loss(outputs.logits, torch_batch["labels"], mtp_logits=outputs.mtp_logits,
                                       mtp_loss_weight=MTP_LOSS_WEIGHT)
    assert abs(float(loss) - torch_loss.item()) <= LOSS_TOLERANCE


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_jit_train_steps_lower_the_held_out_loss(flax_model, fast_tokenizer, mode):
    # One padded length for every batch: one compile of the train step.
    batches = [numpy_batch(fast_tokenizer, make_demo_examples(8, seed=100 + i), pad_to_multiple_of=256)
               for i in range(6)]
    held_out = numpy_batch(fast_tokenizer, make_demo_examples(16, seed=2), pad_to_multiple_of=256)
    params = flax_model.params
    lora_scale = ALPHA / RANK if mode == "lora" else None
    trainable = init_lora(params, rank=RANK, key=jax.random.PRNGKey(0)) if mode == "lora" else params
    optimizer = finetune_optimizer(learning_rate=1e-2 if mode == "lora" else 3e-3, total_steps=len(batches))
    step = make_train_step(flax_model, optimizer, lora_scale=lora_scale, mtp_loss_weight=MTP_LOSS_WEIGHT)
    evaluate = jax.jit(make_loss_function(flax_model, lora_scale=lora_scale, mtp_loss_weight=MTP_LOSS_WEIGHT))
    before = float(evaluate(trainable, params, held_out))
    state = optimizer.init(trainable)
    for batch in batches:
        trainable, state, loss = step(trainable, state, params, batch)
    after = float(evaluate(trainable, params, held_out))
    assert np.isfinite(float(loss)) and after < before - 0.1, (before, after)


def test_bad_flax_finetuning_options_are_refused_naming_them(flax_model):
    import jax

    for call, problem in [
        (lambda: init_lora(flax_model.params, rank=0, key=jax.random.PRNGKey(0)), r"rank: expected an int >= 1, found 0"),
        (lambda: finetune_optimizer(learning_rate=float("nan"), total_steps=10), r"learning_rate: expected a finite number > 0"),
        (lambda: finetune_optimizer(learning_rate=1e-3, total_steps=0), r"total_steps: expected an int >= 1, found 0"),
        (lambda: finetune_optimizer(learning_rate=1e-3, total_steps=10, weight_decay=-1), r"weight_decay: expected"),
        (lambda: make_loss_function(flax_model, lora_scale=float("inf")), r"lora_scale: expected a finite number"),
        (lambda: make_train_step(flax_model, None, lora_scale=None, mtp_loss_weight=-0.5), r"mtp_loss_weight: expected"),
    ]:
        with pytest.raises(ValueError, match=problem):
            call()
