"""Ship the model code beside saved weights, for users who load with `trust_remote_code=True`.

A Hugging Face user without `needle_hf` installed can still load a Needle folder or Hub repository:
`config.json` names the classes in `auto_map`, and transformers (4.57 and 5.x) imports them from
`.py` files stored next to the weights. `write_remote_code` copies those files and writes the map.

How transformers reads the files (`transformers.dynamic_module_utils`, same in 4.57 and 5.x): for
the Auto class being used it takes the `auto_map` entry (`"AutoModelForCausalLM":
"modeling_needle.NeedleForCausalLM"`), fetches that module file, refuses it unless every absolute
import in it is installed (`check_imports`; imports inside a `try:` block are exempt), and fetches
its relative imports (`from .x import ...`) the same way, recursively. Hence:

  * the shipped files import each other only as flat relative imports (`from .numerics import`),
    and nothing from the `needle_hf` package;
  * `AutoConfig` reads configuration_needle.py; `AutoModel`/`AutoModelForCausalLM` read
    modeling_needle.py and its relative imports and need torch only; the Flax classes read
    modeling_flax_needle.py (+ weight_names.py, numerics.py), which needs jax and flax, and are never looked
    at by a PyTorch load. So transformers 5 (no Flax) loads the PyTorch classes from a folder that
    also carries the Flax file;
  * the tokenizer needs no code: tokenizer_config.json names transformers' `PreTrainedTokenizerFast`
    (see `tokenization_needle.save_fast_tokenizer`).

Which files are copied is derived from `AUTO_MAP` and the files' own relative imports (parsed with
transformers' own `get_relative_import_files`), so adding an import to a model file ships the
imported file without touching a list here. This module is itself one of the shipped files once a
shipped file imports it (the save hook in `NeedleConfig.save_pretrained`), so it too imports only
the standard library and transformers.
Run from a remote-code copy (a model loaded with `trust_remote_code=True` and saved again), it
ships the files that were fetched with it and maps only the classes whose code the folder holds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

# The Auto classes a Needle folder declares, and the `module.Class` each one loads. The keys are the
# Auto class names transformers looks up (`cls.__name__` of the Auto class, 4.57 and 5.x alike).
AUTO_MAP = {
    "AutoConfig": "configuration_needle.NeedleConfig",
    "AutoModel": "modeling_needle.NeedleModel",
    "AutoModelForCausalLM": "modeling_needle.NeedleForCausalLM",
    "FlaxAutoModel": "modeling_flax_needle.FlaxNeedleModel",
    "FlaxAutoModelForCausalLM": "modeling_flax_needle.FlaxNeedleForCausalLM",
}


class RemoteCodeError(FileNotFoundError):
    """The model code cannot be shipped: a file it needs is missing next to this module."""


def _module_file(reference: str, source_dir: Path) -> Path:
    module, _, _class_name = reference.partition(".")
    return source_dir / f"{module}.py"


def remote_code_files(source_dir: str | os.PathLike | None = None) -> dict[str, list[Path]]:
    """The files each `AUTO_MAP` entry needs, for the entries whose files all exist in `source_dir`.

    Args:
        source_dir: where the model files live; defaults to the folder of this module (the
            installed package, or the remote-code cache folder when this copy was loaded from a
            saved model).

    Returns:
        `{auto class name: [module file, *its relative imports, recursively]}`, absolute paths.
    """
    source_dir = Path(source_dir) if source_dir is not None else Path(__file__).resolve().parent
    needed_by_entry = {}
    for auto_class, reference in AUTO_MAP.items():
        module_file = _module_file(reference, source_dir)
        if not module_file.is_file():
            continue
        try:
            # Reads every file on the way, so a missing imported file raises here.
            needed = [module_file, *(Path(path) for path in get_relative_import_files(str(module_file)))]
        except FileNotFoundError:
            continue
        if all(path.is_file() for path in needed):
            needed_by_entry[auto_class] = needed
    return needed_by_entry


def write_remote_code(save_directory: str | os.PathLike, config) -> list[str]:
    """Copy the model code into `save_directory` and point `config.auto_map` at it.

    Call it before `config.json` is written (it changes `config.auto_map`). Needle's entries of the
    map become exactly the classes whose code the folder then holds (module file and every relative
    import): all five from the installed package; from a remote-code copy, those whose files were
    fetched with it or were already saved into the folder (transformers' own `custom_object_save`
    copies the saved model's file first). Entries that are not Needle's (say a custom
    `AutoTokenizer`) are kept.

    Args:
        save_directory: the folder being saved (created if needed).
        config: the `NeedleConfig` about to be saved; its `auto_map` attribute is set.

    Returns:
        The names of the files copied, sorted.

    Raises:
        RemoteCodeError: configuration_needle.py (or one of its relative imports) is missing next to
            this module, so not even `AutoConfig` could load the folder.
    """
    source_dir = Path(__file__).resolve().parent
    available = remote_code_files(source_dir)
    if "AutoConfig" not in available:
        raise RemoteCodeError(
            f"cannot ship the Needle model code: {_module_file(AUTO_MAP['AutoConfig'], source_dir)} or one of the "
            f"files it imports is missing from {source_dir}"
        )
    target_dir = Path(save_directory)
    target_dir.mkdir(parents=True, exist_ok=True)
    copied = set()
    for path in {path for paths in available.values() for path in paths}:
        target = target_dir / path.name
        # Saving into the folder the code was loaded from must not copy a file onto itself.
        if not (target.exists() and os.path.samefile(path, target)):
            shutil.copyfile(path, target)
        copied.add(path.name)

    shipped = remote_code_files(target_dir)
    kept = {key: value for key, value in (getattr(config, "auto_map", None) or {}).items() if key not in AUTO_MAP}
    config.auto_map = {**kept, **{auto_class: AUTO_MAP[auto_class] for auto_class in shipped}}
    return sorted(copied)


__all__ = ["AUTO_MAP", "RemoteCodeError", "remote_code_files", "write_remote_code"]
