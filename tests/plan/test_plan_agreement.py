"""The planner's byte count equals what `qtk convert` writes: tiny models, every shipped recipe."""

import json
import struct
import subprocess
import sys

import pytest
from plan_helpers import CONFIGS

from qtk.plan.memory import ModelShape, checkpoint_tensors, read_config, weight_bytes
from qtk.recipe import builtin_recipes, load_recipe

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3",
                      "int8": "I8", "uint8": "U8", "int32": "I32", "int64": "I64"}


def _convert():
    from qtk import api

    return api.convert


def read_checkpoint(d):
    """name -> (shape, dtype, data bytes) from the safetensors headers, and the header bytes in total."""
    tensors, header_bytes = {}, 0
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        header_bytes += 8 + n
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        for k, v in entries.items():
            tensors[k] = (tuple(v["shape"]), v["dtype"], v["data_offsets"][1] - v["data_offsets"][0])
        # nothing but header and tensor data in the file
        assert f.stat().st_size == 8 + n + max((v["data_offsets"][1] for v in entries.values()), default=0)
    return tensors, header_bytes


@pytest.fixture(scope="module")
def tiny_qwen2_tied(tmp_path_factory):
    """Qwen2 (q/k/v biases) with tied embeddings: the two things a Llama does not exercise."""
    from models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("q") / "tiny-qwen2", model_type="qwen2", hidden=128,
                           intermediate=256, tie=True)


@pytest.fixture(scope="module")
def aligned_llama(tmp_path_factory):
    """Linears that are multiples of 128 both ways: FP8 blocks tile it (the tiny models' 64-row k/v they do not)."""
    from models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("al") / "aligned", hidden=256, intermediate=512, heads=2, kv_heads=1)


BLOCK = sorted(r for r in builtin_recipes() if load_recipe(r).weights.strategy == "block")
# static W4A8-FP8 (TensorRT-LLM's W4A8_AWQ) has no vLLM checkpoint to compare with: vLLM refuses static W4A8
VLLM_REFUSES = {r for r in builtin_recipes() if load_recipe(r).activations is not None
                and load_recipe(r).weights.type == "int" and load_recipe(r).activations.is_fp8
                and not load_recipe(r).activations.dynamic}
CASES = [(m, r) for r in sorted(set(builtin_recipes()) - VLLM_REFUSES) for m in
         (["aligned_llama"] if r in BLOCK else ["tiny_llama", "tiny_qwen2_tied"])]


@pytest.mark.parametrize("model,recipe", CASES)
def test_planned_bytes_equal_the_written_checkpoint(model, recipe, request, calib_file, tmp_path):
    convert = _convert()
    src = request.getfixturevalue(model)
    res = convert(src, recipe, tmp_path / "out", calib=str(calib_file), num_samples=2, seq_len=16, hash_source=False)
    written, header_bytes = read_checkpoint(res.outputs["vllm"])
    s = ModelShape.from_config(read_config(src))
    r = load_recipe(recipe)
    planned = {t.name: (t.shape, SAFETENSORS_DTYPES[t.dtype], t.nbytes) for t in checkpoint_tensors(s, r)}
    assert planned == written
    total_on_disk = sum((res.outputs["vllm"] / f.name).stat().st_size for f in res.outputs["vllm"].glob("*.safetensors"))
    # the files are the planned bytes plus their headers (the metadata), nothing else
    assert total_on_disk - weight_bytes(s, r).total == header_bytes


def test_planning_never_imports_torch_or_transformers():
    """`import qtk` stays light (STYLE.md 11), and planning works from config.json alone."""
    code = ("import sys, qtk.plan.cli, qtk.plan.decide, qtk.plan.serving, qtk.plan.memory, qtk.plan.cost, "
            "qtk.plan.hardware, qtk.plan.planner\n"
            "from click.testing import CliRunner\n"
            f"r = CliRunner().invoke(qtk.plan.cli.plan, [{str(CONFIGS / 'llama-3-8b.json')!r}, '--recommend'])\n"
            "assert r.exit_code == 0, r.output\n"
            "print(sorted(m for m in ('torch', 'transformers', 'compressed_tensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
