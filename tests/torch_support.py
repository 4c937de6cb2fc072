"""Support shared by the PyTorch test modules."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """On a small shared CPU, OpenMP's thread wake-ups cost more than these tiny matmuls; one thread is ~100x faster.

    Imported by a test module, it runs that module on one intra-op thread.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
