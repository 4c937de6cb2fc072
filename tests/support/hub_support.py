"""Test support for the Hub, remote-code and model-card tests.

- `write_needle_folder`: a complete saved Needle folder, as a user gets it: config.json with
  `auto_map`, PyTorch-layout model.safetensors from reference-shaped perturbed weights, the fast
  tokenizer with the chat template, and the model code.
- `run_python`: run a script in another interpreter (the main .venv with transformers 4.57, or
  .venv-v5 with transformers 5.x) talking to the local hub, with `needle_hf` made unimportable so
  that only the remote code shipped in the folder can load the model.
- Cache and file checks computed with hashlib, independently of the code under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import textwrap
from pathlib import Path

from needle_reference import TINY_NATIVE_CONFIG, make_native_params

REPO_ROOT = Path(__file__).resolve().parents[2]
# The two environments scripts/setup.sh creates: transformers 4.57 (+ jax/flax, needle_hf installed)
# and transformers 5.x (no Flax, no needle_hf).
MAIN_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
V5_PYTHON = REPO_ROOT / ".venv-v5" / "bin" / "python"

# Vocabulary of the session's SentencePiece fixture (spm_fixture.FIXTURE_VOCAB_SIZE); the model must match it.
FIXTURE_VOCAB = 800
TINY_WITH_TOKENIZER = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB)
# The tiny geometry with 20,000-slot engram tables: model.safetensors is ~10.9 MB, above the Hub's
# 10 MB threshold for LFS uploads, while a forward pass stays as cheap as the tiny model's.
LFS_SIZED_WITH_TOKENIZER = dict(TINY_WITH_TOKENIZER, engram_slots=20_000)

# Prepended to every child script: `needle_hf` cannot be imported (the import system treats a
# `None` entry in sys.modules as "not importable"), so whatever loads came from the folder's code.
_BLOCK_NEEDLE_HF = "import sys\nsys.modules['needle_hf'] = None\n"


def write_needle_folder(path, native_config: dict, *, seed: int, spm_model):
    """Write a complete Needle folder for the weights `make_native_params(native_config, seed)`.

    Returns:
        The `NeedleConfig` written to config.json.
    """
    from flax_support import write_hf_folder

    from needle_hf.models.needle.remote_code import write_remote_code
    from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer, save_fast_tokenizer

    path = Path(path)
    config = write_hf_folder(path, native_config, make_native_params(native_config, seed))
    # write_remote_code directly (it also runs inside save_pretrained once wired there), so that the
    # folder is the same whichever way a user saved it; config.json is rewritten with the auto_map.
    write_remote_code(path, config)
    config.save_pretrained(path)
    tokenizer = build_fast_tokenizer(spm_model, model_max_length=config.max_position_embeddings)
    save_fast_tokenizer(tokenizer, path)
    return config


def sha256_of_files(folder) -> dict[str, str]:
    """{relative posix path: sha256} of every file under `folder`, ignoring huggingface_hub's `.cache`."""
    folder = Path(folder)
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and ".cache" not in path.relative_to(folder).parts
    }


def lfs_pointer(content: bytes) -> bytes:
    """The pointer file the Git LFS spec (v1) prescribes for `content`."""
    return (
        "version https://git-lfs.github.com/spec/v1\n"
        f"oid sha256:{hashlib.sha256(content).hexdigest()}\n"
        f"size {len(content)}\n"
    ).encode()


def partial_downloads(cache_dir) -> list[str]:
    """What a failed download could leave in an HF cache: `*.incomplete` files, and blobs whose
    content does not match the ETag they are named after."""
    cache_dir = Path(cache_dir)
    problems = [str(path.relative_to(cache_dir)) for path in cache_dir.rglob("*.incomplete")]
    for blob in cache_dir.rglob("blobs/*"):
        content = blob.read_bytes()
        if len(blob.name) == 64:
            actual = hashlib.sha256(content).hexdigest()
        else:  # a regular (non-LFS) file is named after its git blob id
            actual = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        if actual != blob.name:
            problems.append(f"{blob.relative_to(cache_dir)} ({len(content)} bytes, content does not match its name)")
    return problems


def cached_snapshot_files(cache_dir) -> list[str]:
    """Names of the files in every cached snapshot (what a later offline load would find)."""
    return sorted(path.name for path in Path(cache_dir).rglob("snapshots/*/*"))


def child_environment(*, hf_home, endpoint: str | None = None, token: str | None = None) -> dict[str, str]:
    """The environment of a child interpreter: this session's hub settings (or `endpoint`), its own
    HF_HOME (so its remote-code module cache starts empty), and no PYTHONPATH (the test runner puts
    the repository there for .venv-v5; the child must not find needle_hf that way either)."""
    from hub_server import hub_client_environment

    environment = hub_client_environment(
        os.environ,
        endpoint=endpoint or os.environ["HF_ENDPOINT"],
        token=token or os.environ["HF_TOKEN"],
        hf_home=Path(hf_home),
    )
    environment.pop("PYTHONPATH", None)
    environment["TOKENIZERS_PARALLELISM"] = "false"
    return environment


def write_child_script(folder, name: str, body: str) -> Path:
    """Write `body` (dedented) after the needle_hf block as `folder/name`."""
    path = Path(folder) / name
    path.write_text(_BLOCK_NEEDLE_HF + textwrap.dedent(body), encoding="utf-8")
    return path


def start_python(python, script, arguments: dict, *, environment: dict[str, str], cwd) -> subprocess.Popen:
    """Start `python script '<arguments as JSON>'` in `cwd` (not the repository: no needle_hf on sys.path[0])."""
    return subprocess.Popen(
        [str(python), str(script), json.dumps(arguments)],
        cwd=str(cwd),
        env=environment,
        # No terminal: transformers' "trust this remote code? [y/N]" prompt gets end-of-file at once.
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_python(process: subprocess.Popen, *, result_file, timeout: float, what: str) -> dict:
    """Wait for a child started by `start_python`; return the JSON object it wrote to `result_file`.

    Raises AssertionError with the child's stderr when it failed.
    """
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        raise AssertionError(f"{what} did not finish within {timeout} s:\n{stderr[-4000:]}") from None
    if process.returncode != 0:
        raise AssertionError(f"{what} failed (exit {process.returncode}):\n{stderr[-6000:]}")
    result_file = Path(result_file)
    if not result_file.is_file():
        raise AssertionError(f"{what} exited without writing {result_file}:\n{stderr[-4000:]}")
    return json.loads(result_file.read_text(encoding="utf-8"))


def run_python(
    python, script, arguments: dict, *, environment: dict[str, str], cwd, result_file, timeout: float, what: str
) -> dict:
    """`start_python` + `finish_python`."""
    process = start_python(python, script, arguments, environment=environment, cwd=cwd)
    return finish_python(process, result_file=result_file, timeout=timeout, what=what)


def flax_model_available() -> bool:
    """Whether this interpreter can run needle_hf's Flax model: jax and flax, and a transformers with
    Flax support (4.x; transformers 5 dropped it, while .venv-v5 still has jax for the reference)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None:
        return False
    return importlib.util.find_spec("transformers.modeling_flax_utils") is not None


def skip_without_flax_model():
    import pytest

    if not flax_model_available():
        pytest.skip("needle_hf's Flax model needs transformers 4.x with jax and flax (the main .venv)")


def interpreter_or_skip(python: Path, reason: str):
    """`python` if it exists, else skip the calling test with `reason`."""
    import pytest

    if not python.exists():
        pytest.skip(f"{python} is missing ({reason}); run scripts/setup.sh to create it")
    return python


__all__ = [
    "LFS_SIZED_WITH_TOKENIZER",
    "MAIN_PYTHON",
    "REPO_ROOT",
    "TINY_WITH_TOKENIZER",
    "V5_PYTHON",
    "cached_snapshot_files",
    "child_environment",
    "finish_python",
    "flax_model_available",
    "interpreter_or_skip",
    "lfs_pointer",
    "partial_downloads",
    "run_python",
    "sha256_of_files",
    "skip_without_flax_model",
    "start_python",
    "write_child_script",
    "write_needle_folder",
]
