"""The reference-based Needle 3 tests need the Needle 3 reference (cactus-needle 3.x), which installs
as the same `needle` package as Needle 2's: they run in .venv-n3 (test.sh's fourth suite). Where the
installed reference is another generation (.venv and .venv-v5 hold 2.0.15), those files are left out
of collection; the model tests (test_needle3_model.py) run everywhere."""

from importlib import metadata

REFERENCE_TESTS = [
    "test_needle3_parity.py", "test_needle3_conversion.py", "test_needle3_readme.py", "test_needle3_tokenizer.py",
    "test_needle3_cact.py", "test_needle3_ladder.py",
]

try:
    _REFERENCE = metadata.version("cactus-needle")
except metadata.PackageNotFoundError:
    _REFERENCE = None

if _REFERENCE is None or not _REFERENCE.startswith("3."):
    collect_ignore = REFERENCE_TESTS
