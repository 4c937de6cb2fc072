"""The smart-home demo: its data generator (categories, valid calls, never the suite's queries) and its
shipped model (the committed weights with the fetched Needle 2 tokenizer give the recorded suite figures)."""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path

import pytest

from needle_hf.demo.smart_home import (
    CATEGORIES, HELD_OUT_SEED, SMART_HOME_TOOLS, TRAIN_SEED, is_held_out_query, make_smart_home_examples,
)
from needle_hf.demo.smart_home_model import MODEL_DIR, assemble_smart_home_folder
from needle_hf.finetune.data import conversations_dataset

os.environ.setdefault("NEEDLE_TELEMETRY", "0")  # the reference's suites import its SDK
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parent.parent
RESULTS = MODEL_DIR.parent / "smart_home_results.json"
SAMPLE = 6000  # examples per seed checked against the suite's queries


def _suite():
    return pytest.importorskip("needle.environments.smart_home")


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9%]+", text.lower()))


def _near(generated: str, query: str) -> bool:
    """Exact or near-exact: same words, a ratio of 0.9 or more, or the query filling most of the generated text."""
    if generated == query:
        return True
    matcher = difflib.SequenceMatcher(None, generated, query)
    if matcher.real_quick_ratio() >= 0.9 and matcher.quick_ratio() >= 0.9 and matcher.ratio() >= 0.9:
        return True
    return f" {query} " in f" {generated} " and len(query) >= 0.6 * len(generated)


def _schema_without_descriptions(node):
    if isinstance(node, dict):
        return {key: _schema_without_descriptions(value) for key, value in node.items() if key != "description"}
    if isinstance(node, list):
        return [_schema_without_descriptions(value) for value in node]
    return node


def test_our_tool_definitions_are_the_suites_apart_from_descriptions():
    from needle_hf.sdk.needle import resolve_tools

    suite_schemas, _ = resolve_tools(_suite().TOOLS)
    assert _schema_without_descriptions(SMART_HOME_TOOLS) == _schema_without_descriptions(suite_schemas)


def test_the_generator_never_emits_a_suite_query_or_a_near_copy():
    queries = [_words(case["query"]) for case in _suite().TEST_CASES]
    examples = make_smart_home_examples(SAMPLE, seed=TRAIN_SEED) + make_smart_home_examples(SAMPLE, seed=HELD_OUT_SEED)
    hits = [(example["query"], query) for example in examples for query in queries
            if _near(_words(example["query"]), query)]
    assert hits == []


def _check_call(call: dict, query: str) -> None:
    """A call of one of the five tools with schema-valid arguments, optional ones only when the query states them."""
    schemas = {schema["name"]: schema["parameters"] for schema in SMART_HOME_TOOLS}
    parameters = schemas[call["name"]]
    arguments = call["arguments"]
    assert set(parameters.get("required", [])) <= set(arguments) <= set(parameters["properties"]), (query, call)
    lowered = query.lower()
    for name, value in arguments.items():
        schema = parameters["properties"][name]
        if "enum" in schema:
            assert value in schema["enum"], (query, call)
            if name == "room":
                assert (value.replace("_", " ") in lowered) or (value == "living_room" and "lounge" in lowered)
            elif name in ("color", "speed"):
                assert value in lowered, (query, call)
        else:
            assert isinstance(value, int) and schema["minimum"] <= value <= schema["maximum"], (query, call)
            assert re.search(rf"(?<!\d){value}(?!\d)", query), (query, call)  # numbers as digits, copied from the query


def test_the_generator_covers_every_category_with_valid_answers():
    examples = make_smart_home_examples(3000, seed=TRAIN_SEED)
    by_category = {category: [e for e in examples if e["category"] == category] for category in CATEGORIES}
    assert all(len(found) > 100 for found in by_category.values()), {c: len(v) for c, v in by_category.items()}
    for example in by_category["positive"]:
        assert len(example["answers"]) == 1
        _check_call(example["answers"][0], example["query"])
    for example in by_category["parallel"]:
        assert len(example["answers"]) == 2 and example["answers"][0]["name"] != example["answers"][1]["name"]
        for call in example["answers"]:
            _check_call(call, example["query"])
    for category in ("missing", "irrelevant", "negation", "invalid"):
        assert all(example["answers"] == [] for example in by_category[category]), category
    called = {call["name"] for example in examples for call in example["answers"]}
    assert called == {schema["name"] for schema in SMART_HOME_TOOLS}
    optional = {(call["name"], name) for example in examples for call in example["answers"] for name in call["arguments"]}
    assert {("control_lights", "brightness_percent"), ("control_lights", "color"), ("control_fan", "speed"),
            ("start_robot_vacuum", "room")} <= optional
    # every example is a valid fine-tuning row (the format's own checks)
    assert len(conversations_dataset([{k: v for k, v in e.items() if k != "category"} for e in examples[:200]])) == 200


def test_the_split_and_the_seed():
    train = make_smart_home_examples(500, seed=TRAIN_SEED, split="train")
    held_out = make_smart_home_examples(200, seed=HELD_OUT_SEED, split="held_out")
    assert not any(is_held_out_query(e["query"]) for e in train)
    assert all(is_held_out_query(e["query"]) for e in held_out)
    assert make_smart_home_examples(50, seed=7) == make_smart_home_examples(50, seed=7)
    with pytest.raises(ValueError, match="split"):
        make_smart_home_examples(1, seed=0, split="test")


def test_the_shipped_model_gives_the_recorded_suite_figures(tmp_path):
    """The committed weights + the fetched tokenizer, run through `needle_hf.Needle` by the reference's own
    harness, pass the smart_home suite's categories exactly as smart_home_results.json records."""
    import contextlib
    import io

    from needle.environments import _harness

    from needle_hf.sdk.needle import Needle

    suite = _suite()
    recorded = json.loads(RESULTS.read_text())["suites"]["smart_home"]
    folder = assemble_smart_home_folder(tmp_path / "smart_home")
    _harness._agents[suite.__name__] = Needle(str(folder), tools=suite.TOOLS, system=suite.SYSTEM)
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            verdict = _harness.run_tests(suite, verbose=True)
    finally:
        _harness._agents.pop(suite.__name__, None)
    failed = [line.split("]", 1)[0].removeprefix("FAIL [") for line in printed.getvalue().splitlines()
              if line.startswith("FAIL [")]
    per_category = {category: {"passed": entry["cases"] - failed.count(category), "cases": entry["cases"]}
                    for category, entry in recorded["per_category"].items()}
    assert per_category == recorded["per_category"]
    assert bool(verdict) == recorded["suite_passes"]


def test_needle_hf_eval_suites_runs_on_the_shipped_weights_folder(tmp_path, capsys):
    """`needle-hf eval suites needle_hf/demo/smart_home_weights` on the folder as a clean clone has it
    (config, weights and the fetched `tokenizer.model`, no converted tokenizer) prints the table with
    the recorded figures; the folder is left as it was."""
    from needle_hf.cli import main as needle_hf_main
    from needle_hf.evaluation.command import SUITE_FAILED

    _suite()
    recorded = json.loads(RESULTS.read_text())["suites"]["smart_home"]
    before = sorted(path.name for path in MODEL_DIR.iterdir())
    report = tmp_path / "smart_home.json"
    status = needle_hf_main(["eval", "suites", str(MODEL_DIR), "--suite", "smart_home", "--report", str(report)])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| smart_home |"))
    assert row.startswith(f"| smart_home | {recorded['passed']}/{recorded['cases']} |")
    assert status == (0 if recorded["suite_passes"] else SUITE_FAILED)
    written = json.loads(report.read_text())["suites"][0]
    assert {category: {"passed": entry["passed"], "cases": entry["total"]}
            for category, entry in written["categories"].items()} == recorded["per_category"]
    assert sorted(path.name for path in MODEL_DIR.iterdir()) == before


def test_the_readme_and_the_demo_page_give_the_recorded_figures():
    """README's table and docs/demo.md's tables are the results JSON's figures, category by category."""
    recorded = json.loads(RESULTS.read_text())
    suite, held_out = recorded["suites"]["smart_home"], recorded["held_out"]
    critical = int(suite["harness_summary"].split(" passed, ")[1].split(" critical")[0])
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    demo_page = (REPO / "docs" / "demo.md").read_text(encoding="utf-8")
    order = re.search(r"\| set \| passed \| (.*) \|\n", readme).group(1).split(" | ")
    assert sorted(order) == sorted(CATEGORIES)

    def cells(figures):
        return " | ".join(f"{figures[c]['passed']}/{figures[c]['cases']}" for c in order)

    failures = f", {critical} critical failure{'s' if critical != 1 else ''}" if critical else ", no critical failure"
    assert (f"| smart_home suite | {suite['passed']}/{suite['cases']}{failures} | {cells(suite['per_category'])} |"
            in readme)
    assert f"| held-out | {held_out['passed']}/{held_out['cases']} | {cells(held_out['per_category'])} |" in readme
    page_order = re.search(r"\| suite \| passed \| passes \| (.*) \|\n", demo_page).group(1).split(" | ")
    for name, figures in recorded["suites"].items():
        row = " | ".join(f"{figures['per_category'][c]['passed']}/{figures['per_category'][c]['cases']}" for c in page_order)
        passes = "yes" if figures["suite_passes"] else "no"
        assert f"| {name} | {figures['passed']}/{figures['cases']} | {passes} | {row} |" in demo_page


def test_the_shipped_model_builds_a_cact(tmp_path):
    from needle_hf.cli import main as needle_hf_main
    from needle_hf.demo.smart_home_model import tokenizer_path

    folder = assemble_smart_home_folder(tmp_path / "smart_home")
    assert needle_hf_main(["build", str(folder), str(tmp_path / "smart_home.cact"), "--tokenizer",
                           str(tokenizer_path())]) == 0
    assert (tmp_path / "smart_home.cact").stat().st_size > 100_000
