"""Acceptance suites: apps' tools and scored cases in the reference's format, run against a Needle model.

`suites` loads them (a user's module, or the reference's six from an installed cactus-needle).
Importing this package imports neither torch nor jax.
"""

from .suites import Suite, SuiteError, find_suites, load_suite

__all__ = ["Suite", "SuiteError", "find_suites", "load_suite"]
