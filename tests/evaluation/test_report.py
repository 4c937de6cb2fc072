"""Reports of a run, without a model: the Markdown table escapes what the cells hold, the JSON keeps
every field, the plot is a PNG, and an existing report or a missing matplotlib stops the writer
before it writes anything."""

from __future__ import annotations

import json
import sys

import pytest

from needle_hf.evaluation import CaseResult, EvaluationResult, SuiteResult, write_report

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)


def _case(index, category, verdict, *, query="play a | b", critical=False):
    calls = [{"name": "play", "arguments": {"song": "a | b"}}]
    return CaseResult(index=index, query=query, category=category, critical=critical, expected=calls,
                      got=calls if verdict == "pass" else [], envelope={"function_calls": calls, "error_code": None},
                      verdict=verdict, voided=None if verdict == "pass" else "negation",
                      match="exact" if verdict == "pass" else None)


@pytest.fixture
def result():
    cases = [_case(0, "positive", "pass"), _case(1, "positive", "fail", critical=True), _case(2, "negation", "pass")]
    return SuiteResult(name="music", cases=cases, min_confidence=0.25)


def test_markdown_and_json_hold_every_case(result):
    assert (result.passed, result.total, result.threshold, result.passes) == (2, 3, 3, False)
    assert {name: str(rate) for name, rate in result.by_category.items()} == {"positive": "1/2", "negation": "1/1"}
    text = result.to_markdown()
    assert "| music | 2/3 | 67% | 1 | FAIL | 1/2 | 1/1 |" in text
    assert "play a \\| b" in text and "voided (negation)" in text and "confidence gate 0.25" in text
    data = json.loads(result.to_json())
    assert data["critical_failures"] == [1] and data["categories"]["positive"]["rate"] == 0.5
    assert data["cases"][1]["envelope"]["function_calls"][0]["arguments"]["song"] == "a | b"
    both = EvaluationResult([result, SuiteResult(name="other", cases=[_case(0, "parallel", "pass")])])
    assert both.categories == ["positive", "negation", "parallel"] and both["other"].passes and not both.passes
    assert "| other | 1/1 | 100% | 0 | PASS | - | - | 1/1 |" in both.table()


def test_write_report_writes_the_report_and_a_png_and_refuses_to_overwrite(result, tmp_path):
    report, plot = write_report(result, tmp_path / "music.json")
    assert json.loads(report.read_text(encoding="utf-8"))["suites"][0]["name"] == "music"
    assert plot == tmp_path / "music.png" and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileExistsError, match="music.json exists"):
        write_report(result, tmp_path / "music.json")
    write_report(result, tmp_path / "music.json", overwrite=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["music.json", "music.png"]  # no temporary left


def test_without_matplotlib_the_writer_says_which_extra_and_writes_nothing(result, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=r"needle-hf\[eval\]"):
        write_report(result, tmp_path / "music.md")
    assert list(tmp_path.iterdir()) == []
