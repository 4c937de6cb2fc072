"""The engram memory of PyTorch Needle 2: each engram site hashes the n-grams ending at every position
into its tables, projects the fetched rows to a key and a value and smooths the value with a causal
dilated convolution (`NeedleEngram`); `engram_window_memory` runs every site over a window of token
ids; `NeedleEngramMemoryMixin` (inherited by `NeedleModel`) reads that window from a call's ids and
its cache. Flax twin: `engram_flax_needle`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from .cache_needle import NeedleEngramCacheLayer
from .configuration_needle import NeedleConfig
from .deploy_numerics import quantize_activations  # deploy numerics hook
from .norms_needle import rms_unit
from .numerics import engram_table_orders
from .ops_needle import engram_hash_indices, shift_right
from .projections_needle import NeedleResidualLinear
from .step_inputs_needle import NeedleStepInputs


class NeedleEngram(nn.Module):
    """Hashed n-gram memory of one site: fetched table rows -> (key, convolved value), [B, T, D] each."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        d = config.hidden_size
        self.config = config  # deploy numerics hook
        self.num_tables = config.engram_num_tables
        self.dilation = config.engram_conv_dilation
        self.reach = config.engram_conv_reach
        self.tables = nn.Parameter(torch.zeros(config.engram_num_tables, config.engram_slots, config.engram_sub_dim))
        self.key_proj = nn.Linear(config.engram_dim, d, bias=False)
        self.value_proj = NeedleResidualLinear(config.engram_dim, d, bias=False)
        taps = torch.zeros(config.engram_conv_taps, d)
        taps[0] = 1.0
        self.conv_taps = nn.Parameter(taps)

    def forward(
        self,
        indices: torch.Tensor,
        ngram_visible: torch.Tensor,
        visible: torch.Tensor,
        first_output: int,
        dtype: torch.dtype,
        *,
        tap_visible: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) [B, C - first_output, D] of window positions ``first_output..C-1``.

        indices: [B, C, tables] rows of the window's n-grams; ngram_visible: [B, C, tables] whether each
        n-gram lies in the visible text; visible: [B, C] whether each window position is visible.
        The value at ``t`` is ``sum_j taps[j] * v[t - j * dilation]`` over visible earlier positions
        (zero before the window, which starts at the text or reaches back `engram_history` tokens).
        tap_visible: [B, C - first_output, taps], whether output t sees the position tap j reads (packed
        sequences, 4-D masks); None: that position's ``visible``.
        """
        batch, length, _ = indices.shape
        table_ids = torch.arange(self.num_tables, device=indices.device)
        rows = self.tables[table_ids, indices]  # [B, C, tables, sub_dim]
        rows = rows * ngram_visible[..., None].to(rows.dtype)
        fetched = rows.reshape(batch, length, -1).to(dtype)  # [B, C, engram_dim]
        fetched = quantize_activations(fetched, self.config)  # deploy numerics hook
        key = self.key_proj(fetched[:, first_output:])
        # Hidden positions contribute zero to every tap; zeros in front stand for positions before the window.
        reach = self.reach
        value_rows = self.value_proj(fetched)  # [B, C, D]
        if tap_visible is None:
            value_rows = value_rows * visible[..., None].to(dtype)
        value_rows = F.pad(value_rows, (0, 0, reach, 0))  # [B, reach + C, D]
        taps = self.conv_taps.to(dtype)
        value = 0
        for j in range(taps.shape[0]):
            start = reach + first_output - j * self.dilation
            tapped = value_rows[:, start : start + length - first_output]
            if tap_visible is not None:
                tapped = tapped * tap_visible[..., j, None].to(dtype)
            value = value + taps[j] * tapped
        return key, value


def add_engram_read(u: torch.Tensor, engram_key: torch.Tensor, engram_value: torch.Tensor, eps: float) -> torch.Tensor:
    """A layer's read of its engram site: ``u + sigmoid(<rms_unit(u), rms_unit(key)> / sqrt(D)) * value``.

    u, engram_key, engram_value: [B, T, D]; the gate in float32, the sum cast back to ``u``'s dtype.
    """
    relevance = (rms_unit(u, eps) * rms_unit(engram_key, eps)).sum(-1) / math.sqrt(u.shape[-1])  # [B, T]
    return u + (torch.sigmoid(relevance)[..., None] * engram_value.float()).to(u.dtype)


def engram_window_memory(
    engrams: nn.ModuleList,
    config: NeedleConfig,
    window_ids: torch.Tensor,
    window_visible: torch.Tensor,
    first_output: int,
    dtype: torch.dtype,
    *,
    lookback: Optional[torch.Tensor] = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Engram (key, value) [B, C - first_output, D] of window positions ``first_output..C-1``, by the
    layer that reads them.

    window_ids: [B, C] token ids; window_visible: [B, C] bool, whether each position is real text
    (positions hidden here contribute zero, exactly like positions before the window).
    lookback: [B, C - first_output, R] whether each output position sees the position k before it
    (`NeedleStepInputs.engram_lookback`: packed sequences, 4-D masks), which then decides its n-grams
    and conv taps; None: every visible earlier position.
    """
    indices = engram_hash_indices(window_ids, config.engram_orders, config.engram_num_heads, config.engram_slots)
    # An n-gram of order o ending at t is visible when its first token, t - (o - 1), is.
    visible_by_order = {order: shift_right(window_visible, order - 1) for order in config.engram_orders}
    tap_visible = None
    if lookback is not None:
        # The output positions see their n-grams' first tokens, and their taps' sources, as lookback says.
        visible_by_order = {
            order: torch.cat([visible[:, :first_output], lookback[..., order - 1]], dim=1)
            for order, visible in visible_by_order.items()
        }
        taps = range(0, config.engram_conv_taps * config.engram_conv_dilation, config.engram_conv_dilation)
        tap_visible = lookback[..., list(taps)]  # [B, C - first_output, taps]
    table_orders = engram_table_orders(config.engram_orders, config.engram_num_heads)
    ngram_visible = torch.stack([visible_by_order[order] for order in table_orders], dim=-1)  # [B, C, tables]
    return {
        layer_idx: engram(indices, ngram_visible, window_visible, first_output, dtype, tap_visible=tap_visible)
        for engram, layer_idx in zip(engrams, config.engram_layers)
    }


class NeedleEngramMemoryMixin:
    """`NeedleModel`'s engram reads (uses ``config``, ``engrams``, ``embed_tokens``, `engram_context_length`)."""

    def engram_memory(
        self, input_ids: torch.Tensor, step: NeedleStepInputs, cache: Optional[Cache]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Engram (key, value) [B, T, D] of the new tokens, by the layer that reads them.

        The window is the `engram_history` positions before the new ones (their ids from the cache's
        `NeedleEngramCacheLayer`, none without a cache) and the new ones. Positions hidden by the mask
        (padding) or before the text count as invisible: an n-gram or a conv tap that reaches one
        contributes zero.
        """
        if not self.engrams:
            return {}
        config = self.config
        batch, length = input_ids.shape
        history = self.engram_context_length
        cache_position = step.cache_position
        if cache is None:
            before_ids = input_ids.new_zeros(batch, history)
        else:
            before_ids = self.engram_cache_layer(cache).update_engram_ids(input_ids, cache_position, history)
        positions = torch.cat([cache_position[:1] - history + torch.arange(history, device=input_ids.device), cache_position])
        window_visible = step.key_visible.index_select(1, positions.clamp(min=0)) & (positions >= 0)  # [B, C]
        window_ids = torch.cat([before_ids, input_ids], dim=1)  # [B, C]

        return engram_window_memory(self.engrams, config, window_ids, window_visible, history, self.embed_tokens.weight.dtype,
                                    lookback=step.engram_lookback)

    def engram_cache_layer(self, cache: Cache) -> NeedleEngramCacheLayer:
        """The cache layer that holds the engram state (that of the first engram layer), made a Needle
        layer on first use."""
        index = self.config.engram_layers[0]
        if getattr(cache, "layer_class_to_replicate", None) is not None:
            while len(cache.layers) <= index:
                cache.layers.append(cache.layer_class_to_replicate())
        layer = cache.layers[index]
        if not isinstance(layer, NeedleEngramCacheLayer):
            layer = cache.layers[index] = NeedleEngramCacheLayer.adopt(layer)
        return layer


__all__ = ["NeedleEngram", "NeedleEngramMemoryMixin", "add_engram_read", "engram_window_memory"]
