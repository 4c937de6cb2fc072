"""The README's Needle 3 section runs as written: its `needle-hf convert` line through the CLI, then its
Python block, on a checkpoint written by the reference; the block's greedy tokens are the reference's."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from needle3_reference import ALL_OPTIONS_NATIVE_CONFIG, make_native_params, reference_greedy, write_reference_checkpoint

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK_START = "# Needle 3"


def needle3_section() -> tuple[str, str]:
    """(the convert command line, the Python block) of the README's Needle 3 section."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Needle 3\n") :]
    section = section[: section.index("\n## ", 1)]
    command = re.search(r"^```bash\n(needle-hf convert [^\n]+)\n```", section, flags=re.MULTILINE).group(1)
    block = re.search(r"^```python\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE).group(1)
    assert block.startswith(BLOCK_START)
    return command, block


def test_readme_needle3_section_converts_and_generates(tmp_path, monkeypatch, one_cpu_thread):
    from needle_hf.cli import main

    command, block = needle3_section()
    params = make_native_params(ALL_OPTIONS_NATIVE_CONFIG, seed=3)
    argv = shlex.split(command)[1:]
    write_reference_checkpoint(tmp_path / argv[1], params, ALL_OPTIONS_NATIVE_CONFIG)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0

    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102  (the README's own code)
    prompt = namespace["ids"][0, 1:].tolist()
    new_tokens = namespace["out"].shape[1] - namespace["ids"].shape[1]
    expected = reference_greedy(ALL_OPTIONS_NATIVE_CONFIG, params, prompt, max_new_tokens=new_tokens)
    assert printed.getvalue().splitlines()[0] == str(expected)
