"""Tool routing recall@k and confidence calibration on the demo checkpoint (PyTorch), through `NeedleToolCaller`.

Held-out demo prompts (`needle_hf.demo.data`, ``split="held_out"``: no query of them occurs in the
demo's training). The catalogue is the five demo tools plus the 16 distractor tools
(`DISTRACTOR_TOOLS`; the demo's contrastive head was trained against the first 8 only):

- recall@k: `rank_tools` puts the query's tool among the top k of the 21;
- routed answers: `NeedleToolCaller(top_k_tools=3)` offers only the 3 best tools of the 21 in the
  prompt and answers; exact calls (name and every argument) against the answers with the prompt's
  own one or two tools (`NeedleToolCaller()`);
- confidence: the head's probability of each answer (prompt + answer, batch 1, as the caller reads
  it) against whether it is exactly right: expected calibration error (10 bins) and the accuracy of
  the answers kept and deferred at a few thresholds; and on held-out right vs corrupted answers
  (`corrupt_demo_answers`), how many of each a 0.5 threshold keeps.

    .venv/bin/python benchmarks/tool_routing.py [--prompts 200]

Recorded run (100 prompts, the shipped demo of scripts/train_demo.py, whose heads are trained on the
fixed backbone by `needle_hf.finetune.heads`; one torch thread, 2 shared cores at load average 8):

| k | recall@k |
|---|---------:|
| 1 |   100.0% |
| 2 |   100.0% |
| 3 |   100.0% |

Exact calls 99.0% with the prompt's own tools, 98.0% with the top 3 of the 21 routed by the head.
Confidence: mean 0.597, ECE 0.393 (the answers are 99.0% right: the head is under-confident);
thresholds 0.25 / 0.5 / 0.75 keep 100% / 86% / 0% of the answers (98.8% right at 0.5, the deferred
ones 100% right). Right answers kept at 0.5: 86.0%; corrupted answers deferred: 39.0% (missing
argument 91.7% of 36, wrong argument 15.6% of 32, wrong tool 3.1% of 32): on a fixed backbone the
head sees a dropped argument, not a changed value or tool.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import load_demo_torch
    from train_demo import CONFIDENCE_THRESHOLD, calibration, confidences, routing_recall

    from needle_hf.demo.data import (
        DEMO_DATA_TOOLS, DEMO_HELD_OUT_SEED, DISTRACTOR_TOOLS, corrupt_demo_answers, make_demo_examples,
    )
    from needle_hf.finetune.heads import turn_ids
    from needle_hf.tools.tool_routing import NeedleToolCaller, embed_tools

    model, tokenizer = load_demo_torch()
    catalogue = DEMO_DATA_TOOLS + DISTRACTOR_TOOLS
    examples = make_demo_examples(args.prompts, seed=DEMO_HELD_OUT_SEED, split="held_out")
    recall = routing_recall(model, tokenizer, examples, catalogue, ks=(1, 2, 3))
    print(f"{len(examples)} held-out prompts, catalogue of {len(catalogue)} tools")
    print("| k | recall@k |\n|---|---|")
    for k in (1, 2, 3):
        print(f"| {k} | {recall[f'recall@{k}']:.1%} |")

    embeddings = embed_tools(model, tokenizer, catalogue)
    plain, routed = NeedleToolCaller(model, tokenizer), NeedleToolCaller(model, tokenizer, top_k_tools=3)
    scores, correct, routed_correct = [], [], []
    for example in examples:
        answer = plain(example["query"], example["tools"], max_new_tokens=48)
        scores.append(answer.confidence)
        correct.append(answer.tool_calls == example["answers"])
        routed_answer = routed(example["query"], catalogue, max_new_tokens=48, tool_embeddings=embeddings)
        routed_correct.append(routed_answer.tool_calls == example["answers"])
    print(f"\nexact calls with the prompt's own tools {np.mean(correct):.1%}; with the top 3 of {len(catalogue)}"
          f" routed by the contrastive head {np.mean(routed_correct):.1%}")

    figures = calibration(scores, correct)
    print(f"\naccuracy {figures['accuracy']:.1%}, mean confidence {figures['mean_confidence']:.3f},"
          f" ECE {figures['ece']:.3f}")
    scores, correct = np.asarray(scores), np.asarray(correct, float)
    print("| threshold | answers kept | accuracy of kept | accuracy of deferred |\n|---|---|---|---|")
    for threshold in (0.25, 0.5, 0.75, 0.9):
        kept = scores >= threshold
        accuracy_kept = f"{correct[kept].mean():.1%}" if kept.any() else "-"
        accuracy_deferred = f"{correct[~kept].mean():.1%}" if (~kept).any() else "-"
        print(f"| {threshold} | {kept.mean():.1%} | {accuracy_kept} | {accuracy_deferred} |")

    rng = random.Random(DEMO_HELD_OUT_SEED)
    right = confidences(model, [turn_ids(tokenizer, e) for e in examples])
    wrong = confidences(model, [turn_ids(tokenizer, {**e, "answers": corrupt_demo_answers(e, rng)}) for e in examples])
    kinds = {}
    rng = random.Random(DEMO_HELD_OUT_SEED)
    for example, score in zip(examples, wrong):
        (call,), (bad,) = example["answers"], corrupt_demo_answers(example, rng)
        kind = ("wrong tool" if bad["name"] != call["name"] else
                "missing argument" if len(bad["arguments"]) < len(call["arguments"]) else "wrong argument")
        kinds.setdefault(kind, []).append(score < CONFIDENCE_THRESHOLD)
    print(f"\nright answers kept at {CONFIDENCE_THRESHOLD}: {np.mean(np.asarray(right) >= CONFIDENCE_THRESHOLD):.1%};"
          f" corrupted answers deferred: {np.mean(np.asarray(wrong) < CONFIDENCE_THRESHOLD):.1%} ("
          + ", ".join(f"{kind} {np.mean(deferred):.1%} of {len(deferred)}" for kind, deferred in sorted(kinds.items()))
          + ")")


if __name__ == "__main__":
    main()
