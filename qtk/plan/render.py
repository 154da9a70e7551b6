"""Rendering of plans and recommendations: rich tables for people, JSON for pipelines."""

from __future__ import annotations

import json

from rich.markup import escape

from qtk.plan.hardware import GB


def _gb(n: float) -> str:
    """Decimal units, switching to MB below 0.1 GB so small parts (scales) do not print as 0.00 GB."""
    if abs(n) >= GB / 10:
        return f"{n / GB:,.2f} GB"
    if abs(n) >= 10**5:
        return f"{n / 1e6:,.2f} MB"
    return f"{n:,.0f} B"


def _num(x: float) -> str:
    if x >= 1e12:
        return f"{x / 1e12:.2f}T"
    if x >= 1e9:
        return f"{x / 1e9:.2f}B"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    return f"{x:,.0f}"


def to_json(plan=None, decision=None) -> str:
    """The plan (and/or the decision when nothing was chosen) as indented JSON."""
    d = plan.as_dict() if plan is not None else {"recommendation": decision.as_dict()}
    return json.dumps(d, indent=2, default=str)


def _table(title: str, rows, columns=("", "")):
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_header=any(columns), header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i else "left", overflow="fold")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


def decision_table(decision):
    from rich.table import Table

    t = Table(title="Recommendation", title_justify="left", header_style="bold")
    for c, j in (("recipe", "left"), ("weights", "right"), ("needed/GPU", "right"), ("headroom", "right"), ("", "left")):
        t.add_column(c, justify=j, overflow="fold")
    order = {"chosen": 0, "passed": 1, "tight": 2, "no-fit": 3, "excluded": 4, "error": 5}
    for c in sorted(decision.candidates, key=lambda c: (order.get(c.status, 9), c.name)):
        mark = "[bold green]✔ " if c.status == "chosen" else "  "
        if c.memory is None:
            t.add_row(mark + escape(c.name), "-", "-", "-", escape(c.reason))
        else:
            t.add_row(mark + escape(c.name), _gb(c.weights.total), _gb(c.memory.needed),
                      f"{100 * c.memory.headroom_fraction:.0f}%", escape(c.reason))
    return t


def render_decision(console, decision) -> None:
    """The table of candidates and, when one is chosen, why (when none is, the caller's error line says so: once)."""
    console.print(decision_table(decision))
    if decision.baseline is not None:
        b = decision.baseline
        console.print(f"unquantized: {'fits' if b.fits else 'does not fit'} "
                      f"({_gb(b.needed)} per GPU of {_gb(b.budget)})")
    if decision.chosen is None:
        return
    console.print("[bold green]→ " + escape(decision.reason), soft_wrap=True)
    if decision.recipe_yaml:
        from qtk.plan.decide import kv_words

        c = decision.candidate
        console.print(f"{escape(decision.chosen)} is {escape(c.derived_from)} with {kv_words(c.recipe)}, which no shipped "
                      "recipe spells out: save it as a recipe file for qtk convert --recipe FILE", soft_wrap=True)
        console.print(decision.recipe_yaml.rstrip(), markup=False, highlight=False, soft_wrap=True)
    for w in decision.warnings:
        console.print(f"[yellow]! {escape(w)}", soft_wrap=True)


def render_plan(console, plan) -> None:
    s, d, w, m, tp_, c, conv = (plan.shape, plan.deployment, plan.weights, plan.memory, plan.throughput, plan.cost,
                                plan.conversion)
    kind = f"{s.model_type}, {_num(w.params)} params" + (f", {s.experts} experts (top-{s.top_k})" if s.is_moe else "")
    console.print(f"[bold]qtk plan[/] {kind} · recipe [bold]{escape(plan.recipe_name)}[/] · {d.describe()}", soft_wrap=True)
    if plan.recommendation is not None:
        render_decision(console, plan.recommendation)

    rows = [("quantized Linears", _gb(w.quantized)), ("scales, zero points", _gb(w.scales)),
            (f"dense ({w.dtype}: embeddings, norms, biases, ignored)", _gb(w.dense))]
    if w.kv_scales:
        rows.append(("KV-cache scales", _gb(w.kv_scales)))
    if w.vision:
        rows.append(("vision tower (estimate)", _gb(w.vision)))
    rows.append(("[bold]checkpoint total", f"[bold]{_gb(w.total)}"))
    console.print(_table("Weights", rows))

    kvd = "8-bit" if m.kv_bytes == 1 else w.dtype
    verdict = "[bold green]fits" if m.fits else "[bold red]does not fit"
    ctx = (("≥ " if m.max_context_limited_by == "search" else "") + f"{m.max_context:,} tokens"
           + (" (model limit)" if m.max_context_limited_by == "model" else ""))
    rows = [
        ("weights", _gb(m.weights)),
        (f"KV cache per token ({kvd})", f"{m.kv_per_token_per_gpu:,} B"),
        (f"KV cache per request ({d.context:,} tokens)", _gb(m.kv_per_request_per_gpu)),
        (f"KV cache × {d.concurrency} requests", _gb(m.kv_total_per_gpu)),
        ("activations / workspace", _gb(m.activations)),
        ("engine overhead", _gb(m.overhead)),
        ("[bold]needed", f"[bold]{_gb(m.needed)}"),
        (f"budget ({d.utilization:g} × {_gb(d.gpu.mem_bytes)})", _gb(m.budget)),
        ("headroom", f"{_gb(m.headroom)} ({100 * m.headroom_fraction:.0f}%)"),
        ("verdict", verdict),
        (f"max concurrency at {d.context:,} tokens", f"{m.max_concurrency:,}"),
        (f"max context at {d.concurrency} concurrent", ctx),
    ]
    console.print(_table(f"Memory per GPU ({d.tp}× {d.gpu.label})", rows))

    rows = [
        ("decode (all sequences)", f"{tp_.decode_tokens_per_s:,.0f} tok/s ({tp_.bound}-bound)"),
        ("decode efficiency (of peak " + ("bandwidth" if tp_.bound == "memory" else "compute") + ")",
         f"{100 * tp_.decode_efficiency:.0f}% = " + (f"{100 * tp_.bandwidth_utilization:.0f}% MBU" if tp_.bound == "memory"
                                                    else f"{100 * tp_.compute_utilization:.0f}% MFU")
         + f" × {tp_.tp_efficiency:.2f} tensor-parallel"),
        ("decode per sequence", f"{tp_.per_sequence_tokens_per_s:,.1f} tok/s"),
        ("prefill", f"{tp_.prefill_tokens_per_s:,.0f} tok/s"),
        (f"time to first token ({d.context:,}-token prompt)", f"{tp_.ttft_s:.2f} s"),
        (f"price ({d.tp}× ${d.gpu.price_per_hour:.2f}/h)", f"${c.price_per_hour:.2f}/h, ${c.monthly_cost:,.0f}/month"),
        ("cost per 1K output tokens", f"${c.usd_per_1k_output:.5f}"),
        ("cost per 1K input tokens", f"${c.usd_per_1k_input:.5f}"),
        ("monthly capacity (output)", f"{_num(c.monthly_capacity_tokens)} tokens"),
    ]
    if c.api_usd_per_1m is not None:
        be = (f"{_num(c.breakeven_tokens_per_month)} tokens/month" if c.breakeven_tokens_per_month is not None
              else "never: the API is cheaper per token even at full load")
        rows.append((f"beats ${c.api_usd_per_1m:g}/1M API above", be))
    console.print(_table("Throughput and cost (roofline, every sequence at full context)", rows))

    rows = [("one decoder layer (fp32)", _gb(conv.layer_fp32)), ("embeddings", _gb(conv.embeddings))]
    if conv.calibration:
        rows.append(("calibration activations", _gb(conv.calibration)))
    rows += [(label, _gb(b)) for label, b in conv.steps.values() if b]  # what each step holds beside a layer
    rows.append(("[bold]peak", f"[bold]{_gb(conv.total)}"))
    est = plan.convert_estimate
    if est is not None:
        where = "CPU" if est.device == "cpu" else f"{est.device} GPU"
        procs = f", {est.processes} processes" if est.processes > 1 else ""
        rows.append((f"on the {where}{procs}: host peak per process", _gb(est.host_peak)))
        if est.device_peak:
            rows.append(("GPU memory peak per GPU", _gb(est.device_peak)))
        rows.append(("time (estimate, qtk/plan/convert_cost.py)", _duration(est.seconds)))
    console.print(_table("qtk convert needs", rows))
    for n in (est.notes if est is not None else ()):
        console.print(f"  {escape(n)}", soft_wrap=True)

    sv = plan.serving
    console.print("[bold]Serving")
    for line in (sv["vllm"], sv["trtllm_build"], sv["trtllm_serve"]):
        console.print("  " + line, soft_wrap=True, markup=False, highlight=False)
    console.print("  " + sv["vllm_cpu"], soft_wrap=True, markup=False, highlight=False)
    for n in sv["notes"] + plan.notes:
        console.print(f"[yellow]! {escape(n)}", soft_wrap=True)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
