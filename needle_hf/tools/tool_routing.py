"""Tool routing and answer confidence with Needle's probe-pooling heads (PyTorch).

Two heads ride on the backbone's hidden states (see `modeling_needle`):

- The contrastive head embeds a text into an L2-normalised vector. Queries and tools live in the
  same space (the reference trains it with ``forward_contrastive(query_tokens, tool_tokens)``), so a
  catalogue too large for the prompt can be ranked by cosine similarity to the query and only the
  top-k tools rendered into the chat template.
- The confidence head scores a whole turn (prompt and answer) with one logit; its sigmoid is the
  probability that the answer is right, and an answer below a threshold can be deferred (to a
  larger model, a human, a clarifying question) instead of executed.

Texts. A query embeds as ``[BOS] + encode(query)``; a tool as ``[BOS] + encode(compact JSON of its
bare schema)`` (``{"name","description","parameters"}``, the form the chat template writes inside
``<tools>``). A turn's confidence is read from the prompt ids followed by the generated ids.

`NeedleToolCaller` puts the three steps together: route, answer (optionally grammar-constrained),
score and defer.

Bad inputs raise `ToolRoutingError` naming the field with what was expected and found: a catalogue
that is not a list of named schemas with unique names (a dict, a string, an empty list to rank),
a text longer than ``max_position_embeddings`` tokens, precomputed embeddings that are not a
finite float tensor [N, C] of unit rows, a ``top_k`` that is not a positive int.

Axis letters: B batch, T tokens, C contrastive width, N tools.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Optional, Sequence

import torch

from .tool_calls import ToolCallParseError, parse_tool_calls


class ToolRoutingError(ValueError):
    """A routing input (catalogue, query, embeddings, option) is not what the heads can read."""


def _excerpt(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_catalogue(tools, *, allow_empty: bool = False) -> list:
    """The catalogue as a list, each entry a named schema (bare or OpenAI-wrapped), names unique."""
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise ToolRoutingError(f"tools: expected a list of tool schemas, found {type(tools).__name__}"
                               + (" (a dict: pass list(catalogue.values()) or a list of schemas)"
                                  if isinstance(tools, dict) else ""))
    tools = list(tools)
    if not tools and not allow_empty:
        raise ToolRoutingError("tools: expected at least one tool schema to rank, found an empty catalogue")
    names = {}
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ToolRoutingError(f"tools[{index}]: expected a tool schema dict, found {type(tool).__name__}")
        schema = _unwrapped(tool)
        if tool.get("type") == "function" and schema is tool:
            raise ToolRoutingError(f"tools[{index}].function: an OpenAI wrapper needs a schema dict, "
                                   f"found {_excerpt(tool.get('function'))}")
        name = schema.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRoutingError(f"tools[{index}].name: expected a non-empty string, found {_excerpt(name)}")
        if name in names:
            raise ToolRoutingError(f"tools[{index}].name: {name!r} is also tools[{names[name]}]'s; expected unique names")
        names[name] = index
    return tools


def _check_count(name: str, value, *, allow_none: bool) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        expected = "a positive int or None" if allow_none else "a positive int"
        raise ToolRoutingError(f"{name}: expected {expected}, found {_excerpt(value)}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class RankedTool:
    """One catalogue entry ranked for a query.

    Attributes:
        tool: the tool as given.
        index: its position in the catalogue.
        similarity: cosine similarity of query and tool embeddings, in [-1, 1].
        probability: softmax over the catalogue of ``similarity / temperature`` (the head's learnt
            temperature), i.e. the head's belief that this is the tool the query wants.
    """

    tool: dict
    index: int
    similarity: float
    probability: float


def tool_text(tool: dict) -> str:
    """The text a tool is embedded from: compact JSON of its bare schema, as the prompt writes it."""
    if not isinstance(tool, dict):
        raise ToolRoutingError(f"tool: expected a tool schema dict, found {type(tool).__name__}")
    try:
        return json.dumps(_unwrapped(tool), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise ToolRoutingError(f"tool {_excerpt(tool.get('name', tool))}: not a JSON schema ({error})") from None


def _unwrapped(tool: dict) -> dict:
    if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        return tool["function"]
    return tool


def _batch(tokenizer, texts: Sequence[str], device, limit: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, T] and mask [B, T] of texts ``first``.. of a call; each must fit ``limit`` positions."""
    encoded = tokenizer(list(texts), padding=True)  # BOS added, padded left
    for offset, mask in enumerate(encoded["attention_mask"]):
        if sum(mask) > limit:
            raise ToolRoutingError(f"texts[{first + offset}]: {sum(mask)} tokens, more than the model's "
                                   f"max_position_embeddings={limit}: {_excerpt(texts[offset])}")
    return (torch.tensor(encoded["input_ids"], device=device),
            torch.tensor(encoded["attention_mask"], device=device))


@torch.no_grad()
def embed_texts(model, tokenizer, texts: Sequence[str], *, batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Contrastive embeddings [N, C] float32 of ``texts`` and the head's log temperature (scalar).

    Every text must fit ``config.max_position_embeddings`` tokens (BOS included).
    """
    if getattr(model, "contrastive_head", None) is None:
        raise ToolRoutingError("model: routing needs a contrastive head (config.use_contrastive_head is False)")
    batch_size = _check_count("batch_size", batch_size, allow_none=False)
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise ToolRoutingError(f"texts: expected a list of strings, found {type(texts).__name__}")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ToolRoutingError(f"texts[{index}]: expected a string, found {type(text).__name__}")
    if not texts:
        raise ToolRoutingError("texts: expected at least one text to embed, found none")
    device, limit = model.device, model.config.max_position_embeddings
    chunks, log_temperature = [], None
    for start in range(0, len(texts), batch_size):
        ids, mask = _batch(tokenizer, texts[start:start + batch_size], device, limit, start)
        embedding, log_temperature = model.contrastive_embedding(ids, attention_mask=mask)
        chunks.append(embedding.float())
    return torch.cat(chunks), log_temperature.float()


@torch.no_grad()
def rank_tools(model, tokenizer, query: str, tools: Sequence[dict], *, top_k: Optional[int] = None,
               tool_embeddings: Optional[torch.Tensor] = None) -> list[RankedTool]:
    """Rank a tool catalogue for ``query`` with the contrastive head, best first.

    Args:
        model: a `NeedleForCausalLM` with a contrastive head.
        tokenizer: its tokenizer.
        query: the user's request (the text the chat template puts after ``</tools>``).
        tools: the catalogue (bare schemas or OpenAI wrappers).
        top_k: keep the best ``top_k`` (None: all).
        tool_embeddings: [N, C] precomputed `embed_tools` of the same catalogue (a catalogue is
            embedded once and reused across queries).
    """
    tools = _check_catalogue(tools)
    top_k = _check_count("top_k", top_k, allow_none=True)
    if not isinstance(query, str):
        raise ToolRoutingError(f"query: expected a string, found {type(query).__name__}")
    if tool_embeddings is None:
        tool_embeddings = embed_tools(model, tokenizer, tools)
    else:
        tool_embeddings = _check_tool_embeddings(tool_embeddings, len(tools), model.config.contrastive_dim)
    try:
        query_embedding, log_temperature = embed_texts(model, tokenizer, [query])
    except ToolRoutingError as error:
        raise ToolRoutingError(str(error).replace("texts[0]", "query", 1)) from None
    similarity = (query_embedding @ tool_embeddings.to(query_embedding.device).T)[0]  # [N]
    probability = torch.softmax(similarity / log_temperature.exp(), dim=-1)
    order = torch.argsort(similarity, descending=True, stable=True).tolist()
    if top_k is not None:
        order = order[:top_k]
    return [RankedTool(tools[i], i, float(similarity[i]), float(probability[i])) for i in order]


# Rows normalised in bfloat16 are within ~1e-2 of unit length.
_UNIT_NORM_TOLERANCE = 2e-2


def _check_tool_embeddings(embeddings, rows: int, width: int) -> torch.Tensor:
    """Precomputed catalogue embeddings: a finite float tensor [rows, width] of unit rows (as `embed_tools` gives)."""
    if not isinstance(embeddings, torch.Tensor):
        raise ToolRoutingError(f"tool_embeddings: expected a torch.Tensor [{rows}, {width}] (embed_tools), "
                               f"found {type(embeddings).__name__}")
    if tuple(embeddings.shape) != (rows, width):
        raise ToolRoutingError(f"tool_embeddings: expected shape ({rows}, {width}) (one row per tool, the "
                               f"contrastive width), found {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise ToolRoutingError(f"tool_embeddings: expected a float tensor, found {embeddings.dtype}")
    if not bool(torch.isfinite(embeddings).all()):
        bad = int((~torch.isfinite(embeddings)).any(dim=-1).nonzero()[0, 0])
        raise ToolRoutingError(f"tool_embeddings: expected finite values, found NaN or infinity in row {bad}")
    norms = torch.linalg.vector_norm(embeddings.float(), dim=-1)
    off = (norms - 1).abs() > _UNIT_NORM_TOLERANCE
    if bool(off.any()):
        row = int(off.nonzero()[0, 0])
        raise ToolRoutingError(f"tool_embeddings: expected L2-normalised rows (embed_tools), found norm "
                               f"{float(norms[row]):.4g} in row {row}")
    return embeddings.float()


def embed_tools(model, tokenizer, tools: Sequence[dict]) -> torch.Tensor:
    """Contrastive embeddings [N, C] of a catalogue, for `rank_tools(tool_embeddings=...)`."""
    tools = _check_catalogue(tools)
    texts = []
    for index, tool in enumerate(tools):
        try:
            texts.append(tool_text(tool))
        except ToolRoutingError as error:
            raise ToolRoutingError(f"tools[{index}]: {str(error).split(': ', 1)[1]}") from None
    try:
        return embed_texts(model, tokenizer, texts)[0]
    except ToolRoutingError as error:
        raise ToolRoutingError(str(error).replace("texts[", "tools[", 1)) from None


def select_tools(model, tokenizer, query: str, tools: Sequence[dict], *, top_k: int,
                 tool_embeddings: Optional[torch.Tensor] = None) -> list[dict]:
    """The ``top_k`` tools of the catalogue for ``query``, in catalogue order (as the prompt lists them)."""
    ranked = rank_tools(model, tokenizer, query, tools, top_k=_check_count("top_k", top_k, allow_none=False),
                        tool_embeddings=tool_embeddings)
    return [entry.tool for entry in sorted(ranked, key=lambda entry: entry.index)]


@torch.no_grad()
def answer_confidence(model, sequences: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Probability [B] float32 that each turn's answer is right: sigmoid of the confidence head.

    Args:
        sequences: [B, T] prompt ids followed by the generated ids (as `generate` returns them;
            padding, left or right, is masked by ``attention_mask`` or by the pad id).
    """
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.is_floating_point():
        found = f"{tuple(sequences.shape)} {sequences.dtype}" if isinstance(sequences, torch.Tensor) else type(sequences).__name__
        raise ToolRoutingError(f"sequences: expected token ids as an integer tensor [B, T], found {found}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != sequences.shape):
        found = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ToolRoutingError(f"attention_mask: expected shape {tuple(sequences.shape)} (as sequences), found {found}")
    if getattr(model, "confidence_head", None) is None:
        raise ToolRoutingError("model: answer_confidence needs a confidence head (config.use_confidence_head is False)")
    vocab_size, limit = model.config.vocab_size, model.config.max_position_embeddings
    if sequences.numel() and (int(sequences.min()) < 0 or int(sequences.max()) >= vocab_size):
        raise ToolRoutingError(f"sequences: expected ids in [0, {vocab_size}), found {int(sequences.min())}.."
                               f"{int(sequences.max())}")
    if sequences.shape[1] > limit:
        raise ToolRoutingError(f"sequences: {sequences.shape[1]} positions, more than the model's "
                               f"max_position_embeddings={limit}")
    return torch.sigmoid(model.confidence_logit(sequences, attention_mask=attention_mask).float())


@dataclasses.dataclass
class ToolCallAnswer:
    """One answer of `NeedleToolCaller`.

    Attributes:
        text: the generated assistant text (markers kept).
        tool_calls: the parsed calls, or None when the text does not parse.
        confidence: the confidence head's probability (None without a confidence head).
        deferred: True when the confidence is below the caller's threshold (the calls should not run).
        tools_offered: the tools the prompt carried (the top-k when routing).
    """

    text: str
    tool_calls: Optional[list]
    confidence: Optional[float]
    deferred: bool
    tools_offered: list


class NeedleToolCaller:
    """Route, answer, score: one tool-calling request end to end on a PyTorch Needle model.

    Args:
        model: a `NeedleForCausalLM` (the contrastive head is needed for ``top_k_tools``, the
            confidence head for ``confidence_threshold``).
        tokenizer: its tokenizer (left padding).
        top_k_tools: keep this many tools of the catalogue in the prompt (None: all).
        confidence_threshold: defer answers whose confidence is below it (None: never defer).
        constrained: constrain the answer with `needle_hf.generation.grammar` (needs llguidance).

    ``caller(query, tools, max_new_tokens=64, **generate_kwargs)`` returns a `ToolCallAnswer`;
    ``NeedleToolCaller.from_pipeline(pipe, ...)`` takes the model and tokenizer of a
    ``pipeline("text-generation")``.
    """

    def __init__(self, model, tokenizer, *, top_k_tools: Optional[int] = None,
                 confidence_threshold: Optional[float] = None, constrained: bool = False):
        top_k_tools = _check_count("top_k_tools", top_k_tools, allow_none=True)
        if confidence_threshold is not None and (
                isinstance(confidence_threshold, bool) or not isinstance(confidence_threshold, numbers.Real)
                or not 0.0 <= confidence_threshold <= 1.0):
            raise ToolRoutingError(f"confidence_threshold: expected a probability in [0, 1] or None, "
                                   f"got {_excerpt(confidence_threshold)}")
        if not isinstance(constrained, bool):
            raise ToolRoutingError(f"constrained: expected True or False, found {_excerpt(constrained)}")
        if top_k_tools is not None and getattr(model, "contrastive_head", None) is None:
            raise ToolRoutingError("top_k_tools needs a contrastive head (config.use_contrastive_head is False)")
        if confidence_threshold is not None and getattr(model, "confidence_head", None) is None:
            raise ToolRoutingError("confidence_threshold needs a confidence head (config.use_confidence_head is False)")
        self.model = model
        self.tokenizer = tokenizer
        self.top_k_tools = top_k_tools
        self.confidence_threshold = confidence_threshold
        self.grammar = None
        if constrained:
            from ..generation.grammar import ToolCallGrammar

            self.grammar = ToolCallGrammar(tokenizer, vocab_size=model.config.vocab_size)

    @classmethod
    def from_pipeline(cls, pipe, **options) -> "NeedleToolCaller":
        return cls(pipe.model, pipe.tokenizer, **options)

    @torch.no_grad()
    def __call__(self, query: str, tools: Sequence[dict], *, max_new_tokens: int = 64,
                 tool_embeddings: Optional[torch.Tensor] = None, **generate_kwargs) -> ToolCallAnswer:
        tools = _check_catalogue(tools, allow_empty=True)  # no tools: the prompt asks for "no tool applies"
        if not isinstance(query, str):
            raise ToolRoutingError(f"query: expected a string, found {type(query).__name__}")
        max_new_tokens = _check_count("max_new_tokens", max_new_tokens, allow_none=False)
        if self.top_k_tools is not None and len(tools) > self.top_k_tools:
            tools = select_tools(self.model, self.tokenizer, query, tools, top_k=self.top_k_tools,
                                 tool_embeddings=tool_embeddings)
        prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=tools,
                                                    add_generation_prompt=True, tokenize=False)
        inputs = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.model.device)
        limit = self.model.config.max_position_embeddings
        if inputs["input_ids"].shape[1] + max_new_tokens > limit:
            raise ToolRoutingError(
                f"prompt: {inputs['input_ids'].shape[1]} tokens + max_new_tokens={max_new_tokens} exceed the model's "
                f"max_position_embeddings={limit}; offer fewer tools (top_k_tools) or lower max_new_tokens")
        if self.grammar is not None:
            from transformers import LogitsProcessorList

            generate_kwargs["logits_processor"] = LogitsProcessorList(
                [*generate_kwargs.get("logits_processor", []), self.grammar.logits_processor(tools)])
        sequences = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs)
        new_ids = [t for t in sequences[0, inputs["input_ids"].shape[1]:].tolist()
                   if t not in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)]
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        try:
            calls = parse_tool_calls(text)
        except ToolCallParseError:
            calls = None
        confidence = None
        if getattr(self.model, "confidence_head", None) is not None:
            turn = torch.tensor([inputs["input_ids"][0].tolist() + new_ids], device=self.model.device)
            confidence = float(answer_confidence(self.model, turn)[0])
        deferred = (self.confidence_threshold is not None
                    and (confidence is None or math.isnan(confidence) or confidence < self.confidence_threshold))
        return ToolCallAnswer(text=text, tool_calls=calls, confidence=confidence, deferred=deferred,
                              tools_offered=tools)


__all__ = [
    "NeedleToolCaller",
    "ToolRoutingError",
    "RankedTool",
    "ToolCallAnswer",
    "answer_confidence",
    "embed_texts",
    "embed_tools",
    "rank_tools",
    "select_tools",
    "tool_text",
]
