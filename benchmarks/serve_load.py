"""Serving load: N concurrent OpenAI clients against `vllm serve` beside HF `pipeline` batches, same run.

Workload: the demo checkpoint (needle_hf/demo/) and the demo tool-calling chats (the four queries of
the pipeline suite, cycled), greedy, at most 48 new tokens each, float32 on the CPU.

Rows:
- ``hf_pipeline``: `pipeline("text-generation")` over all chats with ``batch_size`` = N (one thread);
- ``vllm dp=K``: `vllm serve FOLDER --enable-auto-tool-choice --tool-call-parser needle
  [--data-parallel-size K]`, N client threads each sending its share of the chats one after another
  with the official `openai` client (one OpenMP thread per engine replica, unpinned). Errors are failed
  requests and answers without the expected tool call.
- executor ``mp`` (vLLM's default on the CPU): each engine replica is two processes, the engine core
  and a model worker, handing each step over through shared memory; ``uni``: the model runs inside
  the engine-core process (``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
  in the server's environment, without which vLLM's CPU platform swaps ``uni`` for ``mp``). A reader of vLLM's
  shared-memory queue spins (`sched_yield`) for up to a second after each message, so with ``mp`` the
  waiting side of every hand-over keeps a core busy; on a 2-core machine that is the model's core.

Reported: requests, errors, generated tokens/s, p50/p99 request latency, and vLLM's speed-up over the
pipeline (goal >= 3x).

    .venv-vllm/bin/python benchmarks/serve_load.py [--clients 32] [--requests 128] [--data-parallel-sizes 1 2]
        [--executors uni mp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO / "tests" / "serving" / "vllm")]  # demo prompts and server helpers

MAX_NEW_TOKENS = 48


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def chats(count):
    from demo_support import TOOL_QUERIES

    return [TOOL_QUERIES[i % len(TOOL_QUERIES)] for i in range(count)]


def hf_pipeline_row(folder, workload, batch_size):
    import torch
    from transformers import AutoTokenizer, pipeline

    import needle_hf  # noqa: F401

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    generator = pipeline("text-generation", model=str(folder), tokenizer=tokenizer, device="cpu")
    conversations = [[{"role": "user", "content": query}] for _, query, _ in workload]
    tools = [tools for tools, _, _ in workload]
    # The chat template takes the tools per call: render the prompts, then batch the text.
    prompts = [tokenizer.apply_chat_template(c, tools=t, add_generation_prompt=True, tokenize=False)
               for c, t in zip(conversations, tools)]
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_full_text=False)
    generator(prompts[:2], batch_size=2, **kwargs)  # warm-up
    started = time.perf_counter()
    outputs = generator(prompts, batch_size=batch_size, **kwargs)
    seconds = time.perf_counter() - started
    tokens = sum(len(tokenizer(o[0]["generated_text"], add_special_tokens=False)["input_ids"]) + 1 for o in outputs)
    return {"row": "hf_pipeline", "batch_size": batch_size, "requests": len(prompts), "seconds": seconds,
            "tokens": tokens, "tokens_per_second": tokens / seconds}


def vllm_row(folder, workload, clients, data_parallel_size, log_dir, *, executor="mp"):
    from openai import OpenAI

    from vllm_support import vllm_server

    args = ["--enable-auto-tool-choice", "--tool-call-parser", "needle", "--dtype", "float32",
            "--max-model-len", "512", "--max-num-seqs", str(clients)]
    if data_parallel_size > 1:
        # One API server in front of the replicas (`vllm serve` would start one per replica).
        args += ["--data-parallel-size", str(data_parallel_size), "--api-server-count", "1"]
    # One compute thread per replica, not pinned to a core: on a machine shared with other jobs a
    # pinned replica waits for its core while another is idle (see the README's serving figures).
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    if executor == "uni":  # the model in the engine-core process (see the module docstring)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        args += ["--distributed-executor-backend", "uni"]  # vLLM's default with data parallelism is mp
    log = Path(log_dir) / f"serve-dp{data_parallel_size}-{executor}.log"
    with vllm_server(folder, *args, log_path=log, env=env) as base_url:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        def one(item):
            tools, query, tool = item
            started = time.perf_counter()
            try:
                response = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": query}], tools=tools, temperature=0,
                    max_tokens=MAX_NEW_TOKENS)
            except Exception as error:  # a failed request is counted, not fatal
                return time.perf_counter() - started, 0, f"{type(error).__name__}: {error}"
            seconds = time.perf_counter() - started
            calls = response.choices[0].message.tool_calls or []
            problem = None if calls and calls[0].function.name == tool else f"no {tool} call: {response.choices[0].message}"
            return seconds, response.usage.completion_tokens, problem

        one(workload[0])  # warm-up
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(one, workload))
        seconds = time.perf_counter() - started
    latencies = [r[0] for r in results]
    errors = [r[2] for r in results if r[2]]
    tokens = sum(r[1] for r in results)
    return {"row": f"vllm dp={data_parallel_size} {executor}", "clients": clients, "requests": len(workload),
            "errors": len(errors), "first_error": errors[0] if errors else None, "seconds": seconds,
            "tokens": tokens, "tokens_per_second": tokens / seconds,
            "p50_latency_s": statistics.median(latencies), "p99_latency_s": percentile(latencies, 99)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--data-parallel-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--executors", nargs="+", choices=["uni", "mp"], default=["uni", "mp"],
                        help="uni: the model in the engine-core process; mp: in a worker process (vLLM's CPU default)")
    args = parser.parse_args()

    from vllm_support import demo_folder

    with tempfile.TemporaryDirectory() as scratch:
        folder = demo_folder(Path(scratch) / "needle2-demo-hf")
        workload = chats(args.requests)
        rows = [hf_pipeline_row(folder, workload, args.clients)]
        print(json.dumps(rows[-1]), flush=True)
        for size in args.data_parallel_sizes:
            for executor in args.executors:
                try:
                    rows.append(vllm_row(folder, workload, args.clients, size, scratch, executor=executor))
                except RuntimeError as error:  # e.g. a replica count this machine cannot start
                    rows.append({"row": f"vllm dp={size} {executor}", "failed": str(error)[-1500:]})
                print(json.dumps(rows[-1]), flush=True)
    hf = rows[0]["tokens_per_second"]
    for row in rows[1:]:
        if "tokens_per_second" in row:
            print(f"{row['row']}: {row['tokens_per_second']:.1f} tok/s = {row['tokens_per_second'] / hf:.2f}x the "
                  f"HF pipeline's {hf:.1f} tok/s; p50 {row['p50_latency_s']:.2f} s, p99 {row['p99_latency_s']:.2f} s, "
                  f"{row['errors']} errors in {row['requests']} requests")
        else:
            print(f"{row['row']}: did not run ({row['failed'].splitlines()[-1] if row['failed'] else ''})")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
