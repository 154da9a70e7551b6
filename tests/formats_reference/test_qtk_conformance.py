"""qtk's vLLM outputs of the issue-14 recipes against what llm-compressor 0.14 wrote for the same reference model
(llmc_reference.json): the same tensor names, safetensors dtypes and shapes, and the same compressed-tensors config
fields (format, every quantization arg that decides the layout, the KV scheme).

FP8 block: the reference model's k/v projections (192 rows) are ragged for 128-row blocks, which llm-compressor writes
but vLLM refuses; qtk refuses them too, so that case ignores q/k/v (a fused group) and compares the Linears both quantize.
"""

import json

import pytest
import yaml
from reference_model import LLMC_MANIFEST, build, header

from qtk import api
from qtk.errors import UsageError
from qtk.recipe import builtin_recipes

REF = json.loads(LLMC_MANIFEST.read_text())
# llm-compressor case -> qtk recipe (and whether k/v are left out, see the module docstring)
CASES = {"nvfp4": ("nvfp4", False), "nvfp4-kv8": ("nvfp4-kv8", False), "nvfp4a16": ("nvfp4-a16", False),
         "mxfp4a16": ("mxfp4-a16", False), "mxfp8": ("mxfp8", False), "fp8-block": ("fp8-block", True), "fp8-block-kv8": ("fp8-block-kv8", True),
         "w4afp8-packed": ("w4a8-fp8", False), "w4a8-int": ("w4a8-int8", False)}
ARGS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "scale_dtype")
KV_ARGS = ("num_bits", "type", "symmetric", "strategy", "dynamic")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("ref") / "model")


def _recipe(name: str, drop_kv: bool, tmp_path):
    if not drop_kv:
        return name
    doc = yaml.safe_load(builtin_recipes()[name].read_text())
    doc["ignore"] = ["lm_head", "re:.*self_attn\\.[qkv]_proj"]  # a fused group is ignored whole
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def _args(d: dict | None, keys) -> dict | None:
    return None if d is None else {k: d.get(k) for k in keys}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_output_matches_llm_compressor(case, model, tmp_path):
    recipe, drop_kv = CASES[case]
    ref = REF["cases"][case]
    res = api.convert(model, _recipe(recipe, drop_kv, tmp_path), tmp_path / "out", num_samples=4, seq_len=32,
                      hash_source=False)
    out = res.outputs["vllm"]
    got_cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    want_cfg = ref["quantization_config"]
    assert got_cfg["format"] == want_cfg["format"]
    g, w = got_cfg["config_groups"]["group_0"], want_cfg["config_groups"]["group_0"]
    assert g["format"] == w["format"]
    assert _args(g["weights"], ARGS) == _args(w["weights"], ARGS)
    assert _args(g["input_activations"], ARGS) == _args(w["input_activations"], ARGS)
    assert _args(got_cfg["kv_cache_scheme"], KV_ARGS) == _args(want_cfg["kv_cache_scheme"], KV_ARGS)

    got = {}
    for p in sorted(out.glob("*.safetensors")):
        got.update(header(p))
    qkv = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.")
    want = {n: v for n, v in ref["tensors"].items() if not (drop_kv and any(x in n for x in qkv))}
    if drop_kv:
        got = {n: v for n, v in got.items() if not any(x in n for x in qkv)}
    assert sorted(got) == sorted(want)
    for n, (dtype, shape) in want.items():
        if n.endswith((".k_scale", ".v_scale")):  # qtk writes KV scales in F32 (every recipe, pinned by the
            dtype = "F32"                         # fingerprints), llm-compressor in the model dtype; vLLM reads both
        assert [got[n][0], list(got[n][1])] == [dtype, list(shape)], n


def test_fp8_block_refuses_ragged_blocks_as_vllm_does(model, tmp_path):
    with pytest.raises(UsageError, match=r"vLLM cannot run model\.layers\.0\.self_attn\.k_proj \[192, 384\]"):
        api.convert(model, "fp8-block", tmp_path / "out", hash_source=False)
    assert not (tmp_path / "out").exists()
