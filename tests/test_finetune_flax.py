"""Fine-tuning the Flax model with optax: its loss and LoRA gradients equal the reference's and the
PyTorch model's on the same batch, and jit train steps (LoRA and full) lower the held-out loss."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from finetune_support import (
    EXAMPLES,
    FINETUNE_NATIVE_CONFIG,
    load_adapter_into_peft,
    max_relative_difference,
    reference_adapter,
    reference_finetune_loss,
)
from flax_support import write_hf_folder
from needle.model.finetune import _encode
from needle.model.tokenizer import SANTokenizer
from needle_reference import make_native_params

from needle_hf.demo_data import make_demo_examples
from needle_hf.finetune_data import NeedlePaddingCollator, conversations_dataset, tokenize_conversations
from needle_hf.finetune_flax import finetune_optimizer, init_lora, make_loss_function, make_train_step
from needle_hf.modeling_flax_needle import FlaxNeedleForCausalLM
from needle_hf.tokenization_needle import PAD_ID, build_fast_tokenizer

RANK, ALPHA = 4, 8.0
MTP_LOSS_WEIGHT = 0.5


@pytest.fixture(scope="module")
def fast_tokenizer(needle_spm_model):
    return build_fast_tokenizer(needle_spm_model)


@pytest.fixture(scope="module")
def native_params():
    return make_native_params(FINETUNE_NATIVE_CONFIG, seed=3, with_heads=False)


@pytest.fixture(scope="module")
def flax_model(native_params, tmp_path_factory):
    folder = tmp_path_factory.mktemp("finetune_flax")
    write_hf_folder(folder, FINETUNE_NATIVE_CONFIG, native_params)
    return FlaxNeedleForCausalLM.from_pretrained(folder)


def numpy_batch(fast_tokenizer, examples):
    rows = tokenize_conversations(conversations_dataset(examples), fast_tokenizer)
    return NeedlePaddingCollator(pad_token_id=PAD_ID, return_tensors="np")(list(rows))


def flax_layout(lora: dict) -> dict:
    """Reference adapter (layers stacked) -> per-layer Flax paths."""
    from finetune_support import HF_PROJECTION

    return {("model", "layers", str(layer), "self_attn", HF_PROJECTION[path[-2]], "kernel"):
            {"A": ab["A"][layer], "B": ab["B"][layer]}
            for path, ab in lora.items() for layer in range(ab["A"].shape[0])}


def reference_layout(grads: dict, lora: dict) -> dict:
    from finetune_support import HF_PROJECTION

    return {path: {m: np.stack([np.asarray(grads[("model", "layers", str(layer), "self_attn",
                                                  HF_PROJECTION[path[-2]], "kernel")][m])
                                for layer in range(ab["A"].shape[0])]) for m in ("A", "B")}
            for path, ab in lora.items()}


def test_flax_loss_and_lora_gradients_equal_the_reference_and_pytorch(
        flax_model, native_params, fast_tokenizer, needle_spm_model):
    from peft import get_peft_model

    from needle_hf.configuration_needle import NeedleConfig
    from needle_hf.finetune_torch import needle_causal_lm_loss, needle_lora_config
    from needle_hf.modeling_needle import NeedleForCausalLM
    from needle_hf.weight_names import native_to_hf

    lora = reference_adapter(native_params, rank=RANK, seed=5)
    batch = numpy_batch(fast_tokenizer, EXAMPLES)
    length = batch["input_ids"].shape[1]
    encoded = [_encode(SANTokenizer(needle_spm_model), example, length) for example in EXAMPLES]
    expected_loss, expected_grads = reference_finetune_loss(
        FINETUNE_NATIVE_CONFIG, native_params, lora, scale=ALPHA / RANK,
        ids=np.array([e[0] for e in encoded]), mask=np.array([e[1] for e in encoded], np.float32),
        mtp_loss_weight=MTP_LOSS_WEIGHT)

    loss_fn = make_loss_function(flax_model, lora_scale=ALPHA / RANK, mtp_loss_weight=MTP_LOSS_WEIGHT)
    loss, grads = jax.value_and_grad(loss_fn)(jax.tree.map(np.asarray, flax_layout(lora)), flax_model.params, batch)
    assert abs(float(loss) - expected_loss) <= 1e-5
    assert max_relative_difference(reference_layout(grads, lora), expected_grads) <= 1e-4

    config = NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG)
    torch_model = NeedleForCausalLM._from_config(config, torch_dtype=torch.float32)
    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(native_params, config).items()})
    peft_model = get_peft_model(torch_model, needle_lora_config(rank=RANK, alpha=ALPHA))
    load_adapter_into_peft(peft_model, lora)
    torch_batch = {k: torch.from_numpy(v) for k, v in batch.items()}
    with torch.no_grad():
        outputs = peft_model(input_ids=torch_batch["input_ids"], attention_mask=torch_batch["attention_mask"],
                             return_mtp_logits=True)
    torch_loss = needle_causal_lm_loss(outputs.logits, torch_batch["labels"], mtp_logits=outputs.mtp_logits,
                                       mtp_loss_weight=MTP_LOSS_WEIGHT)
    assert abs(float(loss) - torch_loss.item()) <= 1e-5


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_jit_train_steps_lower_the_held_out_loss(flax_model, fast_tokenizer, mode):
    batches = [numpy_batch(fast_tokenizer, make_demo_examples(8, seed=100 + i)) for i in range(6)]
    held_out = numpy_batch(fast_tokenizer, make_demo_examples(16, seed=2))
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
