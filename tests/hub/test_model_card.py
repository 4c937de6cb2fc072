"""The model card: metadata the Hub client parses and validates, figures taken from the folder, and
usage snippets that run as written.

The card under test is the one rendered for a real conversion (`needle_hf.conversion.convert` of a
reference checkpoint with the session's SentencePiece fixture), so its provenance and parity rows
come from the converter's own `conversion_report.json`. Expected numbers come from the reference's
parameter tree, the native config and hashlib, not from the code under test.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid

import jax
import pytest
import torch
from huggingface_hub import ModelCard

from hub_support import (
    MAIN_PYTHON,
    TINY_WITH_TOKENIZER,
    V5_PYTHON,
    child_environment,
    finish_python,
    interpreter_or_skip,
    start_python,
    write_child_script,
)
from needle_reference import BASE_NATIVE_CONFIG, _param_shapes, make_native_params, write_native_checkpoint

import needle_hf
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.hub import push_folder
from needle_hf.tools.tool_calls import ToolCallParseError, parse_tool_calls
from needle_hf.hub.model_card import (
    LICENSE,
    NEEDLE2_REPO_ID,
    TAGS,
    folder_model_card,
    parameter_count,
    render_model_card,
)
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM

EXPECTED_METADATA = {
    "license": "apache-2.0",  # cactus-needle 2.x is published under Apache-2.0
    "library_name": "transformers",
    "pipeline_tag": "text-generation",
}


def reference_parameter_count(native_config: dict, *, with_heads: bool) -> int:
    """Parameters of the reference's own parameter tree for this config."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(_param_shapes(native_config, with_heads)))


def table_rows(card_text: str, section: str) -> dict[str, str]:
    """{first cell: second cell} of the Markdown table under `## section`."""
    body = card_text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[0] and set(cells[0]) != {"-"}:
            rows[cells[0]] = cells[1]
    return rows


def python_snippets(card_text: str) -> dict[str, str]:
    """{### heading: code} of every ```python block of the card."""
    snippets = {}
    for heading, code in re.findall(r"^### (.+?)\n\n```python\n(.*?)\n```", card_text, flags=re.MULTILINE | re.DOTALL):
        snippets[heading] = code
    return snippets


@pytest.fixture(scope="module")
def converted(tmp_path_factory, needle_spm_model):
    """A real conversion: checkpoint path, output folder, and the report it wrote."""
    from needle_hf.conversion.convert import REPORT_NAME, convert

    scratch = tmp_path_factory.mktemp("card")
    checkpoint = scratch / "needle-tiny.pkl"
    write_native_checkpoint(checkpoint, make_native_params(TINY_WITH_TOKENIZER, seed=11), TINY_WITH_TOKENIZER)
    out_dir = scratch / "needle-tiny-hf"
    convert(checkpoint, out_dir, tokenizer=needle_spm_model, verify_with="auto")
    report = json.loads((out_dir / REPORT_NAME).read_text(encoding="utf-8"))
    return checkpoint, out_dir, report


@pytest.fixture(scope="module")
def card_text(converted) -> str:
    _, out_dir, _ = converted
    return str(folder_model_card(out_dir, repo_id="needle-tester/needle2-tiny", base_model=NEEDLE2_REPO_ID))


def test_metadata_parses_back_with_the_hub_clients_model_card(card_text, tmp_path):
    path = tmp_path / "README.md"
    path.write_text(card_text, encoding="utf-8")

    loaded = ModelCard.load(path, ignore_metadata_errors=False)

    assert loaded.data.to_dict() == {
        **EXPECTED_METADATA,
        "base_model": NEEDLE2_REPO_ID,
        "tags": list(TAGS),
    }
    assert LICENSE == EXPECTED_METADATA["license"]
    assert loaded.text.lstrip().startswith("# needle2-tiny")


def test_base_model_is_left_out_when_unknown(converted):
    _, out_dir, _ = converted
    card = folder_model_card(out_dir, repo_id="needle-tester/needle2-tiny")

    assert "base_model" not in card.data.to_dict()


def test_architecture_table_describes_the_needle2_geometry():
    config = NeedleConfig.from_needle_config(BASE_NATIVE_CONFIG)
    rows = table_rows(str(render_model_card(config, repo_id="org/needle2")), "Architecture")

    expected_parameters = reference_parameter_count(BASE_NATIVE_CONFIG, with_heads=False)
    assert rows["Parameters"].startswith(f"{expected_parameters:,} (")
    assert rows["Decoder layers"] == str(BASE_NATIVE_CONFIG["num_layers"])
    assert rows["Hidden size"] == str(BASE_NATIVE_CONFIG["d_model"])
    assert rows["Attention"].startswith(
        f"{BASE_NATIVE_CONFIG['num_heads']} query heads, {BASE_NATIVE_CONFIG['num_kv_heads']} key/value heads, "
        f"head_dim {BASE_NATIVE_CONFIG['d_model'] // BASE_NATIVE_CONFIG['num_heads']}"
    )
    assert rows["Engram memory layers"] == ", ".join(map(str, BASE_NATIVE_CONFIG["engram_layers"]))
    assert rows["Engram n-gram orders"] == "2, 3"  # the reference default
    assert rows["Engram tables"].startswith("4 (2 hash heads per order), 8,192 slots")
    assert rows["Hyper-connection lanes"] == "4"
    assert rows["Vocabulary"].startswith("8,192")
    assert rows["Extra heads"] == "multi-token prediction (t+2)"


def test_parameter_count_matches_the_reference_tree_with_every_head():
    config = NeedleConfig.from_needle_config(TINY_WITH_TOKENIZER, use_contrastive_head=True, use_confidence_head=True)

    assert parameter_count(config) == reference_parameter_count(TINY_WITH_TOKENIZER, with_heads=True)
    assert parameter_count(config) == sum(p.numel() for p in NeedleForCausalLM(config).parameters())


def test_conversion_section_shows_provenance_and_the_measured_parity(converted, card_text):
    checkpoint, _, report = converted
    rows = table_rows(card_text, "Conversion")

    assert rows["Source sha256"] == f"`{hashlib.sha256(checkpoint.read_bytes()).hexdigest()}`"
    assert rows["Source file"].startswith(f"`{checkpoint.name}`")
    assert f"Converted with needle-hf {needle_hf.__version__}" in card_text
    measured = report["verification"]["max_abs_logit_diff"]
    assert rows["Max abs logit difference vs source"].startswith(f"{measured:.2e} (tolerance ")
    assert measured <= report["verification"]["tolerance"]
    assert rows["Tensors read back"] == "bit-exact"


def test_card_without_conversion_report_says_there_is_none():
    card = render_model_card(NeedleConfig.from_needle_config(TINY_WITH_TOKENIZER), repo_id="org/name")

    assert "carries no `conversion_report.json`" in str(card)
    assert table_rows(str(card), "Conversion") == {}


def test_card_snippets_are_the_documented_set(card_text):
    assert list(python_snippets(card_text)) == [
        "Tools and messages",
        "PyTorch (transformers 4.57 or 5.x)",
        "Flax (transformers 4.57 with jax and flax)",
        "Pipeline with tools (transformers 5.x)",
    ]


# --------------------------------------------------------------------------------------------------
# Checks that need a huggingface_hub >= 1.0 client or a whole interpreter: run in child processes.

VALIDATE_SCRIPT = """
import json
import sys
from pathlib import Path

from huggingface_hub import ModelCard

arguments = json.loads(sys.argv[1])
card = ModelCard.load(arguments["card"])
card.validate()  # raises ValueError with the Hub's message when the metadata is refused
Path(arguments["result"]).write_text(json.dumps({"validated": card.data.to_dict()}))
"""


def test_card_passes_the_hub_clients_validate(card_text, tmp_path):
    # huggingface_hub < 1.0 posts ModelCard.validate to huggingface.co whatever HF_ENDPOINT says; 1.x
    # posts to the endpoint, so the .venv-v5 client validates against the local hub.
    python = interpreter_or_skip(V5_PYTHON, "its huggingface_hub >= 1.0 validates against HF_ENDPOINT")
    card = tmp_path / "README.md"
    card.write_text(card_text, encoding="utf-8")
    script = write_child_script(tmp_path, "validate.py", VALIDATE_SCRIPT)
    result = tmp_path / "result.json"

    outcome = finish_python(
        start_python(
            python,
            script,
            {"card": str(card), "result": str(result)},
            environment=child_environment(hf_home=tmp_path / "hf_home"),
            cwd=tmp_path,
        ),
        result_file=result,
        timeout=120,
        what="the card validation child",
    )

    assert outcome["validated"] == {**EXPECTED_METADATA, "base_model": NEEDLE2_REPO_ID, "tags": list(TAGS)}


SNIPPET_SCRIPT = """
import contextlib
import io
import json
import sys
from pathlib import Path

arguments = json.loads(sys.argv[1])
namespace, printed = {}, {}
for heading, code in arguments["snippets"].items():
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, heading, "exec"), namespace)
    printed[heading] = output.getvalue()
Path(arguments["result"]).write_text(json.dumps(printed))
"""

# Which snippets run where; each entry is one child process, all started at once (the Flax one
# spends most of its time compiling, so it runs apart from the PyTorch snippet of the same venv).
SNIPPETS_BY_ENVIRONMENT = {
    "transformers-4.57-pytorch": (MAIN_PYTHON, ("Tools and messages", "PyTorch (transformers 4.57 or 5.x)")),
    "transformers-4.57-flax": (MAIN_PYTHON, ("Tools and messages", "Flax (transformers 4.57 with jax and flax)")),
    "transformers-5": (
        V5_PYTHON,
        ("Tools and messages", "PyTorch (transformers 4.57 or 5.x)", "Pipeline with tools (transformers 5.x)"),
    ),
}


@pytest.fixture(scope="module")
def snippet_runs(converted, local_hub, tmp_path_factory):
    """Push the converted folder, then run the pushed card's snippets in every environment at once."""
    _, out_dir, _ = converted
    repo_id = f"{local_hub.user}/needle-card-{uuid.uuid4().hex[:8]}"
    push_folder(out_dir, repo_id, base_model=NEEDLE2_REPO_ID)
    card = (out_dir / "README.md").read_text(encoding="utf-8")
    assert f'repo_id = "{repo_id}"' in card
    snippets = python_snippets(card)
    started = {}
    for name, (python, headings) in SNIPPETS_BY_ENVIRONMENT.items():
        if not python.exists():
            started[name] = f"{python} is missing; run scripts/setup.sh to create it"
            continue
        scratch = tmp_path_factory.mktemp(f"snippets-{name}")
        script = write_child_script(scratch, "run_snippets.py", SNIPPET_SCRIPT)
        arguments = {"snippets": {heading: snippets[heading] for heading in headings}, "result": str(scratch / "out.json")}
        process = start_python(
            python, script, arguments, environment=child_environment(hf_home=scratch / "hf_home"), cwd=scratch
        )
        started[name] = (process, scratch / "out.json")
    runs = {}
    for name, entry in started.items():
        if isinstance(entry, str):
            runs[name] = entry
            continue
        process, result = entry
        try:
            runs[name] = finish_python(process, result_file=result, timeout=300, what=f"the {name} snippet child")
        except AssertionError as error:
            runs[name] = error
    return repo_id, runs


@pytest.fixture(scope="module")
def package_reply(converted) -> str:
    """What the package's own model answers to the snippets' request, greedily, in 48 new tokens."""
    from transformers import PreTrainedTokenizerFast

    _, out_dir, _ = converted
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    model = NeedleForCausalLM.from_pretrained(out_dir)
    namespace = {}
    exec(python_snippets((out_dir / "README.md").read_text(encoding="utf-8"))["Tools and messages"], namespace)
    prompt = tokenizer.apply_chat_template(
        namespace["messages"], tools=namespace["tools"], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        output = model.generate(
            prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=48, do_sample=False
        )
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("environment", SNIPPETS_BY_ENVIRONMENT)
def test_card_snippets_run_and_print_the_package_models_reply(snippet_runs, package_reply, environment):
    _, runs = snippet_runs
    run = runs[environment]
    if isinstance(run, str):
        pytest.skip(run)
    if isinstance(run, Exception):
        raise run
    _, headings = SNIPPETS_BY_ENVIRONMENT[environment]

    assert run["Tools and messages"] == ""
    for heading in headings[1:]:
        if heading == "Pipeline with tools (transformers 5.x)":
            # 5.x's pipeline returns the answer parsed by the folder's response_template: the snippet
            # prints its calls, which are the calls of the package model's reply.
            try:
                expected = parse_tool_calls(package_reply)
            except ToolCallParseError:  # a plain answer: no calls
                expected = []
            assert json.loads(run[heading]) == expected, heading
        else:
            assert run[heading] == package_reply + "\n", heading
