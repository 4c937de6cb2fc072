"""Converters between Needle 2's native formats (reference `.pkl` checkpoints, `.cact` deployment
blobs) and the Hugging Face layout. Imported as `needle_hf.conversion`.

The file-format modules (`native_checkpoint`, `cact`, `formats`) use only numpy and
`needle_hf.models.needle.numerics`; they never import the reference, jax or torch."""

from .cact import CactFormatError, CactGeometry, CactModel, CactRecord, is_cact, read_cact, read_cact_tensors
from .formats import SourceFormat, UnknownSourceFormatError, detect_source_format
from .native_checkpoint import (
    CheckpointFormatError,
    NativeCheckpoint,
    UnsafeCheckpointError,
    is_native_checkpoint,
    load_native_checkpoint,
    write_native_checkpoint,
)

__all__ = [
    "CactFormatError",
    "CactGeometry",
    "CactModel",
    "CactRecord",
    "CheckpointFormatError",
    "NativeCheckpoint",
    "SourceFormat",
    "UnknownSourceFormatError",
    "UnsafeCheckpointError",
    "detect_source_format",
    "is_cact",
    "is_native_checkpoint",
    "load_native_checkpoint",
    "read_cact",
    "read_cact_tensors",
    "write_native_checkpoint",
]
