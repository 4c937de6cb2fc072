"""Support of the vLLM suite: engines sized for a small shared CPU machine, perturbed checkpoints."""

from __future__ import annotations

import contextlib
import gc
import os

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
