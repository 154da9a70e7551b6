"""The convert job: options checked once (options.py), calibration token ids (calibration.py), the output context
that locks OUT, writes to temporary directories and commits or rolls back (output.py), resume state (resume.py), the
manifest (manifest.py), and the steps that tie them together (job.py). `qtk.api.convert` is a thin wrapper."""

from qtk.convert.job import ConvertJob, ConvertResult, Interrupted
from qtk.convert.options import ConvertOptions

__all__ = ["ConvertJob", "ConvertOptions", "ConvertResult", "Interrupted"]
