"""Needle 3 (cactus-needle 3.x): configuration, PyTorch model and the native weight table.

`register()` (called when `needle_hf` is imported) registers `Needle3Config` with `AutoConfig` and
the PyTorch classes with `AutoModel`/`AutoModelForCausalLM` without importing torch's model code:
placeholders that become the real classes when read, as for Needle 2.
"""

import importlib
import importlib.util

from .configuration_needle3 import Needle3Config

_TORCH_CLASSES = ("Needle3Model", "Needle3ForCausalLM", "Needle3PreTrainedModel", "Needle3Cache")
__all__ = ["Needle3Config", *_TORCH_CLASSES]


def __getattr__(name: str):
    """`needle_hf.models.needle3.<model class>`, imported on first access."""
    if name in _TORCH_CLASSES:
        return getattr(importlib.import_module(".modeling_needle3", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    from transformers import AutoConfig

    from ... import DeferredModelClass, _ResolvingEntries

    class DeferredNeedle3Class(DeferredModelClass):
        def resolve(cls) -> type:
            return getattr(importlib.import_module(".modeling_needle3", __name__), cls.__name__)

    AutoConfig.register(Needle3Config.model_type, Needle3Config, exist_ok=True)
    if importlib.util.find_spec("torch") is None:
        return
    from transformers import AutoModel, AutoModelForCausalLM

    for auto_class, name in ((AutoModel, "Needle3Model"), (AutoModelForCausalLM, "Needle3ForCausalLM")):
        mapping = auto_class._model_mapping
        if not isinstance(mapping._extra_content, _ResolvingEntries):
            mapping._extra_content = _ResolvingEntries(mapping._extra_content)
        placeholder = DeferredNeedle3Class(
            name, (), {"config_class": Needle3Config, "__module__": f"{__name__}.modeling_needle3"})
        auto_class.register(Needle3Config, placeholder, exist_ok=True)
