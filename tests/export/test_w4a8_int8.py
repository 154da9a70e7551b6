"""W4A8-INT8 (the w4a8-int8 recipe: int4 groups of 128, dynamic per-token INT8 activations) as vLLM runs it.

vLLM loads it as CompressedTensorsW4A8Int (int-quantized: `weight` int8 [out, in] holding the codes, `weight_scale`
[out, in/128]) and runs it on CPUs through Dynamic4bitLinearKernel, which repacks the codes (+8, two per byte, even
column in the low nibble) with bf16 group scales into torch's aten._dyn_quant_pack_4bit_weight and calls
aten._dyn_quant_matmul_4bit. That kernel quantizes each input row to int8 asymmetrically (min/max with a zero point)
whatever `symmetric` the config says; qtk's simulation does the same (ModuleScheme.engine_activations). Here the
kernel itself (torch, on this CPU) is the engine: each written Linear run through it equals the simulated QLinear.

Weights: transformers + compressed-tensors reload the checkpoint with the simulation's logits in float32
(tests/export/test_formats_next_vllm.py); llm-compressor's W4A8 layout: tests/formats_reference/test_qtk_conformance.py.
"""

import pytest
import torch

from models import make_tiny_model
from qtk import api
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model


@pytest.fixture(scope="module")
def converted(tmp_path_factory, calib_file):
    model = make_tiny_model(tmp_path_factory.mktemp("m") / "aligned", hidden=256, intermediate=512, heads=2, kv_heads=1)
    out = api.convert(model, "w4a8-int8", tmp_path_factory.mktemp("out") / "o", calib=str(calib_file), num_samples=4,
                      seq_len=64, hash_source=False)
    return model, out.outputs["vllm"]


def _kernel(qt, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T as vLLM's CPU W4A8-INT8 kernel computes it (its process_weights_after_loading, then apply)."""
    out_f, in_f = qt.shape
    g = qt.scheme.group_size
    u = qt.values.to(torch.int16) + 8
    packed = ((u[:, 1::2] << 4) | u[:, ::2]).to(torch.uint8)
    w = torch.ops.aten._dyn_quant_pack_4bit_weight(packed, qt.scale.to(torch.bfloat16), None, g, in_f, out_f)
    return torch.ops.aten._dyn_quant_matmul_4bit(x, w, g, in_f, out_f)


def test_written_layout_is_what_compressed_tensors_w4a8_int_loads(converted):
    import json

    from safetensors import safe_open

    _, d = converted
    g = json.loads((d / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert g["format"] == "int-quantized"
    assert g["input_activations"] == {**g["input_activations"], "num_bits": 8, "type": "int", "strategy": "token",
                                      "dynamic": True, "symmetric": True}
    with safe_open(str(next(d.glob("*.safetensors"))), framework="pt") as f:
        w, s = f.get_tensor("model.layers.0.mlp.down_proj.weight"), f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert w.dtype == torch.int8 and list(w.shape) == [256, 512] and int(w.min()) >= -8 and int(w.max()) <= 7
    assert s.dtype == torch.bfloat16 and list(s.shape) == [256, 4]


def test_simulation_equals_vllms_cpu_kernel(converted):
    """Every Linear of the checkpoint: torch's dynamic 4-bit matmul against the simulated QLinear (float32). The
    symmetric per-token quantization the config states would be off by two orders of magnitude more."""
    from qtk.model.simulate import QLinear

    _, d = converted
    ck = open_checkpoint(d)
    sim = build_simulated_model(ck, simulate_kv=False)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(1))
    x[0] = x[0].abs()  # one all-positive row: the range still includes 0
    for m in ck.modules():
        qt = ck.qtensor(m)
        xin = x[:, : qt.shape[1]].contiguous()
        lin = sim.get_submodule(m)
        # the kernel scales int32 sums by the group scales in float32, it never forms q·s in bf16: the weight here is
        # q·s in float32 (the simulation's engine_weight rounds it to the model dtype, as compressed-tensors decodes)
        w = qt.dequantize().float()
        want, got = _kernel(qt, xin), QLinear(w, None, lin.act, None)(xin)
        sym = QLinear(w, None, ck.scheme_for(m).activations, None)(xin)
        err = (want - got).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), (m, err)
        assert (want - sym).abs().max().item() > 100 * max(err, 1e-7), m


@pytest.mark.parametrize("target", ["trtllm", "hf-modelopt"])
def test_w4a8_int8_is_refused_where_no_engine_runs_it_naming_vllm(converted, target, tmp_path):
    model, _ = converted
    with pytest.raises(UsageError) as e:
        api.convert(model, "w4a8-int8", tmp_path / "out", targets=[target], hash_source=False)
    assert ("QServe" if target == "trtllm" else "no HF export of int4 weights with INT8 activations") in e.value.problem
    assert "w4a8-fp8-static" in e.value.problem and e.value.fix == "use --target vllm"
    assert not (tmp_path / "out").exists()
