"""Shared pytest setup: tests/ on sys.path (for the support modules) and session fixtures."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
    from needle_hf.tokenization_needle import build_fast_tokenizer

    return build_fast_tokenizer(str(DEMO_DIR / "tokenizer.model"))


@pytest.fixture(scope="session")
def demo_model():
    """The shipped demo checkpoint (needle_hf/demo/needle2-demo.pkl, every head) as a float32 `NeedleForCausalLM`, eval mode."""
    import torch

    from needle_hf.configuration_needle import NeedleConfig
    from needle_hf.conversion.native_checkpoint import load_native_checkpoint
    from needle_hf.demo import DEMO_DIR
    from needle_hf.modeling_needle import NeedleForCausalLM
    from needle_hf.weight_names import native_to_hf, optional_heads_in_native

    checkpoint = load_native_checkpoint(DEMO_DIR / "needle2-demo.pkl")
    config = NeedleConfig.from_needle_config(checkpoint.config, **optional_heads_in_native(checkpoint.params))
    model = NeedleForCausalLM(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(checkpoint.params, config).items()})
    return model.eval()
