"""MTP self-speculative decoding for the PyTorch Needle model (`generate(..., use_mtp_head=True)`).

Needle's multi-token-prediction head reads the backbone's hidden state at ``t`` and the embedding of
token ``t + 1`` and predicts token ``t + 2``. Each step of the loop below feeds the backbone two
tokens, the last verified token ``x`` and the head's draft ``d`` of the token after it:

    backbone([x, d])  ->  scores at x   = the distribution p of the next token   (verified)
                          scores at d   = that of the token after d              (valid only if d is kept)

Greedy: the next token is argmax p, and ``d`` holds when it equals it. Sampling (speculative
sampling): ``d`` was drawn from the head's distribution q (after the same logits processors and
warpers as p); it is kept with probability min(1, p(d) / q(d)), else the next token is drawn from
the normalised residual max(0, p - q), so the next token is distributed exactly as p.

If every unfinished row keeps ``d``, the step writes two tokens (``d`` and the token after it, from
the scores at ``d``) for one backbone forward; otherwise one, and the cache entry of ``d`` is
cropped away. Either way greedy output is token for token the plain greedy output, and sampled
output has the plain sampling distribution. The MTP block then runs with its own one-layer KV cache
and drafts the next ``d``; it reuses the backbone call's masks and rotary tables, and after a
rejection its entry of ``d``'s position is cropped too, so nothing of a rejection survives in its
state. The engram state lives in the backbone's cache and is cropped with it, so it is exact right
after a rejection too.

A batch (left padding welcome) keeps two tokens only when all its unfinished rows accept, so every
row stays aligned and exact; acceptance is therefore highest at batch 1.

Scope: greedy or sampling with the logits processors and warpers `generate` builds from the
generation config (temperature, top_k, top_p, repetition penalty, ...), no user logits processors
or stopping criteria (their state would see rejected drafts), no beams; options that would change
the tokens are refused with an error instead of being ignored.

Axis letters: B batch, S new tokens of a step, T sequence so far, V vocabulary, d width.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from transformers import DynamicCache, LogitsProcessorList


@dataclasses.dataclass
class MTPGenerateOutput:
    """`generate(use_mtp_head=True, return_dict_in_generate=True)`.

    sequences: [B, T] prompt and generated ids (padded with pad_token_id after EOS, as `generate`).
    drafted: steps that carried a draft token; accepted: steps whose draft every row kept.
    forwards: backbone forward calls after the prompt's.
    """

    sequences: Optional[torch.LongTensor] = None
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0


class _TokenChooser:
    """Scores -> tokens as `generate` picks them: its logits processors, then argmax or a draw."""

    def __init__(self, processors: LogitsProcessorList, *, do_sample: bool):
        self.processors = processors
        self.do_sample = do_sample

    def scores(self, logits: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 of the token after ``context`` [B, T] -> processed scores [B, V]."""
        return self.processors(context, logits) if len(self.processors) else logits

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """-> (tokens [B], their distribution [B, V] when sampling, else None)."""
        if not self.do_sample:
            return scores.argmax(-1), None
        probs = scores.softmax(-1)
        return torch.multinomial(probs, num_samples=1)[:, 0], probs

    def verify(self, scores: torch.Tensor, draft: torch.Tensor, draft_probs: Optional[torch.Tensor]):
        """Scores [B, V] of the drafted position -> (next tokens [B], whether each row kept its draft [B])."""
        if not self.do_sample:
            token = scores.argmax(-1)
            return token, token == draft
        probs = scores.softmax(-1)
        p = probs.gather(1, draft[:, None])[:, 0]
        q = draft_probs.gather(1, draft[:, None])[:, 0]  # > 0: the draft was drawn from q
        kept = torch.rand_like(p) * q < p  # u < p / q, with probability min(1, p / q)
        residual = (probs - draft_probs).clamp(min=0)
        # p == q leaves no residual, and then every draft is kept: any distribution will do there.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
        resampled = torch.multinomial(residual, num_samples=1)[:, 0]
        return torch.where(kept, draft, resampled), kept


class _Decoder:
    """The backbone and the MTP head over their caches, for one batch."""

    def __init__(self, model, attention_window: int, chooser: _TokenChooser):
        self.model = model
        self.window = attention_window
        self.chooser = chooser
        self.cache = DynamicCache(config=model.config)
        self.mtp_cache = DynamicCache()

    def backbone(self, new_ids: torch.Tensor, mask: torch.Tensor):
        """new_ids [B, S] after the cached positions; mask [B, past + S].
        Returns (final-normed hidden [B, S, d], logits [B, S, V] float32, the call's step inputs)."""
        backbone = self.model.model
        batch, length = new_ids.shape
        past = self.cache.get_seq_length()
        step = backbone.step_inputs(batch, length, torch.arange(length, device=new_ids.device) + past, past + length,
                                    mask, None, attention_window=self.window)
        hidden = backbone.forward_with_step_inputs(new_ids, step, self.cache)[0]
        return hidden, self.model.tied_logits(hidden), step

    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, step, sequence: torch.Tensor, *, keep: int):
        """MTP over the positions of the last backbone call (its ``step``): hidden [B, S, d] and the tokens
        after them [B, S]; only the first ``keep`` positions are verified text (a rejected draft's
        position is run, then cropped from the MTP cache). ``sequence`` [B, T] ends with the token
        after the last kept position. Returns (the draft [B] of the token after ``sequence``, its
        distribution [B, V] when sampling)."""
        predicted = self.model.mtp(hidden, self.model.model.embed(next_ids), step, cache=self.mtp_cache)
        surplus = next_ids.shape[1] - keep
        if surplus:
            self.mtp_cache.crop(-surplus)
        logits = self.model.tied_logits(predicted[:, keep - 1])  # [B, V]
        return self.chooser.choose(self.chooser.scores(logits, sequence))

    def crop(self, length: int):
        """Keep the first ``length`` cached positions (a negative count: 5.x takes no other form, 4.57 both)."""
        surplus = self.cache.get_seq_length() - length
        if surplus > 0:
            self.cache.crop(-surplus)


def _refuse_unsupported(model, generation_config, kwargs: dict):
    if model.mtp is None:
        raise ValueError("use_mtp_head=True needs the MTP head (config.use_mtp_head is False)")
    checks = {
        "num_beams": (generation_config.num_beams, 1),
        "num_return_sequences": (generation_config.num_return_sequences, 1),
    }
    for name, (found, expected) in checks.items():
        if found not in (expected, None):
            raise ValueError(f"use_mtp_head=True decodes one sequence per prompt: {name} must be {expected}, got {found}")
    for name in ("logits_processor", "stopping_criteria", "assistant_model", "prompt_lookup_num_tokens",
                 "streamer", "past_key_values", "cache"):
        if kwargs.get(name) is not None and kwargs.get(name) != []:
            raise ValueError(f"use_mtp_head=True does not take {name}")
    unknown = set(kwargs) - {"attention_mask", "attention_window", "logits_processor", "stopping_criteria"}
    if unknown:
        raise ValueError(f"use_mtp_head=True: unsupported generate arguments {sorted(unknown)}")


@torch.no_grad()
def mtp_generate(model, input_ids: torch.LongTensor, generation_config, **kwargs) -> Union[torch.LongTensor, MTPGenerateOutput]:
    """Decoding with MTP self-speculation: greedy tokens identical to ``generate(do_sample=False)``,
    sampled tokens distributed as ``generate(do_sample=True)``'s (the same processors and warpers).

    Args:
        model: a `NeedleForCausalLM` with an MTP head.
        input_ids: [B, T] prompt ids (left padded for batches).
        generation_config: the resolved `GenerationConfig` (do_sample, temperature / top_k / top_p and
            the other processors' options, max_new_tokens / max_length, eos and pad ids,
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
    processors = model._get_logits_processor(
        generation_config=generation_config, input_ids_seq_length=prompt_length, encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device,
        model_kwargs={"attention_mask": mask},
    )
    chooser = _TokenChooser(processors, do_sample=bool(generation_config.do_sample))
    window = kwargs.get("attention_window")
    decoder = _Decoder(model, model.config.attention_window if window is None else int(window), chooser)
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

    hidden, logits, step = decoder.backbone(input_ids, mask)
    append(chooser.choose(chooser.scores(logits[:, -1], sequence))[0])
    generated = 1
    draft = draft_probs = None
    if budget > 1 and unfinished.any():
        draft, draft_probs = decoder.draft(hidden, sequence[:, 1:], step, sequence, keep=prompt_length)
    while generated < budget and unfinished.any():
        last = sequence[:, -1:]
        if draft is None or budget - generated < 2:
            _, logits, _ = decoder.backbone(last, mask)
            stats["forwards"] += 1
            append(chooser.choose(chooser.scores(logits[:, -1], sequence))[0])
            generated += 1
            draft = None
            continue
        position = sequence.shape[1] - 1  # of `last`; the cache holds the positions before it
        hidden, logits, step = decoder.backbone(torch.cat([last, draft[:, None]], dim=1), torch.cat([mask, ones], dim=1))
        stats["forwards"] += 1
        stats["drafted"] += 1
        token, kept = chooser.verify(chooser.scores(logits[:, 0], sequence), draft, draft_probs)
        every_row_kept = bool((kept | ~unfinished).all())
        append(token)
        generated += 1
        if every_row_kept:
            stats["accepted"] += 1
            if not unfinished.any():  # the verified token ended every row: generate stops here too
                break
            append(chooser.choose(chooser.scores(logits[:, 1], sequence))[0])
            generated += 1
            draft, draft_probs = decoder.draft(hidden, sequence[:, -2:], step, sequence, keep=2)
        else:
            decoder.crop(position + 1)  # drop the rejected draft's keys and values
            # The MTP runs on both positions (the call's masks fit them) and forgets the second.
            next_ids = torch.cat([sequence[:, -1:], sequence[:, -1:]], dim=1)
            draft, draft_probs = decoder.draft(hidden, next_ids, step, sequence, keep=1)
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
