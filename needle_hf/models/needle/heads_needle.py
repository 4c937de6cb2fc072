"""The output heads of PyTorch Needle 2 that read the backbone without a block of their own: the tied
language-model logits and the probe-pooling heads of tool retrieval (contrastive) and answer
confidence, with the causal LM's methods that run them (`NeedleHeadsMixin`). (The MTP head runs a
decoder block: `mtp_needle`.)
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .configuration_needle import NeedleConfig
from .numerics import CONFIDENCE_PROBES, CONTRASTIVE_NORM_EPS, CONTRASTIVE_PROBES, CONTRASTIVE_TEMPERATURE_INIT


def tied_logits(hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
    """Float32 ``hidden @ E.T``: [..., D] -> [..., V] (the output head is the token embedding)."""
    return hidden.float() @ embedding_weight.float().T


def probe_pool(cells: torch.Tensor, keep: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """Attention pooling of every (position, layer) cell by learned probes.

    cells: [B, T, L + 1, D] float32; keep: [B, T] bool; probes: [P, D] -> [B, P * D] float32.
    """
    batch, length, depth, width = cells.shape
    flat = cells.reshape(batch, length * depth, width)
    keep = keep.repeat_interleave(depth, dim=1)  # position-major, like the cells
    scores = torch.einsum("bcd,kd->bkc", flat, probes.float()) / math.sqrt(width)
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    weights = scores.softmax(dim=-1)
    return torch.einsum("bkc,bcd->bkd", weights, flat).reshape(batch, -1)


class NeedleContrastiveHead(nn.Module):
    """Tool-retrieval embedding: probe pooling, a projection, L2 normalisation, plus a learned log-temperature."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        self.probes = nn.Parameter(torch.zeros(CONTRASTIVE_PROBES, config.hidden_size))
        self.proj = nn.Linear(CONTRASTIVE_PROBES * config.hidden_size, config.contrastive_dim, bias=False)
        self.log_temperature = nn.Parameter(torch.tensor(math.log(CONTRASTIVE_TEMPERATURE_INIT)))

    def forward(self, cells: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        projected = self.proj(probe_pool(cells, keep, self.probes).to(dtype))  # [B, C]
        norm = torch.sqrt(projected.float().pow(2).sum(-1, keepdim=True) + CONTRASTIVE_NORM_EPS)
        return projected / norm.to(projected.dtype)


class NeedleConfidenceHead(nn.Module):
    """Answer-confidence logit: probe pooling and an affine map to one float32 logit per sequence."""

    def __init__(self, config: NeedleConfig):
        super().__init__()
        self.probes = nn.Parameter(torch.zeros(CONFIDENCE_PROBES, config.hidden_size))
        self.proj = nn.Linear(CONFIDENCE_PROBES * config.hidden_size, 1, bias=True)

    def forward(self, cells: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.proj(probe_pool(cells, keep, self.probes).to(dtype))[..., 0].float()


class NeedleHeadsMixin:
    """`NeedleForCausalLM`'s probe-pooling heads over its backbone (uses ``config``, ``model``,
    ``contrastive_head``, ``confidence_head``)."""

    def _probe_cells(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cells [B, T, L + 1, D] float32 (``x0`` and the lane mean after every layer) and their keep mask [B, T].

        Without an attention_mask, padding is ``input_ids == pad_token_id``. Positions are 0..T-1 as in
        the reference (RoPE is relative, so left padding does not change the result).
        """
        if attention_mask is None:
            attention_mask = (input_ids != self.config.pad_token_id).long()
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                             output_hidden_states=True, return_dict=True)
        return self.cells_from_hidden_states(input_ids, outputs.hidden_states), attention_mask.bool()

    def cells_from_hidden_states(self, input_ids: torch.Tensor, hidden_states: tuple) -> torch.Tensor:
        """The heads' cells [B, T, L + 1, D] float32 from a forward's ``hidden_states`` (``output_hidden_states=True``):
        ``x0`` and the lane mean after every layer. Lets a training step read the heads off its own forward."""
        cells = torch.stack([self.model.embed(input_ids), *[h.float() for h in hidden_states[1:]]], dim=2)
        return cells.detach()  # the heads read a fixed backbone (`specification_needle`)

    def contrastive_embedding(
        self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tool-retrieval embedding: (L2-normalised [B, contrastive_dim], log_temperature scalar)."""
        if self.contrastive_head is None:
            raise ValueError("this model has no contrastive head (config.use_contrastive_head is False)")
        cells, keep = self._probe_cells(input_ids, attention_mask)
        embedding = self.contrastive_head(cells, keep, self.model.embed_tokens.weight.dtype)
        return embedding, self.contrastive_head.log_temperature

    def confidence_logit(
        self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Answer-confidence logit [B] float32."""
        if self.confidence_head is None:
            raise ValueError("this model has no confidence head (config.use_confidence_head is False)")
        cells, keep = self._probe_cells(input_ids, attention_mask)
        return self.confidence_head(cells, keep, self.model.embed_tokens.weight.dtype)

