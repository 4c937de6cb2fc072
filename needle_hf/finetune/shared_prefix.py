"""Shared-prefix batches: rows that begin with the same tokens run those tokens once.

A tool-calling example is mostly prompt: the system text and the tools' schemas (hundreds of tokens)
come before a query and an answer of tens. When the rows of a batch offer the same tools and system
text, their token ids agree up to the query. `SharedPrefixCollator` cuts that common prefix off
the batch; `shared_prefix_forward` runs it once (batch 1, filling a KV cache), repeats the cache
across the batch and runs each row's remaining tokens on top of it. Under the causal mask every
remaining position sees the same positions as in the row's own forward (the cache also carries the
ids the engram memory reads across the cut), so logits, loss and gradients are the padded batch's,
for ``P + B x S`` positions of work instead of ``B x (P + S)``.

`PrefixGroupedBatchSampler` makes such batches: it draws each batch from one group of rows (the
caller's key, e.g. `conversation_prefix_key`: the tools and the system text), shuffled anew every
epoch. `needle_hf.finetune.trainer.NeedleTrainer` takes it as ``train_batch_sampler`` and reads the
collator's ``prefix_ids`` in its loss.

Shapes use the axis legend of `needle_hf.models.needle.specification_needle` (B batch, T tokens);
P = prefix length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable, Sequence
from typing import Iterator

import numpy as np
import torch

from ..models.needle.cache_needle import CACHE_OUTPUT_FIELD
from .data import IGNORE_INDEX, FinetuneDataError, NeedlePaddingCollator, checked_option


def conversation_prefix_key(row: dict) -> str:
    """What decides a conversation row's prompt prefix: its tools and its system message (JSON text).

    ``row``: a row of `needle_hf.finetune.data.conversations_dataset` (``messages``, ``tools``).
    """
    if not isinstance(row, dict) or "messages" not in row or "tools" not in row:
        raise FinetuneDataError(f"row: expected a conversation with 'messages' and 'tools', found "
                                f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
    system = [message.get("content") for message in row["messages"]
              if isinstance(message, dict) and message.get("role") == "system"]
    return json.dumps([row["tools"], system], sort_keys=True, allow_nan=False)


class PrefixGroupedBatchSampler:
    """Batches of dataset indices, each drawn from one group of rows that share a prompt prefix.

    Each epoch the rows of every group are shuffled and cut into batches of ``batch_size`` (a
    group's last batch may be smaller), and the batches of all groups are shuffled together, so
    every row is seen once per epoch. The order depends only on ``seed`` and the epoch (`set_epoch`,
    which `Trainer` calls at the start of each epoch).

    Args:
        keys: one hashable key per dataset row; rows with equal keys may share a batch.
        batch_size: rows per batch (at least 1).
        seed: the shuffling seed.
    """

    def __init__(self, keys: Sequence[Hashable], *, batch_size: int, seed: int = 0):
        self.batch_size = checked_option("batch_size", batch_size, low=1, integer=True)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed: expected an int, found {seed!r}")
        groups: dict = {}
        for index, key in enumerate(keys):
            try:
                groups.setdefault(key, []).append(index)
            except TypeError:
                raise FinetuneDataError(f"keys[{index}]: expected a hashable key, found {type(key).__name__}") from None
        if not groups:
            raise FinetuneDataError("keys: expected one key per dataset row, found none")
        self.groups = list(groups.values())
        self.rows = len(keys)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(-(-len(group) // self.batch_size) for group in self.groups)

    def __iter__(self) -> Iterator[list[int]]:
        generator = random.Random(self.seed * 1_000_003 + self.epoch)
        batches = []
        for group in self.groups:
            order = list(group)
            generator.shuffle(order)
            batches += [order[start:start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        generator.shuffle(batches)
        return iter(batches)


class SharedPrefixCollator:
    """Pads a batch after cutting off the token prefix all its rows share.

    The prefix ends before the logit that scores any row's first target, and leaves every row at
    least one token. Returns `NeedlePaddingCollator`'s batch of the rows' remaining tokens
    (``input_ids``, ``attention_mask``, ``labels`` [B, T]) and ``prefix_ids`` [1, P]; with no common
    prefix (P = 0) the plain padded batch, without ``prefix_ids``.
    """

    def __init__(self, *, pad_token_id: int):
        self.padding = NeedlePaddingCollator(pad_token_id=pad_token_id)

    def __call__(self, rows: list[dict]) -> dict:
        checked = self.padding.checked_rows(rows)
        first = checked[0][0]
        limit = min(len(ids) for ids, _ in checked) - 1
        for _, labels in checked:
            targets = np.flatnonzero(labels != IGNORE_INDEX)
            if len(targets):
                limit = min(limit, int(targets[0]) - 1)
        limit = max(limit, 0)  # a row labelled from its first token (or an empty row) leaves no prefix to cut
        differs = np.zeros(limit, bool)
        for ids, _ in checked[1:]:
            differs |= ids[:limit] != first[:limit]
        length = int(np.argmax(differs)) if differs.any() else limit
        batch = self.padding.pad([(ids[length:], labels[length:]) for ids, labels in checked])
        if length:
            batch["prefix_ids"] = torch.from_numpy(first[None, :length].copy())
        return batch


def shared_prefix_forward(model, *, prefix_ids: torch.Tensor, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor):
    """The model's outputs for the rows ``prefix_ids + input_ids[b]``, at the positions of ``input_ids``.

    Args:
        model: a Needle causal LM (or a PEFT model around one).
        prefix_ids: [1, P] the tokens every row begins with.
        input_ids: [B, T] each row's tokens after the prefix, padded on the right.
        attention_mask: [B, T] 1 on ``input_ids``' real tokens.
    Returns:
        the model's output for ``input_ids``: ``logits`` [B, T, V] (``logits[:, t]`` scores
        ``input_ids[:, t + 1]``), equal to the full rows' logits at those positions.
    """
    if prefix_ids.dim() != 2 or prefix_ids.shape[0] != 1:
        raise ValueError(f"prefix_ids: expected a [1, tokens] tensor, found {tuple(prefix_ids.shape)}")
    if input_ids.dim() != 2 or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"input_ids and attention_mask: expected two [batch, tokens] tensors of one shape, found "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    # Only the cache of the prefix is needed: its logits (a [P, V] product) are not computed.
    prefix = model(input_ids=prefix_ids.to(input_ids.device), use_cache=True, logits_to_keep=1)
    cache = getattr(prefix, CACHE_OUTPUT_FIELD)
    cache.batch_repeat_interleave(input_ids.shape[0])
    mask = torch.cat([attention_mask.new_ones(input_ids.shape[0], prefix_ids.shape[1]), attention_mask], dim=1)
    return model(input_ids=input_ids, attention_mask=mask, use_cache=True, **{CACHE_OUTPUT_FIELD: cache})


__all__ = ["PrefixGroupedBatchSampler", "SharedPrefixCollator", "conversation_prefix_key", "shared_prefix_forward"]
