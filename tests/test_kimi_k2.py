"""Kimi-K2: DeepSeek-V3's architecture under its own model_type, which transformers has no class for. qtk reads its
config.json with DeepseekV3Config (as vLLM's config registry does), never with the code its auto_map names, and
converts it exactly as it converts the same model labelled deepseek_v3: the same bytes for every tensor; the
output keeps the source's model_type and auto_map, which vLLM and the model's own code read."""

import json
import shutil

import pytest
from models import make_tiny_model
from safetensors import safe_open

from qtk import api
from test_architectures import DEEPSEEK

# Kimi-K2's config.json names its architecture and its remote code so
KIMI = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    ds = make_tiny_model(root / "deepseek", model_type="deepseek_v3", layers=3, hidden=128, intermediate=256, **DEEPSEEK)
    kimi = root / "kimi"
    shutil.copytree(ds, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**cfg, **KIMI}, indent=2))
    # the remote code its auto_map names: were it imported, the conversion would fail
    (kimi / "configuration_deepseek.py").write_text("raise RuntimeError('remote code ran')\n")
    return ds, kimi


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("recipe", ["w4a16-gptq", "fp8-dynamic"])
def test_converts_as_deepseek_v3_byte_for_byte(pair, calib_file, tmp_path, recipe):
    ds, kimi = pair
    kw = dict(calib=str(calib_file), num_samples=4, seq_len=48, hash_source=False)
    a = api.convert(ds, recipe, tmp_path / "ds", **kw).outputs["vllm"]
    b = api.convert(kimi, recipe, tmp_path / "kimi", **kw).outputs["vllm"]
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 0
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].equal(tb[k]), k
    cfg = json.loads((b / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["auto_map"] == KIMI["auto_map"]
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert json.loads((b / "config.json").read_text())["quantization_config"] == \
        json.loads((a / "config.json").read_text())["quantization_config"]
    report = api.inspect(b)
    assert report.ok, [c for c in report.checks if not c.ok]


def test_plan_counts_it_as_deepseek_v3(pair):
    ds, kimi = pair
    a = api.plan(ds, recipe="w4a16", gpu="h100-80g", context=4096, concurrency=8)
    b = api.plan(kimi, recipe="w4a16", gpu="h100-80g", context=4096, concurrency=8)
    assert a.as_dict()["memory"] == b.as_dict()["memory"] and a.memory.weights > 0 and a.memory.kv_per_token_per_gpu > 0
