"""Reports of a suite run: Markdown or JSON, with a PNG of pass rate per category per suite beside it.

    write_report(result, "suites.md")     # writes suites.md and suites.png
    write_report(result, "suites.json")   # writes suites.json and suites.png

The plot needs matplotlib (the ``eval`` extra: ``pip install 'needle-hf[eval]'``). Files are written
whole (a temporary file renamed into place), and an existing report or plot is replaced only with
``overwrite=True``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from .results import EvaluationResult, SuiteResult

REPORT_FORMATS = (".md", ".json")
PASS_LINE = 0.9  # drawn on the plot: the share of cases a suite needs


def check_report_path(path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """(report, plot) paths for ``path``; raises ValueError / FileExistsError before anything runs."""
    report = Path(path)
    if report.suffix.lower() not in REPORT_FORMATS:
        raise ValueError(f"report {report}: expected a .md or .json file name, found {report.suffix or 'no suffix'!r}")
    plot = report.with_suffix(".png")
    if not report.parent.is_dir():
        raise FileNotFoundError(f"report {report}: the folder {report.parent} does not exist")
    for target in (report, plot):
        if target.exists() and not overwrite:
            raise FileExistsError(f"report {report}: {target} exists (pass overwrite=True / --overwrite to replace it)")
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(f"report {report}: the plot {plot.name} needs matplotlib "
                                  "(pip install 'needle-hf[eval]')")
    return report, plot


def _write_atomically(path: Path, write) -> None:
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def plot_pass_rates(result: EvaluationResult | SuiteResult, path) -> Path:
    """A PNG of the pass rate per category (bars) per suite (groups), with the 90% line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if isinstance(result, SuiteResult):
        result = EvaluationResult([result], min_confidence=result.min_confidence)
    categories = result.categories
    suites = result.suites
    width = 0.8 / max(len(categories), 1)
    figure = Figure(figsize=(max(6.0, 1.6 * len(suites) + 2.0), 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for offset, category in enumerate(categories):
        rates = [suite.by_category[category].rate if category in suite.by_category else 0.0 for suite in suites]
        positions = [index - 0.4 + width * (offset + 0.5) for index in range(len(suites))]
        axes.bar(positions, rates, width=width, label=category)
    axes.axhline(PASS_LINE, color="black", linestyle="--", linewidth=1, label="90%")
    labels = [f"{suite.name}\n{suite.passed}/{suite.total} {'PASS' if suite.passes else 'FAIL'}" for suite in suites]
    axes.set_xticks(range(len(suites)), labels)
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("pass rate")
    gate = f", confidence gate {result.min_confidence:g}" if result.min_confidence else ""
    axes.set_title(f"Acceptance suites: pass rate per category{gate}")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    path = Path(path)
    _write_atomically(path, lambda temporary: figure.savefig(temporary, format="png"))
    return path


def write_report(result: EvaluationResult | SuiteResult, path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write the report (Markdown for .md, JSON for .json) and the plot beside it (.png); returns both paths."""
    report, plot = check_report_path(path, overwrite=overwrite)
    if isinstance(result, SuiteResult):
        result = EvaluationResult([result], min_confidence=result.min_confidence)
    text = result.to_json() + "\n" if report.suffix.lower() == ".json" else result.to_markdown()
    plot_pass_rates(result, plot)
    _write_atomically(report, lambda temporary: Path(temporary).write_text(text, encoding="utf-8"))
    return report, plot


__all__ = ["REPORT_FORMATS", "check_report_path", "plot_pass_rates", "write_report"]
