"""qtk against llm-compressor: same scheme, same model, same calibration token ids; wall time, peak RSS, perplexity.

    .venv/bin/python benchmarks/vs_llmcompressor.py [--repeats 3] [--layers 8] [--num-samples 32] [--seq-len 256]

Sets up llm-compressor in its own venv (benchmarks/.venv-llmc, git-ignored: it pins its own transformers and
compressed-tensors) when that venv is missing: torch==2.13.0 first (the CPU build on this disk; a looser torch
would pull a CUDA build of several GB), then `pip install llmcompressor`, whatever resolves beside that torch.

Schemes, as llm-compressor spells them (benchmarks/_llmc_driver.py) and the qtk recipe that matches them:
  w4a16-gptq    GPTQModifier(scheme="W4A16")        int4 group-128 symmetric weights, GPTQ
  w8a8-sq-gptq  SmoothQuantModifier(0.8) + GPTQModifier(scheme="W8A8")   int8 channel weights, dynamic per-token
                int8 activations; SmoothQuant then GPTQ
GPTQ settings are llm-compressor's defaults on both sides: block 128, dampening 0.01, act-order "static"
(qtk: actorder static, which writes the same "weight"-ordered checkpoint). What still differs: qtk's
GPTQ is true-sequential inside a layer (q/k/v, o, gate/up, down each see the quantized earlier sub-blocks),
llm-compressor takes all of a layer's Hessians in one pass; qtk's SmoothQuant also smooths up -> down (and
v -> o without GQA), llm-compressor's Llama mappings only the two norms, with 2x the weight range in s.

Three models:
  time: a random bf16 Llama from tests/models.py (default 8 layers, hidden 1024, intermediate 2816, 16 heads,
    4 KV heads, 181 MB), large enough that the algorithms' cost dominates start-up; --repeats runs per tool,
    alternating qtk and llm-compressor so drift in the machine's load hits both. Its peak RSS is recorded too, but
    is mostly the torch/transformers runtime (several hundred MB in either tool), not the model.
  memory: a larger random bf16 Llama (--rss-model, default 16 layers x hidden 2048, intermediate 5632, 16 heads,
    4 KV heads: 0.73 B parameters, 1.45 GB of safetensors), one run per tool and --rss-schemes. Real models are
    GBs; llm-compressor holds the whole model in memory and qtk one layer, so the RSS ratio is only meaningful on a
    model well above the runtime's own footprint. 16 x 2048 is the largest that converts in a few minutes per
    tool on this 2-core machine (its wall times are recorded as a second timing point); the ratio keeps falling
    for larger models, since qtk's peak depends on the layer width, not the depth (see --rss-depths).
  perplexity: examples/tiny-llama (a trained char-level Llama; a random model of its shape while it is not
    there), one run per tool, and the unquantized model.

Calibration ids are computed once per model with qtk.calib.calibration_ids on qtk/data/calib/default.jsonl, saved,
and fed unchanged to both tools (qtk: qtk.api.convert(calib_ids=ids); llm-compressor: a pre-tokenized dataset).
Each conversion runs in its own process, model loading included; peak RSS is that child's ru_maxrss, started
from a bare interpreter (Linux would otherwise count this process's own RSS as the child's: see run_measured). qtk writes
the vllm (compressed-tensors) target without hashing the source files (convert --no-hash), since
llm-compressor does not hash either; llm-compressor saves a compressed checkpoint (save_compressed=True).
Perplexity of every checkpoint is computed by the same code, in this process: qtk's reader and simulated model
(dequantized weights from disk, per-token int8 activations simulated for W8A8), BOS + text, exp(mean NLL) over
held-out prose (examples/tasks/prose.jsonl, else the corpus generator's evaluation seed).

Output: a table on stdout and benchmarks/results/vs_llmcompressor.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLMC_VENV = HERE / ".venv-llmc"
LLMC_PY = LLMC_VENV / "bin" / "python"
DRIVER = HERE / "_llmc_driver.py"
TINY = ROOT / "examples" / "tiny-llama"
PROSE = ROOT / "examples" / "tasks" / "prose.jsonl"
TORCH_PIN = "torch==2.13.0"
GOALS = {"time_ratio": 0.5, "rss_ratio": 0.3}

SCHEMES = ("w4a16-gptq", "w8a8-sq-gptq")
GPTQ = {"block_size": 128, "damp_percent": 0.01, "actorder": "static"}
QTK_RECIPES = {
    "w4a16-gptq": {
        "name": "bench-w4a16-gptq",
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
        "algorithm": [{"gptq": GPTQ}],
        "ignore": ["lm_head"],
    },
    "w8a8-sq-gptq": {
        "name": "bench-w8a8-sq-gptq",
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
        "algorithm": [{"smoothquant": {"alpha": 0.8}}, {"gptq": GPTQ}],
        "ignore": ["lm_head"],
    },
}
# Same threading for both children; passive OpenMP waiting keeps a shared 2-core machine from thrashing.
CHILD_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class LlmcUnavailable(Exception):
    """llm-compressor could not be installed or imported here; the message says why."""


# ---------------------------------------------------------------------------------------------- qtk child

def qtk_child(argv: list[str]) -> None:
    """One qtk conversion through qtk.api.convert, given the saved calibration ids (calib_ids=)."""
    ap = argparse.ArgumentParser(prog="vs_llmcompressor.py _qtk")
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--scheme", required=True, choices=SCHEMES)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    from qtk.api import convert
    from qtk.recipe import parse_recipe

    t_import = time.perf_counter() - t_start
    recipe = parse_recipe(QTK_RECIPES[a.scheme], json.dumps(QTK_RECIPES[a.scheme]), a.scheme)
    ids = torch.load(a.ids, weights_only=True)
    res = convert(a.model, recipe, a.out, targets=["vllm"], calib_ids=ids, batch_size=a.batch_size, hash_source=False)
    timings = {**res.timings, "import_s": t_import, "total_in_process": time.perf_counter() - t_start}
    (Path(a.out) / "timings.json").write_text(json.dumps(timings))


# ---------------------------------------------------------------------------------------------- llm-compressor venv

def _pip(*args: str, log) -> None:
    cmd = [str(LLMC_VENV / "bin" / "pip"), "install", "--disable-pip-version-check", *args]
    print("  $", " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        raise LlmcUnavailable(f"`pip {' '.join(cmd[1:])}` failed (exit {r.returncode}); see {log.name}")


def ensure_llmc_venv(log_dir: Path) -> dict[str, str]:
    """Create benchmarks/.venv-llmc with torch 2.13.0 (CPU, from this disk) and llmcompressor; return its versions."""
    if not LLMC_PY.exists():
        print(f"setting up llm-compressor in {LLMC_VENV.relative_to(ROOT)} (once)", flush=True)
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / "llmc-install.log", "w") as log:
            r = subprocess.run(["python3", "-m", "venv", str(LLMC_VENV)], stdout=log, stderr=subprocess.STDOUT, check=False)
            if r.returncode != 0:
                raise LlmcUnavailable(f"python3 -m venv {LLMC_VENV} failed; see {log.name}")
            try:
                _pip(TORCH_PIN, log=log)  # first: llmcompressor's loose torch range would otherwise take a CUDA build
                _pip("llmcompressor", TORCH_PIN, log=log)  # repeating the pin keeps the resolver from moving torch
            except LlmcUnavailable:
                import shutil

                shutil.rmtree(LLMC_VENV, ignore_errors=True)  # a half-built venv would be taken as ready next time
                raise
    r = subprocess.run([str(LLMC_PY), str(DRIVER), "--versions"], capture_output=True, text=True, env=_child_env(), check=False)
    if r.returncode != 0:
        raise LlmcUnavailable(f"llm-compressor does not import in {LLMC_VENV}: {r.stderr.strip().splitlines()[-1:]}"
                              f" (delete {LLMC_VENV} to reinstall)")
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------------------------- measuring

def _child_env() -> dict[str, str]:
    return {**os.environ, **CHILD_ENV}


# A parent's memory counts in its child's ru_maxrss: the child starts as a copy of the parent (fork, or vfork
# sharing its memory) and Linux keeps that high-water mark across exec. This process holds torch and models, so
# the measured command is started by a bare interpreter, whose own few MB are then the floor.
_LAUNCH = """import json, os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, ru = os.wait4(pid, 0)
out = {"wall_s": time.perf_counter() - t0, "maxrss_kb": ru.ru_maxrss, "exit": os.waitstatus_to_exitcode(status)}
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""


def run_measured(args: list[str], log: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a child, from the kernel's rusage for it. Output goes to `log`, not a
    pipe: llm-compressor logs enough to fill a pipe buffer and block before it is read."""
    res = log.with_suffix(".rusage.json")
    res.unlink(missing_ok=True)
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-S", "-c", _LAUNCH, str(res), *args], stdout=f, stderr=subprocess.STDOUT,
                       env=_child_env(), check=False)
    r = json.loads(res.read_text()) if res.is_file() else {"exit": "no result"}
    if r["exit"] != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(args[:3])} ... failed (exit {r['exit']}); last lines of {log}:\n" + "\n".join(tail))
    return r["wall_s"], r["maxrss_kb"] * 1024


def convert_qtk(model: Path, ids: Path, scheme: str, out: Path, log: Path, batch_size: int) -> dict:
    wall, rss = run_measured([sys.executable, str(Path(__file__).resolve()), "_qtk", "--model", str(model), "--ids", str(ids),
                              "--scheme", scheme, "--out", str(out), "--batch-size", str(batch_size)], log)
    stages = json.loads((out / "timings.json").read_text())
    return {"wall_s": wall, "peak_rss": rss, "stages_s": {k: round(v, 3) for k, v in stages.items()}, "ckpt": out / "vllm"}


def convert_llmc(model: Path, ids: Path, scheme: str, out: Path, log: Path, batch_size: int) -> dict:
    import re

    wall, rss = run_measured([str(LLMC_PY), str(DRIVER), "--model", str(model), "--ids", str(ids), "--scheme", scheme,
                              "--out", str(out), "--batch-size", str(batch_size)], log)
    # llm-compressor logs each GPTQ solve's time: their sum is its GPTQ share of the wall time
    solves = [float(x) for x in re.findall(r"GPTQ \| METRIC - time ([0-9.]+)s", log.read_text())]
    return {"wall_s": wall, "peak_rss": rss, "stages_s": {"gptq_solves": round(sum(solves), 3)}, "ckpt": out}


# ---------------------------------------------------------------------------------------------- perplexity

def heldout_texts(n: int) -> tuple[list[str], str]:
    if PROSE.is_file():
        rows = [json.loads(x) for x in PROSE.read_text().splitlines() if x.strip()]
        return [r["text"] for r in rows][:n], str(PROSE.relative_to(ROOT))
    sys.path.insert(0, str(ROOT / "examples"))
    import corpus

    return corpus.prose_examples(corpus.EVAL_SEED, n), f"examples/corpus.py prose_examples(EVAL_SEED={corpus.EVAL_SEED})"


def perplexity(model, tokenizer, texts: list[str], max_len: int) -> tuple[float, int]:
    """exp(mean NLL) of every text token after BOS, each text on its own (cut to max_len tokens)."""
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    with torch.inference_mode():
        for t in texts:
            ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False)["input_ids"]]])[:, :max_len]
            logits = model(input_ids=ids).logits.float()
            nll += float(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / count))), count


def checkpoint_ppl(d: Path, tokenizer, texts, max_len) -> float:
    """As the engine runs it: qtk's reader and simulated model (activation quantization included)."""
    from qtk.export import open_checkpoint
    from qtk.model.simulate import build_simulated_model

    return perplexity(build_simulated_model(open_checkpoint(d)), tokenizer, texts, max_len)[0]


def checkpoint_ppl_hf(d: Path, tokenizer, texts, max_len) -> float:
    """A second reader as a cross-check: transformers + compressed-tensors, weights dequantized, activations
    left in float (so for W8A8 this is the weights' share of the loss only)."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    return perplexity(m.eval(), tokenizer, texts, max_len)[0]


# ---------------------------------------------------------------------------------------------- main

def make_ids(model: Path, path: Path, n: int, seq_len: int, seed: int) -> str:
    import torch
    from transformers import AutoTokenizer

    from qtk.calib import calibration_ids, ids_hash, load_texts

    ids = calibration_ids(AutoTokenizer.from_pretrained(model), load_texts("default"), n, seq_len, seed)
    torch.save(ids, path)
    return ids_hash(ids)


def shape_of(model: Path) -> dict:
    cfg = json.loads((model / "config.json").read_text())
    from safetensors import safe_open

    params = 0
    for f in model.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118 (safe_open is not iterable)
                n = 1
                for d in s.get_slice(k).get_shape():
                    n *= d
                params += n
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "dtype")
    return {**{k: cfg.get(k, cfg.get("torch_dtype")) for k in keys}, "params": params,
            "safetensors_mb": round(sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e6, 1)}


def snapshot_tiny(work: Path) -> tuple[Path | None, str]:
    """A copy of examples/tiny-llama when it is complete, so both tools read the same files whatever changes there."""
    import shutil

    if not (all((TINY / f).is_file() for f in ("config.json", "tokenizer.json")) and any(TINY.glob("*.safetensors"))):
        return None, ""
    d = work / "tiny-llama"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(TINY, d)
    return d, "examples/tiny-llama (trained)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs per tool and scheme on the timing model (median)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the random timing model")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--qtk-batch-size", type=int, default=8, help="qtk convert's default")
    ap.add_argument("--llmc-batch-size", type=int, default=1, help="llm-compressor oneshot's default")
    ap.add_argument("--ppl-texts", type=int, default=200)
    ap.add_argument("--work", type=Path, default=HERE / "results" / "tmp" / "vs_llmcompressor", help="models, ids, outputs, logs")
    ap.add_argument("--rss-depths", type=int, nargs="*", default=[],
                    help="also one w4a16-gptq run per tool on random models of these depths (same width): peak RSS "
                         "against depth, since qtk's should stay flat and llm-compressor's grow with the model")
    ap.add_argument("--rss-model", default="16x2048", help="LAYERSxHIDDEN of the memory model ('' to skip it)")
    ap.add_argument("--rss-schemes", nargs="*", default=["w4a16-gptq"], choices=SCHEMES, help="schemes run on the memory model")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "vs_llmcompressor.json")
    a = ap.parse_args()

    import shutil

    work = a.work
    t_bench = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        llmc_versions = ensure_llmc_venv(work)
    except LlmcUnavailable as e:
        print(f"llm-compressor is not available here: {e}\nno comparison was run.", file=sys.stderr)
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"error": f"llm-compressor unavailable: {e}"}, indent=2) + "\n")
        raise SystemExit(2)
    from qtk.convert.manifest import versions as _versions

    sys.path.insert(0, str(HERE))
    from _common import make_tiny_model

    work.mkdir(parents=True, exist_ok=True)
    big_dir = work / f"random-llama-{a.layers}L"
    if not (big_dir / "config.json").is_file():
        print(f"building the random timing model in {big_dir}", flush=True)
        make_tiny_model(big_dir, layers=a.layers, hidden=1024, intermediate=2816, heads=16, kv_heads=4)
    # snapshot now, or after the timing runs if a tiny-llama is being (re)trained meanwhile
    ppl_dir, ppl_model = snapshot_tiny(work)
    ids_files = {k: work / f"calib-ids-{k}.pt" for k in ("timing", "perplexity")}
    hashes = {"timing": make_ids(big_dir, ids_files["timing"], a.num_samples, a.seq_len, a.seed)}

    def out_dir(name):
        d = work / name
        shutil.rmtree(d, ignore_errors=True)
        return d

    runs = {"qtk": convert_qtk, "llmcompressor": convert_llmc}
    bs = {"qtk": a.qtk_batch_size, "llmcompressor": a.llmc_batch_size}
    result = {s: {"timing": {t: [] for t in runs}, "perplexity_run": {}} for s in a.schemes}
    for s in a.schemes:
        for r in range(a.repeats):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for tool in order:
                m = runs[tool](big_dir, ids_files["timing"], s, out_dir(f"out-{tool}-{s}-timing"), work / f"{tool}-{s}-timing-{r}.log", bs[tool])
                result[s]["timing"][tool].append(m)
                print(f"{s:13s} run {r + 1}/{a.repeats} {tool:13s} {m['wall_s']:7.1f} s  {m['peak_rss'] / 1e6:7.0f} MB", flush=True)

    by_depth = []
    for n in a.rss_depths:
        d = work / f"random-llama-{n}L"
        if not (d / "config.json").is_file():
            make_tiny_model(d, layers=n, hidden=1024, intermediate=2816, heads=16, kv_heads=4)
        ids = work / f"calib-ids-{n}L.pt"
        make_ids(d, ids, a.num_samples, a.seq_len, a.seed)
        row = {"layers": n, "safetensors_mb": shape_of(d)["safetensors_mb"]}
        for tool, convert in runs.items():
            m = convert(d, ids, "w4a16-gptq", out_dir(f"out-{tool}-depth"), work / f"{tool}-depth-{n}L.log", bs[tool])
            row[tool] = {"wall_s": round(m["wall_s"], 2), "peak_rss_mb": round(m["peak_rss"] / 1e6, 1)}
        row["rss_ratio"] = round(row["qtk"]["peak_rss_mb"] / row["llmcompressor"]["peak_rss_mb"], 3)
        by_depth.append(row)
        print(f"depth {n:3d} ({row['safetensors_mb']:.0f} MB): qtk {row['qtk']['peak_rss_mb']:.0f} MB, "
              f"llmcompressor {row['llmcompressor']['peak_rss_mb']:.0f} MB, ratio {row['rss_ratio']:.3f}", flush=True)

    memory = None
    if a.rss_model:
        n_layers, hidden = (int(x) for x in a.rss_model.lower().split("x"))
        inter = {1024: 2816, 2048: 5632, 4096: 11008}.get(hidden, 4 * hidden)
        d = work / f"random-llama-{n_layers}x{hidden}"
        if not (d / "config.json").is_file():
            print(f"building the random memory model in {d}", flush=True)
            make_tiny_model(d, layers=n_layers, hidden=hidden, intermediate=inter, heads=16, kv_heads=4)
        ids = work / f"calib-ids-{n_layers}x{hidden}.pt"
        hashes["memory"] = make_ids(d, ids, a.num_samples, a.seq_len, a.seed)
        memory = {"model": {"source": f"tests/models.py make_tiny_model (random, bf16), {n_layers} layers x hidden {hidden}",
                            **shape_of(d)}, "schemes": {}}
        for s in a.rss_schemes:
            row = {}
            for tool in (list(runs) if len(memory["schemes"]) % 2 == 0 else list(runs)[::-1]):
                m = runs[tool](d, ids, s, out_dir(f"out-{tool}-memory"), work / f"{tool}-{s}-memory.log", bs[tool])
                row[tool] = {"wall_s": round(m["wall_s"], 2), "peak_rss_mb": round(m["peak_rss"] / 1e6, 1), "stages_s": m["stages_s"]}
                print(f"{s:13s} memory model {tool:13s} {m['wall_s']:7.1f} s  {m['peak_rss'] / 1e6:7.0f} MB", flush=True)
            row["ratios_qtk_over_llmcompressor"] = {
                "rss": round(row["qtk"]["peak_rss_mb"] / row["llmcompressor"]["peak_rss_mb"], 3),
                "time": round(row["qtk"]["wall_s"] / row["llmcompressor"]["wall_s"], 3)}
            row["goals_met"] = {"rss": row["ratios_qtk_over_llmcompressor"]["rss"] <= GOALS["rss_ratio"]}
            memory["schemes"][s] = row
        shutil.rmtree(work / "out-qtk-memory", ignore_errors=True)  # GBs of checkpoints nobody reads
        shutil.rmtree(work / "out-llmcompressor-memory", ignore_errors=True)

    ppl_dir, ppl_model = snapshot_tiny(work) if ppl_dir is None else (ppl_dir, ppl_model)
    if ppl_dir is None:  # the trained example is not there: a random model of its shape keeps the harness running
        ppl_dir, ppl_model = work / "random-tiny-llama", "random model of tiny-llama's shape (examples/tiny-llama absent)"
        if not (ppl_dir / "config.json").is_file():
            make_tiny_model(ppl_dir, layers=4, hidden=128, intermediate=512, heads=4, kv_heads=2, head_dim=32)
    print(f"perplexity model: {ppl_model}", flush=True)
    hashes["perplexity"] = make_ids(ppl_dir, ids_files["perplexity"], a.num_samples, a.seq_len, a.seed)
    for s in a.schemes:
        for tool, convert in runs.items():
            d = out_dir(f"out-{tool}-{s}-ppl")
            m = convert(ppl_dir, ids_files["perplexity"], s, d, work / f"{tool}-{s}-ppl.log", bs[tool])
            result[s]["perplexity_run"][tool] = m

    # perplexity: the same code for every checkpoint
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts, texts_src = heldout_texts(a.ppl_texts)
    tok = AutoTokenizer.from_pretrained(ppl_dir)
    max_len = json.loads((ppl_dir / "config.json").read_text()).get("max_position_embeddings", 512)
    base = AutoModelForCausalLM.from_pretrained(ppl_dir, dtype=torch.float32).eval()
    base_ppl, n_tokens = perplexity(base, tok, texts, max_len)
    del base

    report = {
        "benchmark": "benchmarks/vs_llmcompressor.py",
        "command": " ".join([".venv/bin/python", "benchmarks/vs_llmcompressor.py", *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"qtk_venv": _versions(), "llmcompressor_venv": llmc_versions, "python": sys.version.split()[0]},
        "machine": {"cpus": os.cpu_count(), "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
                    "loadavg_1_5_15_at_start": load_start,
                    "note": "shared cores: other jobs may run beside this benchmark, so compare the paired ratios"},
        "settings": {"num_samples": a.num_samples, "seq_len": a.seq_len, "seed": a.seed, "repeats": a.repeats,
                     "batch_size": bs, "child_env": CHILD_ENV, "qtk_recipes": {s: QTK_RECIPES[s] for s in a.schemes},
                     "calib_ids_sha256_16": hashes, "calibration_corpus": "qtk/data/calib/default.jsonl"},
        "models": {"timing": {"source": f"tests/models.py make_tiny_model (random, bf16), {a.layers} layers", **shape_of(big_dir)},
                   "perplexity": {"source": ppl_model, **shape_of(ppl_dir)}},
        "perplexity_eval": {"texts": texts_src, "n_texts": len(texts), "tokens": n_tokens,
                            "method": "qtk simulated model from each checkpoint (fp32, dequantized weights, activations "
                                      "fake-quantized as the engine does); BOS + text; exp(mean NLL). Cross-check: "
                                      "transformers + CompressedTensorsConfig(dequantize=True), float activations"},
        "unquantized_perplexity": round(base_ppl, 4),
        "goals": {"time_ratio_max": GOALS["time_ratio"], "rss_ratio_max": GOALS["rss_ratio"], "perplexity": "qtk <= llmcompressor"},
        "schemes": {},
    }
    rows = []
    for s in a.schemes:
        t = result[s]["timing"]
        entry = {}
        for tool in runs:
            walls = [m["wall_s"] for m in t[tool]]
            rss = [m["peak_rss"] for m in t[tool]]
            pr = result[s]["perplexity_run"][tool]
            entry[tool] = {"wall_s": [round(w, 2) for w in walls], "wall_s_median": round(statistics.median(walls), 2),
                           "peak_rss_mb": [round(x / 1e6, 1) for x in rss], "peak_rss_mb_median": round(statistics.median(rss) / 1e6, 1),
                           "stages_s": [m["stages_s"] for m in t[tool]],
                           "perplexity": round(checkpoint_ppl(pr["ckpt"], tok, texts, max_len), 4),
                           "perplexity_hf_dequantized_weights_only": round(checkpoint_ppl_hf(pr["ckpt"], tok, texts, max_len), 4),
                           "perplexity_model_run": {"wall_s": round(pr["wall_s"], 2), "peak_rss_mb": round(pr["peak_rss"] / 1e6, 1)}}
        q, l = entry["qtk"], entry["llmcompressor"]
        pair_time = [a_["wall_s"] / b_["wall_s"] for a_, b_ in zip(t["qtk"], t["llmcompressor"])]
        pair_rss = [a_["peak_rss"] / b_["peak_rss"] for a_, b_ in zip(t["qtk"], t["llmcompressor"])]
        ratios = {"time": round(q["wall_s_median"] / l["wall_s_median"], 3),
                  "time_per_pair_median": round(statistics.median(pair_time), 3),
                  "rss": round(q["peak_rss_mb_median"] / l["peak_rss_mb_median"], 3),
                  "rss_per_pair_median": round(statistics.median(pair_rss), 3)}
        entry["ratios_qtk_over_llmcompressor"] = ratios
        mem = (memory or {}).get("schemes", {}).get(s)
        rss_ratio = mem["ratios_qtk_over_llmcompressor"]["rss"] if mem else ratios["rss"]
        entry["goals_met"] = {"time": ratios["time_per_pair_median"] <= GOALS["time_ratio"], "rss": rss_ratio <= GOALS["rss_ratio"],
                              "perplexity": q["perplexity"] <= l["perplexity"],
                              "measured_on": {"time": "timing model, median of paired ratios",
                                              "rss": "memory model" if mem else "timing model"}}
        report["schemes"][s] = entry
        rows.append((s, q, l, ratios))
    if memory:
        report["memory_model"] = memory
    if by_depth:
        report["rss_by_depth_w4a16_single_runs"] = by_depth
    report["benchmark_wall_s"] = round(time.perf_counter() - t_bench, 1)

    print()
    print(f"timing model: {report['models']['timing']['params'] / 1e6:.0f}M params ({a.layers} layers, bf16); "
          f"calibration {a.num_samples} x {a.seq_len} tokens; median of {a.repeats} runs")
    print(f"perplexity: {ppl_model} on {n_tokens} held-out tokens ({texts_src}); unquantized {base_ppl:.4f}")
    print(f"{'scheme':13s} {'tool':13s} {'wall s':>8s} {'peak MB':>8s} {'ppl':>9s}")
    for s, q, l, ratios in rows:
        for name, e in (("qtk", q), ("llmcompressor", l)):
            print(f"{s:13s} {name:13s} {e['wall_s_median']:8.1f} {e['peak_rss_mb_median']:8.0f} {e['perplexity']:9.4f}")
        ok = report["schemes"][s]["goals_met"]
        print(f"{s:13s} {'qtk/llmc':13s} {ratios['time_per_pair_median']:8.3f} {ratios['rss']:8.3f}   "
              f"goals (time <= {GOALS['time_ratio']}, RSS <= {GOALS['rss_ratio']}, ppl <=): "
              f"{'met' if ok['time'] else 'MISSED'}, {'met' if ok['rss'] else 'MISSED'}, {'met' if ok['perplexity'] else 'MISSED'}")
    if memory:
        mm = memory["model"]
        print(f"memory model: {mm['params'] / 1e6:.0f}M params ({mm['safetensors_mb']:.0f} MB), one run per tool")
        for s, row in memory["schemes"].items():
            print(f"{s:13s} qtk {row['qtk']['peak_rss_mb']:.0f} MB {row['qtk']['wall_s']:.0f} s, llmcompressor "
                  f"{row['llmcompressor']['peak_rss_mb']:.0f} MB {row['llmcompressor']['wall_s']:.0f} s: "
                  f"RSS ratio {row['ratios_qtk_over_llmcompressor']['rss']:.3f}, time ratio {row['ratios_qtk_over_llmcompressor']['time']:.3f}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {a.json.relative_to(ROOT) if a.json.is_relative_to(ROOT) else a.json}; total {report['benchmark_wall_s']:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_qtk":
        qtk_child(sys.argv[2:])
    else:
        main()
