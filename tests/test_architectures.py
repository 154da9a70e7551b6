"""Architecture coverage: every supported family × every shipped recipe on a tiny random config, to the
vLLM target; the checkpoint reloads in transformers + compressed-tensors with qtk's simulated logits.

scripts/arch_matrix.py runs this file and writes the README's architecture table from the results."""

import re

import pytest
import torch

from models import apply_ct_transforms, fewer_iterations, make_tiny_model
from qtk import api
from qtk.checks import expected_quantized
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from qtk.plan.decide import w4a8_kind
from qtk.recipe import builtin_recipes, load_recipe

DEEPSEEK = {"kv_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "moe_intermediate_size": 128, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 128,
            "q_lora_rank": 128, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "topk_method": "noaux_tc"}  # as DeepSeek-V3's config.json says (vLLM loads the router bias only then)
# layer 0: dense MLP, no RoPE, full attention with the query's temperature tuning (floor_scale 8: active within the
# tests' sequences); layer 1: MoE, RoPE, q/k L2 norm, attention within chunks of 16 tokens
LLAMA4 = {"head_dim": 32, "intermediate_size_mlp": 256, "num_local_experts": 4, "num_experts_per_tok": 1,
          "interleave_moe_layer_step": 2, "attention_chunk_size": 16, "no_rope_layers": [0, 1], "floor_scale": 8}
ARCH_CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "qwen2": {},  # q/k/v biases
    "qwen3": {"head_dim": 32},  # q/k norms
    "gemma2": {"head_dim": 32, "sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 32, "sliding_window": 16, "sliding_window_pattern": 2},
    "phi3": {"pad_token_id": 0},  # fused qkv_proj and gate_up_proj in the source
    # sparse MoE: 4 experts, top-2; per-expert Linears in the checkpoint, fused 3-D experts in transformers 5
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "norm_topk_prob": True},
    # routed experts plus a shared expert behind a sigmoid gate (16-bit, with the router); q/k/v biases
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 256},
    # MLA attention (q_a/q_b low-rank query, kv_a/kv_b latent), a dense first layer, then routed experts with a
    # shared expert and a router bias; K/V heads = heads, as DeepSeek's configs have them
    "deepseek_v3": DEEPSEEK,
    # Llama-style attention with q/k/v biases and q/k norms, DeepSeek-style MoE (dense first layer, router bias)
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                 "moe_intermediate_size": 128, "n_shared_experts": 1, "first_k_dense_replace": 1, "head_dim": 32,
                 "attention_bias": True, "use_qk_norm": True},
    # biases on q/k/v/o, a sink logit per head, sliding and full attention alternating; experts with biases and a
    # clamped SwiGLU, stored fused ([E, H, 2I], gate/up interleaved) by transformers, written per expert by qtk
    "gpt_oss": {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    # dense (intermediate_size_mlp) and MoE layers interleaved, a shared expert, top-1 sigmoid routing that scales the
    # experts' input, experts stored fused ([E, H, 2I], gate then up); RoPE layers chunked (16 tokens, so the tests'
    # 40-48 token sequences cross chunks), the others without RoPE and with temperature tuning
    "llama4_text": LLAMA4,
}
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4_text")
# recipes a family refuses up front, with the reason's text (checked, so a refusal that changes fails the test)
REFUSED = {("deepseek_v3", r): "attention is MLA: vLLM caches MLA's compressed latent (kv_lora_rank + "
                                "qk_rope_head_dim per token), not per-head K and V"
           for r in ("fp8-kv8", "int8-kv8", "nvfp4-kv8")}
# FP8 blocks need Linears that are multiples of 128 both ways, which these tiny models' k/v are not (vLLM refuses
# them, so does qtk): tests/export/test_formats_next_vllm.py runs them on a model they tile
# static W4A8 (TensorRT-LLM's W4A8_AWQ: static per-tensor FP8 inputs) has no vLLM form: tests/trtllm covers it
RECIPES = sorted(r for r in builtin_recipes() if load_recipe(r).weights.strategy != "block"
                 and w4a8_kind(load_recipe(r)) != "fp8-static")


def _moe_ct_reference(ck, tmp):
    """transformers 5.24's dequantizing loader decodes MoE experts only when they are fp8 or symmetric packed
    ones: not int-quantized (W8A8 int8, which vLLM loads) nor zero points. For those, compressed-tensors' own
    compressor for the format decodes every quantized module from the written tensors, and transformers loads
    that dense per-expert checkpoint (fusing the experts itself): the same claim, without the loader's gap. The same
    for NVFP4 / MXFP4 experts.

    gpt-oss: transformers 5 has no per-expert loading for it at all (no conversion mapping: GptOssExperts reads only
    the fused gate_up_proj [E, H, 2I], gate/up interleaved, and down_proj [E, I, H] with their biases), so the decoded
    per-expert Linears are put back into that fused layout here (`fuse_as_transformers_stores`), the one step of
    the reference that is not a library's."""
    import json

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from qtk.model.config_check import text_config

    qc = QuantizationConfig.model_validate(ck.qconfig)
    scheme = qc.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    sd = dict(ck.dense_state_dict())
    for m in ck.modules():
        parts = {k: ck.tensor(f"{m}.{k}") for k in ("weight", "weight_packed", "weight_scale", "weight_shape",
                                                     "weight_zero_point", "weight_global_scale") if ck.has(f"{m}.{k}")}
        w = compressor.decompress(parts, scheme)["weight"]
        # FP8 (float-quantized): transformers' own loader folds the scale into the weight in the dtype it loads in
        # (float32 here), which is what the engines compute with; packed formats decode in the model dtype
        sd[f"{m}.weight"] = w.float() if ck.ct_format == "float-quantized" else w.to(ck.dtype)
    if ck.arch.moe.fused.stored_fused:
        sd = fuse_as_transformers_stores(sd, ck.arch, text_config(ck.hf_config)["num_hidden_layers"])
    tmp.mkdir()
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({k: v for k, v in ck.hf_config.items() if k != "quantization_config"}))
    auto = AutoModelForImageTextToText if ck.arch.multimodal else AutoModelForCausalLM  # Llama 4's multimodal class
    return auto.from_pretrained(str(tmp), dtype=torch.float32)


def fuse_as_transformers_stores(sd: dict, arch, layers: int) -> dict:
    """Per-expert gate/up/down weights and biases (`mlp.experts.{e}.gate_proj.weight` [I, H], ...) in the fused
    layout transformers saves and loads: gpt-oss's gate_up_proj [E, H, 2I] with gate in the even and up in the odd
    columns, down_proj [E, I, H], gate_up_proj_bias [E, 2I] interleaved the same way, down_proj_bias [E, H]; Llama 4's
    the same without biases and with gate in the first I columns, up in the last (its dense layers left as they are)."""
    m, E = arch.moe, arch.num_experts
    sd = dict(sd)
    for i in range(layers):
        if i in arch.dense_layers:
            continue
        p = f"{arch.layers}.{i}.{m.block}.experts"
        pop = lambda e, w, k: sd.pop(f"{p}.{e}.{w}.{k}")  # noqa: E731
        gate = torch.stack([pop(e, m.gate, "weight") for e in range(E)])  # [E, I, H]
        up = torch.stack([pop(e, m.up, "weight") for e in range(E)])
        # [E, 2I, H]: rows g0, u0, g1, u1, ... (interleaved) or g0..g(I-1), u0..u(I-1)
        gate_up = torch.stack((gate, up), dim=2).flatten(1, 2) if m.fused.interleaved else torch.cat((gate, up), dim=1)
        sd[f"{p}.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
        sd[f"{p}.down_proj"] = torch.stack([pop(e, m.down, "weight") for e in range(E)]).transpose(1, 2).contiguous()
        if not m.bias:
            continue
        gb = torch.stack([pop(e, m.gate, "bias") for e in range(E)])
        ub = torch.stack([pop(e, m.up, "bias") for e in range(E)])
        sd[f"{p}.gate_up_proj_bias"] = torch.stack((gb, ub), dim=2).flatten(1, 2).contiguous()
        sd[f"{p}.down_proj_bias"] = torch.stack([pop(e, m.down, "bias") for e in range(E)])
    return sd


def _unrotatable(recipe: str, model_type: str) -> bool:
    """A recipe with the rotate step on a family whose layers no rotation folds into (qtk.algorithms.rotate)."""
    from qtk.algorithms.rotate import layout_problem
    from qtk.model.arch import ARCHS

    rotates = any(s.name == "rotate" for s in load_recipe(recipe).algorithm)
    return rotates and layout_problem(ARCHS[model_type], model_type) is not None


@pytest.fixture(scope="module")
def models(tmp_path_factory, calib_file):
    root = tmp_path_factory.mktemp("arch")
    return {mt: make_tiny_model(root / mt, model_type=mt, hidden=128, intermediate=256, **extra)
            for mt, extra in ARCH_CONFIGS.items()}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model_type", list(ARCH_CONFIGS))
def test_architecture_recipe_vllm(models, calib_file, tmp_path, model_type, recipe, record_property):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = models[model_type]
    if (model_type, recipe) in REFUSED:
        with pytest.raises(UsageError, match=re.escape(REFUSED[model_type, recipe])):
            api.convert(src, recipe, tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48, hash_source=False)
        assert not (tmp_path / "o").exists()
        record_property("refused", REFUSED[model_type, recipe])  # scripts/arch_matrix.py shows the reason in the cell
        return
    if _unrotatable(recipe, model_type):  # refused before any work, naming why (tests/steps/test_rotate.py)
        with pytest.raises(UsageError, match=f"cannot rotate {model_type}") as e:
            api.convert(src, recipe, tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48, hash_source=False)
        assert not (tmp_path / "o").exists()
        record_property("refused", e.value.args[0])
        return
    res = api.convert(src, fewer_iterations(recipe, tmp_path), tmp_path / "o", calib=str(calib_file), num_samples=4,
                      seq_len=48, hash_source=False)
    d = res.outputs["vllm"]
    ck = open_checkpoint(d)
    n_layers = ck.hf_config["num_hidden_layers"]
    assert len(ck.modules()) == n_layers * len(expected_quantized(ck, ck.arch, None)) // n_layers
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
    # (NVFP4 / MXFP4 / MXFP8 experts: the loader's MoE path does not decode them either)
    if ck.hf_config["model_type"] in MOE and (ck.ct_format in ("int-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized",
                                                              "mxfp8-quantized")
                                            or not ck.weights_scheme.symmetric or ck.arch.moe.fused.stored_fused):
        ref = _moe_ct_reference(ck, tmp_path / "dense")
    else:
        ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                   quantization_config=CompressedTensorsConfig(dequantize=True))
    # transformers fuses dequantized MoE experts into 3-D parameters that keep the checkpoint dtype (bf16,
    # exact values) instead of the requested float32; cast so both models compute in float32
    ref = apply_ct_transforms(ref.float(), d).eval()  # an online rotation: compressed-tensors' own transforms
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
