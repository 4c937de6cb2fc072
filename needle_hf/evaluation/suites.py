"""Acceptance suites in the reference's format: what they hold and how they are found.

A suite module defines three names:

    TOOLS       the app's tools: functions (plain, `@needle_hf.tool` or the reference's `@needle.tool`),
                pydantic models or schema dicts, as `needle_hf.Needle(tools=...)` takes them
    SYSTEM      the system text (str)
    TEST_CASES  a list of cases, each ``{"query": str, "calls": [{"name", "arguments"}, ...],
                "category": str, "critical": bool}`` (``critical`` may be left out: False);
                ``calls == []`` means the right answer is no call

`load_suite` imports such a module by dotted name or file path; `find_suites` finds the reference's
six app suites in an installed `cactus-needle` (`needle.environments`). Suite modules written for the
reference import the `needle` package, so the reference's telemetry opt-outs are set in the process
environment before any suite is imported; importing the modules loads neither its native engine nor
anything that sends data (its engine starts only when one of its agents answers, which never happens
here: the modules' lazy ``agent`` attribute is never read).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pkgutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

#: The reference's telemetry opt-outs (cactus-needle's `needle/_telemetry.py` reads both).
REFERENCE_TELEMETRY_OPT_OUTS = {"NEEDLE_TELEMETRY": "0", "DO_NOT_TRACK": "1"}
#: Where an installed cactus-needle keeps its app suites.
REFERENCE_SUITES_PACKAGE = "needle.environments"
NO_REFERENCE_SUITES = ("the reference's app suites were not found: they ship with cactus-needle "
                       "(pip install 'cactus-needle==2.0.15'); `--module` runs a suite module of your own")


class SuiteError(ValueError):
    """A suite module that cannot be loaded or is not in the reference's format."""


@dataclass(frozen=True)
class Suite:
    """One acceptance suite.

    Attributes:
        name: the suite's name (the module's last dotted part, or the file's stem).
        tools: the module's ``TOOLS``, as written there (functions, pydantic models or schema dicts).
        system: the module's ``SYSTEM`` text.
        cases: the module's ``TEST_CASES`` as plain dicts ``{"query", "calls", "category", "critical"}``
            (``critical`` always a bool).
        source: where it was loaded from (a dotted module name or a file path).
    """

    name: str
    tools: list
    system: str
    cases: list[dict]
    source: str = field(default="", compare=False)

    @property
    def schemas(self) -> list[dict]:
        """The tools as schema dicts (``{"name", "description", "parameters"}``), in catalogue order."""
        from ..sdk.needle import resolve_tools

        return resolve_tools(self.tools)[0]

    @property
    def categories(self) -> list[str]:
        """The cases' categories, in order of first appearance."""
        return list(dict.fromkeys(case["category"] for case in self.cases))

    def __post_init__(self):
        # A Suite built by hand is checked and normalised as a module's is (``critical`` made a bool).
        where = self.source or self.name
        if not isinstance(self.name, str) or not self.name:
            raise SuiteError(f"Suite.name: expected a non-empty str, found {self.name!r}")
        if not isinstance(self.tools, (list, tuple)) or not self.tools:
            raise SuiteError(f"{where}.tools: expected a non-empty list of tools, found {self.tools!r}")
        if not isinstance(self.system, str):
            raise SuiteError(f"{where}.system: expected a str, found {type(self.system).__name__}")
        if not isinstance(self.cases, (list, tuple)) or not self.cases:
            raise SuiteError(f"{where}.cases: expected a non-empty list of cases, found {self.cases!r}")
        _check_schemas(self.tools, f"{where}.tools")
        object.__setattr__(self, "tools", list(self.tools))
        object.__setattr__(self, "cases", [_check_case(case, f"{where}.cases[{index}]")
                                           for index, case in enumerate(self.cases)])

    def __len__(self) -> int:
        return len(self.cases)


def quiet_reference() -> None:
    """Set the reference's telemetry opt-outs in the process environment (before `needle` is imported)."""
    os.environ.update(REFERENCE_TELEMETRY_OPT_OUTS)


def _check_schemas(tools, where: str) -> None:
    """Every tool has a schema before any case runs."""
    from ..sdk.needle import resolve_tools

    try:
        resolve_tools(list(tools))
    except (TypeError, ValueError) as error:
        raise SuiteError(f"{where}: {error}") from None


def _check_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        raise SuiteError(f"{where}: expected a call {{'name': str, 'arguments': dict}}, found {call!r}")
    if not isinstance(call["name"], str) or not isinstance(call["arguments"], dict):
        raise SuiteError(f"{where}: expected 'name' a str and 'arguments' a dict, found {call!r}")
    return call


def _check_case(case: Any, where: str) -> dict:
    if not isinstance(case, dict):
        raise SuiteError(f"{where}: expected a dict with query, calls, category, critical; found {type(case).__name__}")
    missing = [key for key in ("query", "calls", "category") if key not in case]
    if missing:
        raise SuiteError(f"{where}: missing {', '.join(missing)} (a case holds query, calls, category, critical)")
    if not isinstance(case["query"], str):
        raise SuiteError(f"{where}.query: expected a str, found {type(case['query']).__name__}")
    if not isinstance(case["category"], str):
        raise SuiteError(f"{where}.category: expected a str, found {type(case['category']).__name__}")
    if not isinstance(case["calls"], list):
        raise SuiteError(f"{where}.calls: expected a list of calls ([] for no call), "
                         f"found {type(case['calls']).__name__}")
    calls = [_check_call(call, f"{where}.calls[{index}]") for index, call in enumerate(case["calls"])]
    critical = case.get("critical", False)
    if not isinstance(critical, bool):
        raise SuiteError(f"{where}.critical: expected a bool, found {critical!r}")
    return {"query": case["query"], "calls": calls, "category": case["category"], "critical": critical}


def suite_from_module(module: ModuleType, *, name: str | None = None, source: str | None = None) -> Suite:
    """The `Suite` a module in the reference's format defines (``TOOLS``, ``SYSTEM``, ``TEST_CASES``).

    Reads only those three names (a reference module's lazy ``agent`` would start its engine)."""
    where = source or module.__name__
    values = {}
    for key in ("TOOLS", "SYSTEM", "TEST_CASES"):
        if key not in vars(module):
            raise SuiteError(f"{where}: a suite module defines TOOLS, SYSTEM and TEST_CASES; {key} is missing")
        values[key] = vars(module)[key]
    tools, system, cases = values["TOOLS"], values["SYSTEM"], values["TEST_CASES"]
    if not isinstance(tools, (list, tuple)) or not tools:
        raise SuiteError(f"{where}.TOOLS: expected a non-empty list of tools, found {tools!r}")
    if not isinstance(system, str):
        raise SuiteError(f"{where}.SYSTEM: expected a str, found {type(system).__name__}")
    if not isinstance(cases, (list, tuple)) or not cases:
        raise SuiteError(f"{where}.TEST_CASES: expected a non-empty list of cases, found {cases!r}")
    checked = [_check_case(case, f"{where}.TEST_CASES[{index}]") for index, case in enumerate(cases)]
    _check_schemas(tools, f"{where}.TOOLS")
    return Suite(name=name or module.__name__.rpartition(".")[2], tools=list(tools), system=system, cases=checked,
                 source=where)


def _import_file(path: Path) -> ModuleType:
    # A name of its own per file, so that two suites called `home.py` in different folders never meet.
    digest = hashlib.sha1(str(path).encode("utf-8")).hexdigest()[:10]
    module_name = f"needle_hf_suite_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SuiteError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # decorators and dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise
    return module


def load_suite(target: str | os.PathLike | ModuleType) -> Suite:
    """A suite from a module in the reference's format.

    Args:
        target: a module object, a file path (``my_suites/home.py``) or a dotted module name
            (``my_app.suite``, ``needle.environments.smart_home``).

    Raises `SuiteError` naming the module when it cannot be imported or is not in the format.
    """
    if isinstance(target, ModuleType):
        return suite_from_module(target)
    text = os.fspath(target)
    quiet_reference()
    path = Path(text)
    if text.endswith(".py") or os.sep in text or path.exists():
        if not path.is_file():
            raise SuiteError(f"{text}: no such suite file (expected a .py module with TOOLS, SYSTEM, TEST_CASES)")
        try:
            module = _import_file(path.resolve())
        except Exception as error:  # the user's module failed to import: say which and why
            raise SuiteError(f"{text}: importing the suite module failed: {type(error).__name__}: {error}") from error
        return suite_from_module(module, name=path.stem, source=text)
    try:
        module = importlib.import_module(text)
    except ModuleNotFoundError as error:
        if error.name and text.startswith(error.name):
            beside = Path(*text.split(".")).with_suffix(".py")
            hint = f"; the file {beside} is here: pass its path" if beside.is_file() else ""
            raise SuiteError(f"{text}: no module of that name on the import path (give a dotted module name or a .py "
                             f"file path){hint}") from None
        raise SuiteError(f"{text}: importing the suite module failed: {error}") from error
    except Exception as error:
        raise SuiteError(f"{text}: importing the suite module failed: {type(error).__name__}: {error}") from error
    return suite_from_module(module, source=text)


def find_suites() -> dict[str, Suite]:
    """The reference's app suites from an installed cactus-needle, name -> `Suite`, sorted by name.

    Empty (with a warning saying how to install them) when cactus-needle is not installed.
    """
    quiet_reference()
    try:
        spec = importlib.util.find_spec(REFERENCE_SUITES_PACKAGE)
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        warnings.warn(NO_REFERENCE_SUITES, stacklevel=2)
        return {}
    package = importlib.import_module(REFERENCE_SUITES_PACKAGE)
    suites = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{REFERENCE_SUITES_PACKAGE}.{info.name}")
        if {"TOOLS", "SYSTEM", "TEST_CASES"} <= set(vars(module)):
            suites[info.name] = suite_from_module(module)
    return suites


__all__ = ["NO_REFERENCE_SUITES", "REFERENCE_TELEMETRY_OPT_OUTS", "Suite", "SuiteError", "find_suites", "load_suite",
           "quiet_reference", "suite_from_module"]
