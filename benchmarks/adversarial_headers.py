"""Peak memory of reading adversarial inputs: each class of hostile header, at two file sizes.

Every input is a file of a given size whose header (or one field of it) claims far more than the
file holds: a `.pkl` whose opcodes name a terabyte, a memo index of 2^32, a 2 GB bytearray, numpy's
constructor with a wild offset, a subarray dtype of 10^9 floats, a web of shared lists, a config of
10^9 layers; a `.cact` with 10^8 layers, 10^9 records or a CQ group of 65536; a safetensors header
length of 1 TiB or shapes of 10^11 elements; a `tokenizer.json` nested a million levels deep. The
rest of the file is ordinary bulk (an array, zero padding), so that the file size is what a reader
may legitimately spend.

Each read runs in a fresh child process. The child imports the readers and reads a small valid
file first (so lazily loaded code is in place); its RSS at that point is the import floor, and its
peak RSS is reset there (Linux `clear_refs`). Then it reads the adversarial file, which must fail
with the reader's documented error, and reports its peak RSS. The figure is (peak - floor) / file
size; the target is <= 3.

    python benchmarks/adversarial_headers.py [--sizes-mib 1 16]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "support"))
TARGET_RATIO = 3.0
MIB = 1 << 20


class _Reduce:
    def __init__(self, *reduction):
        self.reduction = reduction

    def __reduce__(self):
        return self.reduction


def _checkpoint(size: int, **extra) -> dict:
    payload = {"format_version": 2, "params": {"w": np.zeros(size // 4, np.float32)}, "config": {}, "step": 0, "run": {}}
    payload.update(extra)
    return payload


def _pkl_with_tail(size: int, tail: bytes) -> bytes:
    """A pickled dict of `size` bytes whose final STOP is replaced by `tail`."""
    data = pickle.dumps({"format_version": 2, "pad": b"\0" * size}, protocol=4)
    return data[:-1] + tail


def _shared_lists(levels=40):
    value = []
    for _ in range(levels):
        value = [value, value]
    return value


def _cact(size: int, patch) -> bytes:
    from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config
    from needle.model.export import write_export

    params = make_native_params(TINY_NATIVE_CONFIG, seed=0, with_heads=False)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "seed.cact")
        write_export(params, reference_config(TINY_NATIVE_CONFIG), path, bits=4)
        with open(path, "rb") as handle:
            data = bytearray(handle.read())
    patch(data)
    return bytes(data) + b"\0" * max(0, size - len(data))


def _safetensors(size: int, header: dict | None = None, length: int | None = None) -> bytes:
    header = header or {"__metadata__": {"format": "pt"},
                        "model.norm.weight": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size // 4 * 4]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + b"\0" * size


def _cases(size: int) -> dict[str, tuple[str, bytes]]:
    """name -> (reader, file content)."""
    u32 = lambda position, value: lambda data: struct.pack_into("<I", data, position, value)  # noqa: E731
    record0 = 120 + 4 * 28
    shapes = {"__metadata__": {"format": "pt"},
              "model.norm.weight": {"dtype": "F32", "shape": [10**11], "data_offsets": [0, 4 * 10**11]}}
    return {
        "pkl ndarray(offset=-4096)": ("pkl", pickle.dumps(_checkpoint(size, run={"x": _Reduce(
            np.ndarray, ((4,), np.dtype("<f4"), b"\0" * 16, -4096))}), protocol=4)),
        "pkl BINBYTES8 of 1 TiB": ("pkl", _pkl_with_tail(size, b"\x8e" + struct.pack("<Q", 1 << 40))),
        "pkl BYTEARRAY8 of 1 TiB": ("pkl", b"\x80\x05" + _pkl_with_tail(size, b"\x96" + struct.pack("<Q", 1 << 40))[2:]),
        "pkl memo index 2^32-1": ("pkl", _pkl_with_tail(size, b"r\xff\xff\xff\xff.")),
        "pkl bytearray(2e9)": ("pkl", pickle.dumps(_checkpoint(size, run={"x": _Reduce(bytearray, (2 * 10**9,))}), protocol=4)),
        "pkl subarray dtype 1e9": ("pkl", pickle.dumps(_checkpoint(size, run={"x": _Reduce(
            np.dtype, ("f4", False, True), (3, "<", (np.dtype("f4"), (10**9,)), None, None, 4 * 10**9, 4, 0))}), protocol=4)),
        "pkl shared lists 2^40": ("pkl", pickle.dumps(_checkpoint(size, run={"x": _shared_lists()}), protocol=4)),
        "pkl config num_layers 1e9": ("convert", pickle.dumps(_checkpoint(size, config={"num_layers": 10**9}), protocol=4)),
        "cact num_layers 1e8": ("cact", _cact(size, u32(4 * 9, 10**8))),
        "cact num_tensors 1e9": ("cact", _cact(size, u32(4 * 1, 10**9))),
        "cact CQ group 65536": ("cact", _cact(size, u32(record0 + 36, 65536))),
        "safetensors header length 1 TiB": ("safetensors", _safetensors(size, length=1 << 40)),
        "safetensors shape 1e11": ("safetensors", _safetensors(size, header=shapes)),
        "tokenizer.json nested 1e6 deep": ("tokenizer", b'{"model": ' + b"[" * (size // 2) + b"]" * (size // 2) + b"}"),
    }


# --------------------------------------------------------------------------------------------------
# The child: import, warm up on valid input, then read the adversarial file.


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak():
    """Start the peak RSS (VmHWM) afresh from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _child(reader: str, path: str, valid_dir: str) -> dict:
    from needle_hf.conversion.cact import CactFormatError, read_cact
    from needle_hf.conversion.convert import ConversionError, convert
    from needle_hf.conversion.export import ExportError, read_hf_tensors
    from needle_hf.conversion.native_checkpoint import CheckpointFormatError, load_native_checkpoint
    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.tokenization_needle import TokenizerSourceError, read_tokenizer_file

    config = NeedleConfig(num_hidden_layers=2, engram_layers=[0])
    out = os.path.join(valid_dir, "out")
    readers = {
        "pkl": lambda p: load_native_checkpoint(p),
        "convert": lambda p: convert(p, out),
        "cact": lambda p: read_cact(p),
        "safetensors": lambda p: read_hf_tensors(os.path.dirname(p), config),
        "tokenizer": lambda p: read_tokenizer_file(p),
    }
    documented = (CheckpointFormatError, ConversionError, CactFormatError, ExportError, TokenizerSourceError, ValueError)
    warm = os.path.join(valid_dir, "warm.pkl")
    load_native_checkpoint(warm)
    for name in ("model.safetensors", "tokenizer.json"):
        try:
            readers["safetensors" if name.endswith("safetensors") else "tokenizer"](os.path.join(valid_dir, "warm", name))
        except documented:
            pass
    _reset_peak()
    floor = _status_bytes("VmRSS")
    try:
        readers[reader](path)
        outcome = "accepted"
    except documented as error:
        outcome = f"{type(error).__name__}: {str(error)[:90]}"
    except MemoryError:
        outcome = "MemoryError"
    return {"floor": floor, "peak": _status_bytes("VmHWM"), "outcome": outcome, "debris": sorted(os.listdir(valid_dir))}


def _prepare_warm(folder: str):
    from needle_hf.conversion.native_checkpoint import write_native_checkpoint

    write_native_checkpoint(os.path.join(folder, "warm.pkl"), {"w": np.zeros(4, np.float32)}, {})
    warm = os.path.join(folder, "warm")
    os.makedirs(warm)
    with open(os.path.join(warm, "model.safetensors"), "wb") as handle:
        handle.write(_safetensors(64))
    with open(os.path.join(warm, "tokenizer.json"), "w") as handle:
        handle.write('{"model": {}}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--child", nargs=3, metavar=("READER", "PATH", "VALID_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    print(f"{'adversarial input':36s} {'file MiB':>8s} {'floor MiB':>9s} {'peak-floor MiB':>14s} {'ratio':>6s}  outcome")
    worst = 0.0
    failures = []
    for size_mib in args.sizes_mib:
        for name, (reader, content) in _cases(size_mib * MIB).items():
            with tempfile.TemporaryDirectory() as scratch:
                _prepare_warm(scratch)
                folder = os.path.join(scratch, "input")
                os.makedirs(folder)
                file_name = {"safetensors": "model.safetensors", "tokenizer": "tokenizer.json", "cact": "model.cact"}.get(reader, "model.pkl")
                path = os.path.join(folder, file_name)
                with open(path, "wb") as handle:
                    handle.write(content)
                before = sorted(os.listdir(scratch))
                child = subprocess.run([sys.executable, __file__, "--child", reader, path, scratch],
                                       capture_output=True, text=True, timeout=600)
                if child.returncode != 0:
                    failures.append(f"{name}: child exited {child.returncode}: {child.stderr[-300:]}")
                    continue
                result = json.loads(child.stdout.strip().splitlines()[-1])
                size = os.path.getsize(path)
                ratio = (result["peak"] - result["floor"]) / size
                worst = max(worst, ratio)
                print(f"{name:36s} {size / MIB:8.1f} {result['floor'] / MIB:9.1f} "
                      f"{(result['peak'] - result['floor']) / MIB:14.2f} {ratio:6.2f}  {result['outcome'][:70]}", flush=True)
                if result["outcome"] in ("accepted", "MemoryError") or ratio > TARGET_RATIO:
                    failures.append(f"{name} ({size_mib} MiB): {result['outcome']}, ratio {ratio:.2f}")
                if result["debris"] != before:
                    failures.append(f"{name}: left {sorted(set(result['debris']) - set(before))}")
    print(f"worst (peak RSS - import floor) / file size: {worst:.2f} (target <= {TARGET_RATIO})")
    for failure in failures:
        print("FAILED", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
