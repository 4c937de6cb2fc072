"""`needle-hf export`: a Hugging Face Needle folder -> a native format_version 2 checkpoint (`.pkl`).

The way back for weights fine-tuned in HF: the result is what the reference's `load_checkpoint`
reads and what its `.cact` exporter (`needle build`) accepts. Steps, each strict:

1. `config.json` must describe a Needle 2 model (`model_type` "needle2").
2. The safetensors header(s) (`model.safetensors`, or the shards an index lists) must hold exactly
   the tensors the key table implies for that config, with their shapes: a missing, unknown or
   mis-shaped tensor is an error naming it, found before any tensor data is read.
3. `hf_to_native` re-stacks the layers and transposes the weights back to `(in, out)` kernels.
4. The checkpoint `{"format_version": 2, "params", "config": config.to_needle_config(), "step": None,
   "run": {...}}` is written atomically; with `verify`, it is read back (with the safe reader) and
   every leaf compared bit for bit.

Tensor dtypes are kept as stored unless `dtype` asks for another one. The native config holds every
geometry field plus the deployment metadata (kv_window, kv_bits, act_bits, weight_bits); it has no
`dtype` field, so the reference computes in its default (bfloat16) unless told otherwise.

This module also holds the small helpers both directions use to read HF folders.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import needle_hf
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.weight_names import check_hf_weights, hf_to_native

from .atomic_output import check_output_file, check_output_outside_inputs, errors_name, publish_file, staging_path
from .native_checkpoint import load_native_checkpoint, write_native_checkpoint

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
OUTPUT_DTYPES = ("float32", "bfloat16", "float16")

Progress = Callable[[str], None]


class ExportError(ValueError):
    """The folder cannot be exported to a native checkpoint; the message says why."""


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an output dtype name (bfloat16 through `ml_dtypes`)."""
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {', '.join(OUTPUT_DTYPES)}")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def read_hf_config(folder: Path) -> NeedleConfig:
    """The `NeedleConfig` of an HF folder, refusing other model types."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{folder}: no config.json; expected a saved Hugging Face Needle folder")
    try:
        fields = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ExportError(f"{config_path}: not valid JSON ({type(error).__name__}: {str(error)[:80]})") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type != NeedleConfig.model_type:
        raise ExportError(f"{config_path}: model_type {str(model_type)[:40]!r}, expected {NeedleConfig.model_type!r} (Needle 2)")
    try:
        return NeedleConfig.from_pretrained(str(folder))
    except (ValueError, TypeError) as error:
        raise ExportError(f"{config_path}: {error}") from None


def _index_shards(index: Path) -> list[str]:
    """The shard file names an index lists, each a plain file name inside the folder."""
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ExportError(f"{index}: not valid JSON ({type(error).__name__}: {str(error)[:80]})") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(f"{index}: expected a JSON object with a non-empty 'weight_map' of tensor -> shard file")
    shards = set()
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or shard != Path(shard).name or shard in (".", ".."):
            raise ExportError(
                f"{index}: tensor {tensor[:80]} maps to {str(shard)[:80]!r}; expected a file name inside the folder "
                "(no folders, no '..')"
            )
        shards.add(shard)
    return sorted(shards)


def weight_files(folder: Path) -> list[Path]:
    """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
    single, index = folder / SAFETENSORS_NAME, folder / SAFETENSORS_INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        shards = _index_shards(index)
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ExportError(f"{index}: lists shards {shards}, of which {missing} are missing")
        return [folder / name for name in shards]
    raise ExportError(f"{folder}: no {SAFETENSORS_NAME} (or {SAFETENSORS_INDEX_NAME}); expected PyTorch-layout weights")


# Tensor dtypes a Needle folder stores its weights in (safetensors tags).
FLOAT_SAFETENSORS_DTYPES = ("F32", "F16", "BF16")


@contextlib.contextmanager
def open_safetensors(path: Path):
    """`safe_open(path)` for numpy, with a malformed file reported as an `ExportError` naming it."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safe_open needs for BF16 tensors)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            yield handle
    except SafetensorError as error:
        raise ExportError(f"{path}: not a readable safetensors file ({error})") from None


def safetensors_layout(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """(tensor name -> shape, tensor name -> file) from the headers of `files`; each tensor must be a
    float tensor, stored once, in a file whose metadata says PyTorch layout."""
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, Path] = {}
    for path in files:
        with open_safetensors(path) as handle:
            layout = (handle.metadata() or {}).get("format")
            if layout != "pt":
                raise ExportError(
                    f"{path}: metadata format {layout!r}, expected 'pt' (PyTorch layout, as save_pretrained writes it)"
                )
            for name in handle.keys():
                if name in shapes:
                    raise ExportError(f"tensor {name} is stored twice, in {owner[name].name} and {path.name}")
                tensor = handle.get_slice(name)
                if tensor.get_dtype() not in FLOAT_SAFETENSORS_DTYPES:
                    raise ExportError(f"{path}: tensor {name}: dtype {tensor.get_dtype()}, expected one of "
                                      f"{', '.join(FLOAT_SAFETENSORS_DTYPES)}")
                shapes[name], owner[name] = tuple(tensor.get_shape()), path
    return shapes, owner


def read_hf_tensors(folder, config: NeedleConfig) -> dict[str, np.ndarray]:
    """Every tensor of an HF folder as numpy arrays, after checking all names and shapes against `config`."""
    folder = Path(folder)
    files = weight_files(folder)
    shapes, _ = safetensors_layout(files)
    check_hf_weights(shapes, config, where=str(folder))
    tensors = {}
    for path in files:
        with open_safetensors(path) as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def _leaves(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _check_read_back(path: Path, written: dict):
    loaded = dict(_leaves(load_native_checkpoint(path).params))
    expected = dict(_leaves(written))
    if sorted(loaded) != sorted(expected):
        raise ExportError(f"{path}: read back with {len(loaded)} leaves, wrote {len(expected)}")
    for leaf, want in expected.items():
        got = loaded[leaf]
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(
            got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
        ):
            raise ExportError(f"{path}: leaf {'/'.join(leaf)} does not read back bit-exactly")


@dataclass
class ExportResult:
    out_path: Path
    tensors: int
    parameters: int
    bytes: int
    seconds: float

    def summary(self) -> str:
        return (
            f"wrote {self.out_path}: {self.tensors} tensors, {self.parameters:,} parameters, "
            f"{self.bytes:,} bytes, {self.seconds:.1f} s"
        )


def export_native(
    hf_dir,
    out_path,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the native format_version 2 checkpoint of an HF Needle folder (see the module docstring).

    Args:
        hf_dir: the HF folder (config.json + model.safetensors).
        out_path: the `.pkl` to write (its parent must exist).
        dtype: cast every tensor to "float32", "bfloat16" or "float16"; default: keep the stored dtypes.
        overwrite: replace an existing file at `out_path`.
        verify: read the written checkpoint back and compare every leaf.
        progress: called with one line per step.
    """
    started = time.perf_counter()
    progress = progress or (lambda _: None)
    hf_dir, out_path = Path(hf_dir), Path(out_path).absolute()
    if not hf_dir.is_dir():
        raise ExportError(f"{hf_dir} is not a folder; expected a saved Hugging Face Needle folder")
    from .needle3 import export_needle3, is_needle3_folder

    if is_needle3_folder(hf_dir):  # Needle 3 goes back to its own format, a .safetensors checkpoint
        facts = export_needle3(hf_dir, out_path, dtype=dtype, overwrite=overwrite, verify=verify, progress=progress)
        return ExportResult(out_path, facts["tensors"], facts["parameters"], facts["bytes"], time.perf_counter() - started)
    inputs = {"Hugging Face folder": hf_dir}
    check_output_file(out_path, inputs, command="export", kind=".pkl", overwrite=overwrite, error=ExportError)
    cast_to = None if dtype is None else numpy_dtype(dtype)

    progress(f"reading {hf_dir}")
    config = read_hf_config(hf_dir)
    tensors = read_hf_tensors(hf_dir, config)
    if cast_to is not None:
        tensors = {name: value.astype(cast_to) for name, value in tensors.items()}
    count, parameters = len(tensors), sum(int(value.size) for value in tensors.values())
    progress(f"re-stacking {count} tensors into the native tree")
    params = hf_to_native(tensors, config)
    del tensors
    run = {"exported_by": f"needle-hf {needle_hf.__version__}", "source": str(hf_dir.absolute())}
    # Written under a temporary name beside the target and moved over it once read back, so a
    # failure leaves neither a partial file nor a replaced one.
    staging = staging_path(out_path)
    progress(f"writing {out_path}")
    try:
        with errors_name(out_path, staging):
            check_output_outside_inputs(out_path, inputs, command="export")
            write_native_checkpoint(staging, params, config.to_needle_config(), step=None, run=run)
            if verify:
                progress("verifying: reading the checkpoint back")
                _check_read_back(staging, params)
            publish_file(staging, out_path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return ExportResult(out_path, count, parameters, out_path.stat().st_size, time.perf_counter() - started)
