"""The command line: bad input is one line naming the fix, exit 2, and nothing left behind."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from models import make_tiny_model
from qtk.cli import main


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def _no_output_left(out):
    """Nothing that looks like a finished (or unfinished) checkpoint."""
    if not out.exists():
        return True
    return not any(p.name in ("vllm", "trtllm") or p.name.startswith(".") for p in out.iterdir())


def _assert_usage_error(code, output, *needles):
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert code == 2, output
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("odd") / "m96", hidden=96, intermediate=192, layers=1)


def test_missing_config(tmp_path, tiny_llama):
    d = tmp_path / "noconfig"
    d.mkdir()
    shutil.copy(tiny_llama / "model.safetensors", d)
    code, out = run("convert", d, "--recipe", "w8a16", "-o", tmp_path / "o")
    _assert_usage_error(code, out, "has no config.json", "Hugging Face model directory")
    assert _no_output_left(tmp_path / "o")


def test_no_weights(tmp_path, tiny_llama):
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(tiny_llama / "config.json", d)
    code, out = run("convert", d, "--recipe", "w8a16", "-o", tmp_path / "o")
    _assert_usage_error(code, out, "has no weights", "safetensors")
    assert _no_output_left(tmp_path / "o")


def test_missing_model_dir(tmp_path):
    code, out = run("convert", tmp_path / "nope", "--recipe", "w8a16", "-o", tmp_path / "o")
    _assert_usage_error(code, out, "does not exist")


def test_unknown_recipe(tmp_path, tiny_llama):
    code, out = run("convert", tiny_llama, "--recipe", "int7", "-o", tmp_path / "o")
    _assert_usage_error(code, out, "unknown recipe 'int7'", "built-in recipes")
    assert _no_output_left(tmp_path / "o")


def test_recipe_with_unknown_key(tmp_path, tiny_llama):
    p = tmp_path / "r.yaml"
    p.write_text("name: r\nweights: {num_bits: 8, stratgy: channel}\n")
    code, out = run("convert", tiny_llama, "--recipe", p, "-o", tmp_path / "o")
    _assert_usage_error(code, out, "unknown key 'stratgy'", "did you mean 'strategy'")
    assert _no_output_left(tmp_path / "o")


def test_group_size_not_dividing(tmp_path, odd_model):
    code, out = run("convert", odd_model, "--recipe", "w4a16", "-o", tmp_path / "o")
    _assert_usage_error(code, out, "group_size 128 does not divide in_features 96", "use group_size 32 or 16")
    assert _no_output_left(tmp_path / "o")


def test_group_size_checked_from_the_headers_before_calibration(tmp_path):
    """hidden 576 (a real model's width): refused before the calibration data is even opened (the --calib file does
    not exist, which would be the error otherwise), suggesting only sizes that divide every Linear: never 128."""
    m = make_tiny_model(tmp_path / "m576", hidden=576, intermediate=1536, layers=1, heads=4, kv_heads=2)
    code, out = run("convert", m, "--recipe", "w4a16-gptq", "-o", tmp_path / "o", "--calib", tmp_path / "missing.jsonl")
    _assert_usage_error(code, out, "group_size 128 does not divide in_features 576 of model.layers.0.self_attn.q_proj",
                        "use group_size 64 or 32")
    assert "128 (" not in out and _no_output_left(tmp_path / "o")
    p = tmp_path / "none.yaml"  # no group size of the list divides 100 and 200: the fix says what else to do
    p.write_text("name: x\nweights: {num_bits: 4, strategy: group, group_size: 64}\n")
    odd = make_tiny_model(tmp_path / "m100", hidden=100, intermediate=200, layers=1, heads=2, kv_heads=1)
    code, out = run("convert", odd, "--recipe", p, "-o", tmp_path / "o2")
    _assert_usage_error(code, out, "does not divide in_features 100", "strategy: channel")


def test_existing_output(tmp_path, tiny_llama):
    (tmp_path / "o" / "vllm").mkdir(parents=True)
    (tmp_path / "o" / "vllm" / "keep.txt").write_text("mine")
    code, out = run("convert", tiny_llama, "--recipe", "w8a16", "-o", tmp_path / "o")
    _assert_usage_error(code, out, "already exists", "--overwrite")
    assert (tmp_path / "o" / "vllm" / "keep.txt").read_text() == "mine"


def test_overwrite_replaces(tmp_path, tiny_llama):
    (tmp_path / "o" / "vllm").mkdir(parents=True)
    (tmp_path / "o" / "vllm" / "keep.txt").write_text("old")
    code, out = run("convert", tiny_llama, "--recipe", "w8a16", "-o", tmp_path / "o", "--overwrite", "--no-hash")
    assert code == 0, out
    names = {p.name for p in (tmp_path / "o" / "vllm").iterdir()}
    assert "keep.txt" not in names and "model.safetensors" in names
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["vllm"]


def test_output_inside_model_dir_refused(tiny_llama):
    code, out = run("convert", tiny_llama, "--recipe", "w8a16", "-o", tiny_llama / "q")
    _assert_usage_error(code, out, "inside the model directory")
    assert not (tiny_llama / "q").exists()


def test_unknown_target(tmp_path, tiny_llama):
    code, out = run("convert", tiny_llama, "--recipe", "w8a16", "-o", tmp_path / "o", "--target", "onnx")
    _assert_usage_error(code, out, "unknown target 'onnx'", "available targets")


def test_empty_calibration_file(tmp_path, tiny_llama):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    code, out = run("convert", tiny_llama, "--recipe", "int8-kv8", "-o", tmp_path / "o", "--calib", p)
    _assert_usage_error(code, out, "holds no text")
    assert _no_output_left(tmp_path / "o")


def test_calibration_wrong_field(tmp_path, tiny_llama):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"content": "hello world " * 40}) + "\n")
    code, out = run("convert", tiny_llama, "--recipe", "int8-kv8", "-o", tmp_path / "o", "--calib", p)
    _assert_usage_error(code, out, "no 'text' field", "--text-field")
    code, out = run("convert", tiny_llama, "--recipe", "int8-kv8", "-o", tmp_path / "o", "--calib", p,
                    "--text-field", "content", "--num-samples", "2", "--seq-len", "16", "--no-hash")
    assert code == 0, out


def test_calibration_too_short(tmp_path, tiny_llama):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"text": "tiny"}) + "\n")
    code, out = run("convert", tiny_llama, "--recipe", "int8-kv8", "-o", tmp_path / "o", "--calib", p, "--seq-len", "64")
    _assert_usage_error(code, out, "fewer than one window of --seq-len 64", "lower --seq-len")


def test_recipes_list_and_show():
    code, out = run("recipes", "list")
    assert code == 0 and "int8-kv8" in out and "w4a16" in out
    code, out = run("recipes", "show", "fp8-kv8")
    assert code == 0 and "kv_cache" in out and "name: fp8-kv8" in out


def test_inspect_fails_on_uncalibrated_kv_scales(tmp_path, tiny_llama, calib_file):
    """A checkpoint whose KV scales are all 1.0 (the classic silent failure) is caught: exit 1."""
    code, out = run("convert", tiny_llama, "--recipe", "fp8-kv8", "-o", tmp_path / "o", "--calib", calib_file,
                    "--num-samples", "4", "--seq-len", "32", "--no-hash")
    assert code == 0, out
    d = tmp_path / "o" / "vllm"
    code, out = run("inspect", d)
    assert code == 0 and "FAIL" not in out, out
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    for k in sd:
        if k.endswith(("k_scale", "v_scale")):
            sd[k] = sd[k] * 0 + 1.0
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    code, out = run("inspect", d)
    assert code == 1 and "FAIL KV scales calibrated" in out


def test_inspect_fails_on_constant_packed_weights_and_missing_modules(tmp_path, tiny_llama):
    code, out = run("convert", tiny_llama, "--recipe", "w4a16", "-o", tmp_path / "o", "--no-hash")
    assert code == 0, out
    d = tmp_path / "o" / "vllm"
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_packed"
    sd[name] = torch.full_like(sd[name], 0x77777777)  # every nibble 7: a collapsed constant tensor
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    code, out = run("inspect", d, "--json")
    rep = json.loads(out)
    assert code == 1 and not rep["ok"]
    failed = {c["name"] for c in rep["checks"] if not c["ok"]}
    assert failed == {"quantized weights not constant"}
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        del sd[f"model.layers.1.self_attn.o_proj.{suffix}"]
    sd["model.layers.1.self_attn.o_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight_scale"].clone()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    code, out = run("inspect", d, "--json")
    failed = {c["name"] for c in json.loads(out)["checks"] if not c["ok"]}
    assert code == 1 and "every targeted Linear is quantized" in failed


def test_console_script_end_to_end(tmp_path, tiny_llama):
    """The installed `qtk` entry point: real process, real exit codes."""
    exe = os.path.join(os.path.dirname(sys.executable), "qtk")
    r = subprocess.run([exe, "convert", str(tiny_llama), "--recipe", "w8a16", "-o", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "wrote vllm" in r.stdout
    r = subprocess.run([exe, "convert", str(tiny_llama), "--recipe", "w8a16", "-o", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1
