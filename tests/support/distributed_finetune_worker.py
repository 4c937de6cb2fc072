"""One fine-tuning run of a tiny Needle with `NeedleTrainer`, as `accelerate launch` or plain `python` runs it.

    accelerate launch --cpu --num_processes 2 tests/distributed_finetune_worker.py OUT.json --per-device-batch 4
    python tests/distributed_finetune_worker.py OUT.json --per-device-batch 8

Both train the same LoRA adapter on the same demo examples in the same order (the global batch is the
per-device batch times the process count) and the main process writes the per-step training losses to
OUT.json, with the trained adapter weights. Used by tests/test_distributed.py.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune_support import FINETUNE_NATIVE_CONFIG  # noqa: E402
from peft import get_peft_model  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from needle_hf.models.needle.configuration_needle import NeedleConfig  # noqa: E402
from demo_support import DEMO_TOKENIZER  # noqa: E402
from needle_hf.demo.data import make_demo_examples  # noqa: E402
from needle_hf.finetune.data import NeedlePaddingCollator, conversations_dataset, tokenize_conversations  # noqa: E402
from needle_hf.finetune.trainer import NeedleTrainer, needle_lora_config  # noqa: E402
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM  # noqa: E402
from needle_hf.models.needle.tokenization_needle import PAD_ID, build_fast_tokenizer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--per-device-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    options = parser.parse_args()

    torch.set_num_threads(1)
    tokenizer = build_fast_tokenizer(str(DEMO_TOKENIZER))
    torch.manual_seed(0)  # the same initial weights in every process (DDP also broadcasts rank 0's)
    model = get_peft_model(NeedleForCausalLM(NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG)),
                           needle_lora_config(rank=8, alpha=16.0))
    train = tokenize_conversations(conversations_dataset(make_demo_examples(96, seed=1)), tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(
            output_dir=scratch, per_device_train_batch_size=options.per_device_batch, max_steps=options.steps,
            learning_rate=1e-2, warmup_steps=1, lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
            remove_unused_columns=False, label_names=["labels"], ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None)
        trainer = NeedleTrainer(model=model, args=args, train_dataset=train,
                                data_collator=NeedlePaddingCollator(pad_token_id=PAD_ID), mtp_loss_weight=0.3)
        trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        adapter = {name: value.detach().tolist() for name, value in trainer.model.named_parameters() if value.requires_grad}
        options.out.write_text(json.dumps({"world_size": args.world_size, "losses": losses, "adapter": adapter}))


if __name__ == "__main__":
    main()
