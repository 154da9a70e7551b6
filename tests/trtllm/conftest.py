"""Fixtures of the TensorRT-LLM / ModelOpt tests."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # trtllm_helpers, under any --import-mode


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core machine run far faster on one thread (no OpenMP spinning)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
