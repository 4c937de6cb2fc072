"""The PyTorch twin's KV cache: the cache's names across transformers versions and the engram state.

- transformers 5.x renamed the cache argument and output field ``past_key_values`` to ``cache``: the
  forward passes accept both names (`merge_cache_arguments`) and the outputs fill whichever field the
  installed transformers defines (`CACHE_OUTPUT_FIELD`, `BASE_CACHE_OUTPUT_FIELD`).
- The engram needs the ids of the tokens that precede the new ones, which keys and values do not
  hold: the cache layer of the first engram layer keeps them (`NeedleEngramCacheLayer`, a
  `DynamicLayer` / `StaticLayer` subclass swapped in on first use), so `DynamicCache` and
  `StaticCache` carry the whole decoding state through cropping, beam reordering and compiled steps.

Shapes use the axis legend of `specification_needle`; history = `NeedleConfig.engram_history`.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import is_torchdynamo_compiling


# Name of the cache field in transformers' model outputs: `cache` from the 5.x rename on,
# `past_key_values` before. GenerationMixin reads the cache back from this field.
CACHE_OUTPUT_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
BASE_CACHE_OUTPUT_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def merge_cache_arguments(past_key_values, cache) -> Optional[Cache]:
    """Accept the cache under its 4.x name (`past_key_values`) or its 5.x name (`cache`); on 5.x the old
    name warns."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("pass the KV cache once, as `past_key_values` or as `cache`, not both")
    if past_key_values is not None and CACHE_OUTPUT_FIELD == "cache":
        warnings.warn(
            "`past_key_values` is the name of the KV cache before transformers 5; pass it as `cache`",
            FutureWarning,
            stacklevel=3,
        )
    found = cache if cache is not None else past_key_values
    if found is not None and not isinstance(found, Cache):
        raise TypeError(
            f"Needle needs a transformers `Cache` (e.g. DynamicCache) as its KV cache, got {type(found).__name__}; "
            "legacy tuple caches are not supported"
        )
    return found


class NeedleEngramCacheLayer:
    """What the engram memory keeps in the KV cache: the token id of every cached position.

    An engram output depends on the `NeedleConfig.engram_history` tokens before it (n-grams and the
    dilated convolution reach across the boundary of a decoding step), so a cached forward re-reads
    the ids of the positions just before the new ones. They live beside the keys and values of one
    cache layer (the one of the first engram layer) and follow them through `crop`, beam-search
    `reorder_cache`, batch selection and `reset`, the way conv states sit in the cache layers of
    recurrent hybrids. Mixed into transformers' `DynamicLayer` and `StaticLayer`; `NeedleModel`
    swaps a plain layer of a fresh `DynamicCache` / `StaticCache` for the matching one.
    """

    engram_ids: Optional[torch.Tensor] = None

    def update_engram_ids(self, input_ids: torch.Tensor, cache_position: torch.Tensor, history: int) -> torch.Tensor:
        """Store the new ids [B, T] at ``cache_position`` [T]; return the ``history`` ids before them
        [B, history] (0 before the text)."""
        raise NotImplementedError

    @staticmethod
    def adopt(layer):
        """The Needle layer holding ``layer``'s state (``layer`` itself when it already is one)."""
        if isinstance(layer, NeedleEngramCacheLayer):
            return layer
        kind = {DynamicLayer: NeedleDynamicLayer, StaticLayer: NeedleStaticLayer}.get(type(layer))
        if kind is None:
            raise TypeError(
                f"Needle keeps its engram state in DynamicCache or StaticCache layers; this cache has a "
                f"{type(layer).__name__} layer"
            )
        if layer.is_initialized and layer.get_seq_length() > 0:
            raise ValueError(
                "this cache already holds tokens but not their ids, which the engram memory needs: "
                "fill a cache only through the Needle model"
            )
        adopted = kind.__new__(kind)
        adopted.__dict__.update(layer.__dict__)
        return adopted


class NeedleDynamicLayer(NeedleEngramCacheLayer, DynamicLayer):
    """A `DynamicLayer` that also keeps the ids of its positions ([B, past])."""

    def update_engram_ids(self, input_ids: torch.Tensor, cache_position: torch.Tensor, history: int) -> torch.Tensor:
        past = self.engram_ids if self.engram_ids is not None else input_ids[:, :0]
        tail = past[:, max(past.shape[1] - history, 0) :]
        self.engram_ids = torch.cat([past, input_ids], dim=1)
        return F.pad(tail, (history - tail.shape[1], 0))

    def reset(self) -> None:
        super().reset()
        self.engram_ids = None

    def crop(self, *args) -> None:
        super().crop(*args)  # the argument's meaning differs between 4.57 and 5.x; follow the keys
        if self.engram_ids is not None:
            self.engram_ids = self.engram_ids[:, : self.get_seq_length()]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.engram_ids is not None:
            self.engram_ids = self.engram_ids.index_select(0, beam_idx.to(self.engram_ids.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.engram_ids is not None:
            self.engram_ids = self.engram_ids.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.engram_ids is not None:
            self.engram_ids = self.engram_ids[indices]


class NeedleStaticLayer(NeedleEngramCacheLayer, StaticLayer):
    """A `StaticLayer` that also keeps the ids of its positions ([B, max_cache_len], written in place,
    so a compiled decoding step keeps static addresses; cropping only moves the write position)."""

    def update_engram_ids(self, input_ids: torch.Tensor, cache_position: torch.Tensor, history: int) -> torch.Tensor:
        if self.engram_ids is None:
            self.engram_ids = torch.zeros(
                input_ids.shape[0], self.max_cache_len, dtype=torch.long, device=input_ids.device
            )
            if not is_torchdynamo_compiling():
                torch._dynamo.mark_static_address(self.engram_ids)
        positions = cache_position[0] - history + torch.arange(history, device=input_ids.device)  # [history]
        before = self.engram_ids.index_select(1, positions.clamp(min=0)).masked_fill(positions < 0, 0)
        self.engram_ids.index_copy_(1, cache_position, input_ids.long())
        return before

    def reset(self) -> None:
        super().reset()
        if self.engram_ids is not None:
            self.engram_ids.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.engram_ids is not None:
            self.engram_ids.copy_(self.engram_ids.index_select(0, beam_idx.to(self.engram_ids.device)))


def is_static_cache(cache: Cache) -> bool:
    """Whether ``cache`` preallocates its keys (`StaticCache`): masks then span its whole length."""
    return bool(cache.layers) and isinstance(cache.layers[0], StaticLayer)


def static_cache_length(cache: Cache) -> int:
    return cache.layers[0].max_cache_len


def layer_caches(cache: Optional[Cache], count: int) -> list:
    """What each of ``count`` decoder layers writes its keys into: a static cache's own layers (where
    `Cache.update` would write them, without offloading), else the cache itself (or None)."""
    if cache is not None and is_static_cache(cache) and not getattr(cache, "offloading", False) and len(cache.layers) == count:
        return list(cache.layers)
    return [cache] * count


__all__ = [
    "BASE_CACHE_OUTPUT_FIELD",
    "CACHE_OUTPUT_FIELD",
    "NeedleDynamicLayer",
    "NeedleEngramCacheLayer",
    "NeedleStaticLayer",
    "is_static_cache",
    "layer_caches",
    "merge_cache_arguments",
    "static_cache_length",
]
