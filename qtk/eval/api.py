"""`qtk eval` as a function: run_gate(candidate, baseline, tasks) evaluates both models on the same examples,
judges every task against its limit and writes the reports. cli.py and `qtk convert --gate` call it.

Flow: parse the task file → load examples, few-shot prefixes, limits → token requests (baseline tokenizer;
the candidate's must tokenize identically) → contamination check against the checkpoint's calibration data →
baseline results from the cache or the baseline engine → candidate results from the written checkpoint →
statistics and verdicts → JSON / JUnit / Markdown / plot.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qtk.errors import CheckFailed, QtkError, UsageError

SCHEMA = "qtk.eval/1"


@dataclass
class TaskRun:
    """One model's results on one task: per-example additive columns (what the statistics need), generated texts,
    and for perplexity tasks the per-text rows behind the agreement metrics."""

    per_example: dict[str, list[float]]
    predictions: list[str] | None = None
    rows: list[dict] | None = None
    seconds: float = 0.0

    def to_cache(self) -> tuple[dict, dict]:
        tensors, rows = {}, None
        if self.rows is not None:
            rows = []
            for i, r in enumerate(self.rows):
                rows.append({k: v for k, v in r.items() if k not in ("top_lp", "top_ix")})
                if "top_lp" in r:
                    tensors[f"{i}.top_lp"], tensors[f"{i}.top_ix"] = r["top_lp"], r["top_ix"]
        return {"per_example": self.per_example, "predictions": self.predictions, "rows": rows, "seconds": self.seconds}, tensors

    @classmethod
    def from_cache(cls, d: dict, tensors: dict) -> "TaskRun":
        rows = d.get("rows")
        if rows is not None:
            for i, r in enumerate(rows):
                if f"{i}.top_lp" in tensors:
                    r["top_lp"], r["top_ix"] = tensors[f"{i}.top_lp"], tensors[f"{i}.top_ix"]
        return cls(d["per_example"], d.get("predictions"), rows, d.get("seconds", 0.0))


def evaluate_task(engine, task, req, *, topk: int = 0, reference: list[dict] | None = None) -> TaskRun:
    """Run one prepared task (tasks.PreparedTask + its tasks.Requests) on an engine and score every example."""
    from qtk.eval.tasks import extract

    t0 = time.perf_counter()
    spec = task.spec
    if spec.type == "perplexity":
        rows = engine.rolling(req.seqs, topk=topk, reference=reference)
        run = TaskRun({"nll": [r["nll"] for r in rows], "tokens": [r["tokens"] for r in rows]}, rows=rows)
    elif spec.type == "multiple_choice":
        lls = engine.loglikelihood(req.pairs)
        n = len(task.examples)
        scores: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        for (i, _j), ll, nb in zip(req.owner, lls, req.choice_bytes):
            scores[i].append((ll, ll / max(nb, 1)))
        acc, acc_norm, picks = [], [], []
        for ex, sc in zip(task.examples, scores):
            best = max(range(len(sc)), key=lambda j: (sc[j][0], -j))
            best_n = max(range(len(sc)), key=lambda j: (sc[j][1], -j))
            acc.append(float(best == ex["answer"]))
            acc_norm.append(float(best_n == ex["answer"]))
            picks.append(str(best))
        run = TaskRun({"acc": acc, "acc_norm": acc_norm}, predictions=picks)
    else:
        outs = engine.generate(req.prompts, req.max_new_tokens, spec.stop)
        em = []
        for ex, out in zip(task.examples, outs):
            ref = extract(ex["reference"], spec)
            if ref == "[no match]":  # a reference without the pattern is the answer itself
                ref = ex["reference"].strip().lower() if spec.ignore_case else ex["reference"].strip()
            em.append(float(extract(out, spec) == ref))
        run = TaskRun({"exact_match": em}, predictions=outs)
    run.seconds = time.perf_counter() - t0
    return run


@dataclass
class GateResult:
    passed: bool
    mode: str  # significant | strict
    candidate: dict
    baseline: dict
    engine: dict
    tasks: list  # gate.TaskVerdict
    agreement: object | None  # gate.AgreementResult
    contamination: object  # contamination.ContaminationResult
    failures: list[str]
    notes: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    manifest: dict | None = None  # the candidate's qtk.json
    measured: dict | None = None  # errors and KV ranges measured from the written checkpoint (for the plot)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict:
        from qtk import __version__

        return {
            "schema": SCHEMA,
            "qtk_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "passed": self.passed,
            "exit_code": self.exit_code,
            "mode": self.mode,
            "candidate": self.candidate,
            "baseline": self.baseline,
            "engine": self.engine,
            "tasks": [t.to_dict() for t in self.tasks],
            "agreement": self.agreement.to_dict() if self.agreement is not None else None,
            "contamination": self.contamination.to_dict(),
            "failures": self.failures,
            "notes": self.notes,
            "timings": self.timings,
        }

    def raise_for_verdict(self) -> None:
        """CheckFailed (exit 1) naming what failed, when the gate did not pass."""
        if not self.passed:
            raise CheckFailed(f"accuracy gate failed: {'; '.join(self.failures)}", "see the gate report for every task")


# files a quantized checkpoint carries next to (or in) config.json: qtk's manifest, ModelOpt's and GPTQ/AWQ's configs
QUANTIZED_MARKERS = ("qtk.json", "hf_quant_config.json", "quantize_config.json", "quant_config.json")


def _read_config(p: Path, role: str) -> dict:
    f = p / "config.json"
    try:
        cfg = json.loads(f.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise UsageError(f"the {role}'s {f} is not valid JSON ({type(e).__name__})", f"restore the {role}'s config.json") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"the {role}'s {f} is not a JSON object", f"restore the {role}'s config.json")
    return cfg


def _check_baseline_dir(p: Path) -> dict:
    """The baseline's config.json, once it is known to be an unquantized Hugging Face model directory."""
    if not p.is_dir():
        raise UsageError(f"baseline directory {p} does not exist", "--baseline is the original Hugging Face model directory")
    if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise UsageError(f"{p} is not a Hugging Face model directory (needs config.json and *.safetensors)",
                         "--baseline is the original model directory the candidate was converted from")
    cfg = _read_config(p, "baseline")
    q = cfg.get("quantization_config")
    marker = next((m for m in QUANTIZED_MARKERS if (p / m).is_file()), None)
    if q is not None or marker:
        what = (f"a {q.get('quant_method', 'quantized')} quantization_config" if isinstance(q, dict)
                else "a quantization_config" if q is not None else marker)
        raise UsageError(f"the baseline {p} is a quantized checkpoint (it has {what}): the gate would compare against "
                         "a model that already lost accuracy", "--baseline is the original unquantized (bf16/fp16) model "
                         "the candidate was converted from")
    return cfg


def _check_candidate_dir(p: Path) -> None:
    """`qtk eval out/` names the convert output root, which holds one checkpoint per target: point at one."""
    if not p.is_dir() or (p / "config.json").is_file():
        return
    targets = sorted((d.name for d in p.iterdir() if d.is_dir() and (d / "config.json").is_file()),
                     key=lambda n: (n != "vllm", n))
    if targets:
        raise UsageError(f"{p} is the output root of qtk convert (it holds {', '.join(t + '/' for t in targets)}), "
                         "not one checkpoint", f"give one of them, e.g. qtk eval {p / targets[0]}")


def _check_remote_code(p: Path, role: str, trust_remote_code: bool) -> None:
    """Never let transformers reach a model's own code unless asked: an auto_map in config.json or
    tokenizer_config.json makes it import .py files from the directory (and ask on a terminal first)."""
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        f = p / name
        if not f.is_file():
            continue
        try:
            d = json.loads(f.read_bytes().decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue  # not JSON: whoever reads it refuses it; it cannot name code to run either
        if isinstance(d, dict) and d.get("auto_map"):
            raise UsageError(f"the {role} {p} needs custom code from the model repository ({name} has auto_map)",
                             "review that code, then pass --trust-remote-code")


def _check_same_model(ckpt, base_cfg: dict, base: Path, cand: Path) -> None:
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        a, b = ckpt.hf_config.get(k), base_cfg.get(k)
        if a is not None and b is not None and a != b:
            raise UsageError(f"the candidate {cand} and the baseline {base} are different models ({k}: {a} vs {b})",
                             "compare a checkpoint with the model it was converted from")


def engine_settings(engine: str, device: str | None, dtype: str, batch_size: int, topk: int) -> dict:
    """What makes baseline numbers differ between runs: part of the cache key."""
    import importlib.metadata as md

    from qtk import __version__

    if engine == "hf":
        import torch

        dev = device if device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
        s = {"engine": "hf", "device": dev.split(":")[0], "dtype": dtype, "batch_size": batch_size,
             "threads": torch.get_num_threads() if dev == "cpu" else None,  # CPU kernels may block sums by thread count
             "torch": torch.__version__.split("+")[0], "transformers": md.version("transformers")}
    else:
        import vllm

        s = {"engine": "vllm", "vllm": getattr(vllm, "__version__", None)}
    return {**s, "kl_topk": topk, "qtk": __version__}


def run_gate(candidate_dir: str | Path, baseline_dir: str | Path, tasks_file: str | Path, *, engine: str = "hf",
             limit: int | None = None, seed: int | None = None, strict: bool = False, strict_heldout: bool = False,
             cache_dir: str | Path | None = None, use_cache: bool = True, batch_size: int = 16, device: str | None = None,
             dtype: str = "float32", bootstrap: int = 2000, tasks: list[str] | None = None,
             json_path: str | Path | None = None, junit: str | Path | None = None, markdown: str | Path | None = None,
             plot: str | Path | None = None, progress: Callable[[str], None] | None = None,
             threads: int | None = None, on_task: Callable[[int, int, str], None] | None = None,
             trust_remote_code: bool = False) -> GateResult:
    """Evaluate the written checkpoint `candidate_dir` against the original model `baseline_dir` on the tasks of
    `tasks_file` and judge it. Returns the GateResult (its .passed / .exit_code is the verdict) after writing the
    requested reports; raises UsageError for bad input. `threads` sets torch's CPU threads for the run (on a
    shared or small machine, 1 is often fastest for small models). progress(text) names each stage;
    on_task(done, total, what) follows each task run (a cached baseline is not run). A model whose config or
    tokenizer names its own code (auto_map) is refused unless `trust_remote_code`."""
    opts = dict(locals())
    with _torch_threads(opts.pop("threads")):
        return _run_gate(**opts)


@contextmanager
def _torch_threads(n: int | None):
    if n is None:
        yield
        return
    if n < 1:
        raise UsageError(f"--threads must be >= 1 (got {n})", "use e.g. --threads 1")
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_gate(candidate_dir, baseline_dir, tasks_file, *, engine, limit, seed, strict, strict_heldout, cache_dir, use_cache,
              batch_size, device, dtype, bootstrap, tasks, json_path, junit, markdown, plot, progress, on_task,
              trust_remote_code) -> GateResult:
    from qtk.eval import contamination as contam
    from qtk.eval.cache import BaselineCache, default_cache_dir, entry_key, file_digests, model_hash
    from qtk.eval.engines import ENGINES
    from qtk.eval.gate import agreement as agreement_stats
    from qtk.eval.gate import judge_task
    from qtk.eval.tasks import build_requests, load_task_file, prepare
    from qtk.export import open_checkpoint

    say = progress or (lambda s: None)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    if engine not in ENGINES:
        raise UsageError(f"unknown engine '{engine}'", f"choose one of {', '.join(ENGINES)}")
    if batch_size < 1 or bootstrap < 0 or (limit is not None and limit < 1):
        raise UsageError(f"--batch-size must be >= 1, --bootstrap >= 0 and --limit >= 1 (got {batch_size}, {bootstrap}, {limit})",
                         "use e.g. --batch-size 16 --bootstrap 2000")
    if engine == "vllm":
        from qtk.eval.engines import vllm_available

        ok, why = vllm_available()
        if not ok:
            raise UsageError(f"the vllm engine cannot run here: {why}", "use --engine hf (the default) to simulate the engine")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"unknown dtype '{dtype}'", "choose float32, bfloat16 or float16")
    tf = load_task_file(tasks_file)
    if tasks:
        tf = tf.select(tasks)
    cand, base = Path(candidate_dir), Path(baseline_dir)
    _check_candidate_dir(cand)
    base_cfg = _check_baseline_dir(base)
    _check_remote_code(base, "baseline", trust_remote_code)
    _check_remote_code(cand, "candidate", trust_remote_code)
    ckpt = open_checkpoint(cand)
    _check_same_model(ckpt, base_cfg, base, cand)
    notes: list[str] = []
    say("checking the checkpoint")
    measured = validate_candidate(ckpt, base if plot else None, notes)

    say("loading tasks")
    t0 = time.perf_counter()
    from qtk.eval.engines import has_tokenizer, load_tokenizer, same_tokenizer_files

    prepared = [prepare(t, limit=limit, seed=seed) for t in tf.tasks]
    tokenizer = load_tokenizer(base, trust_remote_code=trust_remote_code)
    requests = [build_requests(p, tokenizer) for p in prepared]
    cand_tok = tokenizer
    if not has_tokenizer(cand):
        notes.append("the checkpoint has no tokenizer files: used the baseline's")
    elif not same_tokenizer_files(cand, base):
        cand_tok = load_tokenizer(cand, trust_remote_code=trust_remote_code)
        for p, r in zip(prepared, requests):
            if build_requests(p, cand_tok).digest() != r.digest():
                raise UsageError(f"the candidate's tokenizer tokenizes task '{p.spec.name}' differently from the baseline's",
                                 "the checkpoint should carry the baseline's tokenizer files; reconvert or copy them")
    timings["tasks"] = time.perf_counter() - t0

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    say("contamination check")
    t0 = time.perf_counter()
    manifest = ckpt.manifest
    cont = contam.check(manifest, prepared, cache_dir=root if use_cache else None)
    timings["contamination"] = time.perf_counter() - t0

    say("hashing baseline")
    t0 = time.perf_counter()
    digests = file_digests(base, root if use_cache else None)
    mhash = model_hash(digests)
    src = ((manifest or {}).get("source") or {}).get("files_sha256") or {}
    differing = [n for n, h in src.items() if n in digests and digests[n] != h]
    if differing:
        notes.append(f"the candidate was converted from a model whose {', '.join(differing)} differ from the baseline's")
    timings["hash"] = time.perf_counter() - t0

    vocab = int(base_cfg.get("vocab_size") or ckpt.hf_config.get("vocab_size"))
    topk = min(tf.agreement.kl_topk, vocab)
    settings = engine_settings(engine, device, dtype, batch_size, topk)
    cache = BaselineCache(root)
    kw = dict(device=device, batch_size=batch_size, dtype=dtype, trust_remote_code=trust_remote_code)

    runs = {"done": 0, "total": 2 * len(prepared)}  # baseline and candidate of every task, less cached baselines

    def ran(what: str, seconds: float) -> None:
        runs["done"] += 1
        if on_task:
            on_task(runs["done"], runs["total"], f"{what} ({seconds:.1f}s)")

    say("baseline")
    t0 = time.perf_counter()
    base_runs, cached = {}, set()
    base_engine = None
    try:
        for p, r in zip(prepared, requests):
            key = entry_key(mhash, p.spec.identity(), r.digest(), settings)
            hit = cache.load(key) if use_cache else None
            if hit is not None:
                base_runs[p.spec.name] = TaskRun.from_cache(*hit)
                cached.add(p.spec.name)
                runs["total"] -= 1
                continue
            if base_engine is None:
                base_engine = _make_engine(engine, base, None, kw)
            say(f"baseline: {p.spec.name}")
            run = evaluate_task(base_engine, p, r, topk=topk if p.spec.type == "perplexity" else 0)
            base_runs[p.spec.name] = run
            ran(f"baseline {p.spec.name}", run.seconds)
            if use_cache:
                cache.store(key, *run.to_cache())
    finally:
        if base_engine is not None:
            base_engine.close()
    timings["baseline"] = time.perf_counter() - t0

    say("candidate")
    t0 = time.perf_counter()
    cand_engine = _make_engine(engine, cand, ckpt, {**kw, "tokenizer": cand_tok})
    cand_runs = {}
    try:
        for p, r in zip(prepared, requests):
            say(f"candidate: {p.spec.name}")
            ref = base_runs[p.spec.name].rows if p.spec.type == "perplexity" else None
            cand_runs[p.spec.name] = evaluate_task(cand_engine, p, r, reference=ref)
            ran(f"candidate {p.spec.name}", cand_runs[p.spec.name].seconds)
    finally:
        cand_engine.close()
    timings["candidate"] = time.perf_counter() - t0

    say("statistics")
    verdicts = []
    for i, p in enumerate(prepared):
        b, c = base_runs[p.spec.name], cand_runs[p.spec.name]
        v = judge_task(p.spec, b.per_example, c.per_example, strict=strict, n_boot=bootstrap,
                       seed=(p.spec.seed if seed is None else seed) + i)
        v.baseline_cached = p.spec.name in cached
        if p.spec.type == "generate":
            same = sum(x == y for x, y in zip(b.predictions, c.predictions))
            v.extra["same_output_pct"] = 100.0 * same / max(len(b.predictions), 1)
        elif p.spec.type == "multiple_choice":
            same = sum(x == y for x, y in zip(b.predictions, c.predictions))
            v.extra["same_choice_pct"] = 100.0 * same / max(len(b.predictions), 1)
        v.extra["seconds"] = {"baseline": round(b.seconds, 3), "candidate": round(c.seconds, 3)}
        verdicts.append(v)
    ppl = [p.spec.name for p in prepared if p.spec.type == "perplexity"]
    agree = None
    if ppl:
        agree = agreement_stats([r for n in ppl for r in base_runs[n].rows], [r for n in ppl for r in cand_runs[n].rows],
                                tf.agreement, n_boot=bootstrap, seed=tf.tasks[0].seed if seed is None else seed)

    failures = [f"{v.name}: {v.reason}" for v in verdicts if v.status == "fail"]
    if agree is not None and agree.status == "fail":
        failures.append(f"agreement: {agree.reason}")
    if cont.status == "overlap":
        (failures if strict_heldout else notes).append(f"contamination: {cont.message}")
    elif cont.status == "unchecked":
        (failures if strict_heldout else notes).append(f"contamination not checked: {cont.message}")
    timings["total"] = time.perf_counter() - t_start

    recipe = ((manifest or {}).get("recipe") or {})
    result = GateResult(
        passed=not failures, mode="strict" if strict else "significant",
        candidate={"path": str(cand), "format": ckpt.format, "recipe": recipe.get("name"), "summary": recipe.get("summary"),
                   "weights": ckpt.describe_weights(),
                   "activations": ckpt.describe_activations(), "kv_cache": ckpt.kv_cache},
        baseline={"path": str(base), "model_hash": mhash},
        engine={**settings, "cache_dir": str(root) if use_cache else None, "bootstrap": bootstrap,
                "baseline_cached": sorted(cached)},
        tasks=verdicts, agreement=agree, contamination=cont, failures=failures, notes=notes,
        timings={k: round(v, 3) for k, v in timings.items()}, manifest=manifest, measured=measured)
    write_reports(result, json_path=json_path, junit=junit, markdown=markdown, plot=plot)
    return result


def validate_candidate(ckpt, source_dir: Path | None, notes: list[str]) -> dict:
    """The checks `qtk inspect` runs (qtk.checks), before anything is evaluated: a tensor whose dtype or shape
    contradicts the config, a missing or implausible k/v scale (the engine would run without KV quantization, or
    with a broken one), a malformed tensor is CheckFailed naming it, exit 1. With source_dir (the baseline, for
    --plot) every Linear is also compared with it; what that finds is noted, not failed: the accuracy is judged
    below. Returns the errors and KV ranges measured from the bytes, for the plot."""
    from qtk.checks import check_checkpoint

    source, why = None, "no --plot"
    if source_dir is not None:
        from qtk.model.source import ModelSource

        try:
            source = ModelSource(source_dir)
        except QtkError as e:
            why = f"the baseline cannot be read as a source model ({e.problem})"
            notes.append(f"plot: weight errors not measured: {why}")
    rep = check_checkpoint(ckpt, source=source, source_note=why)
    for c in rep.checks:
        if c.ok:
            continue
        if c.name == "written weights match the source":
            notes.append(f"the written weights differ from the baseline's: {c.detail}")
            continue
        raise CheckFailed(f"{ckpt.path}: {c.name}: {c.detail}", f"run qtk inspect {ckpt.path} for the full report")
    return {"weight_error": rep.errors, "kv_amax": rep.kv_amax}


def _make_engine(engine: str, path: Path, ckpt, kw: dict):
    from qtk.eval.engines import HFEngine, VLLMEngine

    if engine == "vllm":
        if ckpt is not None and ckpt.format != "vllm":
            raise UsageError(f"vLLM cannot load a {ckpt.format} checkpoint", "use --engine hf for this checkpoint")
        return VLLMEngine(path, kv_cache=ckpt.kv_cache if ckpt is not None else None, trust_remote_code=kw["trust_remote_code"])
    if ckpt is None:
        return HFEngine.baseline(path, **{k: v for k, v in kw.items() if k != "tokenizer"})
    kw = {k: v for k, v in kw.items() if k != "trust_remote_code"}  # the candidate is built from qtk's reader, not from its code
    tok = kw.pop("tokenizer")
    return HFEngine.candidate(ckpt, tok, **kw)


def write_reports(result: GateResult, *, json_path=None, junit=None, markdown=None, plot=None) -> None:
    from qtk.eval import report

    if json_path:
        report.write_json(result, json_path)
    if junit:
        report.write_junit(result, junit)
    if markdown:
        report.write_markdown(result, markdown)
    if plot:
        report.write_plot({"stats": result.measured or {}}, plot,
                          title=f"{result.candidate.get('recipe') or ''} {result.candidate['path']}".strip())
