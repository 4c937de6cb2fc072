"""Decoding with drafts (PyTorch and Flax, greedy, batch 1): MTP self-speculation and prompt lookup vs plain.

Rows: plain `generate`, `generate(use_mtp_head=True)` (the MTP head drafts t+2, the backbone verifies),
`generate(prompt_lookup_num_tokens=10)` (transformers' n-gram lookup in the prompt). Workloads: held-out
demo prompts (`needle_hf.demo.data`, ``split="held_out"``), and the Needle 2 geometry with random
weights (a 64-token random prompt, 64 new tokens). Every row must write the plain tokens (checked).
Reports tokens/s, the speed-up, and for MTP the acceptance rate (drafts kept / drafts made) and the
tokens per backbone forward (the prompt's forward included).

    .venv/bin/python benchmarks/speculative.py [--checkpoint PKL] [--flax] [--prompts 30] [--skip-base] [--mtp-steps N]

`--checkpoint` measures another native demo checkpoint (e.g. `scripts/train_demo.py --out /tmp/d/x.pkl`,
whose fine-tuning trains the MTP head too); `--flax` adds the jit-compiled Flax rows (the prompts left
padded to one length, so each row compiles once); `--mtp-steps N` fits the MTP head alone
(`train_mtp_head`, backbone frozen) on the demo data and measures again, for a checkpoint whose head
is untrained. The rows run prompt by prompt, in turn, so a drifting load weighs on all alike; tokens
per forward counts each prompt's own forward too. Every row wrote exactly the plain greedy tokens in
every run.

The shipped demo's MTP head is trained by scripts/train_demo.py (next-token + 0.3 x MTP loss).

Recorded runs (transformers 4.57, one torch thread, on 2 CPU cores shared with other jobs: load
average 9 for the demo rows, 12-14 for the others, so tokens/s and speed-ups are noisy; acceptance
and tokens per forward are not):

| workload                                   | decoding      | speed-up | acceptance | tokens/forward |
|--------------------------------------------|---------------|---------:|-----------:|---------------:|
| demo as shipped (MTP head trained)         | use_mtp       |    1.50x |     100.0% |           1.88 |
| demo as shipped (MTP head trained)         | prompt lookup |    1.69x |          - |              - |
| Needle 2 geometry, random weights          | use_mtp       |    0.94x |       0.0% |           1.00 |
| Needle 2 geometry, random weights          | prompt lookup |    6.83x |          - |              - |

(The random Needle 2 model repeats one token, which prompt lookup finds in its own output. Its row
predates the prompt's forward being counted in tokens/forward.) The MTP step's cost over plain
decoding is the second token of the backbone forward plus the one-block MTP forward, so the speed-up
approaches tokens/forward as the backbone dominates. Before the demo's MTP head was trained, 0.8% of
its drafts held (0.71x); fitting the head alone for 150 steps gave 72.2% (1.33x).

Flax (jit-compiled) on a demo trained the same way: use_mtp 1.33x at 100.0% acceptance, 1.90
tokens per forward (load average 6-8).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))


def run_rows(model, prompts, new_tokens):
    """{row: (seconds, generated tokens, drafted, accepted, forwards)} over `prompts` ([1, T] inputs)."""
    import torch

    rows = {"plain": {}, "use_mtp_head": {"use_mtp_head": True, "return_dict_in_generate": True},
            "prompt lookup": {"prompt_lookup_num_tokens": 10}}
    totals = {name: [0.0, 0, 0, 0, 0] for name in rows}  # seconds, tokens, drafted, accepted, forwards
    # Prompt by prompt, every row in turn: a load that drifts during the run weighs on all rows alike.
    for i, inputs in enumerate(prompts):
        reference = None
        for name, options in rows.items():
            model.generate(**inputs, do_sample=False, max_new_tokens=2, **options)  # warm the shapes
            began = time.perf_counter()
            with torch.no_grad():
                out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, **options)
            total = totals[name]
            total[0] += time.perf_counter() - began
            sequences = out.sequences if hasattr(out, "drafted") else out
            # transformers 4.57's prompt lookup can overshoot max_new_tokens by a few tokens; compare the budget.
            sequences = sequences[:, : inputs["input_ids"].shape[1] + new_tokens]
            if reference is None:
                reference = sequences
            elif not torch.equal(sequences, reference):
                raise AssertionError(f"{name} changed the greedy tokens of prompt {i}")
            total[1] += sequences.shape[1] - inputs["input_ids"].shape[1]
            if hasattr(out, "drafted"):  # forwards: the prompt's and the decoding steps'
                total[2], total[3], total[4] = total[2] + out.drafted, total[3] + out.accepted, total[4] + out.forwards + 1
    return {name: tuple(total) for name, total in totals.items()}


def train_mtp_head(model, tokenizer, *, steps: int, batch: int = 16, seed: int = 0):
    """Fit only the MTP head of ``model`` on the demo's training data (backbone frozen), in place.

    The demo script already trains the MTP head (next-token + MTP loss); this is the check that more
    head training would not raise its acceptance further: the same data, the MTP loss (token t + 2).
    """
    import torch

    from needle_hf.demo.data import DEMO_TRAIN_SEED, make_demo_examples

    texts = []
    for example in make_demo_examples(1000, seed=DEMO_TRAIN_SEED, split="train"):
        calls = [{"type": "function", "function": call} for call in example["answers"]]
        texts.append(tokenizer.apply_chat_template(
            [{"role": "user", "content": example["query"]}, {"role": "assistant", "tool_calls": calls}],
            tools=example["tools"], tokenize=False))
    encoded = tokenizer(texts, return_tensors="pt", add_special_tokens=False, padding=True)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    head = list(model.mtp.parameters())
    for parameter in head:
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(head, lr=3e-3)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = torch.from_numpy(rng.choice(len(texts), batch, replace=False))
        ids, mask = encoded["input_ids"][rows], encoded["attention_mask"][rows]
        out = model(ids, attention_mask=mask, return_mtp_logits=True, use_cache=False)
        target = ids[:, 2:].masked_fill(mask[:, 2:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(out.mtp_logits[:, :-2].reshape(-1, out.mtp_logits.shape[-1]),
                                                 target.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for parameter in head:
        parameter.requires_grad_(False)
    return float(loss.detach())


def report(title, results):
    print(f"\n{title}")
    print("| decoding | tokens/s | speed-up | acceptance | tokens per forward |")
    print("|---|---|---|---|---|")
    plain = "plain" if "plain" in results else "flax plain"
    base = results[plain][1] / results[plain][0]
    for name, (seconds, tokens, drafted, accepted, forwards) in results.items():
        rate = tokens / seconds
        extra = f"{accepted / drafted:.1%} | {tokens / forwards:.2f}" if drafted else "- | -"  # forwards: prompts' too
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {extra} |")


def run_flax_rows(folder, prompts, new_tokens, pad_id):
    """Flax rows over `prompts` (left padded to one length, so each row compiles once), both jit-compiled:
    {row: (seconds, generated tokens, drafted, accepted, forwards)}."""
    import jax
    import jax.numpy as jnp

    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    model = FlaxNeedleForCausalLM.from_pretrained(folder)
    length = max(p["input_ids"].shape[1] for p in prompts)
    padded = []
    for p in prompts:
        ids, mask = p["input_ids"].numpy(), p["attention_mask"].numpy()
        gap = length - ids.shape[1]
        padded.append((jnp.asarray(np.pad(ids, ((0, 0), (gap, 0)), constant_values=pad_id), jnp.int32),
                       jnp.asarray(np.pad(mask, ((0, 0), (gap, 0))), jnp.int32)))
    options = dict(do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad_id)
    plain = jax.jit(lambda x, m: model.generate(x, attention_mask=m, **options).sequences)
    drafted = jax.jit(lambda x, m: model.generate(x, attention_mask=m, use_mtp_head=True, **options))
    results, reference = {}, []
    for name, fn in (("flax plain", plain), ("flax use_mtp", drafted)):
        jax.block_until_ready(fn(*padded[0]))  # compile
        seconds = tokens = drafts = kept = forwards = 0
        for i, (ids, mask) in enumerate(padded):
            began = time.perf_counter()
            out = jax.block_until_ready(fn(ids, mask))
            seconds += time.perf_counter() - began
            sequences = np.asarray(out if name == "flax plain" else out.sequences)
            if name == "flax plain":
                reference.append(sequences)
            elif not np.array_equal(sequences, reference[i]):
                raise AssertionError(f"{name} changed the greedy tokens of prompt {i}")
            # generated tokens up to and including the EOS (the rest is padding)
            tokens += int(generated_length(sequences[0, length:], model.generation_config.eos_token_id))
            if name != "flax plain":
                drafts, kept, forwards = drafts + int(out.drafted), kept + int(out.accepted), forwards + int(out.forwards) + 1
        results[name] = (seconds, tokens, drafts, kept, forwards)
    return results


def generated_length(tokens, eos):
    """Tokens written up to and including the first EOS (all of them without one)."""
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    for i, token in enumerate(tokens):
        if int(token) in eos_ids:
            return i + 1
    return len(tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--checkpoint", help="native demo checkpoint (default: the shipped one), e.g. one "
                        "`scripts/train_demo.py --out` wrote")
    parser.add_argument("--skip-base", action="store_true")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--flax", action="store_true", help="also the Flax rows on the demo (jit-compiled)")
    parser.add_argument("--mtp-steps", type=int, default=0,
                        help="steps of MTP-head-only training on the demo data before measuring again (0: none)")
    args = parser.parse_args(argv)
    import torch
    from common import load_demo_torch
    from transformers import AutoModelForCausalLM

    from needle_hf.demo.data import DEMO_HELD_OUT_SEED, make_demo_examples

    model, tokenizer = load_demo_torch(args.checkpoint)
    prompts = []
    for example in make_demo_examples(args.prompts, seed=DEMO_HELD_OUT_SEED, split="held_out"):
        text = tokenizer.apply_chat_template([{"role": "user", "content": example["query"]}], tools=example["tools"],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, return_tensors="pt", add_special_tokens=False))
    if not args.skip_demo:
        name = args.checkpoint or "the shipped demo"
        report(f"demo ({name}): {len(prompts)} held-out prompts, up to 48 new tokens", run_rows(model, prompts, 48))
        if args.flax:
            folder = tempfile.mkdtemp()
            model.save_pretrained(folder)
            report(f"demo ({name}), Flax: the same prompts left padded to one length",
                   run_flax_rows(folder, prompts, 48, tokenizer.pad_token_id))
        if args.mtp_steps:
            loss = train_mtp_head(model, tokenizer, steps=args.mtp_steps)
            report(f"demo with its MTP head trained here ({args.mtp_steps} steps, final MTP loss {loss:.3f})",
                   run_rows(model, prompts, 48))

    if not args.skip_base:
        from common import make_base_checkpoint
        from needle_reference import BASE_NATIVE_CONFIG

        base_folder = tempfile.mkdtemp()
        make_base_checkpoint(base_folder)
        base = AutoModelForCausalLM.from_pretrained(base_folder).eval()
        ids = torch.from_numpy(np.random.default_rng(0).integers(14, BASE_NATIVE_CONFIG.get("vocab_size", 8192), (1, 64)))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        base.generation_config.eos_token_id = 1  # prompt lookup needs one; random weights rarely write it
        base.generation_config.pad_token_id = 0
        report("Needle 2 geometry, random weights: 64-token prompt, 64 new tokens", run_rows(base, [inputs], 64))
    print(f"\nload average (1, 5, 15 min): {os.getloadavg()}")


if __name__ == "__main__":
    main()
