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


def check_output_outside_inputs(output: Path, inputs: dict[str, Path], *, command: str):
    """Refuse an output that equals, contains or lies inside one of `inputs` (label -> path)."""
    out = Path(os.path.realpath(output))
    for label, path in inputs.items():
        source = Path(os.path.realpath(path))
        if out == source or source.is_relative_to(out) or out.is_relative_to(source):
            relation = "is" if out == source else ("contains" if source.is_relative_to(out) else "lies inside")
            raise OutputOverlapsInputError(
                f"{output} {relation} the {label} {path}; `needle-hf {command}` never writes over its input: "
                "choose an output path outside it"
            )


def check_output_file(output: Path, inputs: dict[str, Path], *, command: str, kind: str, overwrite: bool,
                      error: type[Exception]):
    """Refuse an output file path before any work: over an input (`check_output_outside_inputs`), a
    folder, an existing file without `overwrite`, or a missing parent folder (raised as `error`).
    Debris of an earlier killed run at `output` is cleaned first."""
    check_output_outside_inputs(output, inputs, command=command)
    clean_debris(output)
    if output.is_dir():
        raise error(f"{output} is a folder; give the path of the {kind} to write")
    if output.exists() and not overwrite:
        raise error(f"{output} exists; pass --overwrite to replace it")
    if not output.parent.is_dir():
        raise error(f"the parent folder of {output} does not exist; create it first")


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
