"""Test support: reference (cactus-needle 2.x) checkpoints and reference outputs.

The reference is a test-only dependency. Parameters are made from the reference's own parameter
tree (`jax.eval_shape` of its `init`, so no compile) and filled with values perturbed away from
the reference initialisation for *every* leaf: a norm read as `scale` instead of `1 + scale`, a
missing gate or a swapped bias changes the outputs.
"""

from __future__ import annotations

import functools
import math
import pickle

import numpy as np

TINY_NATIVE_CONFIG = dict(
    vocab_size=512,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    num_layers=3,
    max_seq_len=128,
    engram_layers=(0, 2),
    engram_slots=64,
    contrastive_dim=16,
    dtype="float32",
)
# The Needle 2 geometry (the reference's `base` preset).
BASE_NATIVE_CONFIG = dict(d_model=512, num_heads=8, num_kv_heads=4, num_layers=27, engram_layers=(2, 15), dtype="float32")


def reference_config(native: dict):
    from needle.model.architecture import TransformerConfig

    return TransformerConfig(**native)


def _param_shapes(native: dict, with_heads: bool):
    import jax
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork

    cfg = reference_config(native)
    model = SimpleAttentionNetwork(cfg)
    tokens = jnp.zeros((1, 8), jnp.int32)

    def init_all(rng):
        variables = model.init(rng, tokens)
        if with_heads:
            extra_c = model.init(rng, tokens, method=model.encode_contrastive)
            extra_f = model.init(rng, tokens, method=model.forward_confidence)
            params = dict(variables["params"])
            params["contrastive_head"] = extra_c["params"]["contrastive_head"]
            params["confidence_head"] = extra_f["params"]["confidence_head"]
            return {"params": params}
        return variables

    return jax.eval_shape(init_all, jax.random.PRNGKey(0))["params"]


def first_tap_initial(shape) -> np.ndarray:
    """1 on the current position's tap (taps [..., n, C]), 0 on the others."""
    base = np.zeros(shape)
    base[..., 0, :] = 1.0
    return base


def walsh_initial(shape) -> np.ndarray:
    """The normalised Walsh matrix of a square Kronecker factor [..., s, s]."""
    walsh = np.ones((1, 1))
    while walsh.shape[0] < shape[-1]:
        walsh = np.block([[walsh, walsh], [walsh, -walsh]])
    return np.broadcast_to(walsh / math.sqrt(shape[-1]), shape)


# Per leaf name (a trailing "*" matches a prefix; first match wins): (initial value, noise scale).
NEEDLE2_LEAF_RULES = (
    (("embedding",), 0.0, 0.05),
    (("kernel", "probes", "mhc_phi*"), 0.0, 0.03),
    (("scale", "attn_gate"), 0.0, 0.3),
    (("d1", "d2"), 1.0, 0.3),
    (("d3",), 0.3, 0.2),
    (("taps",), first_tap_initial, 0.3),
    (("mhc_b_res",), lambda shape: 4.0 * np.eye(shape[-1]), 0.7),
    (("mhc_b_*", "bias"), 0.0, 0.5),
    (("mhc_a_*",), 0.01, 0.5),
    (("log_temp",), math.log(0.07), 0.2),
)


def perturbed_leaf(path: tuple[str, ...], shape, rng: np.random.Generator, rules=NEEDLE2_LEAF_RULES) -> np.ndarray:
    """Reference-like initial value plus noise that makes the leaf matter (one draw per leaf).

    rules: `NEEDLE2_LEAF_RULES` or another generation's table of the same form.
    """
    name = path[-1]
    for names, initial, scale in rules:
        if any(name == rule or (rule.endswith("*") and name.startswith(rule[:-1])) for rule in names):
            noise = rng.normal(0.0, scale, shape)
            base = initial(shape) if callable(initial) else initial
            return np.asarray(base + noise, np.float32).reshape(shape)
    raise KeyError(f"no perturbation rule for reference leaf {'/'.join(path)}")


def make_native_params(native: dict, seed: int, with_heads: bool = True) -> dict:
    """A reference parameter tree (nested dicts of float32 numpy arrays), every leaf perturbed."""
    import jax

    shapes = _param_shapes(native, with_heads)
    rng = np.random.default_rng(seed)

    def fill(tree, prefix=()):
        return {
            k: fill(v, prefix + (k,)) if isinstance(v, dict) else perturbed_leaf(prefix + (k,), v.shape, rng)
            for k, v in tree.items()
        }

    return fill(jax.tree.map(lambda x: x, dict(shapes)))


def write_native_checkpoint(path, params: dict, native_config: dict, step: int = 0):
    """Write a format_version 2 checkpoint the way the reference does (a plain pickle)."""
    with open(path, "wb") as f:
        pickle.dump(
            {"format_version": 2, "params": params, "config": dict(native_config), "step": step, "run": {"stage": "test"}},
            f,
        )


@functools.lru_cache(maxsize=None)
def _jitted_apply(native_items: tuple, method: str):
    import jax
    from needle.model.architecture import SimpleAttentionNetwork

    model = SimpleAttentionNetwork(reference_config(dict(native_items)))
    if method == "logits":
        return jax.jit(lambda p, t, m: model.apply({"params": p}, t, mask=m, return_mtp=True))
    if method == "contrastive":
        return jax.jit(lambda p, t: model.apply({"params": p}, t, method=model.encode_contrastive))
    if method == "confidence":
        return jax.jit(lambda p, t: model.apply({"params": p}, t, method=model.forward_confidence))
    raise ValueError(method)


def _key(native: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in native.items()))


def reference_logits(native: dict, params: dict, tokens: np.ndarray, attention_mask: np.ndarray | None = None):
    """(logits, mtp_logits) of the reference, float32 numpy. `attention_mask` [B, T] marks real tokens."""
    import jax.numpy as jnp

    tokens = jnp.asarray(tokens, jnp.int32)
    t = tokens.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if attention_mask is not None:
        mask = mask & jnp.asarray(attention_mask, bool)[:, None, None, :]
    logits, mtp = _jitted_apply(_key(native), "logits")(params, tokens, mask)
    return np.asarray(logits, np.float32), np.asarray(mtp, np.float32)


def reference_heads(native: dict, params: dict, tokens: np.ndarray):
    """(contrastive embedding [B, C], confidence logit [B]) of the reference."""
    import jax.numpy as jnp

    tokens = jnp.asarray(tokens, jnp.int32)
    emb = _jitted_apply(_key(native), "contrastive")(params, tokens)
    conf = _jitted_apply(_key(native), "confidence")(params, tokens)
    return np.asarray(emb, np.float32), np.asarray(conf, np.float32)
