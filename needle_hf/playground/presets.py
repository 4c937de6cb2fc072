"""The playground's presets: a tools box, a system box and a first query, filled in with one choice.

The demo preset is the shipped demo model's alarm tool. When cactus-needle is installed, each of the
reference's app suites (`needle_hf.evaluation.find_suites`) is a preset too: its tools rendered to
JSON schemas by `needle_hf.sdk`'s schema builder, its system text, and its first case's query. The
suites are read from the installed package when the playground starts; nothing of them is stored here.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """What one preset puts in the boxes: ``tools`` is the tools box's JSON text."""

    name: str
    tools: str
    system: str = ""
    query: str = ""


def tools_json(schemas: list) -> str:
    """The tools box's text for a list of schema dicts."""
    return json.dumps(schemas, indent=2, ensure_ascii=False)


def demo_preset() -> Preset:
    """The shipped demo model's tool and query (`needle_hf.demo`)."""
    from ..demo import DEMO_QUERY, DEMO_TOOLS

    return Preset(name="demo: set_alarm", tools=tools_json(DEMO_TOOLS), query=DEMO_QUERY)


def suite_presets() -> dict[str, Preset]:
    """name -> `Preset` of each app suite of an installed cactus-needle; empty without it."""
    from ..evaluation.suites import find_suites

    with warnings.catch_warnings():  # without cactus-needle the playground simply has no app presets
        warnings.simplefilter("ignore")
        suites = find_suites()
    return {name: Preset(name=name, tools=tools_json(suite.schemas), system=suite.system,
                         query=suite.cases[0]["query"] if suite.cases else "")
            for name, suite in suites.items()}


def default_presets() -> dict[str, Preset]:
    """The demo preset, then the app suites' (when cactus-needle is installed)."""
    demo = demo_preset()
    return {demo.name: demo, **suite_presets()}
