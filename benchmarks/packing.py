"""SFT throughput, padding-free (packed) batches against padded ones: TRL `SFTTrainer` on the demo data.

The shipped demo checkpoint (PyTorch, float32, one torch thread), full fine-tuning with SFTConfig's
defaults (activation checkpointing on), assistant-only loss, the same demo examples and batch size in
both modes. Padded: each batch right-padded to its longest row. Padding-free (``padding_free=True``):
the batch flattened into one row, position_ids restarting at 0 per example, no padding computed.
Tokens/s counts the real tokens (not padding) of the examples trained on, over `train_runtime`; each
mode runs ``--repeats`` times, alternating, and the best run counts.

    .venv/bin/python benchmarks/packing.py [--examples 96] [--batch 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile

from common import emit, load_demo_torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch
    from trl import SFTConfig, SFTTrainer

    from needle_hf.demo.data import make_demo_examples
    from needle_hf.finetune.data import conversations_dataset

    model, tokenizer = load_demo_torch()
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    dataset = conversations_dataset(make_demo_examples(args.examples, seed=1))
    best = {}
    for _ in range(args.repeats):
        for padding_free in (False, True):
            model.load_state_dict(initial)
            model.train()
            config = SFTConfig(output_dir=tempfile.mkdtemp(), report_to=[], per_device_train_batch_size=args.batch,
                               num_train_epochs=1, learning_rate=1e-4, bf16=False, assistant_only_loss=True,
                               max_length=None, padding_free=padding_free, use_cpu=True, save_strategy="no",
                               logging_strategy="no", dataloader_drop_last=True, seed=0)
            trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
            steps = len(trainer.get_train_dataloader())
            batches = list(trainer.get_train_dataloader())
            real_tokens = sum(int(b["input_ids"].numel() if padding_free else b["attention_mask"].sum()) for b in batches)
            computed_tokens = sum(int(b["input_ids"].numel()) for b in batches)
            torch.manual_seed(0)
            runtime = trainer.train().metrics["train_runtime"]
            mode = "padding_free" if padding_free else "padded"
            result = {"mode": mode, "steps": steps, "real_tokens": real_tokens, "computed_tokens": computed_tokens,
                      "seconds": round(runtime, 3), "tokens_per_second": round(real_tokens / runtime, 1)}
            if mode not in best or result["tokens_per_second"] > best[mode]["tokens_per_second"]:
                best[mode] = result
    for result in best.values():
        emit(result)
    emit({"speedup_padding_free_over_padded": round(best["padding_free"]["tokens_per_second"]
                                                    / best["padded"]["tokens_per_second"], 2)})


if __name__ == "__main__":
    main()
