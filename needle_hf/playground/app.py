"""The playground page (Gradio): tools, query and system in; calls, reasoning, confidence,
validation flags and speed out; a selector between the loaded folders.

    app = build_app(["needle2-hf"])       # a gr.Blocks; nothing is loaded yet
    launch(app, host="127.0.0.1", port=7860)

The Run button calls `run_callback(session)`, which asks `PlaygroundSession.run` and turns its
`PlaygroundAnswer` into the output boxes' values (`answer_outputs`). The page fetches nothing from
the network (system fonts, no analytics, no share link), so it works offline and inside a Space.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Mapping, Optional, Sequence

from .presets import Preset, default_presets
from .session import PlaygroundAnswer, PlaygroundSession

TITLE = "Needle playground"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# elem_ids of the boxes a test or a page script reads and fills
ELEMENT_IDS = ("model", "preset", "tools", "query", "system", "run", "calls", "reasoning", "confidence", "validation",
               "speed", "status")


def answer_outputs(answer: PlaygroundAnswer) -> tuple[str, str, str, str, str, str]:
    """The output boxes' values: (calls JSON, reasoning, confidence, validation flags, speed, status)."""
    status = f"error: {answer.error}" if answer.error else f"{len(answer.calls)} call(s)"
    return (answer.calls_json(), answer.reasoning, answer.confidence_line(), answer.validation_line(),
            answer.speed_line(), status)


def run_callback(session: PlaygroundSession) -> Callable[[str, str, str, str], tuple]:
    """The Run button's function: (model, tools JSON, query, system) -> `answer_outputs`."""
    def run(model: str, tools: str, query: str, system: str) -> tuple:
        return answer_outputs(session.run(model, tools, query, system))

    return run


def model_choices(folders: Sequence[str]) -> list[tuple[str, str]]:
    """(label, folder) of each folder: its last path part (a Hub id whole), the full path where two share it."""
    labels = [folder if HUB_ID.fullmatch(folder) and not os.path.exists(folder) else os.path.basename(os.path.normpath(folder))
              for folder in folders]
    return [(label if labels.count(label) == 1 else folder, folder) for label, folder in zip(labels, folders)]


def _presets_by_name(presets) -> dict[str, Preset]:
    if presets is None:
        return default_presets()
    if isinstance(presets, Mapping):
        presets = list(presets.values())
    by_name = {}
    for preset in presets:
        if not isinstance(preset, Preset):
            raise TypeError(f"presets: expected Preset objects, got {type(preset).__name__}")
        by_name[preset.name] = preset
    return by_name


def build_app(folders: Sequence[str | os.PathLike], *, presets=None, framework: Optional[str] = None):
    """The playground as a `gr.Blocks` (not launched; each folder is loaded at its first Run).

    Args:
        folders: converted Needle folders or Hub ids; the first is selected.
        presets: `Preset`s (a list, or a dict by name) for the preset selector; default: the demo's
            and, with cactus-needle installed, the six app suites' (`presets.default_presets`).
        framework: "pt" (default) or "flax".
    """
    import gradio as gr

    session = PlaygroundSession(folders, framework=framework)
    by_name = _presets_by_name(presets)
    first = next(iter(by_name.values()), Preset(name="", tools="[]"))
    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                              font_mono=["ui-monospace", "monospace"])
    with gr.Blocks(title=TITLE, theme=theme, analytics_enabled=False) as app:
        gr.Markdown(f"# {TITLE}\nTools and a query in; the model's tool calls out.")
        with gr.Row():
            with gr.Column():
                model = gr.Dropdown(choices=model_choices(session.folders), value=session.folders[0], label="Model",
                                    elem_id="model")
                preset = gr.Dropdown(choices=list(by_name), value=first.name or None, label="Preset", elem_id="preset")
                tools = gr.Textbox(value=first.tools, lines=14, max_lines=30, label="Tools (JSON list of schemas)",
                                   elem_id="tools")
                system = gr.Textbox(value=first.system, lines=2, label="System", elem_id="system")
                query = gr.Textbox(value=first.query, lines=2, label="Query", elem_id="query")
                run = gr.Button("Run", variant="primary", elem_id="run")
            with gr.Column():
                status = gr.Textbox(label="Status", interactive=False, elem_id="status")
                calls = gr.Textbox(label="Calls", lines=8, interactive=False, elem_id="calls")
                reasoning = gr.Textbox(label="Reasoning (<think>)", lines=3, interactive=False, elem_id="reasoning")
                with gr.Row():
                    confidence = gr.Textbox(label="Confidence", interactive=False, elem_id="confidence")
                    validation = gr.Textbox(label="Validation", interactive=False, elem_id="validation")
                speed = gr.Textbox(label="Speed", interactive=False, elem_id="speed")

        def choose_preset(name: str):
            chosen = by_name.get(name)
            if chosen is None:
                return gr.update(), gr.update(), gr.update()
            return chosen.tools, chosen.system, chosen.query

        def choose_model(name: str) -> str:
            return f"{name}: loaded" if name in session.loaded() else f"{name}: loads at the first Run"

        preset.change(choose_preset, inputs=preset, outputs=[tools, system, query])
        model.change(choose_model, inputs=model, outputs=status)
        run.click(run_callback(session), inputs=[model, tools, query, system],
                  outputs=[calls, reasoning, confidence, validation, speed, status])
    app.playground_session = session  # the folders and their loaded models, for callers that launch it
    return app


def launch(app, *, host: str = DEFAULT_HOST, port: Optional[int] = DEFAULT_PORT, block: bool = True):
    """Serve ``app`` on ``host:port`` (no share link). ``block=False`` returns once the server is up."""
    app.queue()
    return app.launch(server_name=host, server_port=port, share=False, inbrowser=False, prevent_thread_lock=not block,
                      show_api=False, quiet=True)
