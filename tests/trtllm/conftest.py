"""Fixtures of the TensorRT-LLM / ModelOpt tests."""

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core machine run far faster on one thread (no OpenMP spinning)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
