"""`qtk plan` estimates `qtk convert`: time and peak memory per process and GPU, from qtk/plan/convert_cost.py's
cost model (constants from benchmarks/convert_cost.py)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from qtk.plan.convert_cost import CPU_READ_BPS, CPU_STREAM_PARAMS_PER_S, CPU_WRITE_BPS, estimate_conversion
from qtk.plan.hardware import get_gpu
from qtk.plan.memory import DTYPE_BYTES, ModelShape, conversion_memory, model_tensors
from qtk.recipe import load_recipe

CFG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
       "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
       "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def _estimate(recipe, **kw):
    s = ModelShape.from_config(CFG)
    r = load_recipe(recipe)
    src = sum(x.numel for x in model_tensors(s)) * DTYPE_BYTES[s.dtype]
    return estimate_conversion(s, r, conversion_memory(s, r), src, src // 3, **kw), src


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "convert_io_datafree_llama3_8b.json"
FORMAT_OF = {"fp8-dynamic": "fp8", "w8a16": "int8", "w4a16": "int4", "nvfp4-a16": "nvfp4", "mxfp4-a16": "mx",
             "fp8-block": "fp8-block"}


def test_a_data_free_conversion_is_the_slower_of_its_disk_and_its_stream():
    est, src = _estimate("w4a16")
    io = src / CPU_READ_BPS + (src // 3) / CPU_WRITE_BPS
    assert est.parts["forward"] == 0 and est.parts["solve"] == 0
    s = ModelShape.from_config(CFG)
    linears = sum(x.numel for x in model_tensors(s) if x.role == "linear" and x.layer is not None)
    assert est.parts["stream"] == pytest.approx(linears / CPU_STREAM_PARAMS_PER_S["int4"], rel=1e-12)
    assert est.seconds == max(io, est.parts["stream"]) + io / 32
    fp8, nvfp4 = _estimate("fp8-dynamic")[0], _estimate("nvfp4-a16")[0]
    # each format streams at its own measured rate (the benchmark's figures)
    assert nvfp4.parts["stream"] / fp8.parts["stream"] == pytest.approx(
        CPU_STREAM_PARAMS_PER_S["fp8"] / CPU_STREAM_PARAMS_PER_S["nvfp4"], rel=1e-12)
    gpu = _estimate("fp8-dynamic", gpu=get_gpu("h200"))[0]
    assert gpu.parts["stream"] < fp8.parts["stream"] and gpu.device_peak > 0 and gpu.processes == 1


def test_the_streams_constants_are_the_benchmarks():
    """CPU_STREAM_PARAMS_PER_S and CPU_PROCESS_BYTES are what benchmarks/convert_io.py recorded (its per-layer slope,
    its peak RSS per weight format), and the estimate's host memory bounds every measured data-free run on those
    shapes from above, by at most the 10 MB the constants are rounded up to."""
    data = json.loads(RESULTS.read_text())
    for label, per in data["per_layer"].items():
        fmt = FORMAT_OF[label.split()[0]]
        assert abs(CPU_STREAM_PARAMS_PER_S[fmt] - per["params_per_s"]) <= 0.5e6, (fmt, per)
    cfg = {**CFG, "num_hidden_layers": 6}
    s = ModelShape.from_config(cfg)
    src = sum(x.numel for x in model_tensors(s)) * DTYPE_BYTES[s.dtype]
    for label, r in data["results"]["6"].items():
        recipe = load_recipe(label.split()[0])
        est = estimate_conversion(s, recipe, conversion_memory(s, recipe), src, int(r["output_mb"] * 1e6))
        measured = r["peak_rss_mb"] * 1e6
        assert measured <= est.host_peak <= measured + 10e6, (label, measured, est.host_peak)


def test_gptq_on_gpus_and_processes():
    cpu, _ = _estimate("w4a16-gptq")
    gpu, _ = _estimate("w4a16-gptq", gpu=get_gpu("h200"))
    four, _ = _estimate("w4a16-gptq", gpu=get_gpu("h200"), processes=4)
    assert gpu.seconds < cpu.seconds / 10
    assert four.parts["forward"] == gpu.parts["forward"] / 4 and four.parts["reduce"] > 0
    assert 0 < gpu.device_peak < get_gpu("h200").mem_bytes and cpu.device_peak == 0
    assert four.device_peak < gpu.device_peak  # each GPU holds a quarter of the activations


def test_plan_cli_reports_the_estimate(tmp_path):
    from qtk.plan.cli import plan

    (tmp_path / "config.json").write_text(json.dumps(CFG))
    r = CliRunner().invoke(plan, [str(tmp_path), "--recipe", "w4a16-gptq", "--gpu", "h200", "--convert-on", "gpu",
                                  "--convert-processes", "2", "--json"])
    assert r.exit_code == 0, r.output
    est = json.loads(r.output)["conversion_estimate"]
    assert est["device"] == "h200" and est["processes"] == 2 and est["seconds"] > 0 and est["device_peak"] > 0
