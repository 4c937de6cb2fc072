"""Retrain the shipped demo checkpoint (scripts/demo/needle2-demo.pkl) through the Hugging Face path.

Steps, each printed:
  1. convert the shipped native checkpoint into a Hugging Face folder and load it as the PyTorch
     `NeedleForCausalLM` (float32);
  2. build the synthetic tool-calling data of `needle_hf.demo_data` (five phone tools, one or two
     offered per prompt, every argument copied from the query): a training set and a held-out set
     drawn with other seeds;
  3. fine-tune every weight with `needle_hf.finetune_torch.NeedleTrainer` (a `transformers.Trainer`):
     next-token loss on the assistant target and EOS plus the MTP head's t + 2 loss, AdamW with
     warm-up and cosine decay, gradient clipping 1.0;
  4. greedy-decode the held-out prompts with `generate()` and print how many give exactly the right
     tool calls (name and every argument);
  5. export the result back to the native format (`needle_hf.conversion.export.export_native`),
     replacing scripts/demo/needle2-demo.pkl, which the main job (`python -m needle_hf.demo`,
     ./run.sh) converts and runs. The tokenizer (scripts/demo/tokenizer.model) is unchanged.

The contrastive and confidence heads are shipped as they are: the reference package defines no
training objective for them (its fine-tuning never tunes the confidence head, and the contrastive
loss of its pre-training is not part of it).

    .venv/bin/python scripts/train_demo.py            # about 6 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEMO_DIR = HERE / "demo"
CHECKPOINT = DEMO_DIR / "needle2-demo.pkl"
TOKENIZER = DEMO_DIR / "tokenizer.model"
TRAIN_EXAMPLES = 6400
HELD_OUT_EXAMPLES = 200
MTP_LOSS_WEIGHT = 0.3
MAX_NEW_TOKENS = 40


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    # One thread: on two busy cores, torch's two-thread kernels of these small matrices run several times slower.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=CHECKPOINT, help="native checkpoint to write (default: the shipped one)")
    return parser.parse_args(argv)


def exact_call_rate(model, tokenizer, examples, *, batch_size: int = 50) -> tuple[float, list[tuple[str, str]]]:
    """Fraction of ``examples`` whose greedy answer parses to exactly their calls; and (query, answer) pairs."""
    import torch

    from needle_hf.tool_calls import ToolCallParseError, parse_tool_calls

    tokenizer.padding_side = "left"
    exact, answers = 0, []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": e["query"]}], tools=e["tools"],
                                                 add_generation_prompt=True, tokenize=False) for e in chunk]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        for example, row in zip(chunk, generated[:, inputs["input_ids"].shape[1]:]):
            text = tokenizer.decode(row, skip_special_tokens=True)
            answers.append((example["query"], text.strip()))
            try:
                exact += parse_tool_calls(text) == example["answers"]
            except ToolCallParseError:
                pass
    return exact / len(examples), answers


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    import torch
    from transformers import AutoTokenizer, TrainingArguments

    from needle_hf.conversion.convert import convert
    from needle_hf.conversion.export import export_native
    from needle_hf.demo_data import DEMO_HELD_OUT_SEED, DEMO_TRAIN_SEED, make_demo_examples
    from needle_hf.finetune_data import NeedlePaddingCollator, conversations_dataset, tokenize_conversations
    from needle_hf.finetune_torch import NeedleTrainer
    from needle_hf.modeling_needle import NeedleForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        print(f"[1/5] converting {CHECKPOINT} and loading NeedleForCausalLM (float32)")
        convert(CHECKPOINT, work / "base", tokenizer=TOKENIZER)
        model = NeedleForCausalLM.from_pretrained(work / "base", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(work / "base")
        print(f"      {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")

        print(f"[2/5] synthetic data: {TRAIN_EXAMPLES} training and {HELD_OUT_EXAMPLES} held-out examples")
        train = tokenize_conversations(conversations_dataset(make_demo_examples(TRAIN_EXAMPLES, seed=DEMO_TRAIN_SEED)),
                                       tokenizer)
        held_out = make_demo_examples(HELD_OUT_EXAMPLES, seed=DEMO_HELD_OUT_SEED)
        held_out_rows = tokenize_conversations(conversations_dataset(held_out), tokenizer)
        longest = max(len(ids) for ids in train["input_ids"])
        print(f"      up to {longest} tokens per example")

        print(f"[3/5] NeedleTrainer: {args.steps} steps of {args.batch_size}, next-token + {MTP_LOSS_WEIGHT} x MTP loss")
        trainer = NeedleTrainer(
            model=model,
            args=TrainingArguments(
                output_dir=str(work / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                per_device_eval_batch_size=50, learning_rate=args.learning_rate, weight_decay=0.01,
                warmup_steps=max(1, args.steps // 20), lr_scheduler_type="cosine", max_grad_norm=1.0,
                logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                remove_unused_columns=False, label_names=["labels"], dataloader_num_workers=0,
            ),
            train_dataset=train,
            data_collator=NeedlePaddingCollator(pad_token_id=tokenizer.pad_token_id),
            mtp_loss_weight=MTP_LOSS_WEIGHT,
        )
        held_out_before = trainer.evaluate(held_out_rows)["eval_loss"]
        trainer.train()
        held_out_after = trainer.evaluate(held_out_rows)["eval_loss"]
        print(f"      held-out loss {held_out_before:.4f} -> {held_out_after:.4f}")

        print(f"[4/5] greedy generate() on {HELD_OUT_EXAMPLES} held-out prompts")
        model.eval()
        rate, answers = exact_call_rate(model, tokenizer, held_out)
        for query, answer in answers[:3]:
            print(f"      {query!r} -> {answer!r}")
        print(f"      exact tool calls (name and every argument): {rate:.1%} of {HELD_OUT_EXAMPLES} held-out prompts")

        print(f"[5/5] exporting to {args.out}")
        model.save_pretrained(work / "trained")
        export_native(work / "trained", work / "needle2-demo.pkl")
        shutil.move(work / "needle2-demo.pkl", args.out)
        (args.out.parent / "train_demo_results.json").write_text(json.dumps({
            "steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
            "mtp_loss_weight": MTP_LOSS_WEIGHT, "held_out_loss": [held_out_before, held_out_after],
            "exact_tool_calls": rate, "held_out_prompts": HELD_OUT_EXAMPLES,
            "seconds": round(time.perf_counter() - started),
        }, indent=1) + "\n")
    print(f"      {os.path.getsize(args.out) / 1e6:.1f} MB; total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
