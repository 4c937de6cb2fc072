"""Needle 3 (cactus-needle 3.x): configuration, PyTorch model and the native weight table.

`register()` (called when `needle_hf` is imported) registers `Needle3Config` with `AutoConfig`, the
PyTorch classes with `AutoModel`/`AutoModelForCausalLM` and (transformers 4.x with jax/flax) the Flax
ones with `FlaxAutoModel`/`FlaxAutoModelForCausalLM`, without importing the model code:
placeholders that become the real classes when read, as for Needle 2.
"""

import importlib
import importlib.util

from .configuration_needle3 import Needle3Config

_TORCH_CLASSES = ("Needle3Model", "Needle3ForCausalLM", "Needle3PreTrainedModel", "Needle3Cache")
_FLAX_CLASSES = ("FlaxNeedle3Model", "FlaxNeedle3ForCausalLM", "FlaxNeedle3PreTrainedModel")
__all__ = ["Needle3Config", *_TORCH_CLASSES, *_FLAX_CLASSES]


def _defining_module(name: str) -> str:
    return ".modeling_flax_needle3" if name in _FLAX_CLASSES else ".modeling_needle3"


def __getattr__(name: str):
    """`needle_hf.models.needle3.<model class>`, imported on first access."""
    if name in _TORCH_CLASSES or name in _FLAX_CLASSES:
        return getattr(importlib.import_module(_defining_module(name), __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    from transformers import AutoConfig

    from ... import DeferredModelClass, _ResolvingEntries

    class DeferredNeedle3Class(DeferredModelClass):
        def resolve(cls) -> type:
            return getattr(importlib.import_module(_defining_module(cls.__name__), __name__), cls.__name__)

    AutoConfig.register(Needle3Config.model_type, Needle3Config, exist_ok=True)
    if importlib.util.find_spec("torch") is None:
        return  # both twins need torch (the Flax one reads the MLP permutations from the PyTorch module)
    import transformers

    pairs = [(transformers.AutoModel, "Needle3Model"), (transformers.AutoModelForCausalLM, "Needle3ForCausalLM")]
    has_flax = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("flax") is not None
    if has_flax and hasattr(transformers, "FlaxAutoModelForCausalLM"):  # gone in transformers 5
        pairs += [(transformers.FlaxAutoModel, "FlaxNeedle3Model"),
                  (transformers.FlaxAutoModelForCausalLM, "FlaxNeedle3ForCausalLM")]
    for auto_class, name in pairs:
        mapping = auto_class._model_mapping
        if not isinstance(mapping._extra_content, _ResolvingEntries):
            mapping._extra_content = _ResolvingEntries(mapping._extra_content)
        placeholder = DeferredNeedle3Class(
            name, (), {"config_class": Needle3Config, "__module__": f"{__name__}{_defining_module(name)}"})
        auto_class.register(Needle3Config, placeholder, exist_ok=True)
