"""Test support: HF folders made from reference-shaped native parameters, and Flax helpers."""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.weight_names import native_to_hf, optional_heads_in_native


def write_hf_folder(path, native_config: dict, params: dict, dtype=None) -> NeedleConfig:
    """Write config.json + PyTorch-layout model.safetensors for native params (optionally cast)."""
    config = NeedleConfig.from_needle_config(native_config, **optional_heads_in_native(params))
    config.save_pretrained(path)
    tensors = native_to_hf(params, config)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return config


def random_tokens(seed: int, batch: int, length: int, vocab: int) -> np.ndarray:
    """Token ids in [4, vocab): no pad (0) inside real text, like tokenizer output after BOS."""
    return np.random.default_rng(seed).integers(4, vocab, (batch, length)).astype(np.int32)
