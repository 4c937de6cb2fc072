"""Needle 2 on vLLM: the model and its parsers, registered through vLLM's plugin entry point.

`pip install needle-hf[vllm]` declares the ``vllm.general_plugins`` entry point ``needle``, which
vLLM calls in every process it starts (API server, engine, workers) before it reads a config. After
that, the folder transformers loads serves as is:

    vllm serve ./needle2-hf --enable-auto-tool-choice --tool-call-parser needle --reasoning-parser needle

`register` imports neither the model nor the parsers (vLLM imports them when it needs them): it
registers `NeedleConfig` with transformers' `AutoConfig` (by importing needle_hf), the architecture
``NeedleForCausalLM`` with vLLM's `ModelRegistry`, the tool-call parser ``needle`` with its
`ToolParserManager`, the reasoning parser ``needle`` with its `ReasoningParserManager`, and
`NeedleEagerOnly` as the architecture's config hook.
"""

from vllm.model_executor.models.config import VerifyAndUpdateConfig

ARCHITECTURE = "NeedleForCausalLM"
TOOL_PARSER_NAME = "needle"
REASONING_PARSER_NAME = "needle"


class NeedleEagerOnly(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook: Needle runs eagerly (no CUDA graphs, no torch.compile).

    Each step reads sizes back to the host (the Sinkhorn spread check, the engram windows of the
    step's requests), which a captured graph cannot replay.
    """

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        vllm_config.model_config.enforce_eager = True


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent)."""
    import needle_hf  # noqa: F401  (registers NeedleConfig with AutoConfig)
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"needle_hf.serving.vllm.model:{ARCHITECTURE}")
    # vLLM offers no registration call for config hooks; its table is keyed by architecture name.
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, NeedleEagerOnly)
    ToolParserManager.register_lazy_module(
        name=TOOL_PARSER_NAME, module_path="needle_hf.serving.vllm.tool_parser", class_name="NeedleToolParser"
    )
    ReasoningParserManager.register_lazy_module(
        name=REASONING_PARSER_NAME, module_path="needle_hf.serving.vllm.reasoning_parser", class_name="NeedleReasoningParser"
    )
