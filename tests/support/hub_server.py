"""A local stand-in for the Hugging Face Hub, for tests.

`LocalHub` serves the part of the Hub HTTP API that `huggingface_hub` (0.34+ and 1.x, hence transformers
4.57 and 5.x) uses to create model repositories, push commits and download files. It is stdlib-only
(`http.server.ThreadingHTTPServer`) and runs in a background thread on 127.0.0.1 with an ephemeral port.

Storage is real: every repository is a bare git repository driven through the `git` command line, so
commit ids are real 40-hex git commit ids and a branch name or a full commit id resolves like on the Hub.
Large files follow the Hub's Git LFS design: git stores a pointer file (`version
https://git-lfs.github.com/spec/v1`, `oid sha256:...`, `size ...`) and the content lives in a per-repository
object store, uploaded through the LFS batch API with the `basic` transfer adapter (PUT to a signed URL, then
`verify`). `/resolve` serves the content with the headers the client checks: `X-Repo-Commit`, `ETag` (git
blob id of a regular file, sha256 of an LFS file), `X-Linked-Etag`/`X-Linked-Size` for LFS files,
`Content-Length`, `Accept-Ranges`, and on errors `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`,
`EntryNotFound`) with the matching status.

Endpoints (model repositories only; datasets and Spaces get a `RepoNotFound` that says so):
    GET    /api/whoami-v2
    POST   /api/repos/create                        409 + {"url": ...} when it exists
    DELETE /api/repos/delete
    POST   /api/validate-yaml
    GET    /api/models/{repo_id}[/revision/{rev}]     ?blobs=True adds sizes, blob ids and LFS info
    GET    /api/models/{repo_id}/tree/{rev}[/{path}]  ?recursive=True, ?expand=True (last commit)
    POST   /api/models/{repo_id}/paths-info/{rev}     form or JSON body: paths, expand
    GET    /api/models/{repo_id}/commits/{rev}
    GET    /api/models/{repo_id}/refs
    POST   /api/models/{repo_id}/branch/{branch}      JSON body: startingPoint
    POST   /api/models/{repo_id}/preupload/{rev}
    POST   /api/models/{repo_id}/commit/{rev}         NDJSON: header, file, lfsFile, deletedFile, deletedFolder
    POST   /{repo_id}.git/info/lfs/objects/batch
    POST   /{repo_id}.git/info/lfs/objects/verify
    PUT    /lfs-upload/{repo_id}/{oid}                the signed upload URL handed out by the batch API
    HEAD   /{repo_id}/resolve/{rev}/{path}
    GET    /{repo_id}/resolve/{rev}/{path}            honours a single `Range: bytes=...`

How it decides like the Hub: a new repository gets an "initial commit" holding a `.gitattributes` with the
usual LFS patterns; `preupload` answers "lfs" for a path those patterns match, for a file of 10 MB or more,
and for a sample that contains a NUL byte (binary), "regular" otherwise, and reports the current oid of the
path (git blob id, or sha256 for an LFS file) so that the client skips unchanged files, which is how the Hub
avoids empty commits. Writes need the hub's token (`Authorization: Bearer ...`); public repositories can be
read anonymously, private ones answer 401 `RepoNotFound` to anonymous callers.

Not modelled: datasets/Spaces, pagination (every listing fits one page), Xet storage (never offered: the
batch API always picks `basic`), multipart LFS uploads, gitignore handling in `preupload` (`shouldIgnore`
is always false), README metadata parsing (`validate-yaml` only rejects an unterminated front matter),
tags creation, discussions. Repository ids must be namespaced (`user/name`).

Hooks for tests: `LocalHub.git_dir(repo_id)` (inspect what git really stores), `served_requests()` (what the
client asked for, with status and Range), `interrupt_downloads(...)` (drop a download mid-body, as a broken
connection would).

Run it by hand with `python tests/hub_server.py --root /tmp/hub`; tests use the fixtures in
`tests/hub_fixtures.py`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qs, quote, unquote, urlsplit

logger = logging.getLogger(__name__)

DEFAULT_USER = "needle-tester"
DEFAULT_TOKEN = "hf_needle_local_hub_token"

LFS_POINTER_VERSION = "https://git-lfs.github.com/spec/v1"
# The Git LFS spec caps pointer files below 1024 bytes; only blobs that small are inspected as pointers.
LFS_POINTER_MAX_SIZE = 1024
# Files of this size or more go through LFS (the Hub's threshold is 10 MB)...
LFS_SIZE_THRESHOLD = 10_000_000
# ...and the Hub rejects regular (non-LFS) files above 10 MiB in a commit.
REGULAR_FILE_LIMIT = 10 * 1024 * 1024
DEFAULT_BRANCH = "main"

# The .gitattributes of a new repository, in the spirit of the Hub's default one.
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z",
        "*.arrow",
        "*.bin",
        "*.bz2",
        "*.ckpt",
        "*.ftz",
        "*.gguf",
        "*.gz",
        "*.h5",
        "*.joblib",
        "*.lfs.*",
        "*.mlmodel",
        "*.model",
        "*.msgpack",
        "*.npy",
        "*.npz",
        "*.onnx",
        "*.ot",
        "*.parquet",
        "*.pb",
        "*.pickle",
        "*.pkl",
        "*.pt",
        "*.pth",
        "*.rar",
        "*.safetensors",
        "saved_model/**/*",
        "*.tar.*",
        "*.tar",
        "*.tflite",
        "*.tgz",
        "*.wasm",
        "*.xz",
        "*.zip",
        "*.zst",
        "*tfevents*",
    )
)

COMMIT_ID = re.compile(r"[0-9a-f]{40}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
NULL_OID = "0" * 40


# --------------------------------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------------------------------


class HubError(Exception):
    """An error answer: HTTP `status`, a message, and the `X-Error-Code` the client maps to an exception."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = dict(headers or {})


class GitCommandError(RuntimeError):
    """A git subprocess failed; carries git's stderr."""


@dataclasses.dataclass(frozen=True)
class LfsPointer:
    """The content of a Git LFS pointer file: sha256 `oid` (hex) and `size` in bytes of the real file."""

    oid: str
    size: int

    def render(self) -> bytes:
        return f"version {LFS_POINTER_VERSION}\noid sha256:{self.oid}\nsize {self.size}\n".encode()

    @classmethod
    def parse(cls, blob: bytes) -> LfsPointer | None:
        """The pointer stored in `blob`, or None if `blob` is not an LFS pointer file."""
        if len(blob) >= LFS_POINTER_MAX_SIZE or not blob.startswith(f"version {LFS_POINTER_VERSION}\n".encode()):
            return None
        fields = dict(line.split(" ", 1) for line in blob.decode("ascii", "replace").splitlines() if " " in line)
        oid = fields.get("oid", "").removeprefix("sha256:")
        size = fields.get("size", "")
        if not SHA256_HEX.fullmatch(oid) or not size.isdigit():
            return None
        return cls(oid=oid, size=int(size))


@dataclasses.dataclass(frozen=True)
class TreeEntry:
    """A path in a commit. `size` is the git blob size (the pointer's size for an LFS file)."""

    path: str
    kind: str  # "file" or "directory"
    oid: str  # git object id of the blob or tree
    size: int
    lfs: LfsPointer | None = None

    @property
    def content_size(self) -> int:
        """Size of what `/resolve` serves: the LFS object for an LFS file, the blob otherwise."""
        return self.lfs.size if self.lfs is not None else self.size

    @property
    def etag(self) -> str:
        """The Hub's ETag: sha256 for an LFS file, git blob id otherwise."""
        return self.lfs.oid if self.lfs is not None else self.oid


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    commit_id: str
    author: str
    timestamp: int  # seconds since the epoch, UTC
    summary: str
    description: str


@dataclasses.dataclass(frozen=True)
class FileAddition:
    path: str
    content: bytes  # what git stores: the file itself, or an LFS pointer file


@dataclasses.dataclass(frozen=True)
class Deletion:
    path: str
    is_folder: bool


def _hub_datetime(timestamp: float) -> str:
    """The Hub's date format, `2024-05-01T12:00:00.000Z` (UTC)."""
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _normalise_repo_path(path: str) -> str:
    """A path inside a repository, checked: relative, no `.`/`..`/empty parts, no `.git`, no control chars."""
    cleaned = path.strip("/")
    parts = cleaned.split("/")
    if not cleaned or any(part in ("", ".", "..", ".git") for part in parts):
        raise HubError(400, f"invalid path in repository: {path!r}")
    if any(ord(character) < 32 for character in cleaned):
        raise HubError(400, f"invalid path in repository (control character): {path!r}")
    return cleaned


def _matches_gitattributes_pattern(pattern: str, path: str) -> bool:
    """gitattributes matching, simplified: a pattern without `/` matches the file name at any depth."""
    if "/" not in pattern:
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    return fnmatch.fnmatchcase(path, pattern.lstrip("/"))


def choose_upload_mode(lfs_path_patterns: Sequence[str], path: str, *, size: int, sample: bytes) -> str:
    """The Hub's choice for a file about to be committed: "lfs" if large, binary or matched by .gitattributes."""
    if size >= LFS_SIZE_THRESHOLD or b"\0" in sample:
        return "lfs"
    if any(_matches_gitattributes_pattern(pattern, path) for pattern in lfs_path_patterns):
        return "lfs"
    return "regular"


def lfs_patterns(gitattributes: str) -> list[str]:
    """Patterns marked `filter=lfs` in a .gitattributes file."""
    patterns = []
    for line in gitattributes.splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#") and "filter=lfs" in fields[1:]:
            patterns.append(fields[0])
    return patterns


# --------------------------------------------------------------------------------------------------
# Git storage
# --------------------------------------------------------------------------------------------------


def _git_environment() -> dict[str, str]:
    """Environment for git subprocesses: no user/system config, literal pathspecs, no prompts."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    environment.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_LITERAL_PATHSPECS="1",
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
    )
    return environment


class GitRepository:
    """One Hub repository: a bare git repository plus its LFS object store, driven through `git`."""

    def __init__(self, git_dir: Path, lfs_dir: Path):
        self.git_dir = git_dir
        self.lfs_dir = lfs_dir
        self._write_lock = threading.Lock()  # serialises commits and ref updates
        self._environment = _git_environment()

    @classmethod
    def initialise(cls, git_dir: Path, lfs_dir: Path, *, author: str) -> GitRepository:
        """Create the bare repository with the Hub's initial commit (a default `.gitattributes`)."""
        git_dir.parent.mkdir(parents=True, exist_ok=True)
        lfs_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "init", "--bare", "--quiet", f"--initial-branch={DEFAULT_BRANCH}", str(git_dir)],
            check=True,
            capture_output=True,
            env=_git_environment(),
        )
        repository = cls(git_dir, lfs_dir)
        blob = repository.git("hash-object", "-w", "--stdin", stdin=DEFAULT_GITATTRIBUTES.encode()).decode().strip()
        tree = repository.git("mktree", stdin=f"100644 blob {blob}\t.gitattributes\n".encode()).decode().strip()
        commit = repository._commit_tree(tree, parent=None, message="initial commit", author=author)
        repository.git("update-ref", f"refs/heads/{DEFAULT_BRANCH}", commit, "")
        return repository

    def git(self, *args: str, stdin: bytes | None = None, environment: Mapping[str, str] | None = None) -> bytes:
        """Run `git --git-dir=<this repository> *args`; raise `GitCommandError` with git's stderr on failure."""
        result = subprocess.run(
            ["git", f"--git-dir={self.git_dir}", *args],
            input=stdin,
            capture_output=True,
            env={**self._environment, **(environment or {})},
        )
        if result.returncode != 0:
            raise GitCommandError(f"git {' '.join(args)}: {result.stderr.decode(errors='replace').strip()}")
        return result.stdout

    # --- revisions -------------------------------------------------------------------------------

    def ref_target(self, ref: str) -> str | None:
        """The commit an exact ref name (`refs/heads/main`) points to, or None. Annotated tags are peeled."""
        try:
            output = self.git("show-ref", "--verify", "--dereference", ref).decode().splitlines()
        except GitCommandError:
            return None
        return output[-1].split(" ", 1)[0] if output else None

    def resolve(self, revision: str) -> str:
        """Commit id for a branch, tag, full ref (`refs/pr/1`) or full commit id, like the Hub.

        Git revision syntax (`main~1`, abbreviated ids) is deliberately not accepted.
        Raises `HubError` 404 `RevisionNotFound`.
        """
        if COMMIT_ID.fullmatch(revision):
            try:
                if self.git("cat-file", "-t", revision).strip() == b"commit":
                    return revision
            except GitCommandError:
                pass
        elif revision and not revision.startswith("-") and "\n" not in revision:
            candidates = [revision] if revision.startswith("refs/") else []
            candidates += [f"refs/heads/{revision}", f"refs/tags/{revision}"]
            for ref in candidates:
                target = self.ref_target(ref)
                if target is not None:
                    return target
        raise HubError(404, f"Invalid rev id: {revision}", error_code="RevisionNotFound")

    def refs(self) -> list[tuple[str, str]]:
        """(ref name, commit id) for every ref, annotated tags peeled."""
        output = self.git("for-each-ref", "--format=%(refname)%00%(objectname)%00%(*objectname)").decode()
        refs = []
        for line in output.splitlines():
            name, target, peeled = line.split("\0")
            refs.append((name, peeled or target))
        return refs

    def create_branch(self, branch: str, start_commit: str) -> None:
        """Create `refs/heads/<branch>` at `start_commit`. 409 if it exists, 400 if the name is invalid."""
        ref = f"refs/heads/{branch}"
        if subprocess.run(["git", "check-ref-format", ref], capture_output=True, env=self._environment).returncode:
            raise HubError(400, f"invalid branch name: {branch!r}")
        with self._write_lock:
            if self.ref_target(ref) is not None:
                raise HubError(409, f"Reference already exists: {ref}")
            self.git("update-ref", ref, start_commit, "")

    # --- reading trees and blobs -----------------------------------------------------------------

    def read_blob(self, oid: str) -> bytes:
        return self.git("cat-file", "blob", oid)

    def _read_small_blobs(self, oids: Sequence[str]) -> dict[str, bytes]:
        """Contents of several blobs in one `git cat-file --batch` call."""
        if not oids:
            return {}
        output = self.git("cat-file", "--batch", stdin="".join(f"{oid}\n" for oid in oids).encode())
        contents: dict[str, bytes] = {}
        position = 0
        while position < len(output):
            header_end = output.index(b"\n", position)
            oid, _kind, size = output[position:header_end].decode().split(" ")
            start = header_end + 1
            contents[oid] = output[start : start + int(size)]
            position = start + int(size) + 1  # the content is followed by a newline
        return contents

    def _with_lfs_pointers(self, entries: list[TreeEntry]) -> list[TreeEntry]:
        """Attach the LFS pointer to every file entry whose blob is a pointer file."""
        candidates = sorted({e.oid for e in entries if e.kind == "file" and e.size < LFS_POINTER_MAX_SIZE})
        contents = self._read_small_blobs(candidates)
        return [
            dataclasses.replace(entry, lfs=LfsPointer.parse(contents[entry.oid])) if entry.oid in contents else entry
            for entry in entries
        ]

    def describe_paths(self, commit: str, paths: Sequence[str]) -> dict[str, TreeEntry]:
        """The entries for those of `paths` that exist in `commit` (files and folders), by path."""
        if not paths:
            return {}
        request = "".join(f"{commit}:{path}\n" for path in paths).encode()
        output = self.git("cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize)", stdin=request)
        entries = []
        for path, line in zip(paths, output.decode().splitlines(), strict=True):
            # "<oid> <type> <size>" for an object; "<commit>:<path> missing" (never 40 hex first) otherwise.
            fields = line.split(" ")
            if len(fields) == 3 and COMMIT_ID.fullmatch(fields[0]) and fields[1] in ("blob", "tree"):
                kind = "file" if fields[1] == "blob" else "directory"
                entries.append(
                    TreeEntry(path=path, kind=kind, oid=fields[0], size=int(fields[2]) if kind == "file" else 0)
                )
        return {entry.path: entry for entry in self._with_lfs_pointers(entries)}

    def entry(self, commit: str, path: str) -> TreeEntry | None:
        return self.describe_paths(commit, [path]).get(path)

    def list_tree(self, commit: str, folder: str = "", *, recursive: bool) -> list[TreeEntry]:
        """Entries under `folder` ("" for the root), folders included; all depths if `recursive`."""
        if folder:
            folder_entry = self.entry(commit, folder)
            if folder_entry is None or folder_entry.kind != "directory":
                raise HubError(404, f"{folder!r} is not a folder at {commit}", error_code="EntryNotFound")
        tree_ish = f"{commit}:{folder}" if folder else commit
        output = self.git("ls-tree", "-l", "-z", *(["-r", "-t"] if recursive else []), tree_ish).decode()
        prefix = f"{folder}/" if folder else ""
        entries = []
        for record in filter(None, output.split("\0")):
            meta, name = record.split("\t", 1)
            _mode, kind, oid, size = meta.split()
            if kind not in ("blob", "tree"):
                continue  # submodules cannot occur in Hub repositories
            is_file = kind == "blob"
            entries.append(
                TreeEntry(
                    path=prefix + name,
                    kind="file" if is_file else "directory",
                    oid=oid,
                    size=int(size) if is_file else 0,
                )
            )
        return self._with_lfs_pointers(entries)

    def log(self, commit: str, path: str | None = None, *, limit: int | None = None) -> list[CommitRecord]:
        """History reachable from `commit`, newest first; only commits touching `path` if given."""
        args = ["log", "-z", "--format=%H%n%an%n%ct%n%B"]
        if limit is not None:
            args.append(f"--max-count={limit}")
        args.append(commit)
        if path is not None:
            args += ["--", path]
        records = []
        for chunk in filter(None, self.git(*args).decode().split("\0")):
            commit_id, author, timestamp, message = chunk.split("\n", 3)
            summary, _, description = message.strip().partition("\n")
            records.append(CommitRecord(commit_id, author, int(timestamp), summary, description.strip()))
        return records

    # --- writing ---------------------------------------------------------------------------------

    def _commit_tree(self, tree: str, *, parent: str | None, message: str, author: str) -> str:
        identity = {
            "GIT_AUTHOR_NAME": author,
            "GIT_AUTHOR_EMAIL": f"{author}@users.noreply.localhost",
            "GIT_COMMITTER_NAME": author,
            "GIT_COMMITTER_EMAIL": f"{author}@users.noreply.localhost",
        }
        parents = ["-p", parent] if parent else []
        return (
            self.git("commit-tree", tree, *parents, "-F", "-", stdin=message.encode(), environment=identity)
            .decode()
            .strip()
        )

    def commit(
        self,
        *,
        ref: str,
        base: str,
        operations: Sequence[FileAddition | Deletion],
        message: str,
        author: str,
        create_ref: bool = False,
    ) -> str:
        """Apply `operations` on top of commit `base` and point `ref` at the new commit; return its id.

        `ref` must still point at `base` (or not exist, with `create_ref`), otherwise 412: the branch moved.
        Deleting a path that does not exist is 404 `EntryNotFound`, as on the Hub. Empty commits are allowed
        (the Hub allows them; the client avoids them).
        """
        with self._write_lock, tempfile.TemporaryDirectory(prefix="hub-index-") as scratch:
            current = self.ref_target(ref)
            if current != (None if create_ref else base):
                raise HubError(412, f"{ref} moved to {current} while committing on top of {base}")
            index = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
            self.git("read-tree", base, environment=index)
            existing = set(filter(None, self.git("ls-files", "-z", environment=index).decode().split("\0")))
            index_info = []
            for operation in operations:
                if isinstance(operation, FileAddition):
                    blob = self.git("hash-object", "-w", "--stdin", stdin=operation.content).decode().strip()
                    index_info.append(f"100644 {blob}\t{operation.path}\0")
                    existing.add(operation.path)
                    continue
                if operation.is_folder:
                    folder = operation.path.rstrip("/") + "/"
                    removed = sorted(path for path in existing if path.startswith(folder))
                else:
                    removed = [operation.path] if operation.path in existing else []
                if not removed:
                    kind = "folder" if operation.is_folder else "file"
                    raise HubError(
                        404, f"A {kind} with this name doesn't exist: {operation.path}", error_code="EntryNotFound"
                    )
                index_info += [f"0 {NULL_OID}\t{path}\0" for path in removed]
                existing.difference_update(removed)
            if index_info:
                self.git("update-index", "-z", "--index-info", stdin="".join(index_info).encode(), environment=index)
            tree = self.git("write-tree", environment=index).decode().strip()
            commit = self._commit_tree(tree, parent=base, message=message, author=author)
            self.git("update-ref", ref, commit, "" if create_ref else base)
            return commit

    # --- LFS object store ------------------------------------------------------------------------

    def lfs_object_path(self, oid: str) -> Path:
        return self.lfs_dir / oid[:2] / oid[2:4] / oid

    def has_lfs_object(self, oid: str, size: int) -> bool:
        path = self.lfs_object_path(oid)
        return path.is_file() and path.stat().st_size == size

    def store_lfs_object(self, oid: str, size: int, chunks: Iterator[bytes]) -> None:
        """Write an uploaded object; 400 if its sha256 or size differ from what the batch request announced."""
        destination = self.lfs_object_path(oid)
        destination.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        received = 0
        with tempfile.NamedTemporaryFile(
            dir=destination.parent, prefix=f"{oid}.", suffix=".part", delete=False
        ) as part:
            try:
                for chunk in chunks:
                    digest.update(chunk)
                    received += len(chunk)
                    part.write(chunk)
                part.close()
                if received != size or digest.hexdigest() != oid:
                    raise HubError(
                        400,
                        f"uploaded object does not match its batch request: expected sha256 {oid} and {size} bytes, "
                        f"got sha256 {digest.hexdigest()} and {received} bytes",
                    )
                os.replace(part.name, destination)
            finally:
                Path(part.name).unlink(missing_ok=True)


@dataclasses.dataclass
class RepositoryRecord:
    repo_id: str
    private: bool
    created_at: float
    git: GitRepository


class RepositoryStore:
    """All repositories of a hub, under `root`: `repos/<ns>/<name>.git` and `lfs/<ns>/<name>/`."""

    def __init__(self, root: Path):
        self.root = root
        self._records: dict[str, RepositoryRecord] = {}
        self._lock = threading.Lock()

    def git_dir(self, repo_id: str) -> Path:
        return self.root / "repos" / f"{repo_id}.git"

    def create(self, repo_id: str, *, private: bool, author: str) -> bool:
        """Create `repo_id`; False if it already exists."""
        with self._lock:
            if repo_id in self._records:
                return False
            git = GitRepository.initialise(self.git_dir(repo_id), self.root / "lfs" / repo_id, author=author)
            self._records[repo_id] = RepositoryRecord(repo_id, private, datetime.datetime.now().timestamp(), git)
            return True

    def get(self, repo_id: str) -> RepositoryRecord | None:
        with self._lock:
            return self._records.get(repo_id)

    def delete(self, repo_id: str) -> bool:
        with self._lock:
            record = self._records.pop(repo_id, None)
        if record is None:
            return False
        shutil.rmtree(record.git.git_dir, ignore_errors=True)
        shutil.rmtree(record.git.lfs_dir, ignore_errors=True)
        return True


# --------------------------------------------------------------------------------------------------
# The HTTP API
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileSlice:
    """A response body streamed from a file: `length` bytes from `offset`."""

    path: Path
    offset: int
    length: int


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytes | FileSlice = b""
    # Fault injection: send only this many body bytes, then drop the connection.
    cut_after: int | None = None

    @property
    def content_length(self) -> int:
        return self.body.length if isinstance(self.body, FileSlice) else len(self.body)


def _json_reply(payload: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(payload).encode())


def _error_reply(error: HubError) -> Reply:
    headers = {"X-Error-Message": error.message.encode("ascii", "replace").decode().replace("\n", " "), **error.headers}
    if error.error_code is not None:
        headers["X-Error-Code"] = error.error_code
    return _json_reply({"error": error.message}, error.status, headers)


class RequestBody:
    """The request body, read lazily from the socket; handles `Content-Length` and chunked encoding."""

    def __init__(self, stream: BinaryIO, headers: Mapping[str, str]):
        self._stream = stream
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        self._remaining = int(headers.get("Content-Length") or 0)
        self._finished = False

    def chunks(self, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        while not self._finished:
            if self._chunked:
                size = int(self._stream.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self._stream.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    self._finished = True
                    return
                data = self._stream.read(size)
                self._stream.readline()  # CRLF after each chunk
            else:
                if self._remaining == 0:
                    self._finished = True
                    return
                data = self._stream.read(min(chunk_size, self._remaining))
                if not data:
                    raise HubError(400, "request body ended before Content-Length bytes")
                self._remaining -= len(data)
            yield data

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def json(self) -> object:
        try:
            return json.loads(self.read() or b"null")
        except ValueError as error:
            raise HubError(400, f"request body is not valid JSON: {error}") from error

    def drain(self) -> None:
        for _ in self.chunks():
            pass


@dataclasses.dataclass
class Request:
    method: str
    path: str  # raw (still percent-encoded) path
    query: dict[str, list[str]]
    headers: Mapping[str, str]
    body: RequestBody
    params: dict[str, str] = dataclasses.field(default_factory=dict)  # decoded route parameters

    def flag(self, name: str) -> bool:
        return self.query.get(name, ["false"])[-1].lower() in ("1", "true", "yes")

    @property
    def repo_id(self) -> str:
        return f"{self.params['namespace']}/{self.params['name']}"


@dataclasses.dataclass(frozen=True)
class ServedRequest:
    """One request as the hub answered it, for tests that check what the client did."""

    method: str
    path: str  # decoded URL path, without the query
    status: int
    range: str | None  # the Range header, if any


@dataclasses.dataclass
class _Interruption:
    after_bytes: int
    remaining: int


class HubApplication:
    """The Hub API as a function of requests: routing, authentication and the endpoint logic."""

    def __init__(self, store: RepositoryStore, *, endpoint: str, token: str, user: str):
        self.store = store
        self.endpoint = endpoint
        self.token = token
        self.user = user
        self._upload_secret = secrets.token_bytes(32)
        self._interruptions: dict[tuple[str, str], _Interruption] = {}
        self._interruptions_lock = threading.Lock()
        self._served: list[ServedRequest] = []
        self._served_lock = threading.Lock()
        repo = r"(?P<namespace>[^/]+)/(?P<name>[^/]+?)"
        api = rf"/api/models/{repo}"
        route_table: list[tuple[tuple[str, ...], str, Callable[[Request], Reply]]] = [
            (("GET",), r"/api/whoami-v2", self.whoami),
            (("POST",), r"/api/repos/create", self.create_repo),
            (("DELETE",), r"/api/repos/delete", self.delete_repo),
            (("POST",), r"/api/validate-yaml", self.validate_yaml),
            (("GET",), rf"{api}(?:/revision/(?P<revision>[^/]+))?", self.model_info),
            (("GET",), rf"{api}/tree/(?P<revision>[^/]+)(?:/(?P<path>.+))?", self.list_tree),
            (("POST",), rf"{api}/paths-info/(?P<revision>[^/]+)", self.paths_info),
            (("GET",), rf"{api}/commits/(?P<revision>[^/]+)", self.list_commits),
            (("GET",), rf"{api}/refs", self.list_refs),
            (("POST",), rf"{api}/branch/(?P<branch>[^/]+)", self.create_branch),
            (("POST",), rf"{api}/preupload/(?P<revision>[^/]+)", self.preupload),
            (("POST",), rf"{api}/commit/(?P<revision>[^/]+)", self.commit),
            (("POST",), rf"/{repo}\.git/info/lfs/objects/batch", self.lfs_batch),
            (("POST",), rf"/{repo}\.git/info/lfs/objects/verify", self.lfs_verify),
            (("PUT",), rf"/lfs-upload/{repo}/(?P<oid>[0-9a-f]{{64}})", self.lfs_upload),
            (("GET", "HEAD"), rf"/{repo}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", self.resolve),
            (("GET", "HEAD", "POST", "PUT", "DELETE"), r"/api/(?:datasets|spaces)(?:/.*)?", self.unsupported_repo_type),
        ]
        self._routes = [(methods, re.compile(pattern), handler) for methods, pattern, handler in route_table]

    # --- plumbing --------------------------------------------------------------------------------

    def handle(self, request: Request) -> Reply:
        reply = self._route(request)
        with self._served_lock:
            self._served.append(
                ServedRequest(request.method, unquote(request.path), reply.status, request.headers.get("Range"))
            )
        return reply

    def served_requests(self) -> list[ServedRequest]:
        with self._served_lock:
            return list(self._served)

    def _route(self, request: Request) -> Reply:
        try:
            route_found = False
            for methods, pattern, handler in self._routes:
                match = pattern.fullmatch(request.path)
                if match is None:
                    continue
                route_found = True
                if request.method in methods:
                    request.params = {
                        key: unquote(value) for key, value in match.groupdict().items() if value is not None
                    }
                    return handler(request)
            if route_found:
                raise HubError(405, f"{request.method} is not supported on {request.path}")
            raise HubError(404, f"this local hub has no endpoint for {request.method} {request.path}")
        except HubError as error:
            return _error_reply(error)
        except Exception as error:
            # A bug or a git failure: answer 500 with the cause rather than dropping the connection.
            logger.exception("local hub failed while serving %s %s", request.method, request.path)
            return _error_reply(HubError(500, f"internal error in the local hub: {type(error).__name__}: {error}"))

    def _caller(self, request: Request) -> str | None:
        """The authenticated user, or None for an anonymous request; 401 for a wrong token."""
        authorization = request.headers.get("Authorization")
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.token):
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.user

    def _require_caller(self, request: Request) -> str:
        caller = self._caller(request)
        if caller is None:
            raise HubError(401, "You must be authenticated (Authorization: Bearer <token>) to do this")
        return caller

    def _repository(self, request: Request, *, write: bool = False) -> RepositoryRecord:
        """The repository named by the route; 404/401 `RepoNotFound` if missing or not readable."""
        caller = self._require_caller(request) if write else self._caller(request)
        record = self.store.get(request.repo_id)
        if record is None or (record.private and caller is None):
            status = 401 if record is not None else 404
            raise HubError(status, f"Repository Not Found: {request.repo_id}", error_code="RepoNotFound")
        return record

    def _resolve(self, record: RepositoryRecord, request: Request) -> str:
        return record.git.resolve(request.params.get("revision", DEFAULT_BRANCH))

    def _json_object(self, request: Request) -> dict:
        payload = request.body.json()
        if not isinstance(payload, dict):
            raise HubError(400, f"expected a JSON object in the request body, got {type(payload).__name__}")
        return payload

    def _tree_entry_json(self, record: RepositoryRecord, commit: str, entry: TreeEntry, *, expand: bool) -> dict:
        item: dict = {"type": entry.kind, "oid": entry.oid, "size": entry.content_size, "path": entry.path}
        if entry.lfs is not None:
            item["lfs"] = {"oid": entry.lfs.oid, "size": entry.lfs.size, "pointerSize": entry.size}
        if expand:
            last = record.git.log(commit, entry.path, limit=1)[0]
            item["lastCommit"] = {"id": last.commit_id, "title": last.summary, "date": _hub_datetime(last.timestamp)}
        return item

    def repo_url(self, repo_id: str) -> str:
        return f"{self.endpoint}/{repo_id}"

    # --- fault injection -------------------------------------------------------------------------

    def interrupt_downloads(self, repo_id: str, path: str, *, after_bytes: int, times: int) -> None:
        with self._interruptions_lock:
            self._interruptions[(repo_id, path)] = _Interruption(after_bytes, times)

    def _take_interruption(self, repo_id: str, path: str) -> int | None:
        with self._interruptions_lock:
            interruption = self._interruptions.get((repo_id, path))
            if interruption is None or interruption.remaining <= 0:
                return None
            interruption.remaining -= 1
            return interruption.after_bytes

    # --- account and repositories ----------------------------------------------------------------

    def whoami(self, request: Request) -> Reply:
        user = self._require_caller(request)
        return _json_reply(
            {
                "type": "user",
                "id": hashlib.sha1(user.encode()).hexdigest()[:24],
                "name": user,
                "fullname": user,
                "email": f"{user}@users.noreply.localhost",
                "emailVerified": True,
                "isPro": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "local-hub", "role": "write"}},
            }
        )

    def create_repo(self, request: Request) -> Reply:
        user = self._require_caller(request)
        payload = self._json_object(request)
        if payload.get("type") not in (None, "model"):
            raise HubError(400, f"this local hub only hosts model repositories, not {payload.get('type')!r}")
        name, namespace = payload.get("name"), payload.get("organization") or user
        for part in (namespace, name):
            if not isinstance(part, str) or not REPO_NAME.fullmatch(part) or part.endswith(".git"):
                raise HubError(400, f"invalid repository name part: {part!r} (letters, digits, '.', '_', '-')")
        repo_id = f"{namespace}/{name}"
        url = self.repo_url(repo_id)
        # huggingface_hub < 1.0 sends `private`, 1.x sends `visibility`.
        private = bool(payload.get("private")) or payload.get("visibility") in ("private", "protected")
        if not self.store.create(repo_id, private=private, author=user):
            return _json_reply({"error": "You already created this model repo", "url": url}, 409)
        return _json_reply({"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self, request: Request) -> Reply:
        user = self._require_caller(request)
        payload = self._json_object(request)
        repo_id = f"{payload.get('organization') or user}/{payload.get('name')}"
        if not self.store.delete(repo_id):
            raise HubError(404, f"Repository Not Found: {repo_id}", error_code="RepoNotFound")
        return _json_reply({})

    def validate_yaml(self, request: Request) -> Reply:
        content = str(self._json_object(request).get("content", ""))
        if content.startswith("---") and "\n---" not in content[3:]:
            error = {"message": "README.md metadata block opened with '---' is never closed"}
            return _json_reply({"errors": [error], "warnings": []}, 400)
        return _json_reply({"errors": [], "warnings": []})

    def unsupported_repo_type(self, request: Request) -> Reply:
        raise HubError(404, "this local hub only hosts model repositories", error_code="RepoNotFound")

    # --- reading ---------------------------------------------------------------------------------

    def model_info(self, request: Request) -> Reply:
        record = self._repository(request)
        commit = self._resolve(record, request)
        files = [entry for entry in record.git.list_tree(commit, recursive=True) if entry.kind == "file"]
        with_blobs = request.flag("blobs")
        siblings = []
        for entry in files:
            sibling: dict = {"rfilename": entry.path}
            if with_blobs:
                sibling.update(size=entry.content_size, blobId=entry.oid)
                if entry.lfs is not None:
                    sibling["lfs"] = {"size": entry.lfs.size, "sha256": entry.lfs.oid, "pointerSize": entry.size}
            siblings.append(sibling)
        last_commit = record.git.log(commit, limit=1)[0]
        namespace = record.repo_id.split("/", 1)[0]
        return _json_reply(
            {
                "_id": hashlib.sha1(record.repo_id.encode()).hexdigest()[:24],
                "id": record.repo_id,
                "modelId": record.repo_id,
                "author": namespace,
                "sha": commit,
                "lastModified": _hub_datetime(last_commit.timestamp),
                "createdAt": _hub_datetime(record.created_at),
                "private": record.private,
                "visibility": "private" if record.private else "public",
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "spaces": [],
                "usedStorage": sum(entry.content_size for entry in files),
            }
        )

    def list_tree(self, request: Request) -> Reply:
        record = self._repository(request)
        commit = self._resolve(record, request)
        folder = _normalise_repo_path(request.params["path"]) if request.params.get("path") else ""
        entries = record.git.list_tree(commit, folder, recursive=request.flag("recursive"))
        expand = request.flag("expand")
        return _json_reply([self._tree_entry_json(record, commit, entry, expand=expand) for entry in entries])

    def paths_info(self, request: Request) -> Reply:
        record = self._repository(request)
        commit = self._resolve(record, request)
        raw = request.body.read()
        if request.headers.get("Content-Type", "").startswith("application/json"):
            try:
                payload = json.loads(raw)
            except ValueError as error:
                raise HubError(400, f"request body is not valid JSON: {error}") from error
            paths, expand = payload.get("paths", []), str(payload.get("expand", False))
        else:
            form = parse_qs(raw.decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), form.get("expand", ["False"])[-1]
        if isinstance(paths, str):
            paths = [paths]
        wanted = [_normalise_repo_path(path) for path in paths]
        entries = record.git.describe_paths(commit, wanted)
        is_expanded = expand.lower() in ("1", "true")
        return _json_reply(
            [
                self._tree_entry_json(record, commit, entries[path], expand=is_expanded)
                for path in wanted
                if path in entries
            ]
        )

    def list_commits(self, request: Request) -> Reply:
        record = self._repository(request)
        commit = self._resolve(record, request)
        return _json_reply(
            [
                {
                    "id": entry.commit_id,
                    "title": entry.summary,
                    "message": entry.description,
                    "authors": [{"user": entry.author, "avatar": ""}],
                    "date": _hub_datetime(entry.timestamp),
                }
                for entry in record.git.log(commit)
            ]
        )

    def list_refs(self, request: Request) -> Reply:
        record = self._repository(request)
        groups: dict[str, list[dict]] = {"branches": [], "converts": [], "tags": [], "pullRequests": []}
        prefixes = {
            "refs/heads/": "branches",
            "refs/convert/": "converts",
            "refs/tags/": "tags",
            "refs/pr/": "pullRequests",
        }
        for ref, target in record.git.refs():
            for prefix, group in prefixes.items():
                if ref.startswith(prefix):
                    groups[group].append({"name": ref.removeprefix(prefix), "ref": ref, "targetCommit": target})
        if not request.flag("include_prs"):
            groups["pullRequests"] = []
        return _json_reply(groups)

    def resolve(self, request: Request) -> Reply:
        record = self._repository(request)
        commit = self._resolve(record, request)
        path = _normalise_repo_path(request.params["path"])
        entry = record.git.entry(commit, path)
        if entry is None or entry.kind != "file":
            raise HubError(
                404,
                f"Entry not found: {path} at {commit}",
                error_code="EntryNotFound",
                headers={"X-Repo-Commit": commit},
            )
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{entry.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'attachment; filename="{quote(path.rsplit("/", 1)[-1])}"',
        }
        if entry.lfs is not None:
            headers.update({"X-Linked-Etag": f'"{entry.lfs.oid}"', "X-Linked-Size": str(entry.lfs.size)})
        size = entry.content_size
        start, length, status = 0, size, 200
        range_header = request.headers.get("Range")
        if range_header and request.method == "GET":
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header.strip())
            if match is None or match.groups() == ("", ""):
                raise HubError(416, f"unsupported Range {range_header!r}", headers={"Content-Range": f"bytes */{size}"})
            first, last = match.groups()
            if first:
                start, end = int(first), min(int(last), size - 1) if last else size - 1
            else:
                start, end = max(size - int(last), 0), size - 1
            if start >= size or end < start:
                raise HubError(
                    416, f"Range {range_header!r} outside {size} bytes", headers={"Content-Range": f"bytes */{size}"}
                )
            start, length, status = start, end - start + 1, 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        if request.method == "HEAD":
            return Reply(status, {**headers, "Content-Length": str(length)})
        if entry.lfs is not None:
            object_path = record.git.lfs_object_path(entry.lfs.oid)
            if not record.git.has_lfs_object(entry.lfs.oid, entry.lfs.size):
                raise HubError(500, f"LFS object {entry.lfs.oid} of {path} is missing from the object store")
            body: bytes | FileSlice = FileSlice(object_path, start, length)
        else:
            body = record.git.read_blob(entry.oid)[start : start + length]
        return Reply(status, headers, body, cut_after=self._take_interruption(record.repo_id, path))

    # --- writing ---------------------------------------------------------------------------------

    def create_branch(self, request: Request) -> Reply:
        record = self._repository(request, write=True)
        payload = self._json_object(request)
        start = record.git.resolve(str(payload.get("startingPoint") or DEFAULT_BRANCH))
        record.git.create_branch(request.params["branch"], start)
        return _json_reply({})

    def preupload(self, request: Request) -> Reply:
        record = self._repository(request, write=True)
        commit = self._resolve(record, request)
        payload = self._json_object(request)
        files = payload.get("files")
        if not isinstance(files, list):
            raise HubError(400, "expected {'files': [{'path', 'sample', 'size'}, ...]}")
        attributes = record.git.entry(commit, ".gitattributes")
        patterns = lfs_patterns(record.git.read_blob(attributes.oid).decode()) if attributes is not None else []
        paths = [_normalise_repo_path(str(item.get("path", ""))) for item in files]
        existing = record.git.describe_paths(commit, paths)
        answers = []
        for item, path in zip(files, paths, strict=True):
            try:
                sample = base64.b64decode(item.get("sample", ""), validate=True)
            except binascii.Error as error:
                raise HubError(400, f"sample of {path} is not base64: {error}") from error
            mode = choose_upload_mode(patterns, path, size=int(item.get("size", 0)), sample=sample)
            current = existing.get(path)
            oid = current.etag if current is not None and current.kind == "file" else None
            answers.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return _json_reply({"files": answers, "commitOid": commit})

    def _parse_commit_payload(self, record: RepositoryRecord, raw: bytes) -> tuple[dict, list[FileAddition | Deletion]]:
        header: dict | None = None
        operations: list[FileAddition | Deletion] = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                key, value = item["key"], item["value"]
                operation = self._parse_commit_operation(record, key, value)
            except (ValueError, KeyError, TypeError) as error:  # binascii.Error is a ValueError
                raise HubError(
                    400, f"commit payload line {number} is malformed: {type(error).__name__}: {error}"
                ) from error
            if key == "header":
                header = value
            elif operation is not None:
                operations.append(operation)
            else:
                raise HubError(400, f"commit payload line {number}: unknown operation {key!r}")
        if not isinstance(header, dict) or not str(header.get("summary", "")).strip():
            raise HubError(400, "commit payload needs a header with a non-empty summary")
        return header, operations

    def _parse_commit_operation(
        self, record: RepositoryRecord, key: str, value: dict
    ) -> FileAddition | Deletion | None:
        """One NDJSON operation; None for the header or an unknown key."""
        if key == "header":
            return None
        if key == "file":
            path = _normalise_repo_path(value["path"])
            content = value.get("content", "")
            data = base64.b64decode(content, validate=True) if value.get("encoding") == "base64" else content.encode()
            if len(data) > REGULAR_FILE_LIMIT:
                raise HubError(
                    400, f"{path} has {len(data)} bytes; regular files above {REGULAR_FILE_LIMIT} bytes must use LFS"
                )
            return FileAddition(path, data)
        if key == "lfsFile":
            path = _normalise_repo_path(value["path"])
            pointer = LfsPointer(oid=str(value["oid"]), size=int(value["size"]))
            if value.get("algo", "sha256") != "sha256" or not SHA256_HEX.fullmatch(pointer.oid):
                raise HubError(400, f"{path}: LFS files need a sha256 oid, got {value!r}")
            if not record.git.has_lfs_object(pointer.oid, pointer.size):
                raise HubError(
                    400, f"{path}: LFS object {pointer.oid} ({pointer.size} bytes) was not uploaded to this repository"
                )
            return FileAddition(path, pointer.render())
        if key in ("deletedFile", "deletedFolder"):
            return Deletion(_normalise_repo_path(value["path"]), is_folder=key == "deletedFolder")
        return None

    def commit(self, request: Request) -> Reply:
        record = self._repository(request, write=True)
        author = self._require_caller(request)
        revision = request.params["revision"]
        branch_ref = revision if revision.startswith("refs/") else f"refs/heads/{revision}"
        base = record.git.ref_target(branch_ref)
        if base is None or not branch_ref.startswith(("refs/heads/", "refs/pr/")):
            record.git.resolve(revision)  # 404 RevisionNotFound if it does not exist at all
            raise HubError(400, f"can only commit to a branch or a pull request ref, not {revision!r}")
        header, operations = self._parse_commit_payload(record, request.body.read())
        parent = header.get("parentCommit")
        if parent and parent != base:
            raise HubError(412, f"parentCommit {parent} is not the head of {revision} ({base})")
        message = str(header["summary"]).strip()
        if str(header.get("description") or "").strip():
            message += "\n\n" + str(header["description"]).strip()
        pull_request_url = None
        if request.flag("create_pr"):
            numbers = [int(ref.removeprefix("refs/pr/")) for ref, _ in record.git.refs() if ref.startswith("refs/pr/")]
            number = max(numbers, default=0) + 1
            commit = record.git.commit(
                ref=f"refs/pr/{number}",
                base=base,
                operations=operations,
                message=message,
                author=author,
                create_ref=True,
            )
            pull_request_url = f"{self.repo_url(record.repo_id)}/discussions/{number}"
        else:
            commit = record.git.commit(ref=branch_ref, base=base, operations=operations, message=message, author=author)
        return _json_reply(
            {
                "success": True,
                "commitOid": commit,
                "commitUrl": f"{self.repo_url(record.repo_id)}/commit/{commit}",
                "commitMessage": message,
                "hookOutput": "",
                "pullRequestUrl": pull_request_url,
            }
        )

    # --- Git LFS ---------------------------------------------------------------------------------

    def _upload_signature(self, repo_id: str, oid: str, size: int) -> str:
        return hmac.new(self._upload_secret, f"{repo_id}\n{oid}\n{size}".encode(), hashlib.sha256).hexdigest()

    def lfs_batch(self, request: Request) -> Reply:
        record = self._repository(request, write=True)
        payload = self._json_object(request)
        if payload.get("operation") != "upload":
            raise HubError(
                400, f"this local hub's LFS batch API only supports 'upload', got {payload.get('operation')!r}"
            )
        if "basic" not in payload.get("transfers", ["basic"]):
            raise HubError(
                400, f"only the 'basic' transfer adapter is available, client offered {payload.get('transfers')}"
            )
        answers = []
        for item in payload.get("objects", []):
            oid, size = item.get("oid"), item.get("size")
            if not isinstance(oid, str) or not SHA256_HEX.fullmatch(oid) or not isinstance(size, int) or size < 0:
                error = {"code": 422, "message": "oid must be 64 hex characters and size an integer >= 0"}
                answers.append({"oid": str(oid), "size": size if isinstance(size, int) else -1, "error": error})
                continue
            answer: dict = {"oid": oid, "size": size, "authenticated": True}
            if not record.git.has_lfs_object(oid, size):
                signature = self._upload_signature(record.repo_id, oid, size)
                answer["actions"] = {
                    "upload": {
                        "href": f"{self.endpoint}/lfs-upload/{record.repo_id}/{oid}?size={size}&signature={signature}",
                        "expires_in": 3600,
                    },
                    "verify": {
                        "href": f"{self.endpoint}/{record.repo_id}.git/info/lfs/objects/verify",
                        "header": {},
                        "expires_in": 3600,
                    },
                }
            answers.append(answer)
        return Reply(
            200,
            {"Content-Type": "application/vnd.git-lfs+json"},
            json.dumps({"transfer": "basic", "objects": answers, "hash_algo": "sha256"}).encode(),
        )

    def lfs_upload(self, request: Request) -> Reply:
        # Like an S3 pre-signed URL: no Authorization header, the signature in the URL is the credential.
        record = self.store.get(request.repo_id)
        oid = request.params["oid"]
        size_text = request.query.get("size", [""])[-1]
        signature = request.query.get("signature", [""])[-1]
        if (
            record is None
            or not size_text.isdigit()
            or not hmac.compare_digest(signature, self._upload_signature(request.repo_id, oid, int(size_text)))
        ):
            raise HubError(403, "upload URL signature does not match")
        record.git.store_lfs_object(oid, int(size_text), request.body.chunks())
        return Reply(200, {"ETag": f'"{oid}"'})

    def lfs_verify(self, request: Request) -> Reply:
        record = self._repository(request, write=True)
        payload = self._json_object(request)
        oid, size = str(payload.get("oid")), payload.get("size")
        if not SHA256_HEX.fullmatch(oid) or not isinstance(size, int) or not record.git.has_lfs_object(oid, size):
            raise HubError(404, f"LFS object {oid} ({size} bytes) is not in {record.repo_id}'s store")
        return _json_reply({"oid": oid, "size": size})


# --------------------------------------------------------------------------------------------------
# HTTP server
# --------------------------------------------------------------------------------------------------


class _HubHttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], application_factory: Callable[[str], HubApplication]):
        super().__init__(address, _HubRequestHandler)
        host, port = self.server_address[:2]
        self.application = application_factory(f"http://{host}:{port}")
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def process_request_thread(self, request, client_address):
        with self._connections_lock:
            self._connections.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._connections_lock:
                self._connections.discard(request)

    def close_all_connections(self) -> None:
        """Drop kept-alive connections too, so a stopped hub really stops answering."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _HubRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HubHttpServer

    def do_GET(self) -> None:
        self._serve()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def _serve(self) -> None:
        url = urlsplit(self.path)
        body = RequestBody(self.rfile, self.headers)
        request = Request(self.command, url.path, parse_qs(url.query, keep_blank_values=True), self.headers, body)
        try:
            reply = self.server.application.handle(request)
            body.drain()  # keep the connection usable when a handler did not need the body
        except HubError as error:  # raised while reading the body
            reply = _error_reply(error)
            self.close_connection = True
        self._send(reply)

    def _send(self, reply: Reply) -> None:
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if "Content-Length" not in reply.headers:
            self.send_header("Content-Length", str(reply.content_length))
        self.end_headers()
        if self.command == "HEAD":
            return
        budget = reply.cut_after if reply.cut_after is not None else reply.content_length
        if isinstance(reply.body, FileSlice):
            with reply.body.path.open("rb") as source:
                source.seek(reply.body.offset)
                remaining = min(budget, reply.body.length)
                while remaining > 0:
                    chunk = source.read(min(1 << 20, remaining))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    remaining -= len(chunk)
        else:
            self.wfile.write(reply.body[:budget])
        if reply.cut_after is not None:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, format: str, *args) -> None:
        logger.debug("%s - %s", self.address_string(), format % args)


class LocalHub:
    """A local Hub API server over real git repositories stored under `root`.

    Use as a context manager or call `start()`/`stop()`. `endpoint` is `http://127.0.0.1:<port>`;
    `token` is the only accepted credential and acts as user `user`.
    """

    def __init__(
        self,
        root: Path,
        *,
        token: str = DEFAULT_TOKEN,
        user: str = DEFAULT_USER,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.root = Path(root)
        self.token = token
        self.user = user
        self._address = (host, port)
        self._store = RepositoryStore(self.root)
        self._server: _HubHttpServer | None = None
        self._thread: threading.Thread | None = None
        self._endpoint: str | None = None

    def start(self) -> LocalHub:
        if self._server is not None:
            raise RuntimeError(f"LocalHub at {self.endpoint} is already running")
        if shutil.which("git") is None:
            raise RuntimeError("LocalHub stores repositories with the `git` command line, which is not on PATH")
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = _HubHttpServer(
            self._address,
            lambda endpoint: HubApplication(self._store, endpoint=endpoint, token=self.token, user=self.user),
        )
        self._endpoint = self._server.application.endpoint
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server.close_all_connections()
        assert self._thread is not None
        self._thread.join()
        self._server = None
        self._thread = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def _application(self) -> HubApplication:
        if self._server is None:
            raise RuntimeError("LocalHub is not running; call start() first")
        return self._server.application

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:<port>`; still the address it served at after `stop()`."""
        if self._endpoint is None:
            raise RuntimeError("LocalHub has no endpoint before start()")
        return self._endpoint

    def git_dir(self, repo_id: str) -> Path:
        """The bare git repository behind `repo_id`, for tests that inspect what was really stored."""
        return self._store.git_dir(repo_id)

    def served_requests(self) -> list[ServedRequest]:
        """Every request answered so far, oldest first."""
        return self._application.served_requests()

    def interrupt_downloads(self, repo_id: str, path: str, *, after_bytes: int, times: int = 1) -> None:
        """Make the next `times` GETs of `path` in `repo_id` drop the connection after `after_bytes` body bytes.

        The headers still announce the full `Content-Length`, as when a network connection breaks mid-transfer.
        """
        self._application.interrupt_downloads(repo_id, path, after_bytes=after_bytes, times=times)


def hub_client_environment(base: Mapping[str, str], *, endpoint: str, token: str, hf_home: Path) -> dict[str, str]:
    """`base` (e.g. `os.environ`) changed so that huggingface_hub and transformers use the hub at `endpoint`.

    huggingface_hub reads most of these once, when it is first imported: the environment must be in place
    before that import, in this process or in a child process started with the returned mapping.
    """
    environment = {
        key: value
        for key, value in base.items()
        # Cache locations that would override HF_HOME, and settings that would bypass the endpoint.
        if key
        not in (
            "HUGGINGFACE_HUB_CACHE",
            "HUGGINGFACE_ASSETS_CACHE",
            "TRANSFORMERS_CACHE",
            "HF_TOKEN_PATH",
            "HF_XET_CACHE",
            "HF_HUB_CACHE",
            "HF_ASSETS_CACHE",
            "HUGGING_FACE_HUB_TOKEN",
        )
    }
    no_proxy = ",".join(filter(None, [base.get("NO_PROXY") or base.get("no_proxy"), "127.0.0.1", "localhost"]))
    environment.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(hf_home),
        HF_TOKEN=token,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_OFFLINE="0",
        TRANSFORMERS_OFFLINE="0",
        HF_HUB_ENABLE_HF_TRANSFER="0",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_SYMLINKS_WARNING="1",
        NO_PROXY=no_proxy,
        no_proxy=no_proxy,
    )
    return environment


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--root", type=Path, required=True, help="folder for the repositories")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0 picks a free one)")
    parser.add_argument("--token", default=DEFAULT_TOKEN)
    parser.add_argument("--user", default=DEFAULT_USER)
    arguments = parser.parse_args(argv)
    hub = LocalHub(arguments.root, token=arguments.token, user=arguments.user, port=arguments.port).start()
    print(f"HF_ENDPOINT={hub.endpoint} HF_TOKEN={hub.token}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":
    main()
