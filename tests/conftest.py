"""Shared pytest setup: tests/support on sys.path (the support modules every room's suites share),
the collection rule of the transformers 5 run, and session fixtures."""

import ast
import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

# Read from the installed metadata: importing transformers here would load huggingface_hub's
# constants before hub_fixtures points them at the local Hub.
TRANSFORMERS_MAJOR = int(importlib.metadata.version("transformers").split(".")[0])


def _module_markers(path: Path) -> set[str]:
    """The marker names of a test module's module-level ``pytestmark`` (read from its source, not imported)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


def pytest_ignore_collect(collection_path, config):
    """Under transformers 5.x only the modules marked `v5` or `vllm` are collected: the others import
    the Flax models, which 5.x no longer has, so importing them there would fail before `-m` could
    deselect them."""
    if TRANSFORMERS_MAJOR >= 5 and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not ({"v5", "vllm"} & _module_markers(collection_path)) or None
    return None


# Starts the local Hub and points HF_ENDPOINT/HF_HOME/HF_TOKEN at it before anything imports huggingface_hub.
pytest_plugins = ["hub_fixtures"]

from spm_fixture import FIXTURE_VOCAB_SIZE, train_needle_spm  # noqa: E402


@pytest.fixture(scope="session")
def needle_spm_model(tmp_path_factory):
    """Path of a Needle-style SentencePiece model (FIXTURE_VOCAB_SIZE pieces), trained once per session."""
    return train_needle_spm(tmp_path_factory.mktemp("needle_spm"), vocab_size=FIXTURE_VOCAB_SIZE)


@pytest.fixture(scope="module")
def one_cpu_thread():
    """On a small shared CPU, OpenMP's thread wake-ups cost more than tiny matmuls: torch on one thread."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def demo_tokenizer():
    """The shipped demo tokenizer (needle_hf/demo/tokenizer.model, 800 pieces) as a fast tokenizer."""
    from needle_hf.demo import DEMO_DIR
    from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer

    return build_fast_tokenizer(str(DEMO_DIR / "tokenizer.model"))


@pytest.fixture(scope="session")
def demo_model():
    """The shipped demo checkpoint (needle_hf/demo/needle2-demo.pkl, every head) as a float32 `NeedleForCausalLM`, eval mode."""
    import torch

    from demo_support import load_demo_checkpoint

    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
    from needle_hf.models.needle.weight_names import native_to_hf, optional_heads_in_native

    checkpoint = load_demo_checkpoint()
    config = NeedleConfig.from_needle_config(checkpoint.config, **optional_heads_in_native(checkpoint.params))
    model = NeedleForCausalLM(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(checkpoint.params, config).items()})
    return model.eval()
