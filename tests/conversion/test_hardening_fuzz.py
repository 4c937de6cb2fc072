"""A seeded mutation corpus against the readers: every damaged `.pkl`, `.cact`, `model.safetensors` and
`tokenizer.json` gives a valid result or the reader's documented error, within an address-space limit
(RLIMIT_AS), without hanging, and without leaving any file behind.

The corpus is built here from valid files (truncations, flipped bytes, length and size fields
inflated to huge values) and read in a child process that runs under the memory limit, so an
unbounded allocation fails there as a MemoryError, which counts as a failure.
"""

import json
import random
import struct
import subprocess
import sys
import textwrap

import pytest

from needle_hf.tokenization_needle import build_fast_tokenizer
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config, write_native_checkpoint
from spm_fixture import FIXTURE_VOCAB_SIZE

CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE)
MUTATIONS_PER_FORMAT = 70
ADDRESS_SPACE_LIMIT = 3 << 30
CHILD_TIMEOUT_S = 120
HUGE_VALUES = (0xFFFFFFFF, 0x7FFFFFFF, 10**8, 10**9, 1 << 31, 65536)

# Runs in the child: read every mutated file with its reader, record "ok", the documented error
# type, or anything else as a failure.
_READER = textwrap.dedent("""
    import json, resource, sys, traceback
    from pathlib import Path
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from needle_hf.configuration_needle import NeedleConfig
    from needle_hf.conversion.cact import CactFormatError, read_cact
    from needle_hf.conversion.export import ExportError, read_hf_tensors
    from needle_hf.conversion.native_checkpoint import CheckpointFormatError, load_native_checkpoint
    from needle_hf.tokenization_needle import TokenizerSourceError, read_tokenizer_file
    from needle_hf.weight_names import NeedleWeightsError

    corpus = Path(sys.argv[1])
    config = NeedleConfig.from_pretrained(str(corpus / "config"))
    readers = {
        "pkl": (load_native_checkpoint, CheckpointFormatError),
        "cact": (read_cact, CactFormatError),
        "safetensors": (lambda path: read_hf_tensors(path, config), (ExportError, NeedleWeightsError)),
        "json": (read_tokenizer_file, TokenizerSourceError),
    }
    results = {}
    for path in sorted(corpus.glob("case-*")):
        kind = path.name.rsplit(".", 1)[1] if path.is_file() else "safetensors"
        read, documented = readers[kind]
        try:
            read(path)
            results[path.name] = "ok"
        except documented as error:
            results[path.name] = "error"
        except BaseException as error:
            results[path.name] = "FAILED " + type(error).__name__ + ": " + str(error)[:200]
    print(json.dumps(results))
""")


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def _flip(data: bytes, rng: random.Random, *, within: int | None = None) -> bytes:
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        buffer[rng.randrange(within or len(buffer))] ^= 1 << rng.randrange(8)
    return bytes(buffer)


def _inflate(data: bytes, rng: random.Random, *, within: int) -> bytes:
    """Overwrite a 4- or 8-byte little-endian field inside the first `within` bytes with a huge value."""
    buffer = bytearray(data)
    width = rng.choice((4, 8))
    position = rng.randrange(max(1, min(within, len(buffer)) - width))
    value = rng.choice(HUGE_VALUES) if width == 4 else rng.choice(HUGE_VALUES + (1 << 40, 1 << 62))
    struct.pack_into("<Q" if width == 8 else "<I", buffer, position, value)
    return bytes(buffer)


def _inflate_json(text: str, rng: random.Random) -> str:
    """Huge numbers, deep nesting or a cut in a JSON document."""
    choice = rng.randrange(3)
    if choice == 0:
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        at = rng.choice(digits)
        return text[:at] + rng.choice(["99999999999", "1" * 5000, "1e999", "-1"]) + text[at:]
    if choice == 1:
        at = rng.choice([i for i, c in enumerate(text) if c == ":"]) + 1
        depth = rng.choice([100, 10_000, 200_000])
        return text[:at] + "[" * depth + "]" * depth + text[at:]
    return text[: rng.randrange(len(text))]


def _mutants(data: bytes, rng: random.Random, *, header: int):
    for index in range(MUTATIONS_PER_FORMAT):
        kind = index % 3
        if kind == 0:
            yield _truncate(data, rng)
        elif kind == 1:
            yield _flip(data, rng, within=header if index % 2 else None)
        else:
            yield _inflate(data, rng, within=header)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, needle_spm_model):
    from needle.model.export import write_export
    from needle.model.tokenizer import SANTokenizer

    from needle_hf.configuration_needle import NeedleConfig
    from needle_hf.conversion.safetensors_stream import write_safetensors
    from needle_hf.weight_names import native_to_hf

    root = tmp_path_factory.mktemp("fuzz")
    params = make_native_params(CONFIG, seed=3, with_heads=False)
    pkl, cact = root / "seed.pkl", root / "seed.cact"
    write_native_checkpoint(pkl, params, CONFIG)
    write_export(params, reference_config(CONFIG), str(cact), bits=4, tokenizer=SANTokenizer(str(needle_spm_model)))
    config = NeedleConfig.from_needle_config(CONFIG, use_mtp_head="mtp_combine" in params)
    config.save_pretrained(str(root / "config"))
    weights = root / "seed.safetensors"
    write_safetensors(weights, native_to_hf(params, config), metadata={"format": "pt"})
    tokenizer_dir = root / "tokenizer"
    build_fast_tokenizer(needle_spm_model).save_pretrained(str(tokenizer_dir))
    tokenizer_json = (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")

    cases = root / "cases"
    cases.mkdir()
    rng = random.Random(20260101)
    count = 0

    def add(suffix, data):
        nonlocal count
        if suffix == "safetensors":
            folder = cases / f"case-{count:04d}"
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(data)
        else:
            (cases / f"case-{count:04d}.{suffix}").write_bytes(data)
        count += 1

    for data in _mutants(pkl.read_bytes(), rng, header=4096):
        add("pkl", data)
    for data in _mutants(cact.read_bytes(), rng, header=120 + 4 * 28 + 44 * 64):
        add("cact", data)
    safetensors_data = weights.read_bytes()
    header_end = 8 + struct.unpack_from("<Q", safetensors_data)[0]
    for data in _mutants(safetensors_data, rng, header=header_end):
        add("safetensors", data)
    header_text = safetensors_data[8:header_end].decode()
    for _ in range(20):  # shapes and offsets in the JSON header inflated
        text = _inflate_json(header_text, rng).encode()
        add("safetensors", struct.pack("<Q", len(text)) + text + safetensors_data[header_end:])
    for data in _mutants(tokenizer_json.encode(), rng, header=len(tokenizer_json)):
        add("json", data)
    for _ in range(30):
        add("json", _inflate_json(tokenizer_json, rng).encode())
    (cases / "config").symlink_to(root / "config")
    return cases


def test_mutated_inputs_give_a_result_or_the_documented_error(corpus):
    before = sorted(p.name for p in corpus.rglob("*"))
    child = subprocess.run(
        [sys.executable, "-c", _READER, str(corpus), str(ADDRESS_SPACE_LIMIT)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    failures = {name: outcome for name, outcome in results.items() if outcome.startswith("FAILED")}
    assert not failures, failures
    assert len(results) == len(list(corpus.glob("case-*")))
    assert sum(outcome == "error" for outcome in results.values()) > len(results) // 2  # the corpus bites
    assert sorted(p.name for p in corpus.rglob("*")) == before  # nothing written beside the inputs
