"""A float32 numpy forward pass of Needle 2 that reads the *native* parameter tree.

The converter uses it as the source side of its end-to-end check: logits computed here from the
tree it read (a `.pkl` or a dequantized `.cact`) are compared with the logits of the HF model
loaded from the folder it wrote. This file is written from the architecture description, reads
the reference's own tree layout (stacked layers, `(in, out)` kernels, `stack/mhc_*`) and does not
go through `needle_hf.models.needle.weight_names`, so a mapping or layout mistake on the way to the HF tensors
shows up as a logit difference instead of being reproduced on both sides.

Scope: full-sequence logits (and MTP logits) for unpadded, causal inputs; no cache, no heads.
The module-level op functions (norms, RoPE, Sinkhorn, the engram hash, the Walsh transform, the
padding-aware attention mask, probe pooling) are the plain statement of each op that the per-op
tests run both models' op functions against (`tests/models/test_ops_parity.py`).

Axis letters: the legend of `needle_hf/numerics.py`.

Numerics: every op in float32 (parameters of any float dtype are read as float32), RMS statistics
with epsilon `config.rms_norm_eps`, softmax and Sinkhorn in log-sum-exp form.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from needle_hf.models.needle.numerics import (
    SINKHORN_ITERATIONS,
    engram_indices_numpy,
    engram_table_orders,
    hyper_connection_offsets,
    rope_inverse_frequencies,
    walsh_matrix,
)

# How a parameter leaf becomes the float32 array the forward computes with. The converter passes
# one that first rounds to the output dtype, so both sides of its check see the same values.
LeafReader = Callable[[np.ndarray], np.ndarray]


def float32_leaf(leaf) -> np.ndarray:
    return np.asarray(leaf).astype(np.float32)


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    peak = np.max(x, axis=axis, keepdims=True)
    return peak + np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _shift_right(x: np.ndarray, offset: int) -> np.ndarray:
    """x[:, t - offset] along axis 1, zeros before the start."""
    if offset == 0:
        return x
    out = np.zeros_like(x)
    out[:, offset:] = x[:, : x.shape[1] - offset]
    return out


# -------------------------------------------------------------------------------------------------
# The ops, one statement each.


def rms_unit(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis, no gain."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))


def zero_centred_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gain `1 + weight` (the stored weight is zero-centred) times `rms_unit(x)`."""
    return (1.0 + weight) * rms_unit(x, eps)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split RoPE `[x1 cos - x2 sin, x2 cos + x1 sin]`; x [B, T, heads, H], cos/sin [T, H/2]."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def rope_angles(positions: np.ndarray, head_dim: int, theta: float) -> np.ndarray:
    """Rotation angles [..., H/2] of integer positions: position * theta^(-2i / H)."""
    return np.asarray(positions, np.float32)[..., None] * rope_inverse_frequencies(head_dim, theta)


def sinkhorn(logits: np.ndarray) -> np.ndarray:
    """Doubly-stochastic [..., I, J]: `SINKHORN_ITERATIONS` log-space rounds normalising rows, then columns."""
    log_k = logits
    for _ in range(SINKHORN_ITERATIONS):
        log_k = log_k - _logsumexp(log_k, axis=-1)
        log_k = log_k - _logsumexp(log_k, axis=-2)
    return np.exp(log_k)


def engram_hash_indices(tokens: np.ndarray, orders, num_heads: int, slots: int) -> np.ndarray:
    """Hash-table rows [B, T, tables] of the n-grams ending at each position (`numerics.engram_indices_numpy`)."""
    return engram_indices_numpy(tokens, orders, num_heads, slots)


def walsh_transform(z: np.ndarray) -> np.ndarray:
    """z @ W over the last axis, W the orthonormal Sylvester Walsh-Hadamard matrix [W, W]."""
    return z @ walsh_matrix(z.shape[-1])


def attention_allowed(key_visible: np.ndarray, past_length: int, query_length: int) -> np.ndarray:
    """[B, T, S] bool: query t (at position past_length + t) may read key s when s is causal and
    visible, and always itself (a padding row, which sees no visible key, reads only itself)."""
    query_positions = past_length + np.arange(query_length)[:, None]  # [T, 1]
    key_positions = np.arange(key_visible.shape[1])[None, :]  # [1, S]
    causal_visible = (key_positions <= query_positions)[None] & np.asarray(key_visible, bool)[:, None, :]
    return causal_visible | (key_positions == query_positions)[None]


def probe_pool(cells: np.ndarray, keep: np.ndarray, probes: np.ndarray) -> np.ndarray:
    """Probe attention pooling: cells [B, T, L + 1, D], keep [B, T] bool, probes [P, D] -> [B, P * D].

    Each probe's softmax runs over every (position, layer) cell of the kept positions.
    """
    b, t, depth, d = cells.shape
    flat = cells.reshape(b, t * depth, d)  # [B, F, D], position-major
    scores = np.einsum("bfd,pd->bpf", flat, probes) / np.float32(math.sqrt(d))
    scores = np.where(np.repeat(np.asarray(keep, bool), depth, axis=1)[:, None, :], scores, -np.inf)
    weights = np.exp(scores - _logsumexp(scores, axis=-1))
    return np.einsum("bpf,bfd->bpd", weights, flat).reshape(b, -1)


class _NativeForward:
    """One forward pass; `read(path)` fetches a native leaf as float32."""

    def __init__(self, params: dict, config, read_leaf: LeafReader):
        self.params = params
        self.config = config
        self.read_leaf = read_leaf
        self.eps = np.float32(config.rms_norm_eps)

    def read(self, *path: str, layer: int | None = None) -> np.ndarray:
        node = self.params
        for key in path:
            node = node[key]
        return self.read_leaf(node if layer is None else np.asarray(node)[layer])

    def rms_unit(self, x: np.ndarray) -> np.ndarray:
        return rms_unit(x, self.eps)

    def zero_centred_norm(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        return zero_centred_rms_norm(x, scale, self.eps)

    # ---------------------------------------------------------------------------------------------
    # Engram memory.

    def engram_memory(self, tokens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(key, value) [B, T, D] per engram site, in site order."""
        cfg = self.config
        b, t = tokens.shape
        heads, tables = cfg.engram_num_heads, cfg.engram_num_tables
        rows = engram_hash_indices(tokens, cfg.engram_orders, heads, cfg.engram_slots)  # [B, T, tables]
        positions = np.arange(t)
        # An n-gram of order o needs o - 1 earlier tokens inside the sequence.
        ngram_visible = np.stack(
            [positions >= order - 1 for order in engram_table_orders(cfg.engram_orders, heads)], axis=-1
        ).astype(np.float32)  # [T, tables]
        memory = []
        for site in range(len(cfg.engram_layers)):
            prefix = f"engrams_{site}"
            table_rows = self.read(prefix, "embedding")  # [tables, slots, sub]
            fetched = table_rows[np.arange(tables), rows]  # [B, T, tables, sub]
            fetched = fetched * ngram_visible[None, :, :, None]
            e = fetched.reshape(b, t, tables * cfg.engram_sub_dim)  # [B, T, E]
            key = e @ self.read(prefix, "key_proj", "kernel")  # [B, T, D]
            projected = e @ self.read(prefix, "value_proj", "kernel")  # [B, T, D]
            taps = self.read(prefix, "taps")  # [taps, D]
            value = sum(
                taps[j] * _shift_right(projected, j * cfg.engram_conv_dilation) for j in range(cfg.engram_conv_taps)
            )
            memory.append((key, value))
        return memory

    # ---------------------------------------------------------------------------------------------
    # The block (decoder layers and the MTP block share it).

    def attention(self, a: np.ndarray, block, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Causal grouped-query attention with q/k norms, RoPE and a sigmoid output gate. a [B, T, D]."""
        cfg = self.config
        b, t, _ = a.shape
        n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = (a @ block("self_attn", "q_proj", "kernel")).reshape(b, t, n, h)
        key = (a @ block("self_attn", "k_proj", "kernel")).reshape(b, t, k, h)
        value = (a @ block("self_attn", "v_proj", "kernel")).reshape(b, t, k, h)
        q = self.zero_centred_norm(q, block("self_attn", "q_norm", "scale"))
        key = self.zero_centred_norm(key, block("self_attn", "k_norm", "scale"))
        q, key = apply_rotary(q, cos, sin), apply_rotary(key, cos, sin)
        q = q.reshape(b, t, k, n // k, h)  # query head g of kv group k is head k * G + g
        scores = np.einsum("btkgh,bskh->bkgts", q, key) / np.float32(math.sqrt(h))
        allowed = attention_allowed(np.ones((b, t), bool), 0, t)  # [B, T, S]
        scores = np.where(allowed[:, None, None], scores, -np.inf)
        weights = np.exp(scores - _logsumexp(scores, axis=-1))
        out = np.einsum("bkgts,bskh->btkgh", weights, value).reshape(b, t, n * h)  # [B, T, A]
        out = out * _sigmoid(a @ block("self_attn", "gate_proj", "kernel"))
        return out @ block("self_attn", "out_proj", "kernel")

    def hadamard_mlp(self, x: np.ndarray, block) -> np.ndarray:
        """Diagonal scalings around two Walsh-Hadamard transforms, zero padded to a power of two."""
        d, width = self.config.hidden_size, self.config.hadamard_size
        z = np.concatenate([x, np.zeros((*x.shape[:-1], width - d), np.float32)], axis=-1) if width > d else x  # [B, T, W]
        z = walsh_transform(block("hadamard_mlp", "d1") * z)
        z = block("hadamard_mlp", "d2") * z
        z = walsh_transform(z * _sigmoid(z))  # silu
        return (block("hadamard_mlp", "d3") * z)[..., :d]

    def block(self, u: np.ndarray, block, cos, sin, engram=None) -> np.ndarray:
        """One Needle block on u [B, T, D]; `engram` is the (key, value) of the site this layer reads."""
        if engram is not None:
            key, value = engram
            d = self.config.hidden_size
            alpha = _sigmoid(np.sum(self.rms_unit(u) * self.rms_unit(key), axis=-1, keepdims=True) / np.float32(math.sqrt(d)))
            u = u + alpha * value
        attended = self.attention(self.zero_centred_norm(u, block("ZCRMSNorm_0", "scale")), block, cos, sin)
        gate = _sigmoid(block("attn_gate"))
        x = u + gate * self.zero_centred_norm(attended, block("post_attn_norm", "scale"))
        return x + self.hadamard_mlp(self.zero_centred_norm(x, block("pre_hada_norm", "scale")), block)

    # ---------------------------------------------------------------------------------------------
    # The whole model.

    def __call__(self, tokens: np.ndarray, *, with_mtp: bool) -> tuple[np.ndarray, np.ndarray | None]:
        cfg = self.config
        b, t = tokens.shape
        d, lanes = cfg.hidden_size, cfg.hyper_connection_lanes
        embedding = self.read("embedding", "embedding")  # [V, D]
        scale = np.float32(math.sqrt(d))
        angles = rope_angles(np.arange(t), cfg.head_dim, cfg.rope_theta)
        cos, sin = np.cos(angles), np.sin(angles)  # [T, H/2]
        memory = self.engram_memory(tokens)
        site_of_layer = {layer: site for site, layer in enumerate(cfg.engram_layers)}
        pre_offsets, post_offsets = hyper_connection_offsets(cfg.num_hidden_layers, lanes)

        x = np.broadcast_to((embedding[tokens] * scale)[:, :, None, :], (b, t, lanes, d)).copy()  # [B, T, L, D]
        for i in range(cfg.num_hidden_layers):
            block = lambda *path, i=i: self.read("stack", "layers", "block", *path, layer=i)  # noqa: E731
            stack = lambda name, i=i: self.read("stack", name, layer=i)  # noqa: E731
            flat = self.rms_unit(x.reshape(b, t, lanes * d))  # [B, T, L*D]
            pre = _sigmoid(stack("mhc_a_pre") * (flat @ stack("mhc_phi_pre")) + stack("mhc_b_pre") + pre_offsets[i])
            u = np.einsum("btl,btld->btd", pre, x)
            site = site_of_layer.get(i)
            y = self.block(u, block, cos, sin, engram=None if site is None else memory[site]) - u
            post = 2.0 * _sigmoid(stack("mhc_a_post") * (flat @ stack("mhc_phi_post")) + stack("mhc_b_post") + post_offsets[i])
            routing = stack("mhc_a_res") * (flat @ stack("mhc_phi_res")).reshape(b, t, lanes, lanes) + stack("mhc_b_res")
            x = np.einsum("btij,btjd->btid", sinkhorn(routing), x) + post[..., None] * y[:, :, None, :]
        hidden = self.zero_centred_norm(np.mean(x, axis=2), self.read("stack", "final_norm", "scale"))  # [B, T, D]
        logits = hidden @ embedding.T  # [B, T, V]
        if not with_mtp:
            return logits, None

        next_tokens = np.concatenate([tokens[:, 1:], np.zeros((b, 1), tokens.dtype)], axis=1)
        next_embedded = self.zero_centred_norm(embedding[next_tokens] * scale, self.read("mtp_emb_norm", "scale"))
        m = np.concatenate([hidden, next_embedded], axis=-1) @ self.read("mtp_combine", "kernel")
        m = self.block(m, lambda *path: self.read("mtp_block", *path), cos, sin)
        mtp_logits = self.zero_centred_norm(m, self.read("mtp_final_norm", "scale")) @ embedding.T
        return logits, mtp_logits


def native_logits(params: dict, config, tokens, *, with_mtp: bool = False, read_leaf: LeafReader = float32_leaf):
    """Logits of a native parameter tree on unpadded token ids, in float32.

    Args:
        params: the native tree (the reference's Flax layout), leaves of any float dtype.
        config: the `NeedleConfig` describing the geometry.
        tokens: int token ids [B, T] (T <= max_position_embeddings).
        with_mtp: also return the MTP logits (the tree must hold the MTP head).
        read_leaf: turns a leaf (or a layer's slice of one) into the float32 array used.

    Returns:
        (logits [B, T, V], mtp_logits [B, T, V] or None); mtp_logits[:, t] predicts token t + 2.
    """
    tokens = np.asarray(tokens, np.int64)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    return _NativeForward(params, config, read_leaf)(tokens, with_mtp=with_mtp)
