"""The issue-14 recipes written for vLLM (compressed-tensors), judged by real clients:

- compressed-tensors' own compressors decompress every written module to exactly qtk's decoded weight;
- transformers + compressed-tensors reload each checkpoint with the logits of qtk's simulation: weights only in
  float32 (CompressedTensorsConfig(dequantize=True)), and the run-time path with activations quantized (NVFP4
  W4A4's per-token groups of 16 under the static global input scale, FP8 block's per-token groups of 128, MXFP8
  W8A8's blocks of 32 under run-time E8M0 scales) in bf16,
  the dtype compressed-tensors 0.20 runs NVFP4 in;
- NVFP4 global scales are shared across fused q/k/v and gate/up, on disk.

The model is a random Llama whose Linears are multiples of 128 both ways (FP8 blocks tile it); tests/test_convert.py
runs the recipes that fit them on tests' tiny Llama and examples/tiny-llama.
"""

import json

import pytest
import torch
from safetensors import safe_open

from models import bf16_runtime_logits, make_tiny_model
from qtk import api
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model, engine_weight

NEW = ("nvfp4", "nvfp4-gptq", "nvfp4-kv8", "nvfp4-a16", "mxfp4-a16", "mxfp8-a16", "mxfp8", "fp8-block", "fp8-block-kv8",
       "w4a8-fp8", "w4a8-int8")
# recipes whose activation quantization compressed-tensors' run-time path reproduces bit for bit in bf16
RUNTIME = ("nvfp4", "nvfp4-gptq", "nvfp4-a16", "mxfp4-a16", "mxfp8-a16", "mxfp8", "fp8-block")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, calib_file):
    model = make_tiny_model(tmp_path_factory.mktemp("m") / "aligned", hidden=256, intermediate=512, heads=2, kv_heads=1)
    root = tmp_path_factory.mktemp("out")
    return {r: api.convert(model, r, root / r, calib=str(calib_file), num_samples=8, seq_len=64,
                           hash_source=False).outputs["vllm"] for r in NEW}


def _ids():
    return torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))


def _compressor(fmt: str):
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor, IntQuantizationCompressor
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    return {"nvfp4-pack-quantized": NVFP4PackedCompressor, "mxfp4-pack-quantized": MXFP4PackedCompressor,
            "mxfp8-quantized": MXFP8QuantizationCompressor,
            "float-quantized": FloatQuantizationCompressor, "pack-quantized": PackedQuantizationCompressor,
            "int-quantized": IntQuantizationCompressor}[fmt]


@pytest.mark.parametrize("recipe", NEW)
def test_compressed_tensors_decompresses_what_qtk_decodes(converted, recipe):
    from compressed_tensors.quantization import QuantizationScheme

    d = converted[recipe]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate({k: group[k] for k in ("targets", "weights", "input_activations")})
    comp = _compressor(group["format"])
    ck = open_checkpoint(d)
    with safe_open(str(next(d.glob("*.safetensors"))), framework="pt") as f:
        names = list(f.keys())
        for m in ck.modules():
            sd = {n[len(m) + 1:]: f.get_tensor(n) for n in names if n.startswith(m + ".")}
            decoded = comp.decompress(sd, scheme)["weight"]
            ours = engine_weight(ck.qtensor(m)).to(decoded.dtype)
            assert torch.equal(decoded, ours), f"{recipe}: {m}"


@pytest.mark.parametrize("recipe", NEW)
def test_reload_weights_in_float32_equals_the_simulation(converted, recipe):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    d = converted[recipe]
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    sim = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)
    with torch.no_grad():
        diff = (ref(_ids()).logits - sim(_ids()).logits).abs().max().item()
    assert diff <= 1e-4, f"{recipe}: {diff}"


@pytest.mark.parametrize("recipe", RUNTIME)
def test_runtime_reload_in_bf16_equals_the_simulation_with_activations(converted, recipe):
    a, b, plain = bf16_runtime_logits(converted[recipe])
    assert (a - b).abs().max().item() <= 1e-4
    if recipe in ("nvfp4", "fp8-block", "mxfp8"):  # the activations really are quantized in both
        assert (plain - a).abs().max().item() > 1e-3


@pytest.mark.parametrize("recipe", ("nvfp4", "nvfp4-gptq", "nvfp4-a16"))
def test_nvfp4_global_scales_shared_in_fused_groups_on_disk(converted, recipe):
    d = converted[recipe]
    with safe_open(str(next(d.glob("*.safetensors"))), framework="pt") as f:
        for layer in range(2):
            p = f"model.layers.{layer}."
            for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
                keys = ["weight_global_scale"] + (["input_global_scale"] if recipe != "nvfp4-a16" else [])
                for k in keys:
                    vals = [f.get_tensor(f"{p}{m}.{k}") for m in group]
                    assert all(torch.equal(v, vals[0]) for v in vals), f"{recipe}: {p}{group} {k}"
            gs = [f.get_tensor(f"{p}{m}.weight_global_scale") for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]
            assert len({float(g) for g in gs}) == 3  # unfused Linears keep their own


def test_inspect_passes_and_flags_a_split_global_scale(converted, tmp_path):
    """qtk inspect's NVFP4 check: passes on the written output, fails once one member of q/k/v gets its own scale."""
    import shutil

    from safetensors.torch import load_file, save_file

    from qtk.checks import check_checkpoint

    name = "NVFP4 global scales finite and shared in fused groups; E8M0 scales in range"
    rep = check_checkpoint(open_checkpoint(converted["nvfp4"]))
    assert any(c.name == name and c.ok for c in rep.checks)
    bad = tmp_path / "bad"
    shutil.copytree(converted["nvfp4"], bad)
    st = next(bad.glob("*.safetensors"))
    t = load_file(str(st))
    t["model.layers.0.self_attn.k_proj.weight_global_scale"] = t["model.layers.0.self_attn.k_proj.weight_global_scale"] * 2
    save_file(t, str(st), metadata={"format": "pt"})
    rep = check_checkpoint(open_checkpoint(bad))
    failed = [c for c in rep.checks if c.name == name and not c.ok]
    assert failed and "different global scales" in failed[0].detail


@pytest.mark.parametrize("recipe", ("mxfp4-a16", "mxfp8"))
def test_inspect_flags_an_e8m0_nan_scale(converted, recipe, tmp_path):
    """qtk inspect's E8M0 check covers MXFP4 and MXFP8: it passes on the written output and fails once one scale of
    one module is code 255 (E8M0's NaN)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from qtk.checks import check_checkpoint

    name = "NVFP4 global scales finite and shared in fused groups; E8M0 scales in range"
    rep = check_checkpoint(open_checkpoint(converted[recipe]))
    assert any(c.name == name and c.ok for c in rep.checks)
    bad = tmp_path / "bad"
    shutil.copytree(converted[recipe], bad)
    st = next(bad.glob("*.safetensors"))
    t = load_file(str(st))
    key = "model.layers.1.mlp.down_proj.weight_scale"
    assert t[key].dtype == torch.uint8
    t[key][3, 1] = 255
    save_file(t, str(st), metadata={"format": "pt"})
    rep = check_checkpoint(open_checkpoint(bad))
    failed = [c for c in rep.checks if c.name == name and not c.ok]
    assert failed and "model.layers.1.mlp.down_proj: 1 E8M0 scales are NaN (code 255)" in failed[0].detail
