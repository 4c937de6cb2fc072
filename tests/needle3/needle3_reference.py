"""Test support: Needle 3 reference (cactus-needle 3.x) checkpoints and reference outputs.

Parameters come from the reference's own tree (`jax.eval_shape` of its `init`, heads included) and
every leaf is perturbed away from its initial value, so a norm read as `scale` instead of
`1 + scale`, a missing gate, a swapped diagonal or a transposed factor changes the outputs.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from needle_reference import first_tap_initial, walsh_initial, perturbed_leaf

# Every architectural option on, odd geometry: d=48 (MLP padded to 64), value heads wider than q/k
# heads, 3 lanes, 5 layers with a sliding window of 3 and one global layer, two engram sites with
# a hash-seed stride that differs from the heads, split MLP permutations (ladder_widths), Q/K/V
# convolution taps, an output head cut to 280 of 300 rows, and all three probe heads.
ALL_OPTIONS_NATIVE_CONFIG = dict(
    vocab_size=300, d_model=48, num_heads=4, num_kv_heads=2, num_layers=5, qk_head_dim=6, v_head_dim=10,
    max_seq_len=64, engram_orders=(2, 3), engram_heads=2, engram_seed_heads=3, engram_slots=97,
    engram_layers=(1, 3), global_layers=(2,), sliding_window=3, ladder_widths=(24,), mhc_lanes=3,
    qkv_conv_taps=3, out_vocab=280, dtype="float32", remat=False, embedding_dim=16, embedding_probes=2,
    embedding_queries=3, confidence_probes=3, confidence_queries=2, router_probes=2, router_queries=2,
)
# Needle 2-style plain attention: no window, no taps, no seed stride, no out_vocab cut.
PLAIN_NATIVE_CONFIG = dict(
    vocab_size=200, d_model=32, num_heads=4, num_kv_heads=4, num_layers=2, qk_head_dim=8, v_head_dim=8,
    max_seq_len=64, engram_layers=(0,), engram_slots=31, global_layers=(), sliding_window=0,
    qkv_conv_taps=0, mhc_lanes=2, dtype="float32", remat=False,
)


def reference_config(native: dict):
    from needle.model.architecture import TransformerConfig

    return TransformerConfig(**native)


def _param_shapes(native: dict, with_heads: bool):
    import jax
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork

    model = SimpleAttentionNetwork(reference_config(native))
    tokens = jnp.zeros((1, 8), jnp.int32)

    def init_all(rng):
        params = dict(model.init(rng, tokens)["params"])
        if with_heads:
            for method, key in ((model.forward_embedding, "embedding_head"), (model.forward_confidence, "confidence_head"),
                                (model.forward_router, "router_head")):
                params[key] = model.init(rng, tokens, method=method)["params"][key]
        return params

    return jax.eval_shape(init_all, jax.random.PRNGKey(0))


# Needle 3's leaves (see `perturbed_leaf`): Kronecker factors near their Walsh initialisation, a
# temperature near log 10, the MLP's output diagonal near 0.3.
NEEDLE3_LEAF_RULES = (
    (("embedding",), 0.0, 0.05),
    (("probes", "query"), 0.0, 0.1),
    (("kernel", "cond_v", "mhc_phi*"), 0.0, 0.03),
    (("scale", "attn_gate", "b2", "cond_u", "row_bias"), 0.0, 0.3),
    (("d1", "d2", "d3", "gain"), 1.0, 0.3),
    (("d4",), 0.3, 0.2),
    (("w1a", "w1b", "w2a", "w2b", "w3a", "w3b"), walsh_initial, 0.15),
    (("taps", "q_taps", "k_taps", "v_taps"), first_tap_initial, 0.3),
    (("mhc_b_res",), lambda shape: 4.0 * np.eye(shape[-1]), 0.7),
    (("mhc_b_*", "bias"), 0.0, 0.5),
    (("mhc_a_*",), 0.01, 0.5),
    (("log_temp",), math.log(10.0), 0.2),
)


def make_native_params(native: dict, seed: int, *, with_heads: bool = True) -> dict:
    """A reference parameter tree (nested dicts of float32 numpy arrays), every leaf perturbed."""
    shapes = _param_shapes(native, with_heads)
    rng = np.random.default_rng(seed)

    def fill(tree, prefix=()):
        return {k: fill(v, prefix + (k,)) if isinstance(v, dict) else perturbed_leaf(prefix + (k,), v.shape, rng, NEEDLE3_LEAF_RULES)
                for k, v in tree.items()}

    return fill(dict(shapes))


def write_reference_checkpoint(path, params: dict, native: dict, *, step: int = 7) -> None:
    """A `.safetensors` checkpoint written by the reference's own writer (format_version 2)."""
    from needle.model.checkpoints import write_checkpoint

    write_checkpoint(str(path), {"format_version": 2, "params": params, "config": dict(native), "step": step,
                                 "run": {"stage": "test"}})


def _key(native: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in native.items()))


@functools.lru_cache(maxsize=None)
def _model(native_items: tuple):
    from needle.model.architecture import SimpleAttentionNetwork

    return SimpleAttentionNetwork(reference_config(dict(native_items)))


def reference_logits(native: dict, params: dict, tokens: np.ndarray) -> np.ndarray:
    """The reference's logits [B, T, out_vocab] (float32 numpy) under its default causal mask."""
    import jax.numpy as jnp

    model = _model(_key(native))
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens, jnp.int32)), np.float32)


def reference_head(native: dict, params: dict, tokens: np.ndarray, head: str) -> np.ndarray:
    """The reference's `forward_embedding` / `forward_confidence` / `forward_router` output (numpy)."""
    import jax.numpy as jnp

    model = _model(_key(native))
    method = getattr(model, f"forward_{head}")
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens, jnp.int32), method=method), np.float32)


class IdsTokenizer:
    """A tokenizer over ids written as text ("17 4 250"): lets the reference's `run.generate` be driven
    with exact ids (its encode/decode are the only members it uses)."""

    def encode(self, text: str) -> list:
        return [int(piece) for piece in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def reference_greedy(native: dict, params: dict, prompt_ids: list, max_new_tokens: int) -> list:
    """Token ids the reference's `run.generate` emits greedily after BOS + prompt_ids (stops at EOS)."""
    from needle.model import run

    model = _model(_key(native))
    text = run.generate(model, params, IdsTokenizer(), " ".join(map(str, prompt_ids)), max_new_tokens=max_new_tokens,
                        temperature=0.0, stream=False)
    return IdsTokenizer().encode(text)
