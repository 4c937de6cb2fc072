"""Native Needle 2 checkpoints (`.pkl`, format_version 2): a safe reader and a writer.

The reference saves a checkpoint as one pickled dict::

    {"format_version": 2, "params": <nested dict of arrays>, "config": <dict>, "step": int | None,
     "run": dict | None}

`params` is the Flax parameter tree (see `needle_hf.models.needle.weight_names`), its leaves numpy arrays
(float32, or float16 when the reference averaged checkpoints, or bfloat16 from `ml_dtypes`).
`config` holds the overridden `TransformerConfig` fields; some checkpoints pickle the
`TransformerConfig` instance itself instead of a dict.

A pickle is a program: a plain `pickle.load` of an untrusted file can run any code. The reader
below therefore unpickles with an allow-list. It admits only the callables that rebuild what a
checkpoint holds, each wrapped so that it can only do that:

- numpy arrays, scalars and dtypes, only in the form numpy's own pickling writes them
  (`numpy[._]core.multiarray._reconstruct` + BUILD state, `...scalar`, `numpy[._]core.numeric._frombuffer`
  for protocol 5, `numpy.dtype` + its plain state; `numpy.ndarray` only as the class `_reconstruct`
  names, never called). Every array is a view of exactly the bytes that carried it, of a numeric
  dtype from `ALLOWED_DTYPE_CODES` (no object, structured or subarray dtypes);
- `ml_dtypes.bfloat16` (the dtype of bfloat16 jax/numpy arrays);
- `jax._src.array._reconstruct_array` (how a pickled jax array rebuilds itself from a numpy
  array), rebuilt here as the plain numpy array without importing jax;
- `needle.model.architecture.TransformerConfig`, mapped to a stand-in that only collects the
  instance's saved fields (the reference is never imported);
- `_codecs.encode` for latin-1 text (how protocols 0-2 spell `bytes`) and `copyreg._reconstructor`
  for the stand-in (how protocols 0-1 spell a plain object).

Anything else raises `UnsafeCheckpointError` naming the module and attribute, before it is called.

Allocation is bounded by the file: every length field is checked against the bytes left before
anything is allocated for it (`_BoundedReader`), the memo is a dict (pure-Python unpickler), and
the result is checked for depth and size (`MAX_NESTING_DEPTH`, `MAX_METADATA_NODES`) before it is
used. Weights must be finite.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic_output import errors_name, staging_path

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


# Array and dtype values a checkpoint may hold: numbers only. Spelled as numpy pickles a dtype
# (`dtype('f4', False, True)`), byte order aside; bfloat16 arrives as the ml_dtypes type itself.
ALLOWED_DTYPE_CODES = ("f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "b1")
MAX_ARRAY_DIMS = 32
# A dtype's pickled state is (version, byte order, subarray, names, fields, itemsize, alignment, flags);
# a plain numeric dtype has no subarray, names or fields.
_PLAIN_DTYPE_STATE_LENGTH = 8


def _unsafe_dtype(spec) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint holds an array of Python objects or of a non-numeric dtype ({spec!r}); parameters are numeric "
        f"(allowed: {', '.join(ALLOWED_DTYPE_CODES)}, bfloat16)"
    )


class _PickledDtype:
    """A dtype being unpickled: `numpy.dtype(spec, align, copy)` then BUILD with its state.

    numpy's own dtype state can turn a plain dtype into a structured, subarray or object dtype, so
    the state is accepted only when it is the one numpy writes for `spec` itself (byte order aside).
    """

    def __init__(self, spec, align=False, copy=False):
        if isinstance(spec, str) and spec.lstrip("<>|=") in ALLOWED_DTYPE_CODES:
            self.dtype = np.dtype(spec)
        elif isinstance(spec, type) and spec.__name__ == "bfloat16" and spec.__module__.startswith("ml_dtypes"):
            self.dtype = np.dtype(spec)
        else:
            raise _unsafe_dtype(spec if isinstance(spec, (str, int, float)) else type(spec).__name__)

    def __setstate__(self, state):
        canonical = self.dtype.__reduce__()[2]
        if not (isinstance(state, tuple) and len(state) == _PLAIN_DTYPE_STATE_LENGTH and state[1] in ("<", ">", "|", "=")
                and state[0] == canonical[0] and state[2:] == canonical[2:]):
            raise UnsafeCheckpointError(
                f"dtype {self.dtype} pickled with state {_describe(state)}, not the state numpy writes for it "
                "(structured, subarray and object dtypes are refused)"
            )
        if state[1] == ">" and self.dtype.itemsize > 1:
            self.dtype = self.dtype.newbyteorder(">")


def _describe(value) -> str:
    """A short, bounded description of an unpickled value for messages (never a deep repr)."""
    if isinstance(value, (int, float, bool, type(None))):
        text = repr(value)
        return text if len(text) <= 40 else f"an integer of {len(text)} digits"
    if isinstance(value, (str, bytes)):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    return f"a {type(value).__name__}"


def _resolve_dtype(dtype, what: str) -> np.dtype:
    if not isinstance(dtype, _PickledDtype):
        raise CheckpointFormatError(f"{what} with dtype argument {_describe(dtype)}, expected a numpy dtype")
    return dtype.dtype


def _checked_shape(shape, what: str) -> tuple[int, ...]:
    if not (isinstance(shape, tuple) and len(shape) <= MAX_ARRAY_DIMS
            and all(type(n) is int and n >= 0 for n in shape)):
        raise CheckpointFormatError(f"{what} with shape {_describe(shape)}, expected a tuple of at most "
                                    f"{MAX_ARRAY_DIMS} non-negative integers")
    return shape


def _array_from_bytes(data, dtype: np.dtype, shape: tuple[int, ...], order: str, what: str) -> np.ndarray:
    """The array viewing `data` (no copy), once its size is exactly the bytes that carried it."""
    if not isinstance(data, (bytes, bytearray)):
        raise CheckpointFormatError(f"{what} with data {_describe(data)}, expected bytes")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise CheckpointFormatError(
            f"{what} of shape {shape} and dtype {dtype} needs {expected} bytes, its data has {len(data)}"
        )
    if order not in ("C", "F"):
        raise CheckpointFormatError(f"{what} with memory order {_describe(order)}, expected 'C' or 'F'")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order=order)


class _ArrayMarker:
    """What `numpy.ndarray` resolves to: the class numpy's `_reconstruct` names, never callable as such."""

    def __call__(self, *args):
        raise UnsafeCheckpointError("numpy.ndarray called directly; numpy pickles arrays through _reconstruct only")


_NDARRAY = _ArrayMarker()


class _PickledArray:
    """An array being unpickled: `_reconstruct(ndarray, (0,), b'b')` then BUILD with
    `(version, shape, dtype, is_fortran, data)`, the state numpy writes. The array views `data`."""

    array = None

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 5 and state[0] == 1:
            state = state[1:]
        if not (isinstance(state, tuple) and len(state) == 4 and isinstance(state[2], bool)):
            raise CheckpointFormatError(f"array state {_describe(state)}, expected (1, shape, dtype, is_fortran, data)")
        shape, dtype, fortran, data = state
        dtype = _resolve_dtype(dtype, "array")
        self.array = _array_from_bytes(data, dtype, _checked_shape(shape, "array"), "F" if fortran else "C", "array")


def _reconstruct_ndarray(subtype, shape, typecode):
    # numpy always pickles `_reconstruct(ndarray, (0,), b'b')`, then fills the array in BUILD.
    if subtype is not _NDARRAY:
        raise UnsafeCheckpointError(f"array reconstruction of type {_describe(subtype)} refused (only numpy.ndarray)")
    if shape != (0,) or typecode != b"b":
        raise CheckpointFormatError(f"array reconstruction with {_describe(shape)}, {_describe(typecode)}; "
                                    "expected (0,), b'b'")
    return _PickledArray()


def _numpy_scalar(dtype, data=None):
    dtype = _resolve_dtype(dtype, "numpy scalar")
    return _array_from_bytes(data, dtype, (), "C", "numpy scalar")[()]


def _array_from_buffer(buffer, dtype, shape, order):
    # Protocol 5: `_frombuffer(buffer, dtype, shape, order)`, the buffer in band.
    if isinstance(buffer, pickle.PickleBuffer):
        buffer = bytes(buffer)
    return _array_from_bytes(buffer, _resolve_dtype(dtype, "array buffer"), _checked_shape(shape, "array buffer"),
                             order, "array buffer")


def _jax_array_as_numpy(fun, args, array_state, aval_state):
    # A jax array pickles as `_reconstruct_array(numpy's _reconstruct, args, state, aval)`: rebuild
    # the numpy value it wraps; the aval (weak-type flag) means nothing outside jax.
    if fun is not _reconstruct_ndarray or not isinstance(args, tuple) or len(args) != 3:
        raise UnsafeCheckpointError(f"jax array rebuilt through {_describe(fun)} refused (only numpy's array reconstruction)")
    pending = fun(*args)
    pending.__setstate__(array_state)
    return pending.array


def _latin1_encode(text, encoding="latin1"):
    if not isinstance(text, str) or encoding.replace("-", "").lower() != "latin1":
        raise UnsafeCheckpointError(f"_codecs.encode({type(text).__name__}, {encoding!r}) refused (only latin-1 text)")
    return text.encode("latin1")


def _reconstruct_plain_object(cls, base, state):
    # Protocols 0 and 1 rebuild a plain object through copyreg; only the config stand-in qualifies.
    if cls is not _SavedTransformerConfig or base is not object or state is not None:
        raise UnsafeCheckpointError(f"copyreg._reconstructor({cls!r}, {base!r}, ...) refused")
    return object.__new__(cls)


def _bytearray(source=b""):
    # Protocols 2-4 spell a bytearray `bytearray(b"...")`; a size argument would allocate unbounded.
    if not isinstance(source, (bytes, bytearray)):
        raise UnsafeCheckpointError(f"bytearray({_describe(source)}) refused (only a copy of pickled bytes)")
    return bytearray(source)


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
    ("numpy", "ndarray"): lambda: _NDARRAY,
    ("numpy", "dtype"): lambda: _PickledDtype,
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
    ("builtins", "bytearray"): lambda: _bytearray,
    ("__builtin__", "bytearray"): lambda: _bytearray,
    ("builtins", "complex"): lambda: complex,
    ("__builtin__", "complex"): lambda: complex,
}


class _BoundedReader:
    """The checkpoint file as the unpickler reads it: a read of more bytes than the file has left is
    an error before anything is allocated for it (a length field is otherwise trusted)."""

    def __init__(self, stream, size: int):
        self._stream, self._size = stream, size

    def remaining(self) -> int:
        return self._size - self._stream.tell()

    def _check(self, count: int):
        if count > self.remaining():
            raise CheckpointFormatError(
                f"a length field at offset {self._stream.tell()} asks for {count} bytes, only {self.remaining()} remain; "
                "the file is truncated or corrupt"
            )

    def read(self, count: int = -1) -> bytes:
        if count is not None and count >= 0:
            self._check(count)
        return self._stream.read(count)

    def readinto(self, buffer) -> int:
        self._check(len(buffer))
        return self._stream.readinto(buffer)

    def readline(self) -> bytes:
        return self._stream.readline()


class _CheckpointUnpickler(pickle._Unpickler):
    """An unpickler that resolves only the allow-listed globals above.

    The pure-Python unpickler, not the C one: its memo is a dict, so a huge memo index costs
    nothing (the C unpickler grows an array to the index), and its opcodes can be overridden where
    one would allocate a size read from the file before reading the bytes.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, reader: _BoundedReader):
        super().__init__(reader)
        self._reader = reader

    def find_class(self, module, name):
        factory = _ALLOWED_GLOBALS.get((module, name)) if isinstance(module, str) and isinstance(name, str) else None
        if factory is None:
            raise UnsafeCheckpointError(
                f"checkpoint references the global {_describe(module)[1:-1]}.{_describe(name)[1:-1]}, which a Needle "
                "checkpoint never holds; refusing to load it (loading it could run arbitrary code)"
            )
        return factory()

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"checkpoint uses a persistent id ({_describe(pid)}); Needle checkpoints have none")

    def load_bytearray8(self):
        (size,) = struct.unpack("<Q", self.read(8))
        if self._unframer.current_frame is None:
            self._reader._check(size)
        elif size > len(self._unframer.current_frame.getbuffer()):
            raise CheckpointFormatError(f"a BYTEARRAY8 of {size} bytes does not fit its frame")
        buffer = bytearray(size)
        self.readinto(buffer)
        self.append(buffer)

    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8


# Bounds on the unpickled structure: deeper nesting than any checkpoint has (a cycle counts as
# infinitely deep), and a node count that also bounds what a web of shared lists expands to.
MAX_NESTING_DEPTH = 64
MAX_METADATA_NODES = 1_000_000


def _children(value, path: str = "") -> list[tuple[str, object]]:
    """(path, child) for each value inside a container."""
    if isinstance(value, dict):
        return [(f"{path}/{key}" if isinstance(key, str) else path, item) for key, item in value.items()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [(path, item) for item in value]
    if isinstance(value, _SavedTransformerConfig):
        return [(path, getattr(value, "fields", {}))]
    return []


def _check_structure(value, path: str, sizes: dict[int, int], depth: int = 0) -> int:
    """The number of values `value` expands to (a shared value counts each time it is reached, as a
    serialiser would write it), computed once per distinct object; refuses deep or circular nesting."""
    if depth > MAX_NESTING_DEPTH:
        raise CheckpointFormatError(f"{path}: nested deeper than {MAX_NESTING_DEPTH} levels (or circular)")
    known = sizes.get(id(value))
    if known is not None:
        return known
    total = 1
    children = _children(value, path)
    for child_path, child in children:
        total += _check_structure(child, child_path, sizes, depth + 1)
        if total > MAX_METADATA_NODES:
            raise CheckpointFormatError(f"{path}: more than {MAX_METADATA_NODES} values (counting shared ones each time)")
    if children:
        sizes[id(value)] = total
    return total


def _finish(value, path: str, done: dict[int, object]):
    """Replace the unpickling stand-ins by their values (arrays, dtypes); a shared container is
    rebuilt once and stays shared, so the result costs what the file held."""
    if isinstance(value, _PickledArray):
        if value.array is None:
            raise CheckpointFormatError(f"{path}: an array whose data was never given")
        return value.array
    if isinstance(value, _PickledDtype):
        return value.dtype
    if not isinstance(value, (dict, list, tuple, set, frozenset, _SavedTransformerConfig)):
        return value
    if id(value) in done:
        return done[id(value)]
    if isinstance(value, _SavedTransformerConfig):
        value.fields = _finish(getattr(value, "fields", {}), path, done)
        result = value
    elif isinstance(value, dict):
        result = {key: _finish(item, f"{path}/{key}" if isinstance(key, str) else path, done)
                  for key, item in value.items()}
    elif isinstance(value, list):
        result = [_finish(item, path, done) for item in value]
    else:
        result = type(value)(_finish(item, path, done) for item in value)
    done[id(value)] = result
    return result


# --------------------------------------------------------------------------------------------------
# Reading.


def looks_like_pickle(header: bytes) -> bool:
    """Whether `header` (the first bytes of a file, at least 3) starts a pickled dict.

    Protocol >= 2 opens with the PROTO opcode; a dict pickled with protocol 0 opens with MARK and
    DICT ("(dp"), with protocol 1 with EMPTY_DICT and a memo PUT or a MARK ("}q", "}r", "}(").
    """
    if len(header) >= 2 and header[0] == 0x80:
        return 2 <= header[1] <= pickle.HIGHEST_PROTOCOL
    return header[:3] == b"(dp" or header[:2] in (b"}q", b"}r", b"}(")


def is_native_checkpoint(path) -> bool:
    """Whether the file at `path` looks like a native checkpoint (a pickle), judged by its first bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return looks_like_pickle(f.read(3))


def safe_unpickle(path: Path):
    """The object pickled in ``path``, through the allow-list unpickler (no code runs; see the module
    docstring): native checkpoints and native LoRA adapters are read this way."""
    # Unpickled from the open file, not from its bytes in memory: a checkpoint's arrays then cost
    # their own size once, not twice.
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        head = stream.read(8)
        if not head:
            raise CheckpointFormatError(f"{path}: empty file, not a native Needle checkpoint")
        if not looks_like_pickle(head):
            raise CheckpointFormatError(
                f"{path}: not a pickle of a dict (starts with bytes {head.hex(' ')}), not a native Needle checkpoint"
            )
        stream.seek(0)
        try:
            obj = _CheckpointUnpickler(_BoundedReader(stream, size)).load()
            _check_structure(obj, "checkpoint", {})
            obj = _finish(obj, "checkpoint", {})
        except CheckpointFormatError as error:
            raise type(error)(f"{path}: {error}") from None
        except MemoryError:
            raise CheckpointFormatError(f"{path}: unpickling ran out of memory; the file is corrupt") from None
        except Exception as error:  # a damaged pickle fails in many ways (EOFError, UnpicklingError, ...)
            raise CheckpointFormatError(
                f"{path}: cannot unpickle ({type(error).__name__}: {_describe(str(error))[1:-1]}); "
                "the file is truncated or corrupt"
            ) from None
        end = stream.tell()
    if size - end:
        raise CheckpointFormatError(f"{path}: {size - end} unexpected byte(s) after the end of the pickle at offset {end}")
    return obj


def _check_params(tree, where: str = "params") -> dict:
    """Validate a nested dict of finite float arrays; numpy scalars become 0-d arrays."""
    if not isinstance(tree, dict):
        raise CheckpointFormatError(f"{where}: expected a dict of parameters, got {type(tree).__name__}")
    if not tree:
        raise CheckpointFormatError(f"{where}: empty parameter dict")
    out = {}
    for key, value in tree.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{where}: parameter names must be strings, got {_describe(key)}")
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
        finite = np.isfinite(value)
        if not finite.all():
            bad = int(finite.size - np.count_nonzero(finite))
            raise CheckpointFormatError(f"{path}: {bad} non-finite value(s) (NaN or Inf) of {value.size}; "
                                        "expected finite weights")
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
    ckpt = safe_unpickle(path)
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
    # A staging name beside the target (same filesystem, so the final rename is atomic); opened
    # exclusively, with the usual permissions. A failure names `path`, not the staging file.
    tmp_path = staging_path(path)
    try:
        with errors_name(path, tmp_path):
            with open(tmp_path, "xb") as f:
                pickle.dump(payload, f, protocol=WRITE_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path

