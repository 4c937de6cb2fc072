"""Needle 3 decode speed at the reference's default geometry (d=768, 20 layers, vocab 16384, random
weights, float32, batch 1): the PyTorch model's cached greedy decode beside the reference's own
`run.generate` loop (a jitted full forward over the whole buffer per token, which is how 3.2.8's
Python generation decodes), and the read bound: the bytes a step must read (every parameter except
the engram tables, of which a step reads only its rows) over the machine's measured copy bandwidth.

    OMP_NUM_THREADS=1 .venv-n3/bin/python benchmarks/needle3_decode.py [--prompt 64] [--new 32]

One torch thread: on a shared small CPU, OpenMP wake-ups cost more than these small products (a
decode step took 11 s on two threads under load, 0.23 s on one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def copy_bandwidth(megabytes: int = 256, rounds: int = 5) -> float:
    """Bytes per second of a large numpy copy (read + write counted as two transfers)."""
    source = np.ones(megabytes << 18, np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def torch_decode(prompt: list, new: int) -> tuple[float, list, object]:
    import torch

    from needle_hf.models.needle3 import Needle3Config
    from needle_hf.models.needle3.modeling_needle3 import Needle3ForCausalLM

    torch.manual_seed(0)
    model = Needle3ForCausalLM(Needle3Config()).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        seconds = time.perf_counter() - start
    return seconds, out[0, len(prompt):].tolist(), model


def reference_decode(model, prompt: list, new: int) -> float:
    """Seconds per token of the reference's generate loop (compile excluded), on the same weights."""
    import jax
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig

    from needle_hf.models.needle3.weight_names_needle3 import hf_to_native

    config = TransformerConfig(dtype="float32", remat=False)
    flat = hf_to_native({k: v.detach().numpy() for k, v in model.state_dict().items() if not k.endswith(("permutation_1", "permutation_2"))}, model.config)
    params: dict = {}
    for path, value in flat.items():
        node = params
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    network = SimpleAttentionNetwork(config)
    length = len(prompt) + new
    forward = jax.jit(lambda p, t: network.apply({"params": p}, t))
    buffer = jnp.zeros((1, length), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    forward(params, buffer).block_until_ready()  # compile
    start = time.perf_counter()
    for position in range(len(prompt) - 1, length - 1):
        token = int(jnp.argmax(forward(params, buffer)[0, position]))
        buffer = buffer.at[0, position + 1].set(token)
    return (time.perf_counter() - start) / new


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args()
    prompt = [2] + [int(i) for i in np.random.default_rng(0).integers(20, 16000, args.prompt - 1)]
    seconds, _, model = torch_decode(prompt, args.new)
    step_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.endswith(".tables"))
    bandwidth = copy_bandwidth()
    bound = bandwidth / step_bytes
    result = {
        "geometry": "Needle3Config() defaults (d=768, 20 layers, vocab 16384), float32, batch 1",
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch_cached_tokens_per_s": round(args.new / seconds, 2),
        "read_bound_tokens_per_s": round(bound, 1),
        "torch_percent_of_read_bound": round(100 * args.new / seconds / bound, 1),
    }
    if not args.skip_reference:
        per_token = reference_decode(model, prompt, args.new)
        result["reference_run_generate_tokens_per_s"] = round(1 / per_token, 2)
        result["torch_over_reference"] = round(args.new / seconds * per_token, 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
