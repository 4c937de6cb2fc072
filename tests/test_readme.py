"""Every Python block of README.md runs, in order, against the demo checkpoint converted to `needle2-hf`.

Runs under transformers 4.57 (`.venv`) and 5.x (`.venv-v5`); the block that starts with a
`# Flax` comment runs where transformers still has Flax models (4.57) and is checked to need them.
The folder also holds `data.jsonl` (demo fine-tuning examples) for the fine-tuning block. Every
block that parses tool calls must parse the demo's `set_alarm` call. The block that starts with
"# With `vllm serve` running" needs a server: the vLLM suite (`tests/vllm_serving`) makes the same
call against one, so it is not run here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

from needle_hf.demo_data import write_demo_jsonl
from test_pipeline import DEMO_CHECKPOINT, DEMO_TOKENIZER, _build_folder_without_converter

README = Path(__file__).resolve().parent.parent / "README.md"
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
        _build_folder_without_converter(root / "needle2-hf")
    else:
        convert(DEMO_CHECKPOINT, root / "needle2-hf", tokenizer=DEMO_TOKENIZER)
    write_demo_jsonl(root / "data.jsonl", 32, seed=0)
    return root


def test_readme_has_the_usage_blocks():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 2
    flax = [b for b in blocks if b.startswith("# Flax")]
    assert len(flax) == 1 and "FlaxAutoModelForCausalLM" in flax[0]
    assert not any("Flax" in b for b in blocks if not b.startswith("# Flax"))  # the rest runs on 5.x too


def test_readme_python_blocks_run_and_call_the_tool(readme_folder, monkeypatch):
    monkeypatch.chdir(readme_folder)
    namespace: dict = {}
    ran = expected = 0
    for block in python_blocks(README.read_text(encoding="utf-8")):
        if block.startswith((NEEDS_SERVER, NEEDLE3)):
            continue
        expected += 1
        if block.startswith("# Flax") and not HAS_FLAX:
            expected -= 1
            continue
        namespace.pop("calls", None)
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102  (the README's own code)
        ran += 1
        if "calls =" in block:  # a block that parses the model's answer gets the demo's call
            assert [call["name"] for call in namespace["calls"]] == ["set_alarm"], block
            assert set(namespace["calls"][0]["arguments"]) == {"time"}
    assert ran == expected >= (6 if HAS_FLAX else 5)
