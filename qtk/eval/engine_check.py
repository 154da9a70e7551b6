"""A written checkpoint run in the real engine (vLLM), compared with qtk's simulation of the same bytes.

qtk's simulation (qtk.model.simulate, the `--engine hf` of `qtk eval`) decodes the checkpoint through qtk's own
reader and fake-quantizes activations and the KV cache as the engine does. A transformers reload proves the bytes
decode as compressed-tensors decodes them; only the engine proves that the engine reads them the same way, has a
kernel for them on this hardware, and computes what the simulation computes. `compare` runs both on the same token
windows and measures, per predicted token, the log-probability each gives the actual next token:

  mean |Δ log p|   mean over tokens of |log p_engine - log p_sim|
  max |Δ log p|    the largest single difference
  top-1            share of positions where the engine's most likely token is the simulation's
  ppl ratio        perplexity under the engine / perplexity under the simulation

How far apart is too far depends on the model: quantized activations turn the rounding differences of two correct
computations into whole-code differences, and a deep model amplifies them (on SmolLM2-135M two correct runs of
FP8 per-token activations differ by mean |Δ log p| 0.2, on the example model by 0.02). So the check measures the
simulation against itself first: the same checkpoint simulated in the engine's dtype (bf16) against float32, on the
same windows (`noise_*`). That spread is what arithmetic alone does to this checkpoint; the engine must stay within
BOUNDS of it: `noise_factor` times the spread plus a small absolute slack. Measured (docs/engine.md), the engine is
as far from the float32 simulation as the bf16 simulation is, while the one real mismatch found, a KV cache the
engine rounds differently from the simulation, stood clearly beyond that; a layout error is orders of magnitude beyond.
Used by `qtk convert --verify-engine`, `qtk inspect --engine`, the engine tests and benchmarks/engine_vs_sim.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qtk.errors import UsageError

# The engine against the float32 simulation, relative to the simulation's own spread between float32 and the
# engine's dtype (the module docstring): mean |Δ log p| <= noise_factor * spread + mean_slack; top-1 agreement at
# least the spread's less top1_slack; |ln ppl ratio| <= noise_factor * |ln spread's ratio| + ppl_slack.
BOUNDS = {"noise_factor": 1.25, "mean_slack": 0.005, "top1_slack": 0.03, "ppl_slack": 0.01}
DEFAULT_WINDOWS = 4
DEFAULT_SEQ_LEN = 256
# the outputs each engine loads
ENGINE_TARGETS = {"vllm": ("vllm", "hf-fp8")}


@dataclass
class EngineComparison:
    """One checkpoint in the engine: status "runs" (with the figures), "refused" (vLLM's reason) or
    "unavailable" (vLLM cannot run here at all)."""

    path: str
    status: str
    reason: str = ""
    engine: str = "vllm"
    engine_version: str | None = None
    device: str | None = None
    kv_cache_dtype: str | None = None
    schemes: list[str] = field(default_factory=list)
    sim_kv: bool | None = None
    tokens: int = 0
    mean_abs_dlogp: float | None = None
    max_abs_dlogp: float | None = None
    top1: float | None = None
    ppl_engine: float | None = None
    ppl_sim: float | None = None
    ppl_ratio: float | None = None
    sim_dtype: str = "float32"
    # the simulation in the engine's dtype against the simulation in float32: what arithmetic alone does
    noise_dtype: str | None = None
    noise_mean_abs_dlogp: float | None = None
    noise_top1: float | None = None
    noise_ppl_ratio: float | None = None
    seconds: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return self.status == "runs" and not self.disagreements

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        if self.status != "runs":
            return f"{self.status}: {self.reason}"
        spread = "" if self.noise_mean_abs_dlogp is None else (
            f"; the simulation in {self.noise_dtype} against float32: {self.noise_mean_abs_dlogp:.4f}, "
            f"top-1 {100 * self.noise_top1:.1f} %, ratio {self.noise_ppl_ratio:.4f}")
        return (f"{self.tokens} tokens: mean |Δ log p| {self.mean_abs_dlogp:.4f}, max {self.max_abs_dlogp:.3f}, "
                f"top-1 {100 * self.top1:.1f} %, perplexity {self.ppl_engine:.3f} (engine) vs {self.ppl_sim:.3f} "
                f"(simulation), ratio {self.ppl_ratio:.4f}{spread}")


def check_windows(tokenizer, *, texts=None, num: int = DEFAULT_WINDOWS, seq_len: int = DEFAULT_SEQ_LEN,
                  seed: int = 4321, max_len: int | None = None) -> list[list[int]]:
    """`num` windows of `seq_len` tokens (BOS first) from `texts`, by default qtk's shipped corpus, at a seed of
    their own. Both runs see the same tokens, so overlap with calibration data does not matter here."""
    from qtk.calib import calibration_ids, load_texts

    if max_len is not None:
        seq_len = min(seq_len, max_len)
    if texts is None:
        texts = load_texts(str(Path(__file__).resolve().parents[1] / "data" / "calib" / "default.jsonl"))
    return calibration_ids(tokenizer, texts, num, seq_len, seed).tolist()


def _metrics(engine_lp: list[list[float]], engine_top: list[list[int]], sim_lp: list[list[float]],
             sim_top: list[list[int]]) -> dict:
    n = sum(len(r) for r in engine_lp)
    d = [abs(a - b) for ra, rb in zip(engine_lp, sim_lp) for a, b in zip(ra, rb)]
    agree = sum(int(a == b) for ra, rb in zip(engine_top, sim_top) for a, b in zip(ra, rb))
    nll_e = -sum(sum(r) for r in engine_lp) / n
    nll_s = -sum(sum(r) for r in sim_lp) / n
    return {"tokens": n, "mean_abs_dlogp": sum(d) / n, "max_abs_dlogp": max(d), "top1": agree / n,
            "ppl_engine": math.exp(nll_e), "ppl_sim": math.exp(nll_s), "ppl_ratio": math.exp(nll_e - nll_s)}


def judge(c: EngineComparison, bounds: dict | None = None) -> list[str]:
    """The figures outside their bounds (the module docstring), each as a phrase naming the figure, its value and
    its bound."""
    b = {**BOUNDS, **(bounds or {})}
    spread = c.noise_mean_abs_dlogp or 0.0
    out = []
    limit = b["noise_factor"] * spread + b["mean_slack"]
    if c.mean_abs_dlogp > limit:
        out.append(f"mean |Δ log p| {c.mean_abs_dlogp:.4f} > {limit:.4f} ({b['noise_factor']} × the simulation's own "
                   f"spread {spread:.4f} + {b['mean_slack']})")
    least = (c.noise_top1 if c.noise_top1 is not None else 1.0) - b["top1_slack"]
    if c.top1 < least:
        out.append(f"top-1 agreement {100 * c.top1:.1f} % < {100 * least:.1f} %")
    room = b["noise_factor"] * abs(math.log(c.noise_ppl_ratio or 1.0)) + b["ppl_slack"]
    if abs(math.log(c.ppl_ratio)) > room:
        out.append(f"perplexity ratio {c.ppl_ratio:.4f} outside [{math.exp(-room):.4f}, {math.exp(room):.4f}]")
    return out


def simulate_logprobs(path: Path, windows: list[list[int]], *, simulate_kv: bool = True, dtype: str = "float32",
                      baseline: bool = False, kv_rounding: str = "nearest",
                      simulate_activations: bool = True) -> tuple[list[list[float]], list[list[int]]]:
    """qtk's simulation of the checkpoint at `path` (or, with baseline, the unquantized model by transformers) on the
    windows: per window, log p of each actual next token and the most likely token at each position."""
    import torch

    from qtk.eval.engines import HFEngine

    if baseline:
        eng = HFEngine.baseline(path, device="cpu", dtype=dtype, batch_size=len(windows))
    else:
        from qtk.export import open_checkpoint
        from qtk.model.simulate import build_simulated_model, use_qtk_attention

        model = build_simulated_model(open_checkpoint(path), simulate_activations=simulate_activations,
                                      simulate_kv=simulate_kv, dtype=getattr(torch, dtype), kv_rounding=kv_rounding)
        use_qtk_attention(model)
        eng = HFEngine(model, None, device="cpu", batch_size=len(windows), dtype=dtype)
    try:
        lps, tops = [], []
        for w in windows:  # one window per forward: no padding, as the engine runs each prompt on its own
            logp = eng._forward([w])[0]
            tgt = torch.tensor(w[1:])
            lps.append(logp[: len(w) - 1].gather(-1, tgt[:, None])[:, 0].tolist())
            tops.append(logp[: len(w) - 1].argmax(-1).tolist())
        return lps, tops
    finally:
        eng.close()


def engine_kv_rounding(device: str | None) -> str:
    """How vLLM on `device` rounds to its FP8 KV cache: its CPU kernel truncates, its GPU kernels round to nearest."""
    return "toward_zero" if device == "cpu" else "nearest"


def compare(path: str | Path, windows: list[list[int]], proc, *, baseline: bool = False, sim_dtype: str = "float32",
            bounds: dict | None = None, sim: dict | None = None) -> EngineComparison:
    """Load the checkpoint at `path` in the vLLM worker `proc` (qtk.eval.vllm_process.VLLMProcess), run the windows,
    run qtk's simulation on the same windows, and compare. baseline: `path` is an unquantized model, compared with
    transformers (the engine's numerical floor)."""
    import json

    path = Path(path)
    res = EngineComparison(path=str(path), status="runs", engine_version=proc.version, device=proc.device)
    cfg = json.loads((path / "config.json").read_text())
    max_len = max(len(w) for w in windows)
    t0 = time.perf_counter()
    load = proc.load(path, max_model_len=max(max_len + 1, 32))  # the prompt plus the one token the engine samples
    res.seconds["load"] = round(time.perf_counter() - t0, 3)
    if load.refused:
        res.status, res.reason = "refused", load.reason()
        return res
    res.kv_cache_dtype, res.schemes = load.kv_cache_dtype, load.schemes
    t0 = time.perf_counter()
    from qtk.eval.vllm_process import EngineRefused

    try:
        lp = proc.logprobs(windows, k=1)
    except EngineRefused as e:
        res.status, res.reason = "refused", e.reason()
        return res
    res.seconds["engine"] = round(time.perf_counter() - t0, 3)
    e_lp = [lp.actual[r].tolist() for r in lp.rows()]
    e_top = [lp.top_ix[r, 0].tolist() for r in lp.rows()]
    declared_kv = (cfg.get("quantization_config") or {}).get("kv_cache_scheme") is not None
    # the simulation quantizes the KV cache the way the engine ran it: with the checkpoint's scales when the engine's
    # cache is fp8, not at all when it kept 16 bits (then the checkpoint's scales went unused: say so)
    res.sim_kv = declared_kv and str(load.kv_cache_dtype).startswith("fp8")
    if declared_kv and not res.sim_kv:
        res.notes.append(f"the checkpoint declares an 8-bit KV cache but the engine ran it as {load.kv_cache_dtype}: "
                         "its k/v scales were not used")
    t0 = time.perf_counter()
    kw = dict(simulate_kv=bool(res.sim_kv), baseline=baseline, kv_rounding=engine_kv_rounding(proc.device), **(sim or {}))
    s_lp, s_top = simulate_logprobs(path, windows, dtype=sim_dtype, **kw)
    res.seconds["simulation"] = round(time.perf_counter() - t0, 3)
    res.sim_dtype = sim_dtype
    for k, v in _metrics(e_lp, e_top, s_lp, s_top).items():
        setattr(res, k, v)
    res.noise_dtype = load.dtype if load.dtype in ("bfloat16", "float16") else None
    if res.noise_dtype and res.noise_dtype != sim_dtype:
        t0 = time.perf_counter()
        n_lp, n_top = simulate_logprobs(path, windows, dtype=res.noise_dtype, **kw)
        res.seconds["simulation_" + res.noise_dtype] = round(time.perf_counter() - t0, 3)
        n = _metrics(n_lp, n_top, s_lp, s_top)
        res.noise_mean_abs_dlogp, res.noise_top1, res.noise_ppl_ratio = n["mean_abs_dlogp"], n["top1"], n["ppl_ratio"]
    res.disagreements = judge(res, bounds)
    return res


def memory_shortfall(path: Path) -> str | None:
    """Why the check cannot run in this machine's memory, or None: it holds the model twice, vLLM's copy (the
    checkpoint's bytes and its KV cache) and qtk's float32 simulation of every parameter."""
    import json
    import os

    from qtk.pipeline import memory
    from qtk.plan.memory import ModelShape, model_tensors

    avail = memory.available_memory()
    if avail is None:
        return None
    try:
        numel = sum(t.numel for t in model_tensors(ModelShape.from_config(json.loads((path / "config.json").read_text()))))
    except Exception:  # a family the planner does not size: the check goes ahead and may fail on its own terms
        return None
    disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")) * 2**30
    need = 4 * numel + disk + kv
    if need <= avail:
        return None
    return (f"the engine check holds the model twice (vLLM's copy and qtk's float32 simulation: about "
            f"{need / 1e9:.1f} GB) and {avail / 1e9:.1f} GB are available: run it on a larger machine")


def verify_engine(path: str | Path, *, engine: str = "vllm", windows: list[list[int]] | None = None, tokenizer=None,
                  proc=None, texts=None, trust_remote_code: bool = False) -> EngineComparison:
    """The post-conversion engine check: `path` in the engine against qtk's simulation. Returns the comparison
    (status "unavailable" with the reason when the engine cannot run here at all); the caller decides the exit code."""
    from qtk.eval.vllm_process import EngineUnavailable, VLLMProcess

    if engine != "vllm":
        raise UsageError(f"unknown engine '{engine}' for the engine check", "use vllm")
    path = Path(path)
    if windows is None:
        import json

        from qtk.eval.engines import load_tokenizer

        tok = tokenizer or load_tokenizer(path, trust_remote_code=trust_remote_code)
        cfg = json.loads((path / "config.json").read_text())
        windows = check_windows(tok, texts=texts, max_len=int(cfg.get("max_position_embeddings") or DEFAULT_SEQ_LEN))
    short = memory_shortfall(path)
    if short:
        return EngineComparison(path=str(path), status="unavailable", reason=short)
    own = proc is None
    try:
        if own:
            proc = VLLMProcess()
        return compare(path, windows, proc)
    except EngineUnavailable as e:
        return EngineComparison(path=str(path), status="unavailable", reason=e.problem)
    finally:
        if own and proc is not None:
            proc.close()
