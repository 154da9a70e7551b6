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


def engine_settings(engine: str, device: str | None, dtype: str, batch_size: int, topk: int, proc=None) -> dict:
    """What makes baseline numbers differ between runs: part of the cache key. proc: the vLLM worker (its version
    and device, and the CPU's instruction sets, which pick vLLM's CPU kernels)."""
    import importlib.metadata as md

    from qtk import __version__

    if engine == "hf":
        import torch

        dev = device if device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
        s = {"engine": "hf", "device": dev.split(":")[0], "dtype": dtype, "batch_size": batch_size,
             "threads": torch.get_num_threads() if dev == "cpu" else None,  # CPU kernels may block sums by thread count
             "torch": torch.__version__.split("+")[0], "transformers": md.version("transformers")}
    else:
        from qtk.eval.vllm_process import cpu_flags

        isa = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))
        s = {"engine": "vllm", "vllm": proc.version, "device": proc.device, **({"isa": isa} if proc.device == "cpu" else {})}
    return {**s, "kl_topk": topk, "qtk": __version__}


@dataclass(frozen=True)
class GateOptions:
    """How a gate runs and what it writes (qtk eval's options; run_gate takes them whole or as keywords).

    engine: hf (transformers with the engine's quantization simulated) or vllm. limit: examples per task (default the
    task file's); seed: few-shot selection and the bootstrap (default the task file's). strict: fail on the point
    estimate; strict_heldout: fail when evaluation examples occur in the calibration data. cache_dir / use_cache:
    the baseline result cache. batch_size, device, dtype: the hf engine's. bootstrap: resamples. tasks: the task
    file's tasks to run (default all). json_path / junit / markdown / plot: the reports to write, the user's to name;
    report_root: the output directory they lie in when qtk names them itself (convert --gate, tune), where they are
    written without following a link (qtk.io.outdir.write_file). threads: torch's CPU threads for the run. A model
    whose config or tokenizer names its own code (auto_map) is refused unless trust_remote_code."""

    engine: str = "hf"
    limit: int | None = None
    seed: int | None = None
    strict: bool = False
    strict_heldout: bool = False
    cache_dir: str | Path | None = None
    use_cache: bool = True
    batch_size: int = 16
    device: str | None = None
    dtype: str = "float32"
    bootstrap: int = 2000
    tasks: list[str] | None = None
    json_path: str | Path | None = None
    junit: str | Path | None = None
    markdown: str | Path | None = None
    plot: str | Path | None = None
    threads: int | None = None
    trust_remote_code: bool = False
    report_root: str | Path | None = None


def run_gate(candidate_dir: str | Path, baseline_dir: str | Path, tasks_file: str | Path,
             options: GateOptions | None = None, *, progress: Callable[[str], None] | None = None,
             on_task: Callable[[int, int, str], None] | None = None, **fields) -> GateResult:
    """Evaluate the written checkpoint `candidate_dir` against the original model `baseline_dir` on the tasks of
    `tasks_file` and judge it. Returns the GateResult (its .passed / .exit_code is the verdict) after writing the
    requested reports; raises UsageError for bad input. options: a GateOptions, or its fields as keywords (engine=,
    limit=, threads=, json_path=, ...). progress(text) names each stage; on_task(done, total, what) follows each
    task run (a cached baseline is not run)."""
    opts = options if options is not None else GateOptions(**fields)
    if options is not None and fields:
        raise TypeError(f"run_gate: give options or keywords, not both ({', '.join(fields)})")
    with _torch_threads(opts.threads), Engines(opts.engine, progress) as engines:
        return _Gate(Path(candidate_dir), Path(baseline_dir), tasks_file, opts, engines, progress, on_task).run()


class Engines:
    """The engines a gate runs on. For vLLM, one worker process serves the baseline and the candidate (vLLM is
    imported once), started when first needed and ended with the gate."""

    def __init__(self, engine: str, progress: Callable[[str], None] | None = None):
        self.engine = engine
        self.say = progress or (lambda s: None)
        self._proc = None
        self.start_seconds = 0.0

    def proc(self):
        if self._proc is None:
            from qtk.eval.vllm_process import VLLMProcess

            self.say("starting vLLM")
            t0 = time.perf_counter()
            self._proc = VLLMProcess()
            self.start_seconds = time.perf_counter() - t0
        return self._proc

    def settings(self, device, dtype, batch_size, topk) -> dict:
        return engine_settings(self.engine, device, dtype, batch_size, topk, self.proc() if self.engine == "vllm" else None)

    def make(self, path: Path, ckpt, kw: dict):
        return _make_engine(self.engine, path, ckpt, kw, self.proc() if self.engine == "vllm" else None)

    def __enter__(self) -> "Engines":
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.close()


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


class _Gate:
    """One gate run, in the order of the module's flow: refuse bad options and inputs (_check_options, _open), the
    tasks as token requests (_requests), the contamination check and the baseline's hash (_provenance), the baseline
    (from the cache or run) and the candidate (_run_baseline, _run_candidate), the verdicts (_judge), the reports."""

    def __init__(self, cand: Path, base: Path, tasks_file, opts: GateOptions, engines: Engines,
                 progress: Callable[[str], None] | None, on_task: Callable[[int, int, str], None] | None):
        self.cand, self.base, self.tasks_file, self.opts, self.engines = cand, base, tasks_file, opts, engines
        self.say = progress or (lambda s: None)
        self.on_task = on_task
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []
        self.runs = {"done": 0, "total": 0}  # baseline and candidate of every task, less cached baselines

    def run(self) -> GateResult:
        t_start = time.perf_counter()
        self._check_options()
        tf, ckpt, base_cfg, measured = self._open()
        prepared, requests, cand_tok = self._requests(tf, ckpt)
        cont, mhash, digests_root = self._provenance(ckpt, prepared)
        vocab = int(base_cfg.get("vocab_size") or ckpt.hf_config.get("vocab_size"))
        topk = min(tf.agreement.kl_topk, vocab)
        o = self.opts
        settings = self.engines.settings(o.device, o.dtype, o.batch_size, topk)
        kw = dict(device=o.device, batch_size=o.batch_size, dtype=o.dtype, trust_remote_code=o.trust_remote_code)
        self.runs["total"] = 2 * len(prepared)
        base_runs, cached = self._run_baseline(prepared, requests, mhash, settings, topk, digests_root, kw)
        cand_runs, cand_engine = self._run_candidate(ckpt, prepared, requests, base_runs, cand_tok, kw)
        if o.engine == "vllm":
            self.timings["engine_start"] = self.engines.start_seconds
            settings = {**settings, "kv_cache_dtype": cand_engine.kv_cache_dtype, "kernels": cand_engine.schemes}
        verdicts, agree, failures = self._judge(tf, prepared, base_runs, cand_runs, cached, cont)
        self.timings["total"] = time.perf_counter() - t_start

        manifest = ckpt.manifest
        recipe = ((manifest or {}).get("recipe") or {})
        result = GateResult(
            passed=not failures, mode="strict" if o.strict else "significant",
            candidate={"path": str(self.cand), "format": ckpt.format, "recipe": recipe.get("name"),
                       "summary": recipe.get("summary"), "weights": ckpt.describe_weights(),
                       "activations": ckpt.describe_activations(), "kv_cache": ckpt.kv_cache},
            baseline={"path": str(self.base), "model_hash": mhash},
            engine={**settings, "cache_dir": str(digests_root) if o.use_cache else None, "bootstrap": o.bootstrap,
                    "baseline_cached": sorted(cached)},
            tasks=verdicts, agreement=agree, contamination=cont, failures=failures, notes=self.notes,
            timings={k: round(v, 3) for k, v in self.timings.items()}, manifest=manifest, measured=measured)
        write_reports(result, json_path=o.json_path, junit=o.junit, markdown=o.markdown, plot=o.plot, root=o.report_root)
        return result

    def _check_options(self) -> None:
        """The options' values, before any input is read."""
        from qtk.eval.engines import ENGINES

        o = self.opts
        if o.engine not in ENGINES:
            raise UsageError(f"unknown engine '{o.engine}'", f"choose one of {', '.join(ENGINES)}")
        if o.device is not None:
            from qtk.pipeline.device import parse_device

            parse_device(o.device)  # convert's check: a device that is none, or a GPU where none is visible
        if o.batch_size < 1 or o.bootstrap < 0 or (o.limit is not None and o.limit < 1):
            raise UsageError(f"--batch-size must be >= 1, --bootstrap >= 0 and --limit >= 1 (got {o.batch_size}, "
                             f"{o.bootstrap}, {o.limit})", "use e.g. --batch-size 16 --bootstrap 2000")
        if o.engine == "vllm":
            from qtk.eval.engines import vllm_available

            ok, why = vllm_available()
            if not ok:
                raise UsageError(f"the vllm engine cannot run here: {why}", "use --engine hf (the default) to simulate the engine")
            if o.device not in (None, "auto"):
                raise UsageError(f"--device {o.device} is the hf engine's: vLLM runs where its build runs (CPU or GPU)",
                                 "leave --device out with --engine vllm")
        if o.dtype not in ("float32", "bfloat16", "float16"):
            raise UsageError(f"unknown dtype '{o.dtype}'", "choose float32, bfloat16 or float16")

    def _open(self):
        """The task file, both directories checked (the candidate one checkpoint, the baseline unquantized, neither
        naming code unless trusted, the same model), and the checkpoint judged by qtk inspect's checks."""
        from qtk.eval.tasks import load_task_file
        from qtk.export import open_checkpoint

        tf = load_task_file(self.tasks_file)
        if self.opts.tasks:
            tf = tf.select(self.opts.tasks)
        _check_candidate_dir(self.cand)
        base_cfg = _check_baseline_dir(self.base)
        _check_remote_code(self.base, "baseline", self.opts.trust_remote_code)
        _check_remote_code(self.cand, "candidate", self.opts.trust_remote_code)
        ckpt = open_checkpoint(self.cand)
        _check_same_model(ckpt, base_cfg, self.base, self.cand)
        self.say("checking the checkpoint")
        measured = validate_candidate(ckpt, self.base if self.opts.plot else None, self.notes)
        return tf, ckpt, base_cfg, measured

    def _requests(self, tf, ckpt):
        """Examples, few-shot prefixes and token requests from the baseline's tokenizer; the candidate's must
        tokenize every task identically."""
        from qtk.eval.engines import has_tokenizer, load_tokenizer, same_tokenizer_files
        from qtk.eval.tasks import build_requests, prepare

        self.say("loading tasks")
        t0 = time.perf_counter()
        o = self.opts
        prepared = [prepare(t, limit=o.limit, seed=o.seed) for t in tf.tasks]
        tokenizer = load_tokenizer(self.base, trust_remote_code=o.trust_remote_code)
        requests = [build_requests(p, tokenizer) for p in prepared]
        cand_tok = tokenizer
        if not has_tokenizer(self.cand):
            self.notes.append("the checkpoint has no tokenizer files: used the baseline's")
        elif not same_tokenizer_files(self.cand, self.base):
            cand_tok = load_tokenizer(self.cand, trust_remote_code=o.trust_remote_code)
            for p, r in zip(prepared, requests):
                if build_requests(p, cand_tok).digest() != r.digest():
                    raise UsageError(f"the candidate's tokenizer tokenizes task '{p.spec.name}' differently from the baseline's",
                                     "the checkpoint should carry the baseline's tokenizer files; reconvert or copy them")
        self.timings["tasks"] = time.perf_counter() - t0
        return prepared, requests, cand_tok

    def _provenance(self, ckpt, prepared):
        """The contamination check against the checkpoint's calibration data, and the baseline's hash (the cache key's
        model part); a note when the candidate was converted from other files than the baseline's."""
        from qtk.eval import contamination as contam
        from qtk.eval.cache import default_cache_dir, file_digests, model_hash

        o = self.opts
        root = Path(o.cache_dir) if o.cache_dir else default_cache_dir()
        self.say("contamination check")
        t0 = time.perf_counter()
        manifest = ckpt.manifest
        cont = contam.check(manifest, prepared, cache_dir=root if o.use_cache else None)
        self.timings["contamination"] = time.perf_counter() - t0

        self.say("hashing baseline")
        t0 = time.perf_counter()
        digests = file_digests(self.base, root if o.use_cache else None)
        mhash = model_hash(digests)
        src = ((manifest or {}).get("source") or {}).get("files_sha256") or {}
        differing = [n for n, h in src.items() if n in digests and digests[n] != h]
        if differing:
            self.notes.append(f"the candidate was converted from a model whose {', '.join(differing)} differ from the baseline's")
        self.timings["hash"] = time.perf_counter() - t0
        return cont, mhash, root

    def _ran(self, what: str, seconds: float) -> None:
        self.runs["done"] += 1
        if self.on_task:
            self.on_task(self.runs["done"], self.runs["total"], f"{what} ({seconds:.1f}s)")

    def _run_baseline(self, prepared, requests, mhash: str, settings: dict, topk: int, root: Path, kw: dict):
        """Each task's baseline results: from the cache (keyed by model hash, task, requests and engine settings) or
        run on the baseline engine (started only when a task is not cached) and stored."""
        from qtk.eval.cache import BaselineCache, entry_key

        self.say("baseline")
        t0 = time.perf_counter()
        cache = BaselineCache(root)
        base_runs, cached = {}, set()
        base_engine = None
        try:
            for p, r in zip(prepared, requests):
                key = entry_key(mhash, p.spec.identity(), r.digest(), settings)
                hit = cache.load(key) if self.opts.use_cache else None
                if hit is not None:
                    base_runs[p.spec.name] = TaskRun.from_cache(*hit)
                    cached.add(p.spec.name)
                    self.runs["total"] -= 1
                    continue
                if base_engine is None:
                    base_engine = self.engines.make(self.base, None, kw)
                self.say(f"baseline: {p.spec.name}")
                run = evaluate_task(base_engine, p, r, topk=topk if p.spec.type == "perplexity" else 0)
                base_runs[p.spec.name] = run
                self._ran(f"baseline {p.spec.name}", run.seconds)
                if self.opts.use_cache:
                    cache.store(key, *run.to_cache())
        finally:
            if base_engine is not None:
                base_engine.close()
        self.timings["baseline"] = time.perf_counter() - t0
        return base_runs, cached

    def _run_candidate(self, ckpt, prepared, requests, base_runs: dict, cand_tok, kw: dict):
        """Each task on the written checkpoint (perplexity tasks against the baseline's rows, for the agreement)."""
        self.say("candidate")
        t0 = time.perf_counter()
        cand_engine = self.engines.make(self.cand, ckpt, {**kw, "tokenizer": cand_tok})
        if self.opts.engine == "vllm" and ckpt.kv_cache and not str(cand_engine.kv_cache_dtype).startswith("fp8"):
            self.notes.append(f"the checkpoint declares an {ckpt.kv_cache} KV cache, but vLLM ran it as "
                              f"{cand_engine.kv_cache_dtype}: its k/v scales were not used")
        cand_runs = {}
        try:
            for p, r in zip(prepared, requests):
                self.say(f"candidate: {p.spec.name}")
                ref = base_runs[p.spec.name].rows if p.spec.type == "perplexity" else None
                cand_runs[p.spec.name] = evaluate_task(cand_engine, p, r, reference=ref)
                self._ran(f"candidate {p.spec.name}", cand_runs[p.spec.name].seconds)
        finally:
            cand_engine.close()
        self.timings["candidate"] = time.perf_counter() - t0
        return cand_runs, cand_engine

    def _judge(self, tf, prepared, base_runs: dict, cand_runs: dict, cached: set, cont):
        """Each task's verdict (paired bootstrap, gate.judge_task), the agreement of perplexity tasks, and the failures
        (contamination fails only with strict_heldout, else it is a note)."""
        from qtk.eval.gate import agreement as agreement_stats
        from qtk.eval.gate import judge_task

        o = self.opts
        self.say("statistics")
        verdicts = []
        for i, p in enumerate(prepared):
            b, c = base_runs[p.spec.name], cand_runs[p.spec.name]
            v = judge_task(p.spec, b.per_example, c.per_example, strict=o.strict, n_boot=o.bootstrap,
                           seed=(p.spec.seed if o.seed is None else o.seed) + i)
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
                                    tf.agreement, n_boot=o.bootstrap, seed=tf.tasks[0].seed if o.seed is None else o.seed)
        failures = [f"{v.name}: {v.reason}" for v in verdicts if v.status == "fail"]
        if agree is not None and agree.status == "fail":
            failures.append(f"agreement: {agree.reason}")
        if cont.status == "overlap":
            (failures if o.strict_heldout else self.notes).append(f"contamination: {cont.message}")
        elif cont.status == "unchecked":
            (failures if o.strict_heldout else self.notes).append(f"contamination not checked: {cont.message}")
        return verdicts, agree, failures


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


def _make_engine(engine: str, path: Path, ckpt, kw: dict, proc=None):
    from qtk.eval.engines import HFEngine, VLLMEngine

    if engine == "vllm":
        if ckpt is not None and ckpt.format not in ("vllm", "hf-fp8"):
            raise UsageError(f"qtk runs only vllm and hf-fp8 checkpoints in vLLM, not {ckpt.format}",
                             "use --engine hf for this checkpoint")
        return VLLMEngine(path, proc=proc, trust_remote_code=kw["trust_remote_code"])
    if ckpt is None:
        return HFEngine.baseline(path, **{k: v for k, v in kw.items() if k != "tokenizer"})
    kw = {k: v for k, v in kw.items() if k != "trust_remote_code"}  # the candidate is built from qtk's reader, not from its code
    tok = kw.pop("tokenizer")
    return HFEngine.candidate(ckpt, tok, **kw)


def write_reports(result: GateResult, *, json_path=None, junit=None, markdown=None, plot=None, root=None) -> None:
    """The reports asked for; root: the output directory qtk-named reports lie in (see run_gate)."""
    from qtk.eval import report

    if json_path:
        report.write_json(result, json_path, root)
    if junit:
        report.write_junit(result, junit, root)
    if markdown:
        report.write_markdown(result, markdown, root)
    if plot:
        report.write_plot({"stats": result.measured or {}}, plot,
                          title=f"{result.candidate.get('recipe') or ''} {result.candidate['path']}".strip(), root=root)
