"""The process that runs vLLM for qtk: `python -m qtk.eval.vllm_worker RESULT_FD`.

qtk never imports vLLM into its own process. Importing it changes the process (torch's thread count, logging,
signal handlers, a multiprocessing start method), its engine needs an `if __name__ == "__main__":` guard around
whatever creates it, and on a CPU the wheel was built for it may kill the process with SIGILL. So one worker
process imports vLLM once and loads checkpoints one after another (each `load` replaces the previous engine),
driven by qtk.eval.vllm_process.VLLMProcess.

Protocol: one JSON object per line on stdin (a request), one JSON object per line written to RESULT_FD (its
answer); vLLM's own logs go to stdout/stderr, which the parent sends to a log file. The first answer, before any
request, says whether vLLM imported: {"ok": true, "vllm": version, "device": "cpu" | "cuda" | ...}.

Requests ("op"):
  load      {model, dtype, max_model_len, max_logprobs, trust_remote_code, kv_cache_dtype}
            -> {ok, seconds, kv_cache_dtype, quantization, schemes} | {ok: false, refused: true, error, message}
  logprobs  {seqs: [[ids]], k, out?} -> per predicted position (1..n-1 of each sequence, sequences one after
            another): log p(actual token), top-k ids and log-probs; in the .npz file `out` when given
  generate  {prompts: [[ids]], max_tokens, stop} -> {ok, texts}
  unload    {} -> {ok}
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), eagerly (no torch.compile: minutes on a
CPU for no change in what is computed), without prefix caching (prompt log-probs need every position computed).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# the engine in this process: no engine-core and worker processes to spawn (and re-import everything) per load
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# GiB of KV cache on a CPU; vLLM's default reserves more than a check needs
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# qtk asks for max_position_embeddings + 2: a window as long as the model allows, plus the token a loglikelihood
# request scores after it, plus the one token the engine samples (and qtk drops); RoPE positions one or two past
# the config's limit change nothing that is read
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
# vLLM's CPU build runs a W4A16 checkpoint as W4A8 on AMX CPUs by default (int4_scaled_mm: activations quantized to
# int8 per token), which is not the format the checkpoint declares; the check judges the checkpoint's own format
os.environ.setdefault("VLLM_CPU_INT4_W4A8", "0")


def _send(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _schemes(model) -> list[str]:
    """The quantization scheme and kernel classes the engine picked for the model's Linears (what runs)."""
    seen = []
    for m in model.modules():
        scheme = getattr(m, "scheme", None)
        if scheme is None:
            continue
        kernel = next((v for v in vars(scheme).values() if type(v).__name__.endswith("Kernel")), None)
        name = type(scheme).__name__ + (f"/{type(kernel).__name__}" if kernel is not None else "")
        if name not in seen:
            seen.append(name)
    return seen


class Worker:
    def __init__(self):
        self.llm = None

    def unload(self) -> dict:
        if self.llm is not None:
            import gc

            self.llm = None
            gc.collect()
        return {"ok": True}

    def load(self, req: dict) -> dict:
        from vllm import LLM

        self.unload()
        t0 = time.perf_counter()
        kw = dict(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype") or "auto", seed=0,
                  enforce_eager=True, enable_prefix_caching=False, max_logprobs=int(req.get("max_logprobs", 20)),
                  trust_remote_code=bool(req.get("trust_remote_code", False)), max_num_seqs=int(req.get("max_num_seqs", 16)))
        if req.get("max_model_len"):
            kw["max_model_len"] = int(req["max_model_len"])
        if req.get("kv_cache_dtype"):
            kw["kv_cache_dtype"] = req["kv_cache_dtype"]
        try:
            self.llm = LLM(**kw)
        except Exception as e:  # vLLM refuses what it cannot run with an exception naming why: that is the answer
            self.llm = None
            return {"ok": False, "refused": True, "error": type(e).__name__, "message": str(e),
                    "traceback": traceback.format_exc(limit=6)}
        cfg = self.llm.llm_engine.vllm_config
        schemes = []
        try:
            schemes = [s for part in self.llm.apply_model(_schemes) for s in part]
        except Exception:  # reporting the kernels is a courtesy; older/newer vLLMs may not offer apply_model
            pass
        return {"ok": True, "seconds": time.perf_counter() - t0, "kv_cache_dtype": str(cfg.cache_config.cache_dtype),
                "quantization": cfg.model_config.quantization, "dtype": str(cfg.model_config.dtype).replace("torch.", ""),
                "schemes": sorted(set(schemes))}

    def logprobs(self, req: dict) -> dict:
        """Prompt log-probs of each sequence. With "out", the arrays go to that .npz file (top-k of a long text is
        too much for a JSON line): actual [N], top_ix [N, k], top_lp [N, k], lengths [S]; N = sum(len(seq) - 1)."""
        import numpy as np
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        k = max(int(req.get("k", 1)), 1)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        seqs = req["seqs"]
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in seqs], sp, use_tqdm=False)
        except Exception as e:  # loaded, but a layer has no working path on this device (vLLM 0.32's online transforms
            # on CPU): the engine's refusal, found at the first forward rather than at load
            return {"ok": False, "refused": True, "error": type(e).__name__,
                    "message": f"loaded, but failed at its first forward: {e}"}
        n = sum(len(s) - 1 for s in seqs)
        actual = np.zeros(n, dtype=np.float32)
        top_ix = np.zeros((n, k), dtype=np.int32)
        top_lp = np.full((n, k), -np.inf, dtype=np.float32)
        i = 0
        for seq, o in zip(seqs, outs):
            plp = o.prompt_logprobs  # per position: None at 0, then {token id: Logprob(logprob, rank, ...)}
            for p in range(1, len(seq)):
                d = plp[p]
                actual[i] = d[seq[p]].logprob
                top = sorted(((tid, v.logprob) for tid, v in d.items()), key=lambda x: -x[1])[:k]
                top_ix[i, : len(top)] = [t for t, _ in top]
                top_lp[i, : len(top)] = [v for _, v in top]
                i += 1
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        if req.get("out"):
            np.savez(req["out"], actual=actual, top_ix=top_ix, top_lp=top_lp, lengths=lengths)
            return {"ok": True, "out": req["out"]}
        return {"ok": True, "actual": actual.tolist(), "top_ix": top_ix.tolist(), "top_lp": top_lp.tolist(),
                "lengths": lengths.tolist()}

    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=int(req["max_tokens"]), temperature=0.0, stop=list(req.get("stop") or []))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]], sp, use_tqdm=False)
        return {"ok": True, "texts": [o.outputs[0].text for o in outs]}


def _request_amx() -> None:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM), which a process must hold before its first
    AMX instruction. vLLM's CPU build never asks: its own AMX kernels (the small-GEMM one for weights under 1 MiB,
    the W4A16 one) die of SIGILL unless oneDNN asked first, which it does only for GEMMs it runs on tiles itself."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def main(argv: list[str]) -> int:
    out = os.fdopen(int(argv[1]), "w", encoding="utf-8")
    try:
        import vllm
        from vllm.platforms import current_platform
    except BaseException as e:  # ImportError, a missing shared library, an operator that will not register ...
        _send(out, {"ok": False, "error": type(e).__name__, "message": str(e).strip().splitlines()[0][:500] if str(e) else ""})
        return 1
    _request_amx()
    _send(out, {"ok": True, "vllm": getattr(vllm, "__version__", "?"), "device": str(current_platform.device_type),
                "pid": os.getpid()})
    w = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "load":
                ans = w.load(req)
            elif op == "logprobs":
                ans = w.logprobs(req)
            elif op == "generate":
                ans = w.generate(req)
            elif op == "unload":
                ans = w.unload()
            elif op == "exit":
                w.unload()
                _send(out, {"ok": True})
                return 0
            else:
                ans = {"ok": False, "error": "ValueError", "message": f"unknown op {op!r}"}
        except Exception as e:
            ans = {"ok": False, "error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc(limit=8)}
        _send(out, ans)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
