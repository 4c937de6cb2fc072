"""The Needle 3 suite needs the Needle 3 reference (cactus-needle 3.x), which installs as the same
`needle` package as Needle 2's: it runs in .venv-n3 (test.sh's fourth suite). Where the installed
reference is another generation (.venv holds 2.0.15), this folder is left out of collection."""

from importlib import metadata

try:
    _REFERENCE = metadata.version("cactus-needle")
except metadata.PackageNotFoundError:
    _REFERENCE = None

if _REFERENCE is None or not _REFERENCE.startswith("3."):
    collect_ignore_glob = ["test_*.py"]
