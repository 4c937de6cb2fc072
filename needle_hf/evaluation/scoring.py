"""The acceptance rule: one case's verdict from the agent's envelope, and a suite's from its cases.

A case passes when the calls the agent would act on equal the expected calls. The calls acted on
are the envelope's ``function_calls``, except that none are acted on when

    validation   the envelope's validation flags an ungrounded argument or a negated request, or
    confidence   ``confidence`` is below ``min_confidence`` (a missing or None confidence counts as 0.0)

(an answer voided so is a refusal: it passes exactly when the expected calls are ``[]``). Calls
are equal as lists (same calls, same order), or else as multisets: parallel calls in another order
match. A suite passes when at least ``round(0.9 * n)`` of its ``n`` cases pass and no critical case
fails. This is the reference harness's rule (`needle.environments._harness.run_tests`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

#: A suite passes with at least round(PASS_FRACTION * cases) passing cases and no critical failure.
PASS_FRACTION = 0.9


@dataclass(frozen=True)
class Verdict:
    """How one case was scored.

    Attributes:
        passed: the calls acted on equal the expected calls.
        got: the calls acted on ([] when none, or when the answer was voided).
        voided: None, or why the envelope's calls were not acted on: "ungrounded", "negation" or
            "low_confidence".
        match: None (failed), "exact" (same list) or "order_free" (the same calls in another order).
    """

    passed: bool
    got: list
    voided: Optional[str]
    match: Optional[str]


def _canonical(calls: list) -> list[str]:
    return sorted(json.dumps(call, sort_keys=True) for call in calls)


def calls_match(got: list, want: list) -> Optional[str]:
    """"exact", "order_free" or None: whether ``got`` equals ``want`` as a list, else as a multiset."""
    if got == want:
        return "exact"
    if _canonical(got) == _canonical(want):
        return "order_free"
    return None


def score_case(want: list, envelope: dict, *, min_confidence: float = 0.0) -> Verdict:
    """The verdict of one answer (``envelope``, as `needle_hf.Needle.complete` returns) against ``want``."""
    got = list(envelope.get("function_calls") or [])
    voided = None
    if got:
        checks = envelope.get("validation") or {}
        if checks.get("ungrounded"):
            voided = "ungrounded"
        elif checks.get("negation"):
            voided = "negation"
        else:
            confidence = envelope.get("confidence")
            if (0.0 if confidence is None else confidence) < min_confidence:
                voided = "low_confidence"
    if voided:
        got = []
    match = calls_match(got, want)
    return Verdict(passed=match is not None, got=got, voided=voided, match=match)


def pass_threshold(cases: int) -> int:
    """The fewest passing cases a suite of ``cases`` cases needs."""
    return round(PASS_FRACTION * cases)


def suite_passes(passed: int, cases: int, critical_failures: int) -> bool:
    """The suite's verdict: enough cases passed and no critical case failed."""
    return passed >= pass_threshold(cases) and critical_failures == 0


__all__ = ["PASS_FRACTION", "Verdict", "calls_match", "pass_threshold", "score_case", "suite_passes"]
