"""Which keys each query of PyTorch Needle 2 attends to, and which earlier tokens its engram reads.

The attention mask follows `specification_needle.attention_rule` (causal, visible keys, the sliding
window, padding rows seeing themselves); packed sequences (padding-free batches) and 4-D masks are
turned into the per-sequence layout and the engram lookback the model reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.utils import is_torchdynamo_compiling

from .configuration_needle import NeedleConfig
from .specification_needle import attention_rule


def attention_allowed(
    key_visible: torch.Tensor, past_length: int, query_length: int, group: int, *, window: int = 0
) -> torch.Tensor:
    """Boolean attention mask [B, 1, group * T, S]: causal, restricted to visible keys (and, with
    ``window > 0``, to the last ``window`` key slots: the engine's sliding KV window, see `kv_window.py`),
    and always the query itself.

    key_visible: [B, S] (S = past + T, or the length of a static cache); past_length may be a 0-d tensor.
    A query attending to itself keeps padding rows (which see no visible key) finite and independent
    of other positions, as in the Flax model. The [T, S] rows repeat ``group`` times (group = 1 gives
    the [B, 1, T, S] mask of the attention functions).
    """
    device = key_visible.device
    query_positions = torch.arange(query_length, device=device) + past_length  # [T]
    key_positions = torch.arange(key_visible.shape[1], device=device)  # [S]
    allowed = attention_rule(query_positions[:, None], key_positions[None, :], key_visible[:, None, :], window=window)
    return (allowed.repeat(1, group, 1) if group > 1 else allowed)[:, None]  # [B, 1, group * T, S]


def default_position_ids(
    attention_mask: Optional[torch.Tensor], past_length: int, length: int, batch: int, device
) -> torch.Tensor:
    """Positions [B, T] of the new tokens: ``cumsum(mask) - 1`` over the whole mask (padding does not
    advance the position), or ``past_length + arange(S)`` without a mask. The mask may run past the new
    tokens (a static cache's full length); past_length may be a 0-d tensor."""
    new_positions = torch.arange(length, device=device) + past_length  # [T]
    if attention_mask is None:
        return new_positions[None].expand(batch, -1)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return positions.gather(1, new_positions[None].expand(batch, -1).to(positions.device))


def packed_segment_ids(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Sequence index [B, T] of every token of a padding-free (packed) batch, or None when no row packs.

    transformers' convention (`find_packed_sequence_indices`, TRL's padding-free collator,
    `DataCollatorWithFlattening`): a position that is not its predecessor's plus one starts a sequence.
    position_ids: [B, T].
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    segments = starts.long().cumsum(-1) - 1  # [B, T], 0 for the first sequence
    if not (is_torchdynamo_compiling() or torch.compiler.is_exporting()) and not bool(segments[:, -1].any()):
        return None
    return segments


def largest_position(position_ids: Optional[torch.Tensor], cu_seq_lens_q: Optional[torch.Tensor]) -> Optional[int]:
    """The largest position id a call gives (`specification_needle.positions_taken`): of ``position_ids``
    [B, T], else of the packed sequences ``cu_seq_lens_q`` [Q + 1] bounds (each from position 0), else None."""
    if position_ids is not None and position_ids.numel():
        return int(position_ids.max())
    if cu_seq_lens_q is not None:
        return int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max()) - 1
    return None


def segment_ids_from_cu_seq_lens(cu_seq_lens: torch.Tensor, length: int) -> torch.Tensor:
    """Sequence index [1, T] of a flattened row from its cumulative sequence lengths [Q + 1] (the varlen
    kernels' ``cu_seq_lens_q``: 0, end of sequence 1, ..., S)."""
    cu_seq_lens = cu_seq_lens.long().flatten()
    if cu_seq_lens.numel() < 2 or int(cu_seq_lens[0]) != 0 or int(cu_seq_lens[-1]) != length or bool(
        (cu_seq_lens.diff() < 0).any()
    ):
        raise ValueError(
            f"cu_seq_lens_q must rise from 0 to the row length {length} (the flattened batch's sequence "
            f"boundaries), got {cu_seq_lens.tolist()}"
        )
    positions = torch.arange(length, device=cu_seq_lens.device)
    return (torch.searchsorted(cu_seq_lens[1:], positions, right=True))[None]


@dataclass(frozen=True)
class PackedLayout:
    """Where the tokens of a packed batch sit when its sequences are laid out one per row for attention.

    index: [Q, M] flat position (b * T + t) of each sequence's tokens, Q sequences of up to M tokens
    (0 where a sequence is shorter); inverse: [B * T] place of each token in the [Q * M] layout.
    Attention over [Q, M] rows costs sum-over-sequences M^2 rather than T^2 per packed row.
    """

    index: torch.Tensor
    inverse: torch.Tensor

    @classmethod
    def of(cls, segment_ids: torch.Tensor) -> "PackedLayout":
        batch, length = segment_ids.shape
        device = segment_ids.device
        flat_segments = (segment_ids + torch.arange(batch, device=device)[:, None] * length).flatten()  # [B * T]
        _, sequence, counts = torch.unique_consecutive(flat_segments, return_inverse=True, return_counts=True)
        starts = counts.cumsum(0) - counts
        offsets = torch.arange(batch * length, device=device) - starts[sequence]
        longest = int(counts.max())
        inverse = sequence * longest + offsets  # [B * T]
        index = torch.zeros(counts.numel() * longest, dtype=torch.long, device=device)
        index[inverse] = torch.arange(batch * length, device=device)
        return cls(index=index.view(-1, longest), inverse=inverse)

    def attention_allowed(self, window: int = 0) -> torch.Tensor:
        """Boolean [Q, 1, M, M]: causal within each sequence, and always the query itself (the layout's
        empty slots see only themselves, so their rows stay finite)."""
        sequences, longest = self.index.shape
        device = self.index.device
        filled = torch.zeros(sequences * longest, dtype=torch.bool, device=device)
        filled[self.inverse] = True
        positions = torch.arange(longest, device=device)
        causal = positions[None, :] <= positions[:, None]  # [L, L]
        if window > 0:
            causal = causal & (positions[:, None] - positions[None, :] < window)
        itself = torch.eye(longest, dtype=torch.bool, device=device)
        return ((causal[None] & filled.view(sequences, 1, longest)) | itself[None])[:, None]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, T, H] -> [Q, N, M, H]."""
        batch, heads, length, width = x.shape
        flat = x.transpose(1, 2).reshape(batch * length, heads, width)
        return flat[self.index].transpose(1, 2)

    def unpack(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        """[Q, M, N, H] (an attention function's output) -> [B, T, N, H]."""
        sequences, longest, heads, width = x.shape
        return x.reshape(sequences * longest, heads, width)[self.inverse].view(batch, -1, heads, width)


def packed_lookback(segment_ids: torch.Tensor, key_visible: torch.Tensor, width: int) -> torch.Tensor:
    """`engram_lookback` of a packed batch without a cache: [B, T, R], whether token t sees t - k
    (visible, and in the same sequence); segment_ids, key_visible: [B, T]."""
    batch, length = segment_ids.shape
    back = torch.arange(length, device=segment_ids.device)[:, None] - torch.arange(width, device=segment_ids.device)
    earlier = back.clamp(min=0)[None].expand(batch, -1, -1)  # [B, T, R]
    same = segment_ids.gather(1, earlier.reshape(batch, -1)).view(batch, length, width) == segment_ids[..., None]
    visible = key_visible.gather(1, earlier.reshape(batch, -1)).view(batch, length, width)
    return same & visible & (back >= 0)[None]


def attention_sees_from_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """Boolean [B, T, S] (True: the query attends the key) of a custom 4-D attention mask [B, 1, T, S]:
    a boolean mask (True = attend) or an additive float one (0 = attend, a large negative number or
    -inf = masked, as transformers' own 4-D masks)."""
    if attention_mask.dtype == torch.bool:
        return attention_mask[:, 0]
    if not attention_mask.is_floating_point():
        raise ValueError(
            f"a 4-D attention_mask must be boolean (True = attend) or additive float (0 = attend, the dtype's "
            f"minimum or -inf = masked), got dtype {attention_mask.dtype}"
        )
    masked = attention_mask[:, 0] < 0
    if not (is_torchdynamo_compiling() or torch.compiler.is_exporting()):
        values = attention_mask[:, 0]
        if bool(((values != 0) & (values > torch.finfo(values.dtype).min / 2)).any()):
            raise ValueError(
                "a float 4-D attention_mask must hold 0 (attend) and large negative values (masked) only: "
                "Needle has no additive attention biases"
            )
    return ~masked


def engram_lookback(sees: torch.Tensor, past_length, width: int) -> torch.Tensor:
    """[B, T, R] bool: whether new token t (at ``past_length + t``) sees the position k before it,
    read off ``sees`` [B, T, S] (query t, key position); False before the first position."""
    batch, length, keys = sees.shape
    device = sees.device
    back = torch.arange(length, device=device)[:, None] + past_length - torch.arange(width, device=device)  # [T, R]
    gathered = sees.gather(2, back.clamp(0, keys - 1)[None].expand(batch, -1, -1))
    return gathered & (back >= 0)[None]


def check_engram_lookback(lookback: torch.Tensor, real: torch.Tensor, config: NeedleConfig) -> None:
    """Refuse a 4-D mask under which an engram output would read tokens its query does not see.

    The engram of token t hashes the n-grams ending at t and convolves the values of t - dilation * j,
    each hashing its own n-gram: it reads the tokens just before t by their places in the row. That is
    well defined when each query sees, within `engram_history` positions, every real token between
    itself and the earliest one it sees (padding, seen by nobody, may lie between), and every token the
    n-grams of the positions its taps read reach. Causal, padding and packed (block-diagonal) masks
    satisfy this; shared-prefix and tree masks, where a branch sits right after a sibling, do not.

    lookback: [B, T, R] (`engram_lookback`); real: [B, T, R] whether that position is real text.
    """
    hole = ~lookback & real  # [B, T, R]
    hole_before = torch.cummax(hole.int(), dim=-1).values.bool()  # a hole at or before k
    violation = lookback[..., 1:] & hole_before[..., :-1]  # sees k while a real token nearer is hidden
    # Row t sees its tap source s = t - d*j and s's n-gram reaches s - m: t must see s - m as well.
    dilation, width = config.engram_conv_dilation, lookback.shape[-1]
    length = lookback.shape[1]
    for j in range(1, config.engram_conv_taps):
        k = j * dilation
        if k >= length:
            break
        source = F.pad(lookback[:, : length - k], (0, 0, k, 0))  # row t - k of the new tokens, [B, T, R]
        for m in range(1, max(config.engram_orders)):
            if k + m < width:
                leak = lookback[..., k] & source[..., m] & ~lookback[..., k + m] & real[..., k + m]
                violation = violation | F.pad(leak[..., None], (0, violation.shape[-1] - 1))
    if bool(violation.any()):
        b, t, _ = (int(i) for i in violation.nonzero()[0])
        raise ValueError(
            f"attention_mask (4-D): query {t} of row {b} sees some of the {config.engram_history} tokens before it "
            "but not a real token between them; Needle's engram memory hashes the n-grams ending at each position "
            "by their places in the row, so this mask (a shared prefix or tree of branches, say) has no Needle "
            "meaning. Run such branches as separate rows (or packed sequences with position_ids restarting at 0)."
        )


def flex_block_mask(allowed: torch.Tensor):
    """The [B, 1, T, S] boolean mask as flex attention's `BlockMask` (a mask read inside a score
    modification is what the CPU kernels of torch 2.13 mishandle; a block mask they run)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, _, length, keys = allowed.shape

    def visible(b, h, q, k):
        return allowed[b, 0, q, k]

    return create_block_mask(visible, batch, None, length, keys, device=allowed.device)
