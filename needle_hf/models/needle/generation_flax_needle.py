"""How Flax Needle 2 generates: transformers' `FlaxGenerationMixin` with Needle's checks (prompt ids,
the position limit), the decoding kernels and MTP self-speculation (``use_mtp_head=True``).

`FlaxNeedleForCausalLM` inherits `FlaxNeedleGenerationMixin`; the model itself is
`modeling_flax_needle`. PyTorch twin: `generation_needle`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .mtp_option import pop_mtp_option
from .projections_flax_needle import with_decoding_kernels
from .specification_needle import check_positions, position_ids_error, prompt_ids_error


def _as_array(value):
    """``value`` as something with a shape and a dtype (a ragged list becomes a float scalar, refused
    by the checks as not integer)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return value
    try:
        return np.asarray(value)
    except ValueError:
        return np.asarray(0.0)


def check_prompt_ids(input_ids, vocab_size: int) -> None:
    """`generate`'s prompt: integer ids [B, T] in [0, vocab_size) (`prompt_ids_error`; the range is
    checked on concrete values only, not on a jit tracer)."""
    input_ids = _as_array(input_ids)
    integer_matrix = len(input_ids.shape) == 2 and jnp.issubdtype(input_ids.dtype, jnp.integer)
    concrete = integer_matrix and not isinstance(input_ids, jax.core.Tracer) and input_ids.size
    values = np.asarray(input_ids) if concrete else None
    error = prompt_ids_error(
        integer_matrix=integer_matrix,
        found=f"{input_ids.dtype} of shape {tuple(input_ids.shape)}",
        tokens=input_ids.shape[1] if integer_matrix else None,
        bounds=(int(values.min()), int(values.max())) if concrete else None,
        vocab_size=vocab_size,
    )
    if error is not None:
        raise error


def check_position_ids(position_ids, input_shape) -> None:
    """A whole-text call's ``position_ids``: None, or integer positions >= 0 [B, T] or [1, T]
    (``input_shape`` = (B, T); `position_ids_error`; the sign is checked on concrete values only)."""
    if position_ids is None:
        return
    position_ids = _as_array(position_ids)
    integer = jnp.issubdtype(position_ids.dtype, jnp.integer)
    concrete = integer and not isinstance(position_ids, jax.core.Tracer) and position_ids.size
    error = position_ids_error(
        integer=integer,
        found=f"{position_ids.dtype} of shape {tuple(position_ids.shape)}",
        shape=tuple(position_ids.shape),
        input_shape=tuple(input_shape),
        smallest=int(np.min(np.asarray(position_ids))) if concrete else None,
    )
    if error is not None:
        raise error


class FlaxNeedleGenerationMixin:
    """`FlaxNeedleForCausalLM`'s generation (before `FlaxPreTrainedModel` in its bases, whose
    `FlaxGenerationMixin.generate` it calls): uses ``config``, ``params``, `init_cache`."""

    @classmethod
    def can_generate(cls) -> bool:
        """True. (transformers' Flax test reads "GenerationMixin" in the qualified name of
        `prepare_inputs_for_generation` as "not overridden", and this class's name holds those words.)"""
        return True

    def prepare_inputs_for_generation(self, input_ids, max_length, attention_mask: Optional[jax.Array] = None):
        batch_size, prompt_length = input_ids.shape
        check_positions(max_length, self.config.max_position_embeddings)
        past_key_values = self.init_cache(batch_size, max_length)
        extended_mask = jnp.ones((batch_size, max_length), dtype="i4")
        if attention_mask is not None:
            position_ids = jnp.clip(attention_mask.cumsum(axis=-1) - 1, 0)
            extended_mask = jax.lax.dynamic_update_slice(extended_mask, attention_mask.astype("i4"), (0, 0))
        else:
            position_ids = jnp.broadcast_to(jnp.arange(prompt_length, dtype="i4")[None, :], (batch_size, prompt_length))
        return {"past_key_values": past_key_values, "attention_mask": extended_mask, "position_ids": position_ids}

    def update_inputs_for_generation(self, model_outputs, model_kwargs):
        model_kwargs["past_key_values"] = model_outputs.past_key_values
        model_kwargs["position_ids"] = model_kwargs["position_ids"][:, -1:] + 1
        return model_kwargs

    def generate(self, input_ids, generation_config=None, prng_key=None, trace: bool = True, params=None,
                 logits_processor=None, **kwargs):
        """`FlaxGenerationMixin.generate`; with ``use_mtp_head=True`` (argument or generation config), decoding
        with MTP self-speculation (`speculative_flax`): greedy gives the same tokens, sampling
        (``do_sample=True``, seeded by ``prng_key``) the same distribution, with fewer backbone
        forwards, returned as a `FlaxMTPGenerateOutput` (sequences and draft counts).

        Either way the layers run on `with_decoding_kernels` of the params (q, k, v and gate kernels
        concatenated once per call, one matmul per decoding step)."""
        use_mtp = pop_mtp_option(kwargs, generation_config if generation_config is not None else self.generation_config)
        check_prompt_ids(input_ids, self.config.vocab_size)
        params = with_decoding_kernels(params if params is not None else self.params, self.config)
        if not use_mtp:
            return super().generate(input_ids, generation_config, prng_key, trace, params, logits_processor, **kwargs)
        from .speculative_flax import mtp_generate, resolve_generation

        max_length, eos, pad, processors, warpers, mask = resolve_generation(self, input_ids, generation_config,
                                                                             logits_processor, kwargs)
        return mtp_generate(self, input_ids, mask, max_length=max_length, eos_token_id=eos, pad_token_id=pad,
                            logits_processor=processors, logits_warper=warpers, prng_key=prng_key, params=params,
                            trace=trace)


__all__ = ["FlaxNeedleGenerationMixin", "check_position_ids", "check_prompt_ids"]
