"""Hub failures during `push`: one `HubPushError` line naming the endpoint, the repository and what to
do; the folder is left as it was, and the repository gets every file or none (one commit)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from hub_support import TINY_WITH_TOKENIZER, write_needle_folder
from needle_hf.cli import error_line
from needle_hf.hub import HubPushError, push_folder


@pytest.fixture(scope="module")
def folder_without_readme(tmp_path_factory, needle_spm_model) -> Path:
    folder = tmp_path_factory.mktemp("small") / "needle-small"
    write_needle_folder(folder, TINY_WITH_TOKENIZER, seed=5, spm_model=needle_spm_model)
    (folder / "README.md").unlink(missing_ok=True)
    return folder


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _closed_port_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _push_fails(folder, repo_id, message, **kwargs) -> str:
    before = _listing(folder)
    with pytest.raises(HubPushError, match=message) as info:
        push_folder(folder, repo_id, **kwargs)
    line = error_line("push", info.value)
    assert "\n" not in line and repo_id in line and "Traceback" not in line
    assert _listing(folder) == before  # no README left behind by the failed push
    return line


def test_hub_down_is_one_line_naming_the_endpoint(folder_without_readme, hub_repo_id, tmp_path):
    folder = Path(shutil.copytree(folder_without_readme, tmp_path / "folder"))
    endpoint = _closed_port_endpoint()
    line = _push_fails(folder, hub_repo_id, "cannot reach the Hub", endpoint=endpoint)
    assert endpoint in line and "MaxRetryError" not in line and "Request ID" not in line


def test_rejected_credentials_say_how_to_log_in(folder_without_readme, hub_repo_id, tmp_path, local_hub):
    folder = Path(shutil.copytree(folder_without_readme, tmp_path / "folder"))
    line = _push_fails(folder, hub_repo_id, r"refused the credentials \(HTTP 40[13]\)", token="hf_not_a_valid_token")
    assert local_hub.endpoint in line and "hf auth login" in line


def test_invalid_repository_name_is_named(folder_without_readme, tmp_path, local_hub):
    folder = Path(shutil.copytree(folder_without_readme, tmp_path / "folder"))
    _push_fails(folder, "user/bad name!", "invalid repository or branch name")


def test_a_failed_upload_commits_nothing(folder_without_readme, hub_repo_id, tmp_path, monkeypatch):
    """The upload fails after the repository exists: it keeps its initial commit only."""
    folder = Path(shutil.copytree(folder_without_readme, tmp_path / "folder"))
    import huggingface_hub.hf_api as hf_api
    from huggingface_hub.errors import HfHubHTTPError

    def failing_preupload(*args, **kwargs):
        raise HfHubHTTPError("500 Server Error: upload rejected")

    monkeypatch.setattr(hf_api, "_fetch_upload_modes", failing_preupload)
    _push_fails(folder, hub_repo_id, "rejected the upload")
    files = HfApi().list_repo_files(hub_repo_id)
    assert files == [".gitattributes"]
