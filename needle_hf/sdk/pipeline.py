"""The ``pipeline("tool-calling", model=...)`` task: `Needle.complete` envelopes the Hugging Face way.

    pipe = pipeline("tool-calling", model="needle2-hf")
    pipe("wake me at 7", tools=[set_alarm])                  # one envelope
    pipe(["wake me at 7", "text Bob"], tools=[...], batch_size=8)   # a list of envelopes, decoded in batches

Each query is answered on its own (no conversation), with the tools given to the call (functions,
pydantic models or schema dicts, as `Needle` takes them), grammar-constrained when llguidance is
installed (``grammar=False`` at construction turns it off) and routed to the top ``top_k_tools``
when the model has a contrastive head. The envelope is `Needle.complete`'s (see
`needle_hf.sdk.needle`). PyTorch models only (transformers' pipelines are PyTorch's).

`register_tool_calling_pipeline` adds the task to transformers' registry; importing `needle_hf`
arranges for it to run as soon as `transformers.pipelines` is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from transformers import AutoModelForCausalLM
from transformers.pipelines import PIPELINE_REGISTRY, Pipeline

from .engine import TorchBackend
from .needle import DEFAULT_TOP_K_TOOLS, Needle

TASK = "tool-calling"


class ToolCallingPipeline(Pipeline):
    """Tool-calling envelopes from a `NeedleForCausalLM` (see the module docstring).

    Args (besides `Pipeline`'s model and tokenizer):
        grammar: constrain answers to valid calls (needs llguidance).
        top_k_tools: retrieval width; None offers every tool.
    """

    def __init__(self, model, tokenizer=None, *, grammar: bool = True,
                 top_k_tools: Optional[int] = DEFAULT_TOP_K_TOOLS, **pipeline_options):
        super().__init__(model, tokenizer=tokenizer, **pipeline_options)
        self._backend = TorchBackend(self.model, self.tokenizer, grammar=grammar)
        self.top_k_tools = top_k_tools

    def _sanitize_parameters(self, tools=None, system=None, max_new_tokens=None, **unknown):
        if unknown:
            raise TypeError(f"tool-calling pipeline: unknown arguments {sorted(unknown)}; "
                            "expected tools, system, max_new_tokens, batch_size")
        forward = {"tools": tools, "system": system}
        if max_new_tokens is not None:
            forward["max_new_tokens"] = max_new_tokens
        return {}, forward, {}

    def __call__(self, inputs, *, tools=None, system: Optional[str] = None, max_new_tokens: int = 256,
                 batch_size: Optional[int] = None):
        """One query -> one envelope; a list of queries -> a list of envelopes (``batch_size`` per decode)."""
        single = isinstance(inputs, str)
        if not single and (not isinstance(inputs, Iterable) or isinstance(inputs, (bytes, dict))):
            raise TypeError(f"tool-calling pipeline: expected a query (str) or a list of queries, got "
                            f"{type(inputs).__name__}: {inputs!r:.80}")
        queries = [inputs] if single else list(inputs)
        agent = Needle(self._backend, tools=tools, system=system, top_k_tools=self.top_k_tools)
        envelopes = agent.complete_batch(queries, max_new_tokens, batch_size=batch_size or self._batch_size or 8)
        return envelopes[0] if single else envelopes

    # Pipeline's single-item path (used by `Pipeline.run_single` and iterators): one query at a time.
    def preprocess(self, inputs):
        return {"query": inputs}

    def _forward(self, model_inputs, tools=None, system=None, max_new_tokens=256):
        agent = Needle(self._backend, tools=tools, system=system, top_k_tools=self.top_k_tools)
        return agent.complete_batch([model_inputs["query"]], max_new_tokens, batch_size=1)[0]

    def postprocess(self, model_outputs):
        return model_outputs


def register_tool_calling_pipeline() -> None:
    """Register ``"tool-calling"`` with transformers' pipeline registry (idempotent)."""
    if TASK not in PIPELINE_REGISTRY.supported_tasks:
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=ToolCallingPipeline, pt_model=AutoModelForCausalLM,
                                            type="text")


register_tool_calling_pipeline()

__all__ = ["TASK", "ToolCallingPipeline", "register_tool_calling_pipeline"]
