"""`qtk eval`: the Click command. Parses, calls qtk.eval.api.run_gate, renders; the verdict is the exit code
(0 pass, 1 gate failed, 2 usage error). No torch or transformers at import time."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import click

from qtk.errors import QtkError
from qtk.eval.report import summary


class _QtkCommand(click.Command):
    """qtk's errors as one line and their exit code, also when the command runs on its own (not under `qtk`)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QtkError as e:
            click.echo(e.line(), err=True)
            sys.exit(e.exit_code)


def _eval(checkpoint, baseline, tasks_file, no_cache, task_names, **options):
    """Gate CHECKPOINT (a directory `qtk convert` wrote) against the original model: same examples, same batches,
    paired bootstrap intervals, limits from the task file. Exit 0 pass, 1 gate failed, 2 usage error.

    \b
      qtk eval out/vllm --baseline model/ --tasks tasks.yaml --junit gate.xml --json gate.json
    """
    from qtk.eval.api import GateOptions

    opts = GateOptions(use_cache=not no_cache, tasks=list(task_names) or None, **options)
    result = gate_with_progress(checkpoint, baseline, tasks_file, opts)
    click.echo(summary(result))
    result.raise_for_verdict()


@contextmanager
def gate_progress():
    """qtk's progress on stderr for gating, as `qtk convert` shows it: a bar with ETA in a terminal, one line per
    stage and per task run in logs. Yields the progress keywords run_gate (and qtk.api.gate_outputs) take."""
    from transformers.utils import logging as hf_logging

    from qtk.progress import Reporter

    hf_logging.disable_progress_bar()  # transformers' per-load bars would interleave with ours
    with Reporter("qtk eval", unit="task") as rep:
        yield {"progress": rep.stage, "on_task": lambda done, total, what: rep.step(done, total, what, label="task run")}


def gate_with_progress(checkpoint, baseline, tasks_file, options=None, **kw):
    """run_gate with qtk's progress on stderr."""
    from qtk.eval.api import run_gate

    with gate_progress() as progress:
        return run_gate(checkpoint, baseline, tasks_file, options, **progress, **kw)


_options = [
    click.argument("checkpoint", type=click.Path(path_type=str)),
    click.option("--baseline", "-b", required=True, type=click.Path(path_type=str),
                 help="The original Hugging Face model directory (BF16/FP16) the checkpoint was converted from."),
    click.option("--tasks", "tasks_file", required=True, type=click.Path(path_type=str), help="YAML task file (see docs/eval.md)."),
    click.option("--junit", type=click.Path(path_type=str), help="Write a JUnit XML report (one test case per task)."),
    click.option("--json", "json_path", type=click.Path(path_type=str), help="Write the JSON report (schema qtk.eval/1)."),
    click.option("--markdown", type=click.Path(path_type=str), help="Write a Markdown table for a pull request."),
    click.option("--plot", type=click.Path(path_type=str), help="Write a per-layer quantization-error plot (PNG; needs matplotlib)."),
    click.option("--engine", type=click.Choice(["hf", "vllm"]), default="hf", show_default=True,
                 help="hf: transformers with the engine's quantization simulated; vllm: run it in the installed vLLM (CPU or GPU build)."),
    click.option("--limit", type=int, default=None, help="Evaluate at most N examples per task [task file]."),
    click.option("--seed", type=int, default=None, help="Seed for few-shot selection and the bootstrap [task file: 1234]."),
    click.option("--strict", is_flag=True, help="Fail on the point estimate, even when the drop is not significant."),
    click.option("--strict-heldout", is_flag=True, help="Fail when evaluation examples occur in the calibration data."),
    click.option("--cache-dir", type=click.Path(path_type=str), default=None,
                 help="Baseline result cache [$QTK_CACHE_DIR or ~/.cache/qtk/eval]."),
    click.option("--no-cache", is_flag=True, help="Neither read nor write the baseline cache."),
    click.option("--batch-size", type=int, default=16, show_default=True, help="Sequences per forward pass."),
    click.option("--device", default=None, help="hf engine device: cpu, cuda, cuda:1 [cuda if available]."),
    click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
                 help="hf engine compute dtype, the same for baseline and candidate."),
    click.option("--bootstrap", type=int, default=2000, show_default=True, help="Bootstrap resamples for the intervals."),
    click.option("--task", "task_names", multiple=True, help="Run only this task of the file (repeatable)."),
    click.option("--threads", type=int, default=None,
                 help="CPU threads for the hf engine [torch's default]; 1 is often fastest for small models on a busy machine."),
    click.option("--trust-remote-code", is_flag=True,
                 help="Allow custom code named by the models' auto_map (config or tokenizer); refused without this flag."),
]


def _build(f):
    for opt in reversed(_options):
        f = opt(f)
    return f


eval_cmd = click.command("eval", cls=_QtkCommand, context_settings={"help_option_names": ["-h", "--help"]})(_build(_eval))
