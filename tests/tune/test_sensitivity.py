"""The one-pass damage estimate (qtk.tune.sensitivity) against measured damage on the trained example model: the KL
divergence from the unquantized model's next-token distribution when only that unit is quantized (with the very
weights the estimate was computed for). Their rank agreement is reported and held above a floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qtk.calib import ChatTemplate, calibration_ids, load_texts
from qtk.model.source import ModelSource
from qtk.recipe import load_recipe
from qtk.tune.sensitivity import Candidate, measure, units_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-llama"


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return torch.tensor(r)

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)


def test_units_are_fusion_groups():
    src = ModelSource(EXAMPLE)
    units = units_of(src.arch, list(src.arch.linears))
    assert [(u.label, u.linears) for u in units] == [
        ("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), ("o", ("self_attn.o_proj",)),
        ("gate_up", ("mlp.gate_proj", "mlp.up_proj")), ("down", ("mlp.down_proj",))]


@pytest.fixture(scope="module")
def measured():
    from transformers import AutoModelForCausalLM

    src = ModelSource(EXAMPLE)
    r4, r8 = load_recipe("w4a16-gptq"), load_recipe("w8a16")
    cands = [Candidate("w4a16-gptq", r4.default_scheme), Candidate("w8a16", r8.default_scheme), Candidate("bf16", None)]
    chat = ChatTemplate(src.tokenizer)
    ids = calibration_ids(chat.tokenizer, load_texts("default", "text", None, chat=chat), 32, 128, 0)
    sens = measure(src, cands, ids, solver=r4.step("gptq").params, keep_weights=True)

    model = AutoModelForCausalLM.from_pretrained(EXAMPLE, dtype=torch.float32).eval()
    rows = [json.loads(line)["text"] for line in (ROOT / "examples/tasks/prose.jsonl").read_text().splitlines()[:64]]
    tok = src.tokenizer()
    enc = [torch.tensor([tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"][:100]) for t in rows]
    with torch.no_grad():
        ref = [torch.log_softmax(model(e[None]).logits[0].float(), -1) for e in enc]

    def kl(weights: dict[str, torch.Tensor]) -> float:
        saved = {n: model.get_submodule(n).weight.data.clone() for n in weights}
        try:
            for n, w in weights.items():
                model.get_submodule(n).weight.data.copy_(w.float())
            tot, cnt = 0.0, 0
            with torch.no_grad():
                for e, lp in zip(enc, ref):
                    lq = torch.log_softmax(model(e[None]).logits[0].float(), -1)
                    tot += float((lp.exp() * (lp - lq)).sum())
                    cnt += lp.shape[0]
            return tot / cnt
        finally:
            for n, w in saved.items():
                model.get_submodule(n).weight.data.copy_(w)

    pairs = []  # (candidate, estimate, measured KL)
    for u, unit in enumerate(sens.units):
        for c in ("w4a16-gptq", "w8a16"):
            pairs.append((c, unit.damage[c], kl(sens.weights[(u, c)])))
    return sens, pairs


def test_estimate_ranks_like_measured_kl(measured):
    sens, pairs = measured
    est, kls = [p[1] for p in pairs], [p[2] for p in pairs]
    rho_all = spearman(est, kls)
    w4 = [p for p in pairs if p[0] == "w4a16-gptq"]
    rho_w4 = spearman([p[1] for p in w4], [p[2] for p in w4])
    print(f"\nSpearman(estimate, KL): all {len(pairs)} unit x scheme pairs {rho_all:.3f}; "
          f"16 units under w4a16-gptq {rho_w4:.3f}")
    assert rho_all >= 0.8
    assert rho_w4 >= 0.55
    # the estimate never calls a more precise scheme more damaging than a less precise one on the same unit
    for u in sens.units:
        assert u.damage["bf16"] == 0 < u.damage["w8a16"] < u.damage["w4a16-gptq"]
