"""Fine-tuning the PyTorch model: the loss and LoRA gradients equal the reference's, and PEFT LoRA
trains with `Trainer` and TRL's `SFTTrainer` (assistant-only loss) to a lower held-out loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from finetune_support import (
    EXAMPLES,
    FINETUNE_NATIVE_CONFIG,
    load_adapter_into_peft,
    max_relative_difference,
    peft_gradients,
    reference_adapter,
    reference_finetune_loss,
)
from needle.model.finetune import _encode
from needle.model.tokenizer import SANTokenizer
from needle_reference import make_native_params
from peft import get_peft_model
from transformers import TrainingArguments

from needle_hf.configuration_needle import NeedleConfig
from needle_hf.demo_data import make_demo_examples
from needle_hf.finetune_data import NeedlePaddingCollator, conversations_dataset, tokenize_conversations
from needle_hf.finetune_torch import NeedleTrainer, needle_causal_lm_loss, needle_lora_config
from needle_hf.modeling_needle import NeedleForCausalLM
from needle_hf.tokenization_needle import PAD_ID, build_fast_tokenizer
from needle_hf.weight_names import native_to_hf

RANK, ALPHA = 4, 8.0
LOSS_TOLERANCE = 1e-5  # absolute, float32
GRADIENT_TOLERANCE = 1e-4  # relative to the largest gradient of each tensor


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def fast_tokenizer(needle_spm_model):
    return build_fast_tokenizer(needle_spm_model)


@pytest.fixture(scope="module")
def native_params():
    return make_native_params(FINETUNE_NATIVE_CONFIG, seed=3, with_heads=False)


def torch_model(params) -> NeedleForCausalLM:
    config = NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG)
    model = NeedleForCausalLM._from_config(config, torch_dtype=torch.float32)
    model.load_state_dict({name: torch.from_numpy(value) for name, value in native_to_hf(params, config).items()})
    return model


def hf_batch(fast_tokenizer, examples):
    rows = tokenize_conversations(conversations_dataset(examples), fast_tokenizer)
    return NeedlePaddingCollator(pad_token_id=PAD_ID)(list(rows))


@pytest.mark.parametrize("mtp_loss_weight", [0.0, 0.5])
def test_loss_and_lora_gradients_equal_the_reference(native_params, fast_tokenizer, needle_spm_model, mtp_loss_weight):
    lora = reference_adapter(native_params, rank=RANK, seed=5)
    batch = hf_batch(fast_tokenizer, EXAMPLES)
    length = batch["input_ids"].shape[1]
    encoded = [_encode(SANTokenizer(needle_spm_model), example, length) for example in EXAMPLES]
    ids, mask = np.array([e[0] for e in encoded]), np.array([e[1] for e in encoded], np.float32)
    assert (ids == batch["input_ids"].numpy()).all()
    expected_loss, expected_grads = reference_finetune_loss(
        FINETUNE_NATIVE_CONFIG, native_params, lora, scale=ALPHA / RANK, ids=ids, mask=mask,
        mtp_loss_weight=mtp_loss_weight)

    model = get_peft_model(torch_model(native_params), needle_lora_config(rank=RANK, alpha=ALPHA))
    load_adapter_into_peft(model, lora)
    trainer = NeedleTrainer(model=model, args=TrainingArguments(output_dir="unused", report_to=[]),
                            mtp_loss_weight=mtp_loss_weight)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    assert abs(loss.item() - expected_loss) <= LOSS_TOLERANCE
    assert max_relative_difference(peft_gradients(model, lora), expected_grads) <= GRADIENT_TOLERANCE


def test_lora_targets_only_the_five_backbone_projections(native_params):
    model = get_peft_model(torch_model(native_params), needle_lora_config(rank=RANK, alpha=ALPHA))
    adapted = {name.split(".lora_A")[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    layers = FINETUNE_NATIVE_CONFIG["num_layers"]
    assert adapted == {f"base_model.model.model.layers.{i}.self_attn.{p}"
                       for i in range(layers) for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj")}
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_loss_without_mtp_is_the_models_labels_loss(native_params, fast_tokenizer):
    model = torch_model(native_params)
    batch = hf_batch(fast_tokenizer, EXAMPLES[:3])
    outputs = model(**batch)
    assert torch.allclose(needle_causal_lm_loss(outputs.logits, batch["labels"]), outputs.loss, atol=1e-6)


def held_out_loss(trainer, dataset) -> float:
    return trainer.evaluate(dataset)["eval_loss"]


def training_arguments(tmp_path, **overrides):
    return dict(output_dir=str(tmp_path), per_device_train_batch_size=8, per_device_eval_batch_size=16,
                max_steps=8, learning_rate=1e-2, warmup_steps=1, lr_scheduler_type="cosine", max_grad_norm=1.0,
                logging_steps=4, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                dataloader_num_workers=0, seed=0, **overrides)


def test_peft_lora_with_trainer_lowers_the_held_out_loss(tmp_path, fast_tokenizer):
    torch.manual_seed(0)
    model = get_peft_model(NeedleForCausalLM(NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG)),
                           needle_lora_config(rank=8, alpha=16.0))
    train = tokenize_conversations(conversations_dataset(make_demo_examples(64, seed=1)), fast_tokenizer)
    held_out = tokenize_conversations(conversations_dataset(make_demo_examples(16, seed=2)), fast_tokenizer)
    trainer = NeedleTrainer(
        model=model, args=TrainingArguments(**training_arguments(tmp_path), remove_unused_columns=False,
                                            label_names=["labels"]),
        train_dataset=train, data_collator=NeedlePaddingCollator(pad_token_id=PAD_ID), mtp_loss_weight=0.3)
    before = held_out_loss(trainer, held_out)
    trainer.train()
    after = held_out_loss(trainer, held_out)
    assert after < before - 0.1, (before, after)


def test_trl_sft_trainer_with_assistant_only_loss_lowers_the_held_out_loss(tmp_path, fast_tokenizer):
    from trl import SFTConfig

    from needle_hf.finetune_trl import NeedleSFTTrainer

    torch.manual_seed(0)
    model = NeedleForCausalLM(NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG))
    train = conversations_dataset(make_demo_examples(64, seed=1))
    held_out = conversations_dataset(make_demo_examples(16, seed=2))
    # Needle does not support gradient checkpointing yet; SFTConfig turns it on by default.
    args = SFTConfig(**training_arguments(tmp_path), assistant_only_loss=True, gradient_checkpointing=False,
                     max_length=None)
    trainer = NeedleSFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                               processing_class=fast_tokenizer, peft_config=needle_lora_config(rank=8, alpha=16.0))
    # TRL's labels come from the template's generation mask: the reference's target and EOS.
    first = trainer.train_dataset[0]
    expected = tokenize_conversations(train.select([0]), fast_tokenizer)[0]
    assert first["input_ids"] == expected["input_ids"] and first["labels"] == expected["labels"]
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < before - 0.1, (before, after)
