"""The native `.pkl` checkpoint reader (restricted unpickling, validation) and writer."""

import builtins
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from needle_hf.conversion.native_checkpoint import (
    CheckpointFormatError,
    UnsafeCheckpointError,
    is_native_checkpoint,
    load_native_checkpoint,
    write_native_checkpoint,
)
from needle_reference import TINY_NATIVE_CONFIG, make_native_params
from needle_reference import write_native_checkpoint as write_reference_style_checkpoint


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def assert_trees_identical(actual: dict, expected: dict):
    """Same paths, same dtypes, bit-identical values."""
    actual_leaves, expected_leaves = dict(_leaves(actual)), dict(_leaves(expected))
    assert sorted(actual_leaves) == sorted(expected_leaves)
    for path, value in expected_leaves.items():
        got = actual_leaves[path]
        assert isinstance(got, np.ndarray), path
        assert got.dtype == np.asarray(value).dtype, path
        assert got.shape == np.shape(value), path
        np.testing.assert_array_equal(got, np.asarray(value), err_msg="/".join(path))


@pytest.fixture(scope="module")
def tiny_params():
    return make_native_params(TINY_NATIVE_CONFIG, seed=3)


@pytest.fixture(scope="module")
def reference_checkpoint(tiny_params, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pkl"
    write_reference_style_checkpoint(path, tiny_params, TINY_NATIVE_CONFIG, step=12)
    return path


def _dump(path, obj, protocol=pickle.DEFAULT_PROTOCOL):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return path


# ------------------------------------------------------------------------------------------------
# Reading what the reference writes.


def test_loads_reference_written_checkpoint(reference_checkpoint, tiny_params):
    ckpt = load_native_checkpoint(reference_checkpoint)
    assert ckpt.config == TINY_NATIVE_CONFIG
    assert ckpt.config_source == "dict"
    assert ckpt.step == 12
    assert ckpt.run == {"stage": "test"}
    assert_trees_identical(ckpt.params, tiny_params)
    assert is_native_checkpoint(reference_checkpoint)


def test_fp16_checkpoint_from_reference_averaging_keeps_dtype(tiny_params, tmp_path):
    from needle.model.run import average_checkpoints

    other = make_native_params(TINY_NATIVE_CONFIG, seed=4)
    first, second = tmp_path / "a.pkl", tmp_path / "b.pkl"
    write_reference_style_checkpoint(first, tiny_params, TINY_NATIVE_CONFIG, step=10)
    write_reference_style_checkpoint(second, other, TINY_NATIVE_CONFIG, step=20)
    averaged = tmp_path / "avg.pkl"
    average_checkpoints([str(first), str(second)], str(averaged))

    ckpt = load_native_checkpoint(averaged)
    # The reference's own view of the same file (a trusted file, so plain pickle is fine here).
    with open(averaged, "rb") as f:
        expected = pickle.load(f)
    assert_trees_identical(ckpt.params, expected["params"])
    assert {leaf.dtype for _, leaf in _leaves(ckpt.params)} == {np.dtype(np.float16)}
    q_kernel = ckpt.params["stack"]["layers"]["block"]["self_attn"]["q_proj"]["kernel"]
    mean = 0.5 * tiny_params["stack"]["layers"]["block"]["self_attn"]["q_proj"]["kernel"] + 0.5 * other["stack"][
        "layers"]["block"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_allclose(q_kernel.astype(np.float32), mean, rtol=1e-3, atol=1e-4)
    assert ckpt.run["averaged_from"] == [10, 20]


def test_bfloat16_and_pickled_jax_arrays_load_as_numpy(tmp_path):
    import jax.numpy as jnp
    import ml_dtypes

    params = {
        "numpy_bf16": {"kernel": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)},
        "jax_bf16": {"kernel": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)},
        "jax_f32": {"scale": jnp.linspace(0, 1, 5, dtype=jnp.float32)},
        "scalar": np.float32(0.25),
    }
    path = _dump(tmp_path / "mixed.pkl", {"format_version": 2, "params": params, "config": {}, "step": None, "run": None})
    ckpt = load_native_checkpoint(path)
    got = ckpt.params
    assert type(got["jax_bf16"]["kernel"]) is np.ndarray and got["jax_bf16"]["kernel"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["jax_bf16"]["kernel"].astype(np.float32), np.arange(6).reshape(2, 3))
    assert got["numpy_bf16"]["kernel"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["numpy_bf16"]["kernel"], params["numpy_bf16"]["kernel"])
    np.testing.assert_array_equal(got["jax_f32"]["scale"], np.linspace(0, 1, 5, dtype=np.float32))
    assert got["scalar"].shape == () and got["scalar"] == np.float32(0.25)
    assert ckpt.step is None and ckpt.run == {}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickled_config_object_loads_without_importing_needle(tiny_params, tmp_path, monkeypatch, protocol):
    from needle.model.architecture import TransformerConfig

    from needle_hf import NeedleConfig

    native = TransformerConfig(**TINY_NATIVE_CONFIG)
    small = {"embedding": tiny_params["embedding"], "stack": {"final_norm": tiny_params["stack"]["final_norm"]}}
    path = _dump(tmp_path / "object_config.pkl",
                 {"format_version": 2, "params": small, "config": native, "step": np.int64(5), "run": {}}, protocol)
    # Make every import of the reference fail: the reader must not need it.
    for module in ("needle", "needle.model", "needle.model.architecture"):
        monkeypatch.setitem(sys.modules, module, None)
    ckpt = load_native_checkpoint(path)
    assert ckpt.config_source == "TransformerConfig"
    assert ckpt.config == vars(native)
    assert ckpt.step == 5
    assert_trees_identical(ckpt.params, small)
    config = NeedleConfig.from_needle_config(ckpt.config)
    assert (config.hidden_size, config.num_hidden_layers, config.engram_layers) == (64, 3, [0, 2])


# ------------------------------------------------------------------------------------------------
# Writing.


def test_written_checkpoint_loads_in_reference_identically(tiny_params, tmp_path):
    from needle.model.run import load_checkpoint

    path = write_native_checkpoint(tmp_path / "ours.pkl", tiny_params, TINY_NATIVE_CONFIG, step=7, run={"stage": "sft"})
    params, config, run = load_checkpoint(str(path), return_run=True)
    assert_trees_identical(params, tiny_params)
    assert (config.d_model, config.num_layers, config.engram_layers, config.dtype) == (64, 3, (0, 2), "float32")
    assert run == {"stage": "sft"}
    with open(path, "rb") as f:
        raw = pickle.load(f)  # our own file: trusted
    assert sorted(raw) == ["config", "format_version", "params", "run", "step"]
    assert (raw["format_version"], raw["step"], raw["config"]) == (2, 7, TINY_NATIVE_CONFIG)
    ckpt = load_native_checkpoint(path)
    assert_trees_identical(ckpt.params, tiny_params)
    assert (ckpt.step, ckpt.run, ckpt.config) == (7, {"stage": "sft"}, TINY_NATIVE_CONFIG)


def test_writer_stores_jax_arrays_as_numpy_and_keeps_fp16(tmp_path):
    import jax.numpy as jnp

    params = {"a": {"kernel": jnp.ones((2, 3), jnp.float32)}, "b": {"scale": np.full(4, 0.5, np.float16)}}
    path = write_native_checkpoint(tmp_path / "w.pkl", params, {"d_model": 4})
    ckpt = load_native_checkpoint(path)
    assert type(ckpt.params["a"]["kernel"]) is np.ndarray and ckpt.params["a"]["kernel"].dtype == np.float32
    assert ckpt.params["b"]["scale"].dtype == np.float16
    assert b"jax" not in path.read_bytes()


def test_writer_is_atomic(tiny_params, tmp_path, monkeypatch):
    import needle_hf.conversion.native_checkpoint as module

    path = write_native_checkpoint(tmp_path / "ckpt.pkl", tiny_params, TINY_NATIVE_CONFIG, step=1)
    before = path.read_bytes()

    def crash_midway(obj, f, protocol):
        f.write(b"\x80\x04partial")
        raise OSError("disk full")

    monkeypatch.setattr(module.pickle, "dump", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        write_native_checkpoint(path, tiny_params, TINY_NATIVE_CONFIG, step=2)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pkl"]  # no temporary file left behind


# ------------------------------------------------------------------------------------------------
# Malicious pickles: refused before anything runs.


class _Payload:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker):
    return {
        "os.system": _Payload(os.system, (f"touch {marker}",)),
        "builtins.eval": _Payload(builtins.eval, (f"open({str(marker)!r}, 'w').close()",)),
        "builtins.exec": _Payload(builtins.exec, (f"open({str(marker)!r}, 'w').close()",)),
        "subprocess.call": _Payload(subprocess.call, (["touch", str(marker)],)),
    }


@pytest.mark.parametrize("attack", ["os.system", "builtins.eval", "builtins.exec", "subprocess.call"])
@pytest.mark.parametrize("placement", ["top_level", "inside_params"])
def test_malicious_pickle_is_refused_and_does_not_run(tmp_path, attack, placement):
    marker = tmp_path / "pwned"
    payload = _payloads(marker)[attack]
    if placement == "top_level":
        obj = payload
    else:  # hidden in an otherwise well-formed checkpoint
        obj = {"format_version": 2, "params": {"embedding": {"embedding": payload}}, "config": {}, "step": 0, "run": {}}
    path = _dump(tmp_path / "evil.pkl", obj)

    with pytest.raises(UnsafeCheckpointError) as info:
        load_native_checkpoint(path)
    module = {"os.system": "posix.system" if os.name == "posix" else "nt.system"}.get(attack, attack)
    assert module in str(info.value)
    assert not marker.exists()

    # Control: the payload is live, a plain pickle.load would have run it.
    with open(path, "rb") as f:
        pickle.load(f)
    assert marker.exists()


@pytest.mark.parametrize(
    "data, named",
    [
        # Protocol 0 spells globals as text: {'x': os.system('echo pwned')}.
        (b"(dp0\nS'x'\ncos\nsystem\n(S'echo pwned'\ntRs.", "os.system"),
        # A module the allow-list knows, an attribute it does not.
        (b"\x80\x02cnumpy\nload\n.", "numpy.load"),
        # Allowed callables used for something other than a checkpoint value are refused too.
        (b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x06\x00\x00\x00rot_13\x86R.", "_codecs.encode"),
        (b"\x80\x02ccopyreg\n_reconstructor\ncbuiltins\nset\ncbuiltins\nobject\nN\x87R.", "copyreg._reconstructor"),
    ],
    ids=["protocol0-os-system", "numpy-load", "codecs-rot13", "copyreg-foreign-class"],
)
def test_handwritten_hostile_pickles_are_refused(tmp_path, data, named):
    path = tmp_path / "hostile.pkl"
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=named.replace(".", r"\.")):
        load_native_checkpoint(path)


def test_object_arrays_are_refused(tmp_path):
    path = _dump(tmp_path / "objects.pkl", {"format_version": 2, "params": {"w": np.array([1, "x"], dtype=object)},
                                            "config": {}, "step": 0, "run": {}})
    with pytest.raises(UnsafeCheckpointError, match="Python objects"):
        load_native_checkpoint(path)


# ------------------------------------------------------------------------------------------------
# Malformed files.


@pytest.mark.parametrize("version", [1, 3, None, "2"])
def test_wrong_format_version_says_found_and_expected(tiny_params, tmp_path, version):
    path = _dump(tmp_path / "v.pkl", {"format_version": version, "params": tiny_params, "config": {}, "step": 0})
    with pytest.raises(CheckpointFormatError, match=rf"format_version {version!r} found, expected 2"):
        load_native_checkpoint(path)


@pytest.mark.parametrize("keep", [1, 2, 40, 0.5, -1], ids=["1B", "2B", "40B", "half", "all-but-last"])
def test_truncated_file_is_reported(reference_checkpoint, tmp_path, keep):
    data = reference_checkpoint.read_bytes()
    cut = {0.5: len(data) // 2, -1: len(data) - 1}.get(keep, keep)
    path = tmp_path / "cut.pkl"
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointFormatError, match="truncated or corrupt|not a pickle"):
        load_native_checkpoint(path)


def test_garbage_and_empty_files_are_reported(tmp_path):
    rng = np.random.default_rng(0)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"GARBAGE!" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointFormatError, match="not a pickle"):
        load_native_checkpoint(garbage)
    assert not is_native_checkpoint(garbage)

    empty = tmp_path / "empty.pkl"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="empty file"):
        load_native_checkpoint(empty)

    # Random bytes behind a valid protocol header: some error, never a crash or a silent success.
    for seed in range(20):
        noisy = tmp_path / f"noisy{seed}.pkl"
        noisy.write_bytes(b"\x80\x04" + np.random.default_rng(seed).integers(0, 256, 512, dtype=np.uint8).tobytes())
        with pytest.raises(CheckpointFormatError):
            load_native_checkpoint(noisy)


def test_trailing_bytes_are_reported(reference_checkpoint, tmp_path):
    path = tmp_path / "trailing.pkl"
    path.write_bytes(reference_checkpoint.read_bytes() + b"junk")
    with pytest.raises(CheckpointFormatError, match="4 unexpected byte"):
        load_native_checkpoint(path)


@pytest.mark.parametrize(
    "obj, message",
    [
        ([1, 2, 3], "expected a pickled dict, found list"),
        ({"format_version": 2, "config": {}}, r"missing \['params'\]"),
        ({"format_version": 2, "params": [np.zeros(2)], "config": {}}, "params: expected a dict of parameters, got list"),
        ({"format_version": 2, "params": {}, "config": {}}, "params: empty parameter dict"),
        ({"format_version": 2, "params": {"a": {"kernel": "weights"}}, "config": {}}, "params/a/kernel: expected a numpy array, got str"),
        ({"format_version": 2, "params": {"a": {"kernel": np.arange(3)}}, "config": {}},
         "params/a/kernel: expected a floating-point array, got dtype int64"),
        ({"format_version": 2, "params": {"w": np.zeros(2)}, "config": [1]}, "'config' must be a dict"),
        ({"format_version": 2, "params": {"w": np.zeros(2)}, "config": {}, "step": "ten"}, "'step' must be an integer"),
        ({"format_version": 2, "params": {"w": np.zeros(2)}, "config": {}, "run": "stage"}, "'run' must be a dict"),
    ],
    ids=["not-a-dict", "missing-params", "params-list", "params-empty", "leaf-str", "leaf-int", "config-list",
         "step-str", "run-str"],
)
def test_structure_errors_name_the_problem(tmp_path, obj, message):
    path = _dump(tmp_path / "bad.pkl", obj)
    with pytest.raises(CheckpointFormatError, match=message):
        load_native_checkpoint(path)
