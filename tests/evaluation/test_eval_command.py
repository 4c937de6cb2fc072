"""`needle-hf eval suites` end to end on the shipped demo model (converted to a folder), and a clear
error, status 1 and nothing written for bad input.

On the demo (512 positions, trained on five phone tools) the reference's six suites fail: their
prompts do not fit, every answer is a refusal, and only the cases that expect no call pass. The
phone suite of these tests passes under a confidence gate of 0.4 (see test_verdict_parity.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from needle_hf.cli import main
from needle_hf.evaluation.command import SUITE_FAILED
from needle_hf.evaluation.suites import NO_REFERENCE_SUITES
from demo_support import demo_folder  # noqa: F401  (the demo model as a Hugging Face folder)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

HERE = Path(__file__).resolve().parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIX = ["data_capture", "kitchen_appliance", "media_player", "productivity", "smart_home", "wearable"]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_six_suites_on_the_demo_folder_print_the_table_and_write_md_and_png(demo_folder, tmp_path, capsys):  # noqa: F811
    report = tmp_path / "suites.md"
    status = main(["eval", "suites", str(demo_folder), "--report", str(report)])
    out, err = capsys.readouterr()
    assert status == SUITE_FAILED
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| suite | passed | rate | critical failures | verdict | positive |")
    assert [row.split(" | ")[0][2:] for row in table[1:]] == SIX
    assert all(" FAIL " in row for row in table[1:]) and "0/6 suites pass" in out
    assert all(f"{name}: 100%" in err for name in SIX) and "32/32" in err  # the progress bars
    text = report.read_text(encoding="utf-8")
    assert text.startswith("# Acceptance suites: ") and text.count("\n## ") == 6
    assert "error: context_length" in text  # why every case of the demo is a refusal
    width, height = _png_size(report.with_suffix(".png"))
    assert width > 400 and height > 200


def test_a_user_module_under_a_gate_passes_and_writes_json(demo_folder, tmp_path, capsys):  # noqa: F811
    report = tmp_path / "phone.json"
    status = main(["eval", "suites", str(demo_folder), "--module", str(HERE / "phone_suite.py"), "--suite",
                   "phone_suite", "--min-confidence", "0.4", "--report", str(report)])
    out, _ = capsys.readouterr()
    assert status == 0 and "1/1 suites pass" in out and "confidence gate 0.4" in out
    data = json.loads(report.read_text(encoding="utf-8"))
    assert data["passes"] is True and data["min_confidence"] == 0.4
    [suite] = data["suites"]
    assert (suite["name"], suite["passed"], suite["total"], suite["threshold"]) == ("phone_suite", 9, 10, 9)
    assert suite["categories"]["positive"] == {"passed": 5, "total": 5, "rate": 1.0}
    case = suite["cases"][8]
    assert {"query", "expected", "got", "envelope", "verdict"} <= set(case)
    assert (case["category"], case["verdict"], case["voided"], case["got"]) == ("parallel", "fail", "low_confidence", [])
    assert case["envelope"]["function_calls"] and case["envelope"]["confidence"] < 0.4
    assert _png_size(report.with_suffix(".png"))[0] > 0


@pytest.fixture
def demo_path(demo_folder):  # noqa: F811
    return str(demo_folder)


@pytest.mark.parametrize("arguments, message", [
    (["eval", "suites", "/no/such/folder"], "FOLDER /no/such/folder: no such folder"),
    (["eval", "suites", "{folder}", "--suite", "toaster"], "--suite toaster: no such suite; known suites: data_capture"),
    (["eval", "suites", "{folder}", "--module", "{bad_module}"], "TOOLS is missing"),
    (["eval", "suites", "{folder}", "--module", "no_such_suite_module"], "no_such_suite_module: no module of that name"),
    (["eval", "suites", "{folder}", "--min-confidence", "1.5"], "--min-confidence: expected a number in [0, 1]"),
    (["eval", "suites", "{folder}", "--report", "{tmp}/out.txt"], "expected a .md or .json file name"),
    (["eval", "suites", "{folder}", "--report", "{tmp}/existing.md"], "existing.md exists"),
    (["eval", "suites", "{tmp}"], "no config.json"),
], ids=["missing-folder", "unknown-suite", "module-without-tools", "unknown-module", "gate", "report-suffix",
        "report-exists", "not-a-model-folder"])
def test_bad_input_gets_a_clear_error_and_writes_nothing(arguments, message, demo_path, tmp_path, capsys):
    bad_module = tmp_path / "no_tools.py"
    bad_module.write_text("SYSTEM = ''\nTEST_CASES = [{'query': 'q', 'calls': [], 'category': 'c'}]\n",
                          encoding="utf-8")
    existing = tmp_path / "existing.md"
    existing.write_text("keep me", encoding="utf-8")
    before = sorted(tmp_path.iterdir())
    status = main([part.format(folder=demo_path, bad_module=bad_module, tmp=tmp_path) for part in arguments])
    out, err = capsys.readouterr()
    assert status == 1 and out == ""
    assert err.startswith("needle-hf eval: error: ") and message in err and "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == before and existing.read_text(encoding="utf-8") == "keep me"


def test_without_cactus_needle_the_command_says_how_to_get_the_suites(demo_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "needle", None)
    monkeypatch.setitem(sys.modules, "needle.environments", None)
    assert main(["eval", "suites", demo_path]) == 1
    assert NO_REFERENCE_SUITES in capsys.readouterr().err
