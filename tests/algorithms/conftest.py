import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The kernels' tests use tiny tensors: one intra-op thread is ~100x faster than two on a busy
    shared machine (OpenMP workers spin-waiting for a core), and results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
