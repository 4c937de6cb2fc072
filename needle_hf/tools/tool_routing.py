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

Axis letters: B batch, T tokens, C contrastive width, N tools.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional, Sequence

import torch

from .tool_calls import ToolCallParseError, parse_tool_calls


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
    return json.dumps(_unwrapped(tool), separators=(",", ":"), ensure_ascii=False)


def _unwrapped(tool: dict) -> dict:
    if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        return tool["function"]
    return tool


def _batch(tokenizer, texts: Sequence[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = tokenizer(list(texts), return_tensors="pt", padding=True)  # BOS added, padded left
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)


@torch.no_grad()
def embed_texts(model, tokenizer, texts: Sequence[str], *, batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Contrastive embeddings [N, C] float32 of ``texts`` and the head's log temperature (scalar)."""
    device = model.device
    chunks, log_temperature = [], None
    for start in range(0, len(texts), batch_size):
        ids, mask = _batch(tokenizer, texts[start:start + batch_size], device)
        embedding, log_temperature = model.contrastive_embedding(ids, attention_mask=mask)
        chunks.append(embedding.float())
    if not chunks:
        raise ValueError("embed_texts: no texts given")
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
    if not tools:
        return []
    if tool_embeddings is None:
        tool_embeddings, _ = embed_texts(model, tokenizer, [tool_text(tool) for tool in tools])
    if tool_embeddings.shape[0] != len(tools):
        raise ValueError(f"tool_embeddings: expected {len(tools)} rows (one per tool), got {tool_embeddings.shape[0]}")
    query_embedding, log_temperature = embed_texts(model, tokenizer, [query])
    similarity = (query_embedding @ tool_embeddings.T)[0]  # [N]
    probability = torch.softmax(similarity / log_temperature.exp(), dim=-1)
    order = torch.argsort(similarity, descending=True, stable=True).tolist()
    if top_k is not None:
        order = order[: max(int(top_k), 0)]
    return [RankedTool(tools[i], i, float(similarity[i]), float(probability[i])) for i in order]


def embed_tools(model, tokenizer, tools: Sequence[dict]) -> torch.Tensor:
    """Contrastive embeddings [N, C] of a catalogue, for `rank_tools(tool_embeddings=...)`."""
    return embed_texts(model, tokenizer, [tool_text(tool) for tool in tools])[0]


def select_tools(model, tokenizer, query: str, tools: Sequence[dict], *, top_k: int, **options) -> list[dict]:
    """The ``top_k`` tools of the catalogue for ``query``, in catalogue order (as the prompt lists them)."""
    ranked = rank_tools(model, tokenizer, query, tools, top_k=top_k, **options)
    return [entry.tool for entry in sorted(ranked, key=lambda entry: entry.index)]


@torch.no_grad()
def answer_confidence(model, sequences: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Probability [B] float32 that each turn's answer is right: sigmoid of the confidence head.

    Args:
        sequences: [B, T] prompt ids followed by the generated ids (as `generate` returns them;
            padding, left or right, is masked by ``attention_mask`` or by the pad id).
    """
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
        if top_k_tools is not None and getattr(model, "contrastive_head", None) is None:
            raise ValueError("top_k_tools needs a contrastive head (config.use_contrastive_head is False)")
        if confidence_threshold is not None and getattr(model, "confidence_head", None) is None:
            raise ValueError("confidence_threshold needs a confidence head (config.use_confidence_head is False)")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold: expected a probability in [0, 1], got {confidence_threshold}")
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
        tools = list(tools)
        if self.top_k_tools is not None and len(tools) > self.top_k_tools:
            tools = select_tools(self.model, self.tokenizer, query, tools, top_k=self.top_k_tools,
                                 tool_embeddings=tool_embeddings)
        prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=tools,
                                                    add_generation_prompt=True, tokenize=False)
        inputs = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.model.device)
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
    "RankedTool",
    "ToolCallAnswer",
    "answer_confidence",
    "embed_texts",
    "embed_tools",
    "rank_tools",
    "select_tools",
    "tool_text",
]
