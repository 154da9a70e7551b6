"""The MoE families added to the family table, loaded and run by vLLM's CPU build: Qwen2-MoE (routed experts, a
shared expert behind a 16-bit sigmoid gate), DeepSeek-V3 (MLA attention, a dense first layer, routed and shared
experts, a router bias), GLM-4.5 (Llama-style attention, DeepSeek-style MoE), gpt-oss (attention sinks, biased
experts stored fused; its unquantized model runs as transformers computes it) and Llama 4 (dense and MoE layers
interleaved, input-scaled experts stored fused, chunked attention). Each tiny random model, unquantized and in a weight-only and an INT8 W8A8 recipe, either
runs in vLLM and agrees with qtk's simulation of the same bytes within qtk.eval.engine_check.BOUNDS, or vLLM
refuses it for the reason recorded here (REFUSALS), so a vLLM release that starts serving it fails this test."""

from __future__ import annotations

import re

import pytest

from qtk.eval.engine_check import check_windows, compare
from qtk.eval.engines import load_tokenizer
from qtk.eval.vllm_process import cpu_flags
from test_architectures import LLAMA4

FAMILIES = {
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 256},
    "deepseek_v3": {"kv_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                    "moe_intermediate_size": 128, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    # vLLM's CPU MLA takes DeepSeek-V3's latent width only: kv_lora_rank + qk_rope_head_dim = 576
                    "kv_lora_rank": 512, "q_lora_rank": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                 "moe_intermediate_size": 128, "n_shared_experts": 1, "first_k_dense_replace": 1, "head_dim": 32,
                 "attention_bias": True, "use_qk_norm": True},
    "gpt_oss": {"head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    # dense and MoE layers interleaved, a shared expert, top-1 sigmoid routing scaling the experts' input (vLLM's
    # apply_router_weight_on_input), experts stored fused; the RoPE layer attends in chunks of 128 tokens (vLLM's CPU
    # chunked local attention takes multiples of its 128-token KV block only), the other without RoPE. floor_scale
    # the config class's 8192: vLLM 0.32 runs the no-RoPE layers' temperature tuning only when generation_config
    # asks for it or max_model_len > 32K (the real models' contexts), transformers whenever config.json says so;
    # below floor_scale tokens the tuning multiplies by 1, so both compute the same here (with a floor_scale of 8 the
    # unquantized model's logits differ: vLLM runs those layers without the tuning)
    "llama4_text": {**LLAMA4, "attention_chunk_size": 128, "floor_scale": 8192},
}
# windows long enough to cross a family's attention chunk (Llama 4's 128 tokens)
SEQ_LEN = {"llama4_text": 256}
RECIPES = ("(unquantized)", "w4a16", "w8a8-sq", "fp8-dynamic")
# (family, recipe) -> a pattern of vLLM 0.32 CPU's own refusal, where it refuses: its CPU build has no fused-MoE
# kernel for any quantized expert format (unquantized experts run)
REFUSALS: dict[tuple[str, str], str] = {
    **{(f, "w4a16"): r"No WNA16 MoE backend supports the deployment configuration" for f in FAMILIES},
    **{(f, "w8a8-sq"): r"No Int8 MoE backend supports the deployment configuration" for f in FAMILIES},
    **{(f, "fp8-dynamic"): r"Unsupported FP8 MoE backend: NONE" for f in FAMILIES},
    # gpt-oss: vLLM 0.32's gpt_oss.py load_weights reads quantized experts only as MXFP4 (quant_method mxfp4: fused
    # *_blocks / *_scales), as quark's fused tensors, or one expert at a time under its own fused names
    # (experts.{e}.w13_weight_packed / w13_weight_scale / w13_bias, gate and up interleaved; packed WNA16 and NVFP4 MoE
    # methods only): not as per-expert gate_proj / up_proj / down_proj Linears, the layout qtk writes (llm-compressor's,
    # which transformers + compressed-tensors decodes), whose biases its name mapping sends to a parameter it does not
    # have. The backend refuses w4a16 and w8a8-sq before loading; FP8 gets to the loader, which refuses this way
    ("gpt_oss", "fp8-dynamic"): r"KeyError: 'layers\.0\.mlp\.experts\.0\.w2_bias'",
}
# On CPUs with AMX tiles (Sapphire Rapids and newer) vLLM's CPU MoE kernels run int4 and int8 experts of a
# softmax-routed model (measured: Qwen2-MoE); DeepSeek-style grouped routing with a router bias they still refuse
AMX = "amx_tile" in cpu_flags()
if AMX:
    for key in (("qwen2_moe", "w4a16"), ("qwen2_moe", "w8a8-sq")):
        del REFUSALS[key]
    # Llama 4: those kernels take the router's weight on the output only; Llama 4 applies it to the experts' input
    REFUSALS[("llama4_text", "w4a16")] = r"CPUExpertsInt4 \(W4A16\) does not support apply_router_weight_on_input=True"
    REFUSALS[("llama4_text", "w8a8-sq")] = r"CPUExpertsInt8 does not support apply_router_weight_on_input=True"
# (family, recipe) -> why vLLM runs it but not as transformers computes it, before qtk changes a byte: the
# unquantized model is the engine's floor, so a quantized checkpoint of the family cannot be judged against it here
BASELINE_GAPS = {
    ("deepseek_v3", "(unquantized)"): "vLLM 0.32's CPU MLA path and transformers 5.19's DeepseekV3 differ on the "
                                      "source model itself (mean |Δ log p| 0.18, top-1 73 % on this tiny model)",
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from models import make_tiny_model

    root = tmp_path_factory.mktemp("moe-families")
    return {f: make_tiny_model(root / f, model_type=f, hidden=128, intermediate=256, **kw) for f, kw in FAMILIES.items()}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_in_vllm_or_vllm_says_why(vllm, sources, record, tmp_path, family, recipe):
    from qtk import api

    src = sources[family]
    windows = check_windows(load_tokenizer(src), num=2, seq_len=SEQ_LEN.get(family, 128))
    if recipe == "(unquantized)":
        path, baseline = src, True
    else:
        res = api.convert(src, recipe, tmp_path / "o", num_samples=8, seq_len=64, hash_source=False)
        path, baseline = res.outputs["vllm"], False
    want = REFUSALS.get((family, recipe))
    try:
        c = compare(path, windows, vllm, baseline=baseline)
    except RuntimeError as e:  # loaded, then refused by the kernel at the first forward (Llama 4's input-side weight)
        if want is None or not re.search(want, str(e)):
            raise
        record(f"{family} {recipe}", f"refused at run time: {str(e).splitlines()[0][:200]}")
        return
    record(f"{family} {recipe}", ("runs: " + c.line()) if c.status == "runs" else f"{c.status}: {c.reason[:200]}")
    gap = BASELINE_GAPS.get((family, recipe))
    if gap is not None:
        assert c.status == "runs", c.reason
        if not c.disagreements:
            pytest.fail(f"vLLM {vllm.version} now runs {family} as transformers does ({c.line()}): remove BASELINE_GAPS' entry")
        pytest.xfail(f"{gap}: {c.line()}")
    if want is None:
        assert c.status == "runs", c.reason
        assert not c.disagreements, f"{family} {recipe}: engine and simulation disagree: {c.disagreements} ({c.line()})"
    else:
        assert c.status == "refused" and re.search(want, c.reason), (
            f"vLLM {vllm.version} no longer refuses {family} {recipe} for the recorded reason: {c.status} {c.reason}")
