"""Progress and warnings of the long commands (convert, eval) on stderr.

In a terminal: a rich bar with elapsed time and ETA, redrawn in place and gone when done. Anywhere else (CI
logs, pipes, files): one plain line per stage and per step, nothing redrawn, no control characters. Warnings
logged under the "qtk" logger are shown the same way, above the bar or as their own line."""

from __future__ import annotations

import logging
import sys
import time

from qtk.errors import printable


def clock(seconds: float) -> str:
    """0:07, 12:34, 1:02:03."""
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Reporter:
    """Stages ("calibration data") and counted steps ("layer 3/24") of one command.

    ETA = the mean time of the steps computed so far in this run times the steps left; steps restored from
    saved state (replayed=True) take no time and do not enter it."""

    def __init__(self, command: str, *, stream=None, interactive: bool | None = None, unit: str = "step"):
        self.command, self.unit = command, unit
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty()) if interactive is None else interactive
        self.t0 = time.perf_counter()
        self._mark = self.t0  # start of the steps that count for the ETA
        self._fresh = 0
        self._progress = self._task = None
        self._handler: logging.Handler | None = None

    # ---- lifetime ----

    def __enter__(self) -> "Reporter":
        if self.interactive:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), TextColumn("{task.fields[detail]}"),
                                      console=Console(file=self.stream, force_terminal=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.command, total=None, eta="", detail="")
        self._handler = _WarningHandler(self)
        qtk_log = logging.getLogger("qtk")
        qtk_log.addHandler(self._handler)
        self._propagate, qtk_log.propagate = qtk_log.propagate, False  # shown here, not again by another handler
        return self

    def __exit__(self, *exc) -> None:
        qtk_log = logging.getLogger("qtk")
        qtk_log.removeHandler(self._handler)
        qtk_log.propagate = self._propagate
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # ---- what commands report ----

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _line(self, text: str) -> None:
        print(f"[{self.command} {clock(self.elapsed)}] {text}", file=self.stream, flush=True)

    def stage(self, text: str) -> None:
        """A named stage; before the first step it also starts the clock the ETA counts from."""
        if self._fresh == 0:
            self._mark = time.perf_counter()
        if self._progress is not None:
            self._progress.update(self._task, description=text)
        else:
            self._line(text)

    def eta(self, done: int, total: int) -> float | None:
        if self._fresh == 0 or done >= total:
            return None
        return (time.perf_counter() - self._mark) / self._fresh * (total - done)

    def step(self, done: int, total: int, detail: str = "", *, replayed: bool = False, label: str | None = None) -> None:
        """Step `done` of `total` is finished; detail says how it went (e.g. the layer's largest error)."""
        if replayed:
            self._mark = time.perf_counter()
        else:
            self._fresh += 1
        left = self.eta(done, total)
        eta = "" if left is None else f"ETA {clock(left)}"
        label = label or self.unit
        if self._progress is not None:
            self._progress.update(self._task, description=label, completed=done, total=total, eta=eta, detail=detail)
        else:
            parts = [f"{label} {done}/{total}"] + ([eta] if eta else []) + (["restored"] if replayed else []) + ([detail] if detail else [])
            self._line(", ".join(parts))

    def warn(self, text: str) -> None:
        text = printable(text)  # one line, whatever a quoted input holds
        if self._progress is not None:
            self._progress.console.print(f"warning: {text}", markup=False, highlight=False)
        else:
            print(f"warning: {text}", file=self.stream, flush=True)


class _WarningHandler(logging.Handler):
    def __init__(self, reporter: Reporter):
        super().__init__(logging.WARNING)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.reporter.warn(record.getMessage())
        except Exception:  # a broken stream must not turn a warning into a crash
            self.handleError(record)


def layer_detail(layer, short: bool = False) -> str:
    """The largest relative weight error of a layer and, under GPTQ, its largest loss, with the module names
    (short: the values only, to fit beside a bar)."""
    parts = []
    for what, values, fmt in (("weight error", layer.weight_error, ".4f"), ("GPTQ loss", layer.gptq_loss, ".3g")):
        if values:
            name, v = max(values.items(), key=lambda kv: kv[1])
            parts.append(f"max {what} {v:{fmt}}" + ("" if short else f" ({name})"))
    return ", ".join(parts)
