"""The local Hub (tests/hub_server.py) driven by the real huggingface_hub client.

Everything here goes through huggingface_hub's public API with its defaults, i.e. through the environment
that hub_fixtures set up (HF_ENDPOINT, HF_TOKEN, HF_HOME), except where a test needs its own cache folder
or its own hub. Expected values are computed independently of the server: sha256 and git blob ids with
hashlib, LFS pointers from the Git LFS spec, git facts with the git command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import (
    CommitOperationDelete,
    HfApi,
    constants,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.utils import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.numpy import save_file

from hub_server import LocalHub

# float32 elements of the test checkpoint: 2.7M * 4 bytes = 10.8 MB, above the Hub's 10 MB LFS threshold.
LARGE_CHECKPOINT_ELEMENTS = 2_700_000


def _connection_error_types() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when nothing listens, for whichever HTTP library this version uses:
    requests before 1.0, httpx in 1.x, httpx2 from 2.0."""
    types = []
    for module_name, class_name in (
        ("requests.exceptions", "ConnectionError"),
        ("httpx", "ConnectError"),
        ("httpx2", "ConnectError"),
    ):
        try:
            types.append(getattr(importlib.import_module(module_name), class_name))
        except ImportError:
            pass
    return tuple(types)


def git_blob_id(content: bytes) -> str:
    """Git's object id for a blob, computed as git defines it."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def lfs_pointer_text(content: bytes) -> bytes:
    """The pointer file the Git LFS spec (v1) prescribes for `content`."""
    return (
        "version https://git-lfs.github.com/spec/v1\n"
        f"oid sha256:{hashlib.sha256(content).hexdigest()}\n"
        f"size {len(content)}\n"
    ).encode()


def git(hub: LocalHub, repo_id: str, *args: str) -> bytes:
    """Run git on the bare repository that backs `repo_id`."""
    return subprocess.run(["git", f"--git-dir={hub.git_dir(repo_id)}", *args], check=True, capture_output=True).stdout


def read_folder(folder: Path) -> dict[str, bytes]:
    """{relative posix path: bytes} for every file under `folder`, ignoring huggingface_hub's local metadata."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in folder.rglob("*")
        if path.is_file() and ".cache" not in path.relative_to(folder).parts
    }


def write_folder(folder: Path, files: dict[str, bytes]) -> Path:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return folder


def assert_cache_holds_only_complete_files(cache_dir: Path) -> None:
    """No `*.incomplete` download left behind, and every cached blob matches the ETag it is named after."""
    leftovers = sorted(str(path.relative_to(cache_dir)) for path in cache_dir.rglob("*.incomplete"))
    assert leftovers == [], f"partial downloads left in the HF cache: {leftovers}"
    for blob in cache_dir.rglob("blobs/*"):
        content = blob.read_bytes()
        actual = hashlib.sha256(content).hexdigest() if len(blob.name) == 64 else git_blob_id(content)
        assert actual == blob.name, f"cached blob {blob} does not match its ETag ({len(content)} bytes)"


def checkpoint_bytes(seed: int, folder: Path) -> bytes:
    """A real safetensors file above the LFS threshold, different for each seed."""
    weights = np.random.default_rng(seed).standard_normal(LARGE_CHECKPOINT_ELEMENTS, dtype=np.float32)
    path = folder / f"checkpoint-{seed}.safetensors"
    save_file({"model.embed_tokens.weight": weights.reshape(-1, 100)}, str(path))
    return path.read_bytes()


README = b"---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# Needle test model\n"


@dataclasses.dataclass(frozen=True)
class PushedHistory:
    """A repository on the local hub holding two pushes of a model folder."""

    repo_id: str
    first_files: dict[str, bytes]
    second_files: dict[str, bytes]
    first_commit: str
    second_commit: str


@pytest.fixture(scope="module")
def history(local_hub: LocalHub, tmp_path_factory: pytest.TempPathFactory) -> PushedHistory:
    """A repository with two pushed versions of a model folder (LFS checkpoint, json files, a nested file).

    The second push changes the checkpoint and config.json and leaves the other files alone.
    """
    scratch = tmp_path_factory.mktemp("history")
    version_1 = {
        "model.safetensors": checkpoint_bytes(1, scratch),
        "config.json": json.dumps({"model_type": "needle2", "hidden_size": 64}).encode(),
        "tokenizer_config.json": json.dumps({"model_max_length": 1024}).encode(),
        "templates/chat.jinja": b"{% for message in messages %}{{ message.content }}{% endfor %}",
        "README.md": README,
    }
    version_2 = {
        **version_1,
        "model.safetensors": checkpoint_bytes(2, scratch),
        "config.json": json.dumps({"model_type": "needle2", "hidden_size": 128}).encode(),
    }
    api = HfApi()
    repo_id = api.create_repo(f"{local_hub.user}/history-{uuid.uuid4().hex[:8]}").repo_id
    first = api.upload_folder(
        repo_id=repo_id, folder_path=write_folder(scratch / "v1", version_1), commit_message="Add model v1"
    )
    second = api.upload_folder(
        repo_id=repo_id, folder_path=write_folder(scratch / "v2", version_2), commit_message="Update model to v2"
    )
    return PushedHistory(repo_id, version_1, version_2, first.oid, second.oid)


def test_client_defaults_point_at_the_local_hub(local_hub: LocalHub, hub_repo_id: str):
    assert constants.ENDPOINT == local_hub.endpoint
    assert constants.HF_HUB_DISABLE_XET
    assert HfApi().whoami()["name"] == local_hub.user

    # No endpoint, token or cache_dir given: the download lands in the session's private HF_HOME.
    HfApi().create_repo(hub_repo_id)
    downloaded = Path(hf_hub_download(hub_repo_id, ".gitattributes"))
    assert downloaded.is_relative_to(os.environ["HF_HOME"])


def test_new_repo_has_the_hub_initial_commit_and_conflicts_unless_exist_ok(local_hub: LocalHub, hub_repo_id: str):
    api = HfApi()
    url = api.create_repo(hub_repo_id)
    assert (url.repo_id, url.endpoint) == (hub_repo_id, local_hub.endpoint)

    with pytest.raises(HfHubHTTPError) as conflict:
        api.create_repo(hub_repo_id)
    assert conflict.value.response.status_code == 409
    assert api.create_repo(hub_repo_id, exist_ok=True) == url

    assert api.list_repo_files(hub_repo_id) == [".gitattributes"]
    [initial] = api.list_repo_commits(hub_repo_id)
    assert initial.title == "initial commit"
    assert git(local_hub, hub_repo_id, "rev-parse", "refs/heads/main").decode().strip() == initial.commit_id


def test_snapshot_download_returns_the_pushed_files_byte_for_byte(history: PushedHistory, tmp_path: Path):
    snapshot = Path(snapshot_download(history.repo_id, cache_dir=tmp_path))

    downloaded = read_folder(snapshot)
    assert downloaded.pop(".gitattributes").count(b"*.safetensors filter=lfs") == 1
    assert downloaded == history.second_files
    assert snapshot.name == history.second_commit
    siblings = HfApi().model_info(history.repo_id).siblings
    assert sorted(sibling.rfilename for sibling in siblings) == sorted([".gitattributes", *history.second_files])
    assert_cache_holds_only_complete_files(tmp_path)


def test_revision_set_to_the_first_commit_returns_the_old_bytes(history: PushedHistory, tmp_path: Path):
    repo_id, first = history.repo_id, history.first_commit
    assert history.first_files["model.safetensors"] != history.second_files["model.safetensors"]

    for name in ("model.safetensors", "config.json"):
        old = hf_hub_download(repo_id, name, revision=first, cache_dir=tmp_path)
        new = hf_hub_download(repo_id, name, cache_dir=tmp_path)
        assert Path(old).read_bytes() == history.first_files[name]
        assert Path(new).read_bytes() == history.second_files[name]

    old_snapshot = read_folder(Path(snapshot_download(repo_id, revision=first, cache_dir=tmp_path)))
    old_snapshot.pop(".gitattributes")
    assert old_snapshot == history.first_files
    assert HfApi().model_info(repo_id, revision=first).sha == first
    assert HfApi().model_info(repo_id).sha == history.second_commit


def test_commits_are_real_git_commits_on_main(history: PushedHistory, local_hub: LocalHub):
    repo_id, first, second = history.repo_id, history.first_commit, history.second_commit

    commits = HfApi().list_repo_commits(repo_id)

    assert [commit.commit_id for commit in commits[:2]] == [second, first]
    assert [commit.title for commit in commits] == ["Update model to v2", "Add model v1", "initial commit"]
    assert commits[0].authors == [local_hub.user]
    for commit in commits:
        assert git(local_hub, repo_id, "cat-file", "-t", commit.commit_id) == b"commit\n"
    assert git(local_hub, repo_id, "rev-parse", "main", f"{second}^").decode().split() == [second, first]


def test_large_and_weight_files_are_committed_as_lfs_pointers(history: PushedHistory, local_hub: LocalHub):
    repo_id, v2 = history.repo_id, history.second_files

    assert git(local_hub, repo_id, "show", "main:model.safetensors") == lfs_pointer_text(v2["model.safetensors"])
    assert git(local_hub, repo_id, "show", "main:config.json") == v2["config.json"]

    files = {entry.path: entry for entry in HfApi().list_repo_tree(repo_id, recursive=True)}
    checkpoint, config = files["model.safetensors"], files["config.json"]
    assert checkpoint.lfs.sha256 == hashlib.sha256(v2["model.safetensors"]).hexdigest()
    assert checkpoint.size == checkpoint.lfs.size == len(v2["model.safetensors"])
    assert checkpoint.blob_id == git_blob_id(lfs_pointer_text(v2["model.safetensors"]))
    assert config.lfs is None and config.blob_id == git_blob_id(v2["config.json"])
    assert "templates" in files and "templates/chat.jinja" in files  # folders are listed when recursive

    [folder] = HfApi().get_paths_info(repo_id, ["templates", "not-there.txt"])
    assert folder.path == "templates"


def test_resolve_headers_identify_the_content_like_the_hub(history: PushedHistory, local_hub: LocalHub):
    repo_id, v2 = history.repo_id, history.second_files

    checkpoint = get_hf_file_metadata(hf_hub_url(repo_id, "model.safetensors"))
    config = get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=history.first_commit))

    assert checkpoint.commit_hash == history.second_commit
    assert checkpoint.etag == hashlib.sha256(v2["model.safetensors"]).hexdigest()
    assert checkpoint.size == len(v2["model.safetensors"])
    assert config.commit_hash == history.first_commit
    assert config.etag == git_blob_id(history.first_files["config.json"])
    assert config.size == len(history.first_files["config.json"])

    # A resumed download asks for the rest of the file with a Range header.
    ranged = urllib.request.Request(hf_hub_url(repo_id, "model.safetensors"), headers={"Range": "bytes=1000-"})
    with urllib.request.urlopen(ranged) as response:
        assert response.status == 206
        assert (
            response.headers["Content-Range"]
            == f"bytes 1000-{len(v2['model.safetensors']) - 1}/{len(v2['model.safetensors'])}"
        )
        assert response.read() == v2["model.safetensors"][1000:]


def test_repushing_unchanged_files_makes_no_new_commit(hub_repo_id: str, local_hub: LocalHub, tmp_path: Path):
    api = HfApi()
    api.create_repo(hub_repo_id)
    files = {
        "config.json": b'{"hidden_size": 64}',
        "adapter.safetensors": b"small text, LFS only because of the extension",
        "vocab.dat": bytes(range(256)),  # small, LFS because it is binary
        "README.md": README,
    }
    folder = write_folder(tmp_path / "model", files)

    first = api.upload_folder(repo_id=hub_repo_id, folder_path=folder)
    again = api.upload_folder(repo_id=hub_repo_id, folder_path=folder)

    assert again.oid == first.oid
    assert len(api.list_repo_commits(hub_repo_id)) == 2  # initial commit + first push
    for name in ("adapter.safetensors", "vocab.dat"):
        assert git(local_hub, hub_repo_id, "show", f"main:{name}") == lfs_pointer_text(files[name])
    assert git(local_hub, hub_repo_id, "show", "main:config.json") == files["config.json"]

    (folder / "config.json").write_bytes(b'{"hidden_size": 128}')
    changed = api.upload_folder(repo_id=hub_repo_id, folder_path=folder)
    assert changed.oid != first.oid
    assert git(local_hub, hub_repo_id, "diff", "--name-only", first.oid, changed.oid) == b"config.json\n"


def test_readme_metadata_is_validated_before_anything_is_uploaded(hub_repo_id: str):
    api = HfApi()
    api.create_repo(hub_repo_id)
    unterminated = b"---\nlicense: apache-2.0\n# the closing --- is missing\n"

    with pytest.raises(ValueError, match="Invalid metadata in README.md"):
        api.upload_file(path_or_fileobj=unterminated, path_in_repo="README.md", repo_id=hub_repo_id)
    assert api.list_repo_files(hub_repo_id) == [".gitattributes"]


def test_deleted_file_disappears_from_main_but_stays_in_history(hub_repo_id: str, tmp_path: Path):
    api = HfApi()
    api.create_repo(hub_repo_id)
    added = api.upload_file(path_or_fileobj=b"draft", path_in_repo="notes/draft.txt", repo_id=hub_repo_id)

    api.create_commit(hub_repo_id, operations=[CommitOperationDelete("notes/draft.txt")], commit_message="Drop draft")

    assert api.list_repo_files(hub_repo_id) == [".gitattributes"]
    old = hf_hub_download(hub_repo_id, "notes/draft.txt", revision=added.oid, cache_dir=tmp_path)
    assert Path(old).read_bytes() == b"draft"
    with pytest.raises(EntryNotFoundError):
        api.create_commit(hub_repo_id, operations=[CommitOperationDelete("notes/draft.txt")], commit_message="Again")


def test_push_to_a_branch_leaves_main_untouched(hub_repo_id: str, tmp_path: Path):
    api = HfApi()
    api.create_repo(hub_repo_id)
    api.create_branch(hub_repo_id, branch="experiment")
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id=hub_repo_id, revision="experiment")

    assert api.list_repo_files(hub_repo_id, revision="experiment") == [".gitattributes", "config.json"]
    assert api.list_repo_files(hub_repo_id) == [".gitattributes"]
    assert (
        Path(hf_hub_download(hub_repo_id, "config.json", revision="experiment", cache_dir=tmp_path)).read_bytes()
        == b"{}"
    )


def test_unknown_repo_raises_repository_not_found(tmp_path: Path):
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("needle-tester/no-such-model", "config.json", cache_dir=tmp_path)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("needle-tester/no-such-model")
    assert_cache_holds_only_complete_files(tmp_path)
    assert not list(tmp_path.rglob("blobs/*"))


@pytest.mark.parametrize("revision", ["no-such-branch", "0123456789abcdef0123456789abcdef01234567", "main~1"])
def test_unknown_revision_raises_revision_not_found(history: PushedHistory, revision: str, tmp_path: Path):
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(history.repo_id, "config.json", revision=revision, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        HfApi().model_info(history.repo_id, revision=revision)
    assert_cache_holds_only_complete_files(tmp_path)
    assert not list(tmp_path.rglob("blobs/*"))


def test_missing_file_raises_entry_not_found(history: PushedHistory, tmp_path: Path):
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(history.repo_id, "pytorch_model.bin", cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(history.repo_id, "templates", cache_dir=tmp_path)  # a folder is not a file
    assert_cache_holds_only_complete_files(tmp_path)
    assert not list(tmp_path.rglob("blobs/*"))


def test_private_repo_is_hidden_from_anonymous_callers(hub_repo_id: str, tmp_path: Path):
    api = HfApi()
    api.create_repo(hub_repo_id, private=True)
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id=hub_repo_id)

    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=False).model_info(hub_repo_id)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(hub_repo_id, "config.json", cache_dir=tmp_path / "anonymous", token=False)
    assert api.model_info(hub_repo_id).private is True
    assert Path(hf_hub_download(hub_repo_id, "config.json", cache_dir=tmp_path / "owner")).read_bytes() == b"{}"


def test_interrupted_download_resumes_and_never_leaves_a_truncated_file(
    history: PushedHistory, local_hub: LocalHub, tmp_path: Path
):
    repo_id, expected = history.repo_id, history.second_files["model.safetensors"]
    # Past huggingface_hub's 10 MiB read size, so that the client has written part of the file when the
    # connection drops.
    cut = len(expected) - 100_000
    local_hub.interrupt_downloads(repo_id, "model.safetensors", after_bytes=cut)

    # huggingface_hub < 1.0 raises and keeps `<etag>.incomplete` to resume from on the next call; 1.x resumes
    # by itself. Either way the file in the snapshot is complete or absent, never truncated.
    try:
        path = Path(hf_hub_download(repo_id, "model.safetensors", cache_dir=tmp_path))
        assert path.read_bytes() == expected
    except Exception as error:  # noqa: BLE001 - any client error is acceptable here, a truncated file is not
        assert not list(tmp_path.rglob("snapshots/*/model.safetensors")), f"snapshot entry despite {error!r}"
    for blob in tmp_path.rglob("blobs/*"):
        if not blob.name.endswith(".incomplete"):
            assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name

    path = Path(hf_hub_download(repo_id, "model.safetensors", cache_dir=tmp_path))
    assert path.read_bytes() == expected
    assert_cache_holds_only_complete_files(tmp_path)
    resumed = [
        served
        for served in local_hub.served_requests()
        if served.path == f"/{repo_id}/resolve/main/model.safetensors" and served.status == 206
    ]
    assert resumed and all(served.range.startswith("bytes=") for served in resumed)


def test_stopped_hub_surfaces_a_connection_error(tmp_path: Path):
    cache = tmp_path / "cache"
    with LocalHub(tmp_path / "hub") as hub:
        # huggingface_hub < 1.0 cannot commit to an endpoint other than HF_ENDPOINT (it parses the commit URL
        # against the global endpoint), so these repositories only hold the Hub's initial `.gitattributes`.
        api = HfApi(endpoint=hub.endpoint, token=hub.token)
        cached_repo = api.create_repo(f"{hub.user}/cached-before-outage").repo_id
        uncached_repo = api.create_repo(f"{hub.user}/never-downloaded").repo_id
        cached_snapshot = snapshot_download(cached_repo, endpoint=hub.endpoint, cache_dir=cache)

    # Not hf_hub_download: before 1.0 it retries an unreachable HEAD for ~23 s before giving up.
    with pytest.raises(_connection_error_types()):
        api.model_info(cached_repo)
    with pytest.raises(LocalEntryNotFoundError) as not_cached:
        snapshot_download(uncached_repo, endpoint=hub.endpoint, cache_dir=cache)
    causes = []
    error: BaseException | None = not_cached.value
    while error is not None:
        causes.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(cause, _connection_error_types()) for cause in causes), causes
    # Like against the real Hub, what was cached before the outage is still served from the cache.
    assert snapshot_download(cached_repo, endpoint=hub.endpoint, cache_dir=cache) == cached_snapshot
    assert_cache_holds_only_complete_files(cache)


def test_lfs_commit_is_refused_until_matching_content_is_uploaded(local_hub: LocalHub, hub_repo_id: str):
    HfApi().create_repo(hub_repo_id)
    content, impostor = b"real weights" * 100, b"other weights" * 100
    oid = hashlib.sha256(content).hexdigest()
    authorization = {"Authorization": f"Bearer {local_hub.token}"}

    def post(url: str, payload: bytes, content_type: str) -> tuple[int, dict]:
        request = urllib.request.Request(url, data=payload, headers={**authorization, "Content-Type": content_type})
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    commit_url = f"{local_hub.endpoint}/api/models/{hub_repo_id}/commit/main"
    commit_payload = b"\n".join(
        json.dumps(line).encode()
        for line in (
            {"key": "header", "value": {"summary": "Add weights"}},
            {"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": oid, "size": len(content)}},
        )
    )
    status, answer = post(commit_url, commit_payload, "application/x-ndjson")
    assert status == 400 and "was not uploaded" in answer["error"]

    batch_url = f"{local_hub.endpoint}/{hub_repo_id}.git/info/lfs/objects/batch"
    batch = {"operation": "upload", "transfers": ["basic"], "objects": [{"oid": oid, "size": len(content)}]}
    status, answer = post(batch_url, json.dumps(batch).encode(), "application/vnd.git-lfs+json")
    upload_href = answer["objects"][0]["actions"]["upload"]["href"]
    for body, expected_status in ((impostor[: len(content)], 400), (content, 200)):
        try:
            with urllib.request.urlopen(urllib.request.Request(upload_href, data=body, method="PUT")) as response:
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
        assert status == expected_status

    status, answer = post(commit_url, commit_payload, "application/x-ndjson")
    assert status == 200
    assert HfApi().list_repo_files(hub_repo_id) == [".gitattributes", "w.bin"]
