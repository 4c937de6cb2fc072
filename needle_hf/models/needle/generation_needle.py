"""How PyTorch Needle 2 generates: transformers' `GenerationMixin` with Needle's checks (prompt ids,
the position limit, the attention window), MTP self-speculation (``use_mtp_head=True``), prompt
lookup, the compiled static-cache decoding step and the CPU thread policy.

`NeedleForCausalLM` inherits it; the model itself (layers, backbone, heads) is `modeling_needle`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin
from transformers.cache_utils import Cache

from .cache_needle import is_static_cache, static_cache_length
from .compiled_decoding_needle import LayerCompiledCall
from .configuration_needle import NeedleConfig
from .mtp_option import pop_mtp_option
from .specification_needle import attention_window_option, check_positions, position_ids_error, prompt_ids_error
from .speculative import mtp_generate, trim_to_max_length


# torch's intra-op thread count when this module was imported: a different count later was chosen.
_THREADS_AT_IMPORT = torch.get_num_threads()


def _threads_chosen_by_user() -> bool:
    return bool(os.environ.get("OMP_NUM_THREADS")) or torch.get_num_threads() != _THREADS_AT_IMPORT


@contextlib.contextmanager
def torch_threads(threads: Optional[int]):
    """torch's intra-op thread count set to ``threads`` (None: left alone) inside, put back on leaving."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def is_integer_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
        and value.dtype != torch.bool


def tensor_description(value) -> str:
    """What an ids argument was, for an error: its dtype and shape, or its type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return type(value).__name__


def check_prompt_ids(input_ids, vocab_size: int) -> None:
    """`generate`'s prompt: an integer tensor [B, T] of ids in [0, vocab_size) (`prompt_ids_error`)."""
    integer_matrix = is_integer_tensor(input_ids) and input_ids.dim() == 2
    bounds = (int(input_ids.min()), int(input_ids.max())) if integer_matrix and input_ids.numel() else None
    error = prompt_ids_error(
        integer_matrix=integer_matrix,
        found=tensor_description(input_ids),
        tokens=input_ids.shape[1] if integer_matrix else None,
        bounds=bounds,
        vocab_size=vocab_size,
    )
    if error is not None:
        raise error


def check_position_ids(position_ids, input_shape) -> None:
    """A whole-text forward's ``position_ids``: None, or integer positions >= 0 [B, T] or [1, T]
    (``input_shape`` = (B, T); `position_ids_error`)."""
    if position_ids is None:
        return
    integer = is_integer_tensor(position_ids)
    error = position_ids_error(
        integer=integer,
        found=tensor_description(position_ids),
        shape=tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else None,
        input_shape=tuple(input_shape),
        smallest=int(position_ids.min()) if integer and position_ids.numel() else None,
    )
    if error is not None:
        raise error


class NeedleGenerationMixin(GenerationMixin):
    """`GenerationMixin` as Needle generates (see the module docstring)."""

    def generate(self, inputs: Optional[torch.Tensor] = None, generation_config=None, **kwargs):
        """`GenerationMixin.generate` (with ``use_mtp_head=True``, argument or generation config: decoding
        with MTP self-speculation, `speculative.mtp_generate`: the same tokens, fewer backbone forwards),
        on one intra-op thread on the CPU unless the user chose a count.

        A decoding step is thousands of small ops; with several OpenMP threads each op that opens a
        parallel region waits for every thread to be scheduled, which on a loaded machine makes
        decoding several times slower than one thread (whose speed does not depend on the load). A
        thread count set with ``torch.set_num_threads`` (after importing this module) or
        ``OMP_NUM_THREADS`` is left alone; the previous count is restored afterwards either way.
        """
        with torch_threads(None if self.device.type != "cpu" or _threads_chosen_by_user() else 1):
            return self._generate_with_drafts(inputs, generation_config, **kwargs)

    def get_compiled_call(self, compile_config) -> "LayerCompiledCall":
        """The decoding step `generate` runs with a static cache when it compiles (``compile_config``):
        the model with each decoder layer and the engram memory compiled (`LayerCompiledCall`), not one
        whole-model graph.
        The prefill stays eager, as in transformers."""
        from transformers import CompileConfig

        options = (compile_config or getattr(self.generation_config, "compile_config", None) or CompileConfig()).to_dict()
        if getattr(self, "_compiled_call", None) is None or self._compiled_call.options != options:
            self._compiled_call = LayerCompiledCall(self, options)
        return self._compiled_call

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config) -> bool:
        """transformers compiles the decoding step on accelerators only; on the CPU a ``compile_config``
        passed to `generate` (with a static cache) asks for it."""
        requested = generation_config.compile_config
        if requested is not None and self.device.type == "cpu" and not requested._compile_all_devices:
            generation_config.compile_config = copy.copy(requested)
            generation_config.compile_config._compile_all_devices = True
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def _generate_with_drafts(self, inputs, generation_config, **kwargs):
        use_mtp = pop_mtp_option(kwargs, generation_config or self.generation_config)
        lookup = kwargs.get("prompt_lookup_num_tokens") or getattr(
            generation_config or self.generation_config, "prompt_lookup_num_tokens", None
        )
        if use_mtp and lookup:
            raise ValueError(f"use_mtp_head=True drafts with the MTP head; it does not take prompt_lookup_num_tokens={lookup}")
        if kwargs.get("attention_window") is not None:
            kwargs["attention_window"] = attention_window_option(kwargs["attention_window"])
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if prompt is not None:
            check_prompt_ids(prompt, self.config.vocab_size)
            # `check_positions` at the start of generate: the prompt and every new token it may add.
            resolved, _ = self._prepare_generation_config(generation_config, **kwargs)
            most = resolved.max_length if resolved.max_new_tokens is None else prompt.shape[1] + resolved.max_new_tokens
            check_positions(most, self.config.max_position_embeddings)
        if not use_mtp and not lookup:
            return super().generate(inputs, generation_config, **kwargs)
        resolved, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        if not use_mtp:  # prompt lookup: 4.57 can overshoot the length limit, see `trim_to_max_length`
            output = super().generate(inputs, generation_config, **kwargs)
            prompt = inputs if inputs is not None else kwargs["input_ids"]
            limit = resolved.max_length if resolved.max_new_tokens is None else prompt.shape[1] + resolved.max_new_tokens
            return trim_to_max_length(output, limit)
        input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
        if input_ids is None:
            raise ValueError("use_mtp_head=True needs input_ids")
        return mtp_generate(self, input_ids, resolved, **model_kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """`GenerationMixin`'s preparation (the positions were checked when `generate` started)."""
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        # Filled in (as None) by transformers 4.57 for every model; Needle reads token ids only.
        model_inputs.pop("inputs_embeds", None)
        return model_inputs

    def create_masks_for_generate(
        self,
        config: NeedleConfig,
        attention_mask: Optional[torch.Tensor],
        cache: Optional[Cache] = None,
        past_key_values: Optional[Cache] = None,
        **generation_metadata,
    ) -> Optional[torch.Tensor]:
        """`GenerationMixin`'s hook for compilable (static) caches: keep the 2-D padding mask, padded
        with zeros to the cache's length, so every decoding step sees the same shapes. (The other
        arguments transformers passes here, shapes and token types, differ between versions and say
        nothing the mask does not.)"""
        cache = cache if cache is not None else past_key_values
        if attention_mask is None or cache is None or not is_static_cache(cache):
            return attention_mask
        return F.pad(attention_mask, (0, static_cache_length(cache) - attention_mask.shape[1]))
