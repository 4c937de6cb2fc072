"""The engram memory of Flax Needle 2: each engram site hashes the n-grams ending at every position
into its tables, projects the fetched rows to a key and a value and smooths the value with a causal
dilated convolution (`FlaxNeedleEngram`, named per site by `FlaxNeedleEngramCollection`);
`engram_window_memory` runs every site over a context window of token ids; `add_engram_read` is a
layer's read of its site. PyTorch twin: `engram_needle`.
"""

from __future__ import annotations

import math
from functools import partial

import flax.linen as nn
import jax.numpy as jnp

from .configuration_needle import NeedleConfig
from .deploy_numerics_flax import quantize_activations  # deploy numerics hook
from .masking_flax_needle import same_segment_back
from .norms_flax_needle import rms_unit
from .numerics import ENGRAM_FIRST_TAP_INIT, engram_table_orders
from .ops_flax_needle import engram_hash_indices, normal_initializer, shift_right


class FlaxNeedleEngram(nn.Module):
    """Hashed n-gram memory for one engram site: keys and (dilated-conv) values per position.

    The values convolve the value projections of the last `config.engram_conv_reach` positions,
    which the caller keeps (the cache does, when decoding), so only new positions are projected.
    """

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.config
        self.tables = self.param(
            "tables", normal_initializer(cfg.initializer_range), (cfg.engram_num_tables, cfg.engram_slots, cfg.engram_sub_dim)
        )
        dense = partial(nn.Dense, cfg.hidden_size, use_bias=False, dtype=self.dtype)
        self.key_proj = dense(kernel_init=normal_initializer(cfg.initializer_range))
        self.value_proj = dense(kernel_init=normal_initializer(cfg.initializer_range / math.sqrt(2 * cfg.num_hidden_layers)))
        self.conv_taps = self.param(
            "conv_taps", lambda key, shape: jnp.zeros(shape).at[0].set(ENGRAM_FIRST_TAP_INIT), (cfg.engram_conv_taps, cfg.hidden_size)
        )

    def __call__(self, indices, ngram_visible, tap_visible, past_projected):
        """Keys and values of T new positions.

        indices, ngram_visible [B, T, tables]; tap_visible [taps, B, T] (is the position each tap
        reads visible); past_projected [B, reach, D]: value projections of the positions before
        these -> (keys [B, T, D], values [B, T, D], value projections of the last `reach` positions).
        """
        cfg = self.config
        b, t, num_tables = indices.shape
        reach = past_projected.shape[1]
        rows = self.tables[jnp.arange(num_tables), indices]  # [B, T, tables, sub]
        rows = rows * ngram_visible[..., None]
        e = rows.reshape(b, t, num_tables * cfg.engram_sub_dim).astype(self.dtype)  # [B, T, E]
        e = quantize_activations(e, cfg)  # deploy numerics hook
        keys = self.key_proj(e)
        projected = jnp.concatenate([past_projected.astype(self.dtype), self.value_proj(e)], axis=1)  # [B, reach + T, D]
        taps = self.conv_taps.astype(self.dtype)
        values = sum(
            taps[j] * projected[:, reach - j * cfg.engram_conv_dilation :][:, :t] * tap_visible[j][..., None]
            for j in range(cfg.engram_conv_taps)
        )
        return keys, values, projected[:, t:]


class FlaxNeedleEngramCollection(nn.Module):
    """Engram sites named "0", "1", ... so parameters read `model.engrams.{s}.*`.

    When decoding with a cache, each site keeps the value projections of the last
    `config.engram_conv_reach` positions as `projected_values_{s}` [B, reach, D].
    """

    config: NeedleConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, indices, ngram_visible, tap_visible, *, init_cache: bool = False):
        """(keys, values) [sites, B, T, D] for T new positions (inputs as `FlaxNeedleEngram`, without the past)."""
        cfg = self.config
        shape = (indices.shape[0], cfg.engram_conv_reach, cfg.hidden_size)
        keys, values = [], []
        for s in range(len(cfg.engram_layers)):
            name = f"projected_values_{s}"
            state = None
            if init_cache or self.has_variable("cache", name):
                state = self.variable("cache", name, jnp.zeros, shape, self.dtype)
            past = jnp.zeros(shape, self.dtype) if state is None or init_cache else state.value
            k, v, projected = FlaxNeedleEngram(cfg, dtype=self.dtype, name=str(s))(indices, ngram_visible, tap_visible, past)
            if state is not None and not init_cache:
                state.value = projected
            keys.append(k)
            values.append(v)
        return jnp.stack(keys), jnp.stack(values)


def add_engram_read(u, engram_key, engram_value, eps: float):
    """A layer's read of its engram site: ``u + sigmoid(<rms_unit(u), rms_unit(key)> / sqrt(D)) * value``.

    u, engram_key, engram_value [B, T, D]; the gate in float32, the sum cast back to ``u``'s dtype.
    """
    alpha = nn.sigmoid(
        jnp.sum(rms_unit(u, eps) * rms_unit(engram_key, eps), axis=-1, keepdims=True) / math.sqrt(u.shape[-1])
    )  # [B, T, 1]
    return u + (alpha * engram_value.astype(jnp.float32)).astype(u.dtype)


def engram_window_memory(engrams, config: NeedleConfig, window_ids, window_visible, first_output: int, *,
                         init_cache: bool = False, segment_ids=None):
    """Engram (keys, values) [sites, B, C - first_output, D] of window positions ``first_output..C-1``
    (``engrams``: a `FlaxNeedleEngramCollection`; None without engram sites, which gives None).

    window_ids [B, C] token ids; window_visible [B, C] bool, whether each position is real text
    (positions hidden here count as invisible, exactly like positions before the window).
    segment_ids [B, C] (packed sequences, no cache): an n-gram or conv tap reaching into an earlier
    sequence counts as invisible, as before the start of a text."""
    cfg = config
    if engrams is None:
        return None
    new_tokens = window_ids.shape[1] - first_output
    context_tokens, context_valid = window_ids, window_visible
    orders, heads = cfg.engram_orders, cfg.engram_num_heads
    new = lambda x: x[:, x.shape[1] - new_tokens :]  # noqa: E731  (the new positions of a context array)

    def visible_back(offset):  # [B, C]: position t - offset is visible to t
        visible = shift_right(context_valid, offset, fill=False)
        same = same_segment_back(segment_ids, offset)
        return visible if same is None else visible & same

    # Invisible (padded) positions hash as token 0, like positions before the start.
    indices = engram_hash_indices(jnp.where(context_valid, context_tokens, 0), orders, heads, cfg.engram_slots)
    ngram_visible = jnp.stack([visible_back(o - 1) for o in engram_table_orders(orders, heads)], -1)
    tap_visible = jnp.stack(
        [new(visible_back(j * cfg.engram_conv_dilation)) for j in range(cfg.engram_conv_taps)]
    )
    return engrams(new(indices), new(ngram_visible), tap_visible, init_cache=init_cache)


__all__ = ["FlaxNeedleEngram", "FlaxNeedleEngramCollection", "add_engram_read", "engram_window_memory"]
