"""MTP self-speculative decoding for the Flax Needle model (`generate(..., use_mtp_head=True)`).

The scheme of `speculative.py` (the PyTorch twin), as one `lax.while_loop` that traces under
`jax.jit`: each step feeds the backbone the last token ``x`` and the MTP head's draft ``d``; the
scores at ``x`` give the next token ``v``; if every unfinished row has ``v == d`` the step also
keeps the token after ``d`` (two tokens for one forward), otherwise it keeps ``v`` only. Greedy
output is token for token that of plain Flax greedy `generate`.

Sampling (``do_sample=True``) is speculative sampling, as in the PyTorch twin: ``d`` is drawn from
the head's distribution q (after the same processors and warpers as plain sampling, which give p);
row by row it stands with probability min(1, p(d) / q(d)), else ``v`` is drawn from the normalised
residual max(0, p - q), so ``v`` is distributed as p. The token after ``d`` is kept only when every
unfinished row kept ``d``. Each step splits the loop's `prng_key`, so a fixed key gives fixed tokens.

Static shapes throughout: every step is a two-token backbone call and a two-token MTP call, so
the caches have one slot more than ``max_length`` (the last step's draft may sit past it). After a
rejection nothing needs erasing in the key/value caches: the next step writes its two tokens over
the rejected draft's slot before attending, and causal masking hides every slot past the query.
What does need undoing is the engram state, whose token and value-projection histories shift by one
entry per token (`_forget_second_token`); the MTP block's cache position is set per step.

Axis letters: B batch, T tokens of a call, S cache slots, V vocabulary, D width.
"""

from __future__ import annotations

import copy
from typing import Optional

import flax
import jax
import jax.numpy as jnp
from flax.core.frozen_dict import unfreeze
from jax import lax
from transformers.generation.flax_logits_process import FlaxLogitsProcessorList

from .cache_flax_needle import LayerKVCache
from .specification_needle import check_positions


@flax.struct.dataclass
class FlaxMTPGenerateOutput:
    """`generate(use_mtp_head=True)` of the Flax model.

    sequences: [B, max_length] prompt and generated ids (pad_token_id after EOS, as `generate`).
    drafted: steps whose draft could be kept (the last step, with room for one token, cannot);
    accepted: steps whose draft every row kept; forwards: backbone calls after the prompt's (int32 scalars).
    """

    sequences: jnp.ndarray
    drafted: jnp.ndarray
    accepted: jnp.ndarray
    forwards: jnp.ndarray


class _StepState(flax.struct.PyTreeNode):
    cur_len: jnp.ndarray  # tokens written so far (prompt included)
    sequences: jnp.ndarray  # [B, max_length + 1]
    finished: jnp.ndarray  # [B] bool
    cache: dict  # the backbone's `cache` collection, max_length + 1 slots
    mtp_cache: LayerKVCache  # the MTP block's keys and values, max_length + 1 slots
    draft: jnp.ndarray  # [B] the head's guess of the token at cur_len
    draft_probs: jnp.ndarray  # [B, V] the distribution q it was drawn from when sampling, else [B, 0]
    prng_key: jnp.ndarray
    drafted: jnp.ndarray
    accepted: jnp.ndarray
    forwards: jnp.ndarray


def _forget_second_token(after: dict, before: dict, kept) -> dict:
    """The backbone's cache after a two-token call, or where ``kept`` is False, with the engram
    state as if only the first token had been fed (the key/value caches need nothing).

    Each engram history is [B, n, ...] (n >= 2) and moves on by one entry per token: ``after`` =
    before[2:] + [new0, new1], so the state after new0 alone = before[1:2] + after[:-1].
    """
    def one_token(now, then):
        return jnp.where(kept, now, jnp.concatenate([then[:, 1:2], now[:, :-1]], axis=1))

    after, before = unfreeze(after), unfreeze(before)
    state = after["model"]["decode_state"]
    state["cache_index"] = jnp.where(kept, state["cache_index"], state["cache_index"] - 1)
    for name in ("engram_tokens", "engram_valid"):
        state[name] = one_token(state[name], before["model"]["decode_state"][name])
    for name, value in after["model"].get("engrams", {}).items():
        after["model"]["engrams"][name] = one_token(value, before["model"]["engrams"][name])
    return after


def resolve_generation(model, input_ids, generation_config, logits_processor, kwargs: dict):
    """(max_length, eos id or None, pad id, logits processor list, logits warper list or None when
    greedy, attention_mask or None) of a `generate(use_mtp_head=True)` call, as
    `FlaxGenerationMixin.generate` resolves them; refuses what this path would ignore."""
    if not model.config.use_mtp_head:
        raise ValueError("use_mtp_head=True needs the MTP head (config.use_mtp_head is False)")
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    model_kwargs = config.update(**kwargs)
    unknown = set(model_kwargs) - {"attention_mask"}
    if unknown:
        raise ValueError(f"use_mtp_head=True: unsupported generate arguments {sorted(unknown)}")
    if config.num_beams not in (1, None):
        raise ValueError(f"use_mtp_head=True decodes one sequence per prompt: num_beams must be 1, got {config.num_beams}")
    prompt_length = input_ids.shape[1]
    max_length = prompt_length + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    pad = config.pad_token_id if config.pad_token_id is not None else (eos if eos is not None else 0)
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=prompt_length,
        logits_processor=logits_processor if logits_processor is not None else FlaxLogitsProcessorList(),
    )
    warpers = model._get_logits_warper(generation_config=config) if config.do_sample else None
    return max_length, eos, pad, processors, warpers, model_kwargs.get("attention_mask")


def mtp_generate(model, input_ids, attention_mask=None, *, max_length: int, eos_token_id: Optional[int],
                 pad_token_id: int, logits_processor, logits_warper=None, prng_key=None, params=None,
                 trace: bool = True) -> FlaxMTPGenerateOutput:
    """Decoding with MTP self-speculation: greedy (``logits_warper`` None) gives the tokens of plain
    greedy `generate`; sampling (``logits_warper`` a list, maybe empty) draws tokens distributed as
    plain `generate(do_sample=True)`'s, seeded by ``prng_key`` (default `jax.random.PRNGKey(0)`).

    input_ids, attention_mask: [B, T] (left padded for batches); max_length: prompt plus new tokens.
    """
    params = params if params is not None else model.params
    module = model.module
    input_ids = jnp.asarray(input_ids, jnp.int32)
    batch, prompt_length = input_ids.shape
    check_positions(max_length, model.config.max_position_embeddings)  # the start of generate
    slots = max_length + 1
    prompt_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    mask = jnp.ones((batch, slots), jnp.int32).at[:, :prompt_length].set(prompt_mask)  # [B, S]
    padding = prompt_length - prompt_mask.sum(axis=1)  # [B] left-padding slots before each row's text
    pad = jnp.int32(pad_token_id)
    eos = None if eos_token_id is None else jnp.int32(eos_token_id)

    def backbone(cache, ids, positions):
        """ids/positions [B, T] -> ((hidden [B, T, D], logits [B, T, V]), updated cache)."""
        outputs, updated = module.apply({"params": params, "cache": cache}, ids, mask, positions,
                                        method=type(module).hidden_and_logits, mutable=["cache"])
        return outputs, updated["cache"]

    def mtp(kv, hidden, next_ids, positions, pick):
        """-> (MTP logits [B, V] of new position ``pick``, the MTP cache)."""
        return module.apply({"params": params}, hidden, next_ids, positions, mask, kv, pick,
                            method=type(module).mtp_draft_logits)

    sampling = logits_warper is not None

    def distribution(sequences, logits, cur_len):
        """Logits [B, V] of the token at ``cur_len`` -> the scores plain `generate` picks it from [B, V]."""
        scores = logits_processor(sequences[:, :max_length], logits.astype(jnp.float32), cur_len)
        return logits_warper(scores, scores, cur_len) if sampling else scores

    def choose(sequences, logits, cur_len, key):
        """-> (the token at ``cur_len`` [B], its distribution [B, V] when sampling, else [B, 0]):
        argmax of the processed scores, or a draw from the warped ones (as plain `generate`)."""
        scores = distribution(sequences, logits, cur_len)
        if not sampling:
            return jnp.argmax(scores, axis=-1).astype(jnp.int32), jnp.zeros((batch, 0), jnp.float32)
        return jax.random.categorical(key, scores, axis=-1).astype(jnp.int32), jax.nn.softmax(scores, axis=-1)

    def verify(sequences, logits, cur_len, draft, draft_probs, key):
        """-> (the token at ``cur_len`` [B], whether each row's draft stands [B])."""
        if not sampling:
            token = choose(sequences, logits, cur_len, key)[0]
            return token, token == draft
        probs = jax.nn.softmax(distribution(sequences, logits, cur_len), axis=-1)  # p [B, V]
        key_keep, key_residual = jax.random.split(key)
        p = jnp.take_along_axis(probs, draft[:, None], axis=1)[:, 0]
        q = jnp.take_along_axis(draft_probs, draft[:, None], axis=1)[:, 0]  # > 0: the draft was drawn from q
        kept = jax.random.uniform(key_keep, p.shape) * q < p  # u < p / q, with probability min(1, p / q)
        residual = jnp.maximum(probs - draft_probs, 0.0)
        # p == q leaves no residual, and then every draft stands: any distribution will do there.
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, probs)
        resampled = jax.random.categorical(key_residual, jnp.log(residual), axis=-1).astype(jnp.int32)
        return jnp.where(kept, draft, resampled), kept

    def ends(tokens):
        return jnp.zeros_like(tokens, jnp.bool_) if eos is None else tokens == eos

    # The prompt, its first token, and the MTP over the prompt's positions: the draft of the second.
    positions = jnp.clip(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    (hidden, logits), cache = backbone(model.init_cache(batch, slots), input_ids, positions)
    sequences = jnp.full((batch, slots), pad, jnp.int32).at[:, :prompt_length].set(input_ids)
    key_first, key_draft, prng_key = jax.random.split(jax.random.PRNGKey(0) if prng_key is None else prng_key, 3)
    first = choose(sequences, logits[:, -1], prompt_length, key_first)[0]
    sequences = sequences.at[:, prompt_length].set(first)
    cfg = model.config
    empty = jnp.zeros((batch, cfg.num_key_value_heads, cfg.head_dim, slots), model.dtype)
    mtp_cache = LayerKVCache(empty, empty.transpose(0, 1, 3, 2), jnp.int32(0))
    next_ids = sequences[:, 1 : prompt_length + 1]
    draft_logits, mtp_cache = mtp(mtp_cache, hidden, next_ids, positions, prompt_length - 1)
    draft, draft_probs = choose(sequences, draft_logits, prompt_length + 1, key_draft)
    state = _StepState(
        cur_len=jnp.int32(prompt_length + 1), sequences=sequences, finished=ends(first), cache=cache,
        mtp_cache=mtp_cache, draft=draft, draft_probs=draft_probs, prng_key=prng_key,
        drafted=jnp.int32(0), accepted=jnp.int32(0), forwards=jnp.int32(0),
    )

    def unfinished(state):
        return (state.cur_len < max_length) & ~jnp.all(state.finished)

    def step(state):
        at = state.cur_len - 1  # slot of the last token x; the draft d goes after it
        last = lax.dynamic_slice(state.sequences, (0, at), (batch, 1))[:, 0]
        positions = at + jnp.arange(2)[None, :] - padding[:, None]  # [B, 2]
        (hidden, logits), cache = backbone(state.cache, jnp.stack([last, state.draft], axis=1), positions)
        key_verify, key_after, key_draft, prng_key = jax.random.split(state.prng_key, 4)
        verified, stands = verify(state.sequences, logits[:, 0], state.cur_len, state.draft, state.draft_probs,
                                  key_verify)
        verified = jnp.where(state.finished, pad, verified)
        room = state.cur_len + 1 < max_length  # for the token after the draft
        kept = room & jnp.all(stands | state.finished)
        finished = state.finished | ends(verified)
        sequences = lax.dynamic_update_slice(state.sequences, verified[:, None], (0, state.cur_len))
        after = jnp.where(finished, pad, choose(sequences, logits[:, 1], state.cur_len + 1, key_after)[0])
        after = jnp.where(kept, after, pad)  # a pad slot the next step overwrites
        sequences = lax.dynamic_update_slice(sequences, after[:, None], (0, state.cur_len + 1))
        finished = finished | (kept & ends(after))
        cache = _forget_second_token(cache, state.cache, kept)
        # MTP over both positions; after a rejection the second is the rejected draft's, forgotten
        # by moving the MTP cache position back (its slot is written again next step).
        next_ids = jnp.stack([verified, jnp.where(kept, after, verified)], axis=1)
        draft_logits, mtp_cache = mtp(state.mtp_cache._replace(write_index=at), hidden, next_ids, positions,
                                      kept.astype(jnp.int32))
        cur_len = state.cur_len + jnp.where(kept, 2, 1)
        draft, draft_probs = choose(sequences, draft_logits, cur_len, key_draft)
        return _StepState(cur_len=cur_len, sequences=sequences, finished=finished, cache=cache, mtp_cache=mtp_cache,
                          draft=draft, draft_probs=draft_probs, prng_key=prng_key,
                          drafted=state.drafted + room.astype(jnp.int32),
                          accepted=state.accepted + kept.astype(jnp.int32), forwards=state.forwards + 1)

    state = lax.while_loop(unfinished, step, state) if trace else model._run_loop_in_debug(unfinished, step, state)
    return FlaxMTPGenerateOutput(sequences=state.sequences[:, :max_length], drafted=state.drafted,
                                 accepted=state.accepted, forwards=state.forwards)


__all__ = ["FlaxMTPGenerateOutput", "mtp_generate", "resolve_generation"]
