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


class UsageError(Exception):
    """Bad arguments or input files: reported as one line, before anything is written."""


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
                        help="first write N synthetic demo examples (needle_hf.demo.data) to the data path "
                             "(an existing file is reused only if it holds exactly those examples)")
    return parser.parse_args(argv)


def check_args(args) -> None:
    """Every option in its range, the base a folder, and no output equal to, inside or around an input."""
    ranges = [
        ("--rank", args.rank, args.rank >= 1, "an int >= 1"),
        ("--alpha", args.alpha, math.isfinite(args.alpha) and args.alpha > 0, "a finite number > 0"),
        ("--epochs", args.epochs, math.isfinite(args.epochs) and args.epochs > 0, "a finite number > 0"),
        ("--learning-rate", args.learning_rate, math.isfinite(args.learning_rate) and args.learning_rate > 0,
         "a finite number > 0"),
        ("--batch-size", args.batch_size, args.batch_size >= 1, "an int >= 1"),
        ("--max-length", args.max_length, args.max_length >= 2, "an int >= 2"),
        ("--mtp-loss-weight", args.mtp_loss_weight, math.isfinite(args.mtp_loss_weight) and args.mtp_loss_weight >= 0,
         "a finite number >= 0"),
        ("--held-out", args.held_out, 0 <= args.held_out < 1, "a share in [0, 1)"),
        ("--seed", args.seed, 0 <= args.seed < 2**32, "an int in [0, 2**32)"),
        ("--threads", args.threads, args.threads >= 1, "an int >= 1"),
        ("--demo-data", args.demo_data, args.demo_data is None or args.demo_data >= 1, "an int >= 1"),
    ]
    for flag, value, good, expected in ranges:
        if not good:
            raise UsageError(f"{flag}: expected {expected}, found {value}")
    if not (args.base / "config.json").is_file():
        raise UsageError(f"{args.base}: not a Needle folder (no config.json); expected the output of `needle-hf convert`")
    if args.data.exists() and not args.data.is_file():
        raise UsageError(f"{args.data}: not a file; expected a fine-tuning JSONL file")
    written = [args.out / "adapter", args.out / "merged", args.out / "checkpoints"] + ([args.cact] if args.cact else [])
    for output in written:
        for name, source in (("base", args.base), ("data", args.data)):
            a, b = output.resolve(), source.resolve()
            if a == b or a in b.parents or b in a.parents:
                raise UsageError(f"{output}: the output would overlap the {name} input {source}; "
                                 "choose an output outside the inputs")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"{args.out}: a file; expected an output folder")
    if args.cact is not None and args.cact.is_dir():
        raise UsageError(f"{args.cact}: a folder; expected a .cact file path")


def write_demo_data(path: Path, count: int, *, seed: int) -> None:
    """Write the demo examples to ``path``; an existing file is kept only if it holds exactly them."""
    import os
    import tempfile

    from needle_hf.demo.data import write_demo_jsonl

    handle, staging = tempfile.mkstemp(prefix=".demo-", suffix=".jsonl", dir=path.parent if path.parent.is_dir() else None)
    os.close(handle)
    try:
        write_demo_jsonl(staging, count, seed=seed)
        if path.exists():
            if Path(staging).read_bytes() != path.read_bytes():
                raise UsageError(f"{path}: exists and holds other data; --demo-data never overwrites a file "
                                 "(remove it or choose another data path)")
            print(f"{path} already holds the {count} synthetic demo examples")
            return
        if not path.parent.is_dir():
            raise UsageError(f"{path.parent}: no such folder for the data file")
        os.replace(staging, path)
        print(f"wrote {count} synthetic demo examples to {path}")
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except UsageError as error:
        print(f"finetune_tools: error: {error}", file=sys.stderr)
        return 1


def run(args) -> int:
    check_args(args)
    from needle_hf.finetune.data import FinetuneDataError, load_finetune_dataset

    if args.demo_data:
        write_demo_data(args.data, args.demo_data, seed=args.seed)
    try:
        dataset = load_finetune_dataset(args.data)
    except FinetuneDataError as error:
        raise UsageError(error) from None
    if args.held_out > 0 and (math.ceil(args.held_out * len(dataset)) >= len(dataset)):
        raise UsageError(f"{args.data}: {len(dataset)} example(s) leave none to train on after holding out "
                         f"--held-out {args.held_out}; add examples or pass --held-out 0")

    import torch
    from transformers import AutoTokenizer
    from trl import SFTConfig

    from needle_hf.demo.data import write_demo_jsonl
    from needle_hf.finetune.data import FinetuneDataError, load_finetune_dataset
    from needle_hf.finetune.trainer import needle_lora_config
    from needle_hf.finetune.trainer_trl import NeedleSFTTrainer
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    try:
        model = NeedleForCausalLM.from_pretrained(args.base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.base)
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"{args.base}: not a loadable Needle folder ({reason})") from None
    if args.mtp_loss_weight > 0 and not model.config.use_mtp_head:
        raise UsageError(f"--mtp-loss-weight: {args.base} has no MTP head (config.json use_mtp_head is false); "
                         "expected 0")
    limit = model.config.max_position_embeddings
    if args.max_length > limit:
        raise UsageError(f"--max-length: expected at most the model's max_position_embeddings ({limit}), "
                         f"found {args.max_length}")

    split = dataset.train_test_split(test_size=args.held_out, seed=args.seed) if args.held_out > 0 else None
    train, held_out = (split["train"], split["test"]) if split else (dataset, None)
    print(f"{len(train)} training examples, {len(held_out) if held_out else 0} held out")

    torch.set_num_threads(args.threads)
    # Warm-up over the first 5% of the steps, as the reference (a step count: transformers 5 has no warmup_ratio).
    total_steps = math.ceil(len(train) / args.batch_size) * args.epochs
    warmup_steps = max(1, int(total_steps) // 20)
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

    try:
        print(build_cact(args.out / "merged", args.cact, overwrite=True, progress=print).summary())
    except (OSError, ValueError) as error:
        raise UsageError(f"{args.cact}: not built ({error})") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
