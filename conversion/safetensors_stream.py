"""Writing a `.safetensors` file tensor by tensor, and checking it back byte for byte, in bounded memory.

`safetensors.numpy.save_file` first serialises every tensor into one in-memory buffer, and reading
a file back through `safe_open` maps it, so each would hold a second copy of the model (the mapped
pages count as the process's resident memory). The converter instead writes the header, then each
tensor's bytes in turn (a non-contiguous view is made contiguous one tensor at a time), and compares
the file with the tensors by plain reads of one tensor at a time. The header layout is the format's:
an 8-byte little-endian header length, a JSON header (padded with spaces to 8 bytes) mapping each name
to its dtype, shape and `[begin, end)` data offsets, plus `__metadata__`; then the data, back to back.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# numpy dtype name -> safetensors dtype tag (bfloat16 is ml_dtypes' numpy dtype).
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
HEADER_ALIGNMENT = 8


class SafetensorsMismatchError(ValueError):
    """A written file does not hold the tensors it should; the message names the tensor."""


def _layout(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """(header bytes with its length prefix, tensor names in data order)."""
    names = sorted(tensors)
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        tensor = tensors[name]
        if tensor.dtype.name not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} has no safetensors equivalent")
        size = tensor.size * tensor.dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype.name], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text, names


def _tensor_bytes(tensor: np.ndarray) -> memoryview:
    """The tensor's data, C order, as bytes (a copy only when the array is a non-contiguous view)."""
    return memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8))


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], *, metadata: dict[str, str]) -> int:
    """Write `tensors` (in name order) to `path`; returns the file size in bytes."""
    header, names = _layout(tensors, metadata)
    with open(path, "wb") as handle:
        handle.write(header)
        for name in names:
            handle.write(_tensor_bytes(tensors[name]))
    return Path(path).stat().st_size


def check_safetensors_bytes(path: Path, tensors: dict[str, np.ndarray], *, metadata: dict[str, str]):
    """Raise `SafetensorsMismatchError` unless `path` holds exactly `tensors` (names, dtypes, shapes,
    bytes) and `metadata`, laid out as `write_safetensors` lays them out."""
    header, names = _layout(tensors, metadata)
    with open(path, "rb") as handle:
        if handle.read(len(header)) != header:
            raise SafetensorsMismatchError(f"{path}: the header does not list the expected tensors, dtypes and shapes")
        for name in names:
            want = _tensor_bytes(tensors[name])
            if handle.read(len(want)) != want:
                raise SafetensorsMismatchError(f"{path}: tensor {name} does not read back bit-exactly")
        if handle.read(1):
            raise SafetensorsMismatchError(f"{path}: unexpected bytes after the last tensor")
