"""What a suite run records, and its JSON and Markdown forms.

Per case: the query, the expected calls, the calls acted on (``got``), the agent's whole envelope
and the verdict. Per category and per suite: passed / total. Per run: the suites, the model and the
confidence gate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from .scoring import pass_threshold, suite_passes


@dataclass(frozen=True)
class CaseResult:
    """One scored case.

    Attributes:
        index: the case's position in the suite's ``TEST_CASES``.
        query, category, critical, expected: the case as the suite writes it (``expected``: its calls).
        got: the calls acted on (the envelope's calls, or [] when voided; see `scoring`).
        envelope: what the agent's ``complete(query)`` returned.
        verdict: "pass" or "fail".
        voided: None, "ungrounded", "negation" or "low_confidence".
        match: None, "exact" or "order_free".
        seconds: the wall time of the answer.
    """

    index: int
    query: str
    category: str
    critical: bool
    expected: list
    got: list
    envelope: dict
    verdict: str
    voided: Optional[str] = None
    match: Optional[str] = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict:
        return {"index": self.index, "query": self.query, "category": self.category, "critical": self.critical,
                "expected": self.expected, "got": self.got, "verdict": self.verdict, "voided": self.voided,
                "match": self.match, "seconds": self.seconds, "envelope": self.envelope}


@dataclass(frozen=True)
class Rate:
    """``passed`` of ``total`` cases."""

    passed: int
    total: int

    @property
    def rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def __str__(self) -> str:
        return f"{self.passed}/{self.total}"

    def to_dict(self) -> dict:
        return {"passed": self.passed, "total": self.total, "rate": self.rate}


@dataclass(frozen=True)
class SuiteResult:
    """One suite's run: every case's result, and the suite's verdict (see `scoring`).

    Attributes:
        name: the suite's name.
        cases: one `CaseResult` per case, in the suite's order.
        min_confidence: the confidence gate the run used.
        seconds: the wall time of the run.
    """

    name: str
    cases: list[CaseResult]
    min_confidence: float = 0.0
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return len(self.cases)

    @property
    def passed(self) -> int:
        return sum(case.passed for case in self.cases)

    @property
    def critical_failures(self) -> list[CaseResult]:
        return [case for case in self.cases if case.critical and not case.passed]

    @property
    def threshold(self) -> int:
        """The fewest passing cases this suite needs."""
        return pass_threshold(self.total)

    @property
    def passes(self) -> bool:
        return suite_passes(self.passed, self.total, len(self.critical_failures))

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def by_category(self) -> dict[str, Rate]:
        """Category -> `Rate`, in order of first appearance."""
        counts: dict[str, list[int]] = {}
        for case in self.cases:
            tally = counts.setdefault(case.category, [0, 0])
            tally[0] += case.passed
            tally[1] += 1
        return {name: Rate(passed, total) for name, (passed, total) in counts.items()}

    def to_dict(self) -> dict:
        return {"name": self.name, "passes": self.passes, "passed": self.passed, "total": self.total,
                "pass_rate": self.pass_rate, "threshold": self.threshold,
                "critical_failures": [case.index for case in self.critical_failures],
                "min_confidence": self.min_confidence, "seconds": self.seconds,
                "categories": {name: rate.to_dict() for name, rate in self.by_category.items()},
                "cases": [case.to_dict() for case in self.cases]}

    def to_json(self, *, indent: Optional[int] = 2) -> str:
        return _json(self.to_dict(), indent)

    def to_markdown(self) -> str:
        """The summary row of this suite and its per-case table."""
        return EvaluationResult([self], min_confidence=self.min_confidence).to_markdown()


@dataclass(frozen=True)
class EvaluationResult:
    """A run of several suites against one model.

    Attributes:
        suites: one `SuiteResult` per suite, in run order.
        model: what was evaluated (a folder, a Hub id, or the model's name).
        min_confidence: the confidence gate.
    """

    suites: list[SuiteResult]
    model: str = ""
    min_confidence: float = 0.0
    seconds: float = field(default=0.0)

    @property
    def passes(self) -> bool:
        """Every suite passes."""
        return all(suite.passes for suite in self.suites)

    @property
    def categories(self) -> list[str]:
        """Every category of every suite, in order of first appearance."""
        return list(dict.fromkeys(name for suite in self.suites for name in suite.by_category))

    def __getitem__(self, name: str) -> SuiteResult:
        for suite in self.suites:
            if suite.name == name:
                return suite
        raise KeyError(f"no suite named {name!r} in this result (suites: {[s.name for s in self.suites]})")

    def to_dict(self) -> dict:
        return {"model": self.model, "min_confidence": self.min_confidence, "seconds": self.seconds,
                "passes": self.passes, "suites": [suite.to_dict() for suite in self.suites]}

    def to_json(self, *, indent: Optional[int] = 2) -> str:
        return _json(self.to_dict(), indent)

    def table(self) -> str:
        """The summary as a Markdown table: one row per suite, a column per category."""
        categories = self.categories
        header = ["suite", "passed", "rate", "critical failures", "verdict", *categories]
        rows = []
        for suite in self.suites:
            rates = suite.by_category
            rows.append([suite.name, f"{suite.passed}/{suite.total}", f"{suite.pass_rate:.0%}",
                         str(len(suite.critical_failures)), "PASS" if suite.passes else "FAIL",
                         *(str(rates[name]) if name in rates else "-" for name in categories)])
        return _markdown_table(header, rows)

    def to_markdown(self) -> str:
        """The report: the summary table, then each suite's cases."""
        gate = f", confidence gate {self.min_confidence:g}" if self.min_confidence else ""
        title = f"# Acceptance suites{f': {self.model}' if self.model else ''}"
        lines = [title, "",
                 f"A suite passes with at least 90% of its cases passing and no critical case failing{gate}.", "",
                 self.table()]
        for suite in self.suites:
            lines += ["", f"## {suite.name}: {'PASS' if suite.passes else 'FAIL'} "
                          f"({suite.passed}/{suite.total}, needs {suite.threshold}, "
                          f"{len(suite.critical_failures)} critical failures)", ""]
            rows = [[str(case.index), case.category, "yes" if case.critical else "", case.verdict.upper(),
                     case.query, _compact(case.expected), _compact(case.got), _note(case)] for case in suite.cases]
            lines.append(_markdown_table(["#", "category", "critical", "verdict", "query", "expected", "got", "note"],
                                         rows))
        return "\n".join(lines) + "\n"


def _note(case: CaseResult) -> str:
    notes = []
    if case.voided:
        raw = case.envelope.get("function_calls") or []
        notes.append(f"voided ({case.voided}): {_compact(raw)}")
    if case.match == "order_free":
        notes.append("matched in another order")
    if case.envelope.get("error_code"):
        notes.append(f"error: {case.envelope['error_code']}")
    return "; ".join(notes)


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_cell(cell) for cell in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _json(data: dict, indent: Optional[int]) -> str:
    return json.dumps(data, indent=indent, ensure_ascii=False, default=str)


__all__ = ["CaseResult", "EvaluationResult", "Rate", "SuiteResult"]
