"""Fine-tuning the PyTorch model: the loss and LoRA gradients equal the reference's, and PEFT LoRA
trains with `Trainer` and TRL's `SFTTrainer` (assistant-only loss) to a lower held-out loss."""

from __future__ import annotations

import pytest
import torch
from finetune_support import (  # noqa: F401  (fast_tokenizer, parity_case: fixtures)
    EXAMPLES,
    FINETUNE_NATIVE_CONFIG,
    GRADIENT_TOLERANCE,
    LOSS_TOLERANCE,
    PARITY_ALPHA,
    PARITY_MTP_LOSS_WEIGHT,
    PARITY_RANK,
    fast_tokenizer,
    max_relative_difference,
    parity_case,
    peft_gradients,
    peft_model_with_the_parity_adapter,
    torch_model_of,
)
from peft import get_peft_model
from transformers import TrainingArguments

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.demo.data import make_demo_examples
from needle_hf.finetune.data import NeedlePaddingCollator, conversations_dataset, tokenize_conversations
from needle_hf.finetune.trainer import NeedleTrainer, needle_causal_lm_loss, needle_lora_config
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.tokenization_needle import PAD_ID

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]  # conftest: torch on one thread


def hf_batch(fast_tokenizer, examples):
    rows = tokenize_conversations(conversations_dataset(examples), fast_tokenizer)
    return NeedlePaddingCollator(pad_token_id=PAD_ID)(list(rows))


def test_loss_and_lora_gradients_equal_the_reference(parity_case, fast_tokenizer):
    model = peft_model_with_the_parity_adapter(parity_case)
    batch = hf_batch(fast_tokenizer, EXAMPLES)
    assert (batch["input_ids"].numpy() == parity_case["ids"]).all()
    trainer = NeedleTrainer(model=model, args=TrainingArguments(output_dir="unused", report_to=[]),
                            mtp_loss_weight=PARITY_MTP_LOSS_WEIGHT)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    expected = parity_case["next_token_loss"] + PARITY_MTP_LOSS_WEIGHT * parity_case["mtp_loss"]
    assert abs(loss.item() - expected) <= LOSS_TOLERANCE
    assert max_relative_difference(peft_gradients(model, parity_case["lora"]), parity_case["gradients"]) <= GRADIENT_TOLERANCE

    with torch.no_grad():
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], return_mtp_logits=True)
    next_token = needle_causal_lm_loss(outputs.logits, batch["labels"])
    mtp = (needle_causal_lm_loss(outputs.logits, batch["labels"], mtp_logits=outputs.mtp_logits, mtp_loss_weight=1.0)
           - next_token)
    assert abs(next_token.item() - parity_case["next_token_loss"]) <= LOSS_TOLERANCE
    assert abs(mtp.item() - parity_case["mtp_loss"]) <= LOSS_TOLERANCE


def test_lora_targets_only_the_five_backbone_projections(parity_case):
    model = get_peft_model(torch_model_of(parity_case["params"]), needle_lora_config(rank=PARITY_RANK, alpha=PARITY_ALPHA))
    adapted = {name.split(".lora_A")[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    layers = FINETUNE_NATIVE_CONFIG["num_layers"]
    assert adapted == {f"base_model.model.model.layers.{i}.self_attn.{p}"
                       for i in range(layers) for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj")}
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_loss_without_mtp_is_the_models_labels_loss(parity_case, fast_tokenizer):
    model = torch_model_of(parity_case["params"])
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

    from needle_hf.finetune.trainer_trl import NeedleSFTTrainer

    torch.manual_seed(0)
    model = NeedleForCausalLM(NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG))
    train = conversations_dataset(make_demo_examples(64, seed=1))
    held_out = conversations_dataset(make_demo_examples(16, seed=2))
    # SFTConfig's defaults (gradient checkpointing on), float32 as the reference trains (no bf16 on a CPU).
    args = SFTConfig(**training_arguments(tmp_path), assistant_only_loss=True, bf16=False, max_length=None)
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


def test_trl_sft_trainer_own_fused_lm_head_loss_is_the_models_loss(tmp_path, fast_tokenizer):
    """TRL's own loss (no Needle subclass): the backbone's hidden states through `get_output_embeddings()`,
    the tied bias-less `lm_head`, in tiles; it equals the model's next-token loss on the same batch."""
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = NeedleForCausalLM(NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG))
    args = SFTConfig(**training_arguments(tmp_path), assistant_only_loss=True, bf16=False, max_length=None)
    trainer = SFTTrainer(model=model, args=args, train_dataset=conversations_dataset(make_demo_examples(8, seed=1)),
                         processing_class=fast_tokenizer, peft_config=needle_lora_config(rank=8, alpha=16.0))
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.eval()
    with torch.no_grad():
        fused = trainer.compute_loss(trainer.model, dict(batch))
        plain = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"]).loss
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_shipped_demo_model_answers_held_out_prompts_with_the_exact_calls(demo_model, demo_tokenizer):
    from needle_hf.demo.data import DEMO_HELD_OUT_SEED
    from needle_hf.tools.tool_calls import ToolCallParseError, parse_tool_calls

    model, tokenizer = demo_model, demo_tokenizer  # the Needle tokenizer pads on the left
    examples = make_demo_examples(10, seed=DEMO_HELD_OUT_SEED, split="held_out")  # queries never trained on
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": e["query"]}], tools=e["tools"],
                                             add_generation_prompt=True, tokenize=False) for e in examples]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        generated = model.eval().generate(**inputs, max_new_tokens=48, do_sample=False)
    exact = 0
    for example, row in zip(examples, generated[:, inputs["input_ids"].shape[1]:]):
        try:
            exact += parse_tool_calls(tokenizer.decode(row, skip_special_tokens=True)) == example["answers"]
        except ToolCallParseError:
            pass
    assert exact >= 9, f"{exact}/10 exact tool calls"


@pytest.mark.parametrize("call, problem", [
    (lambda: needle_lora_config(rank=0), r"rank: expected an int >= 1, found 0"),
    (lambda: needle_lora_config(rank=2.5), r"rank: expected an int >= 1, found 2.5"),
    (lambda: needle_lora_config(alpha=float("nan")), r"alpha: expected a finite number > 0, found nan"),
    (lambda: needle_lora_config(dropout=1.0), r"dropout: expected a finite number >= 0 and < 1, found 1.0"),
    (lambda: needle_causal_lm_loss(torch.zeros(2, 4, 8), torch.zeros(2, 4)),
     r"labels: expected an integer tensor \(2, 4\) \(as logits\), found torch.float32"),
    (lambda: needle_causal_lm_loss(torch.zeros(4, 8), torch.zeros(2, 4, dtype=torch.long)),
     r"logits: expected a float tensor \[batch, tokens, vocab\], found torch.float32 \(4, 8\)"),
    (lambda: needle_causal_lm_loss(torch.zeros(2, 4, 8), torch.zeros(2, 3, dtype=torch.long)), r"labels: .*found torch.int64 \(2, 3\)"),
    (lambda: needle_causal_lm_loss(torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.long), mtp_loss_weight=float("inf")),
     r"mtp_loss_weight: expected a finite number >= 0, found inf"),
    (lambda: NeedleTrainer(model=None, args=TrainingArguments(output_dir="unused", report_to=[]), mtp_loss_weight=-1),
     r"mtp_loss_weight: expected a finite number >= 0, found -1"),
    (lambda: NeedleTrainer(model=None, args=TrainingArguments(output_dir="unused", report_to=[]), confidence_loss_weight="x"),
     r"confidence_loss_weight: expected a finite number >= 0, found 'x'"),
])
def test_bad_finetuning_options_are_refused_naming_them(call, problem):
    with pytest.raises(ValueError, match=problem):
        call()
