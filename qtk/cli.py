"""The `qtk` command line: parse, call qtk.api, render. No logic lives here."""

from __future__ import annotations

import os
import sys

# Before torch loads OpenMP: idle worker threads sleep instead of spinning. On a busy host spinning threads
# fight the working ones for cores (a w4a16-gptq conversion of examples/tiny-llama took 18.7 s with spinning
# and 5.1 s without, on 2 shared cores); an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import click  # noqa: E402

from qtk import __version__
from qtk.errors import CheckFailed, QtkError, UsageError, printable
from qtk.export import TARGETS

SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def _size(text: str, flag: str = "--max-shard-size") -> int:
    t = text.strip().upper()
    for unit in sorted(SIZE_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * SIZE_UNITS[unit])
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise click.BadParameter(f"'{text}' is not a size", param_hint=f"{flag} (e.g. 5GB, 500MB)") from None


# calibration options default to the recipe's own values, which differ between recipes
RECIPE_DEFAULT = "[default: the recipe's, see `qtk recipes show NAME`]"

# commands that live with their feature; imported only when used, so `qtk --help` stays fast
LAZY_COMMANDS = {"plan": "qtk.plan.cli:plan", "eval": "qtk.eval.cli:eval_cmd"}


class QtkGroup(click.Group):
    """Turns qtk's own errors and bad option values into one line and their exit code; Ctrl-C into exit 130."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx, name):
        if name in LAZY_COMMANDS and name not in self.commands:
            import importlib

            mod, _, attr = LAZY_COMMANDS[name].partition(":")
            self.add_command(getattr(importlib.import_module(mod), attr), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        from qtk import interrupts

        try:
            with interrupts.handled():  # Ctrl-C and `kill` end the run even when a finalizer swallowed the signal
                return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:  # a bad option value: one line like qtk's own errors, not click's usage block
            where = e.ctx.command_path if e.ctx else ctx.command_path
            click.echo(printable(f"error: {e.format_message()} — see '{where} --help'"), err=True)
            sys.exit(e.exit_code)
        except QtkError as e:
            if _reports(e):
                click.echo(e.line(), err=True)
            interrupts.settle_background()
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            if _reports(None):
                click.echo("interrupted: no output was left behind", err=True)
            if not interrupts.settle_background():  # a stalled read: leave without the shutdown that would abort
                sys.stderr.flush()
                os._exit(130)
            sys.exit(130)


def _rank() -> int:
    """This process's rank under torchrun (0 in one process)."""
    return int(os.environ.get("RANK", "0") or 0)


def _reports(e) -> bool:
    """Under torchrun one process speaks for the run: rank 0 (which reports another rank's failure as that rank's own
    line), or rank 1 when rank 0 vanished without a word. Every process still exits with the error's code."""
    if _rank() == 0:
        return True
    from qtk.pipeline.distributed import PeerFailed

    return _rank() == 1 and isinstance(e, PeerFailed) and e.origin is None


@click.group(cls=QtkGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="qtk")
def main():
    """Quantize LLMs into engine-ready checkpoints, prove accuracy, plan capacity.

    \b
      qtk convert model/ --recipe int8-kv8 -o out/ --target vllm
      qtk inspect out/vllm
      qtk recipes list
    """


@main.command()
@click.argument("model", type=click.Path(file_okay=False, path_type=str))
@click.option("--recipe", "-r", required=True, help="Built-in recipe name (see `qtk recipes list`) or a YAML file.")
@click.option("--output", "-o", "out", required=True, type=click.Path(path_type=str), help="Output directory; each target goes to OUT/<target>/.")
@click.option("--target", "-t", "targets", multiple=True, default=("vllm",), show_default=True,
              help=f"Output format; repeat for several: {', '.join(TARGETS)}.")
@click.option("--calib", default=None, help="Calibration text: 'default', a .jsonl/.txt/.parquet file, a dataset directory, or a Hugging Face dataset id; for a vision-language model also image+text: a .jsonl whose rows name an 'image' (a path relative to it) and text, or a folder of images.")
@click.option("--split", default=None, help="Split of a calibration dataset directory or hub id [train, or its only split].")
@click.option("--text-field", default=None, help=f"Text field/column of the calibration data; a list of chat turns (e.g. messages) gets the model's chat template {RECIPE_DEFAULT}.")
@click.option("--num-samples", type=int, default=None, help=f"Calibration windows {RECIPE_DEFAULT}.")
@click.option("--seq-len", type=int, default=None, help=f"Tokens per calibration window {RECIPE_DEFAULT}.")
@click.option("--seed", type=int, default=None, help=f"Seed for calibration sampling {RECIPE_DEFAULT}.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT/<target>/.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks (trtllm target).")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel ranks (trtllm target).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard.")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Calibration windows per forward pass.")
@click.option("--allow-pickle", is_flag=True, help="Allow loading pickle (*.bin) weights. Only for sources you trust.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom model code from the model directory.")
@click.option("--no-hash", is_flag=True, help="Skip hashing the source files for the manifest.")
@click.option("--gate", "gate", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="After converting, gate every output against MODEL with this task file (like `qtk eval`); exit 1 if a gate fails. Reports go to OUT/gate-<target>.{json,xml,md}.")
@click.option("--resume", is_flag=True, help="Save per-layer state in OUT/.qtk-resume and continue an interrupted run of the same command from its last finished layer.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for calibration and the --gate run [torch's default: one per core]; fewer can be faster on a busy machine.")
@click.option("--device", default="auto", show_default=True,
              help="Where layers, calibration activations and solvers live: auto (a GPU when one is visible, else the CPU), cpu, cuda, cuda:N. Under torchrun each process takes its LOCAL_RANK's GPU.")
@click.option("--max-device-memory", default=None,
              help="Most calibration activations kept on the GPU (e.g. 20GB); the rest wait in pinned host memory [default: free memory less one layer's working set].")
@click.option("--verify-engine", type=click.Choice(["vllm"]), default=None,
              help="Before publishing, run the vllm output in the installed vLLM (CPU or GPU build) on a few token windows and compare with qtk's simulation; exit 1 if they disagree (docs/engine.md).")
def convert(model, recipe, out, gate, threads, max_shard_size, no_hash, max_device_memory, **options):
    """Quantize MODEL (a local Hugging Face directory) with a recipe into engine-ready checkpoints."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    from qtk import api
    from qtk.convert import ConvertOptions
    from qtk.progress import Reporter, layer_detail

    targets = options["targets"]

    quiet = _rank() != 0  # under torchrun rank 0 reports progress and results for every process
    with Reporter("qtk convert", unit="layer", stream=open(os.devnull, "w") if quiet else None) as rep:
        if rep.interactive:  # a bar from the start; a log's first line comes with the first real work
            rep.stage("reading the model")

        def on_layer(done, total, layer):
            rep.step(done, total, layer_detail(layer, short=rep.interactive), replayed=layer.replayed)

        opts = ConvertOptions(**options, max_shard_bytes=_size(max_shard_size), hash_source=not no_hash,
                              max_device_memory=None if max_device_memory is None
                              else _size(max_device_memory, "--max-device-memory"),
                              also_writes=api.gate_reports(targets) if gate else ())
        res = api.convert(model, recipe, out, opts, on_stage=rep.stage, on_layer=on_layer)
    if quiet:
        return
    for m in res.messages:
        click.echo(m, err=True)
    for t, path in res.outputs.items():
        click.echo(f"wrote {t}: {path}")
        for n in res.notes.get(t, []):
            click.echo(f"  note: {n}")
    click.echo(f"recipe {res.manifest['recipe']['name']} ({res.manifest['recipe']['summary']}) in {res.timings['total']:.1f}s")
    if not gate:
        _next_steps(res.outputs, model)
        return
    from qtk.eval.cli import gate_progress
    from qtk.eval.report import summary

    with gate_progress() as progress:
        results = api.gate_outputs(res.outputs, model, gate, out, threads=threads,
                                   trust_remote_code=options["trust_remote_code"],
                                   on_output=lambda t, path: progress["progress"](f"gating {t} with {gate}"), **progress)
    for result in results.values():
        click.echo(summary(result))
    _next_steps(res.outputs, model)
    failed = [t for t, result in results.items() if not result.passed]
    if failed:
        click.echo(f"gate failed for: {', '.join(failed)}", err=True)
        sys.exit(1)


# ---- qtk tune


@main.command()
@click.argument("model", type=click.Path(file_okay=False, path_type=str))
@click.option("--tasks", "tasks_file", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="The accuracy gate: a `qtk eval` task file (see docs/eval.md).")
@click.option("--output", "-o", "out", required=True, type=click.Path(path_type=str),
              help="Output directory: OUT/<target>/, recipe.yaml, tune.{json,md}, frontier.png, plan.json, rounds/.")
@click.option("--candidates", default="w4a16-gptq,w8a16,bf16", show_default=True,
              help="Comma-separated weight-only recipes (built-in names or YAML files) each unit may get; bf16 keeps a unit in 16 bits.")
@click.option("--target", "-t", "targets", multiple=True, default=("vllm",), show_default=True,
              type=click.Choice(TARGETS), help="Checkpoint format(s) to write; awq and hf-modelopt hold one scheme, so only uniform points are tried.")
@click.option("--gpu", default=None, help="Budget from `qtk plan`'s deployment model on this GPU (see `qtk plan --help`); the KV-cache format is searched too.")
@click.option("--context", type=int, default=4096, show_default=True, help="Tokens per request (with --gpu).")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Concurrent requests (with --gpu).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel GPUs (with --gpu).")
@click.option("--max-weight-bytes", default=None, help="Budget as checkpoint bytes instead of a deployment (e.g. 40GB, 1.5MB).")
@click.option("--max-rounds", type=int, default=6, show_default=True, help="Most convert + gate rounds along the frontier.")
@click.option("--calib", default=None, help="Calibration text (as for `qtk convert`) [default: the first GPTQ candidate's].")
@click.option("--num-samples", type=int, default=None, help="Calibration windows [default: the first GPTQ candidate's].")
@click.option("--seq-len", type=int, default=None, help="Tokens per calibration window [default: the first GPTQ candidate's].")
@click.option("--seed", type=int, default=None, help="Calibration sampling seed.")
@click.option("--limit", type=int, default=None, help="Examples per gate task [default: the task file's].")
@click.option("--task", "tasks", multiple=True, help="Gate only this task of the file (repeatable).")
@click.option("--strict", is_flag=True, help="Gate on point estimates, as `qtk eval --strict`.")
@click.option("--overwrite", is_flag=True, help="Write into a non-empty OUT.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads [torch's default].")
def tune(model, tasks_file, out, candidates, max_weight_bytes, tasks, threads, **options):
    """The cheapest per-module mix of CANDIDATES that fits a budget and passes an accuracy gate.

    One calibration pass estimates, for every fusion group (q/k/v, o, gate/up, down; MoE experts together) and
    every candidate, the damage (Hessian-weighted output error) and the exact bytes; the whole bytes-vs-damage
    frontier follows. Each round converts one frontier point and gates it against MODEL, bisecting for the
    cheapest point that passes. Exit 0: OUT holds the checkpoint(s) and recipe.yaml (`qtk convert --recipe
    OUT/recipe.yaml` reproduces them); exit 1: nothing fits the budget (the smallest feasible one is named) or
    nothing tried passes; exit 2: bad input.

    \b
      qtk tune model/ --tasks tasks.yaml --gpu h100-80g --context 8192 --concurrency 16 -o out/
      qtk tune model/ --tasks tasks.yaml --max-weight-bytes 40GB --candidates w4a16-gptq,w8a16,bf16 -o out/
    """
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    from qtk import api
    from qtk.progress import Reporter

    if max_weight_bytes is not None:
        try:
            max_weight_bytes = _size(max_weight_bytes)
        except click.BadParameter:
            raise UsageError(f"--max-weight-bytes {max_weight_bytes!r} is not a size", "e.g. --max-weight-bytes 40GB") from None
    from qtk.tune.job import TuneOptions

    names = [c.strip() for c in candidates.split(",")]
    with Reporter("qtk tune", unit="round") as rep:
        opts = TuneOptions(candidates=names, max_weight_bytes=max_weight_bytes, tasks=list(tasks) or None,
                           threads=threads, **options)
        res = api.tune(model, tasks_file, out, opts, progress=rep.stage)
    for n in res.notes:
        click.echo(f"note: {n}", err=True)
    for t in res.trials:
        click.echo(f"round {t.round}: {t.bytes / 1e6:.3f} MB, predicted damage {t.damage:.4g}: "
                   + ("pass" if t.passed else "fail (" + "; ".join(t.failures) + ")"))
    if not res.passed:
        raise CheckFailed("no point tried passes the gate" + (f" within {res.report['budget']['what']}"),
                          f"see {out}/tune.md; raise the budget, add a more precise candidate or more --max-rounds")
    f = res.report["final"]
    for t, path in res.outputs.items():
        click.echo(f"wrote {t}: {path}")
    click.echo(f"recipe: {res.recipe_path} ({f['bytes'] / 1e6:.3f} MB, KV cache {f['kv_cache']}); report: {out}/tune.md")


def _next_steps(outputs: dict, model: str) -> None:
    """What to run next: the check, the gate and the serving flags, which each output's README spells out."""
    import shlex

    click.echo("next:")
    for t, path in outputs.items():
        click.echo(f"  qtk inspect {shlex.quote(str(path))}")
    first = next(iter(outputs.values()))
    click.echo(f"  qtk eval {shlex.quote(str(first))} --baseline {shlex.quote(str(model))} --tasks TASKS.yaml")
    readmes = ", ".join(shlex.quote(str(p / 'README.md')) for p in outputs.values())
    click.echo(f"  serving commands and flags: {readmes}")


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--modules", "show_modules", is_flag=True, help="List every quantized module.")
@click.option("--source", type=click.Path(file_okay=False, path_type=str), default=None,
              help="The model it was converted from, to compare every written Linear with [default: the path qtk.json records].")
@click.option("--engine", type=click.Choice(["vllm"]), default=None,
              help="Also run the checkpoint in the installed vLLM (CPU or GPU build) on a few token windows and compare with qtk's simulation (docs/engine.md).")
def inspect(checkpoint, as_json, show_modules, source, engine):
    """Summarise a written checkpoint and check it from its bytes. Exit 1 when a check fails."""
    import json

    from qtk import api

    if engine is not None:
        from qtk.eval.engines import vllm_available

        ok, why = vllm_available()
        if not ok:
            raise UsageError(f"--engine vllm: {why}", "install vLLM (make engine-env) or leave --engine out")
    rep = api.inspect(checkpoint, source=source, engine=engine)
    if as_json:
        click.echo(json.dumps({"path": str(rep.path), "summary": rep.summary, "ok": rep.ok,
                               "checks": [c.__dict__ for c in rep.checks], "modules": rep.modules}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        con = Console()
        t = Table(title=f"{rep.path}", show_header=False)
        for k, v in rep.summary.items():
            t.add_row(k, f"{v / 1e6:.2f} MB" if k == "size_bytes" else str(v))
        con.print(t)
        if show_modules:
            mt = Table("module", "quantized as")
            for m, d in rep.modules.items():
                mt.add_row(m, d)
            con.print(mt)
        for c in rep.checks:
            from rich.markup import escape

            tag = "[yellow]SKIP[/]" if c.skipped else ("[green]PASS[/]" if c.ok else "[red]FAIL[/]")
            con.print(f"{tag} {escape(c.name)}" + (f"  ({escape(c.detail)})" if c.detail else ""), highlight=False)
    if not rep.ok and not as_json:  # the report above has every check; one line on stderr says what failed first
        bad = [c for c in rep.checks if not c.ok]
        click.echo(printable(f"error: {bad[0].name}: {bad[0].detail} — {len(bad)} of {len(rep.checks)} checks failed "
                             f"(report above); the checkpoint is not what its config and qtk.json say"), err=True)
        sys.exit(1)
    if not rep.ok:
        sys.exit(1)


@main.group()
def recipes():
    """List and show the built-in recipes."""


@recipes.command("list")
def recipes_list():
    """One line per built-in recipe."""
    from rich.console import Console
    from rich.table import Table

    from qtk.recipe import builtin_recipes, load_recipe

    t = Table("recipe", "scheme", "algorithm", "calibration")
    for name in builtin_recipes():
        r = load_recipe(name)
        c = r.calibration
        t.add_row(name, r.summary(), " → ".join(r.step_names), f"{c.num_samples} × {c.seq_len}" if r.needs_calibration else "none")
    Console().print(t)


def _calibration_line(r) -> str:
    """The calibration a recipe uses, with the values its YAML leaves to the defaults."""
    if not r.needs_calibration:
        return "calibration: none (no step looks at data; --calib and its options are not used)"
    c = r.calibration
    return (f"calibration: {c.num_samples} samples × {c.seq_len} tokens from {c.dataset!r} (field {c.text_field!r}, "
            f"seed {c.seed}); --calib, --num-samples, --seq-len, --seed and --text-field override it")


@recipes.command("show")
@click.argument("name")
def recipes_show(name):
    """Print a recipe's YAML (NAME is a built-in name or a file)."""
    from qtk.recipe import load_recipe

    r = load_recipe(name)
    click.echo(r.text.rstrip())
    click.echo(f"# {r.summary()}; algorithm: {' -> '.join(r.step_names)}; hash {r.hash}")
    click.echo(f"# {_calibration_line(r)}")


if __name__ == "__main__":
    main()
