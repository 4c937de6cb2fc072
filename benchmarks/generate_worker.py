"""One measurement for benchmarks/generate.py, in its own process (own compile cache and peak RSS).

    python benchmarks/generate_worker.py IMPL BATCH CHECKPOINT_DIR PROMPT_TOKENS NEW_TOKENS
IMPL: flax (our jit-compiled generate()), torch (our PyTorch generate(), default settings),
torch-static-compiled (`generate(cache_implementation="static", compile_config=...)`: a StaticCache
and compiled decoder layers and engram memory in every decoding step),
reference (cactus-needle's cached decoding, decode.py's forward_cached loop as in its
generate_cached). Prints one JSON line.
IMPL prepare (other arguments ignored) writes the `base`-preset checkpoint into CHECKPOINT_DIR, as an
HF folder and as the reference's native.pkl, and reports this machine's copy bandwidth and its
all-core read bandwidth.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import numpy as np

from common import copy_bandwidth_bytes_per_second, emit, make_base_checkpoint, median_seconds, peak_rss_bytes


def prompt_ids(batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(0).integers(4, 8192, (batch, length)).astype(np.int32)


def measure_flax(folder, batch, prompt_len, new_tokens):
    import jax

    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    model = FlaxNeedleForCausalLM.from_pretrained(folder)
    ids = prompt_ids(batch, prompt_len)
    generate = jax.jit(
        lambda p, x: model.generate(x, params=p, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None).sequences
    )
    start = time.perf_counter()
    first = jax.block_until_ready(generate(model.params, ids))
    compile_s = time.perf_counter() - start
    seconds = median_seconds(lambda: jax.block_until_ready(generate(model.params, ids)), 3)
    return compile_s, seconds, np.asarray(first)[:, prompt_len:]


def measure_torch(folder, batch, prompt_len, new_tokens):
    import torch

    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    torch.set_grad_enabled(False)
    # Default settings: generate() itself decodes on one intra-op thread (see its docstring). With
    # two OpenMP threads every op that opens a parallel region waits for the second thread to be
    # scheduled, which on this shared 2-core machine made generate() ~9x slower (2.1 vs 18.6 tok/s
    # at batch 1, 8.5 vs 77 at batch 8).
    model = NeedleForCausalLM.from_pretrained(folder).eval()
    ids = torch.as_tensor(prompt_ids(batch, prompt_len), dtype=torch.long)

    def run():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )

    start = time.perf_counter()
    first = run()
    compile_s = time.perf_counter() - start
    seconds = median_seconds(run, 3)
    return compile_s, seconds, first[:, prompt_len:].numpy()


def measure_torch_static_compiled(folder, batch, prompt_len, new_tokens):
    """The documented fast path: `generate(cache_implementation="static", compile_config=...)`, whose
    decoding steps run each decoder layer and the engram memory compiled (`NeedleForCausalLM.get_compiled_call`; the prefill
    stays eager). Threads as `generate()` picks them, like the torch row."""
    import torch
    from transformers import CompileConfig

    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    torch.set_grad_enabled(False)
    model = NeedleForCausalLM.from_pretrained(folder).eval()
    ids = torch.as_tensor(prompt_ids(batch, prompt_len), dtype=torch.long)
    compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")

    def run():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, cache_implementation="static", compile_config=compile_config,
        )

    start = time.perf_counter()
    first = run()
    compile_s = time.perf_counter() - start
    seconds = median_seconds(run, 3)
    return compile_s, seconds, first[:, prompt_len:].numpy()


def read_bandwidth_bytes_per_second(size_bytes: int = 1600 * 2**20, repeats: int = 5, *, threads: int = 2) -> float:
    """Bytes per second a float32 matrix-vector product on ``threads`` threads reads from a `size_bytes`
    matrix: what a decoding step does with its weights, by default on all (both) cores. The fastest of
    `repeats` after a warm-up; torch when installed (its threads), else numpy's BLAS (its own threads)."""
    try:
        import torch
    except ImportError:
        torch = None
    columns = 4096
    rows = size_bytes // (4 * columns)
    if torch is not None:
        torch.set_num_threads(threads)
        matrix, vector = torch.ones(rows, columns), torch.ones(columns)
        product = lambda: torch.mv(matrix, vector)  # noqa: E731
    else:
        matrix, vector = np.ones((rows, columns), np.float32), np.ones(columns, np.float32)
        product = lambda: matrix @ vector  # noqa: E731
    product()
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        fastest = min(fastest, time.perf_counter() - start)
    return rows * columns * 4 / fastest


def measure_reference(folder, batch, prompt_len, new_tokens):
    """The reference's cached decoding: one prefill, then one forward_cached call per token."""
    import jax.numpy as jnp
    from needle.model.architecture import TransformerConfig, precompute_rope_freqs
    from needle.model.decode import _f32, decode_cfg, forward_cached, init_kv_cache

    with open(os.path.join(folder, "native.pkl"), "rb") as f:
        native = pickle.load(f)
    config = TransformerConfig(**native["config"])
    params = _f32(native["params"])
    ids = prompt_ids(batch, prompt_len)
    max_len = prompt_len + new_tokens
    cos, sin = precompute_rope_freqs(config.d_model // config.num_heads, max_len, config.rope_theta)
    dcfg = decode_cfg(config)
    valid = jnp.ones((batch, max_len), bool)

    def run():
        kc, vc = init_kv_cache(config, batch, max_len)
        hist = jnp.zeros((batch, max_len), jnp.int32).at[:, :prompt_len].set(jnp.asarray(ids))
        logits, kc, vc = forward_cached(params, dcfg, jnp.asarray(ids), kc, vc, jnp.asarray(0, jnp.int32),
                                        cos, sin, None, False, hist, valid, None)
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        out = [nxt]
        for pos in range(prompt_len, max_len - 1):
            hist = hist.at[:, pos].set(nxt)
            logits, kc, vc = forward_cached(params, dcfg, nxt[:, None], kc, vc, jnp.asarray(pos, jnp.int32),
                                            cos, sin, None, False, hist, valid, None)
            nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            out.append(nxt)
        return np.asarray(jnp.stack(out, axis=1))

    start = time.perf_counter()
    first = run()
    compile_s = time.perf_counter() - start
    seconds = median_seconds(run, 3)
    return compile_s, seconds, first


def prepare(folder):
    params, native = make_base_checkpoint(folder)
    with open(os.path.join(folder, "native.pkl"), "wb") as f:
        pickle.dump({"format_version": 2, "params": params, "config": native, "step": 0, "run": {}}, f)
    os.sync()  # the checkpoint's writeback would otherwise share the memory bus with the measurement
    emit({
        "copy_bandwidth_bytes_per_second": copy_bandwidth_bytes_per_second(),
        "read_bandwidth_bytes_per_second": read_bandwidth_bytes_per_second(),
    })


def main():
    impl, batch, folder, prompt_len, new_tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    if impl == "prepare":
        return prepare(folder)
    measure = {
        "flax": measure_flax,
        "torch": measure_torch,
        "torch-static-compiled": measure_torch_static_compiled,
        "reference": measure_reference,
    }[impl]
    compile_s, seconds, tokens = measure(folder, batch, prompt_len, new_tokens)
    emit({
        "impl": impl, "batch": batch, "first_call_s": compile_s, "seconds": seconds,
        "tokens_per_s": batch * new_tokens / seconds, "peak_rss_bytes": peak_rss_bytes(),
        "tokens": np.asarray(tokens).tolist(),
    })


if __name__ == "__main__":
    main()
