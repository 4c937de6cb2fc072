"""The multi-token-prediction head of PyTorch Needle 2: from the backbone's final hidden state at t and
the embedding of token t + 1, a decoder block predicts token t + 2 (``mtp_logits[:, t]``).
`speculative.py` drafts with it. Flax twin: `mtp_flax_needle`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import Cache

from .configuration_needle import NeedleConfig
from .deploy_numerics import quantize_activations  # deploy numerics hook
from .norms_needle import NeedleRMSNorm
from .step_inputs_needle import NeedleStepInputs


class NeedleMultiTokenPrediction(nn.Module):
    """MTP head: ``block(cat(h, norm(E[next] * sqrt(D))) W)`` then a norm; its tied logits predict token t + 2."""

    def __init__(self, config: NeedleConfig, *, block_class: type[nn.Module]):
        """``block_class``: the decoder block (`modeling_needle.NeedleBlock`), built as layer 0."""
        super().__init__()
        d = config.hidden_size
        self.config = config  # deploy numerics hook
        self.combine_proj = nn.Linear(2 * d, d, bias=False)
        self.embed_norm = NeedleRMSNorm(d, config.rms_norm_eps)
        self.norm = NeedleRMSNorm(d, config.rms_norm_eps)
        # Layer 0 of the MTP's own cache when it drafts while decoding (`speculative.py`); uncached otherwise.
        self.block = block_class(config, layer_idx=0)

    def forward(
        self, hidden: torch.Tensor, next_embedded: torch.Tensor, step: NeedleStepInputs, cache: Optional[Cache] = None
    ) -> torch.Tensor:
        """hidden: [B, T, D] final-normed backbone output; next_embedded: [B, T, D] float32 ``E[t+1] * sqrt(D)``;
        cache: the MTP block's own one-layer cache of the positions before these (None: the whole text)."""
        combined = torch.cat([hidden, self.embed_norm(next_embedded).to(hidden.dtype)], dim=-1)
        combined = quantize_activations(combined, self.config)  # deploy numerics hook
        return self.norm(self.block.block(self.combine_proj(combined), step, cache=cache)[0])


def text_mtp_hidden(
    causal_lm: nn.Module,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    *,
    attention_window: Optional[int] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The MTP head's output [B, T, D] over a whole text (``causal_lm.mtp``; ``hidden`` [B, T, D] is the
    backbone's final-normed output of ``input_ids`` [B, T], the other arguments those of its forward).
    In a packed batch a sequence's last token is followed by nothing (id 0), as at the end of a row."""
    backbone = causal_lm.model
    step = backbone.call_step_inputs(input_ids, attention_mask, position_ids, None, attention_window=attention_window,
                                     cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
    next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    segments = None
    if cu_seq_lens_q is not None or (attention_mask is None and position_ids is not None):
        segments = backbone.sequence_segments(attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                                              input_ids.shape[1], 0)
    if segments is not None:
        last = torch.cat([segments[:, 1:] != segments[:, :-1], torch.ones_like(segments[:, :1], dtype=torch.bool)], 1)
        next_ids = next_ids.masked_fill(last, 0)
    return causal_lm.mtp(hidden, backbone.embed(next_ids), step)


__all__ = ["NeedleMultiTokenPrediction", "text_mtp_hidden"]
