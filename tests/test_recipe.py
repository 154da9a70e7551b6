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
    ({"name": "x", "weights": {"num_bits": 4, "type": "float"}}, "fp8 (e4m3) only", "num_bits: 8"),
    ({"name": "x", "weights": {"num_bits": 4, "strategy": "group"}}, "needs a positive group_size", "group_size: 128"),
    ({"name": "x", "weights": {"num_bits": 4, "group_size": 128}}, "only meaningful with strategy 'group'", "strategy: group"),
    ({"name": "x", "weights": {"num_bits": 8, "strategy": "token"}}, "per-token scales", "dynamic"),
    ({"name": "x", "weights": {"num_bits": 8, "strategy": "rows"}}, "unknown strategy 'rows'", "use one of"),
    ({"name": "x", "weights": {"num_bits": 8, "observer": "ema"}}, "unknown observer", "minmax"),
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
