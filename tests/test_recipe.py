"""Recipes: built-ins load; every kind of mistake is a one-line error naming the key and the fix."""

import pytest
import yaml

from qtk.errors import UsageError
from qtk.recipe import builtin_recipes, load_recipe, parse_recipe

REQUIRED = {"int8-kv8", "fp8", "fp8-kv8", "fp8-dynamic", "w8a16", "w4a16"}


def test_builtins_load_and_match_their_names():
    names = set(builtin_recipes())
    assert REQUIRED <= names
    for n in names:
        r = load_recipe(n)
        assert r.name == n and r.description


def test_builtin_schemes():
    r = load_recipe("int8-kv8")
    assert (r.weights.num_bits, r.weights.type, r.weights.strategy, r.weights.symmetric) == (8, "int", "channel", True)
    assert (r.activations.strategy, r.activations.dynamic) == ("token", True)
    assert r.kv_cache.num_bits == 8 and r.needs_calibration
    w4 = load_recipe("w4a16")
    assert (w4.weights.num_bits, w4.weights.group_size, w4.activations, w4.needs_calibration) == (4, 128, None, False)
    fp8 = load_recipe("fp8")
    assert fp8.weights.is_fp8 and fp8.static_activations and fp8.needs_calibration
    assert not load_recipe("fp8-dynamic").needs_calibration


def test_load_by_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\nweights: {num_bits: 4, strategy: group, group_size: 32, symmetric: false}\n")
    r = load_recipe(str(p))
    assert r.weights.group_size == 32 and not r.weights.symmetric and r.ignore == ("lm_head",)


BAD = [
    ({"name": "x", "weights": {"num_bits": 8}, "weight": 1}, "unknown key 'weight'", "did you mean 'weights'"),
    ({"name": "x"}, "missing key 'weights'", "add"),
    ({"weights": {"num_bits": 8}}, "missing key 'name'", "add"),
    ({"name": "x", "weights": {"num_bits": 8, "typ": "int"}}, "unknown key 'typ'", "did you mean 'type'"),
    ({"name": "x", "weights": {"num_bits": 3}}, "int3 is not supported", "use one of"),
    ({"name": "x", "weights": {"num_bits": "8"}}, "expected int", "set num_bits"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "symmetric": False}}, "asymmetric fp8", "symmetric: true"),
    ({"name": "x", "weights": {"num_bits": 6, "type": "float"}}, "fp8 (e4m3) or fp4 (e2m1)", "num_bits: 8 or 4"),
    # issue 14: the fp4 / block / MX vocabulary
    ({"name": "x", "weights": {"num_bits": 4, "type": "float"}}, "fp4 is NVFP4", "tensor_group"),
    ({"name": "x", "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 32}}, "fp4 is NVFP4", "group_size: 16"),
    ({"name": "x", "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16, "scale_dtype": "e8m0"}},
     "MX formats (scale_dtype e8m0) scale blocks of 32", "group_size: 32"),
    ({"name": "x", "weights": {"num_bits": 4, "scale_dtype": "e8m0", "strategy": "group", "group_size": 32}}, "e8m0 scales are for the MX float", "type: float"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "scale_dtype": "fp16"}}, "not a scale dtype", "e8m0"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}, "needs the block shape", "[128, 128]"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128]}}, "expected [rows, cols]", "[128, 128]"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "block", "block_structure": [128, 128]}}, "'block' is for fp8 weights", "num_bits: 8"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "block_structure": [128, 128]}}, "only meaningful with strategy 'block'", "strategy: block"),
    ({"name": "x", "weights": {"num_bits": 8, "dynamic": "local"}}, "'local'", "dynamic: true or false"),
    ({"name": "x", "weights": {"num_bits": 8, "dynamic": "sometimes"}}, "expected true, false or 'local'", "dynamic: true"),
    ({"name": "x", "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
      "activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": True}},
     "NVFP4 activations take group scales at run time", "dynamic: local"),
    ({"name": "x", "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
      "activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}, "NVFP4 weights and activations go together", "nvfp4"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
      "activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}, "FP8 block weights run with", "fp8-block"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
      "activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64, "dynamic": True}}, "do not match weight blocks", "group_size: 128"),
    ({"name": "x", "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "e8m0"},
      "activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}, "MX weights run with quantized activations only as MXFP8", "mxfp8"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "e8m0"},
      "activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "e8m0"}},
     "MX activations are MXFP8 (num_bits 8) with block scales taken at run time", "dynamic: true"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "group", "group_size": 64},
      "activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}}, "run with 8-bit activations only as W4A8-FP8", "w4a8-fp8"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False},
      "activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}}, "run with 8-bit activations only as W4A8-FP8", "w4a8-fp8"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "group"}}, "needs a positive group_size", "group_size: 128"),
    ({"name": "x", "weights": {"num_bits": 4, "group_size": 128}}, "only meaningful with strategy 'group'", "strategy: group"),
    ({"name": "x", "weights": {"num_bits": 8, "strategy": "token"}}, "per-token scales", "dynamic"),
    ({"name": "x", "weights": {"num_bits": 8, "strategy": "rows"}}, "unknown strategy 'rows'", "use one of"),
    ({"name": "x", "weights": {"num_bits": 8, "observer": "ema"}}, "unknown observer", "minmax"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False,
                               "observer": "full_range"}}, "full_range is a grid of symmetric int weights", "minmax"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "observer": "full_range"}},
     "full_range is a grid of symmetric int weights", "minmax"),
    ({"name": "x", "weights": {"num_bits": 8, "strategy": "tensor", "observer": "full_range"}},
     "full_range is a grid of symmetric int weights", "strategy channel or group"),
    ({"name": "x", "weights": {"num_bits": 8}, "activations": {"num_bits": 8, "observer": "full_range"}},
     "activations.observer: full_range", "minmax"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float"}, "kv_cache": {"num_bits": 8, "type": "float",
                                                                            "observer": "full_range"}},
     "kv_cache.observer: full_range", "minmax"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "channel"}, "activations": {"num_bits": 8, "strategy": "token", "dynamic": True}},
     "W4A8", "drop activations"),
    ({"name": "x", "weights": {"num_bits": 8}, "activations": {"num_bits": 4, "strategy": "token", "dynamic": True}},
     "4-bit activations", "num_bits: 8"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float"}, "activations": {"num_bits": 8, "strategy": "token", "dynamic": True}},
     "activations are int but weights are float", "fp8 with fp8"),
    ({"name": "x", "weights": {"num_bits": 8}, "activations": {"num_bits": 8, "strategy": "channel"}}, "per tensor or per token", "strategy"),
    ({"name": "x", "weights": {"num_bits": 8}, "kv_cache": {"num_bits": 4}}, "KV cache is quantized to 8 bits", "kv_cache"),
    ({"name": "x", "weights": {"num_bits": 8}, "algorithm": ["magic"]}, "unknown algorithm 'magic'", "use one of"),
    ({"name": "x", "weights": {"num_bits": 8}, "algorithm": [{"gptq": {"damp": 0.1}}]}, "unknown key 'damp'", "damp_percent"),
    ({"name": "x", "weights": {"num_bits": 8}, "algorithm": [{"gptq": {"damp_percent": 2.0}}]}, "must be in (0, 1)", "0.01"),
    ({"name": "x", "weights": {"num_bits": 8}, "algorithm": ["smoothquant"]}, "must end with exactly one of", "e.g."),
    ({"name": "x", "weights": {"num_bits": 8}, "algorithm": ["rtn", "rtn"]}, "lists a step twice", "once"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
      "algorithm": [{"autoround": {"iters": 0}}]}, "iters: must be in 1..100000", "200"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
      "algorithm": [{"autoround": {"lr": 1.5}}]}, "lr: must be in [0, 1]", "1/iters"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
      "algorithm": ["autoround"]}, "autoround learns int weights per channel or group and FP4 groups", "nvfp4-autoround"),
    ({"name": "x", "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "e8m0"},
      "algorithm": ["autoround"]}, "not mxfp8", "gptq / rtn"),
    ({"name": "x", "weights": {"num_bits": 8}, "ignore": [1]}, "ignore must be a list", "lm_head"),
    ({"name": "x", "weights": {"num_bits": 8}, "ignore": ["re:(("]}, "not a valid regex", "fix"),
    ({"name": "x", "weights": {"num_bits": 8}, "calibration": {"num_samples": 0}}, "must be positive", "64"),
    ({"name": "x", "weights": {"num_bits": 8}, "calibration": {"seq_len": 1}}, "at least 2", "256"),
    ([1, 2], "a recipe is a YAML mapping", "name:"),
]


@pytest.mark.parametrize("doc,problem,fix", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_recipes_name_problem_and_fix(doc, problem, fix):
    with pytest.raises(UsageError) as e:
        parse_recipe(doc, yaml.safe_dump(doc), "r.yaml")
    msg = str(e.value)
    assert problem in msg and fix in msg and "\n" not in msg
    assert e.value.exit_code == 2


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(UsageError, match="unknown recipe 'int9'.*int8-kv8"):
        load_recipe("int9")


def test_invalid_yaml_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nweights: {num_bits: 8\n")
    with pytest.raises(UsageError, match=r"not valid YAML at line \d"):
        load_recipe(str(p))


def test_missing_recipe_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_recipe(str(tmp_path / "nope.yaml"))


# ---- GPTQ activation ordering: llm-compressor's spellings ----

W4G = {"num_bits": 4, "strategy": "group", "group_size": 64}


@pytest.mark.parametrize("spelling,canonical", [("static", "static"), ("weight", "static"), ("Static", "static"),
                                                ("group", "group"), ("dynamic", "group"), (False, None), (None, None)])
def test_gptq_actorder_accepts_llm_compressors_spellings(spelling, canonical):
    r = parse_recipe({"name": "x", "weights": W4G, "algorithm": [{"gptq": {"actorder": spelling}}]})
    assert r.step("gptq").params.actorder == canonical == r.gptq_actorder
    assert r.writes_g_idx == (canonical == "group")


def test_gptq_actorder_defaults_to_static_as_llm_compressor_and_the_shipped_recipes():
    assert parse_recipe({"name": "x", "weights": W4G, "algorithm": ["gptq"]}).gptq_actorder == "static"
    for name in builtin_recipes():
        r = load_recipe(name)
        if r.step("gptq") is not None:
            assert r.gptq_actorder == "static" and not r.writes_g_idx, name


@pytest.mark.parametrize("params,problem,fix", [
    ({"actorder": True}, "actorder: true is ambiguous", "actorder: static"),
    ({"actorder": True, "static_groups": True}, "actorder: true is ambiguous", "actorder: group"),
    ({"actorder": "sideways"}, "unknown ordering 'sideways'", "static (or weight)"),
    ({"actorder": "group", "static_groups": True}, "static_groups fixes them up front", "write actorder: static"),
])
def test_gptq_actorder_refusals_name_the_fix(params, problem, fix):
    with pytest.raises(UsageError) as e:
        parse_recipe({"name": "x", "weights": W4G, "algorithm": [{"gptq": params}]}, origin="r.yaml")
    msg = str(e.value)
    assert problem in msg and fix in msg and msg.startswith("r.yaml: algorithm[0].gptq") and "\n" not in msg, msg


# ---- a scheme per module: overrides and scheme_for ----

MIXED = {
    "name": "w4-sensitive-int8",
    "weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
    "overrides": [
        {"targets": ["re:.*layers\\.0\\..*"], "weights": {"num_bits": 8, "strategy": "channel"}},
        {"targets": ["mlp.down_proj", "re:.*layers\\.0\\.mlp\\.down_proj"], "weights": {"num_bits": 4, "strategy": "channel"}},
    ],
    "ignore": ["lm_head", "model.layers.1.self_attn.o_proj"],
    "algorithm": ["gptq"],
}


def test_scheme_for_ignore_then_first_override_then_default():
    r = parse_recipe(MIXED)
    int8 = r.scheme_for("model.layers.0.self_attn.q_proj")
    assert (int8.weights.num_bits, int8.weights.strategy, int8.activations) == (8, "channel", None)
    # layer 0's down_proj matches both rules: the first one wins
    assert r.scheme_for("model.layers.0.mlp.down_proj") == int8
    ch4 = r.scheme_for("model.layers.3.mlp.down_proj")
    assert (ch4.weights.num_bits, ch4.weights.strategy) == (4, "channel")
    default = r.scheme_for("model.layers.3.mlp.up_proj")
    assert default == r.default_scheme and default.weights.group_size == 128
    # ignore wins over every rule
    assert r.scheme_for("model.layers.1.self_attn.o_proj") is None and r.scheme_for("lm_head") is None
    assert r.mixed and len(r.schemes) == 3 and r.schemes[0] == r.default_scheme
    assert "+2 overrides" in r.summary()


def test_override_activations_inherit_unless_given():
    doc = {"name": "w8a8", "weights": {"num_bits": 8}, "activations": {"num_bits": 8, "strategy": "token", "dynamic": True},
           "overrides": [{"targets": ["mlp.down_proj"], "weights": {"num_bits": 8, "strategy": "tensor"}},
                         {"targets": ["o_proj"], "weights": {"num_bits": 8}, "activations": None}]}
    r = parse_recipe(doc)
    assert r.scheme_for("model.layers.0.mlp.down_proj").activations == r.activations
    assert r.scheme_for("model.layers.0.self_attn.o_proj").activations is None
    static = parse_recipe({**doc, "overrides": [{"targets": ["o_proj"], "weights": {"num_bits": 8},
                                                  "activations": {"num_bits": 8, "strategy": "tensor"}}]})
    assert static.static_activations and static.needs_calibration
    assert not parse_recipe({**doc, "algorithm": ["rtn"], "overrides": []}).static_activations


@pytest.mark.parametrize("overrides,problem,fix", [
    ({"targets": ["q_proj"]}, "overrides[0]: missing key 'weights'", "weights:"),
    ({"weights": {"num_bits": 8}}, "overrides[0]: missing key 'targets'", "targets:"),
    ({"targets": [], "weights": {"num_bits": 8}}, "targets must be a non-empty list", "targets:"),
    ({"targets": ["re:(("], "weights": {"num_bits": 8}}, "is not a valid regex", "fix the pattern"),
    ({"targets": ["o_proj"], "weights": {"num_bits": 8}, "scheme": "x"}, "overrides[0]: unknown key 'scheme'", "valid keys"),
    ({"targets": ["o_proj"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False},
      "activations": {"num_bits": 8, "strategy": "token", "dynamic": True}}, "run only as W4A8-INT8", "drop activations"),
    ({"targets": ["o_proj"], "weights": {"num_bits": 3}}, "overrides[0]: weights.num_bits: int3 is not supported", "use one of"),
])
def test_bad_overrides_name_problem_and_fix(overrides, problem, fix):
    with pytest.raises(UsageError) as e:
        parse_recipe({"name": "x", "weights": {"num_bits": 8}, "overrides": [overrides]}, origin="x.yaml")
    assert problem in e.value.problem and fix in e.value.fix, (e.value.problem, e.value.fix)
    with pytest.raises(UsageError, match="overrides must be a list"):
        parse_recipe({"name": "x", "weights": {"num_bits": 8}, "overrides": {"targets": ["o_proj"]}})


def test_overrides_are_checked_against_the_model(tmp_path, tiny_llama):
    """Before any work: a rule that gives q/k/v (or gate/up) different schemes, and a target that matches no Linear."""
    from qtk.model.source import ModelSource
    from qtk.pipeline import check_ignore, check_group_size

    src = ModelSource(tiny_llama)
    split = parse_recipe({**MIXED, "overrides": [{"targets": ["model.layers.1.self_attn.k_proj"], "weights": {"num_bits": 8}}]})
    with pytest.raises(UsageError) as e:
        check_ignore(src, split)
    assert "fused group self_attn.q_proj, self_attn.k_proj, self_attn.v_proj of layer 1 different schemes" in e.value.problem
    assert "same override" in e.value.fix
    typo = parse_recipe({**MIXED, "overrides": [{"targets": ["mlp.dwn_proj"], "weights": {"num_bits": 8}}]})
    with pytest.raises(UsageError, match=r"overrides\[0\] target 'mlp.dwn_proj' matches no Linear"):
        check_ignore(src, typo)
    check_ignore(src, parse_recipe(MIXED))  # whole groups: fine
    # each module's group size is checked against its own scheme (hidden 128, intermediate 256)
    g = parse_recipe({**MIXED, "overrides": [{"targets": ["mlp.down_proj"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 96}}]})
    with pytest.raises(UsageError, match="group_size 96 does not divide in_features 256 of model.layers.0.mlp.down_proj"):
        check_group_size(src, g)
    check_group_size(src, parse_recipe(MIXED))
