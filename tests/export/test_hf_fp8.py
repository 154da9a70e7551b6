"""--target hf-fp8: Hugging Face's fine-grained FP8 format (quant_method fp8, weight_block_size, weight_scale_inv), judged
by transformers' own FP8 loader (which dequantizes on CPU) and against the vLLM output of the same conversion."""

import json

import pytest
import torch
from safetensors import safe_open

from models import make_tiny_model
from qtk import api
from qtk.errors import UsageError
from qtk.export import ExportOptions, open_checkpoint
from qtk.export.hf_fp8 import HFFP8Checkpoint
from qtk.model.simulate import build_simulated_model


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("m") / "aligned", hidden=256, intermediate=512, heads=2, kv_heads=1)
    res = api.convert(model, "fp8-block", tmp_path_factory.mktemp("o") / "o", targets=["hf-fp8", "vllm"], hash_source=False)
    return model, res.outputs["hf-fp8"], res.outputs["vllm"]


def _tensors(d):
    with safe_open(str(next(d.glob("*.safetensors"))), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def test_layout_and_config(out):
    _, d, v = out
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                  "modules_to_not_convert": ["lm_head"]}
    t, tv = _tensors(d), _tensors(v)
    q = "model.layers.0.mlp.down_proj"
    assert t[f"{q}.weight"].dtype == torch.float8_e4m3fn and list(t[f"{q}.weight"].shape) == [256, 512]
    assert t[f"{q}.weight_scale_inv"].dtype == torch.float32 and list(t[f"{q}.weight_scale_inv"].shape) == [2, 4]
    # the same quantization as the compressed-tensors output: equal codes, the scale stored in float32
    for n in t:
        if n.endswith(".weight_scale_inv"):
            m = n[: -len(".weight_scale_inv")]
            assert torch.equal(t[f"{m}.weight"].view(torch.uint8), tv[f"{m}.weight"].view(torch.uint8))
            assert torch.equal(t[n], tv[f"{m}.weight_scale"].float())
    assert isinstance(open_checkpoint(d), HFFP8Checkpoint) and api.inspect(d).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_reloads_it_with_the_simulated_logits(out, dtype):
    from transformers import AutoModelForCausalLM

    _, d, _ = out
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).eval()  # FineGrainedFP8Config: dequantized on CPU
    sim = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False, dtype=dtype)
    with torch.no_grad():
        assert (ref(ids).logits.float() - sim(ids).logits.float()).abs().max().item() <= 1e-4


def test_hf_fp8_refuses_other_recipes_naming_a_target_that_accepts(out):
    from qtk.export import check_targets
    from qtk.model.source import ModelSource
    from qtk.recipe import load_recipe

    model, _, _ = out
    src = ModelSource(model)
    with pytest.raises(UsageError, match="holds FP8 block weights with dynamic per-token-group activations only") as e:
        check_targets(src, load_recipe("w4a16"), ExportOptions(), ["hf-fp8"])
    assert "--target vllm" in e.value.fix
    with pytest.raises(UsageError, match="no KV-cache scales") as e:
        check_targets(src, load_recipe("fp8-block-kv8"), ExportOptions(), ["hf-fp8"])
    assert "the fp8-block recipe keeps a 16-bit KV cache" in e.value.problem
    assert e.value.fix == "use --target vllm"  # the one target whose own check accepts fp8-block-kv8 on this model
