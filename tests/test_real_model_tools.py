"""The real-model tooling without the real model (fast): scripts/real_model.py's cache rules, and
benchmarks/real_model.py's translation of qtk recipes to llm-compressor's and its code comparison."""

import importlib.util
import math
import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import make_tiny_model
from qtk import api
from qtk.recipe import builtin_recipes, load_recipe

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def script():
    return _load(ROOT / "scripts" / "real_model.py", "scripts_real_model")


@pytest.fixture(scope="module")
def bench():
    return _load(ROOT / "benchmarks" / "real_model.py", "bench_real_model")


def test_an_unstamped_directory_is_not_taken_for_the_model(script, tmp_path, monkeypatch):
    monkeypatch.setenv("QTK_REAL_MODEL_DIR", str(tmp_path))
    d = script.model_path()
    assert d.parent == tmp_path
    d.mkdir()
    (d / "config.json").write_text("{}")  # an interrupted build: files, no stamp
    assert script.real_model_dir(build_if_missing=False) is None
    (d / script.STAMP).write_text(json.dumps({"package": f"{script.PACKAGE}=={script.VERSION}",
                                              "files": ["config.json", "model.safetensors"]}))
    assert script.real_model_dir(build_if_missing=False) is None  # a listed file is missing
    (d / "model.safetensors").write_bytes(b"x")
    assert script.real_model_dir(build_if_missing=False) == d


def test_check_flag_never_downloads(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "real_model.py"), "--check"], capture_output=True,
                       text=True, env={"QTK_REAL_MODEL_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "not built" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_int4_group_size_lowered_to_one_dividing_every_linear(bench):
    doc = bench.qtk_recipe_doc("w4a16-gptq", [576, 1536])
    assert doc["weights"]["group_size"] == 64
    assert bench.qtk_recipe_doc("w4a16-gptq", [512, 1536])["weights"]["group_size"] == 128
    assert "group_size" not in bench.qtk_recipe_doc("w8a16", [576])["weights"]


@pytest.mark.parametrize("name", sorted(builtin_recipes()))
def test_each_builtin_recipe_has_its_llmcompressor_spelling(bench, name):
    doc = bench.qtk_recipe_doc(name, [576, 1536])
    cfg = bench.llmc_config(doc)
    types = [m["type"] for m in cfg["modifiers"]]
    quant = cfg["modifiers"][-1]["kwargs"]
    if name in bench.LLMC_PRESETS:  # issue 14's formats: llm-compressor's own preset of the same scheme
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

        assert quant["scheme"] == bench.LLMC_PRESETS[name]
        preset = PRESET_SCHEMES[quant["scheme"]]
        group = {"weights": preset["weights"].model_dump(),
                 **({"input_activations": {**preset["input_activations"].model_dump(), "observer": "static_minmax"}}
                    if preset.get("input_activations") is not None else {})}
        assert group["weights"]["strategy"] == doc["weights"]["strategy"]
        assert ("input_activations" in group) == bool(doc.get("activations"))
    else:
        group = quant["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == doc["weights"]["num_bits"]
    assert group["weights"].get("group_size") == doc["weights"].get("group_size")
    assert group["weights"].get("symmetric", True) == doc["weights"].get("symmetric", True)
    assert quant["ignore"] == ["lm_head"]
    steps = [next(iter(s)) if isinstance(s, dict) else s for s in doc["algorithm"]]
    expected = {"smoothquant": ["SmoothQuantModifier"], "awq": ["AWQModifier", "QuantizationModifier"],
                "gptq": ["GPTQModifier"], "rtn": ["QuantizationModifier"], "autoround": ["AutoRoundModifier"],
                "rotate": ["SpinQuantModifier"],
                # R4 joins the offline rotations' SpinQuantModifier (its own where R1/R2 are not listed)
                "rotate_online": [] if "rotate" in steps else ["SpinQuantModifier"]}
    assert types == [t for s in steps for t in expected[s]]
    if "rotate_online" in steps:
        spin = next(m for m in cfg["modifiers"] if m["type"] == "SpinQuantModifier")
        assert spin["kwargs"]["rotations"][-1] == "R4"
    act = doc.get("activations")
    if act and act.get("dynamic") is not True and name not in bench.LLMC_PRESETS:
        assert group["input_activations"]["observer"] == "static_minmax"  # llm-compressor's FP8 preset observer
        assert bench.llmc_config(doc, observer="minmax")["modifiers"][-1]["kwargs"]["config_groups"]["group_0"][
            "input_activations"]["observer"] == "minmax"
    assert ("kv_cache_scheme" in quant) == bool(doc.get("kv_cache"))
    # data only where the recipe looks at it: weight-only RTN and dynamic activations need none
    assert cfg["calibrate"] == load_recipe(name).needs_calibration


def test_compare_codes_counts_identical_codes_and_scales(bench, tmp_path, calib_file):
    import torch
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(tmp_path / "m", hidden=128, intermediate=256)
    a = api.convert(src, "w4a16", tmp_path / "a", hash_source=False).outputs["vllm"]
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text((a / "config.json").read_text())
    sd = load_file(str(a / "model.safetensors"))
    same = bench.compare_codes(a, a)
    assert same["codes_equal"] == 1.0 and same["scales_equal"] == 1.0 and same["tensors_all_codes_equal"] == same["tensors"]
    k = sorted(x for x in sd if x.endswith("weight_packed"))[0]
    sd[k] = sd[k].clone()
    sd[k][0, 0] ^= 0xF  # the first int4 code of one row flips to another code
    save_file(sd, str(b / "model.safetensors"))
    c = bench.compare_codes(a, b)
    n = torch.Size(sd[k.replace("packed", "shape")].tolist()).numel()
    total = sum(torch.Size(sd[x.replace("packed", "shape")].tolist()).numel() for x in sd if x.endswith("weight_packed"))
    assert c["codes_equal"] == pytest.approx(1 - 1 / total) and c["scales_equal"] == 1.0
    assert c["tensors_all_codes_equal"] == c["tensors"] - 1
    assert c["per_tensor"][k[: -len(".weight_packed")]]["codes_equal"] == pytest.approx(1 - 1 / n)


def test_compare_codes_reads_fp4_nibbles_and_global_scales(bench, tmp_path, calib_file):
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(tmp_path / "m", hidden=128, intermediate=256)
    a = api.convert(src, "nvfp4-a16", tmp_path / "a", hash_source=False).outputs["vllm"]
    same = bench.compare_codes(a, a)
    assert same["codes_equal"] == 1.0 and same["scales_equal"] == 1.0 and same["global_scales_equal"].startswith(
        str(same["tensors"]))
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text((a / "config.json").read_text())
    sd = load_file(str(a / "model.safetensors"))
    k = sorted(x for x in sd if x.endswith("weight_packed"))[0]
    sd[k] = sd[k].clone()
    sd[k][0, 0] ^= 0x70  # the high nibble (the second FP4 code of the byte) changes, the low one stays
    g = k.replace("weight_packed", "weight_global_scale")
    sd[g] = sd[g] * 2
    save_file(sd, str(b / "model.safetensors"))
    c = bench.compare_codes(a, b)
    m = k[: -len(".weight_packed")]
    assert c["codes_differ"] == 1 and c["per_tensor"][m]["codes_equal"] == pytest.approx(1 - 1 / (2 * sd[k].numel()))
    assert c["global_scales_equal"] == f"{c['tensors'] - 1} of {c['tensors']}"


def test_autoround_benchmark_names_read_as_recipes():
    """benchmarks/autoround.py's --recipes names: `/a,b` the recipe's formats solved by those steps, `+quipN` the
    online rotation first, `:k=v` each to the steps (or the weights scheme) that take it; each name parses as a
    recipe qtk runs."""
    from qtk.recipe import parse_recipe

    ar = _load(ROOT / "benchmarks" / "autoround.py", "bench_autoround")

    def doc(name):
        d = ar.variant_doc(name, [576, 1536])
        parse_recipe(d, json.dumps(d), d["name"])
        return d

    assert doc("nvfp4/awq,autoround")["algorithm"] == [{"awq": {}}, {"autoround": {}}]
    assert doc("nvfp4/awq,gptq:block_size=64")["algorithm"] == [{"awq": {}}, {"gptq": {"block_size": 64}}]
    d = doc("w4a16:observer=full_range")
    assert d["weights"]["observer"] == "full_range" and d["algorithm"] == [{"rtn": {}}]
    assert doc("w4a16-autoround+quip64")["algorithm"][0] == {"rotate_online": {"seed": 1, "block": 64, "modules": "all"}}
    assert doc("w4a16-autoround+rotate_online")["algorithm"][0] == {"rotate_online": {"seed": 1}}
    with pytest.raises(ValueError, match="use \\+rotate or \\+quipN"):
        ar.variant_doc("w4a16-autoround+quipx", [576])


def test_activations_only_perplexity_quantizes_the_inputs_and_nothing_else(tmp_path):
    """`RECIPE/float-weights`: the float model with only the recipe's input quantization (NVFP4 W4A4's, static
    scales from the calibration ids): its perplexity moves away from the float model's, and leaving every input
    unquantized (a 16-bit activation scheme: none to quantize; a site no Linear has) is refused rather than reported
    as a floor; `:SITE,...` quantizes only those Linears' inputs."""
    import torch
    from transformers import AutoModelForCausalLM

    ar = _load(ROOT / "benchmarks" / "autoround.py", "bench_autoround")
    model = make_tiny_model(tmp_path / "m", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids, windows = torch.randint(0, 32, (8, 32), generator=g), torch.randint(0, 32, (4, 32), generator=g)
    base = ar.rm.perplexity(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), windows)
    w4a4 = ar.activations_only_ppl(model, ar.rm.qtk_recipe_doc("nvfp4", [64, 128]), ids, windows, 4)
    assert w4a4 != pytest.approx(base, rel=1e-4) and math.isfinite(w4a4)
    with pytest.raises(SystemExit, match="no quantized activations"):
        ar.activations_only_ppl(model, ar.rm.qtk_recipe_doc("w4a16", [64, 128]), ids, windows, 4)
    # `:o_proj` quantizes o_proj's inputs alone: neither the float model nor every input quantized
    o_only = ar.activations_only_ppl(model, ar.rm.qtk_recipe_doc("nvfp4", [64, 128]), ids, windows, 4, ["o_proj"])
    assert o_only != pytest.approx(base, rel=1e-6) and o_only != pytest.approx(w4a4, rel=1e-6)
    with pytest.raises(SystemExit, match="no quantized activations"):
        ar.activations_only_ppl(model, ar.rm.qtk_recipe_doc("nvfp4", [64, 128]), ids, windows, 4, ["no_such_proj"])


def test_benchmarks_keep_or_refuse_a_results_file_of_other_settings(tmp_path, capsys):
    """Both benchmarks' kept_entries: a run adds to the results file of its own settings and keeps the other entries;
    a file of other settings is refused in one line naming what differs (exit 2, the file untouched) unless --replace
    starts it over (autoround.py's settings; real_model.py's calibration ids and held-out tokens). autoround.py's
    thread count is each row's, not a setting: rows run with --threads 1 and 2 share a table, which says so."""
    ar = _load(ROOT / "benchmarks" / "autoround.py", "bench_autoround")
    path = tmp_path / "r.json"
    settings = {"num_samples": 8, "seq_len": 32, "iters": 50}
    assert ar.rm.kept_entries(path, {}, settings, {}, False) == {}
    text = json.dumps({"settings": settings, "recipes": {"w4a16": {"perplexity": 1.5, "threads": 2}}})
    path.write_text(text)
    prev = json.loads(text)
    assert ar.rm.kept_entries(path, prev, dict(settings), prev["settings"], False) == {
        "w4a16": {"perplexity": 1.5, "threads": 2}}
    with pytest.raises(SystemExit) as e:
        ar.rm.kept_entries(path, prev, {**settings, "iters": 200}, prev["settings"], False)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "1 entries measured with other settings (iters)" in err[0]
    assert path.read_text() == text
    assert ar.rm.kept_entries(path, prev, {**settings, "iters": 200}, prev["settings"], True) == {}
    assert ar.threads_used({"recipes": {"a": {"threads": 2}, "b": {"threads": 2}}}) == "2 threads"
    # benchmarks/real_model.py: the same on its own keys, the calibration ids and the held-out tokens
    prev = {"settings": {"calib_ids_sha256_16": "ab"}, "perplexity_eval": {"tokens": 4088}, "recipes": {"w4a16": {}}}
    was = ar.rm.measured_setup(prev)
    assert was == {"calib_ids_sha256_16": "ab", "heldout_tokens": 4088}
    assert ar.rm.kept_entries(path, prev, dict(was), was, False) == {"w4a16": {}}
    assert ar.rm.kept_entries(path, prev, {**was, "calib_ids_sha256_16": "cd"}, was, True) == {}
    with pytest.raises(SystemExit) as e:
        ar.rm.kept_entries(path, prev, {**was, "heldout_tokens": 16352}, was, False)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "other settings (heldout_tokens)" in err[0]
    assert ar.threads_used({"recipes": {"a": {"threads": 1}, "b": {"threads": 2}}}).startswith("1, 2 threads")
