"""`needle-hf build`: a Hugging Face Needle folder (optionally + a PEFT LoRA adapter) -> a `.cact`.

Writes what the reference's `needle build` writes for the same weights and tokenizer, byte for
byte, without the reference:

1. `config.json` and the safetensors weights are read and checked strictly (`export.read_hf_tensors`),
   then re-stacked into the native tree (`weight_names.hf_to_native`).
2. With `lora`, a PEFT LoRA folder (or the reference's own `needle_lora.pkl`) is merged the way the reference merges its own adapters
   (`lora.merge_into_native`: W + scale * A @ B on the native (in, out) kernels).
3. The quantization scheme, as the reference decides it: the one a LoRA adapter was trained for
   with QAT (`qat_bits_map` / `qat_bits`; an explicit different choice is refused), else
   `bits_map`, else `bits`, else the config's `weight_bits` map (what the model was post-trained
   for), else CQ 4-bit.
4. The tokenizer to embed: `tokenizer` (a SentencePiece `.model` or a `.cact` whose tokenizer to
   reuse), else `HF_DIR/tokenizer.model`, else the folder's `tokenizer.json` (`piece_table`).
5. `cact_writer.cact_bytes` with the deployment KV window (`deployment_kv_window`), written to a
   temporary file that is read back with `cact.read_cact` before it is renamed to OUT.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from needle_hf.models.needle.numerics import TERNARY_BITS, parse_bits_map
from needle_hf.models.needle.tokenization_needle import PieceTable
from needle_hf.models.needle.weight_names import hf_to_native

from .cact import CACT_TAG, read_cact
from .atomic_output import check_output_file
from .cact_writer import CactWriteError, cact_bytes, deployment_kv_window, write_atomically
from .export import read_hf_config, read_hf_tensors
from .lora import merge_into_native, read_native_adapter, read_peft_adapter
from .piece_table import piece_table_from_tokenizer_json

SENTENCEPIECE_NAME = "tokenizer.model"
TOKENIZER_JSON_NAME = "tokenizer.json"
BUILD_BITS = (2, 3, 4)

Progress = Callable[[str], None]


@dataclass
class BuildResult:
    out_path: Path
    records: int
    bytes: int
    scheme: str
    kv_window: int
    tokenizer: str
    seconds: float

    def summary(self) -> str:
        return (f"wrote {self.out_path}: {self.records} records, {self.bytes:,} bytes, {self.scheme}, "
                f"kv_window {self.kv_window}, tokenizer {self.tokenizer}, {self.seconds:.1f} s")


def resolve_scheme(config, *, bits: int | None, bits_map: str | None) -> tuple[int | float, str | None, str]:
    """(bits, bits_map, description): the explicit choice, else the config's `weight_bits` map, else CQ 4-bit."""
    if bits is not None and bits_map is not None:
        raise CactWriteError("give --bits or --bits-map, not both (a bits map sets every width, default included)")
    if bits is not None and bits not in BUILD_BITS:
        raise CactWriteError(f"--bits {bits}, expected one of {', '.join(map(str, BUILD_BITS))} "
                             f"(ternary: --bits-map default={TERNARY_BITS})")
    if bits is None and bits_map is None and config.weight_bits:
        bits_map = config.weight_bits
    if bits_map is not None:
        parse_bits_map(bits_map, engram_sites=len(config.engram_layers))  # refuses a bad map before any work
        return 4, bits_map, f"CQ mixed[{bits_map}]"
    bits = 4 if bits is None else bits
    return bits, None, f"CQ W{bits}"


def _adapter_scheme(adapter, *, bits, bits_map, where) -> tuple[int | None, str | None]:
    """The scheme a QAT-trained adapter requires; an explicit different one would deploy other numerics."""
    trained_map, trained_bits = adapter.metadata.get("qat_bits_map"), adapter.metadata.get("qat_bits")
    if trained_map is not None:
        if bits is not None or (bits_map and bits_map != trained_map):
            asked = f"--bits {bits}" if bits is not None else f"--bits-map {bits_map}"
            raise CactWriteError(f"{where} was trained (QAT) for the bits map {trained_map!r}; {asked} would deploy "
                                 "numerics it was never trained for")
        return None, trained_map
    if trained_bits is not None:
        if bits_map or (bits is not None and bits != trained_bits):
            asked = f"--bits {bits}" if bits is not None else f"--bits-map {bits_map}"
            raise CactWriteError(f"{where} was trained (QAT) for CQ W{trained_bits}; {asked} would deploy numerics "
                                 "it was never trained for; build at its width")
        return trained_bits, None
    return bits, bits_map


def _tokenizer_table(hf_dir: Path, tokenizer) -> tuple[PieceTable, str]:
    if tokenizer is not None:
        path = Path(tokenizer)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        with open(path, "rb") as handle:
            is_blob = handle.read(4) == CACT_TAG.to_bytes(4, "little")
        if is_blob:
            table = read_cact(path).tokenizer_table
            if table is None:
                raise CactWriteError(f"{path}: this .cact has no embedded tokenizer")
            return PieceTable.from_mapping(table), path.name
        return PieceTable.from_sentencepiece(str(path)), path.name
    if (hf_dir / SENTENCEPIECE_NAME).is_file():
        return PieceTable.from_sentencepiece(str(hf_dir / SENTENCEPIECE_NAME)), SENTENCEPIECE_NAME
    if (hf_dir / TOKENIZER_JSON_NAME).is_file():
        return piece_table_from_tokenizer_json(hf_dir / TOKENIZER_JSON_NAME), TOKENIZER_JSON_NAME
    raise CactWriteError(f"{hf_dir} has no {SENTENCEPIECE_NAME} or {TOKENIZER_JSON_NAME}; pass --tokenizer "
                         "tokenizer.model (or --no-tokenizer for a blob without one)")


def build_cact(
    hf_dir,
    out_path,
    *,
    bits: int | None = None,
    bits_map: str | None = None,
    lora=None,
    tokenizer=None,
    embed_tokenizer: bool = True,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> BuildResult:
    """Write the `.cact` of an HF Needle folder (see the module docstring).

    Args:
        hf_dir: the HF folder (config.json + model.safetensors).
        out_path: the `.cact` to write (its parent must exist).
        bits: CQ width 2, 3 or 4 for every quantized matrix.
        bits_map: per-tensor widths, "name=bits,...,default=bits" (1.58 = ternary).
        lora: a PEFT LoRA adapter folder, or a reference `needle_lora.pkl`, to merge first.
        tokenizer: a SentencePiece `.model` or a `.cact` to take the tokenizer from.
        embed_tokenizer: False writes a blob without the RAW tokenizer record.
        overwrite: replace an existing `out_path`.
        progress: called with one line per step.
    """
    started = time.perf_counter()
    progress = progress or (lambda _: None)
    hf_dir, out_path = Path(hf_dir), Path(out_path).absolute()
    if not hf_dir.is_dir():
        raise CactWriteError(f"{hf_dir} is not a folder; expected a saved Hugging Face Needle folder")
    input_paths = {"Hugging Face folder": hf_dir, "adapter": lora, "tokenizer": tokenizer}
    check_output_file(out_path, input_paths, command="build", kind=".cact", overwrite=overwrite, error=CactWriteError)

    from .needle3 import is_needle3_folder

    if is_needle3_folder(hf_dir):
        if bits not in (None, 4) or bits_map is not None or lora is not None:
            raise CactWriteError("a Needle 3 folder builds as the 3.2.8 writer does: 4-bit CQ, no bits map, no adapter "
                                 f"(got bits={bits}, bits_map={bits_map!r}, lora={lora})")
        return _build_needle3(hf_dir, out_path, tokenizer=tokenizer, embed_tokenizer=embed_tokenizer,
                              inputs=input_paths, progress=progress, started=started)
    progress(f"reading {hf_dir}")
    config = read_hf_config(hf_dir)
    if bits_map is not None:  # an explicit map, even an empty one, is checked before any other work
        parse_bits_map(bits_map, engram_sites=len(config.engram_layers))
    adapter = None
    if lora is not None:
        adapter = read_native_adapter(lora, config) if Path(lora).is_file() else read_peft_adapter(lora, config)
    if adapter is not None:
        bits, bits_map = _adapter_scheme(adapter, bits=bits, bits_map=bits_map, where=lora)
    bits, bits_map, scheme = resolve_scheme(config, bits=bits, bits_map=bits_map)
    table, tokenizer_source = _tokenizer_table(hf_dir, tokenizer) if embed_tokenizer else (None, "none")
    params = hf_to_native(read_hf_tensors(hf_dir, config), config)
    if adapter is not None:
        params = merge_into_native(params, adapter)
        progress(f"merged the rank-{adapter.rank} LoRA adapter {lora} (scale {adapter.scale:g}) into "
                 f"{', '.join(adapter.pairs)}")
    kv_window = deployment_kv_window(config)
    progress(f"quantizing: {scheme}, kv_window {kv_window}, tokenizer from {tokenizer_source}")
    data = cact_bytes(params, config, bits=bits, bits_map=bits_map, tokenizer=table, kv_window=kv_window)
    del params
    progress(f"writing {out_path} ({len(data):,} bytes) and reading it back")
    records = []
    write_atomically(out_path, data, inputs=input_paths, command="build",
                     check=lambda staged: records.extend(read_cact(staged).records))
    return BuildResult(out_path, len(records), len(data), scheme, kv_window, tokenizer_source, time.perf_counter() - started)


def _build_needle3(hf_dir: Path, out_path: Path, *, tokenizer, embed_tokenizer: bool, inputs: dict, progress: Progress,
                   started: float) -> BuildResult:
    """The `.cact` v3 of a Needle 3 folder (`cact_v3`), byte for byte what cactus-needle 3.2.8 writes
    for the same weights, with the deployment KV window the reference's build records."""
    from safetensors.numpy import load_file

    from needle_hf.models.needle3.configuration_needle3 import Needle3Config
    from needle_hf.models.needle3.tokenization_needle3 import NEEDLE3_CHAT_MARKERS
    from needle_hf.models.needle3.weight_names_needle3 import hf_to_native as needle3_hf_to_native

    from .cact_v3 import cact3_bytes, deployment_kv_window as needle3_kv_window, read_cact3
    from .cact_writer import tokenizer_record

    progress(f"reading {hf_dir} (Needle 3)")
    config = Needle3Config.from_pretrained(str(hf_dir))
    table, tokenizer_source = _tokenizer_table(hf_dir, tokenizer) if embed_tokenizer else (None, "none")
    state = {name: value.astype("float32") for name, value in load_file(str(hf_dir / "model.safetensors")).items()}
    flat = needle3_hf_to_native(state, config)
    kv_window = needle3_kv_window(config)
    progress(f"quantizing: 4-bit CQ, kv_window {kv_window}, tokenizer from {tokenizer_source}")
    record = None if table is None else tokenizer_record(table, markers=NEEDLE3_CHAT_MARKERS)
    data = cact3_bytes(flat, config, tokenizer=record, kv_window=kv_window)
    records = []
    write_atomically(out_path, data, inputs=inputs, command="build",
                     check=lambda staged: records.append(read_cact3(staged)))
    return BuildResult(out_path, int.from_bytes(data[4:8], "little"), len(data), "CQ 4-bit (cact v3)", kv_window, tokenizer_source,
                       time.perf_counter() - started)
