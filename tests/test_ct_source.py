"""compressed-tensors sources (quant_method compressed-tensors: pack-quantized int4, int-quantized int8,
float-quantized FP8, nvfp4-pack-quantized, mxfp4-pack-quantized, as qtk's vllm target writes them) are read as the BF16
model they stand for, one Linear at a time as the layers stream: each decoded weight equals what compressed-tensors'
own decompression (inside transformers) gives, and converting the source to another recipe writes exactly what
converting that decompressed BF16 model writes. The refusals are in tests/test_bad_inputs.py; the peak memory in
benchmarks/convert_fp8_source.py (--source ct)."""

from __future__ import annotations

import json

import pytest
import torch

from ct_sources import decompressed_reference, make_ct_source
from fp8_sources import read_tensors
from models import make_tiny_model
from qtk import api
from qtk.errors import UsageError
from qtk.model.source import ModelSource

NS, T = 8, 32
# each source recipe -> its compressed-tensors format and the recipe it is converted to below
SOURCES = {"w4a16": ("pack-quantized", "fp8-dynamic"), "w8a8-sq": ("int-quantized", "w4a16-gptq"),
           "fp8-dynamic": ("float-quantized", "nvfp4"), "nvfp4": ("nvfp4-pack-quantized", "w8a16"),
           "mxfp4-a16": ("mxfp4-pack-quantized", "w4a16")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, calib_file):
    """recipe -> (qtk's compressed-tensors output of a tiny Llama, its BF16 model as compressed-tensors decompresses it)."""
    root = tmp_path_factory.mktemp("ctsrc")
    orig = make_tiny_model(root / "orig", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2)
    out = {}
    for recipe in SOURCES:
        ct = make_ct_source(orig, root / recipe, recipe, calib=calib_file)
        out[recipe] = (ct, decompressed_reference(ct, root / f"{recipe}-deq"))
    return out


@pytest.mark.parametrize("recipe", list(SOURCES))
def test_source_reads_weights_as_compressed_tensors_decompresses_them(sources, recipe):
    """ModelSource hides the stored codes and scales and hands back each quantized Linear in the model dtype, bit for
    bit what compressed-tensors' decompression gives; every other tensor as stored."""
    ct, ref = sources[recipe]
    assert json.loads((ct / "config.json").read_text())["quantization_config"]["format"] == SOURCES[recipe][0]
    src = ModelSource(ct)
    want = read_tensors(ref)
    assert set(src.weight_map) == set(want)
    assert not any(n.endswith(("_scale", "_packed", "_shape", "_zero_point", "global_scale")) for n in src.weight_map)
    assert len(src.derived) == 14 and src.config_dict == json.loads((ref / "config.json").read_text())
    for n, t in want.items():
        got = src.tensor(n)
        assert got.dtype == t.dtype == torch.bfloat16 and torch.equal(got, t), n
    # the decode is not the identity on a 16-bit weight: the source's weights are on its grid, not the original's
    orig = read_tensors(ct.parent.parent / "orig")["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(src.tensor("model.layers.0.mlp.down_proj.weight"), orig)


@pytest.mark.parametrize("recipe", list(SOURCES))
def test_converts_as_its_decompressed_model(sources, calib_file, tmp_path, recipe):
    """Converting the source to another recipe writes the same bytes as converting its decompressed BF16 model."""
    ct, ref = sources[recipe]
    to = SOURCES[recipe][1]
    got = api.convert(ct, to, tmp_path / "ct", calib=str(calib_file), num_samples=NS, seq_len=T,
                      hash_source=False).outputs["vllm"]
    want = api.convert(ref, to, tmp_path / "ref", calib=str(calib_file), num_samples=NS, seq_len=T,
                       hash_source=False).outputs["vllm"]
    shards = sorted(p.name for p in got.glob("*.safetensors"))
    assert shards == sorted(p.name for p in want.glob("*.safetensors"))
    for s in shards:
        assert (got / s).read_bytes() == (want / s).read_bytes(), s
    assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    m = json.loads((got / "qtk.json").read_text())
    q = m["source"]["quantization"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == SOURCES[recipe][0] and q["quantized_weights"] == 14
    assert m["stats"]["weight_error"] == json.loads((want / "qtk.json").read_text())["stats"]["weight_error"]
    assert api.inspect(got).ok


def test_same_format_refused_before_any_work(sources, tmp_path):
    """A source converted to its own weight format is refused by name (it would only be rounded again); another
    format of the same family of numbers is not (int4 groups -> int8 channels)."""
    ct, _ = sources["w4a16"]
    with pytest.raises(UsageError) as e:
        api.convert(ct, "w4a16", tmp_path / "o", hash_source=False)
    assert "already int4 group128" in e.value.problem and "compressed-tensors" in e.value.problem
    assert not (tmp_path / "o" / "vllm").exists()
    ct8, _ = sources["w8a8-sq"]
    with pytest.raises(UsageError, match="already int8 channel"):
        api.convert(ct8, "w8a16", tmp_path / "o2", hash_source=False)


def test_mixed_precision_source(tmp_path):
    """A mixed-precision source (an int8-channel group naming down_proj beside the int4 "Linear" group, one layer's
    attention ignored) decodes each module by its own group, as compressed-tensors resolves them: equal to
    compressed-tensors' own unpacking and dequantize with that group's QuantizationArgs, module by module.
    (transformers' dequantize=True load decompresses the int8 group of this checkpoint as int4 with
    compressed-tensors 0.20.1, so the whole-model reference of the tests above is not used here.)"""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    orig = make_tiny_model(tmp_path / "orig", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2)
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("name: mixed\nweights: {num_bits: 4, strategy: group, group_size: 64}\n"
                      "overrides:\n  - targets: ['mlp.down_proj']\n    weights: {num_bits: 8, strategy: channel}\n"
                      "ignore: [lm_head, 're:.*layers\\.1\\.self_attn\\..*']\n")
    ct = make_ct_source(orig, tmp_path / "ct", str(recipe))
    groups = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) == 2
    stored = read_tensors(ct)
    src = ModelSource(ct)
    assert len(src.derived) == 14 - 4  # layer 1's attention stored in 16 bits, as ignored
    for n in src.derived:
        m = n[: -len(".weight")]
        g = groups["group_1"] if m.endswith("down_proj") else groups["group_0"]
        args = QuantizationArgs(**{k: v for k, v in g["weights"].items() if v is not None})
        q = unpack_from_int32(stored[f"{m}.weight_packed"], args.num_bits, torch.Size(stored[f"{m}.weight_shape"].tolist()))
        want = dequantize(q, stored[f"{m}.weight_scale"], None, args=args, dtype=torch.bfloat16)
        assert torch.equal(src.tensor(n), want), n
    assert torch.equal(src.tensor("model.layers.1.self_attn.q_proj.weight"),
                       read_tensors(orig)["model.layers.1.self_attn.q_proj.weight"])
    kinds = {m: s.weights.describe() for m, s in src.quant.modules.items()}
    assert kinds["model.layers.0.mlp.down_proj"] == "int8 channel sym"
    assert kinds["model.layers.0.mlp.up_proj"] == "int4 group64 sym"


def test_act_order_g_idx_source(tmp_path):
    """An older compressed-tensors checkpoint with activation ordering (actorder "group": a weight_g_idx naming each
    input column's group, which compressed-tensors 0.20 itself no longer loads) decodes each column with its group's
    scale and zero point: equal to compressed-tensors' own unpacking of the codes and zero points, dequantized here
    column by column from the format's definition ((q - z[g]) * s[g] in the scales' dtype)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file, save_file

    orig = make_tiny_model(tmp_path / "orig", layers=1, hidden=256, intermediate=256, heads=4, kv_heads=2)
    recipe = tmp_path / "asym.yaml"
    recipe.write_text("name: asym\nweights: {num_bits: 4, strategy: group, group_size: 128, symmetric: false}\n"
                      "ignore: [lm_head]\n")
    ct = make_ct_source(orig, tmp_path / "ct", str(recipe))
    sd = load_file(str(ct / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for k in [k for k in sd if k.endswith(".weight_shape")]:
        sd[k.replace("_shape", "_g_idx")] = (torch.randperm(int(sd[k][1]), generator=g) // 128).to(torch.int32)
    save_file(sd, str(ct / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ct / "config.json").read_text())
    (weights,) = [grp["weights"] for grp in cfg["quantization_config"]["config_groups"].values()]
    weights["actorder"] = "group"
    (ct / "config.json").write_text(json.dumps(cfg))
    src = ModelSource(ct)
    assert len(src.derived) == 7 and not weights["symmetric"]
    for n in src.derived:
        m = n[: -len(".weight")]
        out_f, in_f = sd[f"{m}.weight_shape"].tolist()
        q = unpack_from_int32(sd[f"{m}.weight_packed"], 4, torch.Size([out_f, in_f])).to(torch.bfloat16)
        s = sd[f"{m}.weight_scale"]
        z = unpack_from_int32(sd[f"{m}.weight_zero_point"], 4, torch.Size([out_f, s.shape[1]]), packed_dim=0)
        gi = sd[f"{m}.weight_g_idx"].long()
        want = (q - z[:, gi].to(torch.bfloat16)) * s[:, gi]
        assert torch.equal(src.tensor(n), want), n


def test_llm_compressor_source(tmp_path):
    """A source written by llm-compressor itself (oneshot W4A16, data-free), read as compressed-tensors decompresses
    it."""
    pytest.importorskip("llmcompressor", reason="llm-compressor is not installed in this environment (neither .venv "
                                                "nor .venv-vllm has it); qtk's own compressed-tensors outputs are tested "
                                                "above")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    orig = make_tiny_model(tmp_path / "orig", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(str(orig), dtype=torch.bfloat16)
    out = tmp_path / "llmc"
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
            output_dir=str(out))
    for p in orig.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens")) and not (out / p.name).exists():
            (out / p.name).write_bytes(p.read_bytes())
    ref = decompressed_reference(out, tmp_path / "deq")
    src = ModelSource(out)
    want = read_tensors(ref)
    assert len(src.derived) == 14
    for n in want:
        assert torch.equal(src.tensor(n), want[n]), n
