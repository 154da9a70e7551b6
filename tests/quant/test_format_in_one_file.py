"""A number format is one object, end to end: MXINT8, which qtk does not ship, lives in one file
(tests/quant/mxint8_format.py) and a recipe. Registered, it parses, converts (the data-free stream, the vllm writer),
reads back from disk through the vllm reader, passes `qtk inspect`'s checks against the source, and plans (the
planner's tensors and bytes are the ones written), with no file of qtk touched."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mxint8_format
from qtk import api
from qtk.errors import UsageError
from qtk.quant.formats import format_for, register_format, unregister_format
from qtk.quant.qtensor import QTensor
from qtk.recipe import load_recipe

HERE = Path(__file__).resolve().parent
QTK = HERE.parents[1] / "qtk"
DTYPES = {"I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64", "BF16": "bfloat16", "F16": "float16",
          "F32": "float32", "F8_E4M3": "float8_e4m3fn"}
RECIPE = """name: mxint8
description: int8 weights under power-of-two scales per block of 32 (OCP MXINT8)
weights: {num_bits: 8, type: int, strategy: group, group_size: 32, scale_dtype: e8m0}
"""


@pytest.fixture
def mxint8(tmp_path):
    register_format(mxint8_format.MXINT8Format)
    recipe = tmp_path / "mxint8.yaml"
    recipe.write_text(RECIPE)
    yield recipe
    unregister_format("mxint8")


def test_the_format_is_one_file_that_imports_only_what_formats_import():
    """Its module imports the quant and io layers (and errors) only, and no qtk module names it."""
    tree = ast.parse((HERE / "mxint8_format.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("qtk")}
    assert imported and all(m.startswith(("qtk.quant", "qtk.io", "qtk.errors")) for m in imported), imported
    assert not [p for p in QTK.rglob("*.py") if "mxint8" in p.read_text().lower()]


def test_a_format_in_one_file_converts_reads_back_inspects_and_plans(mxint8, tiny_llama, tmp_path):
    recipe = load_recipe(str(mxint8))
    assert format_for(recipe.weights).name == "mxint8"

    res = api.convert(tiny_llama, str(mxint8), tmp_path / "out", hash_source=False)  # the self-check ran on it
    out = res.outputs["vllm"]
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["format"] == "mxint8-quantized" and group["weights"]["scale_dtype"] == "torch.uint8"

    # read back: the codes and scales on disk are the format's own quantization of the source weights
    from qtk.export import open_checkpoint
    from qtk.model.source import ModelSource

    ck, src = open_checkpoint(out), ModelSource(tiny_llama)
    module = "model.layers.1.mlp.down_proj"
    qt = ck.qtensor(module)
    want = QTensor.quantize(src.tensor(f"{module}.weight").float(), recipe.weights, src.dtype)
    assert qt.values.dtype == torch.int8 and torch.equal(qt.values, want.values) and torch.equal(qt.scale, want.scale)
    assert torch.equal(qt.scale, torch.exp2(torch.log2(qt.scale).round()))  # powers of two

    rep = api.inspect(out, source=tiny_llama)
    assert rep.ok, [c for c in rep.checks if not c.ok]
    compared = next(c for c in rep.checks if c.name == "written weights match the source")
    assert not compared.skipped and 0 < max(rep.errors.values()) < mxint8_format.MXINT8Format().error_bound(None)

    # the plan counts exactly the tensors written, and their bytes
    from qtk.plan.memory import ModelShape, checkpoint_tensors, read_config, weight_bytes

    shape = ModelShape.from_config(read_config(tiny_llama))
    planned = {t.name: (t.shape, t.dtype) for t in checkpoint_tensors(shape, recipe)}
    written = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                t = h.get_slice(n)
                written[n] = (tuple(t.get_shape()), DTYPES[t.get_dtype()])
    assert planned == written
    p = api.plan(tiny_llama, str(mxint8))
    assert p.weights.total == weight_bytes(shape, recipe).total
    assert p.weights.quantized == sum(h.numel() * h.element_size() for h in
                                      (ck.tensor(f"{m}.weight") for m in ck.modules()))


def test_its_refusals_come_from_the_format(mxint8, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(RECIPE.replace("group_size: 32", "group_size: 64"))
    with pytest.raises(UsageError, match="MXINT8 is symmetric int8 in groups of 32"):
        load_recipe(str(bad))
