"""qtk's side of the vLLM engine, without vLLM: the worker process (qtk.eval.vllm_worker), its client
(qtk.eval.vllm_process) and VLLMEngine, driven against a stand-in `vllm` package that answers as vLLM's LLM does
(prompt log-probs as {token id: Logprob}, greedy text, the engine config) with qtk's own hf engine underneath. The
worker finds it through PYTHONPATH, exactly as it would find the real one. tests/engine runs the real vLLM."""

from __future__ import annotations

import textwrap

import pytest
import torch

from qtk.errors import UsageError
from qtk.eval.api import run_gate
from qtk.eval.vllm_process import EngineUnavailable, VLLMProcess

STAND_IN = '''
"""A stand-in for vLLM's offline API (tests/eval/test_vllm_adapter.py)."""
import json, os, types
from dataclasses import dataclass
from pathlib import Path

__version__ = "0.0-test"
if os.environ.get("FAKE_VLLM_IMPORT") == "sigill":
    import signal
    os.kill(os.getpid(), signal.SIGILL)
if os.environ.get("FAKE_VLLM_IMPORT") == "broken":
    raise ImportError("operator torchvision::nms does not exist")


@dataclass
class Logprob:
    logprob: float
    rank: int


class SamplingParams:
    def __init__(self, max_tokens=16, temperature=1.0, prompt_logprobs=None, stop=None):
        assert temperature == 0.0, "qtk decodes greedily"
        self.max_tokens, self.prompt_logprobs, self.stop = max_tokens, prompt_logprobs, stop or []


class LLM:
    def __init__(self, model, tokenizer=None, dtype="auto", seed=0, enforce_eager=False, enable_prefix_caching=True,
                 max_logprobs=20, trust_remote_code=False, max_num_seqs=16, max_model_len=None, kv_cache_dtype="auto"):
        assert not enable_prefix_caching  # prompt log-probs need every position computed
        assert trust_remote_code is False
        from qtk.eval.engines import HFEngine, load_tokenizer
        from qtk.export import open_checkpoint

        if (Path(model) / "REFUSE").exists():
            raise ValueError("Failed to find a kernel that can implement the WNA16 linear layer. Reasons: \\n"
                             " StandInKernel cannot implement due to: a test said so")
        cfg = json.loads((Path(model) / "config.json").read_text())
        qc = cfg.get("quantization_config")
        self.max_logprobs = max_logprobs
        self.fail_forward = (Path(model) / "FAIL_FORWARD").exists()
        self.hf = (HFEngine.candidate(open_checkpoint(model), load_tokenizer(Path(model)), device="cpu") if qc
                   else HFEngine.baseline(model, device="cpu"))
        kv = "fp8" if qc and qc.get("kv_cache_scheme") else "auto"
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            cache_config=types.SimpleNamespace(cache_dtype=kv),
            model_config=types.SimpleNamespace(quantization="compressed-tensors" if qc else None, dtype="torch.bfloat16")))

    def apply_model(self, fn):
        return [fn(self.hf.model)]

    def generate(self, prompts, sp, use_tqdm=True):
        if self.fail_forward:  # what vLLM 0.32's CPU build does with an online transform
            raise AttributeError("'HadamardTransform' object has no attribute 'cpu_linear'")
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            plp = None
            if sp.prompt_logprobs is not None:
                assert sp.prompt_logprobs <= self.max_logprobs
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
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A `vllm` package on PYTHONPATH (the worker's, not this process's: qtk never imports vLLM itself)."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STAND_IN)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    (pkg / "platforms.py").write_text(textwrap.dedent("""
        import types
        current_platform = types.SimpleNamespace(device_type="cpu")
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setattr("qtk.eval.vllm_process.vllm_installed", lambda: True)
    return pkg


def test_vllm_engine_scores_like_the_hf_engine(stand_in, ckpts, tiny_llama, task_dir, tmp_path):
    """Through the worker, the client and VLLMEngine, a gate run scores every task as the hf engine does; KL is exact
    (the tiny vocabulary fits in the top-k), the checkpoint's FP8 KV cache is reported."""
    hf = run_gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", device="cpu", use_cache=False, bootstrap=200)
    vl = run_gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", engine="vllm", cache_dir=tmp_path, bootstrap=200)
    assert vl.engine["engine"] == "vllm" and vl.engine["vllm"] == "0.0-test" and vl.engine["device"] == "cpu"
    assert vl.engine["kv_cache_dtype"] == "fp8"
    for a, b in zip(hf.tasks, vl.tasks):
        assert (a.name, a.n, a.status) == (b.name, b.n, b.status)
        assert b.baseline == pytest.approx(a.baseline, rel=1e-4) and b.candidate == pytest.approx(a.candidate, rel=1e-4)
    assert vl.agreement.kl == pytest.approx(hf.agreement.kl, rel=1e-3, abs=1e-6)
    assert vl.agreement.top1 == pytest.approx(hf.agreement.top1, abs=1e-6)


def test_kl_from_two_top_k_lists_is_exact_with_the_whole_vocabulary_and_a_lower_bound_otherwise():
    from qtk.eval.engines import _kl_to_reference, _partial_kl

    g = torch.Generator().manual_seed(0)
    base = torch.log_softmax(torch.randn(6, 50, generator=g) * 2, -1)
    cand = torch.log_softmax(torch.randn(6, 50, generator=g) * 2, -1)
    exact = (base.exp() * (base - cand)).sum(-1)
    b_lp, b_ix = base.topk(50)
    c_lp, c_ix = cand.topk(50)
    assert torch.allclose(_partial_kl(b_lp, b_ix, c_lp, c_ix), exact, atol=1e-5)
    b_lp, b_ix = base.topk(8)
    c_lp, c_ix = cand.topk(8)
    part = _partial_kl(b_lp, b_ix, c_lp, c_ix)
    assert (part <= exact + 1e-6).all() and (part >= 0).all()
    # when the candidate's list holds every id of the baseline's, it is the hf engine's figure
    c_lp, c_ix = cand.topk(50)
    assert torch.allclose(_partial_kl(b_lp, b_ix, c_lp, c_ix), _kl_to_reference(cand, b_lp, b_ix, 50), atol=1e-5)


def test_a_refused_checkpoint_is_one_line_naming_vllms_reason(stand_in, ckpts):
    from qtk.eval.engines import VLLMEngine

    (ckpts["w8-kv8"] / "REFUSE").write_text("")
    try:
        with pytest.raises(UsageError) as e:
            VLLMEngine(ckpts["w8-kv8"])
    finally:
        (ckpts["w8-kv8"] / "REFUSE").unlink()
    msg = str(e.value)
    assert "vLLM 0.0-test cannot run" in msg and "a test said so" in msg and "--engine hf" in e.value.fix
    assert "\n" not in msg


def test_the_worker_survives_a_refusal_and_loads_the_next_checkpoint(stand_in, ckpts):
    (ckpts["w8-kv8"] / "REFUSE").write_text("")
    try:
        with VLLMProcess() as p:
            r = p.load(ckpts["w8-kv8"])
            assert r.refused and r.error == "ValueError" and "StandInKernel" in r.reason()
            r = p.load(ckpts["int8-kv8"])
            assert r.ok and r.kv_cache_dtype == "fp8"
            lp = p.logprobs([[1, 5, 6, 7, 8]], k=3)
            assert lp.actual.shape == (4,) and lp.top_ix.shape == (4, 3) and (lp.top_lp[:, 0] >= lp.actual).all()
    finally:
        (ckpts["w8-kv8"] / "REFUSE").unlink()


def test_a_checkpoint_that_fails_at_its_first_forward_is_a_refusal(stand_in, ckpts):
    """vLLM loads it, then its first forward raises (online transforms on vLLM 0.32's CPU build): the engine check
    reports a refusal naming vLLM's error, and the worker goes on to the next checkpoint."""
    from qtk.eval.engine_check import compare

    (ckpts["w8-kv8"] / "FAIL_FORWARD").write_text("")
    try:
        with VLLMProcess() as p:
            c = compare(ckpts["w8-kv8"], [[1, 5, 6, 7, 8]], p)
            assert c.status == "refused" and "first forward" in c.reason and "cpu_linear" in c.reason, c.reason
            assert p.load(ckpts["int8-kv8"]).ok
            assert p.logprobs([[1, 5, 6, 7, 8]], k=1).actual.shape == (4,)
    finally:
        (ckpts["w8-kv8"] / "FAIL_FORWARD").unlink()


@pytest.mark.parametrize("how, said", [("sigill", "killed by SIGILL"), ("broken", "cannot be imported here")])
def test_vllm_that_cannot_start_here_is_one_line(stand_in, monkeypatch, how, said):
    monkeypatch.setenv("FAKE_VLLM_IMPORT", how)
    with pytest.raises(EngineUnavailable) as e:
        VLLMProcess()
    assert said in str(e.value) and "\n" not in str(e.value)


def test_vllm_not_installed_is_refused_before_any_work(monkeypatch):
    from qtk.eval.engines import VLLMEngine

    monkeypatch.setattr("qtk.eval.vllm_process.vllm_installed", lambda: False)
    with pytest.raises(EngineUnavailable, match="not installed"):
        VLLMEngine("unused")
