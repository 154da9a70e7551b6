import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: as the qtk command sets it

from models import make_tiny_model, write_calib  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama"


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """The tests run tiny models and tensors: one intra-op thread is faster than OpenMP workers waiting on a
    shared 2-core machine, and no result depends on it (tests that exercise --threads set their own)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def torch_path(monkeypatch):
    """qtk's native CPU kernels off (qtk.quant.native): the torch path they replace, which must stay correct on its own
    (machines without a C compiler, accelerators)."""
    from qtk.quant.native import packing, rounding, scan

    for module in (rounding, packing, scan):
        monkeypatch.setattr(module, "library", lambda: None)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """2-layer random Llama, bf16, GQA (4 heads, 2 KV heads), widths divisible by 128 for int4 g128."""
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", hidden=128, intermediate=256)


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    return write_calib(tmp_path_factory.mktemp("c") / "calib.jsonl")
