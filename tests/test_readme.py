"""Every Python block of README.md and of docs/*.md runs, in order, against the demo checkpoint
converted to `needle2-hf`: each document in a namespace of its own (a document's first block sets up
what its later ones use, as a reader would run them).

Runs under transformers 4.57 (`.venv`) and 5.x (`.venv-v5`); the block that starts with a
`# Flax` comment runs where transformers still has Flax models (4.57) and is checked to need them.
The folder also holds `data.jsonl` (demo fine-tuning examples) for the fine-tuning block. Every
block that parses tool calls must parse the demo's `set_alarm` call. The block that starts with
"# With `vllm serve` running" needs a server: the vLLM suite (`tests/serving/vllm`) makes the same
call against one, so it is not run here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

from needle_hf.demo.data import write_demo_jsonl
from demo_support import DEMO_CHECKPOINT, DEMO_TOKENIZER, build_folder_without_converter

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
HAS_FLAX = hasattr(transformers, "FlaxAutoModelForCausalLM")
NEEDS_SERVER = "# With `vllm serve` running"
# The Needle 3 block runs in the Needle 3 suite (tests/needle3/test_needle3_readme.py, .venv-n3).
NEEDLE3 = "# Needle 3"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


@pytest.fixture(scope="module")
def readme_folder(tmp_path_factory):
    """A folder holding `needle2-hf`: the demo checkpoint, converted as the README's commands do."""
    root = tmp_path_factory.mktemp("readme")
    try:
        from needle_hf.conversion.convert import convert
    except ImportError:  # transformers 5 venv: the converter is not installed there
        build_folder_without_converter(root / "needle2-hf")
    else:
        convert(DEMO_CHECKPOINT, root / "needle2-hf", tokenizer=DEMO_TOKENIZER)
    write_demo_jsonl(root / "data.jsonl", 32, seed=0)
    return root


def test_readme_has_the_usage_blocks():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 2
    every_block = [b for document in DOCUMENTS for b in python_blocks(document.read_text(encoding="utf-8"))]
    flax = [b for b in every_block if b.startswith("# Flax")]
    assert len(flax) == 1 and "FlaxAutoModelForCausalLM" in flax[0] and flax[0] in blocks
    # The rest runs on 5.x too (Needle 3's blocks run in the Needle 3 suite, Flax included).
    assert not any("Flax" in b for b in every_block if not b.startswith(("# Flax", NEEDLE3)))


def test_docs_are_linked_from_the_readme():
    text = README.read_text(encoding="utf-8")
    for document in DOCUMENTS[1:]:
        assert f"(docs/{document.name})" in text, f"README does not link docs/{document.name}"


def test_readme_stays_a_readme():
    assert len(README.read_bytes()) <= 10 * 1024


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_python_blocks_run_and_call_the_tool(document, readme_folder, monkeypatch):
    monkeypatch.chdir(readme_folder)
    namespace: dict = {}
    ran = expected = 0
    for block in python_blocks(document.read_text(encoding="utf-8")):
        if block.startswith((NEEDS_SERVER, NEEDLE3)):
            continue
        expected += 1
        if block.startswith("# Flax") and not HAS_FLAX:
            expected -= 1
            continue
        namespace.pop("calls", None)
        exec(compile(block, str(document), "exec"), namespace)  # noqa: S102  (the document's own code)
        ran += 1
        if "calls =" in block:  # a block that parses the model's answer gets the demo's call
            assert [call["name"] for call in namespace["calls"]] == ["set_alarm"], block
            assert set(namespace["calls"][0]["arguments"]) == {"time"}
    assert ran == expected
    if document == README:
        assert ran >= (3 if HAS_FLAX else 2)


def test_every_python_block_of_the_docs_runs_somewhere():
    ran = sum(len(python_blocks(d.read_text(encoding="utf-8"))) for d in DOCUMENTS)
    server_only = sum(b.startswith(NEEDS_SERVER) for d in DOCUMENTS for b in python_blocks(d.read_text(encoding="utf-8")))
    assert ran - server_only >= 19  # the blocks of README and docs today (the vLLM block runs in its suite)
