"""`needle-hf convert`: a native checkpoint (`.pkl`) or a `.cact` blob -> a complete Hugging Face folder.

Pipeline. Every in-memory step runs (and may fail) before anything is written, and every step is
strict (an unknown, missing or mis-shaped tensor is an error naming it):

1. Read the source, recognised by its content: the native tree, its config and, from a `.cact`,
   the embedded tokenizer.
2. `NeedleConfig.from_needle_config` with the optional heads the tree carries; `dtype` is the
   output dtype (`--dtype`, else the source's own float dtype; float32 for a `.cact`).
3. The fast tokenizer, from `--tokenizer` or the blob, with the chat template; its vocabulary
   must be the model's.
4. HF tensors through the key table (`weight_names.native_to_hf`, strict), as views of the
   native arrays: the model is held in memory once.
5. With a logit check requested (`verify_with`), the source logits for step 7
   (`verification.SourceLogits`: an independent numpy forward over the native tree). The HF
   tensors are cast to the output dtype (an overflow is an error naming the tensor).
6. Write `config.json`, `generation_config.json`, `model.safetensors` (PyTorch layout, metadata
   `format: pt`, streamed out one tensor at a time) and the tokenizer files into a temporary folder
   beside OUT_DIR.
7. Verify: every tensor read back from the file equals the in-memory tensor bit for bit, and
   `safetensors` reads the file as this config's PyTorch-layout tensors. With `verify_with`, also
   the HF model loaded from the folder gives the source logits (and MTP logits) on a fixed
   sequence; it runs in float32 on the stored values, so the check measures the conversion, not
   the output dtype (how much rounding to that dtype moves the logits is recorded separately).
   The logit check is opt-in because it costs what the conversion does not: the model framework
   and a second copy of the weights in memory (about 450 MB and 15 s more for Needle 2).
8. `conversion_report.json` (source sha256, converter version, the measured differences), then the
   temporary folder, synced to disk, takes OUT_DIR's place. An existing OUT_DIR is replaced only now
   (`overwrite`), atomically (see `atomic_output`). Any failure removes the temporary folder: nothing
   is left behind; what a killed run left is cleaned up by the next one. OUT_DIR may not be, contain
   or lie inside the source or the tokenizer file.

Generation defaults: generation stops at EOS (1), as the reference's own generation does; Needle's
trained assistant turn ends `... </tool_call><|im_end|>` followed by EOS. A single id because
transformers' Flax `generate()` accepts only one `eos_token_id`. pad 0, bos 2.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import needle_hf
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.tokenization_needle import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TokenizerSourceError,
    build_fast_tokenizer,
    check_vocab_matches,
    save_fast_tokenizer,
)
from needle_hf.models.needle.weight_names import native_to_hf, optional_heads_in_native

from . import verification
from .atomic_output import check_output_folder, check_output_outside_inputs, errors_name, publish_folder, staging_path
from .cact import CACT_TAG, read_cact
from .export import SAFETENSORS_NAME, numpy_dtype
from .safetensors_stream import write_safetensors
from .formats import SourceFormat, UnknownSourceFormatError, detect_source_format
from .native_checkpoint import load_native_checkpoint

# Generation stops at EOS, as the reference's generation does (a trained turn ends `<|im_end|>` then
# EOS). One id, not a list: transformers' Flax generate() accepts a single eos_token_id only.
GENERATION_EOS_ID = EOS_ID
REPORT_NAME = "conversion_report.json"
# The model architecture recorded in config.json (the PyTorch class; Flax prefixes "Flax").
ARCHITECTURE = "NeedleForCausalLM"

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
    """The source's own float dtype; float32 when its leaves differ, and for a `.cact` (decoded to float32)."""
    if source.format == SourceFormat.CACT:
        return "float32"
    names = set(_dtype_counts(source.params))
    for name in ("float32", "float16", "bfloat16"):
        if names == {name}:
            return name
    return "float32"


# --------------------------------------------------------------------------------------------------
# Checks before any work.


def _check_config_fits_params(config: NeedleConfig, params: dict, source: Path):
    """Check the config's sizes against the tree before any name table is built from them: a config
    claiming 10^9 layers over a small tree is refused here, not after allocating for 10^9 layers."""
    layers = params.get("stack", {}).get("layers", {}).get("block", {}) if isinstance(params.get("stack"), dict) else {}
    norm = layers.get("ZCRMSNorm_0", {}).get("scale") if isinstance(layers.get("ZCRMSNorm_0"), dict) else None
    found_layers = None if norm is None or norm.ndim == 0 else norm.shape[0]
    if found_layers != config.num_hidden_layers:
        raise ConversionError(
            f"{source}: config num_layers {config.num_hidden_layers}, but stack/layers/block/ZCRMSNorm_0/scale holds "
            f"{'no stacked layers' if found_layers is None else f'{found_layers} layers'}"
        )


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
        # File names only: the report travels with the folder (to the Hub), local paths do not belong there.
        entry = {"source": "sentencepiece model", "file": tokenizer_path.name, "sha256": sha256_of(tokenizer_path)}
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
# 4-5. Tensors.


def cast_tensors(tensors: dict[str, np.ndarray], dtype_name: str) -> dict[str, np.ndarray]:
    """Cast every tensor to the output dtype in place of the original; values that overflow it are an error."""
    dtype = numpy_dtype(dtype_name)
    for name in list(tensors):
        value = tensors[name]
        if value.dtype == dtype:
            continue
        with np.errstate(over="ignore"):  # overflow is detected and reported just below
            cast = value.astype(dtype, order="C")
        if not np.all(np.isfinite(cast.astype(np.float32))) and np.all(np.isfinite(value.astype(np.float32))):
            raise ConversionError(
                f"tensor {name}: values up to {np.abs(value.astype(np.float32)).max():.4g} overflow {dtype_name}; "
                "choose --dtype float32 or bfloat16"
            )
        tensors[name] = cast
    return tensors


# --------------------------------------------------------------------------------------------------
# The pipeline.


def convert(
    source_path,
    out_dir,
    *,
    tokenizer=None,
    dtype: str | None = None,
    overwrite: bool = False,
    verify_with: str | None = None,
    progress: Progress | None = None,
) -> ConversionResult:
    """Convert a native `.pkl` or a `.cact` into a Hugging Face folder at `out_dir` (see the module docstring).

    Args:
        source_path: the native checkpoint or `.cact` blob.
        out_dir: the folder to create (its parent must exist).
        tokenizer: a SentencePiece `tokenizer.model`; default: the blob's embedded tokenizer, if any.
        dtype: "float32", "bfloat16" or "float16"; default: the source's dtype (float32 for a `.cact`).
        overwrite: replace an existing, non-empty `out_dir` (only once the new folder is complete).
        verify_with: also compare the logits of the written folder's HF model with the source's:
            "flax", "torch" or "auto" (Flax when available); None (default) for no logit check.
            The bit-exact read-back of the written tensors always runs.
        progress: called with one line per step (the CLI prints them on stderr).

    Returns:
        A `ConversionResult` (counts, seconds and the report written to `conversion_report.json`).
    """
    started = time.perf_counter()
    from .needle3 import convert_needle3, is_needle3_checkpoint

    if is_needle3_checkpoint(source_path):  # a Needle 3 `.safetensors` checkpoint: its own converter
        if verify_with not in (None, "auto", "torch"):
            raise ConversionError(f"verify_with={verify_with!r}: Needle 3 conversions verify with the PyTorch model")
        report = convert_needle3(source_path, out_dir, tokenizer=tokenizer, dtype=dtype, overwrite=overwrite,
                                 progress=progress)
        output = report["output"]
        return ConversionResult(Path(out_dir).absolute(), output["tensors"], output["parameters"],
                                output["safetensors_bytes"], time.perf_counter() - started, report)
    progress = progress or _silent
    out_dir = Path(out_dir).absolute()
    inputs = {"source": Path(source_path)}
    if tokenizer is not None:
        inputs["tokenizer"] = Path(tokenizer)
    check_output_folder(out_dir, inputs, command="convert", overwrite=overwrite, error=ConversionError)
    if dtype is not None:
        numpy_dtype(dtype)  # validates the name before any work
    backend = None if verify_with is None else verification.resolve_backend(verify_with)

    # Steps 1-5, in memory.
    progress(f"reading {source_path}")
    source = read_source(source_path)
    source_dtype = default_output_dtype(source)
    source_facts = {
        "file": source.path.name,
        "format": source.format.value,
        "sha256": source.sha256,
        "bytes": source.path.stat().st_size,
        "dtype": source_dtype,
        "elements_by_dtype": _dtype_counts(source.params),
        **source.details,
    }
    dtype = dtype or source_dtype
    heads = optional_heads_in_native(source.params)
    config = NeedleConfig.from_needle_config(source.native_config, **heads)
    _check_config_fits_params(config, source.params, source.path)
    config.dtype = dtype
    config.architectures = [ARCHITECTURE]
    progress(
        f"{source.format.value}: {config.num_hidden_layers} layers, d={config.hidden_size}, vocab {config.vocab_size}, "
        f"heads {[flag for flag, present in heads.items() if present]}; output dtype {dtype}"
    )
    tokenizer_object, tokenizer_facts = _build_tokenizer(source, tokenizer, config, progress)
    progress("mapping tensors to Hugging Face names")
    # Strict: refuses unknown, missing and mis-shaped leaves. Views: no second copy of the model.
    tensors = native_to_hf(source.params, config, copy=False)
    tensor_count, parameters = len(tensors), sum(int(value.size) for value in tensors.values())
    source_logits = None
    if backend is not None:
        progress("computing the source logits (numpy forward over the native tree)")
        source_logits = verification.SourceLogits(source.params, config, output_dtype=dtype, source_dtype=source_dtype)
    source.params = None  # the HF tensors (views of its arrays) are all that is needed from here on
    tensors = cast_tensors(tensors, dtype)

    # Steps 6-8, in a staging folder beside OUT_DIR; a failure names OUT_DIR, never the staging folder.
    staging = staging_path(out_dir)
    try:
        with errors_name(out_dir, staging):
            os.mkdir(staging)  # the usual permissions (umask), which the published folder keeps
            progress(f"writing {tensor_count} tensors ({parameters:,} parameters) to {SAFETENSORS_NAME}")
            config.save_pretrained(str(staging))
            _generation_config().save_pretrained(str(staging))
            weights_path = staging / SAFETENSORS_NAME
            write_safetensors(weights_path, tensors, metadata=verification.SAFETENSORS_METADATA)
            if tokenizer_object is not None:
                save_fast_tokenizer(tokenizer_object, str(staging))

            progress("verifying: reading every tensor back")
            verification.verify_tensors(weights_path, tensors, config)
            del tensors
            checks: dict = {"tensors_bit_exact": True, "max_abs_logit_diff": None}
            if backend is not None:
                progress(f"verifying: logits of the written folder ({backend} model) against the source")
                logits, mtp_logits = verification.model_logits(
                    staging, source_logits.tokens, with_mtp=config.use_mtp_head, backend=backend
                )
                checks.update(source_logits.compare(logits, mtp_logits, backend=backend, source_name=source.path.name))

            weights_bytes = weights_path.stat().st_size
            report = {
                "converter": {"name": "needle-hf", "version": needle_hf.__version__},
                "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "source": source_facts,
                "output": {
                    "dtype": dtype,
                    "tensors": tensor_count,
                    "parameters": parameters,
                    "safetensors_bytes": weights_bytes,
                    "generation_eos_token_id": GENERATION_EOS_ID,
                },
                "tokenizer": tokenizer_facts,
                "verification": checks,
            }
            (staging / REPORT_NAME).write_text(json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
            check_output_outside_inputs(out_dir, inputs, command="convert")
            publish_folder(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ConversionResult(out_dir, tensor_count, parameters, weights_bytes, time.perf_counter() - started, report)


def _generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=GENERATION_EOS_ID, pad_token_id=PAD_ID)


def _jsonable(value):
    """The report as JSON can hold it (run metadata may hold anything a pickle can): numpy values as
    Python values, non-finite floats and other objects as text. The checkpoint reader bounds the
    metadata's depth and size, shared values included."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(item) for item in value]
    return str(value)
