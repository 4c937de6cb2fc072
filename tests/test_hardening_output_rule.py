"""One output rule for every command that writes: never over, inside or linked into an input.

`convert`, `export`, `build` (with `--lora` and `--tokenizer`), `lora import` and `lora export`
(with `--base`, or the base the adapter records) all refuse an output path that is an input, lies
inside one, contains one, or reaches one through a symbolic link, however the path is spelled
(relative, `..` detours, trailing slashes), with `--overwrite` or without. Cases are generated
(Hypothesis) over command x input x relation x spelling; each one must end with exit status 1, one
error line and every file of the workspace exactly as it was.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from needle_hf.cli import main
from needle_hf.conversion.atomic_output import OutputOverlapsInputError, check_output_outside_inputs

# The tiny checkpoint, its HF folder and a LoRA adapter (pickle + PEFT folder), as those tests make them.
from test_cli import checkpoint, params as cli_params  # noqa: E402,F401  (fixtures)
from test_lora_interop import hf_dir, imported, params  # noqa: E402,F401  (fixtures)

RULE = "never writes over its input"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, checkpoint, hf_dir, imported, needle_spm_model):
    """Every input a writing command takes, side by side, with the PEFT adapter recording this base."""
    root = tmp_path_factory.mktemp("workspace")
    shutil.copy(checkpoint, root / "source.pkl")
    shutil.copytree(hf_dir, root / "base")
    shutil.copy(needle_spm_model, root / "tokenizer.model")
    folder, _ = imported
    shutil.copy(folder / "needle_lora.pkl", root / "adapter.pkl")
    shutil.copytree(folder / "peft", root / "peft")
    settings_path = root / "peft" / "adapter_config.json"
    recorded = json.loads(settings_path.read_text())
    recorded["base_model_name_or_path"] = str(root / "base")
    settings_path.write_text(json.dumps(recorded, indent=2))
    (root / "cases").mkdir()
    return root


# command -> (its inputs: label -> workspace entry, does it write a folder, argv given the output path)
COMMANDS = {
    "convert": ({"source": "source.pkl"}, True, lambda out: ["convert", "source.pkl", out, "--overwrite"]),
    "convert --tokenizer": ({"source": "source.pkl", "tokenizer": "tokenizer.model"}, True,
                            lambda out: ["convert", "source.pkl", out, "--tokenizer", "tokenizer.model"]),
    "export": ({"Hugging Face folder": "base"}, False, lambda out: ["export", "base", out]),
    "build": ({"Hugging Face folder": "base"}, False, lambda out: ["build", "base", out]),
    "build --lora PEFT": ({"Hugging Face folder": "base", "adapter": "peft"}, False,
                          lambda out: ["build", "base", out, "--lora", "peft"]),
    "build --lora pkl --tokenizer": ({"Hugging Face folder": "base", "adapter": "adapter.pkl",
                                      "tokenizer": "tokenizer.model"}, False,
                                     lambda out: ["build", "base", out, "--lora", "adapter.pkl", "--tokenizer",
                                                  "tokenizer.model"]),
    "lora import": ({"adapter": "adapter.pkl", "base folder": "base"}, True,
                    lambda out: ["lora", "import", "adapter.pkl", out, "--base", "base"]),
    "lora export --base": ({"adapter folder": "peft", "base folder": "base"}, False,
                           lambda out: ["lora", "export", "peft", out, "--base", "base"]),
    # No --base: the base is the folder the adapter records, an input all the same.
    "lora export": ({"adapter folder": "peft", "base folder": "base"}, False,
                    lambda out: ["lora", "export", "peft", out]),
}
RELATIONS = ("is", "inside", "deep inside", "parent", "link to it", "link to its folder", "beside a link inside")
SPELLINGS = ("absolute", "relative", "trailing slash", "detour")


def _snapshot(root: Path) -> dict:
    """Every entry under `root`: file bytes, link targets, folders."""
    state = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            state[key] = ("link", os.readlink(path))
        elif path.is_file():
            state[key] = ("file", path.read_bytes())
        else:
            state[key] = ("folder",)
    return state


def _output(root: Path, case: Path, entry: str, relation: str) -> Path:
    target = root / entry
    if relation == "is":
        return target
    if relation == "inside":
        return target / "out"
    if relation == "deep inside":
        return target / "a" / "b" / "out"
    if relation == "parent":
        return target.parent
    if relation == "link to it":
        (case / "link").symlink_to(target)
        return case / "link"
    if relation == "link to its folder":
        (case / "link").symlink_to(target.parent)
        return case / "link" / entry
    # An output whose folder is a link into an input folder (for a file input: a link to the file).
    (case / "link").symlink_to(target)
    return case / "link" / "out" if target.is_dir() else case / "link"


def _spelled(path: Path, root: Path, spelling: str) -> str:
    if spelling == "absolute":
        return str(path)
    relative = os.path.relpath(path, root)
    if spelling == "relative":
        return relative
    if spelling == "trailing slash":
        return relative + "/"
    return os.path.join("cases", "..", relative)


def _refused(capsys, argv, root: Path):
    """Exit 1, one error line stating the rule, no traceback, the workspace exactly as before."""
    before = _snapshot(root)
    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        status = main(argv)
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    command = argv[0] if argv[0] != "lora" else "lora"
    lines = [line for line in captured.err.splitlines() if line.startswith(f"needle-hf {command}: error:")]
    assert status == 1 and len(lines) == 1 and "Traceback" not in captured.err, (argv, captured.err)
    assert RULE in lines[0], lines[0]
    assert _snapshot(root) == before, argv


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(COMMANDS)), relation=st.sampled_from(RELATIONS),
       spelling=st.sampled_from(SPELLINGS), overwrite=st.booleans(), pick=st.integers(0, 2))
def test_no_command_writes_over_inside_or_through_a_link_into_an_input(workspace, capsys, command, relation,
                                                                      spelling, overwrite, pick):
    inputs, _, argv_for = COMMANDS[command]
    entry = list(inputs.values())[pick % len(inputs)]
    case = workspace / "cases" / "case"
    case.mkdir()
    try:
        out = _output(workspace, case, entry, relation)
        argv = argv_for(_spelled(out, workspace, spelling))
        if overwrite and "--overwrite" not in argv:
            argv.append("--overwrite")
        _refused(capsys, argv, workspace)
    finally:
        shutil.rmtree(case)


@pytest.mark.parametrize("command", sorted(name for name, (inputs, _, _) in COMMANDS.items()
                                           if "Hugging Face folder" in inputs or "base folder" in inputs))
def test_an_input_folder_linked_from_inside_the_output_is_refused(workspace, capsys, command):
    """The base folder given as a link whose target lies inside the output, and a base whose file is a
    link into the output (as a Hub cache snapshot links into its blobs)."""
    inputs, _, argv_for = COMMANDS[command]
    case = workspace / "cases" / "case"
    out = case / "out"
    (out / "real-base").mkdir(parents=True)
    moved = workspace / "base.moved"
    try:
        # 1. `base` itself is a link into the output.
        os.rename(workspace / "base", moved)
        shutil.copytree(moved, out / "real-base", dirs_exist_ok=True)
        (workspace / "base").symlink_to(out / "real-base")
        writes_folder = COMMANDS[command][1]
        _refused(capsys, argv_for(str(out) if writes_folder else str(out / "real-base" / "blob")), workspace)
        # 2. `base` is a real folder, one of its files a link into the output.
        (workspace / "base").unlink()
        os.rename(moved, workspace / "base")
        os.rename(workspace / "base" / "config.json", out / "config.json")
        (workspace / "base" / "config.json").symlink_to(out / "config.json")
        _refused(capsys, argv_for(str(out) if writes_folder else str(out / "config.json")), workspace)
    finally:
        if (workspace / "base").is_symlink():
            (workspace / "base").unlink()
        if moved.exists():
            os.rename(moved, workspace / "base")
        if (workspace / "base" / "config.json").is_symlink():
            (workspace / "base" / "config.json").unlink()
            os.rename(out / "config.json", workspace / "base" / "config.json")
        shutil.rmtree(case)


def test_lora_export_over_its_base_with_overwrite_leaves_the_base_intact(workspace, capsys):
    """The headline case: the output inside the base, `--overwrite`, the base recorded or given."""
    for argv in (["lora", "export", "peft", "base/model.safetensors", "--overwrite"],
                 ["lora", "export", "peft", "base/config.json", "--base", "base", "--overwrite"],
                 ["lora", "export", "peft", "./base//config.json/", "--overwrite"]):
        _refused(capsys, argv, workspace)


def test_every_command_writes_beside_its_inputs(workspace, capsys):
    """The rule refuses overlap only: each command still writes next to its inputs, and nothing else changes."""
    case = workspace / "cases" / "ok"
    case.mkdir()
    before = {entry: _snapshot(workspace / entry) for entry in ("base", "peft")}
    cwd = os.getcwd()
    os.chdir(workspace)
    try:
        for index, (command, (_, folder, argv_for)) in enumerate(sorted(COMMANDS.items())):
            if command.startswith("convert"):
                continue  # converting is covered by test_cli
            out = Path("cases", "ok", f"out{index}" if folder else f"out{index}.bin")
            assert main(argv_for(str(out))) == 0, command
            assert out.exists(), command
    finally:
        os.chdir(cwd)
        shutil.rmtree(case)
    assert {entry: _snapshot(workspace / entry) for entry in ("base", "peft")} == before
    capsys.readouterr()


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(["a", "b", "..", ".", "c"]), min_size=0, max_size=5),
       other=st.lists(st.sampled_from(["a", "b", "..", ".", "c"]), min_size=0, max_size=5),
       slash=st.booleans())
def test_the_rule_agrees_with_resolved_paths(tmp_path_factory, parts, other, slash):
    """Property: refused exactly when one resolved path equals or contains the other."""
    root = Path(os.path.realpath(tmp_path_factory.getbasetemp())) / "rule"
    output, source = root.joinpath(*parts), root.joinpath(*other)
    out_real, source_real = Path(os.path.realpath(output)), Path(os.path.realpath(source))
    overlaps = out_real == source_real or out_real.is_relative_to(source_real) or source_real.is_relative_to(out_real)
    spelled = str(output) + ("/" if slash else "")
    if overlaps:
        with pytest.raises(OutputOverlapsInputError, match=RULE):
            check_output_outside_inputs(spelled, {"input": source}, command="test")
    else:
        check_output_outside_inputs(spelled, {"input": source}, command="test")


# ------------------------------------------------------------------------------------------------
# Errors while writing name the user's path, never the staging name.


@pytest.mark.parametrize("failure", ["disk full", "value"])
@pytest.mark.parametrize("command", ["export", "build", "lora import", "lora export"])
def test_a_failure_while_staging_names_the_output_and_leaves_nothing(workspace, capsys, monkeypatch, command, failure):
    case = workspace / "cases" / "staging"
    case.mkdir()
    out = case / ("out" if command == "lora import" else "out.bin")
    argv = {"export": ["export", "base", str(out)], "build": ["build", "base", str(out)],
            "lora import": ["lora", "import", "adapter.pkl", str(out), "--base", "base"],
            "lora export": ["lora", "export", "peft", str(out), "--base", "base"]}[command]

    def fail(staging, target):
        if failure == "disk full":
            raise OSError(28, "No space left on device", str(staging))
        raise ValueError(f"{staging}: the staged output does not read back")

    for module in ("needle_hf.conversion.export", "needle_hf.conversion.cact_writer", "needle_hf.conversion.lora"):
        for name in ("publish_file", "publish_folder"):
            if hasattr(__import__(module, fromlist=[name]), name):
                monkeypatch.setattr(f"{module}.{name}", fail)
    cwd = os.getcwd()
    os.chdir(workspace)
    try:
        capsys.readouterr()
        assert main(argv) == 1
    finally:
        os.chdir(cwd)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(out) in error and ".partial-" not in error, error
    assert sorted(case.iterdir()) == []
    shutil.rmtree(case)


# ------------------------------------------------------------------------------------------------
# Generated paths: every writing command ends with one error line or a usage error, never a traceback.

PATHS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", ".", "..", "/", "/dev/null", "/dev/full", "/proc/self", "\x00", "a\x00b", "\udcff", "x" * 5000,
                     "base", "base/", "peft", "adapter.pkl", "source.pkl", "tokenizer.model", "cases"]),
)
ARGV = {
    "convert": lambda a, b: ["convert", a, b],
    "export": lambda a, b: ["export", a, b, "--overwrite"],
    "build": lambda a, b: ["build", a, b, "--lora", "peft"],
    "lora import": lambda a, b: ["lora", "import", a, b, "--base", "base"],
    "lora export": lambda a, b: ["lora", "export", a, b],
    "push": lambda a, b: ["push", a, b],
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(ARGV)), source=PATHS, output=PATHS)
def test_generated_paths_never_end_in_a_traceback(workspace, capsys, command, source, output):
    if command == "push":
        output = "org/" + output.replace("/", "")  # never a reachable Hub: the folder check runs first
    before = _snapshot(workspace / "base")
    cwd = os.getcwd()
    os.chdir(workspace / "cases")
    try:
        capsys.readouterr()
        try:
            status = main(ARGV[command](source, output))
        except SystemExit as usage:
            status = usage.code
    finally:
        os.chdir(cwd)
        for entry in (workspace / "cases").iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    captured = capsys.readouterr()
    assert status in (0, 1, 2) and "Traceback" not in captured.err, captured.err
    if status == 1:
        assert len([line for line in captured.err.splitlines() if ": error:" in line]) == 1, captured.err
    assert _snapshot(workspace / "base") == before
