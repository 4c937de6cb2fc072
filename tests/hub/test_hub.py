"""`needle-hf push` and loading Needle models from a Hub repository, over HTTP against the local hub.

The repository under test holds two pushes of a complete Needle folder whose model.safetensors is
above the Hub's 10 MB LFS threshold. Expected values come from the pushed files themselves (read
with safetensors / hashlib) and from git, never from the code under test.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.utils import RepositoryNotFoundError, RevisionNotFoundError
from safetensors.numpy import load_file

from hub_server import LFS_SIZE_THRESHOLD, LocalHub, choose_upload_mode
from hub_support import (
    LFS_SIZED_WITH_TOKENIZER,
    TINY_WITH_TOKENIZER,
    cached_snapshot_files,
    child_environment,
    finish_python,
    flax_model_available,
    lfs_pointer,
    partial_downloads,
    sha256_of_files,
    skip_without_flax_model,
    start_python,
    write_needle_folder,
)
from needle_hf.conversion.export import ExportError
from needle_hf.hub import PushError, add_push_arguments, push_folder, run_push
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.weight_names import NeedleWeightsError

WEIGHTS = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class PushedVersions:
    repo_id: str
    first_folder: Path
    second_folder: Path
    first_commit: str
    second_commit: str


def git(hub: LocalHub, repo_id: str, *args: str) -> bytes:
    """git on the bare repository behind `repo_id`: what the hub really stored."""
    return subprocess.run(["git", f"--git-dir={hub.git_dir(repo_id)}", *args], check=True, capture_output=True).stdout


def causes(error: BaseException) -> list[BaseException]:
    """`error` and every exception it was raised from or while handling."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def torch_tensors(model: NeedleForCausalLM) -> dict[str, np.ndarray]:
    """The tensors a saved file holds: the state dict less the tied head, which is the embedding."""
    state = model.state_dict()
    assert state.pop("lm_head.weight").data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    return {name: tensor.detach().numpy() for name, tensor in state.items()}


def flax_tensors(model) -> dict[str, np.ndarray]:
    from needle_hf.models.needle.modeling_flax_needle import flax_params_to_hf

    return flax_params_to_hf(model.params, model.config)


def load_tensors(framework: str, source: str, **kwargs) -> dict[str, np.ndarray]:
    """HF-named weights of the package model `framework` ("torch" or "flax") loaded from `source`."""
    if framework == "torch":
        return torch_tensors(NeedleForCausalLM.from_pretrained(source, **kwargs))
    skip_without_flax_model()
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    return flax_tensors(FlaxNeedleForCausalLM.from_pretrained(source, **kwargs))


def assert_same_tensors(loaded: dict[str, np.ndarray], expected: dict[str, np.ndarray]):
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


FRAMEWORKS = ("torch", "flax")


# --------------------------------------------------------------------------------------------------
# Fixtures


# Loads against a stopped hub retry for ~23 s per file in huggingface_hub (both 0.x and 1.x+), so they
# run in child processes started when this module starts and collected by the last test.
OUTAGE_SCRIPT = """
import json
import sys
from pathlib import Path

arguments = json.loads(sys.argv[1])
if arguments["framework"] == "torch":
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM as model_class
else:
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM as model_class
chain = []
try:
    model_class.from_pretrained(arguments["repo_id"], cache_dir=arguments["cache_dir"])
except Exception as error:
    while error is not None and not any(error is seen for seen, _, _ in chain):
        chain.append((error, type(error).__module__ + "." + type(error).__name__, str(error)))
        error = error.__cause__ or error.__context__
Path(arguments["result"]).write_text(json.dumps([[name, message] for _, name, message in chain]))
"""


@pytest.fixture(scope="module", autouse=True)
def outage_loads(tmp_path_factory):
    """Start a hub, stop it, and start one child per framework loading a repository from it."""
    scratch = tmp_path_factory.mktemp("outage")
    with LocalHub(scratch / "hub") as hub:
        repo_id = f"{hub.user}/needle-during-outage"
    script = scratch / "load_during_outage.py"
    script.write_text(OUTAGE_SCRIPT, encoding="utf-8")
    environment = child_environment(hf_home=scratch / "hf_home", endpoint=hub.endpoint, token=hub.token)
    # The child imports needle_hf from this repository (the package under test), not a remote copy.
    environment["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    children = {}
    for framework in FRAMEWORKS:
        if framework == "flax" and not flax_model_available():
            continue
        cache_dir = scratch / f"cache-{framework}"
        result = scratch / f"{framework}.json"
        arguments = {"framework": framework, "repo_id": repo_id, "cache_dir": str(cache_dir), "result": str(result)}
        process = start_python(sys.executable, script, arguments, environment=environment, cwd=scratch)
        children[framework] = (process, result, cache_dir)
    yield hub.endpoint, children
    for process, _, _ in children.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, local_hub, needle_spm_model) -> PushedVersions:
    """Two versions of an LFS-sized Needle folder pushed to one repository, in order."""
    scratch = tmp_path_factory.mktemp("versions")
    first, second = scratch / "v1", scratch / "v2"
    write_needle_folder(first, LFS_SIZED_WITH_TOKENIZER, seed=1, spm_model=needle_spm_model)
    write_needle_folder(second, LFS_SIZED_WITH_TOKENIZER, seed=2, spm_model=needle_spm_model)
    repo_id = f"{local_hub.user}/needle-pushed-{uuid.uuid4().hex[:8]}"
    first_commit = push_folder(first, repo_id, commit_message="First version")
    second_commit = push_folder(second, repo_id, commit_message="Second version")
    return PushedVersions(repo_id, first, second, first_commit, second_commit)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory, needle_spm_model) -> Path:
    folder = tmp_path_factory.mktemp("small") / "needle-small"
    write_needle_folder(folder, TINY_WITH_TOKENIZER, seed=5, spm_model=needle_spm_model)
    return folder


def copy_folder(folder: Path, destination: Path) -> Path:
    shutil.copytree(folder, destination)
    return destination


# --------------------------------------------------------------------------------------------------
# Push


def test_push_sends_the_weights_through_lfs_and_the_rest_as_regular_files(pushed: PushedVersions, local_hub):
    weights = (pushed.second_folder / WEIGHTS).read_bytes()
    sha256 = hashlib.sha256(weights).hexdigest()
    # Large enough that the Hub stores it in LFS whatever .gitattributes says.
    assert len(weights) >= LFS_SIZE_THRESHOLD
    assert choose_upload_mode([], WEIGHTS, size=len(weights), sample=weights[:512]) == "lfs"

    assert git(local_hub, pushed.repo_id, "show", f"main:{WEIGHTS}") == lfs_pointer(weights)
    for name in ("config.json", "tokenizer.json", "modeling_needle.py", "README.md"):
        assert git(local_hub, pushed.repo_id, "show", f"main:{name}") == (pushed.second_folder / name).read_bytes()
    uploads = [
        served
        for served in local_hub.served_requests()
        if served.method == "PUT" and served.path == f"/lfs-upload/{pushed.repo_id}/{sha256}"
    ]
    assert [served.status for served in uploads] == [200]
    entry = {item.path: item for item in HfApi().list_repo_tree(pushed.repo_id)}[WEIGHTS]
    assert (entry.lfs.sha256, entry.lfs.size) == (sha256, len(weights))


def test_push_returns_the_commit_that_holds_the_folder(pushed: PushedVersions, local_hub):
    commits = HfApi().list_repo_commits(pushed.repo_id)

    assert [commit.commit_id for commit in commits[:2]] == [pushed.second_commit, pushed.first_commit]
    assert [commit.title for commit in commits] == ["Second version", "First version", "initial commit"]
    assert git(local_hub, pushed.repo_id, "rev-parse", "main").decode().strip() == pushed.second_commit


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_from_pretrained_of_the_repo_id_gives_the_pushed_weights(pushed: PushedVersions, framework, tmp_path):
    loaded = load_tensors(framework, pushed.repo_id, cache_dir=tmp_path)

    assert_same_tensors(loaded, load_file(pushed.second_folder / WEIGHTS))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_revision_of_the_first_commit_still_gives_the_first_weights(pushed: PushedVersions, framework, tmp_path):
    old = load_tensors(framework, pushed.repo_id, revision=pushed.first_commit, cache_dir=tmp_path)

    first, second = load_file(pushed.first_folder / WEIGHTS), load_file(pushed.second_folder / WEIGHTS)
    assert not np.array_equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert_same_tensors(old, first)


def test_pushing_an_unchanged_folder_makes_no_commit(pushed: PushedVersions):
    before = HfApi().list_repo_commits(pushed.repo_id)

    again = push_folder(pushed.second_folder, pushed.repo_id, commit_message="Nothing changed")

    assert again == pushed.second_commit
    assert HfApi().list_repo_commits(pushed.repo_id) == before


def test_snapshot_download_files_hash_like_the_pushed_folders(pushed: PushedVersions, tmp_path):
    latest = Path(snapshot_download(pushed.repo_id, cache_dir=tmp_path))
    first = Path(snapshot_download(pushed.repo_id, revision=pushed.first_commit, cache_dir=tmp_path))

    assert latest.name == pushed.second_commit and first.name == pushed.first_commit
    for snapshot, folder in ((latest, pushed.second_folder), (first, pushed.first_folder)):
        downloaded = sha256_of_files(snapshot)
        downloaded.pop(".gitattributes")
        assert downloaded == sha256_of_files(folder)
    assert partial_downloads(tmp_path) == []


def test_push_to_a_branch_of_a_private_repo_leaves_main_untouched(small_folder, hub_repo_id, tmp_path):
    commit = push_folder(small_folder, hub_repo_id, revision="experiment", private=True)

    api = HfApi()
    assert api.model_info(hub_repo_id).private is True
    assert api.list_repo_files(hub_repo_id) == [".gitattributes"]
    assert api.model_info(hub_repo_id, revision="experiment").sha == commit
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=False).model_info(hub_repo_id)
    loaded = load_tensors("torch", hub_repo_id, revision="experiment", cache_dir=tmp_path)
    assert_same_tensors(loaded, load_file(small_folder / WEIGHTS))


def test_push_writes_the_model_card_into_a_folder_without_readme(small_folder, hub_repo_id, tmp_path):
    folder = copy_folder(small_folder, tmp_path / "folder")
    (folder / "README.md").unlink(missing_ok=True)

    push_folder(folder, hub_repo_id)

    readme = (folder / "README.md").read_text(encoding="utf-8")
    assert f'repo_id = "{hub_repo_id}"' in readme
    assert HfApi().list_repo_files(hub_repo_id).count("README.md") == 1


def test_push_keeps_an_existing_readme(small_folder, hub_repo_id, tmp_path):
    folder = copy_folder(small_folder, tmp_path / "folder")
    custom = "---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# My own card\n"
    (folder / "README.md").write_text(custom, encoding="utf-8")

    push_folder(folder, hub_repo_id)

    downloaded = Path(snapshot_download(hub_repo_id, cache_dir=tmp_path / "cache")) / "README.md"
    assert downloaded.read_text(encoding="utf-8") == custom


def _break_folder(folder: Path, problem: str):
    import json

    config_path = folder / "config.json"
    if problem == "missing code file":
        (folder / "modeling_needle.py").unlink()
    elif problem == "missing imported file":
        (folder / "numerics.py").unlink()
    elif problem == "no auto_map":
        fields = json.loads(config_path.read_text())
        del fields["auto_map"]
        config_path.write_text(json.dumps(fields))
    elif problem == "weights of another geometry":
        fields = json.loads(config_path.read_text())
        fields["hidden_size"] = 2 * fields["hidden_size"]
        fields["attention_dim"] = 2 * fields["attention_dim"]
        config_path.write_text(json.dumps(fields))
    elif problem == "no weights":
        (folder / WEIGHTS).unlink()
    elif problem == "not a Needle config":
        fields = json.loads(config_path.read_text())
        fields["model_type"] = "llama"
        config_path.write_text(json.dumps(fields))


@pytest.mark.parametrize(
    "problem, error, message",
    [
        ("missing code file", PushError, r"code of AutoModel -> .*, AutoModelForCausalLM -> [\w.]+ \(its module"),
        ("missing imported file", PushError, r"AutoModelForCausalLM -> [\w.]+, FlaxAutoModel -> "),
        ("no auto_map", PushError, "auto_map does not name AutoConfig, AutoModelForCausalLM"),
        ("weights of another geometry", NeedleWeightsError, r"tensor model\.embed_tokens\.weight: expected shape"),
        ("no weights", ExportError, "no model.safetensors"),
        ("not a Needle config", ExportError, "model_type 'llama', expected 'needle2'"),
    ],
)
def test_push_refuses_an_incomplete_folder_before_creating_the_repo(
    small_folder, hub_repo_id, tmp_path, problem, error, message
):
    folder = copy_folder(small_folder, tmp_path / "folder")
    _break_folder(folder, problem)

    with pytest.raises(error, match=message):
        push_folder(folder, hub_repo_id)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info(hub_repo_id)


def test_push_refuses_a_commit_id_as_branch(small_folder, hub_repo_id):
    with pytest.raises(PushError, match="must be a branch name"):
        push_folder(small_folder, hub_repo_id, revision="0123456789abcdef0123456789abcdef01234567")


# --------------------------------------------------------------------------------------------------
# Command line


def test_push_command_prints_the_commit_and_uploads_the_folder(small_folder, hub_repo_id, capsys):
    parser = argparse.ArgumentParser(prog="needle-hf push")
    add_push_arguments(parser)
    args = parser.parse_args([str(small_folder), hub_repo_id, "--commit-message", "From the CLI"])

    assert run_push(args) == 0

    [commit] = [commit for commit in HfApi().list_repo_commits(hub_repo_id) if commit.title == "From the CLI"]
    assert capsys.readouterr().out.strip() == f"pushed {small_folder} to {hub_repo_id}@main: commit {commit.commit_id}"


def test_needle_hf_cli_has_the_push_command(small_folder, hub_repo_id, capsys):
    from needle_hf.cli import main

    assert main(["push", str(small_folder), hub_repo_id, "--revision", "cli-branch"]) == 0

    assert "commit" in capsys.readouterr().out
    assert "config.json" in HfApi().list_repo_files(hub_repo_id, revision="cli-branch")


def test_convert_with_push_publishes_the_converted_folder_with_its_provenance(
    tmp_path, hub_repo_id, needle_spm_model
):
    from needle_reference import make_native_params, write_native_checkpoint

    from needle_hf.cli import main

    checkpoint = tmp_path / "needle.pkl"
    write_native_checkpoint(checkpoint, make_native_params(TINY_WITH_TOKENIZER, seed=7), TINY_WITH_TOKENIZER)
    out_dir = tmp_path / "converted"

    status = main(
        ["convert", str(checkpoint), str(out_dir), "--tokenizer", str(needle_spm_model), "--push", hub_repo_id]
    )

    assert status == 0
    files = HfApi().list_repo_files(hub_repo_id)
    for name in ("config.json", WEIGHTS, "tokenizer.json", "conversion_report.json", "modeling_needle.py", "README.md"):
        assert name in files
    readme = (out_dir / "README.md").read_text(encoding="utf-8")
    assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() in readme


# --------------------------------------------------------------------------------------------------
# Errors a user meets loading from the Hub: the client's exception, named in a clear message, and
# nothing half-downloaded left in the cache.


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_unknown_repo_raises_a_repository_not_found_error(framework, tmp_path):
    repo_id = "needle-tester/no-such-model"
    with pytest.raises(OSError, match=repo_id) as raised:
        load_tensors(framework, repo_id, cache_dir=tmp_path)

    assert any(isinstance(cause, RepositoryNotFoundError) for cause in causes(raised.value))
    assert partial_downloads(tmp_path) == [] and cached_snapshot_files(tmp_path) == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_unknown_revision_raises_a_revision_not_found_error(pushed: PushedVersions, framework, tmp_path):
    with pytest.raises(OSError, match="no-such-branch") as raised:
        load_tensors(framework, pushed.repo_id, revision="no-such-branch", cache_dir=tmp_path)

    assert any(isinstance(cause, RevisionNotFoundError) for cause in causes(raised.value))
    assert partial_downloads(tmp_path) == [] and cached_snapshot_files(tmp_path) == []


@pytest.fixture(scope="module")
def repo_without_weights(small_folder, local_hub) -> str:
    """A repository holding a Needle folder minus model.safetensors (push_folder would refuse it)."""
    api = HfApi()
    repo_id = api.create_repo(f"{local_hub.user}/needle-no-weights-{uuid.uuid4().hex[:8]}").repo_id
    api.upload_folder(repo_id=repo_id, folder_path=small_folder, ignore_patterns=[WEIGHTS])
    return repo_id


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_missing_weights_file_raises_an_error_naming_the_file(repo_without_weights, framework, tmp_path):
    # transformers turns the client's EntryNotFoundError into an OSError naming the file it looked for.
    with pytest.raises(OSError, match=f"{repo_without_weights} does not appear to have a file named .*{WEIGHTS}"):
        load_tensors(framework, repo_without_weights, cache_dir=tmp_path)

    assert partial_downloads(tmp_path) == []
    assert WEIGHTS not in cached_snapshot_files(tmp_path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_stopped_hub_raises_a_connection_error_and_leaves_no_partial_file(outage_loads, framework):
    endpoint, children = outage_loads
    if framework not in children:
        skip_without_flax_model()
    process, result, cache_dir = children[framework]

    chain = finish_python(process, result_file=result, timeout=240, what=f"the {framework} outage child")

    [top_name, top_message] = chain[0]
    assert top_name == "builtins.OSError"
    assert f"couldn't connect to '{endpoint}'" in top_message
    assert any(name.endswith(("ConnectionError", "ConnectError")) for name, _ in chain), chain
    assert partial_downloads(cache_dir) == []
    assert cached_snapshot_files(cache_dir) == []
