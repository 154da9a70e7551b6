"""qtk: quantize LLMs into engine-ready checkpoints, prove accuracy, plan capacity.

Importing qtk is cheap: no torch or transformers at import time (the CLI starts fast).
"""

__version__ = "0.1.0"

from qtk.errors import QtkError, UsageError, CheckFailed  # noqa: E402

__all__ = ["__version__", "QtkError", "UsageError", "CheckFailed"]
