"""User-facing errors: one line that names the problem and the fix, with a process exit code."""


class QtkError(Exception):
    """Base of every error qtk shows to a user instead of a traceback."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None):
        self.problem = message
        self.fix = fix
        super().__init__(message if not fix else f"{message} — {fix}")


class UsageError(QtkError):
    """Bad input: arguments, recipe, model directory, calibration data (exit 2)."""

    exit_code = 2


class CheckFailed(QtkError):
    """A check on a produced artifact failed (exit 1)."""

    exit_code = 1
