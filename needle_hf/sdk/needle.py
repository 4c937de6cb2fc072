"""`Needle`: the reference SDK's agent (`needle.Needle`) on a Hugging Face Needle model.

A reference user changes ``from needle import Needle`` to ``from needle_hf import Needle`` and
names a model (a converted folder, a Hub id or a loaded model); `complete`, `run`, `extract` and
`reset` keep their names, arguments and result keys.

The envelope `complete` returns (one dict per answer):

    type            "call" (the answer holds calls) or "respond" (no call: nothing applies, a
                    refusal, or the end of a `run`)
    success         the answer was a well-formed, complete tool-call turn
    error           None, or what went wrong (malformed or cut-short answer, prompt too long)
    error_code      None, "malformed", "truncated" or "context_length"
    function_calls  [{"name", "arguments"}, ...]; [] when no call applies
    reasoning       the text of the answer's <think> block ("" without one)
    confidence      the confidence head's probability of the turn (prompt + answer), capped by the
                    smallest probability among the answer's tokens (after the grammar's mask), the
                    reference's "min with the call tokens' probability"; without a confidence
                    head, that smallest token probability alone; None when nothing was generated
    validation      {"ungrounded": ["Tool.path", ...], "negation": bool}: see
                    `needle_hf.sdk.validation` for the rules
    prefill_tps, decode_tps   prompt tokens per second of the prefill, answer tokens per second after it
    peak_ram_mb     the process's peak resident memory so far, in MB

The conversation. `complete(text)` adds a user turn and answers it; earlier turns stay in the
prompt until `reset()` (the oldest exchanges are left out when the prompt would not fit). `run`
feeds each round of results back as `tool` messages, which the chat template writes as the next
user turn (`<tool_result>[...]</tool_result>`, the JSON list of the results).

Retrieval. With more tools than ``top_k_tools`` (default 5, the reference engine's number) and a
model with a contrastive head, each user turn offers the model only the ``top_k_tools`` tools the
head ranks closest to the query (in catalogue order); the grammar and the tools block hold only
those. Without a contrastive head every tool is offered. ``top_k_tools=None`` turns retrieval off.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from typing import Any, Optional, Sequence

import numpy as np

from ..finetune.data import checked_option
from ..tools.tool_calls import ToolCallParseError, parse_assistant_turn
from . import validation
from .tools_schema import is_pydantic_model, tool_schema_of

#: The reference engine's retrieval width: at most this many tools are rendered per turn.
DEFAULT_TOP_K_TOOLS = 5


class ExtractionValidationError(ValueError):
    """`extract(strict=True)` found values that the input text does not ground."""


def _peak_ram_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _jsonable(value: Any) -> Any:
    """A tool's return value as JSON data (pydantic models dumped, anything else unknown as its str)."""
    def default(item):
        if hasattr(item, "model_dump"):
            return item.model_dump()
        if is_pydantic_model(type(item)) and hasattr(item, "dict"):
            return item.dict()
        return str(item)

    return json.loads(json.dumps(value, default=default))


def resolve_tools(tools) -> tuple[list[dict], dict]:
    """(schemas, {name: callable}) of a tools argument: a list of functions, pydantic models and
    schema dicts, or a JSON string of a list of schemas."""
    if tools is None:
        return [], {}
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"tools: a string must be a JSON list of tool schemas ({error})") from None
    if isinstance(tools, dict) or not isinstance(tools, Sequence):
        raise TypeError(f"tools: expected a list of tools, got {type(tools).__name__}")
    schemas, functions = [], {}
    for index, entry in enumerate(tools):
        schema = _named_schema(entry, where=f"tools[{index}]")
        if callable(entry) or is_pydantic_model(entry):
            functions[schema["name"]] = entry
        schemas.append(schema)
    return schemas, functions


def _named_schema(entry, *, where: str) -> dict:
    """`tool_schema_of` of ``entry``, which must name its tool; ``where`` names it in errors."""
    schema = tool_schema_of(entry, where=where)
    if not isinstance(schema.get("name"), str) or not schema["name"]:
        raise ValueError(f"{where}: a tool schema needs a non-empty string 'name', got {schema!r}")
    return schema


def _check_grammar_takes(schemas: list[dict]) -> None:
    """Refuse, when the agent is made, a tool whose parameters the answer grammar cannot constrain
    (it would fail every later call that offers it)."""
    from ..generation.grammar import ToolGrammarError, tool_calls_json_schema

    for index, schema in enumerate(schemas):
        try:
            tool_calls_json_schema([schema])
        except ToolGrammarError as error:
            raise ToolGrammarError(f"tools[{index}]: {error} (grammar=False decodes without the grammar)") from None


def _checked_text(name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}: {value!r:.80}")
    return value


def _tool_text(schema: dict) -> str:
    """The text a tool is embedded from (as `needle_hf.tools.tool_routing.tool_text`): compact JSON of the schema."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class Needle:
    """A tool-calling agent on a Needle model, with the reference SDK's calls.

    Args:
        model: a converted folder or Hub id (loaded with the Auto classes), or a loaded
            `NeedleForCausalLM` / `FlaxNeedleForCausalLM`.
        tools: functions (plain or `@needle_hf.tool`, also the reference's `@needle.tool`),
            pydantic models, schema dicts, or a JSON string of a list of schemas.
        system: the system text.
        framework: "pt" (default for a name) or "flax".
        tokenizer: a tokenizer, or a folder or Hub id holding one; default: the model folder's.
        grammar: constrain every answer to a valid call of the offered tools (needs llguidance,
            the `[grammar]` extra; without it decoding is unconstrained). False turns it off.
        top_k_tools: retrieval width (see the module docstring); None: offer every tool.
        compile: PyTorch: decode with a static cache and compiled layer programs.
        device: PyTorch: the device to load the model on.
        cpu_threads: PyTorch on the CPU: torch's thread count while answering (default 1; see
            `needle_hf.sdk.engine.load_backend`).
    """

    def __init__(self, model=None, tools=None, system: Optional[str] = None, *, framework: Optional[str] = None,
                 tokenizer=None, grammar: bool = True, top_k_tools: Optional[int] = DEFAULT_TOP_K_TOOLS,
                 compile: bool = False, device=None, cpu_threads: int = 1):
        from .engine import _Backend, load_backend

        if model is None:
            raise ValueError("model: name a converted Needle folder, a Hub id or a loaded model "
                             "(needle_hf has no built-in weights)")
        if top_k_tools is not None and (isinstance(top_k_tools, bool) or not isinstance(top_k_tools, int)
                                        or top_k_tools < 1):
            raise ValueError(f"top_k_tools: expected a positive int or None, got {top_k_tools!r}")
        if system is not None:
            _checked_text("system", system)
        self._backend = model if isinstance(model, _Backend) else load_backend(
            model, framework=framework, tokenizer=tokenizer, grammar=grammar, compile=compile, device=device,
            cpu_threads=cpu_threads)
        self._tool_schemas, self._functions = resolve_tools(tools)
        if self._backend.grammar is not None:
            _check_grammar_takes(self._tool_schemas)
        self._system = (system or "").strip()
        self.top_k_tools = top_k_tools
        self._tool_embeddings: Optional[np.ndarray] = None
        self.reset()

    @property
    def framework(self) -> str:
        return self._backend.framework

    @property
    def tools(self) -> list[dict]:
        """The tool schemas, in catalogue order."""
        return list(self._tool_schemas)

    # -- the reference's calls ------------------------------------------------------------------

    def complete(self, text: str = "", max_new_tokens: int = 256) -> dict:
        """Answer ``text`` as the next user turn; returns the envelope (module docstring).

        A call that raises (bad arguments, an interrupted generation) leaves the conversation as it
        was before it."""
        _checked_text("text", text)
        max_new_tokens = checked_option("max_new_tokens", max_new_tokens, low=1, integer=True)
        with self._turn():
            return self._complete(text, max_new_tokens)

    def _complete(self, text: str, max_new_tokens: int) -> dict:
        self._see(text)
        self._messages.append({"role": "user", "content": text})
        self._last_query = text
        self._offered = self._route(text)
        return self._answer(max_new_tokens, check_years=True)

    def run(self, query: str = "", max_steps: int = 8, max_new_tokens: int = 256, *, strict: bool = True) -> dict:
        """The agent loop: answer, call the functions, feed the results back, until an answer calls nothing.

        Stops at a "respond" answer, an answer without calls or after ``max_steps`` rounds of calls.
        A call to a name with no function, or a function that raises, gives ``{"error": ...}`` as its
        result. With ``strict``, a call with an ungrounded argument (a flagged path whose value is
        not a number written in the query or system text) is not made; its result is
        ``{"error": "ungrounded Tool.path, ..."}`` naming the paths. Returns the last envelope with
        ``results``: every result, in call order. A run that raises leaves the conversation as it was
        before it (the functions it called have run).
        """
        _checked_text("query", query)
        max_steps = checked_option("max_steps", max_steps, low=0, integer=True)
        max_new_tokens = checked_option("max_new_tokens", max_new_tokens, low=1, integer=True)
        with self._turn():
            return self._run(query, max_steps, max_new_tokens, strict=strict)

    def _run(self, query: str, max_steps: int, max_new_tokens: int, *, strict: bool) -> dict:
        response = self._complete(query, max_new_tokens)
        executed = []
        for _ in range(max_steps):
            calls = response.get("function_calls") or []
            if response.get("type") != "call" or not calls:
                break
            flagged = validation.paths_by_tool(response["validation"]["ungrounded"])
            results = [self._call(call, flagged, query, strict=strict) for call in calls]
            executed.extend(results)
            for call, result in zip(calls, results):
                # JSON text, so that a string result is written quoted inside the results list
                content = json.dumps(_jsonable(result), separators=(",", ":"), ensure_ascii=False)
                self._messages.append({"role": "tool", "name": call["name"], "content": content})
                self._see(content)
            response = self._answer(max_new_tokens, check_years=False)
        response["results"] = executed
        return response

    def extract(self, text: str, schema, max_new_tokens: int = 256, *, strict: bool = True,
                system: Optional[str] = None):
        """Structured extraction with this agent's model; see `needle_hf.extract`."""
        return _extract(self._backend, text, schema, system=system, max_new_tokens=max_new_tokens, strict=strict,
                        top_k_tools=self.top_k_tools)

    def complete_batch(self, queries: Sequence[str], max_new_tokens: int = 256, *, batch_size: int = 8) -> list[dict]:
        """Answer each query on its own, as `complete` right after `reset()` would, decoding
        ``batch_size`` prompts at a time (queries offered the same tools share a batch). The
        conversation is reset afterwards."""
        batch_size = checked_option("batch_size", batch_size, low=1, integer=True)
        max_new_tokens = checked_option("max_new_tokens", max_new_tokens, low=1, integer=True)
        if isinstance(queries, str) or not isinstance(queries, Sequence):
            raise TypeError(f"queries: expected a list of str, got {type(queries).__name__}")
        for index, query in enumerate(queries):
            _checked_text(f"queries[{index}]", query)
        with self._turn():
            return self._complete_batch(queries, max_new_tokens, batch_size=batch_size)

    def _complete_batch(self, queries: Sequence[str], max_new_tokens: int, *, batch_size: int) -> list[dict]:
        prompts, offered, envelopes = [], [], [None] * len(queries)
        for index, query in enumerate(queries):
            self.reset()
            self._messages.append({"role": "user", "content": query})
            self._offered = self._route(query)
            prompts.append(self._prompt_ids(max_new_tokens))
            offered.append(self._offered)
        groups: dict[tuple, list[int]] = {}
        for index, prompt in enumerate(prompts):
            if prompt is None:
                envelopes[index] = _envelope(
                    error=f"the prompt with the tools offered does not fit in the model's {self._backend.max_positions}"
                          " positions", error_code="context_length")
            else:
                groups.setdefault(tuple(schema["name"] for schema in offered[index]), []).append(index)
        for rows in groups.values():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                generations = self._backend.generate([prompts[i] for i in chunk], max_new_tokens=max_new_tokens,
                                                     tools=offered[chunk[0]])
                for index, generation in zip(chunk, generations):
                    envelopes[index] = _envelope_of(self._backend, prompts[index], generation)
        for query, envelope in zip(queries, envelopes):
            sources = validation.GroundingSources([query], instructions=self._system)
            years = validation.licensed_years(validation.source_years(query), self._system)
            envelope["validation"] = self._validation(envelope["function_calls"], sources, years, query)
        self.reset()
        return envelopes

    def reset(self) -> None:
        """Forget the conversation (turns, texts and years seen)."""
        self._messages: list[dict] = []
        self._sources = validation.GroundingSources(instructions=self._system)
        self._seen_years: set[int] = set()
        self._last_query = ""
        self._offered = list(self._tool_schemas)

    def close(self) -> None:
        """Kept for the reference's API; the model is freed with the object."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # -- internals ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _turn(self):
        """Put the conversation back as it was if the body raises (an exception or an interrupt)."""
        saved = (list(self._messages), self._sources.copy(), set(self._seen_years), self._last_query,
                 list(self._offered))
        try:
            yield
        except BaseException:
            (self._messages, self._sources, self._seen_years, self._last_query, self._offered) = saved
            raise

    def _see(self, text: str) -> None:
        self._sources.add(text)
        self._seen_years |= validation.source_years(text or "")

    def _route(self, query: str) -> list[dict]:
        schemas = self._tool_schemas
        if self.top_k_tools is None or len(schemas) <= self.top_k_tools or not self._backend.has_contrastive_head:
            return list(schemas)
        if self._tool_embeddings is None:
            self._tool_embeddings, _ = self._backend.embed([_tool_text(schema) for schema in schemas])
        query_embedding, _ = self._backend.embed([query])
        similarity = self._tool_embeddings @ query_embedding[0]  # [N]
        best = sorted(np.argsort(-similarity, kind="stable")[: self.top_k_tools].tolist())
        return [schemas[index] for index in best]

    def _prompt_ids(self, max_new_tokens: int) -> Optional[list[int]]:
        """The conversation's prompt ids, its oldest exchanges left out until it fits (None: the last turn alone does not)."""
        system = [{"role": "system", "content": self._system}] if self._system else []
        window = list(self._messages)
        while True:
            ids = self._backend.tokenizer.apply_chat_template(system + window, tools=self._offered,
                                                             add_generation_prompt=True, tokenize=False)
            ids = self._backend.tokenizer(ids, add_special_tokens=False)["input_ids"]
            if len(ids) + max_new_tokens <= self._backend.max_positions:
                return ids
            later_users = [i for i, message in enumerate(window) if i > 0 and message["role"] == "user"]
            if not later_users:
                return None
            window = window[later_users[0]:]

    def _answer(self, max_new_tokens: int, *, check_years: bool) -> dict:
        prompt = self._prompt_ids(max_new_tokens)
        if prompt is None:
            envelope = _envelope(error="the prompt with the tools offered does not fit in the model's "
                                       f"{self._backend.max_positions} positions with max_new_tokens={max_new_tokens}",
                                 error_code="context_length")
        else:
            generation = self._backend.generate([prompt], max_new_tokens=max_new_tokens, tools=self._offered)[0]
            envelope = _envelope_of(self._backend, prompt, generation)
        calls = envelope["function_calls"]
        years = validation.licensed_years(self._seen_years, self._system) if check_years else set()
        envelope["validation"] = self._validation(calls, self._sources, years, self._last_query)
        self._messages.append({"role": "assistant", "tool_calls": calls,
                               **({"reasoning_content": envelope["reasoning"]} if envelope["reasoning"] else {})})
        return envelope

    def _validation(self, calls: list, sources: validation.GroundingSources, years: set, query: str) -> dict:
        """``{"ungrounded", "negation"}`` of an answer; ``years``: the licensed years (empty: no year check)."""
        schemas = {schema["name"]: schema for schema in self._tool_schemas}
        ungrounded = []
        for call in calls:
            schema = schemas.get(call["name"])
            if schema is None:
                continue
            paths = validation.ground_arguments(schema, call["arguments"], sources)
            if years:
                paths += sorted(validation.date_year_check(schema, call["arguments"], years)[1])
            ungrounded += [f"{call['name']}.{path}" for path in dict.fromkeys(paths)]
        return {"ungrounded": ungrounded, "negation": validation.is_negated(query)}

    def _call(self, call: dict, flagged: dict, query: str, *, strict: bool) -> Any:
        name = call["name"]
        arguments = call.get("arguments") or {}
        fabricated = sorted(flagged.get(name, ()))
        if strict and fabricated:
            grounded = validation.grounded_number_paths(arguments, query, self._system)
            fabricated = [path for path in fabricated if path not in grounded]
            if fabricated:
                return {"error": "ungrounded " + ", ".join(fabricated)}
        function = self._functions.get(name)
        if function is None:
            return {"error": "unknown tool: " + name}
        try:
            return function(**arguments)
        except Exception as error:  # the function's failure is the call's result, as in the reference
            return {"error": str(error)}


def _envelope(*, error=None, error_code=None, calls=None, reasoning="", confidence=None, prefill_tps=0.0,
              decode_tps=0.0) -> dict:
    calls = calls or []
    return {"type": "call" if calls else "respond", "success": error is None, "error": error, "error_code": error_code,
            "function_calls": calls, "reasoning": reasoning, "confidence": confidence,
            "validation": {"ungrounded": [], "negation": False}, "prefill_tps": prefill_tps,
            "decode_tps": decode_tps, "peak_ram_mb": _peak_ram_mb()}


def _envelope_of(backend, prompt: list[int], generation, confidence_head: Optional[float] = None) -> dict:
    """The envelope of one generated answer (validation left empty for the caller)."""
    text = backend.tokenizer.decode(generation.ids, skip_special_tokens=True)
    prefill_tps = len(prompt) / generation.prefill_seconds if generation.prefill_seconds > 0 else 0.0
    decoded_after_first = max(len(generation.ids) - 1, 0) + int(generation.finished)
    decode_tps = decoded_after_first / generation.decode_seconds if generation.decode_seconds > 0 else 0.0
    timing = {"prefill_tps": prefill_tps, "decode_tps": decode_tps}
    if not generation.finished:
        return _envelope(error=f"the answer was cut at max_new_tokens={len(generation.ids)} before it ended",
                         error_code="truncated", **timing)
    try:
        turn = parse_assistant_turn(text)
    except ToolCallParseError as error:
        return _envelope(error=f"the answer is not a well-formed tool-call turn: {error}", error_code="malformed",
                         **timing)
    token_confidence = min(generation.token_probs) if generation.token_probs else None
    if backend.has_confidence_head:
        head = confidence_head if confidence_head is not None else generation.confidence
        if head is None:
            head = backend.confidence([prompt + generation.ids])[0]
        confidence = head if token_confidence is None else min(head, token_confidence)
    else:
        confidence = token_confidence
    return _envelope(calls=turn.tool_calls, reasoning=turn.reasoning or "", confidence=confidence, **timing)


def _validate_extraction(text: str, schema: dict, arguments: dict, envelope: dict, system: Optional[str]) -> None:
    """The reference's strict extraction rule: flagged paths fail unless a number in the text or a
    passing year check grounds them; a failing year check fails; a negated request fails."""
    years = validation.licensed_years(validation.source_years(text), system)
    checked, failures = validation.date_year_check(schema, arguments, years)
    flagged = envelope["validation"]["ungrounded"]
    grounded = validation.grounded_number_paths(arguments, text, system) if flagged else set()
    for name in flagged:
        path = name.split(".", 1)[-1]
        if path not in grounded and (path not in checked or path in failures):
            failures.add(path)
    if envelope["validation"]["negation"]:
        failures.add("negated request")
    if failures:
        raise ExtractionValidationError("extract: values not grounded in the text: " + ", ".join(sorted(failures)))


def _extract(backend, text, schema, *, system, max_new_tokens, strict, top_k_tools=DEFAULT_TOP_K_TOOLS):
    _checked_text("text", text)
    resolved = _named_schema(schema, where="schema")
    agent = Needle(backend, tools=[resolved], system=system, top_k_tools=top_k_tools)
    envelope = agent.complete(text, max_new_tokens)
    calls = envelope["function_calls"]
    if not calls:
        return None
    arguments = calls[0]["arguments"]
    if strict:
        _validate_extraction(text, resolved, arguments, envelope, system)
    return schema(**arguments) if is_pydantic_model(schema) else arguments


def extract(text: str, schema, system: Optional[str] = None, max_new_tokens: int = 256, *, model,
            strict: bool = True, framework: Optional[str] = None, tokenizer=None, grammar: bool = True):
    """One-shot structured extraction: the arguments the model fills in for ``schema`` from ``text``.

    Args:
        text: the input text.
        schema: a pydantic model (an instance of it is returned), a function or a schema dict (the
            arguments dict is returned).
        system: a system text.
        model: a folder, Hub id or loaded model (as `Needle`'s ``model``).
        strict: raise `ExtractionValidationError` when a value is not grounded in ``text``: a date
            whose year contradicts the years the text writes, a string or number the text does not
            hold (numbers written in the text pass), or a negated request.

    Returns None when the model makes no call.
    """
    from .engine import _Backend, load_backend

    backend = model if isinstance(model, _Backend) else load_backend(model, framework=framework, tokenizer=tokenizer,
                                                                      grammar=grammar)
    return _extract(backend, text, schema, system=system, max_new_tokens=max_new_tokens, strict=strict)


__all__ = ["DEFAULT_TOP_K_TOOLS", "ExtractionValidationError", "Needle", "extract", "resolve_tools"]
