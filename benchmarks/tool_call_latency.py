"""One tool call end to end: `needle_hf.Needle.complete()` against the reference's Python path, same weights.

Workload: the `base` geometry (d=512, 27 layers, float32, random weights with every head), five
tools (a prompt of about 480 tokens with the demo tokenizer), one query, at most 25 new tokens (a
typical call's length). With random weights the grammar-constrained answer ends early (the
empty call list, 6 tokens with EOS): the reference is timed on the same number of new tokens for
the ratio, and every row's decode rate is measured on 25 unconstrained tokens. Rows, each in its
own process (its own compile caches and peak RSS):

  - ``torch``: `Needle(folder)`, the default path (no flags, no thread setting): PyTorch, grammar
    on, retrieval off (five tools), confidence head read off the decoding forwards.
  - ``torch-compiled``: `Needle(folder, compile=True)`: the same loop over a static cache, each step
    after the prompt through the compiled layer programs; its first call compiles them.
  - ``torch-2threads``, ``torch-compiled-2threads``: the two rows above with ``cpu_threads=2`` (the
    SDK's default is one thread, which a busy machine needs; an idle one can give both cores).
  - ``flax``: `Needle(folder, framework="flax")`, confidence head read off the decoding steps too.
  - ``reference``: the reference's own Python inference path on the same weights,
    `needle.model.run.build_prompt` + `run.generate` (what `needle run` does; its native engine is
    closed and not used), greedy, no grammar.

Per row: prompt tokens, time to first token (prefill + first step), prefill tok/s, decode tok/s
after the first token, total ms of the call (the median of 3 after a warm-up call, whose time is
reported as the first call); the reference's total for the same number of new tokens and for 25.
Bounds: prefill against this machine's measured float32 GEMM rate (2 x weight-matmul parameters x
prompt tokens of work); decode against the read bound (weight bytes a step reads / the bandwidth a
two-thread matrix-vector product reaches). The same two rates on one thread are printed beside them:
the ceiling of a one-thread row's phases as a share of those bounds.

    .venv/bin/python benchmarks/tool_call_latency.py [--rows torch flax ...] [--skip-reference]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

import numpy as np

from common import REPO, emit, make_base_checkpoint, peak_rss_bytes, run_worker

QUERY = "Set an alarm for 6:30 tomorrow and call it gym."
NEW_TOKENS = 25
REPEATS = 3
TOKENIZER = os.path.join(REPO, "needle_hf", "demo", "tokenizer.model")
ROWS = ("torch", "torch-compiled", "torch-2threads", "torch-compiled-2threads", "flax", "reference")


def _tool(name, description, **properties):
    return {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": t, "description": d} for k, (t, d) in properties.items()},
        "required": list(properties)}}


TOOLS = [
    _tool("set_alarm", "Set an alarm on the phone at a given time, optionally with a label shown when it rings.",
          time=("string", "HH:MM, 24-hour clock"), label=("string", "Short label for the alarm.")),
    _tool("send_message", "Send a text message to one contact from the address book.",
          to=("string", "Name of the contact."), text=("string", "Text to send, verbatim.")),
    _tool("play_music", "Play a song, album or playlist on the phone's speaker.",
          song=("string", "Song, album or playlist title.")),
    _tool("set_temperature", "Set the home thermostat to a target temperature in degrees Celsius.",
          degrees=("integer", "Target temperature in Celsius, 10 to 30.")),
    _tool("get_weather", "Get the weather forecast for a city for today or the next days.",
          city=("string", "City name."), days=("integer", "How many days ahead, 0 for today.")),
]


def _median_envelope(call):
    call()  # warm-up (compiles)
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        envelope = call()
        runs.append((time.perf_counter() - start, envelope))
    runs.sort(key=lambda item: item[0])
    return runs[len(runs) // 2]


def measure_needle(folder, row):
    import needle_hf

    start = time.perf_counter()
    agent = needle_hf.Needle(folder, tools=TOOLS, framework="flax" if row == "flax" else "pt",
                             compile=row.startswith("torch-compiled"), cpu_threads=2 if row.endswith("2threads") else 1)
    agent.reset()
    first = agent.complete(QUERY, NEW_TOKENS)
    first_call_s = time.perf_counter() - start

    def call():
        agent.reset()
        return agent.complete(QUERY, NEW_TOKENS)

    seconds, envelope = _median_envelope(call)
    agent.reset()
    agent._messages.append({"role": "user", "content": QUERY})
    prompt = agent._prompt_ids(NEW_TOKENS)
    generation = agent._backend.generate([prompt], max_new_tokens=NEW_TOKENS, tools=agent._offered)[0]
    new = len(generation.ids) + int(generation.finished)
    agent._backend.generate([prompt], max_new_tokens=NEW_TOKENS)  # unconstrained: compiles its shapes
    free = agent._backend.generate([prompt], max_new_tokens=NEW_TOKENS)[0]
    free_new = len(free.ids) + int(free.finished)
    return {"row": row, "first_call_s": first_call_s, "total_s": seconds, "prompt_tokens": len(prompt),
            "new_tokens": new, "ttft_s": generation.prefill_seconds,
            "decode_s_per_token": free.decode_seconds / max(free_new - 1, 1), "decode_tokens": free_new,
            "calls": envelope["function_calls"], "success": envelope["success"], "error_code": envelope["error_code"],
            "peak_rss_bytes": peak_rss_bytes(), "first_envelope_ok": first["error_code"] in (None, "truncated")}


def measure_reference(folder, row, same_call_tokens=NEW_TOKENS):
    import jax
    from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig
    from needle.model.run import build_prompt, generate
    from needle.model.tokenizer import SANTokenizer

    with open(os.path.join(folder, "native.pkl"), "rb") as handle:
        native = pickle.load(handle)
    config = TransformerConfig(**native["config"])
    model = SimpleAttentionNetwork(config)
    params = jax.device_put(native["params"])
    tokenizer = SANTokenizer(TOKENIZER)
    prompt = build_prompt(QUERY, TOOLS)

    def timed(new_tokens):
        start = time.perf_counter()
        generate(model, params, tokenizer, prompt, max_new_tokens=new_tokens, stream=False)
        return time.perf_counter() - start

    start = time.perf_counter()
    timed(1), timed(NEW_TOKENS)  # compiles: the buffer length depends on max_new_tokens
    first_call_s = time.perf_counter() - start
    timed(same_call_tokens)
    ttft = statistics.median(timed(1) for _ in range(REPEATS))
    total = statistics.median(timed(same_call_tokens) for _ in range(REPEATS))
    total_25 = statistics.median(timed(NEW_TOKENS) for _ in range(REPEATS))
    return {"row": row, "first_call_s": first_call_s, "total_s": total, "total_s_at_25": total_25,
            "prompt_tokens": 1 + len(tokenizer.encode(prompt)),
            "new_tokens": same_call_tokens, "ttft_s": ttft, "decode_s_per_token": (total_25 - ttft) / (NEW_TOKENS - 1),
            "decode_tokens": NEW_TOKENS,
            "peak_rss_bytes": peak_rss_bytes()}


def gemm_flops_per_second(size: int = 1024, repeats: int = 5, *, threads: int = 2) -> float:
    """Float32 GEMM rate on ``threads`` threads (torch; by default both cores), the fastest of `repeats`
    after a warm-up."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    fastest = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / fastest


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prepare(folder):
    from generate_worker import read_bandwidth_bytes_per_second

    from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer

    params, native = make_base_checkpoint(folder, with_heads=True)
    with open(os.path.join(folder, "native.pkl"), "wb") as handle:
        pickle.dump({"format_version": 2, "params": params, "config": native, "step": 0, "run": {}}, handle)
    build_fast_tokenizer(TOKENIZER).save_pretrained(folder)
    os.sync()
    # The bounds are the two-thread figures; the one-thread ones are what a one-thread row (the SDK's
    # default) can reach at most, printed beside them.
    emit({"gemm_flops_per_second": gemm_flops_per_second(),
          "read_bandwidth_bytes_per_second": read_bandwidth_bytes_per_second(),
          "one_thread_gemm_flops_per_second": gemm_flops_per_second(threads=1),
          "one_thread_read_bandwidth_bytes_per_second": read_bandwidth_bytes_per_second(threads=1)})


def weight_counts(folder) -> tuple[int, int]:
    """(matmul parameters a token's forward multiplies by, bytes a decoding step reads): every weight but
    the engram tables (gathered, a few rows per token), the MTP head and the pooling heads."""
    from safetensors import safe_open

    matmul = 0
    with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as handle:
        for name in handle.keys():
            if name.endswith(".tables") or name.startswith("mtp.") or "_head." in name:
                continue
            matmul += int(np.prod(handle.get_slice(name).get_shape()))
    return matmul, 4 * matmul


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--worker", nargs="+", metavar="ROW FOLDER [TOKENS]", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        row, folder = args.worker[:2]
        if row == "prepare":
            return prepare(folder)
        if row == "reference":
            emit(measure_reference(folder, row, *map(int, args.worker[2:])))
        else:
            emit(measure_needle(folder, row))
        return
    rows = [row for row in args.rows if not (args.skip_reference and row == "reference")]
    with tempfile.TemporaryDirectory() as root:
        folder = os.path.join(root, "base")
        machine = run_worker(__file__, ["--worker", "prepare", folder])
        matmul, step_bytes = weight_counts(folder)
        results = {}
        for row in rows:  # each row's raw figures as soon as they exist (the reference row takes minutes)
            # the reference is also timed on the new tokens of the first row's call (the same call's length)
            same_call = [str(next(iter(results.values()))["new_tokens"])] if row == "reference" and results else []
            results[row] = run_worker(__file__, ["--worker", row, folder, *same_call])
            print(json.dumps(results[row]), flush=True)
    gemm, bandwidth = machine["gemm_flops_per_second"], machine["read_bandwidth_bytes_per_second"]
    decode_bound = bandwidth / step_bytes
    print(f"machine: float32 GEMM {gemm / 1e9:.1f} GFLOP/s (2 threads); read bandwidth {bandwidth / 1e9:.1f} GB/s"
          f" -> decode bound {decode_bound:.1f} tok/s ({step_bytes / 1e6:.0f} MB of weights per step)")
    gemm_1 = machine["one_thread_gemm_flops_per_second"]
    bandwidth_1 = machine["one_thread_read_bandwidth_bytes_per_second"]
    print(f"one thread: GEMM {gemm_1 / 1e9:.1f} GFLOP/s ({100 * gemm_1 / gemm:.0f}% of the prefill bound), read"
          f" {bandwidth_1 / 1e9:.1f} GB/s ({100 * bandwidth_1 / bandwidth:.0f}% of the decode bound): the most a"
          " one-thread row's phases can reach")
    print(f"{'row':<16}{'prompt':>7}{'new':>5}{'TTFT ms':>9}{'prefill tok/s':>15}{'(bound)':>9}"
          f"{'decode tok/s':>14}{'(bound)':>9}{'total ms':>10}{'first call s':>14}{'peak RSS MB':>13}")
    reference = results.get("reference")
    for row, r in results.items():
        prefill_tps = r["prompt_tokens"] / r["ttft_s"]
        prefill_bound = gemm / (2 * matmul)
        decode_tps = 1.0 / r["decode_s_per_token"]
        print(f"{row:<16}{r['prompt_tokens']:>7}{r['new_tokens']:>5}{1e3 * r['ttft_s']:>9.0f}{prefill_tps:>15.0f}"
              f"{100 * prefill_tps / prefill_bound:>8.0f}%{decode_tps:>14.1f}{100 * decode_tps / decode_bound:>8.0f}%"
              f"{1e3 * r['total_s']:>10.0f}{r['first_call_s']:>14.1f}{r['peak_rss_bytes'] / 2**20:>13.0f}")
    if reference:
        for row, r in results.items():
            if row != "reference":
                print(f"{row}: {r['total_s'] / reference['total_s']:.3f} x the reference's time for the same call"
                      f" ({reference['new_tokens']} new tokens; goal <= 1/3 for the default row 'torch')")
        print(f"reference at {NEW_TOKENS} new tokens: {1e3 * reference['total_s_at_25']:.0f} ms")
    print(json.dumps({"machine": machine, "results": results}, default=str))


if __name__ == "__main__":
    sys.exit(main())
