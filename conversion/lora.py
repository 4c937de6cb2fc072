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

from .cact_writer import write_atomically
from .atomic_output import clean_debris, publish_folder, staging_path
from .native_checkpoint import WRITE_PROTOCOL, CheckpointFormatError, _unpickle

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


class AdapterError(ValueError):
    """An adapter that cannot be read, converted or merged; the message names the file and the entry."""


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
        payload = _unpickle(path)
    except CheckpointFormatError as error:
        raise AdapterError(str(error).replace("native Needle checkpoint", "Needle LoRA adapter")) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("lora"), dict) or "scale" not in payload:
        found = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise AdapterError(f"{path}: expected the reference's adapter dict with 'lora' and 'scale', found {found}")
    scale = payload["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
        raise AdapterError(f"{path}: 'scale' is {scale!r}, expected a finite number (alpha / rank)")
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
        pairs[match.group(1)] = (a.astype(np.float32), b.astype(np.float32))
        ranks.add(a.shape[2])
    if not pairs:
        raise AdapterError(f"{path}: the adapter adapts no kernel ('lora' is empty)")
    if len(ranks) != 1:
        raise AdapterError(f"{path}: the adapted kernels have different ranks {sorted(ranks)}; one rank expected")
    rank = ranks.pop()
    if payload.get("rank") not in (None, rank):
        raise AdapterError(f"{path}: 'rank' says {payload['rank']}, the A/B matrices have rank {rank}")
    adapter = NativeAdapter(pairs, float(scale), rank, {k: payload.get(k) for k in ("base", *NEEDLE_METADATA_KEYS)})
    _check_qat_metadata(adapter.metadata, path)
    if config is not None:
        for name, (a, b) in pairs.items():
            _check_pair(f"{path}: {NATIVE_KERNEL_PATH.format(name)}", a, b, config, name, rank)
    return adapter


def write_native_adapter(path, adapter: NativeAdapter) -> Path:
    """Pickle the adapter in the reference's layout, atomically (a temporary file beside `path`)."""
    payload = {
        "lora": {NATIVE_KERNEL_PATH.format(name): {"A": np.ascontiguousarray(a, np.float32), "B": np.ascontiguousarray(b, np.float32)}
                 for name, (a, b) in adapter.pairs.items()},
        "scale": float(adapter.scale),
        "base": adapter.metadata.get("base"),
        "rank": int(adapter.rank),
        "qat_bits": adapter.metadata.get("qat_bits"),
        "qat_bits_map": adapter.metadata.get("qat_bits_map"),
        "seed": adapter.metadata.get("seed"),
    }
    return write_atomically(path, pickle.dumps(payload, protocol=WRITE_PROTOCOL))


def merge_into_native(params: dict, adapter: NativeAdapter) -> dict:
    """The native tree with the adapter merged as the reference merges it: W + scale * (A @ B), in W's dtype.

    Only the adapted leaves are new arrays; the rest of the tree is shared with `params`.
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
        projection["kernel"] = kernel + (np.float32(adapter.scale) * (a @ b)).astype(kernel.dtype)
    return merged


# --------------------------------------------------------------------------------------------------
# PEFT folders.


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise AdapterError(f"{path.parent}: no {path.name}; expected a PEFT adapter folder (save_pretrained of a PeftModel)")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    return value


def _peft_scale(settings: dict, where: Path) -> tuple[int, float]:
    """(rank, merge scale) of a LoRA adapter_config, refusing what the reference's adapter cannot hold."""
    if settings.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: peft_type {settings.get('peft_type')!r}, expected 'LORA'")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{where}: r {rank!r} and lora_alpha {alpha!r}, expected a positive integer and a number")
    refusals = {
        "bias": (settings.get("bias", "none") != "none", "trained biases"),
        "use_dora": (bool(settings.get("use_dora")), "DoRA magnitudes"),
        "fan_in_fan_out": (bool(settings.get("fan_in_fan_out")), "fan-in/fan-out weights"),
        "modules_to_save": (bool(settings.get("modules_to_save")), "fully trained extra modules"),
        "rank_pattern": (bool(settings.get("rank_pattern")), "per-module ranks"),
        "alpha_pattern": (bool(settings.get("alpha_pattern")), "per-module alphas"),
    }
    for key, (refused, what) in refusals.items():
        if refused:
            raise AdapterError(f"{where}: {key} = {settings.get(key)!r}; the reference's adapter holds one rank and "
                               f"scale for plain LoRA on the five projections, not {what}")
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return rank, float(scale)


def read_peft_adapter(folder, config) -> NativeAdapter:
    """Read a PEFT LoRA folder for a Needle model with `config` into the reference's layout.

    Layers a projection's adapter skips (e.g. `layers_to_transform`) get zero A and B, which merge
    to nothing. Only the backbone layers' five projections are accepted.
    """
    from safetensors import safe_open

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
    with safe_open(str(weights), framework="numpy") as handle:
        for key in handle.keys():
            match = _PEFT_KEY.match(key)
            if not match or match.group(2) not in hf_to_native or int(match.group(1)) >= layers:
                raise AdapterError(
                    f"{weights}: tensor {key}; the reference's adapter holds LoRA on model.layers.<0..{layers - 1}>."
                    f"self_attn.{{{','.join(PROJECTIONS.values())}}} only (not the MTP block, heads or embeddings)")
            layer, name, side = int(match.group(1)), hf_to_native[match.group(2)], match.group(3)
            value = handle.get_tensor(key)
            fan_in, fan_out = shapes[name]
            expected = (rank, fan_in) if side == "A" else (fan_out, rank)
            if value.shape != expected:
                raise AdapterError(f"{weights}: tensor {key}: shape {value.shape}, expected {expected}")
            found.setdefault((name, side), {})[layer] = value.astype(np.float32)
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
        raise AdapterError(f"{weights}: no LoRA tensors")
    metadata = {}
    if (folder / NEEDLE_METADATA_NAME).is_file():
        recorded = _read_json(folder / NEEDLE_METADATA_NAME)
        metadata = {key: recorded.get(key) for key in NEEDLE_METADATA_KEYS}
        _check_qat_metadata(metadata, folder / NEEDLE_METADATA_NAME)
    return NativeAdapter(pairs, scale, rank, metadata)


def _check_qat_metadata(metadata: dict, where):
    bits, bits_map = metadata.get("qat_bits"), metadata.get("qat_bits_map")
    if bits is not None and (isinstance(bits, bool) or bits not in (2, 3, 4)):
        raise AdapterError(f"{where}: qat_bits {bits!r}, expected 2, 3, 4 or null")
    if bits_map is not None and not isinstance(bits_map, str):
        raise AdapterError(f"{where}: qat_bits_map {bits_map!r}, expected a bits-map string or null")


def write_peft_adapter(out_dir, adapter: NativeAdapter, config, *, base_model: str, overwrite: bool = False) -> Path:
    """Write `adapter` as a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a
    Needle model with `config`; built in a temporary folder beside `out_dir`, then renamed."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not overwrite)):
        raise AdapterError(f"{out_dir} exists" + (" and is not a folder" if not out_dir.is_dir() else
                                                  " and is not empty; pass --overwrite to replace it"))
    if not out_dir.parent.is_dir():
        raise AdapterError(f"the parent folder of {out_dir} does not exist; create it first")
    for name, (a, b) in adapter.pairs.items():
        _check_pair(f"adapter {NATIVE_KERNEL_PATH.format(name)}", a, b, config, name, adapter.rank)
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
        "lora_alpha": float(adapter.scale) * int(adapter.rank),
        "lora_dropout": 0.0,
        "target_modules": rf"model\.layers\.\d+\.self_attn\.({targets})",
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    clean_debris(out_dir)
    staging = staging_path(out_dir)
    staging.mkdir()
    try:
        save_file(tensors, str(staging / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        needle_metadata = {key: adapter.metadata.get(key) for key in NEEDLE_METADATA_KEYS}
        (staging / NEEDLE_METADATA_NAME).write_text(json.dumps(needle_metadata, indent=2) + "\n", encoding="utf-8")
        (staging / ADAPTER_CONFIG_NAME).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        publish_folder(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
