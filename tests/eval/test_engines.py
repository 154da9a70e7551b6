"""The hf engine: the candidate is the written checkpoint as the engine runs it. KV quantization is checked against
an attention computed here from scratch (own RoPE, scales read straight from the safetensors file)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from qtk.errors import UsageError
from qtk.eval.engines import HFEngine, VLLMEngine, load_tokenizer, vllm_available
from qtk.export import open_checkpoint

FP8 = torch.float8_e4m3fn


def _file_kv_scales(d):
    """k/v scales per layer, read from the checkpoint's safetensors files without qtk's reader."""
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if k.endswith((".k_scale", ".v_scale")):
                    layer = int(k.split(".")[2])
                    out.setdefault(layer, {})[k.rsplit(".", 1)[1]] = float(sf.get_tensor(k).reshape(-1)[0])
    return out


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _reference_logprobs(model, ids, kv_quant):
    """A Llama forward written out here: the model's own projections, norms and MLPs, but RoPE, the KV quantization
    (kv_quant(layer, k, v) -> k, v, applied to K after RoPE) and causal attention computed independently."""
    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    T = ids.shape[-1]
    pos = torch.arange(T)
    h = model.model.embed_tokens(ids[None])
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(1, T, H, D).transpose(1, 2)
            k = a.k_proj(x).view(1, T, KV, D).transpose(1, 2)
            v = a.v_proj(x).view(1, T, KV, D).transpose(1, 2)
            theta = cfg.rope_parameters["rope_theta"]
            q, k = _rope(q, pos, theta), _rope(k, pos, theta)
            k, v = kv_quant(i, k, v)
            k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + a.o_proj(att.transpose(1, 2).reshape(1, T, H * D))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return F.log_softmax(model.lm_head(model.model.norm(h)).float(), -1)[0]


def _fp8(x, s):
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def _int8(x, s):
    return torch.round(x / s).clamp(-128, 127) * s


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_simulated_kv_quantization_equals_quantizing_k_after_rope_and_v_with_the_checkpoint_scale(ckpts, tiny_llama, kind):
    """fp8: the vLLM checkpoint (cache holds fp8(x / k_scale)); int8: the TensorRT-LLM checkpoint of the same recipe
    (cache holds round(x / s) as int8, one kv_cache_scaling_factor per layer). Weight-only recipe: K and V are the
    only quantized activations, so the comparison is exact."""
    if kind == "fp8":
        d = ckpts["w8-kv8"]
        scales = _file_kv_scales(d)
        assert set(scales) == {0, 1}

        def kv(i, k, v):
            return _fp8(k, scales[i]["k_scale"]), _fp8(v, scales[i]["v_scale"])
    else:
        from safetensors import safe_open

        d = ckpts["w8-kv8-trt"]
        with safe_open(str(d / "rank0.safetensors"), "pt") as f:
            factor = {i: float(f.get_tensor(f"transformer.layers.{i}.attention.kv_cache_scaling_factor").reshape(-1)[0])
                      for i in (0, 1)}
        amax = json.loads((d / "qtk.json").read_text())["stats"]["kv_amax"]
        assert factor[0] == pytest.approx(max(amax["0"]) / 127)

        def kv(i, k, v):
            return _int8(k, factor[i]), _int8(v, factor[i])

    ck = open_checkpoint(d)
    assert ck.kv_cache == kind
    eng = HFEngine.candidate(ck, load_tokenizer(tiny_llama), batch_size=4)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (40, 23, 31)]
    got = eng._forward(rows)  # one right-padded batch, as the engine scores
    worst_q, min_effect = 0.0, math.inf
    for b, r in enumerate(rows):
        ids = torch.tensor(r)
        want = _reference_logprobs(eng.model, ids, kv)
        plain = _reference_logprobs(eng.model, ids, lambda i, k, v: (k, v))
        worst_q = max(worst_q, (got[b, : len(r)] - want).abs().max().item())
        min_effect = min(min_effect, (plain - want).abs().max().item())
    assert worst_q < 2e-5, f"engine differs from the independent KV-quantized reference by {worst_q}"
    assert min_effect > 1e-3, "KV quantization should visibly change the logits (else this test proves nothing)"
    # and the scores the gate uses are these log-probs
    r = rows[1]
    want = _reference_logprobs(eng.model, torch.tensor(r), kv)
    nll = -want[:-1].gather(-1, torch.tensor(r[1:])[:, None]).sum().item()
    assert eng.rolling([r])[0]["nll"] == pytest.approx(nll, rel=1e-5)


def test_candidate_quantizes_activations_as_the_checkpoint_says(ckpts, tiny_llama):
    from qtk.model.simulate import build_simulated_model

    ck = open_checkpoint(ckpts["int8-kv8"])
    assert ck.activations is not None and ck.activations.dynamic and ck.activations.strategy == "token"
    eng = HFEngine.candidate(ck, load_tokenizer(tiny_llama))
    rows = [list(range(5, 40))]
    full = F.log_softmax(build_simulated_model(ck).eval()(torch.tensor(rows)).logits.float(), -1)
    no_act = F.log_softmax(build_simulated_model(ck, simulate_activations=False).eval()(torch.tensor(rows)).logits.float(), -1)
    got = eng._forward(rows)
    assert (got - full).abs().max() < 1e-5
    assert (got - no_act).abs().max() > 1e-3


def test_loglikelihood_is_independent_of_batching_and_equals_a_direct_forward(tiny_llama):
    e1 = HFEngine.baseline(tiny_llama, batch_size=1)
    e5 = HFEngine.baseline(tiny_llama, batch_size=5)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(3, 90, (int(n),), generator=g).tolist(), torch.randint(3, 90, (int(m),), generator=g).tolist())
             for n, m in zip(torch.randint(2, 30, (9,), generator=g), torch.randint(1, 6, (9,), generator=g))]
    a, b = e1.loglikelihood(pairs), e5.loglikelihood(pairs)
    assert a == pytest.approx(b, abs=1e-4)
    ctx, cont = pairs[4]
    with torch.no_grad():
        lp = F.log_softmax(e1.model(torch.tensor([ctx + cont])).logits[0].float(), -1)
    direct = sum(lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
    assert a[4] == pytest.approx(direct, abs=1e-4)


def test_long_texts_are_scored_in_windows_that_predict_every_token_once(tiny_llama):
    e = HFEngine.baseline(tiny_llama)
    e.max_len = 16
    seq = list(range(3, 3 + 40))
    r = e.rolling([seq])[0]
    assert r["tokens"] == 39
    manual = 0.0
    for w in e._windows(seq):
        assert len(w) <= 16
        lp = e._forward([w])[0]
        manual -= lp[:-1].gather(-1, torch.tensor(w[1:])[:, None]).sum().item()
    assert r["nll"] == pytest.approx(manual, rel=1e-6)
    assert sum(len(w) - 1 for w in e._windows(seq)) == 39


def test_agreement_kl_is_exact_with_the_full_vocabulary_and_a_lower_bound_with_top_k(ckpts, tiny_llama):
    base = HFEngine.baseline(tiny_llama)
    cand = HFEngine.candidate(open_checkpoint(ckpts["int8-kv8"]), load_tokenizer(tiny_llama))
    seqs = [list(range(5, 30)), list(range(40, 52))]
    V = base.vocab
    full_ref = base.rolling(seqs, topk=V)
    small_ref = base.rolling(seqs, topk=8)
    exact = cand.rolling(seqs, reference=full_ref)
    bound = cand.rolling(seqs, reference=small_ref)
    for s, e_, b_ in zip(seqs, exact, bound):
        p = base._forward([s])[0, :-1]
        q = cand._forward([s])[0, :-1]
        kl = (p.exp() * (p - q)).sum(-1)
        assert e_["kl"] == pytest.approx(kl.sum().item(), rel=1e-4)
        assert 0 <= b_["kl"] <= e_["kl"] * (1 + 1e-6)
        assert e_["top1"] == int((p.argmax(-1) == q.argmax(-1)).sum())


def test_greedy_generation_with_the_kv_cache_equals_recomputing_without_it(ckpts, tiny_llama):
    """The cache hook re-quantizes cached K/V every step; quantization is idempotent, so decoding with the cache must
    produce what full recomputation of the quantized model produces."""
    tok = load_tokenizer(tiny_llama)
    eng = HFEngine.candidate(open_checkpoint(ckpts["int8-kv8"]), tok, batch_size=3)
    prompts = [[1] + tok("Q: 12+34=", add_special_tokens=False)["input_ids"], [1, 20, 30, 40], [1] + list(range(50, 70))]
    got = eng.generate(prompts, 6, ("\n",))
    for p, text in zip(prompts, got):
        ids = list(p)
        for _ in range(6):
            ids.append(int(eng._forward([ids])[0, -1].argmax()))
        want = tok.decode(ids[len(p):], skip_special_tokens=True).split("\n")[0]
        assert text == want


def test_vllm_engine_runs_or_says_why_not(ckpts):
    ok, why = vllm_available()
    if ok:  # vLLM installed (the engine environment): the checkpoint loads and scores
        eng = VLLMEngine(ckpts["int8-kv8"])
        try:
            assert len(eng.loglikelihood([([1, 5, 6], [7])])) == 1
        finally:
            eng.close()
        return
    with pytest.raises(UsageError) as e:
        VLLMEngine(ckpts["int8-kv8"])
    assert "not installed" in str(e.value) and "make engine-env" in str(e.value)


def test_stepwise_kv_quantization_while_decoding_equals_quantizing_the_whole_cache():
    from qtk.eval.engines import StepwiseKV
    from qtk.model.simulate import kv_fake_quant

    g = torch.Generator().manual_seed(0)
    full_k, full_v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    for kind in ("fp8", "int8"):
        quant = kv_fake_quant(kind, 0.01, 0.02)
        step = StepwiseKV(quant)
        step.start()
        for t in (7, 8, 9, 12):  # prefill of 7 positions, then the cache grows
            k, v = step(full_k[..., :t, :], full_v[..., :t, :])
            want_k, want_v = quant(full_k[..., :t, :], full_v[..., :t, :])
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
        k, _ = step(full_k[..., :5, :], full_v[..., :5, :])  # a new prompt: starts over
        assert torch.equal(k, quant(full_k[..., :5, :], full_v[..., :5, :])[0])
        step.stop()
        assert step.k is None and torch.equal(step(full_k, full_v)[0], quant(full_k, full_v)[0])


def test_the_engines_never_let_transformers_ask_to_run_model_code(tiny_llama, tmp_path, monkeypatch):
    """Behind run_gate's refusal, every load passes trust_remote_code explicitly: left at None, transformers asks on
    stdin (and runs the code on 'y'); with False it refuses without asking."""
    import builtins
    import shutil

    d = shutil.copytree(tiny_llama, tmp_path / "m")
    marker = tmp_path / "RAN"
    (d / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                               "from transformers import PreTrainedConfig\n\nclass EvilConfig(PreTrainedConfig):\n"
                               "    model_type = 'evil'\n")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or "y")
    load_tokenizer(d)  # the tokenizer files themselves are plain: transformers falls back to them without the code
    with pytest.raises(UsageError, match="cannot load the baseline"):
        HFEngine.baseline(d)
    assert not asked and not marker.exists()


def test_fp8_toward_zero_is_the_e4m3_value_of_largest_magnitude_not_above():
    """vLLM's CPU KV cache rounding (qtk.model.simulate.fp8_toward_zero) against its definition, on every bf16 value
    in e4m3's range and beyond (saturating at ±448), subnormals and zeros included."""
    from qtk.model.simulate import FP8_DTYPE, fp8_toward_zero

    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    a = x.abs().clamp(max=448)
    want = torch.sign(x) * grid[torch.searchsorted(grid, a, right=True) - 1]
    got = fp8_toward_zero(x)
    assert torch.equal(got.abs(), want.abs()) and bool(((got == 0) | (got.sign() == x.sign())).all())
    assert not torch.equal(got, x.clamp(-448, 448).to(FP8_DTYPE).float())  # not round-to-nearest
