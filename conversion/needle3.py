"""Convert a Needle 3 checkpoint (cactus-needle 3.x `.safetensors`) into a Hugging Face folder.

A Needle 3 checkpoint is one safetensors file holding the reference's Flax tree with paths joined by
`/` and, in its metadata, `format_version` (2), `config` (JSON: the overridden `TransformerConfig`
fields), `step` and `run`. The conversion:

1. reads the metadata and refuses anything but format_version 2 and a Needle 3 config;
2. resolves the config as the reference's loader does (`Needle3Config.from_needle_config`) and turns
   on the probe heads whose tensors are present;
3. maps every tensor through the one table (`weight_names_needle3`): an unknown, missing or
   mis-shaped tensor is an error naming it;
4. loads the tensors strictly into a float32 `Needle3ForCausalLM`, computes its logits on fixed
   probe tokens, and writes the folder (config, generation config, weights in the chosen dtype)
   into a staging folder;
5. loads the staging folder back through `AutoModelForCausalLM` (strictly) and compares its logits
   with step 4's (float32 output: <= 1e-4), writes `conversion_report.json`, then publishes the
   folder atomically.
"""

from __future__ import annotations

import datetime
import json
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .atomic_output import check_output_outside_inputs, clean_debris, publish_folder, staging_path

CHECKPOINT_FORMAT_VERSION = 2
REPORT_NAME = "conversion_report.json"
OUTPUT_DTYPES = ("float32", "bfloat16", "float16")
# Tolerance of the float32 read-back check (the written folder reproduces the in-memory model).
FLOAT32_LOGIT_TOLERANCE = 1e-4
# Probe sequence of the logit check: fixed ids, long enough to pass a sliding window in small models.
VERIFY_LENGTH = 24
_SAFETENSORS_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100 << 20


class Needle3ConversionError(ValueError):
    """The source is not a readable Needle 3 checkpoint, or the written folder failed its checks."""


def read_safetensors_metadata(path) -> Optional[dict]:
    """The `__metadata__` of a safetensors file, or None when `path` is not a safetensors file."""
    path = Path(path)
    if not path.is_file():
        return None
    with open(path, "rb") as handle:
        head = handle.read(_SAFETENSORS_LENGTH.size)
        if len(head) < _SAFETENSORS_LENGTH.size:
            return None
        (length,) = _SAFETENSORS_LENGTH.unpack(head)
        if length > min(_MAX_HEADER_BYTES, path.stat().st_size - _SAFETENSORS_LENGTH.size):
            return None
        raw = handle.read(length)
    if not raw.startswith(b"{"):
        return None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return header.get("__metadata__") or {}


def is_needle3_checkpoint(path) -> bool:
    """Whether `path` is a native Needle 3 checkpoint: a safetensors file whose metadata carries the
    reference's `format_version` and `config`, or a `.cact` v3 engine blob."""
    from .cact_v3 import is_cact3

    metadata = read_safetensors_metadata(path)
    return (metadata is not None and "format_version" in metadata and "config" in metadata) or is_cact3(path)


@dataclass
class Needle3Checkpoint:
    flat: dict  # native path -> numpy array
    native_config: dict
    step: Optional[int]
    run: dict
    tokenizer_table: Optional[object] = None  # a `.cact` v3's packed tokenizer (PieceTable), if any


def read_needle3_checkpoint(path) -> Needle3Checkpoint:
    """Read a Needle 3 `.safetensors` checkpoint (strict about its metadata)."""
    from safetensors.numpy import load_file

    path = Path(path)
    metadata = read_safetensors_metadata(path)
    if metadata is None:
        raise Needle3ConversionError(f"{path}: not a safetensors file")
    version = metadata.get("format_version")
    if version != str(CHECKPOINT_FORMAT_VERSION):
        raise Needle3ConversionError(
            f"{path}: format_version: expected {CHECKPOINT_FORMAT_VERSION}, found {version!r}")
    try:
        native = json.loads(metadata.get("config") or "{}")
        run = json.loads(metadata.get("run") or "{}")
    except json.JSONDecodeError as error:
        raise Needle3ConversionError(f"{path}: metadata config/run is not valid JSON ({error})") from None
    if not isinstance(native, dict):
        raise Needle3ConversionError(f"{path}: metadata config: expected a JSON object, found {type(native).__name__}")
    step = metadata.get("step")
    flat = load_file(str(path))
    # The reference's loader drops a multi-token-prediction head (it has none); so does the table.
    flat = {name: value for name, value in flat.items() if not name.startswith("mtp_")}
    return Needle3Checkpoint(flat, native, int(step) if step not in (None, "") else None, run if isinstance(run, dict) else {})


def _read_source(path: Path) -> Needle3Checkpoint:
    """A `.safetensors` checkpoint, or a `.cact` v3 blob (its dequantised weights and header geometry)."""
    from .cact_v3 import Cact3Error, is_cact3, read_cact3

    if not is_cact3(path):
        return read_needle3_checkpoint(path)
    try:
        blob = read_cact3(path)
    except Cact3Error as error:
        raise Needle3ConversionError(str(error)) from None
    table = None
    if blob.tokenizer is not None:
        from needle_hf.models.needle.tokenization_needle import PieceTable

        from .cact import CactFormatError, parse_tokenizer_table

        try:
            table = PieceTable.from_mapping(parse_tokenizer_table(blob.tokenizer, where=f"{path}: tokenizer record"))
        except CactFormatError as error:
            raise Needle3ConversionError(str(error)) from None
    return Needle3Checkpoint(blob.flat, blob.native_config, None, {"source": "cact v3"}, table)


def config_for_checkpoint(checkpoint: Needle3Checkpoint, *, source: str = "checkpoint"):
    from needle_hf.models.needle3.configuration_needle3 import Needle3Config
    from needle_hf.models.needle3.weight_names_needle3 import heads_in_native

    try:
        return Needle3Config.from_needle_config(checkpoint.native_config, **heads_in_native(checkpoint.flat))
    except (TypeError, ValueError) as error:
        raise Needle3ConversionError(f"{source}: config: {error}") from None


def verification_tokens(config) -> np.ndarray:
    """Fixed probe ids [1, VERIFY_LENGTH]: BOS, then ids spread over the vocabulary."""
    ids = [config.bos_token_id] + [(7 + 37 * i) % config.vocab_size for i in range(VERIFY_LENGTH - 1)]
    return np.asarray([ids], np.int64)


def _check_output_dir(out_dir: Path, *, overwrite: bool):
    if out_dir.exists() and not out_dir.is_dir():
        raise Needle3ConversionError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise Needle3ConversionError(f"{out_dir} is not empty (pass overwrite=True / --overwrite to replace it)")
    if not out_dir.parent.is_dir():
        raise Needle3ConversionError(f"the parent of {out_dir} does not exist")


def convert_needle3(
    source_path,
    out_dir,
    *,
    tokenizer=None,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Convert a Needle 3 `.safetensors` checkpoint into a Hugging Face folder; returns the report.

    Args:
        source_path: the checkpoint.
        out_dir: the folder to create (its parent must exist).
        tokenizer: a Needle 3 SentencePiece `tokenizer.model` (16 chat markers) to convert and write beside
            the weights, with the chat template.
        dtype: "float32" (default), "bfloat16" or "float16" for model.safetensors.
        overwrite: replace a non-empty `out_dir` (only once the new folder is complete).
        progress: called with one line per step.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import needle_hf
    from needle_hf.models.needle3.modeling_needle3 import Needle3ForCausalLM
    from needle_hf.models.needle3.tokenization_needle3 import build_needle3_tokenizer
    from needle_hf.models.needle.tokenization_needle import check_vocab_matches, save_fast_tokenizer
    from needle_hf.models.needle3.weight_names_needle3 import native_to_hf

    started = time.perf_counter()
    progress = progress or (lambda _: None)
    source_path, out_dir = Path(source_path), Path(out_dir).absolute()
    dtype = dtype or "float32"
    if dtype not in OUTPUT_DTYPES:
        raise Needle3ConversionError(f"dtype: expected one of {OUTPUT_DTYPES}, got {dtype!r}")
    inputs = {"source": source_path} if tokenizer is None else {"source": source_path, "tokenizer": Path(tokenizer)}
    check_output_outside_inputs(out_dir, inputs, command="convert")
    clean_debris(out_dir)
    _check_output_dir(out_dir, overwrite=overwrite)

    progress(f"reading {source_path}")
    checkpoint = _read_source(source_path)
    config = config_for_checkpoint(checkpoint, source=str(source_path))
    progress(f"Needle 3: {config.num_hidden_layers} layers, d={config.hidden_size}, vocab {config.vocab_size} "
             f"(head {config.output_vocab_size} rows); output dtype {dtype}")
    fast_tokenizer = None
    if tokenizer is not None or checkpoint.tokenizer_table is not None:
        progress(f"converting the tokenizer {tokenizer or 'packed in ' + str(source_path)}")
        fast_tokenizer = build_needle3_tokenizer(str(tokenizer) if tokenizer is not None else checkpoint.tokenizer_table,
                                                 model_max_length=config.max_position_embeddings)
        check_vocab_matches(fast_tokenizer, config.vocab_size, source=str(source_path))
    progress("mapping tensors to Hugging Face names")
    state = native_to_hf(checkpoint.flat, config, source=str(source_path))
    checkpoint.flat = None
    model = Needle3ForCausalLM(config).eval()
    model.load_state_dict({name: torch.from_numpy(np.asarray(value, np.float32)) for name, value in state.items()}, strict=True)
    parameters = sum(int(value.size) for value in state.values())
    tensor_count = len(state)
    del state
    tokens = torch.from_numpy(verification_tokens(config))
    with torch.no_grad():
        source_logits = model(tokens, use_cache=False).logits

    config.architectures = ["Needle3ForCausalLM"]
    staging = staging_path(out_dir)
    staging.mkdir()
    try:
        progress(f"writing {parameters:,} parameters")
        model.to(getattr(torch, dtype)).save_pretrained(str(staging))
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(str(staging))
        if fast_tokenizer is not None:
            save_fast_tokenizer(fast_tokenizer, str(staging))
        del model
        progress("verifying: logits of the written folder against the checkpoint's")
        written, info = AutoModelForCausalLM.from_pretrained(str(staging), dtype=torch.float32, output_loading_info=True)
        problems = {kind: names for kind, names in info.items() if names}
        if problems:
            raise Needle3ConversionError(f"{staging}: the written folder does not load exactly: {problems}")
        with torch.no_grad():
            written_logits = written.eval()(tokens, use_cache=False).logits
        diff = float((written_logits - source_logits).abs().max())
        same_argmax = float((written_logits.argmax(-1) == source_logits.argmax(-1)).float().mean())
        if dtype == "float32" and not diff <= FLOAT32_LOGIT_TOLERANCE:
            raise Needle3ConversionError(
                f"verification: the written folder's logits differ from the checkpoint's by {diff:.3g} "
                f"(expected <= {FLOAT32_LOGIT_TOLERANCE})")
        report = {
            "converter": {"name": "needle-hf", "version": needle_hf.__version__},
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": {"file": source_path.name, "format": "needle3-safetensors", "bytes": source_path.stat().st_size,
                       "step": checkpoint.step, "config": checkpoint.native_config},
            "tokenizer": None if tokenizer is None else {"file": Path(tokenizer).name, "pieces": len(fast_tokenizer)},
            "output": {"dtype": dtype, "tensors": tensor_count, "parameters": parameters,
                       "safetensors_bytes": (staging / "model.safetensors").stat().st_size},
            "verification": {"max_abs_logit_diff": diff, "argmax_agreement": same_argmax,
                             "tokens": int(tokens.shape[1])},
            "seconds": round(time.perf_counter() - started, 3),
        }
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2, default=str, allow_nan=False) + "\n", encoding="utf-8")
        publish_folder(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def export_needle3(hf_dir, out_path, *, dtype: Optional[str] = None, overwrite: bool = False, verify: bool = True,
                   progress: Optional[Callable[[str], None]] = None) -> dict:
    """Write the native Needle 3 checkpoint (`.safetensors`, format_version 2, the full config in its
    metadata) of a Hugging Face Needle 3 folder; returns {tensors, parameters, bytes}.

    Args:
        hf_dir: the folder (config.json with model_type "needle3", one model.safetensors).
        out_path: the `.safetensors` file to write (its parent must exist).
        dtype: "float32" (default: float32 for every floating tensor) or "float16".
        overwrite: replace an existing file at `out_path`.
        verify: read the written file back and compare every tensor bit for bit.
    """
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from needle_hf.models.needle3.configuration_needle3 import Needle3Config
    from needle_hf.models.needle3.weight_names_needle3 import hf_to_native

    from .atomic_output import check_output_file, publish_file

    progress = progress or (lambda _: None)
    hf_dir, out_path = Path(hf_dir), Path(out_path).absolute()
    dtype = dtype or "float32"
    if dtype not in ("float32", "float16"):
        raise Needle3ConversionError(f"dtype: expected float32 or float16 for a Needle 3 checkpoint, got {dtype!r}")
    weights = hf_dir / "model.safetensors"
    if not weights.is_file():
        raise Needle3ConversionError(f"{hf_dir}: no model.safetensors (a single-file Needle 3 folder is expected)")
    check_output_file(out_path, {"Hugging Face folder": hf_dir}, command="export", kind=".safetensors",
                      overwrite=overwrite, error=Needle3ConversionError)
    progress(f"reading {hf_dir}")
    config = Needle3Config.from_pretrained(str(hf_dir))
    with safe_open(str(weights), framework="pt") as handle:
        state = {name: handle.get_tensor(name).float().numpy().astype(dtype) for name in handle.keys()}
    flat = hf_to_native(state, config)
    del state
    metadata = {
        "format_version": str(CHECKPOINT_FORMAT_VERSION),
        "config": json.dumps(config.to_needle_config(), allow_nan=False),
        "step": "",
        "run": json.dumps({"exported_by": "needle-hf", "source": str(hf_dir.absolute())}, allow_nan=False),
    }
    staging = staging_path(out_path)
    progress(f"writing {out_path}")
    try:
        save_file(flat, str(staging), metadata=metadata)
        if verify:
            back = load_file(str(staging))
            for name, value in flat.items():
                if name not in back or back[name].dtype != value.dtype or not np.array_equal(back[name], value):
                    raise Needle3ConversionError(f"{staging}: tensor {name} did not read back bit for bit")
        publish_file(staging, out_path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return {"tensors": len(flat), "parameters": sum(int(v.size) for v in flat.values()), "bytes": out_path.stat().st_size}


def is_needle3_folder(path) -> bool:
    """Whether `path` is a folder whose config.json names model_type "needle3"."""
    config = Path(path) / "config.json"
    try:
        fields = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(fields, dict) and fields.get("model_type") == "needle3"
