"""Gate reports: JSON for machines, JUnit XML for CI (one test case per task), Markdown for a pull request, and a
per-layer quantization-error plot (PNG) from the conversion statistics in the checkpoint's qtk.json."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from qtk.errors import UsageError

UNITS = {"acc": "%", "acc_norm": "%", "exact_match": "%", "perplexity": ""}


def summary(result) -> str:
    """The verdict of a gate as the commands print it: one line per task (and agreement), the held-out check, the
    notes, and PASSED or FAILED."""
    rows = []
    for t in result.tasks:
        d, u = _digits(t.metric), UNITS.get(t.metric, "")
        rows.append(f"  {t.status.upper():6} {t.name:<18} {t.metric:<12} base {_f(t.baseline, d)}{u:<2} cand {_f(t.candidate, d)}{u:<2} "
                    f"Δ {t.diff:+.{d}f} [{_f(t.ci[0], d)}, {_f(t.ci[1], d)}]" + ("  (baseline cached)" if t.baseline_cached else ""))
    a = result.agreement
    if a is not None:
        rows.append(f"  {a.status.upper():6} agreement          KL {_f(a.kl, 5)}  top-1 {_f(a.top1)}%  ppl ratio {_f(a.ppl_ratio, 4)}")
    rows.append(f"  held-out: {result.contamination.status} — {result.contamination.message}")
    for n in result.notes:
        rows.append(f"  note: {n}")
    rows.append(f"gate {'PASSED' if result.passed else 'FAILED'} ({result.mode} mode) in {result.timings.get('total', 0):.1f}s")
    return "\n".join(rows)


def _out(path) -> Path:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write report {p} ({e.strerror})", "choose a writable path") from None
    return p


def _write(path, data: bytes, root=None) -> None:
    """A report at a path the user named (its folder made if absent), or, with `root`, at a name qtk gives it inside
    the output directory root (convert --gate, tune): written there without following a link
    (qtk.io.outdir.write_file)."""
    if root is None:
        _out(path).write_bytes(data)
        return
    from qtk.io import outdir

    outdir.write_file(root, Path(path).relative_to(root), data)


def _clean(x):
    """JSON has no NaN/Infinity: write null instead."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(result, path, root=None) -> None:
    _write(path, (json.dumps(_clean(result.to_dict()), indent=2) + "\n").encode(), root)


def _f(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def _digits(metric: str) -> int:
    return 3 if metric == "perplexity" else 2


def _limit_text(limit: dict) -> str:
    parts = []
    if "max_drop" in limit:
        parts.append(f"drop ≤ {limit['max_drop']:g}")
    if "min_recovery" in limit:
        parts.append(f"recovery ≥ {limit['min_recovery']:g}")
    return ", ".join(parts) or "—"


def _agreement_limit_text(limits: dict) -> str:
    parts = []
    if "max_kl" in limits:
        parts.append(f"KL ≤ {limits['max_kl']:g}")
    if "min_top1" in limits:
        parts.append(f"top-1 agreement ≥ {limits['min_top1']:g}%")
    if "max_ppl_ratio" in limits:
        parts.append(f"perplexity ratio ≤ {limits['max_ppl_ratio']:g}")
    return ", ".join(parts) or "none"


_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _x(s: str) -> str:
    return _XML_BAD.sub("?", s)


def write_junit(result, path, root=None) -> None:
    """One <testcase> per task (classname qtk.eval.<type>), plus agreement and contamination cases; a failed limit
    is a <failure>, a task without a limit passes and says so in system-out."""
    cases = []
    for t in result.tasks:
        d = _digits(t.metric)
        msg = (f"{t.metric}: baseline {_f(t.baseline, d)}, candidate {_f(t.candidate, d)}, diff {_f(t.diff, d)} "
               f"(95% CI [{_f(t.ci[0], d)}, {_f(t.ci[1], d)}]), recovery {_f(t.recovery, 4)}, n={t.n}, "
               f"limit {_limit_text(t.limit)}")
        cases.append((f"qtk.eval.{t.type}", t.name, t.status == "fail", t.reason, msg + (f"; {t.reason}" if t.reason else ""),
                      t.extra.get("seconds", {}).get("candidate", 0.0)))
    a = result.agreement
    if a is not None:
        msg = (f"tokens {a.tokens}, KL {_f(a.kl, 5)}, top-1 agreement {_f(a.top1)}%, perplexity ratio {_f(a.ppl_ratio, 4)}; "
               f"limits {_agreement_limit_text(a.limits)}")
        cases.append(("qtk.eval.agreement", "agreement", a.status == "fail", a.reason, msg, 0.0))
    c = result.contamination
    c_failed = any(f.startswith("contamination") for f in result.failures)
    cases.append(("qtk.eval.contamination", "heldout", c_failed, c.message, f"{c.status}: {c.message}", 0.0))

    suite = ET.Element("testsuite", name="qtk-eval", tests=str(len(cases)), failures=str(sum(f for _, _, f, _, _, _ in cases)),
                       errors="0", skipped="0", time=f"{result.timings.get('total', 0.0):.3f}")
    props = ET.SubElement(suite, "properties")
    for k, v in (("candidate", result.candidate["path"]), ("baseline", result.baseline["path"]),
                 ("recipe", result.candidate.get("recipe") or ""), ("mode", result.mode), ("engine", result.engine.get("engine"))):
        ET.SubElement(props, "property", name=k, value=_x(str(v)))
    for classname, name, failed, reason, text, secs in cases:
        tc = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{secs:.3f}")
        if failed:
            f = ET.SubElement(tc, "failure", message=_x(reason or "failed"), type="GateFailure")
            f.text = _x(text)
        ET.SubElement(tc, "system-out").text = _x(text)
    suites = ET.Element("testsuites", name="qtk eval", tests=suite.get("tests"), failures=suite.get("failures"), errors="0",
                        time=suite.get("time"))
    suites.append(suite)
    ET.indent(suites)
    _write(path, ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n", root)


def markdown(result) -> str:
    icon = {"pass": "✅ pass", "fail": "❌ fail", "report": "— report"}
    c = result.candidate
    lines = [
        f"### qtk accuracy gate: {'✅ PASSED' if result.passed else '❌ FAILED'}",
        "",
        f"Candidate `{c['path']}` ({c.get('recipe') or c['format']}: weights {c['weights']}, activations "
        f"{c.get('activations') or '16-bit'}, KV {c.get('kv_cache') or '16-bit'}) vs baseline `{result.baseline['path']}`; "
        f"engine {result.engine.get('engine')}, mode {result.mode}.",
        "",
        "| task | metric | n | baseline | candidate | Δ | 95% CI of Δ | limit | verdict |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for t in result.tasks:
        d, u = _digits(t.metric), UNITS.get(t.metric, "")
        cached = " (cached)" if t.baseline_cached else ""
        lines.append(f"| {t.name} | {t.metric}{' ↓' if not t.higher_is_better else ''} | {t.n} | {_f(t.baseline, d)}{u}{cached} | "
                     f"{_f(t.candidate, d)}{u} | {t.diff:+.{d}f} | [{_f(t.ci[0], d)}, {_f(t.ci[1], d)}] | "
                     f"{_limit_text(t.limit)} | {icon[t.status]} |")
        for o in t.other:
            od = _digits(o.metric)
            lines.append(f"|  | {o.metric} | | {_f(o.baseline, od)}{UNITS.get(o.metric, '')} | {_f(o.candidate, od)}{UNITS.get(o.metric, '')} | "
                         f"{o.diff:+.{od}f} | [{_f(o.ci[0], od)}, {_f(o.ci[1], od)}] | | |")
    a = result.agreement
    if a is not None:
        lines += ["", "| agreement (perplexity texts) | value | 95% CI | limit |", "|---|---:|---|---|"]
        kl_ci = f"[{_f(a.kl_ci[0], 5)}, {_f(a.kl_ci[1], 5)}]" if a.kl_ci else "n/a"
        lines.append(f"| mean token KL(baseline ‖ candidate) | {_f(a.kl, 5)} | {kl_ci} | {a.limits.get('max_kl', '—')} |")
        lines.append(f"| top-1 agreement | {_f(a.top1)}% | [{_f(a.top1_ci[0])}, {_f(a.top1_ci[1])}] | {a.limits.get('min_top1', '—')} |")
        lines.append(f"| perplexity ratio | {_f(a.ppl_ratio, 4)} | [{_f(a.ppl_ratio_ci[0], 4)}, {_f(a.ppl_ratio_ci[1], 4)}] | "
                     f"{a.limits.get('max_ppl_ratio', '—')} |")
        lines.append(f"| tokens | {a.tokens} | | |")
    lines += ["", f"Held-out check: **{result.contamination.status}** — {result.contamination.message}"]
    if result.failures:
        lines += ["", "Failures:", *[f"- {f}" for f in result.failures]]
    if result.notes:
        lines += ["", "Notes:", *[f"- {n}" for n in result.notes]]
    lines += ["", "Δ = candidate − baseline; ↓ lower is better. In mode *significant* a task fails only when it breaks "
              "its limit and the drop is significant (its 95% bootstrap interval excludes 0)."]
    return "\n".join(lines) + "\n"


def write_markdown(result, path, root=None) -> None:
    _write(path, markdown(result).encode(), root)


def write_plot(manifest: dict | None, path, title: str = "", root=None) -> bool:
    """Per-layer relative weight error (one line per projection) and K/V amax per layer, from {"stats": {...}}:
    `qtk eval` passes what it measured from the written checkpoint (errors against the baseline's weights, the
    ranges the written k/v scales imply), not what qtk.json claims. Returns False (and writes nothing) when
    there is nothing to draw."""
    stats = (manifest or {}).get("stats") or {}
    werr, kv = stats.get("weight_error") or {}, stats.get("kv_amax") or {}
    if not werr and not kv:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed", "pip install matplotlib (or 'qtk[dev]')") from None
    series: dict[str, dict[int, float]] = {}
    for name, err in werr.items():
        m = re.search(r"\.(\d+)\.(.+)$", name)
        if not m:
            continue
        layer, proj = int(m.group(1)), m.group(2).split(".")[-1]
        series.setdefault(proj, {})[layer] = float(err)
    panels = 1 + bool(kv)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.2 * panels), squeeze=False)
    ax = axes[0][0]
    for proj in sorted(series):
        pts = sorted(series[proj].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=proj)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("‖W − Q(W)‖ / ‖W‖")
    ax.set_title(f"weight error per layer, measured from the checkpoint {title}".strip(), fontsize=9)
    if series:
        ax.legend(fontsize=7, ncol=4)
    ax.grid(alpha=0.3)
    if kv:
        ax2 = axes[1][0]
        layers = sorted(int(k) for k in kv)
        ax2.plot(layers, [kv[str(i)][0] if str(i) in kv else kv[i][0] for i in layers], marker="o", label="K (after RoPE)")
        ax2.plot(layers, [kv[str(i)][1] if str(i) in kv else kv[i][1] for i in layers], marker="s", label="V")
        ax2.set_xlabel("decoder layer")
        ax2.set_ylabel("amax (written scale × 448 or 127)")
        ax2.set_title("KV-cache range per layer implied by the written scales", fontsize=9)
        ax2.legend(fontsize=7)
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    if root is None:
        fig.savefig(_out(path), dpi=110)
    else:
        import io

        buf = io.BytesIO()
        fig.savefig(buf, dpi=110, format="png")
        _write(path, buf.getvalue(), root)
    plt.close(fig)
    return True
