"""MTP self-speculative greedy decoding for the PyTorch Needle model (`generate(..., use_mtp=True)`).

Needle's multi-token-prediction head reads the backbone's hidden state at ``t`` and the embedding of
token ``t + 1`` and predicts token ``t + 2``. Each step of the loop below feeds the backbone two
tokens, the last verified token ``x`` and the head's draft ``d`` of the token after it:

    backbone([x, d])  ->  argmax at x   = the true next token  v   (verified)
                          argmax at d   = the token after d        (valid only if v == d)

If every unfinished row has ``v == d``, both tokens are kept (two tokens for one backbone forward);
otherwise only ``v`` is kept and the cache entry of ``d`` is cropped away. Either way the output is
exactly what plain greedy decoding writes. The MTP block then runs on the verified positions only,
with its own one-layer KV cache, and drafts the next ``d``; it never sees a rejected token, so
nothing of a rejection survives in its state. The engram state lives in the backbone's cache and is
cropped with it, so it is exact right after a rejection too.

A batch (left padding welcome) keeps two tokens only when all its unfinished rows accept, so every
row stays aligned and exact; acceptance is therefore highest at batch 1.

Scope: greedy decoding, no logits processors, no beams; the options that would change the tokens
are refused with an error instead of being ignored.

Axis letters: B batch, S new tokens of a step, T sequence so far, V vocabulary, d width.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from transformers import DynamicCache


@dataclasses.dataclass
class MTPGenerateOutput:
    """`generate(use_mtp=True, return_dict_in_generate=True)`.

    sequences: [B, T] prompt and generated ids (padded with pad_token_id after EOS, as `generate`).
    drafted: steps that carried a draft token; accepted: steps whose draft every row accepted.
    forwards: backbone forward calls after the prompt's.
    """

    sequences: Optional[torch.LongTensor] = None
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0


class _Decoder:
    """The backbone and the MTP head over their caches, for one batch."""

    def __init__(self, model, attention_window: int):
        self.model = model
        self.window = attention_window
        self.cache = DynamicCache(config=model.config)
        self.mtp_cache = DynamicCache()

    def backbone(self, new_ids: torch.Tensor, sequence: torch.Tensor, mask: torch.Tensor):
        """new_ids [B, S] after the cached positions; sequence [B, >= past]; mask [B, past + S].
        Returns (final-normed hidden [B, S, d], logits [B, S, V] float32)."""
        out = self.model.model(input_ids=new_ids, attention_mask=mask, cache=self.cache, use_cache=True,
                               attention_window=self.window)
        return out.last_hidden_state, self.model.tied_logits(out.last_hidden_state)

    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """MTP over verified positions: hidden [B, S, d] and the tokens after them [B, S]; mask
        [B, cached + S]. Returns the draft [B] of the token two after the last position."""
        batch, length = next_ids.shape
        past = self.mtp_cache.get_seq_length()
        positions = torch.arange(length, device=hidden.device) + past
        step = self.model.model.step_inputs(batch, length, positions, past + length, mask, None,
                                            attention_window=self.window)
        predicted = self.model.mtp(hidden, self.model.model.embed(next_ids), step, cache=self.mtp_cache)
        return self.model.tied_logits(predicted[:, -1:])[:, -1].argmax(-1)

    def crop(self, length: int):
        """Keep the first ``length`` cached positions (a negative count: 5.x takes no other form, 4.57 both)."""
        surplus = self.cache.get_seq_length() - length
        if surplus > 0:
            self.cache.crop(-surplus)


def _refuse_unsupported(model, generation_config, kwargs: dict):
    if model.mtp is None:
        raise ValueError("use_mtp=True needs the MTP head (config.use_mtp_head is False)")
    checks = {
        "do_sample": (generation_config.do_sample, False),
        "num_beams": (generation_config.num_beams, 1),
        "num_return_sequences": (generation_config.num_return_sequences, 1),
    }
    for name, (found, expected) in checks.items():
        if found not in (expected, None):
            raise ValueError(f"use_mtp=True decodes greedily: {name} must be {expected}, got {found}")
    for name in ("logits_processor", "stopping_criteria", "assistant_model", "prompt_lookup_num_tokens",
                 "streamer", "past_key_values", "cache"):
        if kwargs.get(name) is not None and kwargs.get(name) != []:
            raise ValueError(f"use_mtp=True does not take {name}")
    unknown = set(kwargs) - {"attention_mask", "attention_window", "logits_processor", "stopping_criteria"}
    if unknown:
        raise ValueError(f"use_mtp=True: unsupported generate arguments {sorted(unknown)}")


@torch.no_grad()
def mtp_generate(model, input_ids: torch.LongTensor, generation_config, **kwargs) -> Union[torch.LongTensor, MTPGenerateOutput]:
    """Greedy decoding with MTP self-speculation; tokens identical to ``generate(do_sample=False)``.

    Args:
        model: a `NeedleForCausalLM` with an MTP head.
        input_ids: [B, T] prompt ids (left padded for batches).
        generation_config: the resolved `GenerationConfig` (max_new_tokens / max_length, eos and pad ids,
            return_dict_in_generate).
        kwargs: ``attention_mask`` [B, T] and ``attention_window`` (see `NeedleModel.forward`).
    """
    _refuse_unsupported(model, generation_config, kwargs)
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    if generation_config.max_new_tokens is not None:
        budget = generation_config.max_new_tokens
    else:
        budget = generation_config.max_length - prompt_length
    eos = generation_config.eos_token_id
    eos_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), device=device)
    pad_id = generation_config.pad_token_id
    if pad_id is None:
        pad_id = int(eos_ids[0]) if len(eos_ids) else 0
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(device).long()
    window = kwargs.get("attention_window")
    decoder = _Decoder(model, model.config.attention_window if window is None else int(window))
    ones = torch.ones(batch, 1, dtype=mask.dtype, device=device)

    sequence = input_ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    stats = {"drafted": 0, "accepted": 0, "forwards": 0}

    def append(tokens: torch.Tensor):
        """Add one column of tokens [B] (pad after EOS) and update which rows are done."""
        nonlocal sequence, mask, unfinished
        tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad_id))
        sequence = torch.cat([sequence, tokens[:, None]], dim=1)
        mask = torch.cat([mask, ones], dim=1)
        if len(eos_ids):
            unfinished = unfinished & ~torch.isin(tokens, eos_ids)

    hidden, logits = decoder.backbone(input_ids, sequence, mask)
    append(logits[:, -1].argmax(-1))
    generated = 1
    draft = None
    if budget > 1 and unfinished.any():
        draft = decoder.draft(hidden, sequence[:, 1:], mask[:, :prompt_length])
    while generated < budget and unfinished.any():
        last = sequence[:, -1:]
        position = sequence.shape[1] - 1  # of `last`; the cache holds the positions before it
        if draft is None or budget - generated < 2:
            _, logits = decoder.backbone(last, sequence, mask)
            stats["forwards"] += 1
            append(logits[:, -1].argmax(-1))
            generated += 1
            draft = None
            continue
        hidden, logits = decoder.backbone(torch.cat([last, draft[:, None]], dim=1), sequence,
                                          torch.cat([mask, ones], dim=1))
        stats["forwards"] += 1
        stats["drafted"] += 1
        verified = logits[:, 0].argmax(-1)  # [B]
        if bool(((verified == draft) | ~unfinished).all()):
            stats["accepted"] += 1
            append(verified)
            generated += 1
            if not unfinished.any():  # the verified token ended every row: generate stops here too
                break
            append(logits[:, 1].argmax(-1))
            generated += 1
            draft = decoder.draft(hidden, sequence[:, -2:], mask[:, :position + 2])
        else:
            decoder.crop(position + 1)  # drop the rejected draft's keys and values
            append(verified)
            generated += 1
            draft = decoder.draft(hidden[:, :1], sequence[:, -1:], mask[:, :position + 1])
    if generation_config.return_dict_in_generate:
        return MTPGenerateOutput(sequences=sequence, **stats)
    return sequence


def trim_to_max_length(output, max_length: int):
    """Cut a `generate` result back to ``max_length`` positions: transformers 4.57's prompt lookup can
    accept candidate tokens past the length limit (5.x stops at it), which no other decoding writes."""
    if isinstance(output, torch.Tensor):
        return output[:, :max_length]
    if getattr(output, "sequences", None) is not None and output.sequences.shape[1] > max_length:
        surplus = output.sequences.shape[1] - max_length
        output.sequences = output.sequences[:, :max_length]
        for name in ("scores", "logits"):
            steps = getattr(output, name, None)
            if steps is not None:
                setattr(output, name, steps[: len(steps) - surplus])
    return output


__all__ = ["MTPGenerateOutput", "mtp_generate", "trim_to_max_length"]
