"""Fixtures of the TensorRT-LLM / ModelOpt tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # trtllm_helpers, under any --import-mode
