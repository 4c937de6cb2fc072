"""Hostile `.pkl` checkpoints through the public entry points: `load_native_checkpoint` raises a
`CheckpointFormatError` (or its `UnsafeCheckpointError`) naming the problem, and `needle-hf convert`
exits 1 with one line and leaves nothing on disk.

Each pickle is built the way an attacker would: by an object whose `__reduce__` names an
allow-listed global with hostile arguments, or opcode by opcode.
"""

import pickle
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from needle_hf.cli import main
from needle_hf.conversion.native_checkpoint import CheckpointFormatError, UnsafeCheckpointError, load_native_checkpoint
from needle_reference import TINY_NATIVE_CONFIG, make_native_params
from spm_fixture import FIXTURE_VOCAB_SIZE

CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE)
_RECONSTRUCT = np.ndarray((0,), np.int8).__reduce__()[0]


@pytest.fixture(scope="module")
def params():
    return make_native_params(CONFIG, seed=7, with_heads=False)


class _Reduce:
    """Pickles as `callable(*args)` (then BUILD with `state` when given)."""

    def __init__(self, *reduction):
        self.reduction = reduction

    def __reduce__(self):
        return self.reduction


def _checkpoint(leaf=None, **overrides):
    payload = {"format_version": 2, "params": {"w": np.zeros(2, np.float32) if leaf is None else leaf},
               "config": {}, "step": 0, "run": {}}
    payload.update(overrides)
    return payload


def _write(path: Path, obj=None, *, data: bytes | None = None, protocol=4) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=protocol) if data is None else data)
    return path


def _convert_fails(capsys, source: Path, out: Path, *fragments):
    capsys.readouterr()
    before = sorted(p.name for p in out.parent.iterdir())
    assert main(["convert", str(source), str(out)]) == 1
    captured = capsys.readouterr().err
    err = [line for line in captured.splitlines() if line.startswith("needle-hf convert: error:")]
    assert len(err) == 1 and "Traceback" not in captured, captured
    for fragment in fragments:
        assert fragment in err[0], err[0]
    assert sorted(p.name for p in out.parent.iterdir()) == before  # nothing written, nothing removed


# ------------------------------------------------------------------------------------------------
# Class 1: no memory disclosure through numpy's constructors.

HOSTILE_LEAVES = {
    # ndarray(shape, dtype, buffer, offset) with a negative offset views memory before the buffer.
    "ndarray-negative-offset": (_Reduce(np.ndarray, ((4,), np.dtype("<f4"), b"\0" * 16, -4096)), UnsafeCheckpointError,
                                "numpy.ndarray called directly"),
    "ndarray-huge-offset": (_Reduce(np.ndarray, ((4,), np.dtype("<f4"), b"\0" * 16, 1 << 40)), UnsafeCheckpointError,
                            "numpy.ndarray called directly"),
    # The array state claims more elements than its bytes hold.
    "state-larger-than-data": (_Reduce(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (1 << 20,), np.dtype("f4"), False, b"\0" * 4)),
                               CheckpointFormatError, "needs 4194304 bytes, its data has 4"),
    # A dtype whose pickled state turns it into a subarray of 10^9 floats.
    "subarray-dtype-state": (_Reduce(np.dtype, ("f4", False, True), (3, "<", (np.dtype("f4"), (10**9,)), None, None, 4 * 10**9, 4, 0)),
                             UnsafeCheckpointError, "not the state numpy writes"),
    "object-dtype": (np.array([1, "x"], dtype=object), UnsafeCheckpointError, "Python objects"),
    "structured-dtype": (np.zeros(2, dtype=[("a", "f4"), ("b", "f4")]), UnsafeCheckpointError, "non-numeric dtype"),
    "bytearray-size": (_Reduce(bytearray, (2 * 10**9,)), UnsafeCheckpointError, "bytearray(2000000000) refused"),
    "scalar-short-data": (_Reduce(np.float32(0).__reduce__()[0], (np.dtype("f8"), b"\0")), CheckpointFormatError,
                          "needs 8 bytes, its data has 1"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LEAVES))
def test_hostile_arrays_are_refused_before_any_memory_is_read(case, tmp_path, capsys):
    leaf, error, message = HOSTILE_LEAVES[case]
    path = _write(tmp_path / "model.pkl", _checkpoint(leaf))
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_native_checkpoint(path)
    _convert_fails(capsys, path, tmp_path / "out", str(path), message)


def test_valid_arrays_of_every_protocol_still_load(tmp_path):
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    for protocol in range(6):
        path = _write(tmp_path / f"p{protocol}.pkl", _checkpoint(weights.T, step=np.int64(3)), protocol=protocol)
        ckpt = load_native_checkpoint(path)
        np.testing.assert_array_equal(ckpt.params["w"], weights.T)
        assert ckpt.step == 3


# ------------------------------------------------------------------------------------------------
# Class 2: no allocation beyond what the file holds.

OPCODE_BOMBS = {
    # BINBYTES8 / FRAME / BYTEARRAY8 with a 1 TiB length field.
    "binbytes8-length": (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40), "asks for 1099511627776 bytes"),
    "frame-length": (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40), "asks for 1099511627776 bytes"),
    "bytearray8-length": (b"\x80\x05\x96" + struct.pack("<Q", 1 << 40), "asks for 1099511627776 bytes"),
    # A memo index of 2^32 - 1 (the C unpickler grows an array to it).
    "memo-index": (b"\x80\x02}r\xff\xff\xff\xff.", "missing ['format_version', 'params', 'config']"),
    "long-digits": (b"(dp0\nVa\np1\nL" + b"9" * 100_000 + b"L\ns.", "cannot unpickle"),
}


@pytest.mark.parametrize("case", sorted(OPCODE_BOMBS))
def test_length_fields_and_memo_indices_cannot_make_the_reader_allocate(case, tmp_path):
    data, message = OPCODE_BOMBS[case]
    path = _write(tmp_path / "bomb.pkl", data=data)
    started = time.perf_counter()
    with pytest.raises(CheckpointFormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_native_checkpoint(path)
    assert time.perf_counter() - started < 5


def _shared_lists(levels):
    value = []
    for _ in range(levels):
        value = [value, value]
    return value


def _circular():
    value = []
    value.append(value)
    return value


_DEEP = "@@deep@@"


def _with_deep_run(levels: int) -> bytes:
    """A checkpoint whose run metadata nests `levels` lists deep, written opcode by opcode (pickle.dumps
    itself would recurse): EMPTY_LIST `levels` times, then APPEND `levels - 1` times."""
    data = pickle.dumps(_checkpoint(run={"history": _DEEP}), protocol=2)
    text = b"X" + struct.pack("<I", len(_DEEP)) + _DEEP.encode()
    assert data.count(text) == 1
    return data.replace(text, b"]" * levels + b"a" * (levels - 1))


@pytest.mark.parametrize("run, message", [
    (_shared_lists(40), "more than 1000000 values"),
    (_circular(), "nested deeper than 64 levels (or circular)"),
    (100_000, "nested deeper than 64 levels"),
], ids=["shared-lists", "circular", "deep"])
def test_run_metadata_is_bounded_in_depth_and_size(run, message, tmp_path, capsys):
    if isinstance(run, int):
        path = _write(tmp_path / "model.pkl", data=_with_deep_run(run))
    else:
        path = _write(tmp_path / "model.pkl", _checkpoint(run={"history": run}))
        assert path.stat().st_size < 4096
    with pytest.raises(CheckpointFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_native_checkpoint(path)
    _convert_fails(capsys, path, tmp_path / "out", message)


def test_a_config_with_a_billion_layers_is_refused_at_once(params, tmp_path, capsys):
    path = _write(tmp_path / "model.pkl", _checkpoint(params=params, config=dict(CONFIG, num_layers=10**9)))
    started = time.perf_counter()
    _convert_fails(capsys, path, tmp_path / "out", "num_hidden_layers must be in [1, 16777216], got 1000000000")
    path = _write(tmp_path / "model.pkl", _checkpoint(params=params, config=dict(CONFIG, num_layers=100_000)))
    _convert_fails(capsys, path, tmp_path / "out", "config num_layers 100000, but stack/layers/block/ZCRMSNorm_0/scale "
                   f"holds {CONFIG['num_layers']} layers")
    assert time.perf_counter() - started < 30


# ------------------------------------------------------------------------------------------------
# Class 8: non-finite weights are refused, naming the tensor.


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(params, bad, tmp_path, capsys):
    import copy

    damaged = copy.deepcopy(params)
    kernel = damaged["stack"]["layers"]["block"]["self_attn"]["q_proj"]["kernel"]
    kernel[1, 0, 0] = bad
    path = _write(tmp_path / "model.pkl", _checkpoint(params=damaged, config=CONFIG))
    _convert_fails(capsys, path, tmp_path / "out", "params/stack/layers/block/self_attn/q_proj/kernel: 1 non-finite value")


# ------------------------------------------------------------------------------------------------
# Class 10: protocol 0 and 1 pickles are recognised by content, whatever their name.


@pytest.mark.parametrize("protocol", [0, 1])
def test_old_protocol_pickles_convert_without_a_pkl_name(params, protocol, tmp_path, capsys):
    path = _write(tmp_path / "weights.bin", _checkpoint(params=params, config=CONFIG), protocol=protocol)
    out = tmp_path / "out"
    assert main(["convert", str(path), str(out)]) == 0, capsys.readouterr().err
    assert (out / "model.safetensors").is_file()


def test_run_metadata_of_any_kind_gives_a_valid_report(params, tmp_path, capsys):
    import json

    run = {"loss": float("nan"), "best": float("inf"), "steps": np.int64(3), "lr": np.float32(0.5),
           "shape": (1, 2), "tags": {"a"}, "shared": [[1]] * 3}
    path = _write(tmp_path / "model.pkl", _checkpoint(params=params, config=CONFIG, run=run))
    out = tmp_path / "out"
    assert main(["convert", str(path), str(out)]) == 0, capsys.readouterr().err
    report = json.loads((out / "conversion_report.json").read_text(),
                        parse_constant=lambda name: pytest.fail(f"report holds {name}"))
    assert report["source"]["run"] == {"loss": "nan", "best": "inf", "steps": 3, "lr": 0.5, "shape": [1, 2],
                                       "tags": ["a"], "shared": [[1], [1], [1]]}
