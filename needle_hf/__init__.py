"""needle-hf: Needle 2 (Cactus Compute's tool-calling model) for Hugging Face Transformers.

Importing the package registers `NeedleConfig` with `AutoConfig`, the Flax models with
`FlaxAutoModel`/`FlaxAutoModelForCausalLM` (transformers 4.x with jax/flax installed) and the
PyTorch models with `AutoModel`/`AutoModelForCausalLM` (torch installed).

The model classes are registered as deferred stand-ins (`DeferredModelClass`), and
`needle_hf.FlaxNeedleForCausalLM` and friends resolve on first access: importing the package
imports neither torch's nor jax's model code (together ~190 MB and ~2.5 s), so a tool that only
converts checkpoints or tokenizers stays small. The first use of a model class imports it.
"""

import importlib
import importlib.util

from transformers import AutoConfig

from .configuration_needle import NeedleConfig
from .tokenization_needle import register_transformers5_tokenizer_name

__version__ = "0.1.0"

# Public model classes: name -> the module (in this package) that defines it.
_TORCH_CLASSES = {name: "modeling_needle" for name in ("NeedleModel", "NeedleForCausalLM", "NeedlePreTrainedModel")}
_FLAX_CLASSES = {
    name: "modeling_flax_needle" for name in ("FlaxNeedleModel", "FlaxNeedleForCausalLM", "FlaxNeedlePreTrainedModel")
}


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _transformers_has_flax() -> bool:
    import transformers

    return hasattr(transformers, "FlaxAutoModelForCausalLM")  # gone in transformers 5


_MODEL_CLASSES = {
    **(_TORCH_CLASSES if _has("torch") else {}),
    **(_FLAX_CLASSES if _has("jax") and _has("flax") and _transformers_has_flax() else {}),
}
__all__ = ["NeedleConfig", *_MODEL_CLASSES]


def _model_class(name: str) -> type:
    return getattr(importlib.import_module(f".{_MODEL_CLASSES[name]}", __name__), name)


def __getattr__(name: str):
    """`needle_hf.<model class>`, imported on first access."""
    if name in _MODEL_CLASSES:
        return _model_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DeferredModelClass(type):
    """Metaclass of the stand-ins registered with the Auto classes in place of the model classes.

    A stand-in carries the real class's name and `config_class` (all that registration reads); any
    other attribute (`from_pretrained`, `from_config`, ...), a call, or an isinstance/issubclass test
    imports the real class and forwards to it. What the Auto classes return is always an instance of
    the real class.
    """

    def resolve(cls) -> type:
        return _model_class(cls.__name__)

    def __getattr__(cls, name):  # only for names the stand-in itself lacks
        return getattr(cls.resolve(), name)

    def __call__(cls, *args, **kwargs):
        return cls.resolve()(*args, **kwargs)

    def __instancecheck__(cls, instance):
        return isinstance(instance, cls.resolve())

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, cls.resolve())


def _stand_in(name: str) -> type:
    return DeferredModelClass(name, (), {"config_class": NeedleConfig, "__module__": f"{__name__}.{_MODEL_CLASSES[name]}"})


def _register_auto_classes():
    AutoConfig.register(NeedleConfig.model_type, NeedleConfig, exist_ok=True)
    register_transformers5_tokenizer_name()
    if "NeedleForCausalLM" in _MODEL_CLASSES:
        from transformers import AutoModel, AutoModelForCausalLM

        AutoModel.register(NeedleConfig, _stand_in("NeedleModel"), exist_ok=True)
        AutoModelForCausalLM.register(NeedleConfig, _stand_in("NeedleForCausalLM"), exist_ok=True)
    if "FlaxNeedleForCausalLM" in _MODEL_CLASSES:
        from transformers import FlaxAutoModel, FlaxAutoModelForCausalLM

        FlaxAutoModel.register(NeedleConfig, _stand_in("FlaxNeedleModel"), exist_ok=True)
        FlaxAutoModelForCausalLM.register(NeedleConfig, _stand_in("FlaxNeedleForCausalLM"), exist_ok=True)


_register_auto_classes()
