"""The tensors one PyTorch Needle 2 forward call derives once and every layer reads: masks, RoPE
tables, the Walsh operand and the hyper-connection offsets (`NeedleStepInputs`), and how the backbone
builds them from a call's arguments (`NeedleStepInputsMixin`, which `NeedleModel` inherits):
2-D and 4-D attention masks, packed sequences, the sliding window, flex attention's block mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache
from transformers.utils import is_torchdynamo_compiling

from .cache_needle import is_static_cache, static_cache_length

from .masking_needle import (
    PackedLayout,
    attention_allowed,
    attention_sees_from_4d,
    check_engram_lookback,
    default_position_ids,
    engram_lookback,
    flex_block_mask,
    packed_lookback,
    packed_segment_ids,
    segment_ids_from_cu_seq_lens,
)
from .ops_needle import architecture_constant, rope_tables, walsh_operand
from .specification_needle import attention_window_option


@dataclass
class NeedleStepInputs:
    """Tensors derived once per forward call and shared by every layer (and the MTP block).

    key_visible: [B, S] bool, which key positions are real text (S = past + T, or a static cache's length).
    attention_mask: [B, 1, T, S] additive mask in the compute dtype (0 allowed, the dtype's minimum not);
        for flex attention the same mask as a `BlockMask`.
    cos, sin: [B, 1, T, H] float32 RoPE tables of the new positions (both halves the same).
    cache_position: [T] positions of the new tokens in the cache (where their keys are written).
    walsh: [W, W] Walsh-Hadamard matrix (compute dtype), or its Kronecker factors (`walsh_transform`).
    pre_offsets, post_offsets: [layers, L] float32 lane-ownership offsets of the hyper-connection
        logits (`numerics.hyper_connection_offsets`).
    attention_implementation: the attention function to use instead of the config's (a compiled
        decoding step runs sdpa as the same grouped products as eager, see `_DecoderLayerStep`).
    engram_lookback: [B, T, R] bool, whether new token t sees the position k before it
        (`engram_lookback`), for packed sequences and 4-D masks; None: read from ``key_visible`` (a
        position sees every visible position before it).
    packed_layout: a packed batch's sequences one per row (`PackedLayout`); attention then runs over
        that layout, and ``attention_mask`` is its [Q, 1, M, M] mask.
    plain_causal: ``attention_mask`` is the plain causal mask over S = T keys (a whole prompt without
        padding, window or packing), so the CPU's sdpa kernel runs it in blocks of query rows over the
        keys up to each block's end (`grouped_sdpa_attention_forward`); decided outside traced graphs only.
    """

    key_visible: torch.Tensor
    attention_mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cache_position: torch.Tensor
    walsh: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
    pre_offsets: torch.Tensor
    post_offsets: torch.Tensor
    attention_implementation: Optional[str] = None
    engram_lookback: Optional[torch.Tensor] = None
    packed_layout: Optional[PackedLayout] = None
    plain_causal: bool = False


class NeedleStepInputsMixin:
    """`NeedleModel`'s builder of its `NeedleStepInputs` (reads ``config``, ``embed_tokens`` and the
    ``_constant_copies`` dict the model owns)."""

    def step_inputs(
        self,
        batch: int,
        length: int,
        cache_position: torch.Tensor,
        key_length: int,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        *,
        attention_window: int = 0,
        segment_ids: Optional[torch.Tensor] = None,
        packed_attention: bool = True,
    ) -> NeedleStepInputs:
        """Masks, RoPE tables and constants of a forward call over ``length`` new tokens at ``cache_position``
        [T], attending over ``key_length`` keys (past + T, or a static cache's length);
        ``attention_window``: see `attention_allowed`.

        attention_mask: 2-D [B, S'] (1 = real token, S' <= S), or a custom 4-D [B, 1, T, S]
        (`attention_sees_from_4d`; refused where the engram has no meaning, `check_engram_lookback`).
        segment_ids: [B, T] sequence index of each token of a packed batch (no cached tokens; see
        `NeedleModel.sequence_segments`): a token sees only the earlier tokens of its own sequence.
        packed_attention: run a packed batch's attention over its sequences laid out one per row
        (`PackedLayout`) rather than over [T, T] masks (False: attention probabilities are wanted
        in the batch's own shape).
        """
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        past_length = cache_position[0]
        sees = None  # [B, T, S] bool, only where it is not causal-over-visible-keys
        if attention_mask is None:
            key_visible = torch.ones(batch, key_length, dtype=torch.bool, device=device)
        elif attention_mask.dim() == 4:
            if attention_mask.shape[0] != batch or attention_mask.shape[1] != 1 or attention_mask.shape[2] != length \
                    or attention_mask.shape[3] > key_length:
                raise ValueError(
                    f"a 4-D attention_mask must be [batch, 1, new tokens, past + new tokens]: expected shape "
                    f"{(batch, 1, length, key_length)}, got {tuple(attention_mask.shape)}"
                )
            sees = attention_sees_from_4d(attention_mask.to(device))
            sees = F.pad(sees, (0, key_length - sees.shape[-1]))  # a static cache's free slots
            key_visible = sees.any(dim=1)  # [B, S]: the keys some query sees (padding: none)
        else:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"Needle takes a 2-D attention_mask [batch, past + new tokens] marking real tokens with 1, "
                    f"or a 4-D one [batch, 1, new tokens, past + new tokens], got shape {tuple(attention_mask.shape)}"
                )
            if attention_mask.shape[0] != batch or attention_mask.shape[1] > key_length:
                raise ValueError(
                    f"attention_mask must cover the cached and the new tokens: expected shape {(batch, key_length)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            key_visible = attention_mask.to(device=device, dtype=torch.bool)
            key_visible = F.pad(key_visible, (0, key_length - key_visible.shape[1]))  # a static cache's free slots
        if segment_ids is not None:
            if key_length != length or tuple(segment_ids.shape) != (batch, length):
                raise ValueError(
                    f"packed sequences (segment ids {tuple(segment_ids.shape)}) need a forward over the whole "
                    f"text of shape {(batch, length)} without cached tokens (key length {key_length})"
                )
            segment_ids = segment_ids.to(device)
        traced = is_torchdynamo_compiling() or torch.compiler.is_exporting()
        layout = None
        if segment_ids is not None and sees is None and packed_attention and not traced \
                and self.config._attn_implementation != "flex_attention":
            layout = PackedLayout.of(segment_ids)
        elif segment_ids is not None:
            same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            sees = (sees if sees is not None else causal[None] & key_visible[:, None, :]) & same
        if position_ids is None and segment_ids is not None:  # each packed sequence starts at 0
            index = torch.arange(length, device=device).expand(batch, -1)
            starts = torch.ones_like(segment_ids, dtype=torch.bool)
            starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
            position_ids = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
        elif position_ids is None:
            mask_2d = key_visible.long() if sees is not None else attention_mask
            position_ids = default_position_ids(mask_2d, past_length, length, batch, device)
        inverse_frequencies = self.constant("rope_inverse_frequencies", device, torch.float32)
        cos, sin = rope_tables(position_ids.to(device), inverse_frequencies)  # [B, T, H] each
        lookback = None
        if layout is not None:
            allowed = layout.attention_allowed(attention_window)  # [Q, 1, M, M]
            lookback = packed_lookback(segment_ids, key_visible, self.config.engram_history + 1)
        else:
            allowed = attention_allowed(key_visible, past_length, length, group=1, window=attention_window)  # [B, 1, T, S]
        if sees is not None:
            query_positions = torch.arange(length, device=device) + past_length
            itself = torch.arange(key_length, device=device)[None, :] == query_positions[:, None]  # [T, S]
            allowed = ((sees & allowed[:, 0]) | itself[None])[:, None]  # window and causality still apply
            width = self.config.engram_history + 1
            lookback = engram_lookback(sees, past_length, width)  # [B, T, R]
            if attention_mask is not None and attention_mask.dim() == 4 and not (
                is_torchdynamo_compiling() or torch.compiler.is_exporting()
            ):
                check_engram_lookback(lookback, engram_lookback(key_visible[:, None, :].expand(-1, length, -1),
                                                                past_length, width), self.config)
        if self.config._attn_implementation == "flex_attention":
            attention_mask_4d = flex_block_mask(allowed)
        else:
            attention_mask_4d = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, torch.finfo(dtype).min
            )
        return NeedleStepInputs(
            key_visible=key_visible,
            attention_mask=attention_mask_4d,
            cos=cos[:, None],
            sin=sin[:, None],
            cache_position=cache_position,
            walsh=self.walsh(device, dtype),
            pre_offsets=self.constant("pre_offsets", device, torch.float32),
            post_offsets=self.constant("post_offsets", device, torch.float32),
            engram_lookback=lookback,
            packed_layout=layout,
            plain_causal=(
                not traced and layout is None and sees is None and key_length == length and length > 1
                and (attention_window == 0 or attention_window >= length)
                and int(past_length) == 0 and bool(key_visible.all())
            ),
        )

    def sequence_segments(
        self,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        cu_seq_lens_q: Optional[torch.Tensor],
        cu_seq_lens_k: Optional[torch.Tensor],
        length: int,
        past_length: int,
    ) -> Optional[torch.Tensor]:
        """Sequence index [B, T] of each token when the batch packs several sequences per row, else None.

        A padding-free batch (TRL's ``padding_free=True``, `DataCollatorWithFlattening`) has no
        attention_mask and gives its boundaries as ``position_ids`` restarting at 0 and, for the varlen
        kernels, as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (one flattened row); transformers reads
        packing only there (no mask, no cached tokens), and so does Needle.
        """
        if cu_seq_lens_k is not None and (cu_seq_lens_q is None or not torch.equal(cu_seq_lens_q.cpu(), cu_seq_lens_k.cpu())):
            raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: Needle's attention is self-attention")
        if attention_mask is not None or past_length:
            if cu_seq_lens_q is not None:
                raise ValueError(
                    "cu_seq_lens_q describes a padding-free batch: pass it without attention_mask and without cached tokens"
                )
            return None
        if cu_seq_lens_q is not None:
            segments = segment_ids_from_cu_seq_lens(cu_seq_lens_q, length)
            if position_ids is not None and position_ids.shape[0] != 1:
                raise ValueError(f"cu_seq_lens_q describes one flattened row, got position_ids of shape {tuple(position_ids.shape)}")
            return segments
        return packed_segment_ids(position_ids) if position_ids is not None else None


    def constant(self, name: str, device, dtype) -> torch.Tensor:
        """`architecture_constant` ``name`` on ``device`` in ``dtype``, built once per placement."""
        placement = (name, str(device), dtype)
        if placement not in self._constant_copies:
            table = architecture_constant(name, self.config)
            self._constant_copies[placement] = torch.from_numpy(table).to(device=device, dtype=dtype)
        return self._constant_copies[placement]

    def walsh(self, device: torch.device, dtype: torch.dtype) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """What the MLPs' `walsh_transform` reads (`walsh_operand`), on ``device`` in ``dtype``."""
        return walsh_operand(self.config, lambda name: self.constant(name, device, dtype))

    def call_step_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        cache: Optional[Cache],
        *,
        cache_position: Optional[torch.Tensor] = None,
        attention_window: Optional[int] = None,
        cu_seq_lens_q: Optional[torch.Tensor] = None,
        cu_seq_lens_k: Optional[torch.Tensor] = None,
        packed_attention: bool = True,
    ) -> NeedleStepInputs:
        """The step inputs of a forward call over ``input_ids`` [B, T] with these arguments (see
        `NeedleModel.forward`): where the new tokens go in ``cache``, how many keys they attend over,
        the window (default ``config.attention_window``) and a packed batch's sequences."""
        batch, length = input_ids.shape
        device = input_ids.device
        static = cache is not None and is_static_cache(cache)
        if cache_position is None:
            past = cache.get_seq_length() if cache is not None else 0
            cache_position = torch.arange(length, device=device) + past
        if static:
            key_length = static_cache_length(cache)
        else:
            key_length = (cache.get_seq_length() if cache is not None else 0) + length
            if attention_mask is not None and attention_mask.shape[-1] != key_length:
                expected = (batch, key_length) if attention_mask.dim() != 4 else (batch, 1, length, key_length)
                raise ValueError(
                    f"attention_mask must cover the cached and the new tokens: expected shape {expected}, "
                    f"got {tuple(attention_mask.shape)}"
                )
        window = self.config.attention_window if attention_window is None else attention_window_option(attention_window)
        segments = None
        if cu_seq_lens_q is not None or cu_seq_lens_k is not None or (attention_mask is None and position_ids is not None):
            past_length = 0 if cache is None else int(cache.get_seq_length())
            segments = self.sequence_segments(attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k, length,
                                              past_length)
        return self.step_inputs(batch, length, cache_position, key_length, attention_mask, position_ids,
                                attention_window=window, segment_ids=segments, packed_attention=packed_attention)


__all__ = ["NeedleStepInputs", "NeedleStepInputsMixin"]
