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
