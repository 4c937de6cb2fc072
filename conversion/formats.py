"""Recognise a conversion source by its content, not its file name."""

from __future__ import annotations

import enum
import json
import struct
from pathlib import Path

from .cact import CACT_TAG
from .native_checkpoint import looks_like_pickle

# A safetensors file opens with the u64 length of its JSON header, then the header itself.
_SAFETENSORS_LENGTH = struct.Struct("<Q")


class SourceFormat(enum.StrEnum):
    NATIVE_CHECKPOINT = "native-checkpoint"  # the reference's pickled format_version 2 `.pkl`
    CACT = "cact"  # the reference's deployment blob
    SAFETENSORS = "safetensors"  # one HF-named weights file
    HF_DIRECTORY = "hf-directory"  # a saved Hugging Face model folder (config.json beside the weights)


class UnknownSourceFormatError(ValueError):
    """The path is none of the formats in `SourceFormat`."""


def _is_safetensors(header: bytes, file_size: int) -> bool:
    if len(header) < _SAFETENSORS_LENGTH.size + 1:
        return False
    (length,) = _SAFETENSORS_LENGTH.unpack_from(header, 0)
    return header[_SAFETENSORS_LENGTH.size : _SAFETENSORS_LENGTH.size + 1] == b"{" and length <= file_size - 8


def detect_source_format(path) -> SourceFormat:
    """The format of the checkpoint at `path`, judged from its first bytes (or, for a folder, its config.json).

    Raises:
        FileNotFoundError: nothing at `path`.
        UnknownSourceFormatError: the content matches no supported format.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise UnknownSourceFormatError(f"{path} is a folder without config.json, not a saved Hugging Face model")
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UnknownSourceFormatError(f"{config} is not valid JSON ({error})") from None
        return SourceFormat.HF_DIRECTORY
    with open(path, "rb") as f:
        header = f.read(16)
    if header[:4] == struct.pack("<I", CACT_TAG):
        return SourceFormat.CACT
    if looks_like_pickle(header):
        return SourceFormat.NATIVE_CHECKPOINT
    if _is_safetensors(header, path.stat().st_size):
        return SourceFormat.SAFETENSORS
    raise UnknownSourceFormatError(
        f"{path}: unrecognised content (first bytes {header[:8].hex(' ') or 'none: empty file'}); expected a native "
        f"checkpoint (a pickle, protocol >= 2), a .cact blob (tag 0x{CACT_TAG:08X}), a safetensors file or an HF folder"
    )
