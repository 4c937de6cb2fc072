"""The playground without a browser: what Run does (on both twins), lazy loading and switching between
folders, the presets, the Space writer (its app.py imported and run offline) and the command line.

The model is the shipped demo checkpoint converted to a Hugging Face folder, so the answers are real
calls (`set_alarm` for an alarm request); every rendered result is compared with what
`needle_hf.Needle(...).complete(query)` returns for the same inputs.
"""

from __future__ import annotations

import json
import runpy
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import transformers

import needle_hf
from demo_support import PLAY_MUSIC, SET_ALARM, demo_folder  # noqa: F401  (demo_folder: fixture)

gr = pytest.importorskip("gradio", reason="gradio is not installed (pip install 'needle-hf[playground]')")

from needle_hf.cli import main  # noqa: E402
from needle_hf.playground import (  # noqa: E402
    PlaygroundSession, Preset, build_app, default_presets, demo_preset, parse_tools, run_callback, suite_presets,
    write_space)
from needle_hf.playground.app import ELEMENT_IDS  # noqa: E402
from needle_hf.playground.space import SpaceError  # noqa: E402

HAS_FLAX = hasattr(transformers, "FlaxAutoModelForCausalLM")
TWINS = ["pt", pytest.param("flax", marks=pytest.mark.skipif(not HAS_FLAX, reason="transformers 5 has no Flax"))]
TOOLS = [SET_ALARM, PLAY_MUSIC]
QUERY = "Set an alarm for 6:45."
MAX_NEW_TOKENS = 48

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.parametrize("framework", TWINS)
def test_run_shows_what_needle_returns(demo_folder, framework):
    folder = str(demo_folder)
    session = PlaygroundSession([folder], framework=framework)
    calls, reasoning, confidence, validation, speed, status = run_callback(session)(
        folder, json.dumps(TOOLS), QUERY, "")
    expected = needle_hf.Needle(folder, tools=TOOLS, framework=framework).complete(QUERY)
    assert [call["name"] for call in expected["function_calls"]] == ["set_alarm"]
    assert json.loads(calls) == expected["function_calls"]
    assert reasoning == expected["reasoning"]
    assert float(confidence) == pytest.approx(expected["confidence"], abs=1e-3)
    assert validation == "no flags" and status == "1 call(s)"
    assert speed.startswith("prefill ") and " tok/s · decode " in speed


def test_each_run_is_a_new_conversation_with_the_system_text(demo_folder):
    folder = str(demo_folder)
    session = PlaygroundSession([folder])
    system = "You are a phone assistant."
    first = session.run(folder, json.dumps(TOOLS), QUERY, system, max_new_tokens=MAX_NEW_TOKENS)
    again = session.run(folder, json.dumps(TOOLS), QUERY, system, max_new_tokens=MAX_NEW_TOKENS)
    expected = needle_hf.Needle(folder, tools=TOOLS, system=system).complete(QUERY, MAX_NEW_TOKENS)
    assert first.calls == again.calls == expected["function_calls"]
    assert first.validation == expected["validation"]


def test_folders_load_at_their_first_run_and_are_kept(demo_folder, tmp_path):
    first, second = str(demo_folder), str(tmp_path / "second")
    shutil.copytree(first, second)
    session = PlaygroundSession([first, second])
    assert session.loaded() == []
    session.run(first, json.dumps(TOOLS), QUERY, max_new_tokens=MAX_NEW_TOKENS)
    assert session.loaded() == [first]
    backend = session.backend(first)
    answer = session.run(second, json.dumps(TOOLS), QUERY, max_new_tokens=MAX_NEW_TOKENS)
    assert session.loaded() == [first, second] and session.backend(first) is backend
    assert [call["name"] for call in answer.calls] == ["set_alarm"]


def test_bad_input_is_shown_as_an_error_and_loads_nothing(demo_folder, tmp_path):
    folder = str(demo_folder)
    missing = str(tmp_path / "no-such-folder")
    session = PlaygroundSession([folder, missing])
    assert "tools: not valid JSON" in session.run(folder, "[{", QUERY).error
    assert "expected a JSON list of tool schemas" in session.run(folder, "3", QUERY).error
    assert "non-empty string 'name'" in session.run(folder, '[{"description": "x"}]', QUERY).error
    assert session.loaded() == []
    assert session.run(missing, json.dumps(TOOLS), QUERY).error.startswith(f"{missing}: the model could not be loaded")
    assert "is not one of this playground's folders" in session.run("elsewhere", json.dumps(TOOLS), QUERY).error
    bad_parameters = [{"name": "x", "parameters": {"type": "object", "properties": [1]}}]
    assert "tools[0]: tool x: parameters: keyword 'properties' must be an object of schemas" in \
        session.run(folder, json.dumps(bad_parameters), QUERY).error
    with pytest.raises(ValueError, match="at least one"):
        PlaygroundSession([])
    with pytest.raises(ValueError, match="each folder once"):
        PlaygroundSession([folder, folder])


def test_parse_tools_accepts_openai_wrappers_plain_schemas_and_one_schema():
    plain = {"name": "set_alarm", "description": "Set an alarm.", "parameters": {"type": "object", "properties": {}}}
    assert parse_tools("") == []
    assert parse_tools(json.dumps(plain)) == parse_tools(json.dumps([plain]))
    assert [schema["name"] for schema in parse_tools(json.dumps(TOOLS))] == ["set_alarm", "play_music"]


def test_the_app_has_its_boxes_and_presets(demo_folder):
    preset = Preset(name="mine", tools=json.dumps([SET_ALARM]), system="Be brief.", query="Alarm at 5.")
    app = build_app([str(demo_folder)], presets={"mine": preset})
    assert isinstance(app, gr.Blocks)
    components = {block.elem_id: block for block in app.blocks.values() if getattr(block, "elem_id", None)}
    assert set(ELEMENT_IDS) <= set(components)
    assert components["tools"].value == preset.tools and components["system"].value == "Be brief."
    assert components["query"].value == "Alarm at 5." and components["preset"].value == "mine"
    assert app.playground_session.loaded() == []  # building the page loads no model
    with pytest.raises(TypeError, match="Preset"):
        build_app([str(demo_folder)], presets=[{"name": "x"}])


def test_the_model_selector_names_folders_briefly(tmp_path):
    from needle_hf.playground.app import model_choices

    one, other = str(tmp_path / "a" / "needle"), str(tmp_path / "b" / "needle")
    assert model_choices([str(tmp_path / "a" / "needle2-hf/"), "org/needle"]) == [
        ("needle2-hf", str(tmp_path / "a" / "needle2-hf/")), ("org/needle", "org/needle")]
    assert model_choices([one, other]) == [(one, one), (other, other)]


def test_presets_are_the_demo_and_the_installed_app_suites():
    from needle_hf.evaluation import find_suites

    suites = find_suites()
    presets = default_presets()
    assert list(presets) == [demo_preset().name, *suites]
    assert json.loads(demo_preset().tools) == needle_hf.demo.DEMO_TOOLS
    for name, preset in suite_presets().items():
        assert parse_tools(preset.tools) == suites[name].schemas
        assert preset.system == suites[name].system and preset.query == suites[name].cases[0]["query"]


def test_the_written_space_serves_the_page_offline(demo_folder, tmp_path):
    folder = str(demo_folder)
    space = write_space(tmp_path / "space", folder)
    assert sorted(path.name for path in space.iterdir()) == ["README.md", "app.py", "requirements.txt"]
    assert "sdk: gradio" in (space / "README.md").read_text()
    requirements = (space / "requirements.txt").read_text().split()
    assert requirements == [f"needle-hf[playground,torch]=={needle_hf.__version__}", f"gradio=={gr.__version__}"]
    namespace = runpy.run_path(str(space / "app.py"), run_name="space_app")  # importing builds, never launches
    app = namespace["app"]
    assert isinstance(app, gr.Blocks) and app.playground_session.folders == [folder]
    answer = app.playground_session.run(folder, json.dumps(TOOLS), QUERY, max_new_tokens=MAX_NEW_TOKENS)
    assert [call["name"] for call in answer.calls] == ["set_alarm"]


def test_write_space_refuses_a_non_empty_folder_and_keeps_it(tmp_path):
    target = tmp_path / "space"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(SpaceError, match="exists and is not empty; pass --overwrite"):
        write_space(target, "org/needle")
    assert [path.name for path in target.iterdir()] == ["notes.txt"]
    write_space(target, "org/needle", overwrite=True)
    assert "MODEL = 'org/needle'" in (target / "app.py").read_text()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["space"]  # no staging folder left behind


@pytest.mark.parametrize("relation", ["is", "inside", "around"])
def test_write_space_never_writes_over_a_local_model_folder(demo_folder, tmp_path, relation):
    model = tmp_path / "models" / "needle"
    shutil.copytree(demo_folder, model)
    before = sorted((path.relative_to(tmp_path), path.stat().st_size) for path in tmp_path.rglob("*"))
    out = {"is": model, "inside": model / "space", "around": tmp_path / "models"}[relation]
    with pytest.raises(ValueError, match="never writes over its input"):
        write_space(out, model, overwrite=True)
    assert sorted((path.relative_to(tmp_path), path.stat().st_size) for path in tmp_path.rglob("*")) == before


def test_cli_writes_a_space_and_names_usage_errors(tmp_path, capsys):
    assert main(["playground", "org/needle", "--write-space", str(tmp_path / "space")]) == 0
    assert "a Gradio Space serving org/needle" in capsys.readouterr().out
    assert main(["playground", "org/a", "org/b", "--write-space", str(tmp_path / "two")]) == 1
    assert "needle-hf playground: error: --write-space: a Space serves one model, got 2" in capsys.readouterr().err
    assert main(["playground", "org/needle", "--write-space", str(tmp_path / "space")]) == 1
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert not (tmp_path / "two").exists()


def test_cli_serves_the_page_on_localhost(demo_folder):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "needle_hf.cli", "playground", str(demo_folder), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, page = time.monotonic() + 120, None
        while page is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                    page = response.read().decode()
            except OSError:
                time.sleep(0.5)
        assert page is not None, server.stderr.read() if server.poll() is not None else "no answer in 120 s"
        assert "Needle playground" in page
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=30)
    assert f"serving {demo_folder} on http://127.0.0.1:{port}" in stderr
