"""Recipe -> TensorRT-LLM quant_algo (and hf-modelopt) mapping, refusals with their fix, geometry checks, int4 pairs."""

from types import SimpleNamespace

import pytest
import torch

from qtk.errors import UsageError
from qtk.export import ExportOptions
from qtk.export.modelopt import modelopt_quant
from qtk.export.codecs.trtllm import pack_int4_pairs, unpack_int4_pairs
from qtk.export.trtllm import TRTLLMWriter, trtllm_quant
from qtk.export.trtllm.sharding import check_geometry
from qtk.model.arch import Geometry
from qtk.recipe import builtin_recipes, load_recipe, parse_recipe

FP8T = {"num_bits": 8, "type": "float", "strategy": "tensor"}
FP8C = {"num_bits": 8, "type": "float", "strategy": "channel"}
FP8_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
I8C = {"num_bits": 8, "type": "int", "strategy": "channel"}
I8T = {"num_bits": 8, "type": "int", "strategy": "tensor"}
I8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
I8_STATIC = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}
KV_INT, KV_FP8 = {"num_bits": 8, "type": "int"}, {"num_bits": 8, "type": "float"}


def W4(group=128, sym=True, strategy="group"):
    return {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": strategy, **({"group_size": group} if strategy == "group" else {})}


def recipe(**doc):
    return parse_recipe({"name": "t", **doc}, origin="t")


MAPPED = [
    (dict(weights=FP8T, activations=FP8_STATIC), "FP8", None),
    (dict(weights=FP8T, activations=FP8_STATIC, kv_cache=KV_FP8), "FP8", "FP8"),
    (dict(weights=FP8T, activations=FP8_STATIC, kv_cache=KV_INT), "FP8", "INT8"),
    (dict(weights=FP8C, activations=FP8_TOKEN), "FP8_PER_CHANNEL_PER_TOKEN", None),
    (dict(weights=I8C, activations=I8_TOKEN, kv_cache=KV_INT, algorithm=[{"smoothquant": {"alpha": 0.8}}, "gptq"]),
     "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "INT8"),
    (dict(weights=I8C, activations=I8_STATIC, kv_cache=KV_INT), "W8A8_SQ_PER_CHANNEL", "INT8"),
    (dict(weights=I8C), "W8A16", None),
    (dict(weights=I8C, algorithm=["gptq"]), "W8A16", None),
    (dict(weights=W4(strategy="channel")), "W4A16", None),
    (dict(weights=W4(128), algorithm=[{"awq": {}}]), "W4A16_AWQ", None),
    (dict(weights=W4(64), algorithm=["gptq"]), "W4A16_AWQ", None),
    (dict(weights=W4(128)), "W4A16_AWQ", None),
    # int4 groups of 128 with static per-tensor FP8 activations: ModelOpt's W4A8_AWQ (FP8 KV as FP8_KV_CFG adds it)
    (dict(weights=W4(128), activations=FP8_STATIC, algorithm=["gptq"]), "W4A8_AWQ", None),
    (dict(weights=W4(128), activations=FP8_STATIC, kv_cache=KV_FP8, algorithm=[{"awq": {}}]), "W4A8_AWQ", "FP8"),
]


@pytest.mark.parametrize("doc,algo,kv", MAPPED)
def test_recipe_maps_to_quant_algo(doc, algo, kv):
    q = trtllm_quant(recipe(**doc))
    assert (q.quant_algo, q.kv_cache_quant_algo) == (algo, kv)
    cfg = q.config(["lm_head"])
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        assert cfg == {"quant_algo": algo, "kv_cache_quant_algo": kv, "group_size": doc["weights"]["group_size"],
                       "has_zero_point": False, "pre_quant_scale": True, "exclude_modules": ["lm_head"]}
    else:
        assert cfg == {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head"]}


def test_int8_kv8_is_per_token_smoothquant_with_int8_kv():
    q = trtllm_quant(load_recipe("int8-kv8"))
    assert (q.quant_algo, q.kv_cache_quant_algo) == ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "INT8")


def test_non_awq_int4_and_plain_weight_only_say_what_they_wrote():
    assert any("W4A16_GPTQ" in n for n in trtllm_quant(recipe(weights=W4(128), algorithm=["gptq"])).notes)
    assert not trtllm_quant(recipe(weights=W4(128), algorithm=[{"awq": {}}])).notes
    assert any("re-quantizes" in n for n in trtllm_quant(recipe(weights=I8C)).notes)


REFUSED = [
    (dict(weights=W4(128, sym=False), algorithm=[{"awq": {}}]), "symmetric: true"),
    (dict(weights=W4(32)), "group_size: 128"),
    (dict(weights=W4(128), algorithm=[{"gptq": {"actorder": "group"}}]), "actorder: static"),
    (dict(weights=W4(strategy="tensor")), "strategy: group"),
    (dict(weights=FP8C, activations=FP8_STATIC), "fp8-dynamic"),
    (dict(weights=FP8T, activations=FP8_TOKEN), "fp8-dynamic"),
    (dict(weights=FP8T), "add fp8 activations"),
    (dict(weights=I8T, activations=I8_TOKEN), "strategy: channel"),
    (dict(weights=I8T), "strategy: channel"),
    (dict(weights={"num_bits": 2, "type": "int", "strategy": "channel"}), "4- or 8-bit"),
    # W4A8-FP8 per token (vLLM's): TensorRT-LLM's W4A8_AWQ has one static input scale per tensor
    (dict(weights=W4(128), activations=FP8_TOKEN, algorithm=["gptq"]), "strategy: tensor, dynamic: false"),
    (dict(weights=W4(128), activations=FP8_STATIC, algorithm=[{"gptq": {"actorder": "group"}}]), "actorder: static"),
]


@pytest.mark.parametrize("name", ["fp8-block", "fp8-block-kv8"])
def test_fp8_block_is_refused_naming_the_hugging_face_form(name):
    """FP8_BLOCK_SCALES runs in TensorRT-LLM's PyTorch backend from a Hugging Face checkpoint only (and ModelOpt's
    TensorRT-LLM export of its FP8 block config fails): no fix of the mapping's own, check_targets names the
    targets that accept the recipe for the model at hand."""
    with pytest.raises(UsageError, match="FP8_BLOCK_SCALES.*--target hf-fp8") as e:
        trtllm_quant(load_recipe(name))
    assert e.value.fix is None


@pytest.mark.parametrize("doc,fix", REFUSED)
def test_unexpressible_recipes_are_refused_with_the_fix(doc, fix):
    with pytest.raises(UsageError) as e:
        trtllm_quant(recipe(**doc))
    assert fix in e.value.fix and "\n" not in str(e.value)
    assert e.value.exit_code == 2


@pytest.mark.parametrize("name", sorted(builtin_recipes()))
def test_every_builtin_recipe_maps_or_names_the_fix(name):
    try:
        q = trtllm_quant(load_recipe(name))
    except UsageError as e:
        # the issue-14 formats qtk does not write for TensorRT-LLM are refused without a fix of the mapping's own:
        # qtk.export.check_targets names the targets that accept them (tests/export/test_target_suggestions.py)
        assert e.fix or "as a TensorRT-LLM checkpoint" in e.problem
    else:
        assert q.quant_algo


def test_hf_modelopt_mapping():
    assert modelopt_quant(recipe(weights=FP8T, activations=FP8_STATIC, kv_cache=KV_FP8)) == ("FP8", "FP8", None)
    assert modelopt_quant(recipe(weights=W4(128), algorithm=[{"awq": {}}])) == ("W4A16_AWQ", None, 128)
    with pytest.raises(UsageError) as e:
        modelopt_quant(load_recipe("int8-kv8"))
    assert "--target trtllm" in e.value.fix and "SmoothQuant" in e.value.problem
    for doc in (dict(weights=FP8C, activations=FP8_TOKEN), dict(weights=I8C), dict(weights=W4(128, sym=False))):
        with pytest.raises(UsageError, match="qtk writes hf-modelopt checkpoints for FP8") as e:
            modelopt_quant(recipe(**doc))
        assert e.value.fix is None  # the targets to suggest are computed from their checks (tests/export/test_target_suggestions.py)
    with pytest.raises(UsageError, match="INT8 KV"):
        modelopt_quant(recipe(weights=W4(128), kv_cache=KV_INT))


def test_hf_modelopt_w4a8_awq_and_fp8_block():
    """W4A8_AWQ as ModelOpt's W4A8_AWQ_BETA_CFG (static per-tensor FP8 inputs); per-token W4A8-FP8 names the fix and
    vLLM; FP8 block (ModelOpt's fp8_pb_wo is weight-only) is refused without a fix of its own (the accepting targets
    are computed)."""
    assert modelopt_quant(recipe(weights=W4(128), activations=FP8_STATIC)) == ("W4A8_AWQ", None, 128)
    assert modelopt_quant(recipe(weights=W4(128), activations=FP8_STATIC, kv_cache=KV_FP8)) == ("W4A8_AWQ", "FP8", 128)
    with pytest.raises(UsageError, match="per tensor with a static") as e:
        modelopt_quant(load_recipe("w4a8-fp8"))
    assert "--target vllm" in e.value.fix and "dynamic: false" in e.value.fix and "w4a8-fp8-static" in e.value.fix
    for name in ("fp8-block", "fp8-block-kv8"):
        with pytest.raises(UsageError, match="fp8_pb_wo") as e:
            modelopt_quant(load_recipe(name))
        assert e.value.fix is None


GEO = Geometry(layers=4, hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=32, vocab=100)


@pytest.mark.parametrize("tp,pp,group,ok", [
    (1, 1, None, True), (2, 2, None, True), (4, 1, None, True),  # kv 2 over 4 ranks: each KV head copied twice
    (8, 1, None, True), (3, 1, None, False), (16, 1, None, False), (1, 3, None, False),
    (2, 1, 128, True), (4, 1, 128, False), (4, 1, 64, True),  # attention width per rank 64 at tp 4
])
def test_geometry_checks(tp, pp, group, ok):
    if ok:
        check_geometry(GEO, tp, pp, (group,) if group else ())
    else:
        with pytest.raises(UsageError) as e:
            check_geometry(GEO, tp, pp, (group,) if group else ())
        assert e.value.fix


def test_unsupported_architecture_is_refused_naming_the_supported_ones():
    src = SimpleNamespace(config_dict={"model_type": "gemma"}, arch=SimpleNamespace(trtllm_architecture=None))
    with pytest.raises(UsageError) as e:
        TRTLLMWriter.check(src, load_recipe("fp8"), ExportOptions())
    assert all(m in e.value.problem for m in ("llama", "mistral", "qwen2", "qwen3")) and "--target vllm" in e.value.fix


# ---- int4 pairs (ModelOpt pack_int4_in_uint8 / TensorRT-LLM W4A16_AWQ layout)

def reference_pack(q: torch.Tensor) -> torch.Tensor:
    """Byte j of column i = low nibble q[2j, i], high nibble q[2j+1, i], as ModelOpt documents it."""
    out = torch.zeros(q.shape[0] // 2, q.shape[1], dtype=torch.uint8)
    for j in range(q.shape[0] // 2):
        for i in range(q.shape[1]):
            out[j, i] = (int(q[2 * j, i]) & 0xF) | ((int(q[2 * j + 1, i]) & 0xF) << 4)
    return out


def test_int4_pair_bytes():
    q = torch.tensor([[1, -8], [-1, 7]], dtype=torch.int8)
    assert pack_int4_pairs(q).view(torch.uint8).tolist() == [[0xF1, 0x78]]


@pytest.mark.parametrize("out,inp", [(2, 1), (6, 5), (16, 33)])
def test_int4_pairs_round_trip_and_match_reference(out, inp):
    g = torch.Generator().manual_seed(out * 100 + inp)
    q = torch.randint(-8, 8, (out, inp), generator=g, dtype=torch.int8)
    p = pack_int4_pairs(q)
    assert p.dtype == torch.int8 and p.shape == (out // 2, inp)
    assert torch.equal(p.view(torch.uint8), reference_pack(q))
    assert torch.equal(unpack_int4_pairs(p), q) and torch.equal(unpack_int4_pairs(p.view(torch.uint8)), q)


def test_every_int4_pair_value():
    lo, hi = torch.meshgrid(torch.arange(-8, 8), torch.arange(-8, 8), indexing="ij")
    q = torch.stack([lo.reshape(-1), hi.reshape(-1)]).to(torch.int8)  # [2, 256]: all pairs
    p = pack_int4_pairs(q)
    assert sorted(p.view(torch.uint8).reshape(-1).tolist()) == list(range(256))
    assert torch.equal(unpack_int4_pairs(p), q)
    with pytest.raises(ValueError):
        pack_int4_pairs(q[:1])


def test_fp8_fused_scales_are_unified_by_requantizing_to_the_largest():
    from qtk.export.trtllm.writer import unify_tensor_scale as _unify_tensor_scale
    from qtk.quant.qtensor import QTensor
    from qtk.recipe import QuantScheme

    s = QuantScheme(8, "float", True, "tensor")
    g = torch.Generator().manual_seed(0)
    a, b = QTensor.quantize(torch.randn(8, 16, generator=g), s), QTensor.quantize(3 * torch.randn(4, 16, generator=g), s)
    ua, ub = _unify_tensor_scale([a, b])
    assert torch.equal(ua.scale, ub.scale) and torch.equal(ub.scale, b.scale) and torch.equal(ub.values.view(torch.uint8), b.values.view(torch.uint8))
    assert not torch.equal(ua.scale, a.scale)  # the smaller range moved to the shared, larger scale
    assert torch.allclose(ua.dequantize(), a.dequantize(), rtol=0.07, atol=1e-3)
    assert _unify_tensor_scale([a, a]) == [a, a]


def test_hf_modelopt_refuses_tensor_parallel():
    from qtk.export.modelopt import ModelOptHFWriter

    with pytest.raises(UsageError, match="trtllm target only"):
        ModelOptHFWriter.check(None, load_recipe("fp8"), ExportOptions(tp=2))
