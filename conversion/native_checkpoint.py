"""Native Needle 2 checkpoints (`.pkl`, format_version 2): a safe reader and a writer.

The reference saves a checkpoint as one pickled dict::

    {"format_version": 2, "params": <nested dict of arrays>, "config": <dict>, "step": int | None,
     "run": dict | None}

`params` is the Flax parameter tree (see `needle_hf.weight_names`), its leaves numpy arrays
(float32, or float16 when the reference averaged checkpoints, or bfloat16 from `ml_dtypes`).
`config` holds the overridden `TransformerConfig` fields; some checkpoints pickle the
`TransformerConfig` instance itself instead of a dict.

A pickle is a program: a plain `pickle.load` of an untrusted file can run any code. The reader
below therefore unpickles with an allow-list. It admits only the callables that rebuild what a
checkpoint holds, each wrapped so that it can only do that:

- numpy arrays, scalars and dtypes (`numpy[._]core.multiarray._reconstruct`, `...scalar`,
  `numpy[._]core.numeric._frombuffer` for protocol 5, `numpy.ndarray`, `numpy.dtype`);
- `ml_dtypes.bfloat16` (the dtype of bfloat16 jax/numpy arrays);
- `jax._src.array._reconstruct_array` (how a pickled jax array rebuilds itself from a numpy
  array), rebuilt here as the plain numpy array without importing jax;
- `needle.model.architecture.TransformerConfig`, mapped to a stand-in that only collects the
  instance's saved fields (the reference is never imported);
- `_codecs.encode` for latin-1 text (how protocols 0-2 spell `bytes`) and `copyreg._reconstructor`
  for the stand-in (how protocols 0-1 spell a plain object).

Anything else raises `UnsafeCheckpointError` naming the module and attribute, before it is called.
"""

from __future__ import annotations

import math
import os
import pickle
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

NATIVE_FORMAT_VERSION = 2
# Written with protocol 4: what the reference's `pickle.dump` produces on Python 3.8-3.13, and
# readable by every Python 3 that can run the reference.
WRITE_PROTOCOL = 4
REQUIRED_KEYS = ("format_version", "params", "config")
# How the reference's config class is spelled inside a pickle.
NEEDLE_CONFIG_GLOBAL = ("needle.model.architecture", "TransformerConfig")


class CheckpointFormatError(ValueError):
    """The file is not a readable native Needle 2 checkpoint; the message says what is wrong and where."""


class UnsafeCheckpointError(CheckpointFormatError):
    """The pickle references a global outside the allow-list (it could run code); nothing was called."""


@dataclass
class NativeCheckpoint:
    """A loaded native checkpoint.

    Attributes:
        params: the Flax parameter tree, nested dicts of numpy arrays (dtypes as stored).
        config: the saved config fields as a dict (only the overridden ones; resolve against the
            reference defaults, e.g. with `NeedleConfig.from_needle_config`).
        step: training step, or None.
        run: the run metadata dict (empty when the checkpoint has none).
        config_source: "dict", or "TransformerConfig" when the checkpoint pickled the config object.
    """

    params: dict
    config: dict
    step: int | None = None
    run: dict = field(default_factory=dict)
    config_source: str = "dict"


# --------------------------------------------------------------------------------------------------
# The allow-list. Each entry rebuilds one kind of checkpoint value and refuses anything else.


class _SavedTransformerConfig:
    """Stand-in for the reference's `TransformerConfig` while unpickling: keeps the saved fields only."""

    def __setstate__(self, state):
        # A dataclass instance pickles its `__dict__`; (dict, slots) is the form with __slots__.
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointFormatError(
                f"pickled TransformerConfig has state of type {type(state).__name__}, expected a dict of fields"
            )
        self.fields = dict(state)


# numpy's own reconstruction functions, found through the objects they rebuild rather than by
# their private module path (numpy 1.x calls it `numpy.core`, numpy 2.x `numpy._core`).
_NUMPY_RECONSTRUCT = np.ndarray((0,), np.int8).__reduce__()[0]
_NUMPY_SCALAR = np.float32(0).__reduce__()[0]
_NUMPY_FROMBUFFER = np.zeros(1, np.float32).__reduce_ex__(5)[0]


def _check_dtype(dtype: np.dtype) -> np.dtype:
    if dtype.hasobject:
        raise UnsafeCheckpointError(f"checkpoint holds an array of Python objects (dtype {dtype}); parameters are numeric")
    return dtype


def _make_dtype(spec, align=False, copy=False):
    return _check_dtype(np.dtype(spec, align, copy))


def _reconstruct_ndarray(subtype, shape, typecode):
    # numpy always pickles `_reconstruct(ndarray, (0,), b'b')`, then fills the array in BUILD.
    if subtype is not np.ndarray:
        raise UnsafeCheckpointError(f"array reconstruction of type {subtype!r} refused (only numpy.ndarray)")
    if tuple(shape) != (0,):
        raise CheckpointFormatError(f"array reconstruction with initial shape {shape!r}, expected (0,)")
    return _NUMPY_RECONSTRUCT(np.ndarray, (0,), typecode)


def _numpy_scalar(dtype, data=None):
    if not isinstance(dtype, np.dtype):
        raise CheckpointFormatError(f"numpy scalar with dtype argument of type {type(dtype).__name__}")
    _check_dtype(dtype)
    return _NUMPY_SCALAR(dtype, data) if data is not None else _NUMPY_SCALAR(dtype)


def _array_from_buffer(buffer, dtype, shape, order):
    if not isinstance(dtype, np.dtype):
        raise CheckpointFormatError(f"array buffer with dtype argument of type {type(dtype).__name__}")
    _check_dtype(dtype)
    return _NUMPY_FROMBUFFER(buffer, dtype, shape, order)


def _jax_array_as_numpy(fun, args, array_state, aval_state):
    # A jax array pickles as `_reconstruct_array(numpy's _reconstruct, args, state, aval)`: rebuild
    # the numpy value it wraps; the aval (weak-type flag) means nothing outside jax.
    if fun is not _reconstruct_ndarray:
        raise UnsafeCheckpointError(f"jax array rebuilt through {fun!r} refused (only numpy's array reconstruction)")
    array = fun(*args)
    array.__setstate__(array_state)
    return array


def _latin1_encode(text, encoding="latin1"):
    if not isinstance(text, str) or encoding.replace("-", "").lower() != "latin1":
        raise UnsafeCheckpointError(f"_codecs.encode({type(text).__name__}, {encoding!r}) refused (only latin-1 text)")
    return text.encode("latin1")


def _reconstruct_plain_object(cls, base, state):
    # Protocols 0 and 1 rebuild a plain object through copyreg; only the config stand-in qualifies.
    if cls is not _SavedTransformerConfig or base is not object or state is not None:
        raise UnsafeCheckpointError(f"copyreg._reconstructor({cls!r}, {base!r}, ...) refused")
    return object.__new__(cls)


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError as error:  # pragma: no cover - ml_dtypes ships with jax
        raise CheckpointFormatError("this checkpoint stores bfloat16 arrays; reading them needs `pip install ml_dtypes`") from error
    return ml_dtypes.bfloat16


_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): lambda: _reconstruct_ndarray,
    ("numpy._core.multiarray", "_reconstruct"): lambda: _reconstruct_ndarray,
    ("numpy.core.multiarray", "scalar"): lambda: _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): lambda: _numpy_scalar,
    ("numpy.core.numeric", "_frombuffer"): lambda: _array_from_buffer,
    ("numpy._core.numeric", "_frombuffer"): lambda: _array_from_buffer,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: _make_dtype,
    ("ml_dtypes", "bfloat16"): _bfloat16,
    ("jax._src.array", "_reconstruct_array"): lambda: _jax_array_as_numpy,
    NEEDLE_CONFIG_GLOBAL: lambda: _SavedTransformerConfig,
    ("copyreg", "_reconstructor"): lambda: _reconstruct_plain_object,
    ("copy_reg", "_reconstructor"): lambda: _reconstruct_plain_object,
    ("_codecs", "encode"): lambda: _latin1_encode,
    # Plain containers and numbers, as protocols 0-2 spell them.
    ("builtins", "object"): lambda: object,
    ("__builtin__", "object"): lambda: object,
    ("builtins", "set"): lambda: set,
    ("__builtin__", "set"): lambda: set,
    ("builtins", "frozenset"): lambda: frozenset,
    ("__builtin__", "frozenset"): lambda: frozenset,
    ("builtins", "bytearray"): lambda: bytearray,
    ("__builtin__", "bytearray"): lambda: bytearray,
    ("builtins", "complex"): lambda: complex,
    ("__builtin__", "complex"): lambda: complex,
}


class _CheckpointUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the allow-listed globals above."""

    def find_class(self, module, name):
        factory = _ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            raise UnsafeCheckpointError(
                f"checkpoint references the global {module}.{name}, which a Needle checkpoint never holds; "
                "refusing to load it (loading it could run arbitrary code)"
            )
        return factory()

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"checkpoint uses a persistent id ({pid!r}); Needle checkpoints have none")


# --------------------------------------------------------------------------------------------------
# Reading.


def looks_like_pickle(header: bytes) -> bool:
    """Whether `header` (the first bytes of a file) starts a pickle of protocol 2 or later.

    Python 3 writes protocol >= 2 by default, and such a pickle opens with the PROTO opcode.
    """
    return len(header) >= 2 and header[0] == 0x80 and 2 <= header[1] <= pickle.HIGHEST_PROTOCOL


def is_native_checkpoint(path) -> bool:
    """Whether the file at `path` looks like a native checkpoint (a pickle), judged by its first bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return looks_like_pickle(f.read(2))


def _unpickle(path: Path):
    # Unpickled from the open file, not from its bytes in memory: a checkpoint's arrays then cost
    # their own size once, not twice.
    with open(path, "rb") as stream:
        head = stream.read(2)
        if not head:
            raise CheckpointFormatError(f"{path}: empty file, not a native Needle checkpoint")
        # The top level must be a dict: protocol >= 2 starts with PROTO, protocol 0 with MARK ("(dp0"),
        # protocol 1 with EMPTY_DICT.
        if not (looks_like_pickle(head) or head[:1] in (b"(", b"}")):
            head += stream.read(6)
            raise CheckpointFormatError(
                f"{path}: not a pickle (starts with bytes {head.hex(' ')}), not a native Needle checkpoint"
            )
        stream.seek(0)
        try:
            obj = _CheckpointUnpickler(stream).load()
        except CheckpointFormatError as error:
            raise type(error)(f"{path}: {error}") from None
        except Exception as error:  # a damaged pickle fails in many ways (EOFError, UnpicklingError, ...)
            raise CheckpointFormatError(
                f"{path}: cannot unpickle ({type(error).__name__}: {error}); the file is truncated or corrupt"
            ) from error
        end = stream.tell()
        trailing = os.fstat(stream.fileno()).st_size - end
    if trailing:
        raise CheckpointFormatError(f"{path}: {trailing} unexpected byte(s) after the end of the pickle at offset {end}")
    return obj


def _check_params(tree, where: str = "params") -> dict:
    """Validate a nested dict of float arrays; numpy scalars become 0-d arrays."""
    if not isinstance(tree, dict):
        raise CheckpointFormatError(f"{where}: expected a dict of parameters, got {type(tree).__name__}")
    if not tree:
        raise CheckpointFormatError(f"{where}: empty parameter dict")
    out = {}
    for key, value in tree.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{where}: parameter names must be strings, got {key!r}")
        path = f"{where}/{key}"
        if isinstance(value, dict):
            out[key] = _check_params(value, path)
            continue
        if isinstance(value, np.generic):
            value = np.asarray(value)
        if not isinstance(value, np.ndarray):
            raise CheckpointFormatError(f"{path}: expected a numpy array, got {type(value).__name__}")
        if not (np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16"):
            raise CheckpointFormatError(f"{path}: expected a floating-point array, got dtype {value.dtype}")
        out[key] = value
    return out


def _check_step(step, path: Path):
    if step is None:
        return None
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
        return int(step)
    if isinstance(step, (float, np.floating)) and math.isfinite(step) and float(step).is_integer():
        return int(step)
    raise CheckpointFormatError(f"{path}: 'step' must be an integer or None, got {step!r}")


def load_native_checkpoint(path) -> NativeCheckpoint:
    """Load a format_version 2 native checkpoint safely (see the module docstring).

    Raises:
        UnsafeCheckpointError: the pickle references a global a checkpoint never holds.
        CheckpointFormatError: the file is not a pickle, is truncated or corrupt, or does not hold
            a format_version 2 checkpoint (missing keys, wrong version, params not arrays, ...).
    """
    path = Path(path)
    ckpt = _unpickle(path)
    if not isinstance(ckpt, dict):
        raise CheckpointFormatError(f"{path}: expected a pickled dict, found {type(ckpt).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in ckpt]
    if missing:
        raise CheckpointFormatError(f"{path}: checkpoint dict is missing {missing} (has {sorted(map(str, ckpt))})")
    version = ckpt["format_version"]
    if version != NATIVE_FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{path}: format_version {version!r} found, expected {NATIVE_FORMAT_VERSION} (Needle 2); "
            "older encoder-decoder checkpoints and Needle 3 checkpoints are not supported"
        )
    config = ckpt["config"]
    config_source = "dict"
    if isinstance(config, _SavedTransformerConfig):
        config, config_source = dict(getattr(config, "fields", {})), "TransformerConfig"
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{path}: 'config' must be a dict or a TransformerConfig, got {type(config).__name__}")
    run = ckpt.get("run")
    if run is None:
        run = {}
    if not isinstance(run, dict):
        raise CheckpointFormatError(f"{path}: 'run' must be a dict or None, got {type(run).__name__}")
    return NativeCheckpoint(
        params=_check_params(ckpt["params"]),
        config=dict(config),
        step=_check_step(ckpt.get("step"), path),
        run=dict(run),
        config_source=config_source,
    )


# --------------------------------------------------------------------------------------------------
# Writing.


def _as_numpy_tree(tree, where: str = "params") -> dict:
    """Copy a parameter tree to plain numpy leaves (jax or torch arrays pickle as their own classes)."""
    if not isinstance(tree, dict):
        raise TypeError(f"{where}: expected a dict of parameters, got {type(tree).__name__}")
    out = {}
    for key, value in tree.items():
        path = f"{where}/{key}"
        if isinstance(value, dict):
            out[str(key)] = _as_numpy_tree(value, path)
        else:
            array = np.asarray(value)
            if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
                raise TypeError(f"{path}: expected a floating-point array, got dtype {array.dtype}")
            out[str(key)] = array
    return out


def write_native_checkpoint(path, params: dict, config_dict: dict, *, step: int | None = None, run: dict | None = None) -> Path:
    """Write a format_version 2 checkpoint the reference can load, atomically.

    The payload is the reference's: `{"format_version": 2, "params", "config", "step", "run"}`,
    params as plain numpy arrays (dtypes kept). The file is written to a temporary name in the same
    directory and moved into place, so a crash never leaves a half-written checkpoint at `path`.
    """
    if not isinstance(config_dict, dict):
        raise TypeError(f"config_dict must be a dict of TransformerConfig fields, got {type(config_dict).__name__}")
    payload = {
        "format_version": NATIVE_FORMAT_VERSION,
        "params": _as_numpy_tree(params),
        "config": dict(config_dict),
        "step": None if step is None else int(step),
        "run": dict(run or {}),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name beside the target (same filesystem, so the final rename is atomic); opened
    # exclusively, with the usual permissions.
    tmp_path = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp_path, "xb") as f:
            pickle.dump(payload, f, protocol=WRITE_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path

