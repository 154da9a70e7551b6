"""Shared by the TensorRT-LLM tests and make_modelopt_reference.py: the reference model, the conformance cases,
and summaries of written checkpoints (config + tensor names, dtypes, shapes read from safetensors headers)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: models.py

REFERENCE = HERE / "data" / "modelopt_reference.json"
NS, T = 8, 48  # calibration windows: small, the numbers only need to be consistent

# the tiny Llama both ModelOpt and qtk quantize: widths divisible by 128 (int4 g128 at tp 2), GQA, and a vocab
# that is a multiple of 64 so ModelOpt's AWQ vocab padding (pad_embedding_lm_head) does not trigger
MODEL = dict(model_type="llama", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=128, dtype="bfloat16", seed=0)

# case -> (qtk recipe, ModelOpt configs, target, tp)
CASES = {
    "trtllm/fp8-kv8/tp1": ("fp8-kv8", ["FP8_DEFAULT_CFG", "FP8_KV_CFG"], "trtllm", 1),
    "trtllm/fp8-kv8/tp2": ("fp8-kv8", ["FP8_DEFAULT_CFG", "FP8_KV_CFG"], "trtllm", 2),
    "trtllm/w4a16-awq/tp1": ("w4a16", ["INT4_AWQ_CFG"], "trtllm", 1),
    "trtllm/w4a16-awq/tp2": ("w4a16", ["INT4_AWQ_CFG"], "trtllm", 2),
    "trtllm/int8-sq-static-kv8/tp1": ("int8-static-kv8", ["INT8_SMOOTHQUANT_CFG", "INT8_KV"], "trtllm", 1),
    "hf/fp8-kv8": ("fp8-kv8", ["FP8_DEFAULT_CFG", "FP8_KV_CFG"], "hf-modelopt", 1),
    "hf/w4a16-awq": ("w4a16", ["INT4_AWQ_CFG"], "hf-modelopt", 1),
}

# W8A8 with static per-tensor int8 activations (what ModelOpt's INT8_SMOOTHQUANT_CFG produces) and INT8 KV
INT8_STATIC_KV8 = {
    "name": "int8-static-kv8",
    "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
    "activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False},
    "kv_cache": {"num_bits": 8, "type": "int"},
    "algorithm": ["rtn"],
}

# TensorRT-LLM config keys where qtk deliberately differs from ModelOpt (everything else must be equal):
#  producer: who wrote it; rank: ModelOpt's index of the rank whose config it saved (one config serves all ranks);
#  logits_dtype: qtk keeps TensorRT-LLM's default float32 logits, ModelOpt writes the model dtype
TRT_CONFIG_DIFFERENT = {"producer", "rank", "logits_dtype"}


def make_reference_model(path: Path) -> Path:
    """MODEL as a Hugging Face directory with the char tokenizer of tests/models.py."""
    import torch
    from models import save_char_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    m = MODEL
    cfg = AutoConfig.for_model(m["model_type"], vocab_size=m["vocab"], hidden_size=m["hidden"],
                               intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
                               num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                               max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(m["seed"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.6, 1.4)
    path = Path(path)
    model.to(getattr(torch, m["dtype"])).save_pretrained(str(path))
    save_char_tokenizer(path)
    return path


def header(p: Path) -> dict[str, list]:
    """{tensor: [safetensors dtype, shape]} from a file's header, without loading tensors."""
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {k: [v["dtype"], v["shape"]] for k, v in sorted(h.items())}


def summarize_trtllm(d: Path) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    n = cfg["mapping"]["world_size"]
    return {"config": cfg, "ranks": {f"rank{r}": header(d / f"rank{r}.safetensors") for r in range(n)}}


def summarize_hf(d: Path) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    tensors: dict = {}
    for p in sorted(d.glob("*.safetensors")):
        tensors.update(header(p))
    return {"hf_quant_config": json.loads((d / "hf_quant_config.json").read_text()),
            "quantization_config": cfg.get("quantization_config"), "tensors": dict(sorted(tensors.items()))}


def compare(case: str, ref: dict, ours: dict) -> list[str]:
    """Differences that matter between ModelOpt's summary (ref) and qtk's (ours), one line each."""
    diffs: list[str] = []
    if case.startswith("trtllm/"):
        for k, v in ref["config"].items():
            if k not in TRT_CONFIG_DIFFERENT and ours["config"].get(k, "<missing>") != v:
                diffs.append(f"config.{k}: modelopt {v!r}, qtk {ours['config'].get(k, '<missing>')!r}")
        pairs = [(r, ref["ranks"][r], ours["ranks"].get(r, {})) for r in ref["ranks"]]
        if set(ours["ranks"]) != set(ref["ranks"]):
            diffs.append(f"rank files: modelopt {sorted(ref['ranks'])}, qtk {sorted(ours['ranks'])}")
    else:
        for part in ("hf_quant_config", "quantization_config"):
            a, b = dict(ref[part]), dict(ours[part])
            if part == "hf_quant_config":
                a, b = a["quantization"], b["quantization"]
            for k in sorted(set(a) | set(b)):
                if k != "producer" and a.get(k, "<missing>") != b.get(k, "<missing>"):
                    diffs.append(f"{part}.{k}: modelopt {a.get(k, '<missing>')!r}, qtk {b.get(k, '<missing>')!r}")
        pairs = [("model", ref["tensors"], ours["tensors"])]
    for where, a, b in pairs:
        for name in sorted(set(a) | set(b)):
            if name not in b:
                diffs.append(f"{where}: qtk lacks {name} {a[name]}")
            elif name not in a:
                diffs.append(f"{where}: qtk has extra {name} {b[name]}")
            elif a[name] != b[name]:
                diffs.append(f"{where}: {name} modelopt {a[name]}, qtk {b[name]}")
    return diffs


def qtk_recipe(name: str):
    from qtk.recipe import load_recipe, parse_recipe

    return parse_recipe(INT8_STATIC_KV8, origin=name) if name == "int8-static-kv8" else load_recipe(name)


def qtk_summaries(tmp: Path, calib: Path) -> dict[str, dict]:
    """qtk's output for every case, on the reference model: one conversion per (recipe, tp)."""
    from qtk import api

    model = make_reference_model(tmp / "model")
    runs: dict[tuple[str, int], list[str]] = {}
    for case, (recipe, _, target, tp) in CASES.items():
        runs.setdefault((recipe, tp), []).append(target)
    out: dict[str, dict] = {}
    for (recipe, tp), targets in runs.items():
        d = tmp / f"{recipe}-tp{tp}"
        api.convert(model, qtk_recipe(recipe), d, targets=targets, calib=str(calib), num_samples=4, seq_len=32,
                    tp=tp, hash_source=False)
    for case, (recipe, _, target, tp) in CASES.items():
        d = tmp / f"{recipe}-tp{tp}" / target
        out[case] = summarize_trtllm(d) if target == "trtllm" else summarize_hf(d)
    return out


def convert(model, recipe, out, calib_file, **kw):
    """api.convert on the tiny models with a small calibration set; recipe: a name, a dict or a Recipe."""
    from qtk import api
    from qtk.recipe import parse_recipe

    if isinstance(recipe, dict):
        recipe = parse_recipe(recipe, origin=recipe["name"])
    return api.convert(model, recipe, out, calib=str(calib_file), num_samples=NS, seq_len=T, hash_source=False, **kw)
