"""Shared helpers for the benchmarks: Needle 2 checkpoints, timing, memory and bandwidth figures.

Benchmarks compare needle-hf with the reference (cactus-needle 2.0.15) measured in the same run, on
randomly initialised weights of the Needle 2 geometry (`base` preset), in float32 on the CPU.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))  # reference-checkpoint support shared with the tests


def make_base_checkpoint(folder: str, seed: int = 0, with_heads: bool = False):
    """(native params, native config) of the Needle 2 geometry, also written as an HF folder."""
    from flax_support import write_hf_folder
    from needle_reference import BASE_NATIVE_CONFIG, make_native_params

    params = make_native_params(BASE_NATIVE_CONFIG, seed, with_heads=with_heads)
    write_hf_folder(folder, BASE_NATIVE_CONFIG, params)
    return params, dict(BASE_NATIVE_CONFIG)


def load_demo_torch(checkpoint: str = None):
    """(PyTorch model, tokenizer) of the shipped demo checkpoint (or another native demo checkpoint, such
    as one `scripts/train_demo.py --out` wrote), converted into a temporary folder; one torch thread."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import needle_hf  # noqa: F401  (registers Needle with the Auto classes)
    from needle_hf.conversion.convert import convert

    torch.set_num_threads(1)
    folder = os.path.join(tempfile.mkdtemp(), "demo")
    convert(checkpoint or os.path.join(REPO, "needle_hf", "demo", "needle2-demo.pkl"), folder,
            tokenizer=os.path.join(REPO, "needle_hf", "demo", "tokenizer.model"))
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls (fn must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def copy_bandwidth_bytes_per_second(size_bytes: int = 512 * 2**20, repeats: int = 10) -> float:
    """Bytes read per second by a large numpy copy (each copy reads and writes `size_bytes`).

    The fastest of `repeats` copies after a warm-up one (which faults the pages in): the bound is
    what the memory system sustains, and a slower copy measured something else as well (writeback
    of freshly written files, another process).
    """
    src = np.ones(size_bytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        fastest = min(fastest, time.perf_counter() - start)
    return size_bytes / fastest


def run_worker(script: str, args: list[str], timeout: int = 3600) -> dict:
    """Run `python script args...` in a fresh process (own compile caches and peak RSS); parse its JSON line.

    Inductor's on-disk cache is an empty folder of the worker's own, so a first call is a cold compile.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as inductor_cache:
        done = subprocess.run(
            [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
            env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache),
        )
    if done.returncode != 0:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def emit(result: dict):
    """A worker's single JSON result line on stdout."""
    print(json.dumps(result), flush=True)
