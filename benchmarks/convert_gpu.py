"""qtk against llm-compressor on one GPU: GPTQ W4A16 g128 and FP8 (static activations) of a random Llama with
Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32/8 heads, vocab 128256), 8 decoder layers, 512 x 2048
calibration tokens, both tools on the same token ids. Reports per-layer time, the time extrapolated to 32 layers,
peak GPU memory and peak host RSS of each tool (goals, issue 13: GPTQ W4A16 <= 5 min for 32 layers, time and peak
GPU memory each <= 0.5x llm-compressor's).

UNMEASURED: no GPU was lent to the session that wrote this. The command, on one H200 machine without network
(its Python has torch 2.11 and transformers 5.17; qtk's other dependencies and llm-compressor travel as wheels,
llm-compressor in its own directory because it pins its own compressed-tensors), from the repository root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/qtk/*.whl && \
    python3 -m pip install -q --no-index --no-deps --target /tmp/llmc .whl/llmc/*.whl && \
    PYTHONPATH=/tmp/site python3 benchmarks/convert_gpu.py --llmc-site /tmp/llmc --json $OUT/convert_gpu.json

(about 8 minutes: building the 5.6 GB model ~1 min, qtk 2 recipes, llm-compressor 2 recipes; --skip-llmc halves it).
qtk itself runs from this checkout (the child processes put the repository first on PYTHONPATH). The wheels,
fetched in advance with `pip download --no-deps` (see the device notes for the platform flags) into the git-ignored
.whl/: .whl/qtk holds qtk's requirements that the machine lacks (compressed-tensors 0.20.x, safetensors, click,
rich, pyyaml; torch and transformers are the machine's); .whl/llmc holds llmcompressor with the compressed-tensors
it pins, accelerate, datasets and their needs (its directory comes first on PYTHONPATH in its process only).

On the CPU its logic runs on a tiny shape (tests/test_benchmarks_gpu.py):

    .venv/bin/python benchmarks/convert_gpu.py --tiny --device cpu --skip-llmc

Each tool runs in its own process: peak host RSS is that process's ru_maxrss, peak GPU memory its
torch.cuda.max_memory_allocated (qtk: layer, solver state, activations; the rest spills to pinned host memory).
Per-layer time: qtk's from its on_layer callback (median of the layers); llm-compressor's is its total less model
loading, divided by the layers (it has no per-layer hook from outside). The 32-layer time: the run's total plus 24
more median layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # Llama-3-8B, and a tiny one for the CPU test of this script
    "8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    "tiny": dict(hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=512),
}
# the recipes both tools run: qtk recipe -> llm-compressor's config for benchmarks/_llmc_driver.py
RECIPES = {
    "w4a16-gptq": {"modifiers": [{"type": "GPTQModifier", "kwargs": {"scheme": "W4A16", "targets": "Linear",
                                                                    "ignore": ["lm_head"]}}]},
    "fp8": {"modifiers": [{"type": "QuantizationModifier", "kwargs": {"scheme": "FP8", "targets": "Linear",
                                                                      "ignore": ["lm_head"]}}]},
}


def build_model(path: Path, layers: int, shape: dict, device: str, seq_len: int) -> Path:
    """A random bf16 Llama of `shape` written shard by shard (one layer per shard), generated on `device`."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from models import save_char_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    h, f, nh, kv, v = shape["hidden"], shape["intermediate"], shape["heads"], shape["kv_heads"], shape["vocab"]
    hd = h // nh
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s, std=0.02):
        return (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * std).to(torch.bfloat16).cpu()

    weight_map, shards = {}, []

    def shard(name, tensors):
        fn = f"model-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / fn), metadata={"format": "pt"})
        shards.append(fn)
        weight_map.update({k: fn for k in tensors})

    shard("embed", {"model.embed_tokens.weight": rnd(v, h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(p, {p + "self_attn.q_proj.weight": rnd(nh * hd, h), p + "self_attn.k_proj.weight": rnd(kv * hd, h),
                  p + "self_attn.v_proj.weight": rnd(kv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nh * hd),
                  p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
                  p + "mlp.down_proj.weight": rnd(h, f),
                  p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    shard("head", {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": rnd(v, h)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": f,
           "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": kv, "head_dim": hd,
           "vocab_size": v, "max_position_embeddings": max(8192, seq_len), "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_char_tokenizer(path)
    return path


QTK_CHILD = r"""
import json, resource, sys, time, torch
from qtk import api
model, recipe, out, ids_path, device, report = sys.argv[1:7]
ids = torch.load(ids_path, weights_only=True)
marks = []
t0 = time.perf_counter()
res = api.convert(model, recipe, out, calib_ids=ids, device=device, hash_source=False, overwrite=True,
                  batch_size=int(sys.argv[7]), on_layer=lambda d, n, l: marks.append(time.perf_counter()))
total = time.perf_counter() - t0
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and device != "cpu" else 0
layer_s = [b - a for a, b in zip([t0 + res.timings.get("capture", 0.0)] + marks[:-1], marks)]
json.dump({"total_s": total, "layer_s": layer_s, "timings": res.timings, "peak_gpu_bytes": gpu,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, open(report, "w"))
"""


def run_qtk(model: Path, recipe: str, out: Path, ids: Path, device: str, batch_size: int, tmp: Path) -> dict:
    report = tmp / f"qtk-{recipe}.json"
    cmd = [sys.executable, "-c", QTK_CHILD, str(model), recipe, str(out), str(ids), device, str(report), str(batch_size)]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    return json.loads(report.read_text())


LLMC_CHILD = r"""
import json, resource, runpy, sys, time
import torch
report = sys.argv[1]
sys.argv = ["_llmc_driver.py"] + sys.argv[2:]
t0 = time.perf_counter()
runpy.run_path(__import__("os").environ["QTK_LLMC_DRIVER"], run_name="__main__")
total = time.perf_counter() - t0
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
json.dump({"total_s": total, "peak_gpu_bytes": gpu,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, open(report, "w"))
"""


def run_llmc(site: Path, model: Path, recipe: str, out: Path, ids: Path, batch_size: int, tmp: Path) -> dict:
    """llm-compressor's oneshot in a process whose imports come from `site` first (its own compressed-tensors)."""
    cfg = tmp / f"llmc-{recipe}.json"
    cfg.write_text(json.dumps({**RECIPES[recipe], "calibrate": True}))
    report = tmp / f"llmc-{recipe}-report.json"
    env = {**os.environ, "PYTHONPATH": str(site), "QTK_LLMC_DRIVER": str(ROOT / "benchmarks" / "_llmc_driver.py")}
    subprocess.run([sys.executable, "-c", LLMC_CHILD, str(report), "--model", str(model), "--ids", str(ids),
                    "--config", str(cfg), "--out", str(out), "--batch-size", str(batch_size)], check=True, env=env)
    return json.loads(report.read_text())


def summarise(tool: str, recipe: str, r: dict, layers: int) -> dict:
    import statistics

    per_layer = statistics.median(r["layer_s"]) if r.get("layer_s") else r["total_s"] / layers
    return {"tool": tool, "recipe": recipe, "total_s": round(r["total_s"], 2), "per_layer_s": round(per_layer, 3),
            "extrapolated_32_layers_s": round(r["total_s"] + (32 - layers) * per_layer, 1),
            "peak_gpu_gib": round(r["peak_gpu_bytes"] / 2**30, 2), "peak_rss_gib": round(r["peak_rss_bytes"] / 2**30, 2)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (tests the script's logic on the CPU)")
    ap.add_argument("--device", default="auto", help="qtk's --device [auto]")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--llmc-site", type=Path, default=None, help="directory holding llm-compressor and its own deps")
    ap.add_argument("--skip-llmc", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the model and outputs here [a temp dir]")
    a = ap.parse_args(argv)
    if a.tiny:
        a.num_samples, a.seq_len, a.layers = min(a.num_samples, 4), min(a.seq_len, 32), min(a.layers, 2)
    shape = SHAPES["tiny" if a.tiny else "8b"]
    import torch

    gen_device = "cuda" if torch.cuda.is_available() and a.device != "cpu" else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(dir=a.workdir) as td:
        tmp = Path(td)
        t0 = time.perf_counter()
        model = build_model(tmp / "model", a.layers, shape, gen_device, a.seq_len)
        print(f"model: {a.layers} layers of {shape} in {time.perf_counter() - t0:.0f}s", flush=True)
        ids = tmp / "ids.pt"
        torch.save(torch.randint(3, shape["vocab"], (a.num_samples, a.seq_len), generator=torch.Generator().manual_seed(0)), ids)
        for recipe in a.recipes:
            r = run_qtk(model, recipe, tmp / f"qtk-{recipe}", ids, a.device, a.batch_size, tmp)
            rows.append(summarise("qtk", recipe, r, a.layers))
            print(json.dumps(rows[-1]), flush=True)
            if a.skip_llmc or a.llmc_site is None:
                continue
            r = run_llmc(a.llmc_site, model, recipe, tmp / f"llmc-{recipe}", ids, a.batch_size, tmp)
            rows.append(summarise("llm-compressor", recipe, r, a.layers))
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
