"""`qtk plan`: memory, throughput and cost before you convert, and the recipe to pick."""

from __future__ import annotations

import click

from qtk.errors import CheckFailed, UsageError
from qtk.plan.hardware import DEFAULT_GPU, GB, gpu_names


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
def plan(model, recipe_names, recommend, gpu, gpu_mem, gpu_bw, price, tp, tp_efficiency, context, concurrency,
         utilization, overhead_gb, dtype, headroom, workload, api_price, convert_on, convert_processes, as_json):
    """Plan serving MODEL (a model directory or its config.json) from its config alone.

    Exits 1 when the plan does not fit (or, with --recommend, when no recipe fits).
    """
    from rich.console import Console

    from qtk.plan.decide import recommend as decide
    from qtk.plan.hardware import get_gpu
    from qtk.plan.memory import ModelShape, read_config
    from qtk.plan.planner import Deployment, make_plan
    from qtk.plan.render import render_decision, render_plan, to_json
    from qtk.recipe import load_recipe

    names = [n for n in recipe_names if n != "none"]
    if not recommend and len(recipe_names) > 1:
        raise UsageError(f"--recipe given {len(recipe_names)} times", "plan one recipe at a time, or add --recommend to choose among them")
    if overhead_gb < 0:
        raise UsageError(f"--overhead-gb must be >= 0, got {overhead_gb}", "e.g. --overhead-gb 1.5")
    if not 0 <= headroom < 1:
        raise UsageError(f"--headroom must be in [0, 1), got {headroom}", "e.g. --headroom 0.1")
    if api_price is not None and api_price <= 0:
        raise UsageError(f"--api-price must be positive, got {api_price}", "give USD per 1M output tokens, e.g. --api-price 0.6")
    shape = ModelShape.from_config(read_config(model))
    dep = Deployment(gpu=get_gpu(gpu, mem_gb=gpu_mem, bandwidth_tb_s=gpu_bw, price=price), context=context,
                     concurrency=concurrency, tp=tp, utilization=utilization, overhead=int(overhead_gb * GB),
                     tp_efficiency_per_doubling=tp_efficiency, dtype=dtype)
    console = Console(highlight=False)

    if recommend:
        extra = {}
        for n in names:
            r = load_recipe(n)
            extra[r.name if r.name not in extra and r.name not in shipped_names() else n] = r
        decision = decide(shape, dep, min_headroom=headroom, workload=workload, extra=extra)
        if decision.chosen is None:
            if as_json:
                click.echo(to_json(decision=decision))
            else:
                render_decision(console, decision)  # the table of reasons; the verdict is the error line below
            raise CheckFailed(decision.reason, "use more GPUs (--tp), a shorter --context or a lower --concurrency")
        p = make_plan(shape, decision.recipe, dep, recipe_name=decision.chosen, api_usd_per_1m=api_price, decision=decision,
                      convert_on=convert_on, convert_processes=convert_processes)
    else:
        recipe = load_recipe(names[0]) if names else None
        p = make_plan(shape, recipe, dep, api_usd_per_1m=api_price, convert_on=convert_on,
                      convert_processes=convert_processes)

    if as_json:
        click.echo(to_json(p))
    else:
        render_plan(console, p)
    m = p.memory
    if not m.fits:
        fix = (f"serve at most {m.max_concurrency} concurrent (--concurrency {m.max_concurrency})" if m.max_concurrency
               else "use more GPUs (--tp), a shorter --context, or a smaller recipe (try --recommend)")
        raise CheckFailed(f"{p.recipe_name} does not fit on {dep.describe()}: needs {m.needed / GB:.1f} GB per GPU "
                          f"of {m.budget / GB:.1f} GB", fix)


def shipped_names() -> set[str]:
    from qtk.recipe import builtin_recipes

    return set(builtin_recipes())
