"""Greedy generation speed on the Needle 2 geometry: needle-hf vs the reference, same run.

Workload: `base` preset (d=512, 27 layers), float32, a 64-token prompt and 64 new tokens, batch 1
and batch 8. Rows: our jit-compiled Flax `generate()`, our PyTorch `generate()` and PyTorch
`generate(cache_implementation="static", compile_config=...)` (compiled decoder layers; when torch
is installed),
and the reference's cached decoding (decode.py). Each row runs in its own process so that compile
time and peak RSS are its own. The bound is the all-core read bound: the weight bytes a decoding
step must read against the bandwidth a two-thread float32 matrix-vector product reads (a 1.6 GB
matrix, measured in the same run); the one-thread copy bandwidth is printed beside it.

Targets at batch 1: >= 5x the reference's tokens/s, >= 50% of the read bound, first call <= 30 s
(Flax) / <= 60 s (PyTorch compiled); batch 8 aggregate >= 4x batch 1.

    .venv/bin/python benchmarks/generate.py [--batches 1 8] [--impls flax torch ...] [--skip-reference]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

import numpy as np

from common import run_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_worker.py")


def decode_weight_bytes(folder: str) -> int:
    """Bytes of weights read per decoding step: all tensors except the engram tables (only a few
    rows of those are gathered per token)."""
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            if name.endswith(".tables") or name.startswith("mtp."):
                continue
            t = f.get_slice(name)
            total += int(np.prod(t.get_shape())) * np.dtype(t.get_dtype().lower().replace("f32", "float32")).itemsize
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-reference", action="store_true", help="omit the reference rows (their compile takes minutes)")
    parser.add_argument("--impls", nargs="+", help="only these rows (flax, torch, torch-static-compiled, reference)")
    args = parser.parse_args(argv)

    impls = ["flax"] + (["torch", "torch-static-compiled"] if importlib.util.find_spec("torch") else [])
    if not args.skip_reference:
        impls.append("reference")
    if args.impls:
        impls = [impl for impl in args.impls]
    with tempfile.TemporaryDirectory() as folder:
        # In a child: a measured worker starts from its parent's resident size (ru_maxrss counts the
        # pages it shares before exec), so this process never holds the weights or the copy buffers.
        prepared = run_worker(WORKER, ["prepare", "0", folder, "0", "0"])
        bandwidth = prepared["read_bandwidth_bytes_per_second"]
        copy_bandwidth = prepared["copy_bandwidth_bytes_per_second"]
        weight_bytes = decode_weight_bytes(folder)
        rows = {}
        for batch in args.batches:
            for impl in impls:
                rows[impl, batch] = run_worker(
                    WORKER, [impl, str(batch), folder, str(args.prompt_tokens), str(args.new_tokens)]
                )
                r = rows[impl, batch]
                print(f"  measured {impl:21s} batch {batch}: {r['tokens_per_s']:7.1f} tok/s", flush=True)

    bound = bandwidth / weight_bytes
    print(f"\nNeedle 2 geometry, float32, greedy, prompt {args.prompt_tokens} + {args.new_tokens} new tokens")
    print(f"read bound: {weight_bytes / 1e6:.0f} MB of weights per step, all-core read bandwidth {bandwidth / 1e9:.1f} GB/s"
          f" -> {bound:.0f} tok/s per sequence (one-thread copy bandwidth {copy_bandwidth / 1e9:.1f} GB/s)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    header = f"{'impl':21s} {'batch':>5s} {'tok/s':>8s} {'vs ref':>7s} {'% bound':>8s} {'1st call s':>10s} {'peak RSS GB':>11s}"
    print(header)
    for (impl, batch), r in rows.items():
        ref = rows.get(("reference", batch))
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:6.2f}x" if ref else "     -"
        per_seq_bound = 100 * r["tokens_per_s"] / batch / bound
        print(f"{impl:21s} {batch:5d} {r['tokens_per_s']:8.1f} {ratio:>7s} {per_seq_bound:7.0f}% {r['first_call_s']:10.1f}"
              f" {r['peak_rss_bytes'] / 2**30:11.2f}")
    for batch in args.batches:
        for impl in impls:
            if impl != "reference" and ("reference", batch) in rows:
                same = rows[impl, batch]["tokens"] == rows["reference", batch]["tokens"]
                print(f"batch {batch}: {impl} greedy tokens {'equal' if same else 'DIFFER from'} the reference's")
        if ("torch", batch) in rows and ("torch-static-compiled", batch) in rows:
            same = rows["torch", batch]["tokens"] == rows["torch-static-compiled", batch]["tokens"]
            print(f"batch {batch}: torch-static-compiled greedy tokens {'equal' if same else 'DIFFER from'} torch's")
    for impl in impls:
        if (impl, 1) in rows and (impl, 8) in rows:
            print(f"{impl}: batch 8 aggregate {rows[impl, 8]['tokens_per_s'] / rows[impl, 1]['tokens_per_s']:.1f}x batch 1 (>= 4x)")
    if ("reference", 1) in rows and ("flax", 1) in rows:
        r, ref = rows["flax", 1], rows["reference", 1]
        print(f"targets at batch 1: speed-up {r['tokens_per_s'] / ref['tokens_per_s']:.1f}x (>= 5x), "
              f"{100 * r['tokens_per_s'] / bound:.0f}% of bound (>= 50%), first call {r['first_call_s']:.1f} s (<= 30 s)")


if __name__ == "__main__":
    main()
