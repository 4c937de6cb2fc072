"""needle-hf: Needle 2 (Cactus Compute's tool-calling model) for Hugging Face Transformers.

Importing the package registers `NeedleConfig` with `AutoConfig`, the Flax models with
`FlaxAutoModel`/`FlaxAutoModelForCausalLM` (transformers 4.x with jax/flax installed) and the
PyTorch models with `AutoModel`/`AutoModelForCausalLM` (torch installed).

Importing the package imports neither torch's nor jax's model code (together ~190 MB and ~2.5 s),
so a tool that only converts checkpoints or tokenizers stays small: `needle_hf.FlaxNeedleForCausalLM`
and friends import their module on first access, and the Auto mappings hold deferred entries that
become the real classes when read. `MODEL_FOR_CAUSAL_LM_MAPPING[NeedleConfig]` (what the Auto
classes, pipelines and libraries that check the mapping read) imports the model module and returns
`NeedleForCausalLM` itself, and from then on the mapping holds the class.

The package is laid out by role (`models/needle/`, `generation/`, `tools/`, `finetune/`, `hub/`,
`serving/`, `demo/`; docs/architecture.md has the map). The modules' earlier names
(`needle_hf.tool_calls`, ...) still import: `MOVED_MODULES` below.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# Where each module lived before the package was laid out by role (old dotted name -> new one).
# `import needle_hf.tool_calls` and `from needle_hf.tool_calls import X` keep working: the import
# system hands out the module at its new name (one module object under both names). A moved package
# carries its submodules along (`needle_hf.vllm.model` -> `needle_hf.serving.vllm.model`).
MOVED_MODULES = {
    "needle_hf.configuration_needle": "needle_hf.models.needle.configuration_needle",
    "needle_hf.modeling_needle": "needle_hf.models.needle.modeling_needle",
    "needle_hf.modeling_flax_needle": "needle_hf.models.needle.modeling_flax_needle",
    "needle_hf.tokenization_needle": "needle_hf.models.needle.tokenization_needle",
    "needle_hf.tokenization_needle_fast": "needle_hf.models.needle.tokenization_needle_fast",
    "needle_hf.numerics": "needle_hf.models.needle.numerics",
    "needle_hf.weight_names": "needle_hf.models.needle.weight_names",
    "needle_hf.chat_template": "needle_hf.models.needle.chat_template",
    "needle_hf.deploy_numerics": "needle_hf.models.needle.deploy_numerics",
    "needle_hf.deploy_numerics_flax": "needle_hf.models.needle.deploy_numerics_flax",
    "needle_hf.speculative": "needle_hf.models.needle.speculative",
    "needle_hf.speculative_flax": "needle_hf.models.needle.speculative_flax",
    "needle_hf.remote_code": "needle_hf.models.needle.remote_code",
    "needle_hf.kv_window": "needle_hf.generation.kv_window",
    "needle_hf.grammar": "needle_hf.generation.grammar",
    "needle_hf.tool_calls": "needle_hf.tools.tool_calls",
    "needle_hf.tool_routing": "needle_hf.tools.tool_routing",
    "needle_hf.finetune_data": "needle_hf.finetune.data",
    "needle_hf.finetune_heads": "needle_hf.finetune.heads",
    "needle_hf.finetune_torch": "needle_hf.finetune.trainer",
    "needle_hf.finetune_flax": "needle_hf.finetune.trainer_flax",
    "needle_hf.finetune_trl": "needle_hf.finetune.trainer_trl",
    "needle_hf.model_card": "needle_hf.hub.model_card",
    "needle_hf.demo_data": "needle_hf.demo.data",
    "needle_hf.vllm": "needle_hf.serving.vllm",
}


def moved_module_name(name: str) -> str | None:
    """The current dotted name of the module that `name` named before the move, or None."""
    if name in MOVED_MODULES:
        return MOVED_MODULES[name]
    package, _, child = name.rpartition(".")
    while package:
        if package in MOVED_MODULES:
            return f"{MOVED_MODULES[package]}.{child}"
        package, _, parent_child = package.rpartition(".")
        child = f"{parent_child}.{child}"
    return None


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the old names (`MOVED_MODULES`) with the module at its new name."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(f"{__name__}.") or moved_module_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(moved_module_name(spec.name))
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the old name's spec on the module; give it back its own, so
        # the module keeps one identity (its `__spec__.name` is its current dotted name).
        if module.__spec__.loader is self:
            module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())

from transformers import AutoConfig  # noqa: E402

from .models.needle.configuration_needle import NeedleConfig  # noqa: E402
from .models.needle.tokenization_needle import register_tokenizer_class  # noqa: E402

__version__ = "0.1.0"

# Public model classes: name -> the module (in this package) that defines it.
_TORCH_CLASSES = {name: "models.needle.modeling_needle" for name in ("NeedleModel", "NeedleForCausalLM", "NeedlePreTrainedModel")}
_FLAX_CLASSES = {
    name: "models.needle.modeling_flax_needle" for name in ("FlaxNeedleModel", "FlaxNeedleForCausalLM", "FlaxNeedlePreTrainedModel")
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
# The tool-calling SDK (`needle_hf.sdk`): name -> where it is defined; imported on first access.
_SDK_NAMES = ("Needle", "extract", "tool", "Field", "build_schema", "pydantic_schema", "ExtractionValidationError")
__all__ = ["NeedleConfig", *_MODEL_CLASSES, *_SDK_NAMES]


def _model_class(name: str) -> type:
    return getattr(importlib.import_module(f".{_MODEL_CLASSES[name]}", __name__), name)


def __getattr__(name: str):
    """`needle_hf.<model class>` and the SDK's names (`needle_hf.Needle`, ...), imported on first access."""
    if name in _MODEL_CLASSES:
        return _model_class(name)
    if name in _SDK_NAMES:
        return getattr(importlib.import_module(".sdk", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DeferredModelClass(type):
    """Metaclass of the placeholders registered with the Auto classes before the model code is imported.

    A placeholder carries the real class's name and `config_class` (all that registration reads);
    the mapping it is registered in (`_ResolvingEntries`) hands out the real class instead. Any
    other use of a placeholder that escapes (an attribute, a call, an isinstance/issubclass test)
    imports the real class and forwards to it.
    """

    def resolve(cls) -> type:
        return _model_class(cls.__name__)

    def __getattr__(cls, name):  # only for names the placeholder itself lacks
        return getattr(cls.resolve(), name)

    def __call__(cls, *args, **kwargs):
        return cls.resolve()(*args, **kwargs)

    def __instancecheck__(cls, instance):
        return isinstance(instance, cls.resolve())

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, cls.resolve())


class _ResolvingEntries(dict):
    """The registered entries of one transformers Auto mapping (its `_extra_content`, 4.57 and 5.x).

    `_LazyAutoMapping` answers `mapping[config_class]`, `.get`, `.values()` and `.items()` for
    registered classes from this dict; a `DeferredModelClass` placeholder read through any of them
    is replaced by the real class (imported then), so the mapping holds the model classes
    themselves, as for transformers' own models, without importing them at registration.
    """

    def _resolved(self, key):
        value = super().__getitem__(key)
        if isinstance(value, DeferredModelClass):
            value = value.resolve()
            super().__setitem__(key, value)
        return value

    def __getitem__(self, key):
        return self._resolved(key)

    def get(self, key, default=None):
        return self._resolved(key) if key in self else default

    def values(self):
        return [self._resolved(key) for key in self]

    def items(self):
        return [(key, self._resolved(key)) for key in self]


def _placeholder(name: str) -> type:
    return DeferredModelClass(name, (), {"config_class": NeedleConfig, "__module__": f"{__name__}.{_MODEL_CLASSES[name]}"})


def _register(auto_class, name: str) -> None:
    """Register model class `name` with `auto_class` without importing it."""
    mapping = auto_class._model_mapping
    if not isinstance(mapping._extra_content, _ResolvingEntries):
        mapping._extra_content = _ResolvingEntries(mapping._extra_content)
    auto_class.register(NeedleConfig, _placeholder(name), exist_ok=True)


def _register_auto_classes():
    AutoConfig.register(NeedleConfig.model_type, NeedleConfig, exist_ok=True)
    register_tokenizer_class()
    if "NeedleForCausalLM" in _MODEL_CLASSES:
        from transformers import AutoModel, AutoModelForCausalLM

        _register(AutoModel, "NeedleModel")
        _register(AutoModelForCausalLM, "NeedleForCausalLM")
    if "FlaxNeedleForCausalLM" in _MODEL_CLASSES:
        from transformers import FlaxAutoModel, FlaxAutoModelForCausalLM

        _register(FlaxAutoModel, "FlaxNeedleModel")
        _register(FlaxAutoModelForCausalLM, "FlaxNeedleForCausalLM")


_register_auto_classes()

# Needle 3 (needle_hf/models/needle3): its own config and model classes, registered the same deferred way.
from .models.needle3 import register as _register_needle3  # noqa: E402

_register_needle3()

class _RegisterOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the "tool-calling" pipeline task right after `transformers.pipelines` is imported.

    That module is slow to import (it pulls in every pipeline, jax included where installed), so
    importing needle_hf does not import it; this finder sees its import happen, lets it finish, then
    registers the task (`needle_hf.sdk.pipeline`) and removes itself.
    """

    TARGET = "transformers.pipelines"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        module.__spec__.loader = self._inner
        importlib.import_module(".sdk.pipeline", __name__)


def _register_pipeline_task():
    if _RegisterOnImport.TARGET in sys.modules:
        if "NeedleForCausalLM" in _MODEL_CLASSES:
            importlib.import_module(".sdk.pipeline", __name__)
    elif "NeedleForCausalLM" in _MODEL_CLASSES and not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


_register_pipeline_task()
