"""needle-hf: Needle 2 (Cactus Compute's tool-calling model) for Hugging Face Transformers.

Importing the package registers `NeedleConfig` with `AutoConfig`, the Flax models with
`FlaxAutoModel`/`FlaxAutoModelForCausalLM` (transformers 4.x with jax/flax installed) and the
PyTorch models with `AutoModel`/`AutoModelForCausalLM` (torch installed).
"""

import importlib.util

from transformers import AutoConfig

from .configuration_needle import NeedleConfig
from .tokenization_needle import register_transformers5_tokenizer_name

__all__ = ["NeedleConfig"]
__version__ = "0.1.0"

AutoConfig.register(NeedleConfig.model_type, NeedleConfig, exist_ok=True)
register_transformers5_tokenizer_name()


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


if _has("torch"):
    from transformers import AutoModel, AutoModelForCausalLM

    from .modeling_needle import NeedleForCausalLM, NeedleModel, NeedlePreTrainedModel

    AutoModel.register(NeedleConfig, NeedleModel, exist_ok=True)
    AutoModelForCausalLM.register(NeedleConfig, NeedleForCausalLM, exist_ok=True)
    __all__ += ["NeedleModel", "NeedleForCausalLM", "NeedlePreTrainedModel"]

if _has("jax") and _has("flax"):
    import transformers

    if hasattr(transformers, "FlaxAutoModelForCausalLM"):
        from transformers import FlaxAutoModel, FlaxAutoModelForCausalLM

        from .modeling_flax_needle import FlaxNeedleForCausalLM, FlaxNeedleModel, FlaxNeedlePreTrainedModel

        FlaxAutoModel.register(NeedleConfig, FlaxNeedleModel, exist_ok=True)
        FlaxAutoModelForCausalLM.register(NeedleConfig, FlaxNeedleForCausalLM, exist_ok=True)
        __all__ += ["FlaxNeedleModel", "FlaxNeedleForCausalLM", "FlaxNeedlePreTrainedModel"]
