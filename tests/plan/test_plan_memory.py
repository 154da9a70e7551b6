"""Weight, KV and serving memory from config.json: exact byte counts, checked against transformers'
meta-device models and compressed-tensors' own layout of the same models."""

import json
import math

import pytest
from plan_helpers import CONFIGS, config, meta_model, shape

from qtk.errors import UsageError
from qtk.export.vllm import ct_args
from qtk.plan.memory import (
    DTYPE_BYTES,
    ModelShape,
    checkpoint_tensors,
    conversion_memory,
    kv_bytes_of,
    kv_bytes_per_request,
    kv_bytes_per_token,
    model_tensors,
    plan_memory,
    read_config,
    weight_bytes,
)
from qtk.recipe import builtin_recipes, load_recipe, parse_recipe

ALL_CONFIGS = sorted(p.stem for p in CONFIGS.glob("*.json"))
GIB = 2**30


# --- KV cache ---------------------------------------------------------------------------------

def test_kv_example_28_layers_8_kv_heads_head_dim_128_bf16():
    s = shape("llama-3.2-3b")
    assert (s.layers, s.kv_heads, s.head_dim, s.dtype) == (28, 8, 128, "bfloat16")
    assert kv_bytes_per_token(s, 2) == 2 * 28 * 8 * 128 * 2 == 114_688
    assert kv_bytes_per_request(s, 4096, 2) == 469_762_048  # ≈ 0.47 GB per request at 4K
    assert kv_bytes_per_request(s, 32768, 2) == 3_758_096_384  # ≈ 3.76 GB at 32K
    w = weight_bytes(s)
    m = plan_memory(s, w, mem_bytes=200 * 10**9, kv_bytes=2, context=32768, concurrency=8)
    assert m.kv_total_per_gpu == 30_064_771_072  # ≈ 30 GB for 8 requests at 32K
    assert [round(x / 1e9, 2) for x in (469_762_048, 3_758_096_384, m.kv_total_per_gpu)] == [0.47, 3.76, 30.06]


def test_kv_dtype_comes_from_the_recipe():
    assert kv_bytes_of(load_recipe("int8-kv8"), "bfloat16") == 1
    assert kv_bytes_of(load_recipe("fp8-kv8"), "bfloat16") == 1
    assert kv_bytes_of(load_recipe("w8a16"), "bfloat16") == 2
    assert kv_bytes_of(None, "float32") == 4


def test_gqa_mqa_and_tensor_parallel_kv_heads():
    base = config("llama-3-8b")
    s = ModelShape.from_config(base)
    assert kv_bytes_per_token(s, 2) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(s, 2, tp=2) == kv_bytes_per_token(s, 2) // 2  # KV heads split across GPUs
    # 16 GPUs for 8 KV heads: every GPU still holds one (replicated) head
    assert kv_bytes_per_token(s, 2, tp=16) == 2 * 32 * 1 * 128 * 2
    mqa = ModelShape.from_config({**base, "num_key_value_heads": 1})
    assert kv_bytes_per_token(mqa, 2) == 2 * 32 * 1 * 128 * 2
    mha = ModelShape.from_config({k: v for k, v in base.items() if k != "num_key_value_heads"})
    assert kv_bytes_per_token(mha, 2) == 2 * 32 * 32 * 128 * 2


def test_sliding_window_layers_are_capped_at_their_window():
    from transformers import AutoConfig

    s = shape("gemma-2-27b")
    hf = AutoConfig.from_pretrained(str(CONFIGS / "gemma-2-27b.json"))
    # the same layers slide as in transformers' own layer_types
    assert [w is not None for w in s.windows] == [t == "sliding_attention" for t in hf.layer_types]
    per_layer = 2 * 16 * 128 * 2
    assert kv_bytes_per_request(s, 2048, 2) == 46 * 2048 * per_layer
    assert kv_bytes_per_request(s, 8192, 2) == (23 * 8192 + 23 * 4096) * per_layer
    # Mistral-style: every layer slides, so a request's KV stops growing at the window
    mistral = ModelShape.from_config({**config("llama-3-8b"), "model_type": "mistral", "sliding_window": 4096})
    assert kv_bytes_per_request(mistral, 100_000, 2) == kv_bytes_per_request(mistral, 4096, 2)
    # Qwen2 only slides when use_sliding_window is set
    assert not any(shape("qwen2.5-7b").windows)


def test_mla_caches_one_latent_per_token_replicated_across_tp():
    s = shape("deepseek-v3")
    assert s.is_mla
    assert kv_bytes_per_token(s, 2) == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(s, 2, tp=8) == 70_272


# --- Tensors vs. a real (meta-device) model --------------------------------------------------

def _meta_numels(model) -> dict[str, int]:
    """Parameters (tied ones once) and persistent buffers of a meta model, by name."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keep = {k for k in model.state_dict() if k in params or k in buffers}
    return {k: (params.get(k) if k in params else buffers[k]).numel() for k in keep}


def _planner_numels(s) -> dict[str, int]:
    """Planner tensors in the meta model's naming: experts are fused there ([E, 2I, H] gate_up, [E, H, I] down)."""
    out: dict[str, int] = {}
    for x in model_tensors(s):
        n = x.name + (".weight" if x.role == "linear" else "")
        n = (n.replace(".*.gate_proj.weight", ".gate_up_proj").replace(".*.up_proj.weight", ".gate_up_proj")
             .replace(".*.down_proj.weight", ".down_proj"))
        out[n] = out.get(n, 0) + x.numel
    return out


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_tensor_matches_the_meta_model(name):
    s = shape(name)
    meta = _meta_numels(meta_model(name))
    mine = _planner_numels(s)
    vision_meta = sum(v for k, v in meta.items() if ".visual." in k)
    vision_mine = mine.pop("model.visual", 0)
    meta = {k: v for k, v in meta.items() if ".visual." not in k}
    assert mine == meta
    assert weight_bytes(s).params == sum(meta.values()) + vision_mine
    if vision_meta:
        assert abs(vision_mine - vision_meta) <= 0.01 * vision_meta
    else:
        assert vision_mine == 0


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen2.5-7b", "gemma-2-27b", "llama-3.2-3b"])
def test_dense_model_shapes_match_exactly(name):
    model = meta_model(name)
    meta = {k: tuple(p.shape) for k, p in model.named_parameters()}
    mine = {x.name + (".weight" if x.role == "linear" else ""): x.shape for x in model_tensors(shape(name))}
    assert mine == meta


def test_llama3_8b_weight_sizes_per_recipe():
    s = shape("llama-3-8b")
    params = sum(p.numel() for p in meta_model("llama-3-8b").parameters())
    linear = 32 * (4096 * (4096 + 1024 + 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    embed = 128256 * 4096
    dense = 2 * embed * 2 + (2 * 32 + 1) * 4096 * 2  # embeddings + lm_head (ignored) + norms, bf16
    assert params == 8_030_261_248
    bf16 = weight_bytes(s)
    assert bf16.total == 2 * params == 16_060_522_496  # ≈ 16.1 GB
    w8 = weight_bytes(s, load_recipe("w8a16"))
    assert w8.quantized == 4 * linear // 4 == 6_979_321_856  # int8 packed four per int32 word
    assert w8.dense == dense == 2_101_878_784
    assert w8.scales == 32 * (4096 + 1024 + 1024 + 4096 + 2 * 14336 + 4096) * 2 + 7 * 32 * 16  # [out,1] + weight_shape
    assert w8.total == 9_083_956_736  # int8 ≈ 7.0 GB of weights + 2.1 GB unquantized embeddings/lm_head
    assert weight_bytes(s, load_recipe("int8-kv8")).total == 9_083_953_408
    assert weight_bytes(s, load_recipe("fp8-dynamic")).total == 9_086_705_664
    w4 = weight_bytes(s, load_recipe("w4a16"))
    assert w4.quantized == linear // 2
    assert w4.scales == linear // 128 * 2 + 7 * 32 * 16
    assert w4.total == 5_700_595_200  # int4 g128 with bf16 lm_head and embeddings: 5.70 GB
    # the 4.3-5.0 GB often quoted for "8B int4" holds only with lm_head quantized too
    all_linear = parse_recipe({"name": "w4-all", "ignore": [],
                               "weights": {"num_bits": 4, "strategy": "group", "group_size": 128}})
    assert 4.3e9 <= weight_bytes(s, all_linear).total <= 5.0e9


def test_moe_counts_every_expert():
    s = shape("mixtral-8x7b")
    w = weight_bytes(s)
    assert w.expert_params == 32 * 8 * 3 * 4096 * 14336
    assert w.params == 46_702_792_704
    # routers stay dense under every recipe (engines build them without a quant method)
    names = {t.name: t for t in checkpoint_tensors(s, load_recipe("w4a16"))}
    assert names["model.layers.0.mlp.gate.weight"].dtype == "bfloat16"
    assert names["model.layers.0.mlp.experts.*.down_proj.weight_packed"].count == 8


# --- Checkpoint layout vs. compressed-tensors --------------------------------------------------

def _ct_meta_state(name: str, recipe):
    """What compressed-tensors itself lays out for `recipe` on the meta model (as transformers does on load)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    from qtk.plan.memory import checkpoint_format

    fmt = checkpoint_format(recipe)
    model = meta_model(name)
    qc = QuantizationConfig.model_validate({
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": ct_args(recipe.weights, None, fmt),
                                      "input_activations": ct_args(recipe.activations, None, fmt) if recipe.activations else None,
                                      "format": fmt}},
        "ignore": list(recipe.ignore)})
    apply_quantization_config(model, qc)
    ModelCompressor(quantization_config=qc).compress_model(model)
    step = recipe.step("rotate_online")
    if step is not None:  # the online rotation's config as qtk writes it, laid out by compressed-tensors' transforms
        from compressed_tensors.transform import TransformConfig, apply_transform_config

        from qtk.export.codecs.ct_transform import transform_config
        from qtk.quant.hadamard import largest_block

        width = model.config.intermediate_size
        mods = [f"model.layers.{i}.mlp.down_proj" for i in range(model.config.num_hidden_layers)]
        b = step.params.block or largest_block(width)
        apply_transform_config(model, TransformConfig.model_validate(transform_config(mods, b, width)))
    # a transform's matrix is one parameter shared by every module it applies to: each name is a tensor on disk
    return {k: (tuple(v.shape), str(v.dtype).replace("torch.", ""))
            for k, v in model.named_parameters(remove_duplicate=False)}


# compressed-tensors' meta-device path leaves zero points unpacked, so asymmetric recipes are covered by
# the real-compression test below and by the convert agreement test instead
SYMMETRIC = sorted(n for n in builtin_recipes() if load_recipe(n).weights.symmetric)


@pytest.mark.parametrize("recipe", SYMMETRIC)
@pytest.mark.parametrize("name", ["llama-3-8b", "qwen2.5-7b"])
def test_checkpoint_layout_matches_compressed_tensors(name, recipe):
    r = load_recipe(recipe)
    ct = _ct_meta_state(name, r)
    mine = {t.name: (t.shape, t.dtype) for t in checkpoint_tensors(shape(name), r)}
    # compressed-tensors 0.20 under transformers 5 skips creating KV scales (docs/formats.md): qtk writes them
    kv = {k for k in mine if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))}
    assert len(kv) == (2 * shape(name).layers if r.kv_cache else 0)
    assert all(mine[k] == ((1,), "float32") for k in kv)
    assert {k: v[0] for k, v in mine.items() if k not in kv} == {k: v[0] for k, v in ct.items()}
    for k, (_, dt) in ct.items():
        if k.endswith("input_scale") or (k.endswith("weight_scale") and r.weights.is_fp8 and r.weights.strategy != "block"
                                                  and not r.weights.is_mx):  # MX: uint8 E8M0 codes, as ct
            # qtk writes fp8 weight scales and activation scales in float32 (docs/formats.md, vllm);
            # compressed-tensors initialises them in the model dtype
            assert mine[k][1] == "float32", k
        elif k.endswith("_input.weight"):
            # an online transform's ±1 matrix: exact in the model dtype, which qtk writes and vLLM loads it in
            # (module.py: "load up in model's default precision"); compressed-tensors holds it at `precision`
            assert (mine[k][1], dt) == (shape(name).dtype, "float32"), k
        else:
            assert mine[k][1] == dt, k


def test_asymmetric_zero_points_pack_like_compressed_tensors():
    """Real (CPU) compression of a tiny model by compressed-tensors, asymmetric int4 g128."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model_type="llama", hidden_size=256, intermediate_size=384, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16)
    r = parse_recipe({"name": "asym", "weights": {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 128}})
    qc = QuantizationConfig.model_validate({
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": ct_args(r.weights), "format": "pack-quantized"}},
        "ignore": ["lm_head"]})
    apply_quantization_config(model, qc)
    for mod in model.modules():
        if hasattr(mod, "weight_scale"):
            mod.weight_scale.data.fill_(0.01)
    ModelCompressor(quantization_config=qc).compress_model(model)
    ct = {k: (tuple(v.shape), str(v.dtype).replace("torch.", ""), v.numel() * v.element_size())
          for k, v in model.state_dict().items()}
    mine = {t.name: (t.shape, t.dtype, t.nbytes)
            for t in checkpoint_tensors(ModelShape.from_config({**cfg, "dtype": "bfloat16"}), r)}
    assert mine["model.layers.0.mlp.down_proj.weight_zero_point"] == ((32, 3), "int32", 32 * 3 * 4)
    assert mine == ct


# --- Serving memory ---------------------------------------------------------------------------

def _plan(s, recipe=None, **kw):
    w = weight_bytes(s, recipe)
    args = dict(mem_bytes=80 * GIB, kv_bytes=kv_bytes_of(recipe, w.dtype), context=4096, concurrency=8)
    return plan_memory(s, w, **{**args, **kw})


def test_budget_is_memory_times_watermark_and_needed_adds_up():
    s = shape("llama-3-8b")
    m = _plan(s, utilization=0.5)
    assert m.budget == 40 * GIB
    assert m.needed == m.weights + m.kv_total_per_gpu + m.activations + m.overhead
    assert m.headroom == m.budget - m.needed and m.fits
    assert m.kv_total_per_gpu == 8 * kv_bytes_per_request(s, 4096, 2)
    assert _plan(s, tp=2).weights == math.ceil(weight_bytes(s).total / 2)


def test_largest_concurrency_and_context_are_the_fit_boundaries():
    s = shape("llama-3-8b")
    m = _plan(s, context=8192)
    assert _plan(s, context=8192, concurrency=m.max_concurrency).fits
    assert not _plan(s, context=8192, concurrency=m.max_concurrency + 1).fits
    s70 = shape("llama-3.1-70b")
    r = load_recipe("w4a16")
    m = _plan(s70, r, concurrency=16)
    assert m.max_context_limited_by == "memory" and 4096 < m.max_context < s70.max_position
    assert _plan(s70, r, concurrency=16, context=m.max_context).fits
    assert not _plan(s70, r, concurrency=16, context=m.max_context + 1).fits


def test_nothing_fits_gives_zero():
    m = _plan(shape("llama-3.1-70b"), mem_bytes=16 * GIB)
    assert not m.fits and m.max_concurrency == 0 and m.max_context == 0


# --- Conversion memory ------------------------------------------------------------------------

def test_conversion_memory_counts_one_layer_calibration_and_hessians():
    s = shape("llama-3-8b")
    layer = 4096 * 4096 * 2 + 1024 * 4096 * 2 + 3 * 4096 * 14336 + 2 * 4096
    rtn = conversion_memory(s, load_recipe("w8a16"))
    assert rtn.layer_fp32 == 4 * layer
    assert rtn.calibration == rtn.hessians == 0  # weight-only RTN streams without data
    gptq = parse_recipe({"name": "g", "weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
                         "algorithm": ["gptq"], "calibration": {"num_samples": 128, "seq_len": 2048}})
    c = conversion_memory(s, gptq)
    assert c.calibration == 2 * 128 * 2048 * 4096 * 4
    # q/k/v share one Hessian, gate/up another; o_proj and down_proj have their own; plus one inverse
    assert c.hessians == (3 * 4096**2 + 14336**2) * 4 + 14336**2 * 4
    assert c.total == c.layer_fp32 + c.embeddings + c.calibration + c.hessians


def test_moe_hessians_are_per_expert():
    s = shape("qwen3-30b-a3b")
    gptq = parse_recipe({"name": "g", "weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
                         "algorithm": ["gptq"]})
    attn = 2048**2 + (32 * 128) ** 2  # q/k/v share the hidden input; o_proj reads 32 heads × 128
    experts = 128 * (2048**2 + 768**2)  # each expert: gate/up input and down_proj input
    assert conversion_memory(s, gptq).hessians == (attn + experts) * 4 + 4096**2 * 4


# --- Parsing ----------------------------------------------------------------------------------

def test_read_config_from_directory_or_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config("llama-3-8b")))
    assert read_config(tmp_path) == read_config(tmp_path / "config.json") == config("llama-3-8b")
    with pytest.raises(UsageError, match="no config.json"):
        read_config(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UsageError, match="not valid JSON"):
        read_config(tmp_path / "bad.json")


def test_missing_key_is_named():
    cfg = {k: v for k, v in config("llama-3-8b").items() if k != "hidden_size"}
    with pytest.raises(UsageError, match="'hidden_size'"):
        ModelShape.from_config(cfg)


def test_unknown_model_type_is_counted_as_llama_and_said():
    s = ModelShape.from_config({**config("llama-3-8b"), "model_type": "brand_new"})
    assert any("brand_new" in n for n in s.notes)
    assert weight_bytes(s).total == 16_060_522_496


def test_multimodal_text_config_is_the_language_model():
    flat = config("qwen2.5-vl-72b")
    text = {k: v for k, v in flat.items() if k not in ("vision_config", "model_type")}
    nested = {"model_type": "qwen2_5_vl", "vision_config": flat["vision_config"],
              "text_config": {**text, "model_type": "qwen2_5_vl_text"}}
    a, b = ModelShape.from_config(flat), ModelShape.from_config(nested)
    assert weight_bytes(a).total == weight_bytes(b).total
    assert a.vision_params > 0 and DTYPE_BYTES[a.dtype] == 2
