"""Outputs that never destroy inputs, survive a kill, and bad folders, blobs and configs reported in one line.

Through the public entry points: `needle-hf convert/export` exit 1 with one `error:` line naming the
file, tensor or field (expected vs found) and leave the disk as it was; the Python API raises the
documented exception types.
"""

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from needle_hf.cli import main
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.conversion.atomic_output import clean_debris
from needle_hf.conversion.cact import CactFormatError, read_cact

# The tiny checkpoint, its HF folder and its .cact, as the CLI tests make them.
from test_cli import blob, checkpoint, hf_folder, params  # noqa: E402,F401  (fixtures)

CACT_HEADER_BYTES, CACT_CODEBOOK_FLOATS = 120, 28


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _fails(capsys, command, argv, *fragments, untouched: Path):
    """Exit 1, one error line holding every fragment, no traceback, and `untouched` exactly as before."""
    before = _tree(untouched)
    capsys.readouterr()
    assert main([command, *map(str, argv)]) == 1
    captured = capsys.readouterr().err
    lines = [line for line in captured.splitlines() if line.startswith(f"needle-hf {command}: error:")]
    assert len(lines) == 1 and "Traceback" not in captured, captured
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert _tree(untouched) == before
    return lines[0]


# ------------------------------------------------------------------------------------------------
# Class 3: an output never equals, contains or lies inside an input.


def test_convert_into_the_folder_of_its_source_is_refused(checkpoint, tmp_path, capsys):
    folder = tmp_path / "dir"
    folder.mkdir()
    source = shutil.copy(checkpoint, folder / "m.pkl")
    _fails(capsys, "convert", [source, folder, "--overwrite"], f"{folder} contains the source {source}", untouched=tmp_path)
    _fails(capsys, "convert", [source, source, "--overwrite"], "is the source", untouched=tmp_path)


def test_convert_with_a_tokenizer_inside_out_dir_is_refused(checkpoint, needle_spm_model, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    tokenizer = shutil.copy(needle_spm_model, out / "tokenizer.model")
    _fails(capsys, "convert", [checkpoint, out, "--tokenizer", tokenizer, "--overwrite"],
           f"{out} contains the tokenizer {tokenizer}", untouched=tmp_path)


def test_export_over_a_file_of_its_folder_is_refused(hf_folder, tmp_path, capsys):
    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    _fails(capsys, "export", [folder, folder / "model.safetensors", "--overwrite"],
           "lies inside the Hugging Face folder", untouched=tmp_path)


# ------------------------------------------------------------------------------------------------
# Class 4: a kill at any point leaves the old or the new folder, and the next run cleans up.

_KILLED_PUBLISH = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from needle_hf.conversion import atomic_output

    staging, target, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if point == "after-exchange":
        atomic_output._remove = lambda path: os._exit(9)
    else:  # between the two renames of the fallback
        atomic_output._exchange = lambda first, second: False
        real_rename = os.rename
        def rename(source, destination):
            if Path(source) == staging:
                os._exit(9)
            real_rename(source, destination)
        os.rename = rename
    atomic_output.publish_folder(staging, target)
""")


@pytest.mark.parametrize("point, survivor", [("after-exchange", "new"), ("between-renames", "old")])
def test_a_killed_replace_is_recovered_by_the_next_run(point, survivor, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "which").write_text("old")
    # The staging folder as a killed run leaves it: named after a process that is gone.
    staging = target.with_name(f".out.partial-{_dead_pid()}-0123abcd")
    staging.mkdir()
    (staging / "which").write_text("new")
    child = subprocess.run([sys.executable, "-c", _KILLED_PUBLISH, str(staging), str(target), point], check=False)
    assert child.returncode == 9
    clean_debris(target)
    assert (target / "which").read_text() == survivor
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_convert_cleans_what_a_killed_run_left_and_keeps_the_usual_permissions(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    hidden_old = tmp_path / f".out.previous-{_dead_pid()}-0123abcd"
    hidden_old.mkdir()
    (hidden_old / "config.json").write_text("{}")
    stale = tmp_path / f".out.partial-{_dead_pid()}-4567cdef"
    stale.mkdir()
    # A run that fails still puts the hidden folder back and removes the stale one.
    _fails(capsys, "convert", [checkpoint, out], "exists and is not empty", untouched=checkpoint.parent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "config.json").read_text() == "{}"
    assert main(["convert", str(checkpoint), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


# ------------------------------------------------------------------------------------------------
# Class 2 and 8: .cact headers sized far beyond the file, and a count one short.


def _patched(data: bytes, position: int, fmt: str, value) -> bytes:
    buffer = bytearray(data)
    struct.pack_into(fmt, buffer, position, value)
    return bytes(buffer)


@pytest.mark.parametrize("position, fmt, value, message", [
    (4 * 9, "<I", 10**8, "num_layers is 100000000, expected 1..16777216"),
    (4 * 9, "<I", 10**6, "header says"),
    (4 * 1, "<I", 10**9, "truncated: the directory of 1000000000 records"),
    (CACT_HEADER_BYTES + 4 * CACT_CODEBOOK_FLOATS + 36, "<I", 65536, "CQ group size 65536, expected a power of two in 8..1024"),
], ids=["layers-1e8", "layers-1e6", "tensors-1e9", "group-65536"])
def test_cact_headers_cannot_make_the_reader_allocate(blob, position, fmt, value, message, tmp_path, capsys):
    damaged = tmp_path / "model.cact"
    damaged.write_bytes(_patched(blob.read_bytes(), position, fmt, value))
    started = time.perf_counter()
    with pytest.raises(CactFormatError, match=message.replace(".", r"\.")):
        read_cact(damaged)
    assert time.perf_counter() - started < 5
    _fails(capsys, "convert", [damaged, tmp_path / "out"], str(damaged), message, untouched=tmp_path)


# ------------------------------------------------------------------------------------------------
# Class 7 and 8: malformed HF folders on export, and config fields.


def _break_weights(folder: Path, problem: str):
    weights = folder / "model.safetensors"
    if problem == "garbage":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    elif problem == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif problem == "int32-tensor":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(weights))
        tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
        save_file(tensors, str(weights), metadata={"format": "pt"})
    elif problem in ("index-garbage", "index-traversal"):
        weights.rename(folder.parent / "outside.safetensors")
        names = ["model.norm.weight"]
        index = '{"weight_map": ' if problem == "index-garbage" else json.dumps(
            {"metadata": {}, "weight_map": {name: "../outside.safetensors" for name in names}})
        (folder / "model.safetensors.index.json").write_text(index)


@pytest.mark.parametrize("problem, message", [
    ("garbage", "model.safetensors: not a readable safetensors file"),
    ("truncated", "model.safetensors: not a readable safetensors file"),
    ("int32-tensor", "tensor model.norm.weight: dtype I32, expected one of F32, F16, BF16"),
    ("index-garbage", "model.safetensors.index.json: not valid JSON"),
    ("index-traversal", "maps to '../outside.safetensors'; expected a file name inside the folder"),
])
def test_export_reports_malformed_weights_in_one_line(hf_folder, problem, message, tmp_path, capsys):
    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    _break_weights(folder, problem)
    _fails(capsys, "export", [folder, tmp_path / "out.pkl"], message, untouched=tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("rope_theta", float("nan"), "rope_theta must be a finite positive number, got nan"),
    ("rope_theta", float("inf"), "rope_theta must be a finite positive number, got inf"),
    ("vocab_size", 800.9, "vocab_size must be an integer, got 800.9"),
    ("kv_bits", -4, "kv_bits must be in [1, 16777216], got -4"),
    ("kv_window", -1, "kv_window must be in [0, 16777216], got -1"),
    ("pad_token_id", -1, "pad_token_id must be in [0, "),
    ("num_hidden_layers", None, "num_hidden_layers must be an integer, got None"),
    ("hidden_size", [512], "hidden_size must be an integer, got [512]"),
    ("num_attention_heads", "abc", "num_attention_heads must be an integer, got 'abc'"),
    ("engram_orders", "23", "engram_orders must be a list of at most 64 integers"),
])
def test_config_fields_are_validated(hf_folder, field, value, message, tmp_path, capsys):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        NeedleConfig(**{field: value})
    folder = Path(shutil.copytree(hf_folder, tmp_path / "hf"))
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    _fails(capsys, "export", [folder, tmp_path / "out.pkl"], "config.json", message, untouched=tmp_path)


def test_saved_config_is_always_valid_json(tmp_path):
    config = NeedleConfig(num_hidden_layers=2, engram_layers=[0], rope_theta=1e4)
    config.save_pretrained(tmp_path)
    json.loads((tmp_path / "config.json").read_text(), parse_constant=lambda name: pytest.fail(f"config.json holds {name}"))
    assert math.isfinite(config.rope_theta)
