"""Outputs that appear whole or not at all, never over an input, and the debris of a crash cleaned up.

A converter builds its output under a staging name beside the target, on the same filesystem:
`.{name}.partial-{pid}-{tag}`. Once complete and synced to disk it takes the target's place:

- a new target: one `rename`;
- a folder replacing a folder: one atomic exchange of the two (`renameat2(RENAME_EXCHANGE)`, Linux),
  after which the old folder, now under the staging name, is removed; where the exchange is not
  available, the old folder is first renamed `.{name}.previous-{pid}-{tag}` and then the new one
  moved in;
- a file replacing a file: `os.replace`, atomic everywhere.

A kill at any point leaves the old or the new output at the target, except between the two renames
of the fallback, which leaves the old one under its `.previous` name. Every run first calls
`clean_debris`: staging names of processes no longer alive are removed, and a `.previous` folder is
put back at the target when the target is missing (otherwise removed).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import uuid
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_DEBRIS = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|previous)-(?P<pid>\d+)-[0-9a-f]{8}")


class OutputOverlapsInputError(ValueError):
    """The output path equals, contains or lies inside an input path; nothing was written or removed."""


# Entries of an input folder examined for links into the output; a folder larger than this is
# refused rather than half examined.
MAX_INPUT_ENTRIES = 100_000


def _resolved(path) -> Path:
    return Path(os.path.realpath(os.fspath(path)))


def _overlap(out: Path, source: Path) -> str | None:
    if out == source:
        return "is"
    if source.is_relative_to(out):
        return "contains"
    if out.is_relative_to(source):
        return "lies inside"
    return None


def _linked_entries(folder: Path, *, command: str):
    """(entry, resolved target) of every symbolic link under the input `folder`."""
    count = 0
    for root, directories, files in os.walk(folder):
        for name in (*directories, *files):
            count += 1
            if count > MAX_INPUT_ENTRIES:
                raise OutputOverlapsInputError(
                    f"{folder} holds more than {MAX_INPUT_ENTRIES} entries; `needle-hf {command}` reads a model "
                    "folder, not a tree of that size")
            entry = Path(root) / name
            if entry.is_symlink():
                yield entry, _resolved(entry)


def check_output_outside_inputs(output, inputs: dict, *, command: str):
    """The one rule every writer applies before any work: refuse an `output` that is, contains or
    lies inside one of `inputs` (label -> path; None entries are skipped).

    Paths are compared after resolving symbolic links (relative paths, `..`, trailing slashes and
    links all reduce to the same real path), so an output linked into an input, or an input linked
    into the output, is refused too; so is an input folder with a link that resolves into the output
    (a Hub cache snapshot links its files into a blob folder).
    """
    out = _resolved(output)
    for label, path in inputs.items():
        if path is None:
            continue
        source = _resolved(path)
        relation = _overlap(out, source)
        if relation is None and source.is_dir():
            for entry, target in _linked_entries(source, command=command):
                if _overlap(out, target) is not None:
                    relation = f"{_overlap(out, target)} the target {target} of the link {entry} in"
                    break
        if relation is not None:
            raise OutputOverlapsInputError(
                f"{output} {relation} the {label} {path}; `needle-hf {command}` never writes over its input: "
                "choose an output path outside it"
            )


def check_output_file(output, inputs: dict, *, command: str, kind: str, overwrite: bool,
                      error: type[Exception]):
    """Refuse an output file path before any work: over an input (`check_output_outside_inputs`), a
    folder, an existing file without `overwrite`, or a missing parent folder (raised as `error`).
    Debris of an earlier killed run at `output` is cleaned first."""
    output = Path(output)
    check_output_outside_inputs(output, inputs, command=command)
    clean_debris(output)
    if output.is_dir():
        raise error(f"{output} is a folder; give the path of the {kind} to write")
    if os.path.lexists(output) and not output.is_file():
        raise error(f"{output} exists and is not a regular file; give the path of the {kind} to write")
    if output.exists() and not overwrite:
        raise error(f"{output} exists; pass --overwrite to replace it")
    if not output.parent.is_dir():
        raise error(f"the parent folder of {output} does not exist; create it first")


def check_output_folder(output, inputs: dict, *, command: str, overwrite: bool, error: type[Exception]):
    """Refuse an output folder path before any work: over an input (`check_output_outside_inputs`),
    an existing non-folder, a non-empty folder without `overwrite`, or a missing parent folder
    (raised as `error`). Debris of an earlier killed run at `output` is cleaned first."""
    output = Path(output)
    check_output_outside_inputs(output, inputs, command=command)
    clean_debris(output)
    if not output.parent.is_dir():
        raise error(f"the parent folder of {output} does not exist; create it first")
    if os.path.lexists(output) and not output.is_dir():
        raise error(f"{output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise error(f"{output} exists and is not empty; pass --overwrite to replace it")


@contextlib.contextmanager
def errors_name(target: Path, staging: Path):
    """Report a failure while writing `staging` under the user's path `target`, never the staging name."""
    try:
        yield
    except OSError as failure:
        named = os.fspath(failure.filename) if isinstance(failure.filename, (str, os.PathLike)) else None
        if failure.errno is None or (named is not None and not named.startswith(str(staging))):
            raise  # not about the staged output: the message already names the right file
        shown = str(target) if named is None else str(target) + named[len(str(staging)):]
        raise OSError(failure.errno, f"{failure.strerror} (writing {target})", shown) from None
    except ValueError as failure:
        text = str(failure)
        if str(staging) not in text and staging.name not in text:
            raise
        text = text.replace(str(staging), str(target)).replace(staging.name, target.name)
        try:
            renamed = type(failure)(text)
        except Exception:  # an exception type with another constructor keeps the plain ValueError
            renamed = ValueError(text)
        raise renamed from None


def staging_path(target: Path) -> Path:
    """A fresh staging name beside `target` that names this process."""
    return target.with_name(f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_debris(target: Path) -> list[Path]:
    """Remove what crashed runs left beside `target`; put a hidden old folder back if `target` is gone.

    Returns the paths removed or restored.
    """
    cleaned = []
    if not target.parent.is_dir():
        return cleaned
    for entry in sorted(target.parent.iterdir()):
        match = _DEBRIS.fullmatch(entry.name)
        if not match or match["name"] != target.name or _alive(int(match["pid"])):
            continue
        if match["kind"] == "previous" and not os.path.lexists(target):
            os.rename(entry, target)
        else:
            _remove(entry)
        cleaned.append(entry)
    return cleaned


def fsync_path(path: Path):
    """Flush a file's or a folder's entry list to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path):
    """Flush every file under `folder`, then the folders themselves."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically; False where the system cannot (then nothing happened)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def publish_folder(staging: Path, target: Path):
    """Put the complete, synced folder `staging` at `target`, replacing what is there only now."""
    fsync_tree(staging)
    if not os.path.lexists(target):
        os.rename(staging, target)
    elif _exchange(staging, target):
        _remove(staging)  # holds the old folder now
    else:
        previous = target.with_name(staging.name.replace(".partial-", ".previous-", 1))
        os.rename(target, previous)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(previous, target)
            raise
        _remove(previous)
    fsync_path(target.parent)


def publish_file(staging: Path, target: Path):
    """Put the complete file `staging` at `target` (atomic `os.replace`), then sync the folder."""
    fsync_path(staging)
    os.replace(staging, target)
    fsync_path(target.parent)
