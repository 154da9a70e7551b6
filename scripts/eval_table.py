"""Regenerate docs/eval.md's per-recipe table: every built-in recipe on examples/tiny-llama, gated with
examples/tasks.yaml (the same as `qtk convert ... && qtk eval ...` for each recipe).

    python scripts/eval_table.py                 # rewrites the table in docs/eval.md, writes docs/eval-table.json
    python scripts/eval_table.py --recipes fp8 int8-kv8           # re-measures these; the other rows are kept
    python scripts/eval_table.py --recipes fp8 int8-kv8 --no-write

The baseline is evaluated once and taken from the cache for every later recipe. The table is rendered from
docs/eval-table.json, so a run of some recipes replaces their rows and keeps the others (in recipe-name order).

Each recipe is written for vLLM when vLLM runs it, else for the first target whose writer accepts it (the order
`qtk convert` names them in a refusal: static W4A8-FP8 goes to hf-modelopt), and that output is gated; the row's
"target" field says which. A recipe no target accepts for the model (FP8 blocks: its 64-row k/v projections do not
tile) is skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny-llama"
TASKS = ROOT / "examples" / "tasks.yaml"
DOC = ROOT / "docs" / "eval.md"
START, END = "<!-- eval-table:start -->", "<!-- eval-table:end -->"


def _fmt(v: float, ppl: bool) -> str:
    return f"{v:.4f}" if ppl else f"{v:.1f}"  # accuracies are already in %


def _cell(t: dict, ppl: bool) -> str:
    d = t["candidate"] - t["baseline"]
    return f"{_fmt(t['candidate'], ppl)} ({'+' if d >= 0 else '-'}{_fmt(abs(d), ppl)})"


def render(records: dict) -> str:
    """The markdown table of every record (recipe -> what main stores), baseline first, recipes by name."""
    import yaml

    ppl = {t["name"] for t in yaml.safe_load(TASKS.read_text())["tasks"] if t["type"] == "perplexity"}
    first = next(iter(records.values()))["tasks"]
    names = list(first)
    lines = ["| recipe | " + " | ".join(names) + " | KL | top-1 | gate |",
             "|---|" + "---:|" * len(names) + "---:|---:|---|",
             "| baseline | " + " | ".join(_fmt(first[n]["baseline"], n in ppl) for n in names) + " | | | |"]
    for r in sorted(records):
        rec = records[r]
        tasks, a = rec["tasks"], rec["agreement"]
        failed = [n for n in names if tasks[n]["status"] == "fail"]
        if not rec["passed"] and not failed:  # the gate failed on the agreement limits alone
            failed = ["agreement"]
        verdict = "pass" if rec["passed"] else f"**fail: {', '.join(failed)}**"
        lines.append(f"| {r} | " + " | ".join(_cell(tasks[n], n in ppl) for n in names)
                     + f" | {a['kl']:.5f} | {a['top1']:.2f}% | {verdict} |")
    return "\n".join(lines)


def gate_target(recipe) -> str | None:
    """vllm when its writer accepts the recipe for MODEL, else the first target that does (qtk.export.accepting_targets:
    vllm first, then by name), or None."""
    from qtk.export import ExportOptions, accepting_targets
    from qtk.model.source import ModelSource
    from qtk.recipe import load_recipe

    ok = accepting_targets(ModelSource(MODEL), load_recipe(recipe), ExportOptions())
    return ok[0] if ok else None


def main(argv: list[str] | None = None) -> int:
    from qtk import api
    from qtk.errors import UsageError
    from qtk.eval.api import run_gate
    from qtk.recipe import builtin_recipes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="*", default=None, help="default: every built-in recipe")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    recipes = args.recipes or sorted(builtin_recipes())
    stored = ROOT / "docs" / "eval-table.json"
    records = json.loads(stored.read_text()) if stored.is_file() else {}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        for r in recipes:
            t0 = time.perf_counter()
            target = gate_target(r)
            try:
                res = api.convert(MODEL, r, td / r, targets=(target or "vllm",))
            except UsageError as e:  # e.g. FP8 blocks, which this model's 64-row k/v projections do not tile
                print(f"skipped {r}: {e}", file=sys.stderr)
                continue
            conv_s = time.perf_counter() - t0
            g = run_gate(res.outputs[target], MODEL, TASKS, cache_dir=td / "cache", threads=args.threads)
            a = g.agreement
            records[r] = {"passed": g.passed, "convert_s": round(conv_s, 2), "target": target,
                          "tasks": {t.name: {"baseline": t.baseline, "candidate": t.candidate, "diff": t.candidate - t.baseline,
                                             "drop_ci": list(t.drop_ci), "significant": t.significant, "status": t.status}
                                    for t in g.tasks},
                          "agreement": {"kl": a.kl, "top1": a.top1, "ppl_ratio": a.ppl_ratio}}
            print(render({r: records[r]}).splitlines()[-1], file=sys.stderr)
    table = "\n".join([START, "", render(records), "",
                       "Generated by `python scripts/eval_table.py` (accuracies in %, prose perplexity per character; "
                       "Δ to the baseline in brackets).", "", END])
    print(table)
    if not args.no_write:
        text = DOC.read_text()
        if START not in text:
            raise SystemExit(f"{DOC} has no {START} marker")
        DOC.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S))
        stored.write_text(json.dumps(dict(sorted(records.items())), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
