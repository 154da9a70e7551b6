"""`qtk plan` estimates `qtk convert`: time and peak memory per process and GPU, from qtk/plan/convert_cost.py's
cost model (constants from benchmarks/convert_cost.py)."""

import json

from click.testing import CliRunner

from qtk.plan.convert_cost import CPU_READ_BPS, CPU_WRITE_BPS, estimate_conversion
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


def test_data_free_conversion_is_disk_bound():
    est, src = _estimate("w4a16")
    io = src / CPU_READ_BPS + (src // 3) / CPU_WRITE_BPS
    assert est.parts["forward"] == 0 and est.parts["solve"] == 0
    assert est.seconds == io * (1 + 1 / 32)


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
