"""A Hugging Face Space that runs the playground on one model: `app.py`, `requirements.txt`, `README.md`.

    needle-hf playground ORG/NAME --write-space space/     # then push space/ as a Gradio Space

`app.py` builds the same page as `needle-hf playground` (`build_app([MODEL])`) and serves it where a
Space expects it (0.0.0.0:7860); MODEL is the Hub id (or folder) given. The README carries the
Space's front matter (Gradio SDK and its version). The folder is staged beside its target and moved
into place complete (`needle_hf.conversion.atomic_output`), never over, inside or around a local model folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from .. import __version__

GRADIO_VERSION = "5.50.0"
SPACE_FILES = ("app.py", "requirements.txt", "README.md")
SPACE_PORT = 7860


def default_requirement() -> str:
    """The pip requirement that installs this package with the playground's and PyTorch's dependencies."""
    return f"needle-hf[playground,torch]=={__version__}"


def space_app_source(model: str, *, framework: Optional[str] = None) -> str:
    """The text of a Space's `app.py` serving ``model``."""
    return (
        f'"""The Needle playground on {model}: tools and a query in, the model\'s tool calls out."""\n\n'
        "from needle_hf.playground import build_app, launch\n\n"
        f"MODEL = {model!r}\n"
        f"app = build_app([MODEL], framework={framework!r})\n\n"
        'if __name__ == "__main__":\n'
        f'    launch(app, host="0.0.0.0", port={SPACE_PORT})\n'
    )


def space_readme(model: str) -> str:
    return (
        "---\n"
        f"title: Needle playground\n"
        "sdk: gradio\n"
        f"sdk_version: {GRADIO_VERSION}\n"
        "app_file: app.py\n"
        "---\n\n"
        f"Tool calling with [{model}](https://huggingface.co/{model}): write tools as JSON schemas and a "
        "query, press Run, and read the calls, the reasoning, the confidence and the validation flags.\n"
    )


class SpaceError(ValueError):
    """The Space folder cannot be written where asked; nothing was written or removed."""


def write_space(out_dir: str | os.PathLike, model: str | os.PathLike, *, framework: Optional[str] = None,
                requirement: Optional[str] = None, overwrite: bool = False) -> Path:
    """Write a Space folder serving ``model``; returns its path.

    Args:
        model: the Hub id (or folder) the Space loads.
        framework: "pt" (default) or "flax".
        requirement: the pip line that installs needle-hf there (default: `default_requirement`).
        overwrite: replace an existing non-empty ``out_dir`` (never a local model folder, nor one
            inside or around it).
    """
    from ..conversion.atomic_output import (
        check_output_folder, errors_name, fsync_tree, publish_folder, staging_path)

    if framework not in (None, "pt", "flax"):
        raise SpaceError(f"framework: expected 'pt' or 'flax', got {framework!r}")
    model = os.fspath(model)
    if not model:
        raise SpaceError("model: name the Hub id or folder the Space serves")
    out_dir = Path(out_dir)
    local_model = model if os.path.lexists(model) else None
    check_output_folder(out_dir, {"model folder": local_model}, command="playground --write-space",
                        overwrite=overwrite, error=SpaceError)
    requirements = [requirement or default_requirement(), f"gradio=={GRADIO_VERSION}"]
    contents = {"app.py": space_app_source(model, framework=framework),
                "requirements.txt": "\n".join(requirements) + "\n", "README.md": space_readme(model)}
    staging = staging_path(out_dir)
    try:
        with errors_name(out_dir, staging):
            staging.mkdir()
            for name, text in contents.items():
                (staging / name).write_text(text, encoding="utf-8")
            fsync_tree(staging)
            publish_folder(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
