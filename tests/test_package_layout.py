"""The package's layout by role: imports flow one way, the old module names still import, and a
wheel carries every package folder and data file.

Rooms, lowest first: `models/` (what a saved folder ships as remote code) <- `generation/`,
`tools/`, `finetune/`, `hub/`, `conversion/` <- `serving/`, `demo/`, `sdk/` <- `evaluation/` <- `cli`.
A module imports only from its own rank or below, `models/` only from `models/`, and no two modules import each other,
directly or around a loop (imports inside functions count: they run too).
"""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

import needle_hf

REPO = Path(__file__).resolve().parents[1]
# Where each top-level package of the distribution lives in the source tree.
SOURCE_DIRS = {"needle_hf": REPO / "needle_hf", "needle_hf.conversion": REPO / "conversion",
               "needle_hf.model_cards": REPO / "model_cards"}
RANKS = {"models": 0, "generation": 1, "tools": 1, "finetune": 1, "hub": 1, "conversion": 1, "model_cards": 1,
         "cli": 4, "serving": 2, "demo": 2, "sdk": 2, "evaluation": 3,
         "playground": 3}


def _modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the distribution."""
    modules = {}
    for package, root in SOURCE_DIRS.items():
        for path in root.rglob("*.py"):
            if package == "needle_hf" and path.is_relative_to(REPO / "needle_hf" / "conversion"):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _import_targets(name: str, path: Path) -> set[str]:
    """Every dotted name `name` imports (anywhere in the file), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.update([f"{base}.{alias.name}" for alias in node.names] + [base])
    return targets


def _imported_modules(name: str, path: Path) -> set[str]:
    """The modules of the distribution that `name` imports (anywhere in the file), as dotted names."""
    found = set()
    for target in _import_targets(name, path):
        if target.startswith("needle_hf"):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != "needle_hf":
                found.add(target)
    return found - {name}


GRAPH = {name: _imported_modules(name, path) for name, path in MODULES.items()}


def _room(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_sees_the_package():
    assert "needle_hf.models.needle.modeling_needle" in MODULES
    assert "needle_hf.conversion.convert" in MODULES
    assert "needle_hf.models.needle.numerics" in GRAPH["needle_hf.conversion.cact"]
    assert "needle_hf.models.needle.chat_template" in GRAPH["needle_hf.tools.tool_calls"]


def test_every_module_lives_in_a_known_room():
    rooms = {_room(name) for name in MODULES} - {""}
    assert rooms <= set(RANKS), f"modules outside the rooms of the layout: {sorted(rooms - set(RANKS))}"


def test_the_package_imports_no_old_module_name():
    """The alias table serves users' old imports; the package's own modules use the new names."""
    old_names = tuple(needle_hf.MOVED_MODULES)
    for name, path in MODULES.items():
        if name == "needle_hf":
            continue
        old = sorted(t for t in _import_targets(name, path) if t.startswith(old_names) and
                     any(t == o or t.startswith(f"{o}.") for o in old_names))
        assert not old, f"{name} imports {old} by their old names (see needle_hf.MOVED_MODULES)"


def test_models_import_nothing_outside_models():
    for name, imported in GRAPH.items():
        if _room(name) == "models":
            outside = sorted(target for target in imported if _room(target) != "models")
            assert not outside, f"{name} imports {outside}: models/ must not depend on the rooms above it"


def test_imports_flow_from_the_higher_rooms_down():
    for name, imported in GRAPH.items():
        if not _room(name):
            continue
        upward = sorted(t for t in imported if _room(t) and RANKS[_room(t)] > RANKS[_room(name)])
        assert not upward, f"{name} (rank {RANKS[_room(name)]}) imports from a higher room: {upward}"


def test_no_import_cycle():
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            cycle = on_path[on_path.index(name):] + [name]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if name in done:
            return
        on_path.append(name)
        for target in sorted(GRAPH[name]):
            # A package's __init__ importing its own submodules is how packages re-export.
            if not (MODULES[name].name == "__init__.py" and target.startswith(f"{name}.")):
                visit(target)
        on_path.pop()
        done.add(name)

    for name in sorted(GRAPH):
        visit(name)


def test_package_code_uses_current_module_names():
    for name, path in MODULES.items():
        if name == "needle_hf":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert needle_hf.moved_module_name(node.module) is None, f"{name} imports the old name {node.module}"


# --------------------------------------------------------------------------------------------------
# Old module names


@pytest.mark.parametrize("old_name", sorted(needle_hf.MOVED_MODULES))
def test_old_module_name_is_the_moved_module_itself(old_name):
    new_name = needle_hf.MOVED_MODULES[old_name]
    if new_name.startswith("needle_hf.serving.vllm") and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this environment; tests/serving runs the plugin in .venv-vllm")
    if new_name.endswith("trainer_trl") and importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed")
    old = importlib.import_module(old_name)
    new = importlib.import_module(new_name)
    assert old is new
    assert sys.modules[old_name] is new
    assert new.__name__ == new_name and new.__spec__.name == new_name


def test_from_import_through_an_old_name():
    from needle_hf.tool_calls import parse_tool_calls  # noqa: PLC0415
    from needle_hf.tools.tool_calls import parse_tool_calls as current

    assert parse_tool_calls is current
    from needle_hf import weight_names

    assert weight_names is importlib.import_module("needle_hf.models.needle.weight_names")


def test_old_names_of_a_moved_package_carry_its_submodules():
    assert needle_hf.moved_module_name("needle_hf.vllm.tool_parser") == "needle_hf.serving.vllm.tool_parser"
    assert needle_hf.moved_module_name("needle_hf.vllmx") is None
    assert needle_hf.moved_module_name("needle_hf.tools.tool_calls") is None


def test_unknown_names_still_fail_to_import():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("needle_hf.no_such_module")


def test_every_old_name_points_at_a_module_file():
    for old_name, new_name in needle_hf.MOVED_MODULES.items():
        assert new_name in MODULES, f"{old_name} -> {new_name}, which is not a module of the package"
        assert old_name not in MODULES, f"{old_name} exists again beside its alias"


# --------------------------------------------------------------------------------------------------
# Packaging


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_pyproject_lists_every_package_folder():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    folders = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert listed == folders, f"missing from pyproject: {sorted(folders - listed)}; stale: {sorted(listed - folders)}"


def test_entry_points_name_importable_objects():
    project = _pyproject()["project"]
    module, _, attribute = project["scripts"]["needle-hf"].partition(":")
    assert callable(getattr(importlib.import_module(module), attribute))
    module, _, attribute = project["entry-points"]["vllm.general_plugins"]["needle"].partition(":")
    assert module in MODULES and f"def {attribute}(" in MODULES[module].read_text(encoding="utf-8")


def test_wheel_holds_every_module_and_the_demo_data(tmp_path):
    import subprocess
    import zipfile

    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600,
                           cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("needle_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name, path in MODULES.items():
        inside = name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
        assert inside in names, f"{inside} is missing from the wheel"
    for data in ("needle_hf/demo/needle2-demo.pkl", "needle_hf/demo/tokenizer.model",
                 "needle_hf/model_cards/needle2.md"):
        assert data in names, f"{data} is missing from the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "needle-hf = needle_hf.cli:main" in text and "needle_hf.serving.vllm:register" in text
