"""The vllm engine's glue (prompt log-probs, greedy sampling params, stop strings, FP8 KV flag) against a stand-in
`vllm` module that answers like vLLM's LLM.generate does, computed with the hf engine. On a GPU machine with the
real vLLM, test_engines.test_vllm_engine_runs_or_says_why_not runs the real thing."""

import sys
import types
from dataclasses import dataclass

import pytest
import torch

from qtk.eval.api import run_gate
from qtk.eval.engines import HFEngine, load_tokenizer
from qtk.export import open_checkpoint


@dataclass
class Logprob:
    logprob: float
    rank: int


class SamplingParams:
    def __init__(self, max_tokens=16, temperature=1.0, prompt_logprobs=None, stop=None):
        assert temperature == 0.0, "the gate decodes greedily"
        self.max_tokens, self.prompt_logprobs, self.stop = max_tokens, prompt_logprobs, stop or []


class LLM:
    instances: list = []

    def __init__(self, model, kv_cache_dtype="auto", seed=0, gpu_memory_utilization=0.9, max_logprobs=20,
                 enable_prefix_caching=True, trust_remote_code=False):
        assert not enable_prefix_caching  # prompt log-probs and prefix caching do not mix
        assert trust_remote_code is False  # qtk eval passes it explicitly, and only with --trust-remote-code
        self.kwargs = dict(model=model, kv_cache_dtype=kv_cache_dtype, max_logprobs=max_logprobs)
        import json
        from pathlib import Path

        quantized = "quantization_config" in json.loads((Path(model) / "config.json").read_text())
        tok = load_tokenizer(Path(model))
        self.hf = (HFEngine.candidate(open_checkpoint(model), tok, device="cpu") if quantized
                   else HFEngine.baseline(model, device="cpu"))
        LLM.instances.append(self)

    def generate(self, prompts, sp, use_tqdm=True):
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            plp = None
            if sp.prompt_logprobs is not None:
                assert sp.prompt_logprobs <= self.kwargs["max_logprobs"]
                lp = self.hf._forward([ids])[0]
                plp = [None]
                for pos in range(1, len(ids)):
                    row = lp[pos - 1]
                    top = row.topk(sp.prompt_logprobs)
                    d = {int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(top.values, top.indices))}
                    d.setdefault(ids[pos], Logprob(float(row[ids[pos]]), int((row > row[ids[pos]]).sum()) + 1))
                    plp.append(d)
            text = self.hf.generate([ids], sp.max_tokens, tuple(sp.stop))[0]
            outs.append(types.SimpleNamespace(prompt_logprobs=plp, outputs=[types.SimpleNamespace(text=text)]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    import importlib.machinery

    mod = types.ModuleType("vllm")
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    mod.__version__ = "0.0-test"
    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    mod.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    LLM.instances = []
    return mod


def test_vllm_engine_scores_like_the_hf_engine(fake_vllm, ckpts, tiny_llama, task_dir, tmp_path):
    hf = run_gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", device="cpu", use_cache=False, bootstrap=200)
    vl = run_gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", engine="vllm", cache_dir=tmp_path, bootstrap=200)
    base_llm, cand_llm = LLM.instances
    assert base_llm.kwargs["kv_cache_dtype"] == "auto" and cand_llm.kwargs["kv_cache_dtype"] == "fp8"
    assert vl.engine["engine"] == "vllm" and vl.engine["vllm"] == "0.0-test"
    for a, b in zip(hf.tasks, vl.tasks):
        assert (a.name, a.n) == (b.name, b.n)
        assert b.baseline == pytest.approx(a.baseline, rel=1e-4) and b.candidate == pytest.approx(a.candidate, rel=1e-4)
    assert vl.agreement.kl is None and vl.agreement.top1 == pytest.approx(hf.agreement.top1, abs=1.0)


def test_vllm_engine_refuses_an_int8_kv_cache(fake_vllm, ckpts):
    from qtk.errors import UsageError
    from qtk.eval.engines import VLLMEngine

    with pytest.raises(UsageError, match="int8 KV cache"):
        VLLMEngine(ckpts["int8-kv8"], kv_cache="int8")
