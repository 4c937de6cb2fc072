"""`needle-hf convert`: a native checkpoint (`.pkl`) or a `.cact` blob -> a complete Hugging Face folder.

Pipeline. Every in-memory step runs (and may fail) before anything is written, and every step is
strict (an unknown, missing or mis-shaped tensor is an error naming it):

1. Read the source, recognised by its content: the native tree, its config and, from a `.cact`,
   the embedded tokenizer.
2. `NeedleConfig.from_needle_config` with the optional heads the tree carries; `dtype` is the
   output dtype (`--dtype`, else the source's own float dtype; float32 for a `.cact`).
3. The fast tokenizer, from `--tokenizer` or the blob, with the chat template; its vocabulary
   must be the model's.
4. Source logits for the check in step 7, from `native_forward` (an independent numpy forward
   over the native tree, with every weight rounded to the output dtype).
5. HF tensors through the key table (`weight_names.native_to_hf`), cast to the output dtype.
6. Write `config.json`, `generation_config.json`, `model.safetensors` (PyTorch layout, metadata
   `format: pt`) and the tokenizer files into a temporary folder beside OUT_DIR.
7. Verify: every tensor read back from the file equals the in-memory tensor bit for bit, and the
   HF model loaded from the folder gives the source logits (and MTP logits) on a fixed sequence.
   The model runs in float32 on the stored values, so the check measures the conversion, not the
   output dtype; how much rounding to that dtype moves the logits is recorded separately.
8. `conversion_report.json` (source sha256, converter version, the measured differences), then the
   temporary folder is renamed to OUT_DIR. An existing OUT_DIR is replaced only now (`overwrite`).
   Any failure removes the temporary folder: nothing is left behind.

Generation defaults: Needle's trained assistant turn ends `... </tool_call><|im_end|>` followed by
EOS (the reference appends EOS to every target and stops at EOS). `generation_config.json` stops at
either (`eos_token_id = [EOS, <|im_end|>]` = [1, 5]): the decoded text is the same as stopping at
EOS only (skip_special_tokens drops EOS, and `<|im_end|>` is a text marker either way), and
generation ends one step earlier, also when a model emits `<|im_end|>` without the EOS after it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import needle_hf
from needle_hf.chat_template import CHAT_MARKERS, FIRST_CHAT_MARKER_ID, IM_END
from needle_hf.configuration_needle import NeedleConfig
from needle_hf.tokenization_needle import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TokenizerSourceError,
    build_fast_tokenizer,
    check_vocab_matches,
    save_fast_tokenizer,
)
from needle_hf.weight_names import native_to_hf, optional_heads_in_native

from .cact import CACT_TAG, read_cact
from .export import SAFETENSORS_NAME, check_names_and_shapes, numpy_dtype
from .formats import SourceFormat, UnknownSourceFormatError, detect_source_format
from .native_checkpoint import load_native_checkpoint
from .native_forward import float32_leaf, native_logits

IM_END_ID = FIRST_CHAT_MARKER_ID + CHAT_MARKERS.index(IM_END)
GENERATION_EOS_IDS = (EOS_ID, IM_END_ID)
REPORT_NAME = "conversion_report.json"
# The model architecture recorded in config.json (the PyTorch class; Flax prefixes "Flax").
ARCHITECTURE = "NeedleForCausalLM"

# The fixed sequence of the logit check: long enough for every engram tap (11 tokens of history).
VERIFY_LENGTH = 16
# Relative tolerance of the logit check, against max(1, max |source logit|). Two float32
# implementations agree to ~1e-6 of the logit scale; a conversion mistake moves logits by O(1).
VERIFY_RELATIVE_TOLERANCE = 1e-4
VERIFY_BACKENDS = ("auto", "flax", "torch")

Progress = Callable[[str], None]


class ConversionError(ValueError):
    """The conversion cannot proceed or its result failed verification; the message says why."""


@dataclass
class SourceModel:
    """A conversion source read into native form.

    Attributes:
        path: the file read.
        format: `SourceFormat.NATIVE_CHECKPOINT` or `SourceFormat.CACT`.
        params: the native parameter tree (dtypes as stored; float32 for a `.cact`).
        native_config: the native config dict.
        tokenizer_table: the `.cact` piece table, or None.
        sha256: hex digest of the source file.
        details: JSON-able facts for the report (step and run of a checkpoint, the blob's
            quantization and filled-in defaults).
    """

    path: Path
    format: SourceFormat
    params: dict
    native_config: dict
    tokenizer_table: dict | None
    sha256: str
    details: dict = field(default_factory=dict)


@dataclass
class ConversionResult:
    out_dir: Path
    tensors: int
    parameters: int
    bytes: int
    seconds: float
    report: dict

    def summary(self) -> str:
        verification = self.report["verification"]
        checked = (
            f"max |dlogit| {verification['max_abs_logit_diff']:.2e}"
            if verification.get("max_abs_logit_diff") is not None
            else "logits not verified"
        )
        return (
            f"wrote {self.out_dir}: {self.tensors} tensors, {self.parameters:,} parameters, "
            f"{self.bytes:,} bytes ({self.report['output']['dtype']}), {self.seconds:.1f} s, {checked}"
        )


def _silent(_: str):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# 1. The source.


def _source_format(path: Path) -> SourceFormat:
    """The format by content; a file named `.cact`/`.pkl` whose content is neither is read as what
    its name says, so the reader's own, more precise error (bad tag, not a pickle) is reported."""
    try:
        found = detect_source_format(path)
    except UnknownSourceFormatError:
        if path.suffix == ".cact":
            return SourceFormat.CACT
        if path.suffix in (".pkl", ".pickle"):
            return SourceFormat.NATIVE_CHECKPOINT
        raise
    if found not in (SourceFormat.NATIVE_CHECKPOINT, SourceFormat.CACT):
        raise ConversionError(
            f"{path} is a {found.value}, already in Hugging Face layout; `needle-hf convert` reads a native "
            f"checkpoint (.pkl) or a .cact blob (tag 0x{CACT_TAG:08X})"
        )
    return found


def _dtype_counts(params: dict) -> dict[str, int]:
    counts: dict[str, int] = {}

    def walk(tree):
        for value in tree.values():
            if isinstance(value, dict):
                walk(value)
            else:
                counts[value.dtype.name] = counts.get(value.dtype.name, 0) + value.size

    walk(params)
    return counts


def read_source(path) -> SourceModel:
    """Read a native checkpoint or a `.cact` blob (recognised by content) into native form."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no source file at {path}")
    kind = _source_format(path)
    if kind == SourceFormat.NATIVE_CHECKPOINT:
        checkpoint = load_native_checkpoint(path)
        details = {"step": checkpoint.step, "run": checkpoint.run, "config_source": checkpoint.config_source}
        return SourceModel(path, kind, checkpoint.params, checkpoint.config, None, sha256_of(path), details)
    blob = read_cact(path)
    bits: dict[str, int] = {}
    for record in blob.records:
        label = record.dtype_name if record.dtype_name != "CQ" else ("ternary" if record.bits == 5 else f"CQ{record.bits}")
        bits[label] = bits.get(label, 0) + 1
    details = {
        "records_by_encoding": bits,
        "filled_defaults": list(blob.filled_defaults),
        "kv_window": blob.geometry.kv_window,
        "kv_bits": blob.geometry.kv_bits,
        "note": "a .cact is quantized: the weights are its exact dequantization, not the training checkpoint's",
    }
    return SourceModel(path, kind, blob.params, blob.config, blob.tokenizer_table, sha256_of(path), details)


def default_output_dtype(source: SourceModel) -> str:
    """The source's own float dtype (the widest one if leaves differ); float32 for a `.cact`."""
    if source.format == SourceFormat.CACT:
        return "float32"
    names = set(_dtype_counts(source.params))
    for name in ("float32", "float16", "bfloat16"):
        if names == {name}:
            return name
    return "float32"


# --------------------------------------------------------------------------------------------------
# The output folder.


def _check_output_dir(out_dir: Path, *, overwrite: bool):
    if not out_dir.parent.is_dir():
        raise ConversionError(f"the parent folder of {out_dir} does not exist; create it first")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")


def _publish(staging: Path, out_dir: Path):
    """Move the finished staging folder to `out_dir`, replacing what is there only at this point."""
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    previous = out_dir.with_name(f".{out_dir.name}.previous-{uuid.uuid4().hex[:8]}")
    os.rename(out_dir, previous)
    try:
        os.rename(staging, out_dir)
    except BaseException:
        os.rename(previous, out_dir)
        raise
    shutil.rmtree(previous, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# 3. The tokenizer.


def _build_tokenizer(source: SourceModel, tokenizer_path, config: NeedleConfig, progress: Progress):
    """(tokenizer or None, report entry)."""
    if tokenizer_path is not None:
        tokenizer_path = Path(tokenizer_path)
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {tokenizer_path}")
        if source.tokenizer_table is not None:
            progress(f"using {tokenizer_path} instead of the tokenizer embedded in {source.path.name}")
        from google.protobuf.message import DecodeError

        try:
            tokenizer = build_fast_tokenizer(str(tokenizer_path), model_max_length=config.max_position_embeddings)
        except DecodeError as error:
            raise TokenizerSourceError(f"{tokenizer_path}: not a SentencePiece model file ({error})") from None
        entry = {"source": "sentencepiece model", "path": str(tokenizer_path), "sha256": sha256_of(tokenizer_path)}
        where = f"the model ({source.path.name})"
    elif source.tokenizer_table is not None:
        tokenizer = build_fast_tokenizer(source.tokenizer_table, model_max_length=config.max_position_embeddings)
        entry = {"source": f"embedded in {source.path.name}"}
        where = "the blob's header"
    else:
        progress(
            "warning: no tokenizer (a .pkl holds none): the folder gets no tokenizer files; "
            "pass --tokenizer tokenizer.model to add them"
        )
        return None, None
    check_vocab_matches(tokenizer, config.vocab_size, source=where)
    entry["vocab_size"] = len(tokenizer)
    return tokenizer, entry


# --------------------------------------------------------------------------------------------------
# 5. Tensors.


def cast_tensors(tensors: dict[str, np.ndarray], dtype_name: str) -> dict[str, np.ndarray]:
    """Cast every tensor to the output dtype in place of the original; values that overflow it are an error."""
    dtype = numpy_dtype(dtype_name)
    for name in list(tensors):
        value = tensors[name]
        if value.dtype == dtype:
            continue
        cast = value.astype(dtype, order="C")
        if not np.all(np.isfinite(cast.astype(np.float32))) and np.all(np.isfinite(value.astype(np.float32))):
            raise ConversionError(
                f"tensor {name}: values up to {np.abs(value.astype(np.float32)).max():.4g} overflow {dtype_name}; "
                "choose --dtype float32 or bfloat16"
            )
        tensors[name] = cast
    return tensors


def _write_weights(path: Path, tensors: dict[str, np.ndarray]):
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------------
# 7. Verification.


def verification_tokens(config: NeedleConfig) -> np.ndarray:
    """The fixed sequence [1, T]: BOS, then ids scattered over the vocabulary by a quadratic hash
    (no padding, no special ids)."""
    length = min(VERIFY_LENGTH, config.max_position_embeddings)
    first_text_id = FIRST_CHAT_MARKER_ID
    k = np.arange(1, length, dtype=np.int64)
    spread = first_text_id + (k * 7919 + k * k * 104729) % (config.vocab_size - first_text_id)
    return np.concatenate([[BOS_ID], spread]).astype(np.int32)[None, :]


def verify_tensors(weights_path: Path, expected: dict[str, np.ndarray], config: NeedleConfig):
    """Every tensor in the written file equals the in-memory tensor bit for bit (names, shapes, dtypes too)."""
    from safetensors import safe_open

    with safe_open(str(weights_path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != "pt":
            raise ConversionError(f"{weights_path}: metadata format {metadata.get('format')!r}, expected 'pt'")
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        check_names_and_shapes(shapes, config, where=str(weights_path))
        for name, want in expected.items():
            got = handle.get_tensor(name)
            if got.dtype != want.dtype or got.shape != want.shape:
                raise ConversionError(
                    f"{weights_path}: tensor {name} reads back as {got.dtype}{list(got.shape)}, "
                    f"expected {want.dtype}{list(want.shape)}"
                )
            if not np.array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
                raise ConversionError(f"{weights_path}: tensor {name} does not read back bit-exactly")


def _resolve_backend(backend: str) -> str:
    import importlib.util

    if backend not in VERIFY_BACKENDS:
        raise ConversionError(f"unknown verification backend {backend!r}; expected one of {VERIFY_BACKENDS}")
    has_flax = all(importlib.util.find_spec(m) is not None for m in ("jax", "flax"))
    if has_flax:
        import transformers

        has_flax = hasattr(transformers, "FlaxAutoModelForCausalLM")
    has_torch = importlib.util.find_spec("torch") is not None
    if backend == "auto":
        if has_flax:
            return "flax"
        if has_torch:
            return "torch"
        raise ConversionError(
            "verifying the logits needs the Flax model (transformers 4.x with jax and flax) or the PyTorch "
            "model (torch); install one, or pass --no-verify"
        )
    if backend == "flax" and not has_flax:
        raise ConversionError("--verify-with flax needs transformers 4.x with jax and flax installed")
    if backend == "torch" and not has_torch:
        raise ConversionError("--verify-with torch needs torch installed")
    return backend


def model_logits(folder: Path, tokens: np.ndarray, *, with_mtp: bool, backend: str):
    """(logits, mtp_logits or None) float32 of the HF model loaded from `folder`, run in float32."""
    if backend == "flax":
        import jax

        from needle_hf.modeling_flax_needle import FlaxNeedleForCausalLM

        model = FlaxNeedleForCausalLM.from_pretrained(str(folder))
        params = model.to_fp32(model.params)  # the stored values, computed in float32

        def forward(params, input_ids):
            outputs = model(input_ids, params=params, output_mtp_logits=with_mtp)
            return outputs.logits, outputs.mtp_logits

        logits, mtp_logits = jax.jit(forward)(params, tokens)
    else:
        import torch

        from needle_hf.modeling_needle import NeedleForCausalLM

        model = NeedleForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        with torch.no_grad():
            outputs = model(torch.as_tensor(tokens, dtype=torch.long), return_mtp_logits=with_mtp)
        logits, mtp_logits = outputs.logits, outputs.mtp_logits if with_mtp else None
    as_numpy = lambda x: None if x is None else np.asarray(x, np.float32)  # noqa: E731
    return as_numpy(logits), as_numpy(mtp_logits)


def _rounded_reader(dtype_name: str):
    dtype = numpy_dtype(dtype_name)
    return lambda leaf: np.asarray(leaf).astype(dtype).astype(np.float32)


def _max_abs_diff(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    return None if a is None or b is None else float(np.max(np.abs(a - b)))


# --------------------------------------------------------------------------------------------------
# The pipeline.


def convert(
    source_path,
    out_dir,
    *,
    tokenizer=None,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    verify_with: str = "auto",
    progress: Progress | None = None,
) -> ConversionResult:
    """Convert a native `.pkl` or a `.cact` into a Hugging Face folder at `out_dir` (see the module docstring).

    Args:
        source_path: the native checkpoint or `.cact` blob.
        out_dir: the folder to create (its parent must exist).
        tokenizer: a SentencePiece `tokenizer.model`; default: the blob's embedded tokenizer, if any.
        dtype: "float32", "bfloat16" or "float16"; default: the source's dtype (float32 for a `.cact`).
        overwrite: replace an existing, non-empty `out_dir` (only once the new folder is complete).
        verify: compare the loaded model's logits with the source's (the bit-exact read-back of the
            written tensors always runs).
        verify_with: "flax", "torch" or "auto" (Flax when available).
        progress: called with one line per step (the CLI prints them on stderr).

    Returns:
        A `ConversionResult` (counts, seconds and the report written to `conversion_report.json`).
    """
    started = time.perf_counter()
    progress = progress or _silent
    out_dir = Path(out_dir).absolute()
    _check_output_dir(out_dir, overwrite=overwrite)
    if dtype is not None:
        numpy_dtype(dtype)  # validates the name before any work
    backend = _resolve_backend(verify_with) if verify else None

    progress(f"reading {source_path}")
    source = read_source(source_path)
    source_dtype = "float32" if source.format == SourceFormat.CACT else default_output_dtype(source)
    dtype = dtype or default_output_dtype(source)
    heads = optional_heads_in_native(source.params)
    config = NeedleConfig.from_needle_config(source.native_config, **heads)
    config.dtype = dtype
    config.architectures = [ARCHITECTURE]
    progress(
        f"{source.format.value}: {config.num_hidden_layers} layers, d={config.hidden_size}, vocab {config.vocab_size}, "
        f"heads {[flag for flag, present in heads.items() if present]}; output dtype {dtype}"
    )
    tokenizer_object, tokenizer_entry = _build_tokenizer(source, tokenizer, config, progress)

    verification: dict = {"tensors_bit_exact": None, "max_abs_logit_diff": None}
    tokens = verification_tokens(config)
    if verify:
        progress("computing source logits (numpy forward over the native tree)")
        source_logits, source_mtp = native_logits(
            source.params, config, tokens, with_mtp=config.use_mtp_head, read_leaf=_rounded_reader(dtype)
        )
        rounding_change = None
        if dtype != source_dtype:
            unrounded, _ = native_logits(source.params, config, tokens, read_leaf=float32_leaf)
            rounding_change = _max_abs_diff(unrounded, source_logits)

    progress("mapping tensors to Hugging Face names")
    tensors = cast_tensors(native_to_hf(source.params, config), dtype)
    source.params = None  # the HF tensors are all that is needed from here on
    tensor_count, parameters = len(tensors), sum(int(value.size) for value in tensors.values())

    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        progress(f"writing {tensor_count} tensors ({parameters:,} parameters) to {SAFETENSORS_NAME}")
        config.save_pretrained(str(staging))
        _generation_config().save_pretrained(str(staging))
        weights_path = staging / SAFETENSORS_NAME
        _write_weights(weights_path, tensors)
        if tokenizer_object is not None:
            save_fast_tokenizer(tokenizer_object, str(staging))

        progress("verifying: reading every tensor back")
        verify_tensors(weights_path, tensors, config)
        verification["tensors_bit_exact"] = True
        del tensors
        if verify:
            progress(f"verifying: logits of the written folder ({backend} model) against the source")
            logits, mtp = model_logits(staging, tokens, with_mtp=config.use_mtp_head, backend=backend)
            scale = max(1.0, float(np.max(np.abs(source_logits))))
            verification.update(
                backend=backend,
                reference="independent numpy forward of the source tree (weights rounded to the output dtype)",
                tokens=tokens[0].tolist(),
                max_abs_logit=scale,
                max_abs_logit_diff=_max_abs_diff(logits, source_logits),
                max_abs_mtp_logit_diff=_max_abs_diff(mtp, source_mtp),
                tolerance=VERIFY_RELATIVE_TOLERANCE * scale,
                output_dtype_rounding_max_abs_logit_change=rounding_change,
            )
            for label in ("max_abs_logit_diff", "max_abs_mtp_logit_diff"):
                found = verification[label]
                if found is not None and not found <= verification["tolerance"]:
                    raise ConversionError(
                        f"verification failed: {label.replace('_', ' ')} {found:.3g} exceeds {verification['tolerance']:.3g}; "
                        f"the written folder does not reproduce {source.path.name}"
                    )

        weights_bytes = weights_path.stat().st_size
        report = {
            "converter": {"name": "needle-hf", "version": needle_hf.__version__},
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": {
                "file": source.path.name,
                "format": source.format.value,
                "sha256": source.sha256,
                "bytes": source.path.stat().st_size,
                "dtype": source_dtype,
                **source.details,
            },
            "output": {
                "dtype": dtype,
                "tensors": tensor_count,
                "parameters": parameters,
                "safetensors_bytes": weights_bytes,
                "generation_eos_token_ids": list(GENERATION_EOS_IDS),
            },
            "tokenizer": tokenizer_entry,
            "verification": verification,
        }
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2, default=_jsonable) + "\n", encoding="utf-8")
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ConversionResult(
        out_dir=out_dir,
        tensors=tensor_count,
        parameters=parameters,
        bytes=weights_bytes,
        seconds=time.perf_counter() - started,
        report=report,
    )


def _generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=list(GENERATION_EOS_IDS), pad_token_id=PAD_ID)


def _jsonable(value):
    """JSON fallback for run metadata: numpy scalars and arrays as Python values, anything else as text."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)
