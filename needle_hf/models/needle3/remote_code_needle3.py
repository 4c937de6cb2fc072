"""Ship the Needle 3 model code beside saved weights, for users who load with `trust_remote_code=True`.

transformers (4.57 and 5.x) imports the classes `config.json`'s `auto_map` names from `.py` files next
to the weights, following flat relative imports (`from .numerics import ...`) only. In this package
the Needle 3 files also import the pieces they share with Needle 2 from its folder
(`from ..needle.numerics import ...`). The shipped folder is flat: `write_remote_code` copies every
file the mapped modules reach, the shared ones included, and writes those imports as flat ones.
Nothing else in a file changes.

This module is itself shipped (the config's save hook imports it), so it imports only the standard
library. Run from a remote-code copy (a model loaded with `trust_remote_code=True` and saved again)
the files are already flat and side by side; it maps only the classes whose code that copy holds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The Auto classes a Needle 3 folder declares, and the `module.Class` each one loads.
AUTO_MAP = {
    "AutoConfig": "configuration_needle3.Needle3Config",
    "AutoModel": "modeling_needle3.Needle3Model",
    "AutoModelForCausalLM": "modeling_needle3.Needle3ForCausalLM",
    "FlaxAutoModel": "modeling_flax_needle3.FlaxNeedle3Model",
    "FlaxAutoModelForCausalLM": "modeling_flax_needle3.FlaxNeedle3ForCausalLM",
}
# A relative import of this folder (`.name`) or of Needle 2's (`..needle.name`), anywhere in a line
# start (imports inside functions count too, as transformers counts them).
_RELATIVE_IMPORT = re.compile(r"^(\s*from\s+)(\.\.needle\.|\.)(\w+)(\s+import\b)", flags=re.MULTILINE)
_OTHER_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.\.", flags=re.MULTILINE)


class RemoteCodeError(FileNotFoundError):
    """The Needle 3 model code cannot be shipped: a file it needs is missing."""


def _locate(module: str, source_dir: Path) -> Path:
    """This folder's `module.py`, else Needle 2's folder's (the shared pieces)."""
    for candidate in (source_dir / f"{module}.py", source_dir.parent / "needle" / f"{module}.py"):
        if candidate.is_file():
            return candidate
    raise RemoteCodeError(f"{module}.py: not in {source_dir} nor in {source_dir.parent / 'needle'}")


def flat_source(path: Path) -> str:
    """The text of `path` as shipped: `from ..needle.x import` becomes `from .x import`."""
    text = path.read_text(encoding="utf-8")
    flat = _RELATIVE_IMPORT.sub(lambda m: f"{m.group(1)}.{m.group(3)}{m.group(4)}", text)
    if _OTHER_RELATIVE_IMPORT.search(flat):
        raise RemoteCodeError(f"{path}: a relative import outside this folder and Needle 2's cannot be shipped")
    return flat


def remote_code_files(source_dir: str | os.PathLike | None = None) -> dict[str, list[Path]]:
    """`{auto class name: [module file, *everything it imports relatively, recursively]}` for the
    `AUTO_MAP` entries whose files all exist (in `source_dir`, default this module's folder, or in
    Needle 2's folder beside it)."""
    source_dir = Path(source_dir) if source_dir is not None else Path(__file__).resolve().parent
    needed_by_entry = {}
    for auto_class, reference in AUTO_MAP.items():
        try:
            pending, needed = [_locate(reference.partition(".")[0], source_dir)], {}
            while pending:
                path = pending.pop()
                if path.name in needed:
                    continue
                needed[path.name] = path
                pending += [_locate(m.group(3), source_dir) for m in _RELATIVE_IMPORT.finditer(path.read_text("utf-8"))]
        except RemoteCodeError:
            continue
        needed_by_entry[auto_class] = list(needed.values())
    return needed_by_entry


def write_remote_code(save_directory: str | os.PathLike, config) -> list[str]:
    """Copy the model code, flat, into `save_directory` and point `config.auto_map` at it.

    Call it before `config.json` is written. Entries of `auto_map` that are not Needle 3's are kept.
    Returns the names of the files written, sorted.

    Raises:
        RemoteCodeError: configuration_needle3.py or a file it imports is missing.
    """
    source_dir = Path(__file__).resolve().parent
    available = remote_code_files(source_dir)
    if "AutoConfig" not in available:
        raise RemoteCodeError(f"cannot ship the Needle 3 model code: configuration_needle3.py or a file it imports "
                              f"is missing from {source_dir}")
    target_dir = Path(save_directory)
    target_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for path in {path for paths in available.values() for path in paths}:
        target = target_dir / path.name
        if path.name in written and written[path.name] != path:
            raise RemoteCodeError(f"two shipped files are both named {path.name}: {written[path.name]} and {path}")
        written[path.name] = path
        # Saving into the folder the code was loaded from must not rewrite a file onto itself.
        if not (target.exists() and os.path.samefile(path, target)):
            target.write_text(flat_source(path), encoding="utf-8")
    kept = {key: value for key, value in (getattr(config, "auto_map", None) or {}).items() if key not in AUTO_MAP}
    config.auto_map = {**kept, **{auto_class: AUTO_MAP[auto_class] for auto_class in available}}
    return sorted(written)


__all__ = ["AUTO_MAP", "RemoteCodeError", "flat_source", "remote_code_files", "write_remote_code"]
