"""The checks that close a conversion: the written tensors read back bit for bit (always), and, on
request (`--verify-with`), the HF model loaded from the written folder reproduces the source's logits.

Source logits come from `native_forward`, an independent numpy forward over the *native* tree, with
every weight rounded to the output dtype. The HF model (Flax, or PyTorch) runs in float32 on the
stored values. Both sides thus compute in float32 from the same weight values, and what the
comparison measures is the conversion (names, layouts, transposes, the loader), not the output
dtype. How much the rounding to that dtype moves the logits is measured separately, from the
numpy forward alone.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from needle_hf.models.needle.chat_template import FIRST_CHAT_MARKER_ID
from needle_hf.models.needle.tokenization_needle import BOS_ID
from needle_hf.models.needle.weight_names import check_hf_weights

from .export import numpy_dtype
from .native_forward import float32_leaf, native_logits
from .safetensors_stream import SafetensorsMismatchError, check_safetensors_bytes

# Length of the fixed check sequence: longer than the 11 tokens of history an engram output reads.
VERIFY_LENGTH = 16
# Relative tolerance of the logit check, against max(1, max |source logit|). Two float32
# implementations agree to ~1e-6 of the logit scale; a conversion mistake moves logits by O(1).
VERIFY_RELATIVE_TOLERANCE = 1e-4
VERIFY_BACKENDS = ("auto", "flax", "torch")
# The metadata of every written model.safetensors: PyTorch layout, which Flax and PyTorch both load.
SAFETENSORS_METADATA = {"format": "pt"}


class VerificationError(ValueError):
    """The written folder does not reproduce the source, or cannot be checked; the message says how."""


def verification_tokens(config) -> np.ndarray:
    """The fixed sequence [1, T]: BOS, then ids scattered over the text vocabulary by a quadratic hash."""
    length = min(VERIFY_LENGTH, config.max_position_embeddings)
    k = np.arange(1, length, dtype=np.int64)
    spread = FIRST_CHAT_MARKER_ID + (k * 7919 + k * k * 104729) % (config.vocab_size - FIRST_CHAT_MARKER_ID)
    return np.concatenate([[BOS_ID], spread]).astype(np.int32)[None, :]


def verify_tensors(weights_path: Path, expected: dict[str, np.ndarray], config):
    """Every tensor of the written file equals the in-memory one bit for bit, with its name, shape and
    dtype; and `safetensors` itself reads the file as a PyTorch-layout file of this config's tensors."""
    from safetensors import safe_open

    with safe_open(str(weights_path), framework="numpy") as handle:  # parses the header only
        layout = (handle.metadata() or {}).get("format")
        if layout != "pt":
            raise VerificationError(f"{weights_path}: metadata format {layout!r}, expected 'pt'")
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        check_hf_weights(shapes, config, where=str(weights_path))
    try:
        check_safetensors_bytes(weights_path, expected, metadata=SAFETENSORS_METADATA)
    except SafetensorsMismatchError as error:
        raise VerificationError(str(error)) from None


def resolve_backend(backend: str) -> str:
    """"flax" or "torch": the HF model that runs the check ("auto": Flax when transformers has it)."""
    if backend not in VERIFY_BACKENDS:
        raise VerificationError(f"unknown verification backend {backend!r}; expected one of {VERIFY_BACKENDS}")
    has_flax = all(importlib.util.find_spec(module) is not None for module in ("jax", "flax"))
    if has_flax:
        import transformers

        has_flax = hasattr(transformers, "FlaxAutoModelForCausalLM")  # gone in transformers 5
    has_torch = importlib.util.find_spec("torch") is not None
    if backend == "auto":
        if has_flax or has_torch:
            return "flax" if has_flax else "torch"
        raise VerificationError(
            "checking the logits needs the Flax model (transformers 4.x with jax and flax) or the PyTorch model "
            "(torch); install one, or pass --no-verify"
        )
    if backend == "flax" and not has_flax:
        raise VerificationError("--verify-with flax needs transformers 4.x with jax and flax installed")
    if backend == "torch" and not has_torch:
        raise VerificationError("--verify-with torch needs torch installed")
    return backend


def model_logits(folder: Path, tokens: np.ndarray, *, with_mtp: bool, backend: str):
    """(logits, mtp_logits or None), float32 [1, T, V], of the HF model loaded from `folder` in float32."""
    if backend == "flax":
        import jax

        from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

        model = FlaxNeedleForCausalLM.from_pretrained(str(folder))

        def forward(params, input_ids):
            outputs = model(input_ids, params=params, output_mtp_logits=with_mtp)
            return outputs.logits, outputs.mtp_logits

        # One compiled call: an eager Flax call would trace the layer scan op by op.
        logits, mtp_logits = jax.jit(forward)(model.to_fp32(model.params), tokens)
    else:
        import torch

        from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

        model = NeedleForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        with torch.no_grad():
            outputs = model(torch.as_tensor(tokens, dtype=torch.long), return_mtp_logits=with_mtp)
        logits, mtp_logits = outputs.logits, outputs.mtp_logits if with_mtp else None
    return np.asarray(logits, np.float32), None if mtp_logits is None else np.asarray(mtp_logits, np.float32)


class SourceLogits:
    """The source side of the logit check, computed from the native tree before it is released.

    Attributes:
        tokens: the check sequence [1, T].
        logits, mtp_logits: float32 [1, T, V] (mtp_logits None without an MTP head).
        rounding_change: max |logit change| from rounding the weights to the output dtype (None
            when the output dtype holds the source values exactly).
    """

    def __init__(self, params: dict, config, *, output_dtype: str, source_dtype: str):
        self.tokens = verification_tokens(config)
        rounding = numpy_dtype(output_dtype)
        rounded = lambda leaf: np.asarray(leaf).astype(rounding).astype(np.float32)  # noqa: E731
        self.logits, self.mtp_logits = native_logits(params, config, self.tokens, with_mtp=config.use_mtp_head,
                                                     read_leaf=rounded)
        self.rounding_change = None
        if output_dtype not in (source_dtype, "float32"):  # float32 holds float16 and bfloat16 values exactly
            unrounded, _ = native_logits(params, config, self.tokens, read_leaf=float32_leaf)
            self.rounding_change = float(np.max(np.abs(unrounded - self.logits)))

    def compare(self, logits: np.ndarray, mtp_logits: np.ndarray | None, *, backend: str, source_name: str) -> dict:
        """The report entries; raises `VerificationError` when a difference exceeds the tolerance."""
        scale = max(1.0, float(np.max(np.abs(self.logits))))
        tolerance = VERIFY_RELATIVE_TOLERANCE * scale
        differences = {
            "max_abs_logit_diff": float(np.max(np.abs(logits - self.logits))),
            "max_abs_mtp_logit_diff": None
            if self.mtp_logits is None
            else float(np.max(np.abs(mtp_logits - self.mtp_logits))),
        }
        for label, found in differences.items():
            if found is not None and not found <= tolerance:  # also catches NaN
                raise VerificationError(
                    f"verification failed: {label.replace('_', ' ')} {found:.3g} exceeds {tolerance:.3g}; "
                    f"the written folder does not reproduce {source_name}"
                )
        return {
            "backend": backend,
            "reference": "independent numpy forward of the source tree, weights rounded to the output dtype",
            "tokens": self.tokens[0].tolist(),
            "max_abs_logit": scale,
            **differences,
            "tolerance": tolerance,
            "output_dtype_rounding_max_abs_logit_change": self.rounding_change,
        }
