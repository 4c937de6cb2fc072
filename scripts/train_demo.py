"""Retrain the shipped demo checkpoint (needle_hf/demo/needle2-demo.pkl) through the Hugging Face path.

Steps, each printed:
  1. convert the shipped native checkpoint into a Hugging Face folder and load it as the PyTorch
     `NeedleForCausalLM` (float32);
  2. build the synthetic tool-calling data of `needle_hf.demo.data` (five phone tools, one or two
     offered per prompt, every argument copied from the query): a training set and a held-out set
     of queries the training set never contains (``split="held_out"``);
  3. fine-tune every weight with `needle_hf.finetune.trainer.NeedleTrainer` (a `transformers.Trainer`):
     next-token loss on the assistant target and EOS plus the MTP head's t + 2 loss, AdamW with
     warm-up and cosine decay, gradient clipping 1.0;
  4. train the contrastive and confidence heads on the fixed backbone (`needle_hf.finetune.heads`:
     the reference has no objective for them, so InfoNCE of queries against a catalogue of the five
     tools and 8 distractor tools, and binary cross-entropy of right against corrupted answers:
     another tool, a changed or a dropped argument);
  5. measure on the held-out prompts: exact tool calls of greedy `generate()` (name and every
     argument), the MTP head's draft acceptance under `generate(use_mtp=True)` (batch 1), routing
     recall@1/@3 over a catalogue of the five tools and every distractor (half of them never seen in
     training), and the confidence head's calibration on the greedy answers (ECE; accuracy of the
     answers kept and deferred at 0.5) and on corrupted answers;
  6. export the result back to the native format (`needle_hf.conversion.export.export_native`),
     replacing needle_hf/demo/needle2-demo.pkl, which the main job (`python -m needle_hf.demo`,
     ./run.sh) converts and runs. The tokenizer (needle_hf/demo/tokenizer.model) is unchanged.
The figures go to train_demo_results.json beside the checkpoint.

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
DEMO_DIR = HERE.parent / "needle_hf" / "demo"  # the demo ships inside the package
CHECKPOINT = DEMO_DIR / "needle2-demo.pkl"
TOKENIZER = DEMO_DIR / "tokenizer.model"
TRAIN_EXAMPLES = 6400
HELD_OUT_EXAMPLES = 200
MTP_LOSS_WEIGHT = 0.3
MAX_NEW_TOKENS = 48  # the longest demo answer is 45 tokens with its EOS
MTP_PROMPTS = 60  # held-out prompts decoded one by one with use_mtp=True
# 0: the confidence head is fitted on the fixed backbone in step 4. > 0 adds its loss to step 3 (one
# training row in WRONG_ANSWER_EVERY brings a wrong answer), so the backbone learns to tell right
# from wrong; 50 steps of that left its loss at chance, and it costs half a training step more.
CONFIDENCE_LOSS_WEIGHT = 0.0
WRONG_ANSWER_EVERY = 2
HEAD_STEPS = 300
HEAD_LEARNING_RATE = 1e-2
HEAD_EXAMPLES = 600  # training examples of the heads: each one's query, right answer and one corrupted answer
CONFIDENCE_THRESHOLD = 0.5


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--mtp-loss-weight", type=float, default=MTP_LOSS_WEIGHT)
    parser.add_argument("--confidence-loss-weight", type=float, default=CONFIDENCE_LOSS_WEIGHT)
    parser.add_argument("--head-steps", type=int, default=HEAD_STEPS)
    # One thread: on two busy cores, torch's two-thread kernels of these small matrices run several times slower.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=CHECKPOINT, help="native checkpoint to write (default: the shipped one)")
    return parser.parse_args(argv)


def _prompt(tokenizer, example) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": example["query"]}], tools=example["tools"],
                                         add_generation_prompt=True, tokenize=False)


def greedy_answers(model, tokenizer, examples, *, batch_size: int = 50) -> list[dict]:
    """Greedy answers of ``examples`` (batched, left padded): {"text", "exact", "turn"} each.

    ``exact``: the answer parses to exactly the example's calls; ``turn``: prompt ids followed by
    the answer ids, EOS and padding removed (what `NeedleToolCaller` scores).
    """
    import torch

    from needle_hf.tools.tool_calls import ToolCallParseError, parse_tool_calls

    tokenizer.padding_side = "left"
    dropped = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    answers = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        prompt_ids = [tokenizer(_prompt(tokenizer, e), add_special_tokens=False)["input_ids"] for e in chunk]
        inputs = tokenizer.pad({"input_ids": prompt_ids}, return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        for example, prompt, row in zip(chunk, prompt_ids, generated[:, inputs["input_ids"].shape[1]:].tolist()):
            new_ids = [token for token in row if token not in dropped]
            text = tokenizer.decode(new_ids, skip_special_tokens=True)
            try:
                exact = parse_tool_calls(text) == example["answers"]
            except ToolCallParseError:
                exact = False
            answers.append({"text": text.strip(), "exact": exact, "turn": prompt + new_ids})
    return answers


def mtp_acceptance(model, tokenizer, examples) -> dict:
    """Draft acceptance of `generate(use_mtp=True)` at batch 1: drafts kept / made, tokens per backbone forward."""
    import torch

    drafted = accepted = forwards = tokens = 0
    for example in examples:
        inputs = tokenizer(_prompt(tokenizer, example), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, use_mtp=True,
                                 return_dict_in_generate=True)
        drafted, accepted, forwards = drafted + out.drafted, accepted + out.accepted, forwards + out.forwards
        tokens += out.sequences.shape[1] - inputs["input_ids"].shape[1]
    # The prompt's forward writes the first token; `forwards` counts the ones after it.
    return {"acceptance": accepted / max(drafted, 1), "tokens_per_forward": tokens / (forwards + len(examples)),
            "prompts": len(examples)}


def routing_recall(model, tokenizer, examples, catalogue, *, ks=(1, 3)) -> dict:
    """recall@k of `rank_tools` over ``catalogue``: the fraction of queries whose tool is in the top k."""
    from needle_hf.tools.tool_routing import embed_tools, rank_tools

    embeddings = embed_tools(model, tokenizer, catalogue)
    names = [tool["name"] for tool in catalogue]
    ranks = []
    for example in examples:
        ranked = rank_tools(model, tokenizer, example["query"], catalogue, tool_embeddings=embeddings)
        ranks.append([entry.index for entry in ranked].index(names.index(example["answers"][0]["name"])))
    return {f"recall@{k}": sum(rank < k for rank in ranks) / len(ranks) for k in ks}


def confidences(model, turns, *, batch_size: int = 50) -> list[float]:
    """`answer_confidence` of turns (lists of ids), left padded in batches."""
    from needle_hf.finetune.heads import _padded
    from needle_hf.tools.tool_routing import answer_confidence

    scores = []
    for start in range(0, len(turns), batch_size):
        ids, mask = _padded(turns[start:start + batch_size], model.config.pad_token_id)
        scores += answer_confidence(model, ids, mask).tolist()
    return scores


def calibration(scores, correct, *, threshold: float = CONFIDENCE_THRESHOLD, bins: int = 10) -> dict:
    """Expected calibration error over ``bins`` equal-width bins, and the answers kept / deferred at ``threshold``."""
    import numpy as np

    scores, correct = np.asarray(scores, float), np.asarray(correct, float)
    which = np.minimum((scores * bins).astype(int), bins - 1)
    ece = sum(abs(scores[which == b].mean() - correct[which == b].mean()) * (which == b).mean()
              for b in range(bins) if (which == b).any())
    kept = scores >= threshold
    return {"ece": float(ece), "mean_confidence": float(scores.mean()), "accuracy": float(correct.mean()),
            "kept": float(kept.mean()),
            "accuracy_kept": float(correct[kept].mean()) if kept.any() else None,
            "accuracy_deferred": float(correct[~kept].mean()) if (~kept).any() else None}


def routing_training_data(tokenizer, examples, catalogue) -> dict:
    """`train_heads` inputs of the contrastive head: each example's query against ``catalogue``."""
    from needle_hf.tools.tool_routing import tool_text

    names = [tool["name"] for tool in catalogue]
    return {"query_ids": tokenizer([e["query"] for e in examples])["input_ids"],
            "targets": [names.index(e["answers"][0]["name"]) for e in examples],
            "tool_ids": tokenizer([tool_text(tool) for tool in catalogue])["input_ids"]}


def confidence_training_data(tokenizer, examples, *, seed: int) -> dict:
    """`train_heads` inputs of the confidence head: each example's right answer and one corrupted answer."""
    import random

    from needle_hf.demo.data import corrupt_demo_answers
    from needle_hf.finetune.heads import turn_ids

    rng = random.Random(seed)
    turns, labels = [], []
    for example in examples:
        turns += [turn_ids(tokenizer, example), turn_ids(tokenizer, {**example, "answers": corrupt_demo_answers(example, rng)})]
        labels += [1.0, 0.0]
    return {"turns": turns, "labels": labels}


def with_wrong_answers(tokenizer, rows, examples, *, every: int, seed: int):
    """``rows`` (tokenized ``examples``) plus a ``wrong_input_ids`` column: the turn of a corrupted answer
    for one row in ``every``, ``[]`` for the others (`ConfidenceRowsCollator`)."""
    import random

    from needle_hf.demo.data import corrupt_demo_answers
    from needle_hf.finetune.heads import turn_ids

    rng = random.Random(seed)
    wrong = [turn_ids(tokenizer, {**e, "answers": corrupt_demo_answers(e, rng)}) if i % every == 0 else []
             for i, e in enumerate(examples)]
    return rows.add_column("wrong_input_ids", wrong)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    import random

    import torch
    from transformers import AutoTokenizer, TrainingArguments

    from needle_hf.conversion.convert import convert
    from needle_hf.conversion.export import export_native
    from needle_hf.demo.data import (
        DEMO_DATA_TOOLS, DEMO_HELD_OUT_SEED, DEMO_TRAIN_SEED, DISTRACTOR_TOOLS, TRAINING_DISTRACTORS,
        corrupt_demo_answers, make_demo_examples,
    )
    from needle_hf.finetune.data import NeedlePaddingCollator, conversations_dataset, tokenize_conversations
    from needle_hf.finetune.heads import ConfidenceRowsCollator, train_heads, turn_ids
    from needle_hf.finetune.trainer import NeedleTrainer
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = {"steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
               "mtp_loss_weight": args.mtp_loss_weight, "confidence_loss_weight": args.confidence_loss_weight,
               "head_steps": args.head_steps}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        print(f"[1/6] converting {CHECKPOINT} and loading NeedleForCausalLM (float32)")
        convert(CHECKPOINT, work / "base", tokenizer=TOKENIZER)
        model = NeedleForCausalLM.from_pretrained(work / "base", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(work / "base")
        print(f"      {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")

        print(f"[2/6] synthetic data: {TRAIN_EXAMPLES} training and {HELD_OUT_EXAMPLES} held-out examples"
              " (no held-out query occurs in training)")
        train_examples = make_demo_examples(TRAIN_EXAMPLES, seed=DEMO_TRAIN_SEED, split="train")
        train = tokenize_conversations(conversations_dataset(train_examples), tokenizer)
        joint_confidence = args.confidence_loss_weight > 0
        if joint_confidence:
            train = with_wrong_answers(tokenizer, train, train_examples, every=WRONG_ANSWER_EVERY, seed=DEMO_TRAIN_SEED)
        held_out = make_demo_examples(HELD_OUT_EXAMPLES, seed=DEMO_HELD_OUT_SEED, split="held_out")
        held_out_rows = tokenize_conversations(conversations_dataset(held_out), tokenizer)
        if joint_confidence:
            held_out_rows = held_out_rows.add_column("wrong_input_ids", [[]] * len(held_out))
        longest = max(len(ids) for ids in train["input_ids"])
        print(f"      up to {longest} tokens per example")

        print(f"[3/6] NeedleTrainer: {args.steps} steps of {args.batch_size}, next-token + {args.mtp_loss_weight} x MTP loss"
              + (f" + {args.confidence_loss_weight} x confidence loss" if joint_confidence else ""))
        trainer = NeedleTrainer(
            model=model,
            args=TrainingArguments(
                output_dir=str(work / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                per_device_eval_batch_size=50, learning_rate=args.learning_rate, weight_decay=0.01,
                warmup_steps=max(1, args.steps // 20), lr_scheduler_type="cosine", max_grad_norm=1.0,
                logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                remove_unused_columns=False, label_names=["labels"], dataloader_num_workers=0,
                disable_tqdm=True,
            ),
            train_dataset=train,
            data_collator=(ConfidenceRowsCollator if joint_confidence else NeedlePaddingCollator)(
                pad_token_id=tokenizer.pad_token_id),
            mtp_loss_weight=args.mtp_loss_weight,
            confidence_loss_weight=args.confidence_loss_weight,
        )
        held_out_before = trainer.evaluate(held_out_rows)["eval_loss"]
        trainer.train()
        held_out_after = trainer.evaluate(held_out_rows)["eval_loss"]
        results["held_out_loss"] = [held_out_before, held_out_after]
        print(f"      held-out loss {held_out_before:.4f} -> {held_out_after:.4f}")
        model.eval()

        training_catalogue = DEMO_DATA_TOOLS + DISTRACTOR_TOOLS[:TRAINING_DISTRACTORS]
        print(f"[4/6] heads on the fixed backbone, {args.head_steps} steps: InfoNCE over {len(training_catalogue)} tools"
              + ("" if joint_confidence else "; binary cross-entropy of right vs corrupted answers"))
        examples = train_examples[:HEAD_EXAMPLES]
        data = routing_training_data(tokenizer, examples, training_catalogue)
        if not joint_confidence:
            data.update(confidence_training_data(tokenizer, examples, seed=DEMO_TRAIN_SEED))
        history = train_heads(model, **data, steps=args.head_steps, learning_rate=HEAD_LEARNING_RATE, seed=0,
                              log_every=100)
        results["head_losses_first_last"] = [list(history[0]), list(history[-1])]

        print(f"[5/6] held-out measurements ({HELD_OUT_EXAMPLES} prompts)")
        answers = greedy_answers(model, tokenizer, held_out)
        exact = [answer["exact"] for answer in answers]
        results.update(exact_tool_calls=sum(exact) / len(exact), held_out_prompts=len(exact))
        for example, answer in list(zip(held_out, answers))[:3]:
            print(f"      {example['query']!r} -> {answer['text']!r}")
        print(f"      exact tool calls (name and every argument): {results['exact_tool_calls']:.1%}")

        results["mtp"] = mtp_acceptance(model, tokenizer, held_out[:MTP_PROMPTS])
        print(f"      use_mtp (batch 1, {MTP_PROMPTS} prompts): {results['mtp']['acceptance']:.1%} of drafts accepted,"
              f" {results['mtp']['tokens_per_forward']:.2f} tokens per backbone forward")

        catalogue = DEMO_DATA_TOOLS + DISTRACTOR_TOOLS
        results["routing"] = {**routing_recall(model, tokenizer, held_out, catalogue), "catalogue": len(catalogue),
                              "unseen_distractors": len(DISTRACTOR_TOOLS) - TRAINING_DISTRACTORS}
        print(f"      routing over {len(catalogue)} tools ({results['routing']['unseen_distractors']} never seen):"
              f" recall@1 {results['routing']['recall@1']:.1%}, recall@3 {results['routing']['recall@3']:.1%}")

        scores = confidences(model, [answer["turn"] for answer in answers])
        results["confidence_greedy"] = calibration(scores, exact)
        rng = random.Random(DEMO_HELD_OUT_SEED)
        wrong = [turn_ids(tokenizer, {**e, "answers": corrupt_demo_answers(e, rng)}) for e in held_out]
        right = [turn_ids(tokenizer, e) for e in held_out]
        both = confidences(model, right + wrong)
        results["confidence_references"] = {
            **calibration(both, [1.0] * len(right) + [0.0] * len(wrong)),
            "right_kept": sum(s >= CONFIDENCE_THRESHOLD for s in both[:len(right)]) / len(right),
            "wrong_deferred": sum(s < CONFIDENCE_THRESHOLD for s in both[len(right):]) / len(wrong),
        }
        greedy, references = results["confidence_greedy"], results["confidence_references"]
        print(f"      confidence on the greedy answers: mean {greedy['mean_confidence']:.3f}, ECE {greedy['ece']:.3f};"
              f" at {CONFIDENCE_THRESHOLD} it keeps {greedy['kept']:.1%} (accuracy {greedy['accuracy_kept']}),"
              f" defers the rest (accuracy {greedy['accuracy_deferred']})")
        print(f"      on right vs corrupted held-out answers: ECE {references['ece']:.3f}, right kept"
              f" {references['right_kept']:.1%}, wrong deferred {references['wrong_deferred']:.1%}")

        print(f"[6/6] exporting to {args.out}")
        model.save_pretrained(work / "trained")
        export_native(work / "trained", work / "needle2-demo.pkl")
        shutil.move(work / "needle2-demo.pkl", args.out)
    results["megabytes"] = round(os.path.getsize(args.out) / 1e6, 2)
    results["seconds"] = round(time.perf_counter() - started)
    (args.out.parent / "train_demo_results.json").write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    print(f"      {results['megabytes']:.1f} MB; total {results['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
