"""FP8 blocks on a Llama whose hidden size (192) 128 does not tile, for --target vllm (compressed-tensors): the
Linears vLLM runs with a partial last block row (o_proj [192, 128], down_proj [192, 256]: unmerged, inputs whole
groups of 128) are written with ceil(out/128) x ceil(in/128) scale grids, and judged by real clients:

- compressed-tensors' own decompressor decodes each one to exactly qtk's dequantized weight;
- transformers + compressed-tensors reload the checkpoint with the logits of qtk's simulation, weights only in float32
  and on the run-time path (per-token-group FP8 activations) in bf16;
- the Linears it cannot run (q/k/v and gate/up read the 192 hidden channels) are refused unless ignored, and the rule
  is vLLM's validate_fp8_block_shape (qtk.model.config_check.fp8_block_misfit), checked here on SmolLM2-135M's shapes.
"""

import json

import pytest
import torch
from safetensors import safe_open

from models import bf16_runtime_logits, make_tiny_model
from qtk import api
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from qtk.model.config_check import fp8_block_misfit
from qtk.model.simulate import build_simulated_model, engine_weight

RECIPE = """name: fp8-block-ragged
weights: {num_bits: 8, type: float, symmetric: true, strategy: block, block_structure: [128, 128]}
activations: {num_bits: 8, type: float, symmetric: true, strategy: group, group_size: 128, dynamic: true}
algorithm: [rtn]
ignore: [lm_head%s]
"""
IGNORE = ", self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, mlp.gate_proj, mlp.up_proj"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "ragged", hidden=192, intermediate=256, heads=2, kv_heads=1,
                           head_dim=64)


@pytest.fixture(scope="module")
def out(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("o")
    (root / "r.yaml").write_text(RECIPE % IGNORE)
    return api.convert(model, str(root / "r.yaml"), root / "out", hash_source=False).outputs["vllm"]


def _ids():
    return torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))


def test_ceil_scale_grids_on_disk(out):
    ck = open_checkpoint(out)
    assert ck.modules() == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp.down_proj", "self_attn.o_proj"))
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        assert f.get_slice("model.layers.0.self_attn.o_proj.weight").get_shape() == [192, 128]
        assert f.get_slice("model.layers.0.self_attn.o_proj.weight_scale").get_shape() == [2, 1]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_shape() == [2, 2]
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").dtype == torch.bfloat16
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]


def test_compressed_tensors_decompresses_what_qtk_decodes(out, model):
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate({k: group[k] for k in ("targets", "weights", "input_activations")})
    ck = open_checkpoint(out)
    src = load_file(str(next(model.glob("*.safetensors"))))
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        names = list(f.keys())
        for m in ck.modules():
            sd = {n[len(m) + 1:]: f.get_tensor(n) for n in names if n.startswith(m + ".")}
            decoded = FloatQuantizationCompressor.decompress(sd, scheme)["weight"]
            assert decoded.shape == src[m + ".weight"].shape
            assert torch.equal(decoded, engine_weight(ck.qtensor(m)).to(decoded.dtype)), m
            # the partial block row is quantized on its own amax: its error stays at FP8's, like the full one
            w = src[m + ".weight"].float()
            for rows in (slice(0, 128), slice(128, 192)):
                err = (decoded[rows].float() - w[rows]).norm() / w[rows].norm()
                assert err < 0.04, (m, rows, err)


def test_reload_weights_in_float32_equals_the_simulation(out):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    sim = build_simulated_model(open_checkpoint(out), simulate_activations=False, simulate_kv=False)
    with torch.no_grad():
        assert (ref(_ids()).logits - sim(_ids()).logits).abs().max().item() <= 1e-4


def test_runtime_reload_in_bf16_equals_the_simulation_with_activations(out):
    a, b, c = bf16_runtime_logits(out)
    assert (a - b).abs().max().item() <= 1e-4
    assert (c - a).abs().max().item() > 1e-3  # the activations really are quantized in both


def test_what_vllm_cannot_run_is_refused_before_any_work(tmp_path, model):
    (tmp_path / "r.yaml").write_text(RECIPE % "")
    with pytest.raises(UsageError) as e:
        api.convert(model, str(tmp_path / "r.yaml"), tmp_path / "o", hash_source=False)
    assert "model.layers.0.self_attn.q_proj [128, 192]" in e.value.problem and "block_k 128" in e.value.problem
    assert "fp8-dynamic" in e.value.fix and not (tmp_path / "o").exists()
    (tmp_path / "r.yaml").write_text(RECIPE % IGNORE)
    with pytest.raises(UsageError, match="hf-fp8|do not tile model.layers.0.self_attn.o_proj"):
        api.convert(model, str(tmp_path / "r.yaml"), tmp_path / "o", targets=["hf-fp8"], hash_source=False)


B = (128, 128)


def test_vllm_rule_on_smollm2_135m():
    """SmolLM2-135M: hidden 576, intermediate 1536, q 9x64 = 576 rows, k/v 3x64 = 192 rows."""
    qkv = fp8_block_misfit([576, 192, 192], 576, B)
    assert qkv is not None and qkv[0] == 0  # q (not the last member) ends in a partial block; the input 576 too
    assert fp8_block_misfit([1536, 1536], 576, B)[1].startswith("its input size 576")  # gate/up: ragged input
    assert fp8_block_misfit([576], 576, B, split="row") is not None  # o_proj: ragged input
    assert fp8_block_misfit([576], 1536, B, split="row") is None  # down_proj: ragged output only, unmerged
    assert fp8_block_misfit([576], 1536, B, 2, split="row") is None  # tp 2: 768 inputs per shard
    assert fp8_block_misfit([576], 1536, B, 4, split="row") is None  # tp 4: 384 per shard
    assert fp8_block_misfit([576], 1536, B, 8, split="row")[1].endswith("per shard")  # tp 8: 192 per shard

def test_vllm_rule_merged_and_sharded():
    assert fp8_block_misfit([256, 128, 192], 256, B) is None  # only the last member is ragged: allowed
    assert fp8_block_misfit([256, 192, 192], 256, B)[0] == 1  # k is not last
    assert fp8_block_misfit([576], 7168, B) is None  # DeepSeek-V3's kv_a_proj_with_mqa, unmerged
    assert fp8_block_misfit([256, 256, 256], 256, B, 2) is None  # 128 per shard
    assert fp8_block_misfit([256, 256, 256], 256, B, 4)[0] == 0  # 64 per shard
    assert fp8_block_misfit([256, 128, 128], 256, B, 2, shard_parts=[128, 128, 128]) is None  # KV heads copied
    assert fp8_block_misfit([512], 512, B, 4, split="row") is None  # 128 inputs per shard
    assert fp8_block_misfit([512], 512, B, 8, split="row")[1].endswith("per shard")  # 64
    assert fp8_block_misfit([192], 512, B, 4, split="row") is None  # a row-parallel output is not split: may be ragged
