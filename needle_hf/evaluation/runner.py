"""Running suites: each case asked of a fresh conversation, scored by the reference's rule.

    result = run_suite(suite, "needle2-hf")                 # a folder, a Hub id or a loaded model
    result = run_suite(suite, agent)                         # anything with reset() and complete(query)
    report = run_suites(find_suites(), "needle2-hf")         # the model loaded once for every suite

Given a model, the agent is `needle_hf.Needle(model, tools=suite.tools, system=suite.system)`. Given
an agent, it is used as it is (it must hold the suite's tools), as the reference harness uses its
per-suite agent: ``reset()`` before each case, then ``complete(query)``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterable, Mapping, Optional, Union

from .results import CaseResult, EvaluationResult, SuiteResult
from .scoring import score_case
from .suites import Suite


def _is_agent(value: Any) -> bool:
    return callable(getattr(value, "complete", None)) and callable(getattr(value, "reset", None))


def _check_gate(min_confidence: float) -> float:
    number = isinstance(min_confidence, (int, float)) and not isinstance(min_confidence, bool)
    if not number or not 0.0 <= min_confidence <= 1.0:
        raise ValueError(f"min_confidence: expected a number in [0, 1], got {min_confidence!r}")
    return float(min_confidence)


def _model_name(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    config = getattr(model, "config", None)
    return getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None) or type(model).__name__


def _progress_bar(total: int, description: str, *, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="case", disable=not enabled, file=sys.stderr, leave=True,
                dynamic_ncols=True)


def run_suite(suite: Suite, model_or_agent: Any, *, min_confidence: float = 0.0,
              max_new_tokens: Optional[int] = None, progress: bool = True) -> SuiteResult:
    """Run every case of ``suite`` and score it.

    Args:
        suite: a `Suite` (`load_suite`, `find_suites`).
        model_or_agent: a Needle folder, Hub id or loaded model (a `needle_hf.Needle` is built with
            the suite's tools and system), or an agent with ``reset()`` and ``complete(query)`` that
            already holds them.
        min_confidence: the confidence gate: calls of an answer below it are not acted on.
        max_new_tokens: passed to ``complete`` when given (default: the agent's own default).
        progress: show a progress bar on stderr.

    Returns a `SuiteResult`: per case the query, expected, got, envelope and verdict.
    """
    gate = _check_gate(min_confidence)
    if not isinstance(suite, Suite):
        raise TypeError(f"suite: expected a needle_hf.evaluation.Suite, got {type(suite).__name__}")
    agent = model_or_agent if _is_agent(model_or_agent) else _agent(suite, model_or_agent)
    options = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    results = []
    started = time.perf_counter()
    with _progress_bar(len(suite.cases), suite.name, enabled=progress) as bar:
        for index, case in enumerate(suite.cases):
            agent.reset()
            asked = time.perf_counter()
            envelope = agent.complete(case["query"], **options)
            seconds = time.perf_counter() - asked
            if not isinstance(envelope, dict):
                raise TypeError(f"{suite.name} case {index}: the agent's complete() returned a "
                                f"{type(envelope).__name__}, expected an envelope dict")
            verdict = score_case(case["calls"], envelope, min_confidence=gate)
            results.append(CaseResult(index=index, query=case["query"], category=case["category"],
                                      critical=case["critical"], expected=case["calls"], got=verdict.got,
                                      envelope=envelope, verdict="pass" if verdict.passed else "fail",
                                      voided=verdict.voided, match=verdict.match, seconds=seconds))
            bar.update(1)
            bar.set_postfix(passed=sum(result.passed for result in results), refresh=False)
    return SuiteResult(name=suite.name, cases=results, min_confidence=gate, seconds=time.perf_counter() - started)


def _agent(suite: Suite, model: Any, **options):
    from ..sdk.needle import Needle

    return Needle(model, tools=suite.tools, system=suite.system, **options)


def run_suites(suites: Union[Mapping[str, Suite], Iterable[Suite]], model: Any, *, min_confidence: float = 0.0,
               max_new_tokens: Optional[int] = None, progress: bool = True, framework: Optional[str] = None,
               grammar: bool = True) -> EvaluationResult:
    """Run several suites against one model, loaded once.

    Args:
        suites: `Suite`s, or a dict name -> `Suite` (as `find_suites` returns).
        model: a Needle folder, Hub id or loaded model (not an agent: an agent holds one suite's tools).
        framework: "pt" (default for a name) or "flax".
        grammar: constrain answers to valid calls (see `needle_hf.Needle`).
        min_confidence, max_new_tokens, progress: as in `run_suite`.
    """
    from ..sdk.engine import load_backend

    gate = _check_gate(min_confidence)
    suites = list(suites.values()) if isinstance(suites, Mapping) else list(suites)
    if _is_agent(model):
        raise TypeError("model: an agent holds one suite's tools; pass the model (a folder, Hub id or loaded model) "
                        "to run several suites, or call run_suite per suite with an agent of its tools")
    started = time.perf_counter()
    backend = load_backend(model, framework=framework, grammar=grammar)
    results = [run_suite(suite, _agent(suite, backend), min_confidence=gate, max_new_tokens=max_new_tokens,
                         progress=progress) for suite in suites]
    return EvaluationResult(results, model=_model_name(model), min_confidence=gate,
                            seconds=time.perf_counter() - started)


__all__ = ["run_suite", "run_suites"]
