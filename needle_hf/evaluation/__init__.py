"""Acceptance suites: an app's tools and scored cases in the reference's format, run against a Needle model.

`suites` loads them (a module of your own, or the reference's six from an installed cactus-needle),
`scoring` is the acceptance rule, `runner` asks each case of a `needle_hf.Needle`, `results` holds
what a run records (JSON, Markdown) and `report` writes it with a plot. Importing this package imports
neither torch nor jax.
"""

from .report import plot_pass_rates, write_report
from .results import CaseResult, EvaluationResult, Rate, SuiteResult
from .runner import run_suite, run_suites
from .scoring import Verdict, score_case
from .suites import Suite, SuiteError, find_suites, load_suite

__all__ = ["CaseResult", "EvaluationResult", "Rate", "Suite", "SuiteError", "SuiteResult", "Verdict", "find_suites",
           "load_suite", "plot_pass_rates", "run_suite", "run_suites", "score_case", "write_report"]
