"""`needle-hf push`: publish a saved Needle folder to the Hugging Face Hub.

    needle-hf push HF_DIR ORG/NAME [--revision BRANCH] [--private] [--commit-message TEXT] [--base-model REPO]

The folder is checked before anything is sent: config.json must be a Needle config, the weights must
hold exactly the tensors that config implies (names and shapes, read from the safetensors headers),
and every class `auto_map` names must have its code file beside it, so that a repository on the Hub
always loads with `trust_remote_code=True`. Without a README.md the model card is rendered into the
folder first (`needle_hf.hub.model_card`), so the folder you pushed and the repository stay identical.

The upload is `HfApi.create_repo(exist_ok=True)` + `HfApi.upload_folder`: the Hub (or its test
stand-in) decides per file between a regular and an LFS upload, skips files whose content it
already has, and makes no commit when nothing changed, so pushing an unchanged folder again returns
the current commit. Credentials and the endpoint come from huggingface_hub's usual settings
(`HF_TOKEN` or `hf auth login`, `HF_ENDPOINT`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from huggingface_hub import HfApi

from .. import __version__
from ..models.needle.configuration_needle import NeedleConfig
from ..conversion.cact_writer import write_atomically
from ..conversion.export import read_hf_config, safetensors_layout, weight_files
from ..models.needle.weight_names import check_hf_weights
from .model_card import folder_model_card
from ..models.needle.remote_code import AUTO_MAP, remote_code_files
from ..models.needle.tokenization_needle import read_tokenizer_file

DEFAULT_BRANCH = "main"
README_NAME = "README.md"
TOKENIZER_FILE = "tokenizer.json"
COMMIT_ID = re.compile(r"[0-9a-f]{40}")
# The Auto classes a pushed repository must map to shipped code: what `AutoConfig` and
# `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` and the pipeline need.
REQUIRED_AUTO_CLASSES = ("AutoConfig", "AutoModelForCausalLM")


class PushError(ValueError):
    """The folder is not a complete Needle folder, or the push target is invalid; nothing was uploaded."""


class HubPushError(PushError):
    """The Hub refused the push or could not be reached; the message names the endpoint, the repository
    and what to do. The push is one commit, so the repository holds all of the folder or none of it."""


def _hub_failure(error: Exception, *, endpoint: str, repo_id: str, revision: str | None) -> HubPushError:
    """One line for a failed Hub call: which endpoint, which repository, and what to do."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    target = f"{repo_id}@{revision or DEFAULT_BRANCH} on {endpoint}"
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, HFValidationError):
        advice = f"invalid repository or branch name ({' '.join(str(error).split())[:160]})"
    elif isinstance(error, RepositoryNotFoundError) and status not in (401, 403):
        advice = "the repository does not exist and could not be created; check the name and your organisation rights"
    elif isinstance(error, RevisionNotFoundError):
        advice = f"the branch {revision!r} does not exist and could not be created from {DEFAULT_BRANCH}"
    elif status in (401, 403):
        advice = (f"the Hub refused the credentials (HTTP {status}); log in with `hf auth login` or set HF_TOKEN "
                  "to a token with write access to this repository")
    elif isinstance(error, HfHubHTTPError):
        server = " ".join(str(error).split())[:160]
        advice = f"the Hub rejected the upload (HTTP {status or '?'}: {server}); nothing was committed, try again"
    else:
        advice = (f"cannot reach the Hub ({type(error).__name__}); check the network and HF_ENDPOINT, "
                  "then push again (nothing was committed)")
    return HubPushError(f"push to {target} failed: {advice}")


def check_folder(folder: str | os.PathLike) -> NeedleConfig:
    """Check that `folder` is a complete Needle folder; return its config.

    Raises:
        PushError: config.json's auto_map lacks AutoConfig or AutoModelForCausalLM, or a Needle class
            it maps lacks its code (module file or a file that imports) in the folder.
        ValueError (from the converter's readers): not a Needle config.json, no weights, or a
            tensor missing, unknown or of the wrong shape.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder} is not a folder; expected a saved Hugging Face Needle folder")
    config = read_hf_config(folder)
    check_hf_weights(safetensors_layout(weight_files(folder))[0], config, where=str(folder))
    if (folder / TOKENIZER_FILE).is_file():
        read_tokenizer_file(folder / TOKENIZER_FILE)
    auto_map = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("auto_map") or {}
    absent = [auto_class for auto_class in REQUIRED_AUTO_CLASSES if auto_class not in auto_map]
    if absent:
        raise PushError(
            f"{folder / 'config.json'} auto_map does not name {', '.join(absent)}, so users without needle_hf "
            "could not load the repository; save the folder again with needle_hf (saving writes the model code "
            "and auto_map)"
        )
    complete = remote_code_files(folder)
    incomplete = [
        f"{auto_class} -> {reference}"
        for auto_class, reference in auto_map.items()
        if auto_class in AUTO_MAP and auto_class not in complete
    ]
    if incomplete:
        raise PushError(
            f"{folder}: the code of {', '.join(incomplete)} (its module file or a file it imports) is not in the "
            "folder; save the folder again with needle_hf"
        )
    return config


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    base_model: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
) -> str:
    """Upload a saved Needle folder to the Hub repository `repo_id` and return the commit id.

    Args:
        folder: the saved folder (config.json, model.safetensors, tokenizer, model code).
        repo_id: `org/name`; the repository is created if it does not exist.
        revision: the branch to commit to (created from the default branch if missing); None means main.
        private: create the repository private. An existing repository keeps its visibility.
        commit_message: defaults to "Upload Needle 2 model (needle-hf <version>)".
        base_model: the `base_model` of the card rendered when the folder has no README.md.
        token / endpoint: override huggingface_hub's settings (`HF_TOKEN`, `HF_ENDPOINT`).

    Returns:
        The id of the commit that holds the folder: a new commit, or the current one of `revision`
        when every file was already there (the Hub makes no empty commit).
    """
    folder = Path(folder)
    if repo_id.count("/") != 1:
        raise PushError(f"repo_id must be 'org/name', got {repo_id!r}")
    if revision is not None and COMMIT_ID.fullmatch(revision):
        raise PushError(f"--revision must be a branch name, got the commit id {revision}; commits cannot be pushed to")
    check_folder(folder)

    api = HfApi(endpoint=endpoint, token=token)
    readme = folder / README_NAME
    wrote_readme = False
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision not in (None, DEFAULT_BRANCH):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        if not readme.exists():
            card = folder_model_card(folder, repo_id=repo_id, base_model=base_model)
            # Staged beside it and renamed: the folder never holds a half-written card.
            write_atomically(readme, str(card).encode("utf-8"), inputs={}, command="push")
            wrote_readme = True
        # One commit: every file or none of them lands on the Hub.
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            revision=revision,
            commit_message=commit_message or f"Upload Needle 2 model (needle-hf {__version__})",
        )
    except (OSError, ValueError) as error:  # requests' and huggingface_hub's errors derive from these
        if wrote_readme:
            readme.unlink(missing_ok=True)  # a failed push leaves the folder as it was
        if not type(error).__module__.startswith(("huggingface_hub", "requests", "urllib3")):
            raise
        raise _hub_failure(error, endpoint=api.endpoint, repo_id=repo_id, revision=revision) from None
    return commit.oid


# --------------------------------------------------------------------------------------------------
# Command line (wired into needle_hf.cli)


def add_push_arguments(parser: argparse.ArgumentParser):
    """Arguments of `needle-hf push HF_DIR ORG/NAME`."""
    parser.add_argument("hf_dir", metavar="HF_DIR", help="a saved Hugging Face Needle folder (e.g. from needle-hf convert)")
    parser.add_argument("repo_id", metavar="ORG/NAME", help="the Hub repository (created if it does not exist)")
    _add_push_options(parser, revision_flag="--revision")


def _add_push_options(parser: argparse.ArgumentParser, *, revision_flag: str):
    parser.add_argument(revision_flag, dest="push_revision", metavar="BRANCH",
                        help="commit to this branch (created from main if missing); default main")
    parser.add_argument("--private", action="store_true",
                        help="create the repository private (an existing repository keeps its visibility)")
    parser.add_argument("--commit-message", help="the commit message (default: 'Upload Needle 2 model (needle-hf X)')")
    parser.add_argument("--base-model", metavar="REPO",
                        help="`base_model` of the generated model card, e.g. Cactus-Compute/needle2 for a "
                             "conversion of the released weights (used only when HF_DIR has no README.md)")


def add_convert_push_arguments(parser: argparse.ArgumentParser):
    """`needle-hf convert ... --push ORG/NAME [--push-revision BRANCH] [--private] ...`."""
    parser.add_argument("--push", dest="push_repo_id", metavar="ORG/NAME",
                        help="after a successful conversion, push OUT_DIR to this Hub repository")
    _add_push_options(parser, revision_flag="--push-revision")


def _push_from_arguments(args: argparse.Namespace, folder, repo_id: str) -> str:
    commit = push_folder(
        folder,
        repo_id,
        revision=args.push_revision,
        private=args.private,
        commit_message=args.commit_message,
        base_model=args.base_model,
    )
    print(f"pushed {folder} to {repo_id}@{args.push_revision or DEFAULT_BRANCH}: commit {commit}", flush=True)
    return commit


def run_push(args: argparse.Namespace) -> int:
    """Run `needle-hf push`; returns the exit status."""
    _push_from_arguments(args, args.hf_dir, args.repo_id)
    return 0


def push_converted_folder(args: argparse.Namespace, out_dir) -> str | None:
    """The `convert --push` step: push `out_dir` when `--push` was given; returns the commit id."""
    if not args.push_repo_id:
        return None
    print(f"needle-hf convert: pushing {out_dir} to {args.push_repo_id}", file=sys.stderr, flush=True)
    return _push_from_arguments(args, out_dir, args.push_repo_id)


__all__ = [
    "HubPushError",
    "PushError",
    "add_convert_push_arguments",
    "add_push_arguments",
    "check_folder",
    "push_converted_folder",
    "push_folder",
    "run_push",
]
