"""`qtk plan`: memory, throughput and cost before you convert, and the recipe to pick."""

from __future__ import annotations

import click

from qtk.plan.hardware import DEFAULT_GPU, gpu_names


@click.command("plan")
@click.argument("model", type=click.Path(exists=True, dir_okay=True, file_okay=True))
@click.option("--recipe", "recipe_names", multiple=True,
              help="Built-in recipe name or YAML path; 'none' plans the unquantized model (default). "
                   "With --recommend (repeatable): your recipes, considered alongside the shipped ones.")
@click.option("--recommend", is_flag=True,
              help="Pick the recipe (every shipped weight scheme with and without an 8-bit KV cache) that fits with "
                   "headroom, and say why.")
@click.option("--gpu", default=DEFAULT_GPU, show_default=True,
              help=f"One of: {', '.join(gpu_names())} (common aliases such as h100-80g work too).")
@click.option("--gpu-mem", type=float, default=None, help="Override GPU memory, in GB.")
@click.option("--gpu-bw", type=float, default=None, help="Override memory bandwidth, in TB/s.")
@click.option("--price", type=float, default=None, help="Override the hourly price per GPU, in USD.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel GPUs.")
@click.option("--tp-efficiency", type=float, default=None,
              help="Throughput kept per doubling of GPUs (default 0.9 NVLink, 0.75 PCIe).")
@click.option("--context", type=int, default=4096, show_default=True, help="Tokens per request (prompt + output).")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Requests served at once.")
@click.option("--gpu-memory-utilization", "utilization", type=float, default=0.9, show_default=True,
              help="Fraction of GPU memory the engine may use (vLLM's watermark).")
@click.option("--overhead-gb", type=float, default=1.5, show_default=True,
              help="Fixed engine overhead per GPU (CUDA context, workspaces, CUDA graphs).")
@click.option("--dtype", default=None, help="Serving dtype of dense tensors (default: the config's; fp32 serves as bf16).")
@click.option("--headroom", type=float, default=0.10, show_default=True,
              help="Minimum free fraction of the budget for --recommend.")
@click.option("--workload", type=click.Choice(["general", "chat", "code", "math"]), default="general",
              show_default=True, help="INT4 is flagged as risky for code and math.")
@click.option("--api-price", type=float, default=None, help="API price per 1M output tokens, for the break-even volume.")
@click.option("--convert-on", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Where the conversion's time and memory are estimated: the CPU, or --gpu (qtk convert --device cuda).")
@click.option("--convert-processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes of the conversion (torchrun --nproc-per-node).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def plan(model, recipe_names, as_json, **options):
    """Plan serving MODEL (a model directory or its config.json) from its config alone.

    Exits 1 when the plan does not fit (or, with --recommend, when no recipe fits).
    """
    from rich.console import Console

    from qtk import api
    from qtk.plan.planner import NoRecipeFits, PlanOptions
    from qtk.plan.render import render_decision, render_plan, to_json

    console = Console(highlight=False)
    try:
        p = api.plan(model, list(recipe_names), PlanOptions(**options))
    except NoRecipeFits as e:
        if as_json:
            click.echo(to_json(decision=e.decision))
        else:
            render_decision(console, e.decision)  # the table of reasons; the verdict is the error line
        raise
    if as_json:
        click.echo(to_json(p))
    else:
        render_plan(console, p)
    p.check_fit()
