"""How much of the static-FP8 perplexity gap between qtk and llm-compressor on the real model is rounding luck?

    nice .venv/bin/python benchmarks/fp8_rounding.py [--recipe fp8-kv8] [--eps 0 0.002 0.005 0.01 0.02 0.04]

Run benchmarks/real_model.py for the recipe first (both tools): this reads the two vLLM checkpoints it leaves in
its work directory (out-RECIPE-qtk/vllm, out-RECIPE-llmcompressor) and the real model's bf16 source weights.

Per-tensor FP8 (recipes fp8, fp8-kv8) is the one place the tools' weight codes differ by design: qtk quantizes each
fused q/k/v and gate/up group once with the group's scale (amax / 448, rounded to bf16); llm-compressor quantizes
each Linear with its own scale and vLLM requantizes it at load to the group's largest scale (a second rounding).
o_proj and down_proj are unfused, and their codes are equal in the two checkpoints (reported). Three measurements,
each changing only the fused groups' weight codes and scales of qtk's checkpoint (input, KV and other scales kept):

1. the codes of llm-compressor's checkpoint requantized as vLLM loads them ("llmc weights"), per module kind;
2. qtk's own rounding (nearest, one rounding) under weight scales multiplied by (1 + eps), eps >= 0 so nothing
   clips: eps = 0 must reproduce qtk's checkpoint bit for bit (checked), and each eps moves codes by at most one
   step, so the spread of perplexity over eps is what one-code-step rounding differences do to this model;
3. the relative weight error ||W_q - W|| / ||W|| over all fused weights, for each of the above.

Perplexity: benchmarks/real_model.py's held-out windows and simulated model (vLLM's arithmetic). Output:
benchmarks/results/fp8_rounding.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_model as rm  # noqa: E402  (its model, held-out windows and perplexity)

FUSED = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp"}
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fp8(t):
    import torch

    return t.clamp(-448, 448).to(torch.float8_e4m3fn)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="fp8-kv8", choices=("fp8", "fp8-kv8"))
    ap.add_argument("--eps", nargs="+", type=float, default=[0, 0.002, 0.005, 0.01, 0.02, 0.04])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=HERE / "results" / "tmp" / "real_model")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "fp8_rounding.json")
    a = ap.parse_args()
    if any(e < 0 for e in a.eps):
        raise SystemExit("error: --eps must be >= 0 (a smaller scale clips the group's largest weight)")
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    torch.set_num_threads(a.threads)
    q_dir, l_dir = a.work / f"out-{a.recipe}-qtk" / "vllm", a.work / f"out-{a.recipe}-llmcompressor"
    for d in (q_dir, l_dir):
        if not (d / "model.safetensors").is_file():
            raise SystemExit(f"error: {d} has no checkpoint: run benchmarks/real_model.py --recipes {a.recipe} first")
    model = rm._load_script("real_model").real_model_dir()
    src = load_file(str(model / "model.safetensors"))
    qk, lc = load_file(str(q_dir / "model.safetensors")), load_file(str(l_dir / "model.safetensors"))
    layers = sorted({int(k.split(".")[2]) for k in qk if k.startswith("model.layers.")})
    tok = AutoTokenizer.from_pretrained(model)
    windows, _ = rm.heldout_windows(tok, 4096, 512)

    def name(i, m):
        return f"model.layers.{i}.{FUSED.get(m, 'self_attn' if m == 'o_proj' else 'mlp')}.{m}"

    def rel_error(sd, kinds) -> float:
        num = den = 0.0
        for i in layers:
            for m in kinds:
                n = name(i, m)
                w = src[f"{n}.weight"].float()
                num += float((sd[f"{n}.weight"].float() * sd[f"{n}.weight_scale"].float() - w).pow(2).sum())
                den += float(w.pow(2).sum())
        return (num / den) ** 0.5

    def score(sd, tag) -> float:
        d = a.work / f"fp8-rounding-{a.recipe}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(q_dir, d)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        p = rm.checkpoint_ppl(d, windows)
        shutil.rmtree(d)
        print(f"{tag:40s} ppl {p:.4f}", flush=True)
        return round(p, 4)

    # llm-compressor's codes as vLLM runs them: each fused member requantized to the group's largest scale
    llmc_req = {}
    for i in layers:
        for g in GROUPS:
            smax = max(float(lc[f"{name(i, m)}.weight_scale"].float().max()) for m in g)
            for m in g:
                n = name(i, m)
                w = lc[f"{n}.weight"].float() * lc[f"{n}.weight_scale"].float()
                llmc_req[n] = (_fp8(w / smax), torch.tensor(smax))
    codes_equal = {}
    for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        eq = tot = 0
        for i in layers:
            n = name(i, m)
            other = llmc_req[n][0] if n in llmc_req else lc[f"{n}.weight"]
            eq += int((qk[f"{n}.weight"].view(torch.uint8) == other.view(torch.uint8)).sum())
            tot += qk[f"{n}.weight"].numel()
        codes_equal[m] = round(eq / tot, 4)
    print("codes equal to llm-compressor's (fused members requantized as vLLM loads them):", codes_equal, flush=True)

    def with_codes(kinds):
        sd = dict(qk)
        for n, (q, s) in llmc_req.items():
            if n.rsplit(".", 1)[1] in kinds:
                sd[f"{n}.weight"] = q.contiguous()
                sd[f"{n}.weight_scale"] = s.reshape(qk[f"{n}.weight_scale"].shape).to(qk[f"{n}.weight_scale"].dtype)
        return sd

    report = {"benchmark": "benchmarks/fp8_rounding.py", "command": " ".join(["nice", ".venv/bin/python", *sys.argv]),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "recipe": a.recipe,
              "checkpoints": {"qtk": str(q_dir.relative_to(HERE.parent)), "llmcompressor": str(l_dir.relative_to(HERE.parent))},
              "codes_equal_to_llmcompressor": codes_equal, "llmc_weights": {}, "qtk_rounding_scale_times_1_plus_eps": []}
    fused = tuple(FUSED)
    report["qtk_checkpoint"] = {"perplexity": score(qk, "qtk checkpoint as written"), "fused_weight_rel_error": round(rel_error(qk, fused), 6)}
    for tag, kinds in (("all fused", fused), ("q/k/v", GROUPS[0]), ("gate/up", GROUPS[1])):
        sd = with_codes(set(kinds))
        report["llmc_weights"][tag] = {"perplexity": score(sd, f"llm-compressor's {tag} codes"),
                                      "fused_weight_rel_error": round(rel_error(sd, fused), 6)}
    for eps in a.eps:
        sd = dict(qk)
        for i in layers:
            for g in GROUPS:
                amax = max(float(src[f"{name(i, m)}.weight"].float().abs().max()) for m in g)
                s = torch.tensor(amax / 448 * (1 + eps)).to(torch.bfloat16)  # qtk's scale rounding (model dtype)
                for m in g:
                    n = name(i, m)
                    sd[f"{n}.weight"] = _fp8(src[f"{n}.weight"] / s).contiguous()  # bf16 quotient, as qtk rounds it
                    sd[f"{n}.weight_scale"] = s.float().reshape(qk[f"{n}.weight_scale"].shape).to(qk[f"{n}.weight_scale"].dtype)
        if eps == 0:
            same = all(torch.equal(sd[k].view(torch.uint8), qk[k].view(torch.uint8)) if sd[k].dtype == torch.float8_e4m3fn
                       else torch.equal(sd[k], qk[k]) for k in qk)
            if not same:
                raise SystemExit("error: eps 0 does not reproduce qtk's checkpoint: this script's rounding is not qtk's")
        report["qtk_rounding_scale_times_1_plus_eps"].append(
            {"eps": eps, "perplexity": score(sd, f"qtk rounding, scales x (1 + {eps})"),
             "fused_weight_rel_error": round(rel_error(sd, fused), 6)})
    ppls = [r["perplexity"] for r in report["qtk_rounding_scale_times_1_plus_eps"]]
    report["spread_over_eps"] = {"min": min(ppls), "max": max(ppls)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
