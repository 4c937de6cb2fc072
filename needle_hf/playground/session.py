"""What the playground's Run button does, without the web page: one query against one folder.

`PlaygroundSession` holds the folders a playground may switch between and loads each on first use
(a folder's model and tokenizer are loaded once and kept); `run` answers one query with a fresh
`needle_hf.Needle` over the tools given, so every Run is a new conversation, as in a reference
suite case. Its result (`PlaygroundAnswer`) is what the page shows. Importing this module imports
neither gradio, torch nor jax.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..sdk.needle import Needle, resolve_tools

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class PlaygroundAnswer:
    """One Run's result, as the page shows it.

    calls: ``[{"name", "arguments"}, ...]`` (the envelope's ``function_calls``); reasoning: the
    ``<think>`` text; confidence: None when nothing was generated; validation: ``{"ungrounded",
    "negation"}``; error: None, or what went wrong (bad tools JSON, a malformed or cut-short answer).
    """

    calls: list = field(default_factory=list)
    reasoning: str = ""
    confidence: Optional[float] = None
    validation: dict = field(default_factory=lambda: {"ungrounded": [], "negation": False})
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    error: Optional[str] = None

    @classmethod
    def from_envelope(cls, envelope: dict) -> "PlaygroundAnswer":
        return cls(calls=envelope["function_calls"], reasoning=envelope["reasoning"],
                   confidence=envelope["confidence"], validation=envelope["validation"],
                   prefill_tps=envelope["prefill_tps"], decode_tps=envelope["decode_tps"], error=envelope["error"])

    def calls_json(self) -> str:
        return json.dumps(self.calls, indent=2, ensure_ascii=False)

    def speed_line(self) -> str:
        return f"prefill {self.prefill_tps:,.0f} tok/s · decode {self.decode_tps:,.0f} tok/s"

    def confidence_line(self) -> str:
        return "—" if self.confidence is None else f"{self.confidence:.3f}"

    def validation_line(self) -> str:
        flags = [f"ungrounded: {', '.join(self.validation['ungrounded'])}"] if self.validation["ungrounded"] else []
        if self.validation["negation"]:
            flags.append("negated request")
        return "; ".join(flags) or "no flags"


def parse_tools(text: str) -> list[dict]:
    """The tools box: a JSON list of tool schemas (``{"name", "description", "parameters"}`` or
    OpenAI's ``{"type": "function", "function": {...}}``). Raises ValueError naming the problem."""
    if not text.strip():
        return []
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"tools: not valid JSON ({error})") from None
    if isinstance(tools, dict):  # a single schema
        tools = [tools]
    if not isinstance(tools, list):
        raise ValueError(f"tools: expected a JSON list of tool schemas, got a JSON {type(tools).__name__}")
    schemas, _ = resolve_tools(tools)
    return schemas


class PlaygroundSession:
    """The folders (or Hub ids) a playground serves, each loaded on first use and kept.

    Args:
        folders: converted Needle folders or Hub ids, in the order the model selector lists them.
        framework: "pt" (default) or "flax", for every folder.
    """

    def __init__(self, folders: Sequence[str | os.PathLike], *, framework: Optional[str] = None):
        names = [os.fspath(folder) for folder in folders]
        if not names:
            raise ValueError("folders: name at least one converted Needle folder or Hub id")
        if len(set(names)) != len(names):
            raise ValueError(f"folders: each folder once, got {names}")
        self.folders = names
        self.framework = framework
        self._backends: dict = {}
        self._lock = threading.Lock()  # one load and one answer at a time: the page may send Runs concurrently

    def loaded(self) -> list[str]:
        """The folders loaded so far."""
        return [name for name in self.folders if name in self._backends]

    def backend(self, folder: str):
        """The loaded model + tokenizer of ``folder`` (loaded now if it is the first use)."""
        from ..sdk.engine import load_backend

        if folder not in self.folders:
            raise ValueError(f"model: {folder!r} is not one of this playground's folders {self.folders}")
        if folder not in self._backends:
            self._backends[folder] = load_backend(folder, framework=self.framework)
        return self._backends[folder]

    def run(self, folder: str, tools: str, query: str, system: str = "", *,
            max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> PlaygroundAnswer:
        """Answer ``query`` with ``folder``'s model over ``tools`` (the tools box's JSON text)."""
        try:
            schemas = parse_tools(tools)
        except (TypeError, ValueError) as error:
            return PlaygroundAnswer(error=str(error))
        with self._lock:
            try:
                backend = self.backend(folder)
            except (OSError, ValueError) as error:  # a missing folder, an unreachable Hub id, not a Needle model
                return PlaygroundAnswer(error=f"{folder}: the model could not be loaded: {error}")
            try:
                agent = Needle(backend, tools=schemas, system=system or None)
            except ValueError as error:  # a tool the answer grammar cannot constrain
                return PlaygroundAnswer(error=str(error))
            return PlaygroundAnswer.from_envelope(agent.complete(query, max_new_tokens))
