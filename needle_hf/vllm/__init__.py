"""Needle 2 on vLLM: the model and the tool-call parser, registered through vLLM's plugin entry point.

`pip install needle-hf[vllm]` declares the ``vllm.general_plugins`` entry point ``needle``, which
vLLM calls in every process it starts (API server, engine, workers) before it reads a config. After
that, the folder transformers loads serves as is:

    vllm serve ./needle2-hf --enable-auto-tool-choice --tool-call-parser needle

`register` imports neither the model nor the parser (vLLM imports them when it needs them): it
registers `NeedleConfig` with transformers' `AutoConfig` (by importing needle_hf), the architecture
``NeedleForCausalLM`` with vLLM's `ModelRegistry` and the parser ``needle`` with its
`ToolParserManager`.
"""

TOOL_PARSER_NAME = "needle"


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent)."""
    import needle_hf  # noqa: F401  (registers NeedleConfig with AutoConfig)
    from vllm import ModelRegistry
    from vllm.tool_parsers import ToolParserManager

    if "NeedleForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("NeedleForCausalLM", "needle_hf.vllm.model:NeedleForCausalLM")
    ToolParserManager.register_lazy_module(
        name=TOOL_PARSER_NAME, module_path="needle_hf.vllm.tool_parser", class_name="NeedleToolParser"
    )
