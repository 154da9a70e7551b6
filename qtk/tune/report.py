"""The report of `qtk tune` as Markdown and as a PNG of the frontier (predicted damage against bytes, the uniform
recipes marked, each gated point with its verdict). The JSON form is the dict qtk.tune.job builds."""

from __future__ import annotations

import io
from pathlib import Path

from qtk.io import outdir


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def markdown(r: dict) -> str:
    lines = [f"# qtk tune: {r['model']}", ""]
    b = r["budget"]
    lines += [f"Budget: {_mb(b['limit_bytes'])} ({b['what']}). Candidates: {', '.join(r['candidates'])}. "
              f"Targets: {', '.join(r['targets'])}. Gate: {r['tasks']}.", ""]
    f = r.get("final")
    if f:
        counts: dict[str, int] = {}
        for c in f["units"].values():
            counts[c] = counts.get(c, 0) + 1
        lines += [f"**Result: passes the gate** at {_mb(f['bytes'])}, predicted damage {f['damage']:.4g}, "
                  f"KV cache {f['kv_cache']}; units: " + ", ".join(f"{n} {c}" for c, n in counts.items()) + ".", ""]
    else:
        lines += ["**Result: no point tried passes the gate.**", ""]
    lines += ["## Gate rounds", "", "| round | bytes | predicted damage | gate |", "|---|---|---|---|"]
    for t in r["trials"]:
        lines.append(f"| {t['round']} | {_mb(t['bytes'])} | {t['damage']:.4g} | "
                     + ("pass" if t["passed"] else "fail: " + "; ".join(t["failures"]).replace("|", "/")) + " |")
    lines += ["", "## Uniform recipes (predicted)", "", "| recipe | bytes | predicted damage | within budget |", "|---|---|---|---|"]
    for u in r["uniform"]:
        lines.append(f"| {u['recipe']} | {_mb(u['bytes'])} | {u['damage']:.4g} | {'yes' if u['bytes'] <= b['limit_bytes'] else 'no'} |")
    if f:
        lines += ["", "## Assignment", "", "| unit | scheme |", "|---|---|"]
        lines += [f"| layer {k} | {c} |" for k, c in f["units"].items()]
    plan = r.get("plan")
    if plan:
        m = plan.get("memory", {})
        lines += ["", "## Plan of the final checkpoint", "",
                  f"fits: {m.get('fits')}, max concurrency {m.get('max_concurrency')}, "
                  f"headroom {m.get('headroom_fraction')}; cost: {plan.get('cost')}"]
    lines += ["", f"Damage estimate: {r['estimate']}.", ""]
    if r["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in r["notes"]] + [""]
    t = r.get("timings", {})
    if t:
        lines.append("Timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()))
    return "\n".join(lines) + "\n"


def write_markdown(r: dict, out, name: str = "tune.md") -> None:
    """OUT/name, written without following a link (qtk.io.outdir.write_file)."""
    outdir.write_file(out, name, markdown(r).encode())


def write_plot(r: dict, out, name: str = "frontier.png") -> bool:
    """The frontier as a PNG at OUT/name (matplotlib, as `qtk eval --plot` draws; written as write_markdown writes);
    False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    fr = r["frontier"]
    ax.step([p["bytes"] / 1e6 for p in fr], [p["damage"] for p in fr], where="post", color="0.4", lw=1,
            label=f"frontier ({len(fr)} points)")
    for u in r["uniform"]:
        ax.scatter(u["bytes"] / 1e6, max(u["damage"], 1e-12), marker="s", s=40, color="tab:blue", zorder=3)
        ax.annotate(u["recipe"], (u["bytes"] / 1e6, max(u["damage"], 1e-12)), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    for t in r["trials"]:
        ax.scatter(t["bytes"] / 1e6, t["damage"], marker="o" if t["passed"] else "x", s=60,
                   color="tab:green" if t["passed"] else "tab:red", zorder=4)
        ax.annotate(f"r{t['round']}", (t["bytes"] / 1e6, t["damage"]), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.axvline(r["budget"]["limit_bytes"] / 1e6, color="tab:orange", ls="--", lw=1, label="budget")
    ax.scatter([], [], marker="o", color="tab:green", label="gated: pass")
    ax.scatter([], [], marker="x", color="tab:red", label="gated: fail")
    ax.scatter([], [], marker="s", color="tab:blue", label="uniform recipe")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("MB (checkpoint" + (" + KV cache, over the GPUs)" if r["budget"]["kv_options"] else ")"))
    ax.set_ylabel("predicted damage (Σ mean ‖ΔW x‖²)")
    ax.set_title(f"qtk tune frontier: {Path(r['model']).name}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    outdir.write_file(out, name, buf.getvalue())
    return True
