import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from models import make_tiny_model, write_calib  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """2-layer random Llama, bf16, GQA (4 heads, 2 KV heads), widths divisible by 128 for int4 g128."""
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", hidden=128, intermediate=256)


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    return write_calib(tmp_path_factory.mktemp("c") / "calib.jsonl")
