"""Ctrl-C (and `kill`) that is never lost. Python raises KeyboardInterrupt at the next bytecode of the main thread;
when that bytecode belongs to a weakref finalizer or a __del__ (the stream's read budget and the read buffers are
returned by finalizers that run whenever a tensor dies), the interpreter prints "Exception ignored in ..." and the
interrupt is gone: the run goes on and waits for the next layer as if nothing had happened. Under `handled()` the
signal is also remembered, and `check()` (called between layers, before waiting for a read ahead and before the
final renames) raises it again."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_pending: str | None = None  # the signal received and not yet seen to end the run


def check() -> None:
    """Raise KeyboardInterrupt if a signal arrived under `handled()` (again, when a finalizer swallowed it)."""
    if _pending is not None:
        raise KeyboardInterrupt(_pending)


def _on_signal(signum, frame) -> None:
    global _pending
    _pending = signal.Signals(signum).name
    raise KeyboardInterrupt(_pending)


@contextmanager
def handled():
    """SIGINT and SIGTERM raise KeyboardInterrupt (SIGTERM too: `kill` cleans up like Ctrl-C instead of leaving
    temporary directories behind) and are remembered for `check()`; the handlers before are restored after. A signal
    the process ignores stays ignored (a run under nohup), and outside the main thread nothing is installed."""
    global _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending = None
    before = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            before[sig] = signal.signal(sig, _on_signal)
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
        _pending = None


# how long an ending run waits for its read-ahead and write-back threads: one tensor's read or write, not a stalled disk
SETTLE_SECONDS = 5.0


def settle_background(timeout: float = SETTLE_SECONDS) -> bool:
    """Wait, at most `timeout` seconds in all, for qtk's daemon threads (read ahead, write back, flush) that a failure
    or Ctrl-C abandoned; True when none is left. One left inside a torch call when the interpreter shuts down is ended
    by an unwind its C++ frames cannot take, and the process aborts ("terminate called without an active exception",
    SIGABRT) instead of exiting with its code."""
    import time

    deadline = time.monotonic() + timeout
    for t in threading.enumerate():
        if t.daemon and t.name.startswith("qtk-") and t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.daemon and t.name.startswith("qtk-") and t.is_alive() for t in threading.enumerate())
