"""Fine-tune Needle 2 on your own tools: JSONL -> LoRA adapter + merged Hugging Face folder.

    python examples/finetune_tools.py BASE_HF_DIR data.jsonl OUT_DIR [--rank 8] [--alpha 16] [--epochs 3] [--cact OUT.cact]

BASE_HF_DIR is a Needle folder (`needle-hf convert needle2.pkl BASE_HF_DIR --tokenizer tokenizer.model`).
data.jsonl is the Needle fine-tuning format, one example a line:

    {"query": "...", "tools": [{"name", "description", "parameters"}, ...],
     "answers": [{"name": "...", "arguments": {...}}], "system": "...", "reasoning": "..."}

(`system` and `reasoning` optional; `answers: []` teaches "no tool applies".) The script trains a
PEFT LoRA adapter on the five attention projections of the backbone layers with TRL's `SFTTrainer`
(assistant-only loss: the tool calls and EOS, as the reference fine-tunes), holds out a share of the
examples to report the loss before and after, and writes

    OUT_DIR/adapter/   adapter_config.json + adapter_model.safetensors (PeftModel.from_pretrained loads it)
    OUT_DIR/merged/    the base with the adapter merged: a plain Needle folder (weights, config, tokenizer)

Ship OUT_DIR/merged to the on-device engine with `needle-hf build OUT_DIR/merged needle.cact`, or
pass `--cact needle.cact` to build it at the end (CQ widths: the config's `weight_bits`, else 4-bit).

Try it on the demo model and its synthetic data (a few minutes on a CPU):

    needle-hf convert needle_hf/demo/needle2-demo.pkl needle2-hf --tokenizer needle_hf/demo/tokenizer.model
    python examples/finetune_tools.py needle2-hf demo.jsonl needle2-tuned --demo-data 400 --epochs 1 --cact needle.cact
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="Needle Hugging Face folder to fine-tune")
    parser.add_argument("data", type=Path, help="fine-tuning JSONL")
    parser.add_argument("out", type=Path, help="output folder (adapter/ and merged/ are written inside)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / r)")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per example (longer ones are cut)")
    parser.add_argument("--mtp-loss-weight", type=float, default=0.0, help="weight of the MTP head's t+2 loss")
    parser.add_argument("--held-out", type=float, default=0.1, help="share of the examples held out for the loss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (small models on a few busy cores run fastest on one)")
    parser.add_argument("--cact", type=Path, metavar="OUT.cact",
                        help="also build the merged folder's .cact for the on-device engine (as `needle-hf build`)")
    parser.add_argument("--demo-data", type=int, metavar="N",
                        help="first write N synthetic demo examples (needle_hf.demo.data) to the data path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    from transformers import AutoTokenizer
    from trl import SFTConfig

    from needle_hf.demo.data import write_demo_jsonl
    from needle_hf.finetune.data import FinetuneDataError, load_finetune_dataset
    from needle_hf.finetune.trainer import needle_lora_config
    from needle_hf.finetune.trainer_trl import NeedleSFTTrainer
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    if args.demo_data:
        write_demo_jsonl(args.data, args.demo_data, seed=args.seed)
        print(f"wrote {args.demo_data} synthetic demo examples to {args.data}")
    try:
        dataset = load_finetune_dataset(args.data)
    except FinetuneDataError as error:
        print(f"finetune_tools: error: {error}", file=sys.stderr)
        return 1
    split = dataset.train_test_split(test_size=args.held_out, seed=args.seed) if args.held_out > 0 else None
    train, held_out = (split["train"], split["test"]) if split else (dataset, None)
    print(f"{len(train)} training examples, {len(held_out) if held_out else 0} held out")

    torch.set_num_threads(args.threads)
    # Warm-up over the first 5% of the steps, as the reference (a step count: transformers 5 has no warmup_ratio).
    total_steps = math.ceil(len(train) / args.batch_size) * args.epochs
    warmup_steps = max(1, int(total_steps) // 20)
    model = NeedleForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    trainer = NeedleSFTTrainer(
        model=model,
        args=SFTConfig(
            output_dir=str(args.out / "checkpoints"), num_train_epochs=args.epochs,
            per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
            learning_rate=args.learning_rate, warmup_steps=warmup_steps, lr_scheduler_type="cosine", max_grad_norm=1.0,
            assistant_only_loss=True, max_length=args.max_length, logging_steps=10, save_strategy="no",
            eval_strategy="epoch" if held_out else "no", report_to=[], seed=args.seed,
            bf16=False,  # float32 weights and loss, as the reference fine-tunes (SFTConfig's default is bf16)
        ),
        train_dataset=train, eval_dataset=held_out, processing_class=tokenizer,
        peft_config=needle_lora_config(rank=args.rank, alpha=args.alpha), mtp_loss_weight=args.mtp_loss_weight,
    )
    if held_out:
        print(f"held-out loss before: {trainer.evaluate()['eval_loss']:.4f}")
    trainer.train()
    if held_out:
        print(f"held-out loss after:  {trainer.evaluate()['eval_loss']:.4f}")

    trainer.model.save_pretrained(args.out / "adapter")
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(args.out / "merged")
    tokenizer.save_pretrained(args.out / "merged")
    print(f"adapter: {args.out / 'adapter'}\nmerged:  {args.out / 'merged'}")
    if args.cact is None:
        print(f"next:    needle-hf build {args.out / 'merged'} needle.cact")
        return 0
    from needle_hf.conversion.build import build_cact

    print(build_cact(args.out / "merged", args.cact, overwrite=True, progress=print).summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
