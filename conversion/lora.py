"""LoRA adapters both ways: the reference's `needle_lora.pkl` <-> a PEFT adapter folder.

The reference (`needle finetune`) adapts the backbone's attention kernels `q_proj, k_proj, v_proj,
gate_proj, out_proj` (`stack/layers/block/self_attn/<name>/kernel`, stacked over the L layers,
(in, out)) and pickles::

    {"lora": {"stack/layers/block/self_attn/q_proj/kernel": {"A": [L, in, r], "B": [L, r, out]}, ...},
     "scale": alpha / r, "base": <checkpoint>, "rank": r, "qat_bits", "qat_bits_map", "seed"}

merging W + scale * A @ B. PEFT keeps one pair per module in PyTorch layout: `lora_A.weight`
[r, in] and `lora_B.weight` [out, r], merging W_t + (lora_alpha / r) * B_t @ A_t. So for layer i:
A_t = A[i].T and B_t = B[i].T. In the HF model the five projections are
`model.layers.{i}.self_attn.{q,k,v,gate,o}_proj` (`PEFT_TARGET_MODULES`: backbone layers only; the
MTP block has projections of the same names, which the reference never adapts).

The reference's adapter also records the quantization it was trained for (`qat_bits`, or the
`qat_bits_map` of mixed precision), which `needle build --lora` then deploys and refuses to
override. PEFT's config has no place for it, so the PEFT folder carries it beside the adapter in
`needle_adapter.json` (with `seed`); `read_peft_adapter` reads it back and `needle-hf build --lora`
applies the same rule.

Adapters are read with the restricted unpickler of `native_checkpoint` (a pickle can run code) and
written as plain pickles of numpy arrays, which the reference's `needle build --lora` loads.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic_output import check_output_file, check_output_folder, check_output_outside_inputs, errors_name, publish_folder, staging_path
from .cact_writer import write_atomically
from .native_checkpoint import WRITE_PROTOCOL, CheckpointFormatError, safe_unpickle

# Reference kernel name -> HF module name, in the reference's order.
PROJECTIONS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "gate_proj": "gate_proj", "out_proj": "o_proj"}
NATIVE_KERNEL_PATH = "stack/layers/block/self_attn/{}/kernel"
# PEFT matches a string `target_modules` as a regular expression on the whole module name.
PEFT_TARGET_MODULES = r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|gate_proj|o_proj)"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
# The reference's training metadata that PEFT's config cannot hold.
NEEDLE_METADATA_NAME = "needle_adapter.json"
NEEDLE_METADATA_KEYS = ("qat_bits", "qat_bits_map", "seed")
# How PEFT names a saved LoRA tensor of the wrapped causal LM.
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.self_attn\.(\w+)\.lora_([AB])\.weight$")
_NATIVE_KERNEL = re.compile(r"^stack/layers/block/self_attn/(\w+)/kernel$")
# Tensor dtypes an adapter may store (safetensors tags); read as float32 either way.
ADAPTER_SAFETENSORS_DTYPES = ("F32", "F16", "BF16", "F64")
# The merge runs in float32: a scale beyond its range would merge infinities.
MAX_SCALE = float(np.finfo(np.float32).max)


class AdapterError(ValueError):
    """An adapter that cannot be read, converted or merged; the message names the file and the entry."""


def _kind(value) -> str:
    """How a found value is shown in an error: its JSON-ish type and a short repr."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    text = repr(value)
    return f"{names.get(type(value), type(value).__name__)} {text[:60] + '...' if len(text) > 60 else text}"


def _check_scale(scale, where, *, field_name: str) -> float:
    """A finite merge scale the float32 merge can hold."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise AdapterError(f"{where}: {field_name} is {_kind(scale)}, expected a finite number")
    if not math.isfinite(float(scale)) or abs(float(scale)) > MAX_SCALE:
        raise AdapterError(f"{where}: {field_name} is {float(scale)!r}, expected a finite number of magnitude at most "
                           f"{MAX_SCALE:.4g} (the merge runs in float32)")
    return float(scale)


def _check_finite(where: str, value: np.ndarray):
    if not np.isfinite(value).all():
        bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
        raise AdapterError(f"{where}: {bad} non-finite value(s) (NaN or infinity); expected finite numbers")


@dataclass
class NativeAdapter:
    """A LoRA adapter in the reference's layout.

    Attributes:
        pairs: reference projection name ("q_proj", ..., "out_proj") -> (A [L, in, r], B [L, r, out]), float32.
        scale: the merge factor (alpha / r).
        rank: r.
        metadata: the reference's other fields ("base", "qat_bits", "qat_bits_map", "seed").
    """

    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    scale: float
    rank: int
    metadata: dict = field(default_factory=dict)


def _projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted kernel."""
    d, a, kv = config.hidden_size, config.attention_dim, config.kv_dim
    return {"q_proj": (d, a), "k_proj": (d, kv), "v_proj": (d, kv), "gate_proj": (d, a), "out_proj": (a, d)}


def _check_pair(where: str, a: np.ndarray, b: np.ndarray, config, name: str, rank: int):
    expected_in, expected_out = _projection_shapes(config)[name]
    layers = config.num_hidden_layers
    if a.shape != (layers, expected_in, rank):
        raise AdapterError(f"{where} A: shape {a.shape}, expected {(layers, expected_in, rank)} (layers, in, rank)")
    if b.shape != (layers, rank, expected_out):
        raise AdapterError(f"{where} B: shape {b.shape}, expected {(layers, rank, expected_out)} (layers, rank, out)")


# --------------------------------------------------------------------------------------------------
# The reference's pickle.


def read_native_adapter(path, config=None) -> NativeAdapter:
    """Read a reference `needle_lora.pkl` (safely); with `config`, check every shape against the model."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"no adapter file at {path}")
    try:
        payload = safe_unpickle(path)
    except CheckpointFormatError as error:
        raise AdapterError(str(error).replace("native Needle checkpoint", "Needle LoRA adapter")) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("lora"), dict) or "scale" not in payload:
        found = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise AdapterError(f"{path}: expected the reference's adapter dict with 'lora' and 'scale', found {found}")
    scale = _check_scale(payload["scale"], path, field_name="'scale' (alpha / rank)")
    pairs, ranks = {}, set()
    for key, entry in payload["lora"].items():
        match = _NATIVE_KERNEL.match(str(key))
        if not match or match.group(1) not in PROJECTIONS:
            raise AdapterError(f"{path}: adapter entry {key!r}; expected {NATIVE_KERNEL_PATH.format('<name>')} with "
                               f"<name> one of {', '.join(PROJECTIONS)}")
        if not isinstance(entry, dict) or set(entry) != {"A", "B"}:
            raise AdapterError(f"{path}: adapter entry {key}: expected a dict with 'A' and 'B'")
        a, b = (np.asarray(entry[k]) for k in ("A", "B"))
        if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            raise AdapterError(f"{path}: adapter entry {key}: A {a.shape} and B {b.shape}, expected [L, in, r] and [L, r, out]")
        if not (np.issubdtype(a.dtype, np.floating) and np.issubdtype(b.dtype, np.floating)):
            raise AdapterError(f"{path}: adapter entry {key}: dtypes {a.dtype}/{b.dtype}, expected floating point")
        if a.shape[2] == 0:
            raise AdapterError(f"{path}: adapter entry {key}: rank 0 (A {a.shape}); expected a rank of at least 1")
        a, b = a.astype(np.float32), b.astype(np.float32)
        _check_finite(f"{path}: adapter entry {key} A", a)
        _check_finite(f"{path}: adapter entry {key} B", b)
        pairs[match.group(1)] = (a, b)
        ranks.add(a.shape[2])
    if not pairs:
        raise AdapterError(f"{path}: the adapter adapts no kernel ('lora' is empty)")
    if len(ranks) != 1:
        raise AdapterError(f"{path}: the adapted kernels have different ranks {sorted(ranks)}; one rank expected")
    rank = ranks.pop()
    recorded_rank = payload.get("rank")
    if recorded_rank is not None and (isinstance(recorded_rank, bool) or recorded_rank != rank):
        raise AdapterError(f"{path}: 'rank' is {_kind(recorded_rank)}, the A/B matrices have rank {rank}")
    adapter = NativeAdapter(pairs, float(scale), rank, {k: payload.get(k) for k in ("base", *NEEDLE_METADATA_KEYS)})
    _check_qat_metadata(adapter.metadata, path, config)
    if config is not None:
        for name, (a, b) in pairs.items():
            _check_pair(f"{path}: {NATIVE_KERNEL_PATH.format(name)}", a, b, config, name, rank)
    return adapter


def write_native_adapter(path, adapter: NativeAdapter, *, inputs: dict, command: str = "lora export") -> Path:
    """Pickle the adapter in the reference's layout, atomically (a staging file beside `path`).

    `inputs` (label -> path) are the files and folders the adapter was made from: `path` must lie
    outside each of them (`atomic_output.check_output_outside_inputs`).
    """
    scale = _check_scale(adapter.scale, "adapter", field_name="scale")
    payload = {
        "lora": {NATIVE_KERNEL_PATH.format(name): {"A": np.ascontiguousarray(a, np.float32), "B": np.ascontiguousarray(b, np.float32)}
                 for name, (a, b) in adapter.pairs.items()},
        "scale": scale,
        "base": adapter.metadata.get("base"),
        "rank": int(adapter.rank),
        "qat_bits": adapter.metadata.get("qat_bits"),
        "qat_bits_map": adapter.metadata.get("qat_bits_map"),
        "seed": adapter.metadata.get("seed"),
    }
    return write_atomically(path, pickle.dumps(payload, protocol=WRITE_PROTOCOL), inputs=inputs, command=command)


def merge_into_native(params: dict, adapter: NativeAdapter) -> dict:
    """The native tree with the adapter merged as the reference merges it: W + scale * (A @ B), in W's dtype.

    Only the adapted leaves are new arrays; the rest of the tree is shared with `params`. A merge that
    overflows W's dtype is refused, naming the kernel.
    """
    merged = dict(params)
    stack = merged["stack"] = dict(params["stack"])
    layers = stack["layers"] = dict(params["stack"]["layers"])
    block = layers["block"] = dict(params["stack"]["layers"]["block"])
    attention = block["self_attn"] = dict(block["self_attn"])
    for name, (a, b) in adapter.pairs.items():
        projection = attention[name] = dict(attention[name])
        kernel = np.asarray(projection["kernel"])
        if kernel.shape != (a.shape[0], a.shape[1], b.shape[2]):
            raise AdapterError(f"adapter for {NATIVE_KERNEL_PATH.format(name)}: A {a.shape} @ B {b.shape} does not fit "
                               f"the base kernel {kernel.shape}")
        with np.errstate(over="ignore", invalid="ignore"):
            update = (np.float32(adapter.scale) * (a @ b)).astype(kernel.dtype)
            result = kernel + update
        if not np.isfinite(np.asarray(result, np.float32)).all():
            raise AdapterError(f"adapter for {NATIVE_KERNEL_PATH.format(name)}: W + scale * A @ B (scale "
                               f"{adapter.scale:g}) overflows {kernel.dtype}; expected a merge with finite weights")
        projection["kernel"] = result
    return merged


# --------------------------------------------------------------------------------------------------
# PEFT folders.


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise AdapterError(f"{path.parent}: no {path.name}; expected a PEFT adapter folder (save_pretrained of a PeftModel)")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise AdapterError(f"{path}: not UTF-8 text (byte {error.start}); expected a JSON object") from None
    except json.JSONDecodeError as error:
        raise AdapterError(f"{path}: not valid JSON ({error}); expected a JSON object") from None
    except RecursionError:
        raise AdapterError(f"{path}: JSON nested too deeply; expected a flat JSON object") from None
    if not isinstance(value, dict):
        raise AdapterError(f"{path}: found {_kind(value)}, expected a JSON object")
    return value


def _setting(settings: dict, key: str, types: tuple, expected: str, where, default=None):
    """`settings[key]` (or `default`), refused unless one of `types` (booleans are not integers)."""
    value = settings.get(key, default)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise AdapterError(f"{where}: field {key!r} is {_kind(value)}, expected {expected}")
    return value


def _peft_scale(settings: dict, where: Path) -> tuple[int, float]:
    """(rank, merge scale) of a LoRA adapter_config, refusing what the reference's adapter cannot hold."""
    peft_type = settings.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: field 'peft_type' is {_kind(peft_type)}, expected 'LORA'")
    rank = _setting(settings, "r", (int,), "a positive integer (the LoRA rank)", where)
    if rank <= 0:
        raise AdapterError(f"{where}: field 'r' is {rank}, expected a positive integer (the LoRA rank)")
    alpha = _setting(settings, "lora_alpha", (int, float), "a finite number", where)
    if not math.isfinite(alpha):
        raise AdapterError(f"{where}: field 'lora_alpha' is {alpha!r}, expected a finite number")
    bias = _setting(settings, "bias", (str,), "'none'", where, default="none")
    flags = {key: _setting(settings, key, (bool, type(None)), "true, false or null", where)
             for key in ("use_dora", "fan_in_fan_out", "use_rslora")}
    extra = {key: _setting(settings, key, kinds, expected, where)
             for key, kinds, expected in (("modules_to_save", (list, type(None)), "a list or null"),
                                          ("rank_pattern", (dict, type(None)), "an object or null"),
                                          ("alpha_pattern", (dict, type(None)), "an object or null"))}
    refusals = {
        "bias": (bias != "none", "trained biases"),
        "use_dora": (bool(flags["use_dora"]), "DoRA magnitudes"),
        "fan_in_fan_out": (bool(flags["fan_in_fan_out"]), "fan-in/fan-out weights"),
        "modules_to_save": (bool(extra["modules_to_save"]), "fully trained extra modules"),
        "rank_pattern": (bool(extra["rank_pattern"]), "per-module ranks"),
        "alpha_pattern": (bool(extra["alpha_pattern"]), "per-module alphas"),
    }
    for key, (refused, what) in refusals.items():
        if refused:
            raise AdapterError(f"{where}: {key} = {settings.get(key)!r}; the reference's adapter holds one rank and "
                               f"scale for plain LoRA on the five projections, not {what}")
    scale = alpha / math.sqrt(rank) if flags["use_rslora"] else alpha / rank
    return rank, _check_scale(scale, where, field_name="the merge scale lora_alpha / r")


def _adapter_tensors(weights: Path):
    """(name, float32 array) of every tensor of an adapter's safetensors file, checked to be finite
    floating point; a malformed file is an `AdapterError` naming it."""
    from .export import ExportError, open_safetensors

    try:
        with open_safetensors(weights) as handle:
            for key in handle.keys():
                dtype = handle.get_slice(key).get_dtype()
                if dtype not in ADAPTER_SAFETENSORS_DTYPES:
                    raise AdapterError(f"{weights}: tensor {key}: dtype {dtype}, expected one of "
                                       f"{', '.join(ADAPTER_SAFETENSORS_DTYPES)}")
                value = np.asarray(handle.get_tensor(key)).astype(np.float32)
                _check_finite(f"{weights}: tensor {key}", value)
                yield key, value
    except ExportError as error:
        raise AdapterError(str(error)) from None


def read_peft_adapter(folder, config) -> NativeAdapter:
    """Read a PEFT LoRA folder for a Needle model with `config` into the reference's layout.

    Tensors may be stored in float32, float16 or bfloat16 (read as float32). Layers a projection's
    adapter skips (e.g. `layers_to_transform`) get zero A and B, which merge to nothing. Only the
    backbone layers' five projections are accepted.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"{folder} is not a folder; expected a PEFT adapter folder")
    settings_path = folder / ADAPTER_CONFIG_NAME
    rank, scale = _peft_scale(_read_json(settings_path), settings_path)
    weights = folder / ADAPTER_WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS_NAME} (save the adapter with safe_serialization=True)")
    hf_to_native = {hf: native for native, hf in PROJECTIONS.items()}
    shapes = _projection_shapes(config)
    layers = config.num_hidden_layers
    found: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key, value in _adapter_tensors(weights):
        match = _PEFT_KEY.match(key)
        if not match or match.group(2) not in hf_to_native or int(match.group(1)) >= layers:
            raise AdapterError(
                f"{weights}: tensor {key}; the reference's adapter holds LoRA on model.layers.<0..{layers - 1}>."
                f"self_attn.{{{','.join(PROJECTIONS.values())}}} only (not the MTP block, heads or embeddings)")
        layer, name, side = int(match.group(1)), hf_to_native[match.group(2)], match.group(3)
        fan_in, fan_out = shapes[name]
        expected = (rank, fan_in) if side == "A" else (fan_out, rank)
        if value.shape != expected:
            raise AdapterError(f"{weights}: tensor {key}: shape {value.shape}, expected {expected} "
                               f"(r {rank} from {ADAPTER_CONFIG_NAME})")
        found.setdefault((name, side), {})[layer] = value
    pairs = {}
    for name in PROJECTIONS:
        a_layers, b_layers = found.get((name, "A"), {}), found.get((name, "B"), {})
        if set(a_layers) != set(b_layers):
            missing = sorted(set(a_layers) ^ set(b_layers))[0]
            raise AdapterError(f"{weights}: layer {missing} {PROJECTIONS[name]} has only one of lora_A and lora_B")
        if not a_layers:
            continue
        fan_in, fan_out = shapes[name]
        a = np.zeros((layers, fan_in, rank), np.float32)
        b = np.zeros((layers, rank, fan_out), np.float32)
        for layer in a_layers:
            a[layer], b[layer] = a_layers[layer].T, b_layers[layer].T
        pairs[name] = (a, b)
    if not pairs:
        raise AdapterError(f"{weights}: no LoRA tensors; expected lora_A/lora_B pairs of "
                           f"model.layers.<i>.self_attn.{{{','.join(PROJECTIONS.values())}}}")
    metadata = {}
    if (folder / NEEDLE_METADATA_NAME).is_file():
        recorded = _read_json(folder / NEEDLE_METADATA_NAME)
        metadata = {key: recorded.get(key) for key in NEEDLE_METADATA_KEYS}
        _check_qat_metadata(metadata, folder / NEEDLE_METADATA_NAME, config)
    return NativeAdapter(pairs, scale, rank, metadata)


def _check_qat_metadata(metadata: dict, where, config=None):
    bits, bits_map, seed = metadata.get("qat_bits"), metadata.get("qat_bits_map"), metadata.get("seed")
    if bits is not None and (isinstance(bits, bool) or bits not in (2, 3, 4)):
        raise AdapterError(f"{where}: qat_bits is {_kind(bits)}, expected 2, 3, 4 or null")
    if bits_map is not None and not isinstance(bits_map, str):
        raise AdapterError(f"{where}: qat_bits_map is {_kind(bits_map)}, expected a bits-map string or null")
    if bits_map is not None and config is not None:
        from needle_hf.models.needle.numerics import BitsMapError, parse_bits_map

        try:
            parse_bits_map(bits_map, engram_sites=len(config.engram_layers))
        except BitsMapError as error:
            raise AdapterError(f"{where}: qat_bits_map: {error}") from None
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise AdapterError(f"{where}: seed is {_kind(seed)}, expected an integer or null")


def write_peft_adapter(out_dir, adapter: NativeAdapter, config, *, base_model: str, inputs: dict,
                       overwrite: bool = False, command: str = "lora import") -> Path:
    """Write `adapter` as a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a
    Needle model with `config`; built in a staging folder beside `out_dir`, then put in its place.

    `inputs` (label -> path) are the files and folders the adapter was made from: `out_dir` must lie
    outside each of them (`atomic_output.check_output_outside_inputs`).
    """
    from safetensors.numpy import save_file

    out_dir = Path(out_dir).absolute()
    check_output_folder(out_dir, inputs, command=command, overwrite=overwrite, error=AdapterError)
    if adapter.rank < 1:
        raise AdapterError(f"adapter: rank {adapter.rank}, expected a rank of at least 1")
    scale = _check_scale(adapter.scale, "adapter", field_name="scale")
    alpha = scale * int(adapter.rank)
    if not math.isfinite(alpha):
        raise AdapterError(f"adapter: lora_alpha = scale {scale!r} x rank {adapter.rank} overflows; expected a finite number")
    for name, (a, b) in adapter.pairs.items():
        _check_pair(f"adapter {NATIVE_KERNEL_PATH.format(name)}", a, b, config, name, adapter.rank)
        _check_finite(f"adapter {NATIVE_KERNEL_PATH.format(name)} A", a)
        _check_finite(f"adapter {NATIVE_KERNEL_PATH.format(name)} B", b)
    _check_qat_metadata(adapter.metadata, "adapter", config)
    tensors = {}
    for name, (a, b) in adapter.pairs.items():
        for layer in range(config.num_hidden_layers):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{PROJECTIONS[name]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer].T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer].T)
    targets = "|".join(PROJECTIONS[name] for name in PROJECTIONS if name in adapter.pairs)
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(adapter.rank),
        # PEFT merges with lora_alpha / r.
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": rf"model\.layers\.\d+\.self_attn\.({targets})",
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    needle_metadata = {key: adapter.metadata.get(key) for key in NEEDLE_METADATA_KEYS}
    texts = {name: json.dumps(value, indent=2, allow_nan=False) + "\n"
             for name, value in ((NEEDLE_METADATA_NAME, needle_metadata), (ADAPTER_CONFIG_NAME, settings))}
    staging = staging_path(out_dir)
    try:
        with errors_name(out_dir, staging):
            staging.mkdir()
            save_file(tensors, str(staging / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
            for name, text in texts.items():
                (staging / name).write_text(text, encoding="utf-8")
            check_output_outside_inputs(out_dir, inputs, command=command)
            publish_folder(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------------------------------
# The two conversions, as `needle-hf lora import/export` run them.


def import_native_adapter(adapter_path, out_dir, *, base, overwrite: bool = False) -> tuple[Path, NativeAdapter]:
    """The reference's `needle_lora.pkl` at `adapter_path` -> a PEFT adapter folder at `out_dir` for
    the HF Needle folder `base`. Returns (the folder written, the adapter)."""
    from .export import read_hf_config

    adapter_path, base, out_dir = Path(adapter_path), Path(base), Path(out_dir)
    inputs = {"adapter": adapter_path, "base folder": base}
    check_output_folder(out_dir, inputs, command="lora import", overwrite=overwrite, error=AdapterError)
    config = read_hf_config(base)
    adapter = read_native_adapter(adapter_path, config)
    written = write_peft_adapter(out_dir, adapter, config, base_model=str(base.absolute()), inputs=inputs,
                                 overwrite=overwrite, command="lora import")
    return written, adapter


def recorded_base(peft_dir) -> Path:
    """The local HF folder an adapter folder records as `base_model_name_or_path`."""
    settings_path = Path(peft_dir) / ADAPTER_CONFIG_NAME
    recorded = _read_json(settings_path).get("base_model_name_or_path")
    if not isinstance(recorded, str) or not recorded or "\0" in recorded:
        raise AdapterError(f"{settings_path}: field 'base_model_name_or_path' is {_kind(recorded)}, expected the path "
                           "of a local HF folder; pass --base HF_DIR")
    if not (Path(recorded) / "config.json").is_file():
        raise AdapterError(f"{settings_path}: base_model_name_or_path {recorded!r} is not a local HF folder; "
                           "pass --base HF_DIR")
    return Path(recorded)


def export_peft_adapter(peft_dir, out_path, *, base=None, overwrite: bool = False) -> tuple[Path, NativeAdapter]:
    """A PEFT adapter folder at `peft_dir` -> the reference's adapter pickle at `out_path`, for the HF
    Needle folder `base` (default: the adapter's `base_model_name_or_path`, when that is a local
    folder). Returns (the file written, the adapter)."""
    from .export import read_hf_config

    peft_dir, out_path = Path(peft_dir), Path(out_path).absolute()
    if base is None:
        check_output_outside_inputs(out_path, {"adapter folder": peft_dir}, command="lora export")
        if not peft_dir.is_dir():
            raise AdapterError(f"{peft_dir} is not a folder; expected a PEFT adapter folder")
        base = recorded_base(peft_dir)
    inputs = {"adapter folder": peft_dir, "base folder": Path(base)}
    check_output_file(out_path, inputs, command="lora export", kind=".pkl", overwrite=overwrite, error=AdapterError)
    base = Path(base)
    config = read_hf_config(base)
    adapter = read_peft_adapter(peft_dir, config)
    adapter.metadata["base"] = str(base.absolute())
    return write_native_adapter(out_path, adapter, inputs=inputs, command="lora export"), adapter
