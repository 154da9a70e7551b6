"""The --recommend decision tree: three deployments, the nothing-fits case, and the ordering rules."""

from dataclasses import replace

import pytest
from plan_helpers import CONFIGS, shape

from qtk.errors import UsageError
from qtk.plan.decide import RecipeClass, recommend, shipped_recipes
from qtk.plan.hardware import get_gpu
from qtk.plan.memory import ModelShape, read_config
from qtk.plan.planner import Deployment
from qtk.recipe import builtin_recipes, load_recipe, parse_recipe

# The six recipes this test was written against; the shipped directory grows, so exact-name
# assertions use this fixed set and the shipped set is checked by class.
PINNED = ("fp8", "fp8-dynamic", "fp8-kv8", "int8-kv8", "w4a16", "w8a16")


def pinned():
    return {n: load_recipe(n) for n in PINNED}


def pick(s, deployment, recipes, **kw):
    """The tree over exactly these recipes (no KV-cache variants): the ordering rules below are written against them."""
    return recommend(s, deployment, recipes, combine_kv=False, **kw)


def dep(gpu, **kw):
    return Deployment(gpu=get_gpu(gpu), **kw)


def check_reasons(d):
    """Every recipe passed over has a one-line reason; exactly one is chosen (or none)."""
    assert sum(c.status == "chosen" for c in d.candidates) == (1 if d.chosen else 0)
    for c in d.candidates:
        assert c.status and c.reason and "\n" not in c.reason, c


# --- Scenario 1: a 27B-class model on one A100-80G at 4K x 8 -----------------------------------

def test_27b_on_one_a100_80g_takes_int8_weights_not_fp8():
    s = shape("gemma-2-27b")
    deployment = dep("a100-80g", context=4096, concurrency=8)
    d = pick(s, deployment, pinned())
    check_reasons(d)
    assert d.chosen == "w8a16"
    by = {c.name: c for c in d.candidates}
    for n in ("fp8", "fp8-dynamic", "fp8-kv8"):  # A100 has no FP8 tensor cores
        assert by[n].status == "excluded" and "FP8" in by[n].reason and "A100" in by[n].reason
    assert by["int8-kv8"].status == "passed" and "KV-cache quantization not needed" in by["int8-kv8"].reason
    assert by["w4a16"].status == "passed" and "4-bit weights not needed" in by["w4a16"].reason
    # the bf16 model would leave less than the 10% headroom the tree asks for
    assert d.baseline.headroom_fraction < 0.10
    assert not d.warnings
    # against the whole shipped directory the choice stays in the same class
    k = RecipeClass.of(recommend(s, deployment).recipe)
    assert (k.weight_bits, k.fp8, k.kv8) == (8, False, False)


# --- Scenario 2: 70B on two H100 -----------------------------------------------------------------

def test_70b_on_two_h100_takes_fp8():
    s = shape("llama-3.1-70b")
    deployment = dep("h100-80g", tp=2, context=8192, concurrency=16)
    d = pick(s, deployment, pinned())
    check_reasons(d)
    assert d.chosen == "fp8-dynamic"
    assert not d.baseline.fits  # 141 GB of bf16 weights do not fit in 2 x 72 GB
    by = {c.name: c for c in d.candidates}
    assert "finer weight scales" in by["fp8"].reason  # per-tensor vs per-channel
    assert "FP8 runs natively" in by["w8a16"].reason
    k = RecipeClass.of(recommend(s, deployment).recipe)
    assert (k.weight_bits, k.fp8, k.kv8) == (8, True, False)
    # on one H100 the 8-bit weights alone exceed the budget: only 4 bits fit (at a lighter load)
    one = pick(s, dep("h100-80g", tp=1, context=8192, concurrency=4), pinned())
    assert RecipeClass.of(one.recipe).weight_bits == 4


# --- Scenario 3: a 72B multimodal-sized text model ------------------------------------------------

def test_72b_multimodal_on_one_h100_needs_int4_and_says_it_is_risky():
    s = shape("qwen2.5-vl-72b")
    d = pick(s, dep("h100-80g", context=4096, concurrency=4), pinned())
    check_reasons(d)
    assert d.chosen == "w4a16"
    for c in d.candidates:
        if c.name != "w4a16":
            assert c.status == "no-fit" and c.reason.startswith("does not fit")
    assert any("risky for math/code" in w for w in d.warnings)
    code = pick(s, dep("h100-80g", context=4096, concurrency=4), pinned(), workload="code")
    assert any("--workload code" in w and "--tp 2" in w for w in code.warnings)
    # on an H200 the same model fits at 8 bits, so INT4 is passed over
    h200 = pick(s, dep("h200", context=4096, concurrency=4), pinned())
    assert RecipeClass.of(h200.recipe).weight_bits == 8 and not h200.warnings


# --- Nothing fits --------------------------------------------------------------------------------

def test_nothing_fits_names_the_smallest_and_its_need():
    d = recommend(shape("llama-3.1-70b"), dep("t4", context=32768, concurrency=8), pinned())
    assert d.chosen is None and d.recipe is None
    check_reasons(d)
    assert d.reason.startswith("nothing fits")
    # fp8 recipes cannot run on a T4; of the rest INT4 weights with an (INT8, no FP8 on a T4) 8-bit KV cache is smallest
    assert "the smallest, w4a16+kv8," in d.reason and "GB per GPU" in d.reason
    assert next(c for c in d.candidates if c.name == "w4a16+kv8").recipe.kv_cache.type == "int"
    only = pick(shape("llama-3.1-70b"), dep("t4", context=32768, concurrency=8), pinned())
    assert "the smallest, int8-kv8," in only.reason  # without the combinations: the shipped 8-bit-KV recipe


# --- Ordering rules --------------------------------------------------------------------------------

def test_a_calibrated_recipe_ranks_above_rtn_in_the_same_class():
    recipes = pinned()
    recipes["w4a16-gptq"] = parse_recipe({"name": "w4a16-gptq", "algorithm": ["gptq"],
                                          "weights": {"num_bits": 4, "strategy": "group", "group_size": 128}})
    d = pick(shape("qwen2.5-vl-72b"), dep("h100-80g", context=4096, concurrency=4), recipes)
    assert d.chosen == "w4a16-gptq"
    assert "calibrates (gptq)" in next(c for c in d.candidates if c.name == "w4a16").reason


def test_symmetric_ranks_above_asymmetric_when_both_calibrate():
    w4 = {"num_bits": 4, "strategy": "group", "group_size": 128}
    recipes = {"w4-awq": parse_recipe({"name": "w4-awq", "algorithm": ["awq"], "weights": {**w4, "symmetric": False}}),
               "w4-gptq": parse_recipe({"name": "w4-gptq", "algorithm": ["gptq"], "weights": w4})}
    d = pick(shape("qwen2.5-vl-72b"), dep("h100-80g", context=4096, concurrency=4), recipes)
    assert d.chosen == "w4-gptq"
    assert "no zero points" in next(c for c in d.candidates if c.name == "w4-awq").reason


def test_headroom_threshold_moves_the_choice():
    s = shape("gemma-2-27b")
    strict = pick(s, dep("a100-80g", context=8192, concurrency=8), pinned(), min_headroom=0.5)
    loose = pick(s, dep("a100-80g", context=8192, concurrency=8), pinned(), min_headroom=0.0)
    assert RecipeClass.of(strict.recipe).weight_bits == 4
    assert loose.chosen == "w8a16"
    assert any(c.status == "tight" and "headroom" in c.reason for c in strict.candidates)


def test_broken_recipe_is_reported_not_fatal():
    recipes = {**pinned(), "broken": UsageError("broken.yaml: unknown key 'wieghts'")}
    d = pick(shape("llama-3-8b"), dep("h100-80g"), recipes)
    broken = next(c for c in d.candidates if c.name == "broken")
    assert broken.status == "error" and "wieghts" in broken.reason
    assert d.chosen == "fp8-dynamic"


def test_the_shipped_directory_is_what_the_tree_reads():
    shipped = shipped_recipes()
    assert set(shipped) == set(builtin_recipes())
    assert all(not isinstance(r, Exception) for r in shipped.values())


def test_classification_reads_the_schemes():
    k = RecipeClass.of(load_recipe("int8-kv8"))
    assert (k.weight_bits, k.fp8, k.kv8, k.weight_only) == (8, False, True, False)
    k = RecipeClass.of(load_recipe("w4a16"))
    assert (k.weight_bits, k.fp8, k.kv8, k.weight_only, k.calibrated) == (4, False, False, True, None)
    assert RecipeClass.of(load_recipe("fp8")).fp8
    # weights first, then the KV cache, then fewer bits
    tiers = sorted(PINNED, key=lambda n: RecipeClass.of(load_recipe(n)).tier)
    assert [RecipeClass.of(load_recipe(n)).tier for n in tiers] == sorted(RecipeClass.of(load_recipe(n)).tier for n in PINNED)
    assert tiers[-1] == "w4a16"


@pytest.mark.parametrize("gpu", ["a100-40g", "t4"])
def test_fp8_is_never_chosen_without_fp8_tensor_cores(gpu):
    d = recommend(shape("llama-3-8b"), dep(gpu, context=2048, concurrency=2))
    assert d.chosen is not None and not RecipeClass.of(d.recipe).fp8


# ---- issue 14: FP4 on Blackwell, FP8 blocks where they tile, W4A8-FP8 on Hopper only

def test_recommend_picks_nvfp4_on_blackwell_when_4_bit_is_needed_and_says_why():
    s = ModelShape.from_config(read_config(CONFIGS / "gemma-2-27b.json"))
    d = recommend(s, Deployment(get_gpu("rtx-5090"), context=4096, concurrency=8))
    assert d.chosen.startswith("nvfp4-gptq")  # FP4 over INT4 at the 4-bit tier; GPTQ over RTN
    assert "NVFP4 weights" in d.reason and "FP4 runs natively on RTX 5090 32GB's FP4 tensor cores" in d.reason
    int4 = next(c for c in d.candidates if c.name == "w4a16-gptq+kv8")
    assert int4.status == "passed" and "FP4 (NVFP4) runs natively" in int4.reason
    assert next(c for c in d.candidates if c.name == "w4a8-fp8").status == "excluded"  # Hopper-only kernel


def test_fp4_is_excluded_before_blackwell_and_w4a8_runs_on_hopper():
    s = ModelShape.from_config(read_config(CONFIGS / "llama-3.1-70b.json"))
    d = recommend(s, Deployment(get_gpu("h100-sxm"), context=4096, concurrency=8))
    for c in d.candidates:
        if c.klass is not None and c.klass.fp4:
            assert c.status == "excluded" and "Blackwell" in c.reason, c.name
    w4a8 = next(c for c in d.candidates if c.name == "w4a8-fp8")
    assert w4a8.status != "excluded"


def test_fp8_blocks_are_excluded_where_they_do_not_tile():
    s = ModelShape.from_config(read_config(CONFIGS / "llama-3-8b.json"))
    tiny = replace(s, kv_heads=1, head_dim=64)  # k/v of 64 rows
    d = recommend(tiny, Deployment(get_gpu("h100-sxm"), context=4096, concurrency=8))
    blk = next(c for c in d.candidates if c.name == "fp8-block")
    assert blk.status == "excluded" and "vLLM cannot run FP8 blocks on model.layers.0.self_attn.k_proj [64, 4096]" in blk.reason
    assert "only the last member of a merged GEMM" in blk.reason
    d = recommend(s, Deployment(get_gpu("h100-sxm"), context=4096, concurrency=8))
    assert next(c for c in d.candidates if c.name == "fp8-block").status != "excluded"


def test_untiled_follows_vllms_rule_at_the_deployment_tp():
    """Ragged outputs of unmerged Linears are fine (DeepSeek-V3's 576-row kv_a_proj_with_mqa at tp 8); a k/v shard of
    64 rows at tp 8 is not; SmolLM2-135M (hidden 576) only fits where its 576-wide inputs are ignored; scale bytes
    count the ceil grid."""
    from qtk.plan.decide import untiled
    from qtk.plan.memory import checkpoint_tensors
    from qtk.recipe import load_recipe

    r = load_recipe("fp8-block")
    s = ModelShape.from_config(read_config(CONFIGS / "llama-3-8b.json"))  # 32 heads, 8 KV heads of 128
    assert untiled(s, r, 1) is None and untiled(s, r, 8) is None and untiled(s, r, 16) is None  # 16: KV heads copied
    narrow = replace(s, head_dim=64)  # k/v of 512 rows: whole blocks at tp 1, 64-row shards at tp 8
    assert untiled(narrow, r, 1) is None
    assert "k_proj [512, 4096]: its 512 outputs split over tp 8" in untiled(narrow, r, 8)
    assert untiled(ModelShape.from_config(read_config(CONFIGS / "deepseek-v3.json")), r, 8) is None
    smol = replace(s, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, layers=2)
    assert "q_proj [576, 576]" in untiled(smol, r, 1)
    scales = {t.name: t.shape for t in checkpoint_tensors(smol, r) if t.name.endswith("down_proj.weight_scale")}
    assert scales and set(scales.values()) == {(5, 12)}  # ceil(576/128) x 1536/128


def test_recommend_on_b200_picks_fp4_for_deepseek_v3_and_says_why():
    s = ModelShape.from_config(read_config(CONFIGS / "deepseek-v3.json"))
    d = recommend(s, Deployment(get_gpu("b200"), context=4096, concurrency=8, tp=4))
    assert d.chosen == "nvfp4-gptq", d.reason
    assert "FP4 runs natively on B200 180GB's FP4 tensor cores" in d.reason and "does not fit" in d.reason


# ---- issue 14: the W4A8 built-ins, where each runs (qtk/plan/hardware.py: w4a8_fp8, w4a8_awq, w4a8_int8)

@pytest.mark.parametrize("gpu,static_ok,dynamic_ok", [("h100-sxm", True, True), ("l4", True, False),
                                                      ("a100-80g", False, False), ("b200", False, False)])
def test_w4a8_recipes_are_excluded_where_their_kernels_do_not_run(gpu, static_ok, dynamic_ok):
    """Per-token W4A8-FP8: vLLM's CUTLASS kernel, Hopper only; static W4A8-FP8: TensorRT-LLM's W4A8_AWQ, Ada and
    Hopper; W4A8-INT8: vLLM on CPUs and Intel XPUs, so no GPU of the table."""
    s = ModelShape.from_config(read_config(CONFIGS / "llama-3.1-70b.json"))
    d = recommend(s, Deployment(get_gpu(gpu), context=4096, concurrency=8))
    by = {c.name: c for c in d.candidates}
    for name in ("w4a8-fp8-static", "w4a8-fp8-static-kv8"):
        assert (by[name].status == "excluded") != static_ok, (name, by[name].reason)
        if not static_ok:  # an A100 has no FP8 at all, which is said first
            assert ("TensorRT-LLM's W4A8_AWQ kernels on Ada and Hopper only" in by[name].reason
                    or "FP8 needs FP8 tensor cores" in by[name].reason), by[name].reason
    assert (by["w4a8-fp8"].status == "excluded") != dynamic_ok
    assert by["w4a8-int8"].status == "excluded" and "CPUs (Arm KleidiAI) and Intel XPUs" in by["w4a8-int8"].reason
    assert by["w4a8-int8+kv8"].status == "excluded"


def test_w4a8_bytes_follow_the_written_layout():
    """W4A8-INT8 is int-quantized (one int8 per int4 code, as llm-compressor's W4A8 and vLLM's W4A8Int), the static
    W4A8-FP8 packs two codes a byte (W4A8_AWQ's int4 row pairs, the same bytes as pack-quantized)."""
    from qtk.plan.memory import weight_bytes

    s = ModelShape.from_config(read_config(CONFIGS / "llama-3-8b.json"))
    int8 = weight_bytes(s, load_recipe("w4a8-int8"))
    static = weight_bytes(s, load_recipe("w4a8-fp8-static"))
    w4a16 = weight_bytes(s, load_recipe("w4a16-gptq"))
    assert int8.quantized == 2 * static.quantized == 2 * w4a16.quantized
    assert static.total > w4a16.total  # plus one static input scale per Linear


# ---- issue 14: MXFP8, Blackwell only (qtk/plan/hardware.py: mxfp8)

@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80g", "l4", "b200"])
def test_mxfp8_runs_natively_on_blackwell_only(gpu):
    """vLLM's MXFP8 GEMM (FlashInfer CUTLASS) is SM100+; before Blackwell both MXFP8 recipes are excluded, saying vLLM
    runs them weight-only. On Blackwell the 8-bit tier takes MXFP8 (blocks of 32 are finer than per-channel FP8), and
    the weight-only recipe is served W8A8-MX, which the serving notes say."""
    from qtk.plan.serving import hardware_notes

    s = ModelShape.from_config(read_config(CONFIGS / "llama-3.1-70b.json"))
    g = get_gpu(gpu)
    d = recommend(s, Deployment(g, context=4096, concurrency=8, tp=2 if gpu != "b200" else 1))
    by = {c.name: c for c in d.candidates}
    if gpu != "b200":
        for name in ("mxfp8", "mxfp8-a16", "mxfp8+kv8"):
            assert by[name].status == "excluded", (name, by[name].reason)
            assert "MXFP8 needs Blackwell's block-scaled FP8 tensor cores" in by[name].reason
            assert "vLLM runs it weight-only" in by[name].reason
        assert not (d.chosen or "").startswith("mxfp8")
        assert "vLLM runs it weight-only" in hardware_notes(load_recipe("mxfp8-a16"), g)[0]
    else:
        assert d.chosen == "mxfp8", d.reason
        assert "MXFP8 weights" in d.reason and "MXFP8 runs natively on B200 180GB" in d.reason
        assert by["fp8-dynamic"].status == "passed" and "scales every 32 weights" in by["fp8-dynamic"].reason
        assert "served as W8A8-MX" in hardware_notes(load_recipe("mxfp8-a16"), g)[0]
        assert "served as W8A8-MX" not in hardware_notes(load_recipe("mxfp8"), g)[0]
