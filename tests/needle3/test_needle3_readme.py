"""The README's Needle 3 section runs as written: its `needle-hf` lines through the CLI, then its Python
block, on a checkpoint written by the reference and a tokenizer trained with Needle 3's settings; the
block's greedy tokens are the reference's `run.generate` tokens for the same prompt ids."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from needle.model.tokenizer import CHAT_MARKERS

from needle3_reference import ALL_OPTIONS_NATIVE_CONFIG, make_native_params, reference_greedy, write_reference_checkpoint
from needle_hf.conversion.needle3 import is_needle3_checkpoint
from spm_fixture import train_needle_spm

README = Path(__file__).resolve().parents[2] / "docs" / "needle3.md"
BLOCK_START = "# Needle 3"
# Every option on, with a vocabulary the fixture corpus can fill (its characters alone need ~490 pieces).
NATIVE_CONFIG = {**ALL_OPTIONS_NATIVE_CONFIG, "vocab_size": 900, "out_vocab": 880}


def needle3_section() -> tuple[list[list[str]], str]:
    """(the `needle-hf` command lines as argv lists, the Python blocks joined in order) of docs/needle3.md."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("# Needle 3\n") :]
    bash = re.search(r"^```bash\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE).group(1)
    commands = [shlex.split(line, comments=True)[1:] for line in bash.splitlines() if line.startswith("needle-hf ")]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)
    block = "".join(blocks)
    assert block.startswith(BLOCK_START) and commands
    return commands, block


def test_readme_needle3_section_converts_and_generates(tmp_path, monkeypatch, one_cpu_thread):
    from needle_hf.cli import main

    commands, block = needle3_section()
    convert, export, build, convert_back = commands
    assert convert[:3] == ["convert", "needle3.safetensors", "needle3-hf"] and export[0] == "export"
    assert build[0] == "build" and convert_back[:2] == ["convert", build[2]]
    params = make_native_params(NATIVE_CONFIG, seed=3)
    write_reference_checkpoint(tmp_path / "needle3.safetensors", params, NATIVE_CONFIG)
    model_path = train_needle_spm(tmp_path / "spm", vocab_size=NATIVE_CONFIG["vocab_size"],
                                  user_defined_symbols=list(CHAT_MARKERS))
    Path(model_path).rename(tmp_path / "tokenizer.model")
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert main(argv) == 0, argv
    assert is_needle3_checkpoint(tmp_path / export[2])

    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102  (the README's own code)
    prompt_ids = namespace["inputs"]["input_ids"][0].tolist()
    assert prompt_ids[0] == 2 and 4 in prompt_ids and 8 in prompt_ids  # BOS, <|im_start|>, <tools>
    new_tokens = namespace["out"].shape[1] - len(prompt_ids)
    expected = reference_greedy(NATIVE_CONFIG, params, prompt_ids[1:], max_new_tokens=new_tokens)
    lines = printed.getvalue().splitlines()
    assert lines[0] == str(expected)
    assert lines[2] == str(expected)  # the Flax twin's greedy tokens
