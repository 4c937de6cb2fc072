"""Why Flax decoding gains less than 4x from batch 8: a decoding step and its weight products, 1 vs 8 rows.

Workload: the `base` preset (d=512, 27 layers), float32, random weights; a cache of 128 positions
filled with a 64-token prompt. Rows, each timed at batch 1 and batch 8 in this one process:
- `products`: the weight matmuls of a decoding step alone, jitted and unrolled as the model runs
  them (each layer's fused q/k/v/gate kernel and its o_proj, on `with_decoding_kernels` of the
  checkpoint's params; each product's output feeds the next layer, so none is elided);
- `step`: one whole cached decoding step (`FlaxNeedleForCausalLM.__call__` with `past_key_values`,
  the cache updated in place), as `generate()`'s loop runs it.
The last column is the batch-8 aggregate a row allows: 8 x its batch-1 time / its batch-8 time.
A 4x aggregate needs the batch-8 step within 2x the batch-1 step.

    .venv/bin/python benchmarks/flax_batch_rows.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial


from common import make_base_checkpoint, median_seconds
from generate_worker import prompt_ids

PROMPT_TOKENS, CACHE_LENGTH = 64, 128


def layer_kernels(params, config) -> list:
    """(fused q/k/v/gate kernel [D, 2A + 2KV], o_proj kernel [A, D]) of every layer."""
    from needle_hf.models.needle.modeling_flax_needle import FUSED_QKVG_KERNEL

    layers = params["model"]["layers"]
    return [(layers[str(i)]["self_attn"][FUSED_QKVG_KERNEL], layers[str(i)]["self_attn"]["o_proj"]["kernel"])
            for i in range(config.num_hidden_layers)]


def weight_products(kernels, x, *, attention_dim: int):
    """x [B, D] -> x after every layer's two products (kernels passed in, so XLA reads them as inputs)."""
    for qkvg, o_proj in kernels:
        y = x @ qkvg  # [B, 2A + 2KV]
        x = x + 1e-3 * (y[:, :attention_dim] @ o_proj)  # [B, D]
    return x


def decoding_step(model, params, batch: int):
    """A function running one jitted one-token step, after a prefill of PROMPT_TOKENS into a fresh cache."""
    import jax
    import jax.numpy as jnp

    ids = prompt_ids(batch, PROMPT_TOKENS)
    mask = jnp.ones((batch, CACHE_LENGTH), jnp.int32)
    prefill = model(ids, mask, jnp.broadcast_to(jnp.arange(PROMPT_TOKENS), ids.shape), params=params,
                    past_key_values=model.init_cache(batch, CACHE_LENGTH))
    token = jnp.argmax(prefill.logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
    position = jnp.full((batch, 1), PROMPT_TOKENS, jnp.int32)

    # The cache is donated and carried from step to step, updated in place as in generate()'s loop
    # (each step writes the same position: the time of a step does not depend on it).
    compiled = jax.jit(
        lambda params, cache, token: model(token, mask, position, params=params, past_key_values=cache).past_key_values,
        donate_argnums=1,
    )
    state = {"cache": prefill.past_key_values}

    def step():
        state["cache"] = jax.block_until_ready(compiled(params, state["cache"], token))

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    import jax

    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM, with_decoding_kernels

    with tempfile.TemporaryDirectory() as folder:
        make_base_checkpoint(folder)
        model = FlaxNeedleForCausalLM.from_pretrained(folder)
    config = model.config
    params = with_decoding_kernels(model.params, config)
    kernels = layer_kernels(params, config)
    product_bytes = sum(k.nbytes for pair in kernels for k in pair)
    products = jax.jit(partial(weight_products, attention_dim=config.attention_dim))
    seconds = {}
    for batch in (1, 8):
        x = jax.random.normal(jax.random.PRNGKey(0), (batch, config.hidden_size))
        jax.block_until_ready(products(kernels, x))
        seconds["products", batch] = median_seconds(lambda: jax.block_until_ready(products(kernels, x)), args.repeats)
        step = decoding_step(model, params, batch)
        step()
        seconds["step", batch] = median_seconds(step, args.repeats)
    kv_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.init_cache(1, CACHE_LENGTH)["model"]["layers"]))
    print(f"KV cache read per step: {kv_bytes / 1e6:.1f} MB per row ({CACHE_LENGTH} positions)")
    for batch in (1, 8):
        print(f"products, batch {batch}: {product_bytes / 1e6:.0f} MB of kernels at "
              f"{product_bytes / seconds['products', batch] / 1e9:.1f} GB/s")
    print("| row | batch 1 | batch 8 | batch 8 / batch 1 | batch-8 aggregate allowed |")
    print("|---|---|---|---|---|")
    for row in ("products", "step"):
        one, eight = seconds[row, 1], seconds[row, 8]
        print(f"| {row} | {one * 1e3:.2f} ms | {eight * 1e3:.2f} ms | {eight / one:.2f}x | {8 * one / eight:.2f}x |")


if __name__ == "__main__":
    main()
