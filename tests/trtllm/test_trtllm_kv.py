"""INT8 KV factors equal max(amax K, amax V) / 127, with K taken after RoPE, measured here independently: the
checkpoint's model is run on the calibration tokens with an attention function of this test's own that
records |K| and |V| as the cache would receive them."""

import json

import pytest
import torch
from safetensors.torch import load_file
from trtllm_helpers import NS, T, convert

from models import make_tiny_model
from qtk.calib import calibration_ids, ids_hash, load_texts
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model

PROBE = "kv_probe_trtllm_test"


def measure_kv_amax(model, ids) -> dict[int, tuple[float, float]]:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen: dict[int, list[float]] = {}

    def probe(module, query, key, value, attention_mask, **kw):  # key: after RoPE, before the GQA repeat
        a = seen.setdefault(module.layer_idx, [0.0, 0.0])
        a[0], a[1] = max(a[0], float(key.abs().amax())), max(a[1], float(value.abs().amax()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(PROBE, probe)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    model.config._attn_implementation = PROBE
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return {i: tuple(v) for i, v in seen.items()}


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_int8_kv_factor_is_max_amax_over_127(kv_heads, calib_file, tmp_path):
    m = make_tiny_model(tmp_path / "m", hidden=128, intermediate=256, heads=4, kv_heads=kv_heads, layers=3)
    out = convert(m, "int8-kv8", tmp_path / "o", calib_file, targets=["vllm", "trtllm"], tp=1).outputs
    man = json.loads((out["trtllm"] / "qtk.json").read_text())
    ck = open_checkpoint(out["vllm"])  # the same QTensors; its model is what calibration propagated through
    ids = calibration_ids(load_tokenizer(m), load_texts(str(calib_file)), NS, T, man["calibration"]["seed"])
    assert ids_hash(ids) == man["calibration"]["token_hash"]  # the very tokens the conversion calibrated on
    # in the model dtype (bf16), as the engine and qtk's calibration run the layers
    amax = measure_kv_amax(build_simulated_model(ck, simulate_kv=False, dtype=torch.bfloat16), ids)
    f = load_file(str(out["trtllm"] / "rank0.safetensors"))
    cfg = json.loads((out["trtllm"] / "config.json").read_text())
    assert cfg["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert len(amax) == 3
    for i, (k, v) in amax.items():
        p = f"transformer.layers.{i}.attention."
        assert float(f[p + "k_cache_scaling_factor"]) == pytest.approx(k / 127, rel=1e-5)
        assert float(f[p + "v_cache_scaling_factor"]) == pytest.approx(v / 127, rel=1e-5)
        assert float(f[p + "kv_cache_scaling_factor"]) == pytest.approx(max(k, v) / 127, rel=1e-5)
        assert f[p + "kv_cache_scaling_factor"].dtype == torch.float32 and f[p + "kv_cache_scaling_factor"].shape == (1,)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
