"""Full-forward latency of FlaxNeedleForCausalLM vs the reference on the Needle 2 geometry.

128 tokens, batch 1, float32, after compile; both models run on the same weights in the same
process, interleaved, and the result is printed as a ratio (target: ours <= 1.0x the reference).

    .venv/bin/python benchmarks/forward.py [--tokens 128] [--repeats 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from common import make_base_checkpoint, median_seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig

    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        params, native = make_base_checkpoint(folder)
        ours = FlaxNeedleForCausalLM.from_pretrained(folder)
    reference = SimpleAttentionNetwork(TransformerConfig(**native))
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, 8192, (1, args.tokens)), jnp.int32)
    reference_params = jax.device_put(params)

    ours_fn = jax.jit(lambda p, t: ours(t, params=p).logits)
    reference_fn = jax.jit(lambda p, t: reference.apply({"params": p}, t))
    compile_seconds = {}
    for name, fn, p in (("needle-hf", ours_fn, ours.params), ("reference", reference_fn, reference_params)):
        start = time.perf_counter()
        jax.block_until_ready(fn(p, tokens))
        compile_seconds[name] = time.perf_counter() - start
    diff = float(np.abs(np.asarray(ours_fn(ours.params, tokens)) - np.asarray(reference_fn(reference_params, tokens))).max())

    ours_s, reference_s = [], []
    for _ in range(args.repeats):  # interleaved, so load changes hit both alike
        ours_s.append(median_seconds(lambda: jax.block_until_ready(ours_fn(ours.params, tokens)), 1))
        reference_s.append(median_seconds(lambda: jax.block_until_ready(reference_fn(reference_params, tokens)), 1))
    ours_ms, reference_ms = 1e3 * float(np.median(ours_s)), 1e3 * float(np.median(reference_s))
    print(f"Needle 2 geometry (base preset), float32, batch 1, {args.tokens} tokens, {args.repeats} runs each")
    print(f"  first call (compile + run): needle-hf {compile_seconds['needle-hf']:.1f} s, reference {compile_seconds['reference']:.1f} s")
    print(f"  max |logit difference|: {diff:.2e}")
    print(f"  median latency: needle-hf {ours_ms:.1f} ms, reference {reference_ms:.1f} ms")
    print(f"  ratio needle-hf / reference: {ours_ms / reference_ms:.2f}x  (target <= 1.00x)")


if __name__ == "__main__":
    main()
