"""User-facing errors: one line that names the problem and the fix, with a process exit code."""

import unicodedata

_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def printable(text: str) -> str:
    """`text` as qtk prints it on a terminal: every character a terminal would act on (control characters, line
    and paragraph separators) written as an escape, and each byte of a name that is not UTF-8 (which Python keeps
    as a lone surrogate) as \\xNN, so that an error stays one line and shows what the input held."""
    out = []
    for c in text:
        cat = unicodedata.category(c)
        if cat not in ("Cc", "Cs", "Zl", "Zp"):
            out.append(c)
        elif c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif 0xDC80 <= ord(c) <= 0xDCFF:  # surrogateescape: the byte that was not UTF-8
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


class QtkError(Exception):
    """Base of every error qtk shows to a user instead of a traceback."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None):
        self.problem = message
        self.fix = fix
        super().__init__(message if not fix else f"{message} — {fix}")

    def line(self) -> str:
        """The line the commands print for it."""
        return "error: " + printable(str(self))


class UsageError(QtkError):
    """Bad input: arguments, recipe, model directory, calibration data (exit 2)."""

    exit_code = 2


class CheckFailed(QtkError):
    """A check on a produced artifact failed (exit 1)."""

    exit_code = 1
