"""Hostile inputs against every reader and the round-2 surfaces: each gives a valid result or the
documented error, naming the file or field, never another exception or a traceback.

- Checkpoint readers: a seeded mutation corpus of damaged `.pkl`, `.cact`, `model.safetensors` and
  `tokenizer.json` files (truncations, flipped bytes, length and size fields inflated to huge
  values), read in a child process under an address-space limit (RLIMIT_AS), so an unbounded
  allocation fails there as a MemoryError, which counts as a failure; no file is left behind.
- Fine-tuning data (Hypothesis): generated JSONL files (wrong types in every field, NaN and huge
  numbers, lone surrogates, deep nesting, non-UTF-8 bytes, BOMs, markers inside strings) load, and
  then every row's training tokens decode to a turn `parse_assistant_turn` reads back as the
  example's calls, each naming an offered tool; or they fail with `FinetuneDataError` naming the
  file and line.
- Routing (Hypothesis): generated catalogues, queries, `top_k` values and precomputed embeddings
  rank or fail with `ToolRoutingError` naming the field.
- `examples/finetune_tools.py` run as a program on damaged data and bad options: one error line,
  no traceback, nothing written.
"""

import json
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer
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
    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.conversion.cact import CactFormatError, read_cact
    from needle_hf.conversion.export import ExportError, read_hf_tensors
    from needle_hf.conversion.native_checkpoint import CheckpointFormatError, load_native_checkpoint
    from needle_hf.models.needle.tokenization_needle import TokenizerSourceError, read_tokenizer_file
    from needle_hf.models.needle.weight_names import NeedleWeightsError

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

    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.conversion.safetensors_stream import write_safetensors
    from needle_hf.models.needle.weight_names import native_to_hf

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


# ---------------------------------------------------------------------------------------------------
# Fine-tuning data

_MARKERS = ["<tool_call>", "</tool_call>", "<|im_end|>", "<think>", "</think>", "\ufdd0", "\\", '"', "\n", "é北☀️"]
_TEXTS = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(_MARKERS)), max_size=3).map("".join)
_NUMBERS = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                     st.sampled_from([10**500, -(10**401), float("nan"), float("inf"), float("-inf"), 1e308]))
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXTS),
                     lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_TEXTS, inner, max_size=3)),
                     max_leaves=8)
_FINITE = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False), _TEXTS,
                    st.booleans(), st.none())
_ARGUMENT_VALUES = st.recursive(_FINITE, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(_TEXTS, inner, max_size=2)), max_leaves=6)
_TOOL_NAMES = ["get_weather", "set_alarm", "play_music", "send_message"]
_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
# Hostile replacements for one field of an otherwise well-formed example.
_FIELD_DAMAGE = st.sampled_from([
    None, None, None, "query", "tools", "answers", "call", "name", "arguments", "reasoning", "system", "duplicate tool",
    "unoffered", "key order", "extra field", "both answer fields", "tools as text", "wrapped",
])


@st.composite
def _examples(draw):
    """A well-formed example (tools, calls of offered tools, markers and non-ASCII inside its strings),
    then, often, one field made hostile."""
    names = draw(st.lists(st.sampled_from(_TOOL_NAMES), unique=True, max_size=3))
    tools = [{"name": name, "description": draw(_TEXTS), "parameters": _PARAMETERS} for name in names]
    calls = [{"name": draw(st.sampled_from(names)), "arguments": draw(st.dictionaries(_TEXTS, _ARGUMENT_VALUES, max_size=3))}
             for _ in range(draw(st.integers(0, 2)) if names else 0)]
    example = {"query": draw(_TEXTS), "tools": tools, "answers": calls}
    for field in ("reasoning", "system"):
        if draw(st.booleans()):
            example[field] = draw(_TEXTS)
    damage = draw(_FIELD_DAMAGE)
    if damage in ("query", "tools", "answers", "reasoning", "system"):
        example[damage] = draw(_JSON)
    elif damage in ("call", "name", "arguments") and calls:
        if damage == "call":
            calls[0] = draw(_JSON)
        else:
            calls[0][damage] = draw(_JSON)
    elif damage == "duplicate tool" and tools:
        tools.append(dict(tools[0]))
    elif damage == "unoffered":
        calls.append({"name": draw(st.sampled_from(_TOOL_NAMES + ["", "x"])), "arguments": {}})
    elif damage == "key order" and calls:
        calls[0] = {"arguments": calls[0]["arguments"], "name": calls[0]["name"]}
    elif damage == "extra field":
        example[draw(st.sampled_from(["answer", "id", "tool", ""]))] = draw(_JSON)
    elif damage == "both answer fields":
        example["function_calls"] = calls
    elif damage == "tools as text":
        example["tools"] = json.dumps(tools)
    elif damage == "wrapped" and tools:
        tools[0] = {"type": "function", "function": draw(st.one_of(st.just(tools[0]), _JSON))}
    return example


# Byte-level damage after the JSON is written.
_DAMAGE = ["none"] * 10 + ["bom", "latin1", "truncate", "deep", "surrogate", "nul", "control"]


def _damaged(line: str, damage: str, depth: int) -> bytes:
    data = line.encode("utf-8")
    if damage == "bom":
        return b"\xef\xbb\xbf" + data
    if damage == "latin1":
        return data[:1] + b"\xe9\xff" + data[1:]
    if damage == "truncate":
        return data[: len(data) // 2]
    if damage == "deep":
        return ('{"query":"q","answers":[{"name":"x","arguments":{"a":' + "[" * depth + "]" * depth + "}}]}").encode()
    if damage == "surrogate":
        return line.replace('"query":"', '"query":"\\udc80', 1).encode()
    if damage == "nul":
        return data + b"\x00"
    if damage == "control":
        return line.replace('"query":"', '"query":"\x01', 1).encode()
    return data


@st.composite
def _jsonl_files(draw):
    lines = []
    for _ in range(draw(st.integers(1, 2))):
        line = json.dumps(draw(_examples()), separators=(",", ":"), ensure_ascii=draw(st.booleans()))
        lines.append(_damaged(line, draw(st.sampled_from(_DAMAGE)), draw(st.sampled_from([63, 70, 3000, 100_000]))))
        if draw(st.booleans()):
            lines.append(draw(st.sampled_from([b"", b"  ", b"\r"])))
    return draw(st.sampled_from([b"\n", b"\r\n"])).join(lines)


@pytest.fixture(scope="module")
def demo_chat_tokenizer(demo_tokenizer):
    return demo_tokenizer


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.data_too_large])
@given(data=_jsonl_files())
def test_generated_finetune_files_train_only_on_parseable_offered_calls_or_fail_naming_file_and_line(
        demo_chat_tokenizer, data):
    from needle_hf.finetune.data import FinetuneDataError, encode_conversation, load_finetune_dataset
    from needle_hf.tools.tool_calls import parse_assistant_turn

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.jsonl"
        path.write_bytes(data)
        try:
            dataset = load_finetune_dataset(path)
        except FinetuneDataError as error:
            located = re.match(re.escape(str(path)) + r"(?::(\d+))?: \S", str(error))
            assert located, str(error)
            assert located.group(1) is None or 1 <= int(located.group(1)) <= data.count(b"\n") + 1
            return
    for row in dataset:
        ids, mask = encode_conversation(demo_chat_tokenizer, row["messages"], row["tools"],
                                        chat_template_kwargs=row["chat_template_kwargs"])
        target = [token for token, keep in zip(ids, mask) if keep][:-1]  # the EOS is no text
        turn = parse_assistant_turn(demo_chat_tokenizer.decode(target))
        assistant = row["messages"][-1]
        assert turn.tool_calls == [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
                                   for call in assistant["tool_calls"]]
        assert (turn.reasoning or "") == assistant["reasoning_content"].strip()
        offered = {tool.get("function", tool)["name"] if tool.get("type") == "function" else tool["name"]
                   for tool in json.loads(row["tools"])}
        assert {call["name"] for call in turn.tool_calls} <= offered


# ---------------------------------------------------------------------------------------------------
# Routing

ROUTING_POSITIONS = 64  # max_position_embeddings of the routing model: long texts are easy to generate


@pytest.fixture(scope="module")
def routing_model(demo_tokenizer):
    import torch

    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

    torch.manual_seed(0)
    native = dict(TINY_NATIVE_CONFIG, vocab_size=len(demo_tokenizer), max_seq_len=ROUTING_POSITIONS)
    config = NeedleConfig.from_needle_config(native, use_contrastive_head=True, use_confidence_head=True)
    return NeedleForCausalLM(config).eval()


_ROUTING_TEXT = st.one_of(_TEXTS, st.integers(1, 80).map(lambda words: "word " * words))
_VALID_TOP_K = st.one_of(st.none(), st.integers(1, 5))
_TOP_K = st.one_of(_VALID_TOP_K, _VALID_TOP_K, _VALID_TOP_K, st.one_of(st.integers(-3, 0), st.booleans(), st.floats(), _TEXTS))
_ROUTING_DAMAGE = st.sampled_from([None, None, None, None, "dict", "text", "entry", "name", "duplicate", "function",
                                   "long", "empty", "tuple"])


@st.composite
def _catalogues(draw):
    """A catalogue of named tools (some wrapped, descriptions up to past the position limit), often damaged."""
    names = draw(st.lists(st.sampled_from(_TOOL_NAMES), unique=True, min_size=1, max_size=4))
    tools = [{"name": name, "description": draw(_TEXTS), "parameters": _PARAMETERS} for name in names]
    if draw(st.booleans()):
        tools[-1] = {"type": "function", "function": tools[-1]}
    damage = draw(_ROUTING_DAMAGE)
    if damage == "dict":
        return {tool.get("name", "wrapped"): tool for tool in tools}
    if damage == "text":
        return json.dumps(tools)
    if damage == "entry":
        tools[0] = draw(_JSON)
    elif damage == "name":
        tools[0]["name"] = draw(_JSON)
    elif damage == "duplicate":
        tools.append(dict(tools[0]))
    elif damage == "function":
        tools[0] = {"type": "function", "function": draw(_JSON)}
    elif damage == "long":
        tools[0]["description"] = "word " * draw(st.integers(40, 200))
    elif damage == "empty":
        return []
    return tuple(tools) if damage == "tuple" else tools


@st.composite
def _embedding_specs(draw, catalogue):
    """None (embed the catalogue), or a tensor spec (rows, width, poisoned, dtype, unit rows), mostly of the right shape."""
    kind = draw(st.sampled_from(["none", "none", "right", "right", "wrong", "list"]))
    rows = len(catalogue) if isinstance(catalogue, (list, tuple)) else 2
    if kind == "none":
        return None
    if kind == "list":
        return [[0.0] * 16] * rows
    if kind == "right":
        return (rows, 16, draw(st.booleans()), draw(st.sampled_from(["float32", "float32", "float64", "int64"])),
                draw(st.booleans()))
    return draw(st.integers(0, 5)), draw(st.integers(1, 20)), False, "float32", True


_ROUTING_FIELD = re.compile(r"(tools(\[\d+\])?(\.(name|function))?|query|top_k|tool_embeddings): \S")


def _embeddings(spec):
    import torch

    if not isinstance(spec, tuple):
        return spec
    rows, width, poisoned, dtype, unit = spec
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * 31 + width))
    if unit:
        values = torch.nn.functional.normalize(values, dim=-1)
    values = values.to(getattr(torch, dtype))
    if poisoned and values.numel() and values.is_floating_point():
        values[-1, -1] = float("nan")
    return values


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), query=st.one_of(_ROUTING_TEXT, _ROUTING_TEXT, _JSON), top_k=_TOP_K)
def test_generated_routing_inputs_rank_or_fail_naming_the_field(routing_model, demo_tokenizer, data, query, top_k):
    from needle_hf.tools.tool_routing import ToolRoutingError, rank_tools

    catalogue = data.draw(_catalogues())
    embeddings = data.draw(_embedding_specs(catalogue))
    try:
        ranked = rank_tools(routing_model, demo_tokenizer, query, catalogue, top_k=top_k,
                            tool_embeddings=_embeddings(embeddings))
    except ToolRoutingError as error:
        assert _ROUTING_FIELD.match(str(error)), str(error)
        return
    assert len(ranked) == min(len(catalogue), top_k or len(catalogue))
    assert sorted(entry.index for entry in ranked) == sorted(set(entry.index for entry in ranked))
    assert all(-1.0001 <= entry.similarity <= 1.0001 for entry in ranked)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(top_k_tools=_TOP_K, threshold=st.one_of(st.none(), st.floats(), _TEXTS, st.booleans()),
       constrained=st.one_of(st.booleans(), st.integers(0, 1), _TEXTS))
def test_generated_caller_options_build_or_fail_naming_the_option(routing_model, demo_tokenizer, top_k_tools, threshold,
                                                                  constrained):
    from needle_hf.tools.tool_routing import NeedleToolCaller, ToolRoutingError

    try:
        caller = NeedleToolCaller(routing_model, demo_tokenizer, top_k_tools=top_k_tools,
                                  confidence_threshold=threshold, constrained=False if constrained is True else constrained)
    except ToolRoutingError as error:
        assert re.match(r"(top_k_tools|confidence_threshold|constrained)[: ]", str(error)), str(error)
        return
    assert caller.top_k_tools is None or caller.top_k_tools >= 1
    assert threshold is None or 0.0 <= caller.confidence_threshold <= 1.0


# ---------------------------------------------------------------------------------------------------
# examples/finetune_tools.py as a program

EXAMPLE_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "finetune_tools.py"


def _finetune_cases(root: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of hostile runs: damaged demo data (seeded) and bad options or paths."""
    from needle_hf.demo.data import make_demo_examples

    base = root / "base"
    base.mkdir()
    (base / "config.json").write_text("{}", encoding="utf-8")  # passes the cheap check; never loads
    valid = "".join(json.dumps(example) + "\n" for example in make_demo_examples(6, seed=0)).encode()
    rng = random.Random(20261204)
    cases = []
    for index, damage in enumerate(["flip", "truncate", "latin1"]):  # each run imports the package: a few only
        data = {"flip": lambda: _flip(valid, rng), "truncate": lambda: _truncate(valid, rng),
                "latin1": lambda: valid.replace(b'"query"', b'"qu\xe9ry"', 1)}[damage]()
        path = root / f"data-{index}.jsonl"
        path.write_bytes(data)
        cases.append((f"data-{damage}", [str(base), str(path), str(root / f"out-{index}"), "--held-out", "0.5"]))
    good = root / "good.jsonl"
    good.write_bytes(valid)
    out = str(root / "out")
    cases += [
        ("rank-0", [str(base), str(good), out, "--rank", "0"]),
        ("alpha-nan", [str(base), str(good), out, "--alpha", "nan"]),
        ("held-out-1", [str(base), str(good), out, "--held-out", "1"]),
        ("no-base", [str(root / "missing"), str(good), out]),
        ("out-is-base", [str(base), str(good), str(base)]),
        ("demo-over-other-data", [str(base), str(good), out, "--demo-data", "3"]),
        ("data-is-folder", [str(base), str(base), out]),
        ("not-a-number", [str(base), str(good), out, "--epochs", "three"]),
    ]
    return cases


def test_finetune_example_ends_bad_input_with_one_error_line_and_writes_nothing(tmp_path):
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(EXAMPLE_SCRIPT.parent.parent))
    for name, argv in _finetune_cases(tmp_path):
        before = sorted(str(p) for p in tmp_path.rglob("*"))
        child = subprocess.run([sys.executable, str(EXAMPLE_SCRIPT), *argv], capture_output=True, text=True,
                               timeout=CHILD_TIMEOUT_S, env=environment)
        assert child.returncode in (1, 2), (name, child.returncode, child.stderr[-2000:])
        assert "Traceback" not in child.stderr, (name, child.stderr[-2000:])
        last = child.stderr.strip().splitlines()[-1]
        assert re.match(r"finetune_tools(\.py)?: error: \S", last), (name, last)
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before, name
