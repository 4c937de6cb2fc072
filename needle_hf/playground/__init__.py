"""The playground: a web page (Gradio) where tools and a query go in and a Needle model's calls come out.

`session` is what the Run button does (no gradio needed), `presets` fills the boxes for the demo and
the app suites, `app` builds the page and serves it, `space` writes a Hugging Face Space that runs the
same page. `needle-hf playground FOLDER [FOLDER ...]` serves it on 127.0.0.1.
"""

from .app import answer_outputs, build_app, launch, run_callback
from .presets import Preset, default_presets, demo_preset, suite_presets
from .session import PlaygroundAnswer, PlaygroundSession, parse_tools
from .space import SpaceError, write_space

__all__ = ["PlaygroundAnswer", "PlaygroundSession", "Preset", "SpaceError", "answer_outputs", "build_app", "default_presets",
           "demo_preset", "launch", "parse_tools", "run_callback", "suite_presets", "write_space"]
