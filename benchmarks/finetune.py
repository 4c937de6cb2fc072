"""LoRA fine-tuning step: needle-hf (PyTorch + PEFT, and Flax + optax) vs the reference's step.

The Needle 2 geometry (`base` preset), float32 on the CPU, LoRA rank 8 on the five attention
projections of every backbone layer, batch 4 x 128 tokens with the loss on the second half of each
row. One training step = forward, backward, gradient clipping to 1.0 and an AdamW update:
  - reference: `finetune_local`'s jit-compiled step, built from the reference's own pieces
    (`lora_target_paths`, `init_lora`, `merge_lora`, `SimpleAttentionNetwork`, optax), no QAT;
  - needle-hf torch: `NeedleForCausalLM` wrapped by PEFT (`needle_lora_config`),
    `needle_causal_lm_loss`, `torch.nn.utils.clip_grad_norm_`, `torch.optim.AdamW`;
  - needle-hf flax: `needle_hf.finetune.trainer_flax.make_train_step` (LoRA applied beside the frozen
    kernels, x @ W + (x @ A) @ (s B), not merged), the layers rematerialised in the backward pass
    (`gradient_checkpointing=True`) as the reference's are (its `remat=True` default).
Each runs in its own process (own compile caches and peak RSS), on the same weights and tokens; the
figures are the median step time after two warm-up steps and the process's peak RSS, and the ratios
are against the reference in the same run (target: <= 1.0x).

    .venv/bin/python benchmarks/finetune.py [--steps 5] [--torch-threads N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from common import emit, make_base_checkpoint, peak_rss_bytes, run_worker

RANK, ALPHA = 8, 16.0
BATCH, TOKENS = 4, 128


def batch_arrays():
    """input_ids [B, T] and the loss mask [B, T] (1 on the second half: a prompt, then its target)."""
    ids = np.random.default_rng(0).integers(14, 8192, (BATCH, TOKENS)).astype(np.int32)
    mask = np.zeros((BATCH, TOKENS), np.float32)
    mask[:, TOKENS // 2:] = 1.0
    return ids, mask


def timed_steps(step, steps: int) -> tuple[float, float]:
    """(first step seconds, median seconds of `steps` steps after two warm-up ones)."""
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first, float(np.median(times))


def reference_worker(steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig
    from needle.model.finetune import init_lora, lora_target_paths, merge_lora

    with tempfile.TemporaryDirectory() as folder:
        params, native = make_base_checkpoint(folder)
    params = jax.device_put(params)
    model = SimpleAttentionNetwork(TransformerConfig(**native))
    lora = init_lora(params, lora_target_paths(params), RANK, jax.random.PRNGKey(0))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    opt_state = optimizer.init(lora)
    ids, mask = (jnp.asarray(a) for a in batch_arrays())

    def loss_fn(adapter):
        logits = model.apply({"params": merge_lora(params, adapter, ALPHA / RANK)}, ids)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
        return (ce * mask[:, 1:]).sum() / jnp.maximum(mask[:, 1:].sum(), 1.0)

    @jax.jit
    def train_step(adapter, state):
        loss, grads = jax.value_and_grad(loss_fn)(adapter)
        updates, state = optimizer.update(grads, state, adapter)
        return optax.apply_updates(adapter, updates), state, loss

    carry = [lora, opt_state]

    def step():
        carry[0], carry[1], loss = train_step(*carry)
        jax.block_until_ready(loss)

    first, median = timed_steps(step, steps)
    return {"first_s": first, "step_s": median, "peak_rss": peak_rss_bytes()}


def flax_worker(steps: int) -> dict:
    import jax

    from needle_hf.finetune.trainer_flax import finetune_optimizer, init_lora, make_train_step
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        make_base_checkpoint(folder)
        model = FlaxNeedleForCausalLM.from_pretrained(folder, gradient_checkpointing=True)
    ids, mask = batch_arrays()
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": np.where(mask > 0, ids, -100)}
    lora = init_lora(model.params, rank=RANK, key=jax.random.PRNGKey(0))
    optimizer = finetune_optimizer(learning_rate=1e-4, total_steps=1000)
    train_step = make_train_step(model, optimizer, lora_scale=ALPHA / RANK)
    carry = [lora, optimizer.init(lora)]

    def step():
        carry[0], carry[1], loss = train_step(carry[0], carry[1], model.params, batch)
        jax.block_until_ready(loss)

    first, median = timed_steps(step, steps)
    return {"first_s": first, "step_s": median, "peak_rss": peak_rss_bytes()}


def torch_worker(steps: int, threads: int) -> dict:
    import torch
    from peft import get_peft_model

    from needle_hf.finetune.trainer import needle_causal_lm_loss, needle_lora_config
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as folder:
        make_base_checkpoint(folder)
        model = NeedleForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(model, needle_lora_config(rank=RANK, alpha=ALPHA)).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids, mask = batch_arrays()
    ids = torch.from_numpy(ids).long()
    labels = torch.where(torch.from_numpy(mask) > 0, ids, -100)

    def step():
        loss = needle_causal_lm_loss(model(input_ids=ids, use_cache=False).logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first, median = timed_steps(step, steps)
    return {"first_s": first, "step_s": median, "peak_rss": peak_rss_bytes()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                        help="torch intra-op threads (default: every core, as the reference's JAX step uses; "
                             "on busy cores one is usually fastest)")
    parser.add_argument("--worker", choices=("reference", "flax", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "reference":
        return emit(reference_worker(args.steps))
    if args.worker == "flax":
        return emit(flax_worker(args.steps))
    if args.worker == "torch":
        return emit(torch_worker(args.steps, args.torch_threads))

    results = {}
    for name in ("reference", "torch", "flax"):  # one process each, one after the other
        results[name] = run_worker(__file__, ["--worker", name, "--steps", str(args.steps),
                                              "--torch-threads", str(args.torch_threads)])
    reference = results["reference"]
    print(f"LoRA fine-tuning step, Needle 2 geometry (base preset), float32, rank {RANK}, "
          f"batch {BATCH} x {TOKENS} tokens, median of {args.steps} steps")
    for name, label in (("reference", "reference (jax)"), ("torch", f"needle-hf torch+PEFT ({args.torch_threads} thr.)"),
                        ("flax", "needle-hf flax+optax")):
        r = results[name]
        print(f"  {label:<34} step {r['step_s']:6.2f} s  ({r['step_s'] / reference['step_s']:.2f}x)   "
              f"peak RSS {r['peak_rss'] / 2**30:5.2f} GiB ({r['peak_rss'] / reference['peak_rss']:.2f}x)   "
              f"first step {r['first_s']:6.1f} s")
    print("  ratios are against the reference in this run (target <= 1.00x)")


if __name__ == "__main__":
    main()
