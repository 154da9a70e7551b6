"""Architecture coverage: every supported family × every shipped recipe on a tiny random config, to the
vLLM target; the checkpoint reloads in transformers + compressed-tensors with qtk's simulated logits.

scripts/arch_matrix.py runs this file and writes the README's architecture table from the results."""

import pytest
import torch

from models import make_tiny_model
from qtk import api
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from qtk.recipe import builtin_recipes

ARCH_CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "qwen2": {},  # q/k/v biases
    "qwen3": {"head_dim": 32},  # q/k norms
    "gemma2": {"head_dim": 32, "sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 32, "sliding_window": 16, "sliding_window_pattern": 2},
    "phi3": {"pad_token_id": 0},  # fused qkv_proj and gate_up_proj in the source
}
RECIPES = sorted(builtin_recipes())


@pytest.fixture(scope="module")
def models(tmp_path_factory, calib_file):
    root = tmp_path_factory.mktemp("arch")
    return {mt: make_tiny_model(root / mt, model_type=mt, hidden=128, intermediate=256, **extra)
            for mt, extra in ARCH_CONFIGS.items()}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model_type", list(ARCH_CONFIGS))
def test_architecture_recipe_vllm(models, calib_file, tmp_path, model_type, recipe):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = models[model_type]
    res = api.convert(src, recipe, tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48, hash_source=False)
    d = res.outputs["vllm"]
    ck = open_checkpoint(d)
    n_layers = ck.hf_config["num_hidden_layers"]
    assert len(ck.modules()) == n_layers * len(api._expected_quantized(ck)) // n_layers
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        diff = (ref(ids).logits - sim(ids).logits).abs().max().item()
    assert diff <= 1e-4
    if ck.kv_cache:
        scales = [ck.kv_scales(i) for i in range(n_layers)]
        assert all(s is not None and 0 < s[0] != 1.0 for s in scales)
    assert api.inspect(d).ok


def test_unsupported_architecture_is_refused_with_the_list(tmp_path):
    from qtk.errors import UsageError

    src = make_tiny_model(tmp_path / "gpt2ish", model_type="llama")
    cfg = (src / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "falcon"')
    (src / "config.json").write_text(cfg)
    with pytest.raises(UsageError, match="model_type 'falcon' is not supported.*supported: .*gemma2.*llama.*phi3"):
        api.convert(src, "w8a16", tmp_path / "o")
