"""Tensor/pipeline parallelism: the rank files of tp = 2, 4 (and pp = 2) reassemble exactly to the tp = 1 tensors,
including GQA models with fewer KV heads than ranks. One calibration pass feeds every writer, so all
outputs come from the same QTensors; the reassembly below is written from the spec, not from qtk's reader."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from trtllm_helpers import NS, T

from models import make_tiny_model
from qtk.calib import calibration_ids, load_texts
from qtk.export import ExportOptions, open_checkpoint
from qtk.export.trtllm import TRTLLMWriter
from qtk.model.source import ModelSource
from qtk.pipeline import run
from qtk.recipe import load_recipe, parse_recipe

COLUMN, ROW = ("attention.qkv", "mlp.fc", "mlp.gate"), ("attention.dense", "mlp.proj")
W4G64 = {"name": "w4a16-g64", "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}
LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2)]


def write_all(model_dir, recipe, calib_file, root, layouts=LAYOUTS):
    """One pipeline pass into a TensorRT-LLM writer per (tp, pp)."""
    source = ModelSource(model_dir)
    ids = calibration_ids(source.tokenizer(), load_texts(str(calib_file)), NS, T, 0)
    dirs, writers = {}, []
    for tp, pp in layouts:
        d = dirs[tp, pp] = root / f"tp{tp}pp{pp}"
        d.mkdir(parents=True)
        writers.append(TRTLLMWriter(d, source, recipe, ExportOptions(tp=tp, pp=pp)))
    run(source, recipe, ids, writers)
    for w in writers:
        w.finish({})
    return dirs


def axis_of(module: str, key: str, t: torch.Tensor):
    """Split axis of a stored tensor under tensor parallelism (None: replicated), per docs/formats.md (trtllm)."""
    if module in COLUMN:
        return {"weight": 0, "bias": 0, "prequant_scaling_factor": None, "activation_scaling_factor": None,
                "weights_scaling_factor": None if t.numel() == 1 else 0, "per_channel_scale": t.dim() - 1}[key]
    return {"weight": 1, "bias": None, "activation_scaling_factor": None, "per_channel_scale": None, "smoother": 1,
            "prequant_scaling_factor": 0, "weights_scaling_factor": 1 if t.dim() == 2 else None}[key]


def reassemble(d):
    """{tp=1, pp=1 name: tensor} from the rank files of a tp x pp checkpoint."""
    cfg = json.loads((d / "config.json").read_text())
    tp, pp = cfg["mapping"]["tp_size"], cfg["mapping"]["pp_size"]
    assert cfg["mapping"]["world_size"] == tp * pp
    L, heads, kv, vocab = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    h_r, kv_r, reps = heads // tp, max(kv // tp, 1), max(tp // kv, 1)
    out = {}
    for stage in range(pp):
        files = [load_file(str(d / f"rank{stage * tp + r}.safetensors")) for r in range(tp)]
        assert all(set(f) == set(files[0]) for f in files), "ranks of a stage hold different tensors"
        for name in files[0]:
            pieces = [f[name] for f in files]
            glob = re.sub(r"^transformer\.layers\.(\d+)\.", lambda m: f"transformer.layers.{int(m[1]) + stage * L // pp}.", name)
            m = re.fullmatch(r"transformer\.layers\.\d+\.(attention\.qkv|attention\.dense|mlp\.fc|mlp\.gate|mlp\.proj)\.(\w+)", name)
            assert all(p.shape == pieces[0].shape for p in pieces), f"{name}: ranks differ in shape"
            if name in ("transformer.vocab_embedding.weight", "lm_head.weight"):
                assert pieces[0].shape[0] == -(-vocab // tp)  # TensorRT-LLM's per-rank vocab: ceil(vocab / tp)
                t = torch.cat(pieces, 0)
                assert t.shape[0] >= vocab and not t[vocab:].any()  # zero padding up to a multiple of tp
                out[glob] = t[:vocab]
                continue
            axis = axis_of(m[1], m[2], pieces[0]) if m else None
            if axis is None:
                assert all(torch.equal(p.view(torch.uint8), pieces[0].view(torch.uint8)) for p in pieces), name
                out[glob] = pieces[0]
            elif m[1] != "attention.qkv":
                out[glob] = torch.cat(pieces, axis)
            else:  # each rank: [q heads_r, k kv_r, v kv_r] along the axis; kv copies on `reps` consecutive ranks
                unit = pieces[0].shape[axis] // (h_r + 2 * kv_r)
                qkv = [p.split([h_r * unit, kv_r * unit, kv_r * unit], axis) for p in pieces]
                for r in range(tp):
                    for c in (1, 2):
                        assert torch.equal(qkv[r][c].view(torch.uint8), qkv[r - r % reps][c].view(torch.uint8)), "KV copies differ"
                q = torch.cat([x[0] for x in qkv], axis)
                k = torch.cat([x[1] for x in qkv[::reps]], axis)
                v = torch.cat([x[2] for x in qkv[::reps]], axis)
                out[glob] = torch.cat([q, k, v], axis)
    return out


def assert_reassembles(dirs):
    ref = load_file(str(dirs[1, 1] / "rank0.safetensors"))
    for (tp, pp), d in dirs.items():
        got = reassemble(d)
        assert set(got) == set(ref), f"tp{tp} pp{pp}: {sorted(set(got) ^ set(ref))[:6]}"
        for name, t in ref.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, (tp, pp, name)
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (tp, pp, name)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """4 query heads, 2 KV heads: tp 4 copies each KV head to two ranks."""
    return make_tiny_model(tmp_path_factory.mktemp("tp") / "gqa", hidden=128, intermediate=256, heads=4, kv_heads=2)


@pytest.mark.parametrize("name", ["fp8-kv8", "int8-kv8", "w8a16", "fp8-dynamic"])
def test_rank_files_reassemble_to_tp1(name, gqa_model, calib_file, tmp_path):
    dirs = write_all(gqa_model, load_recipe(name), calib_file, tmp_path)
    assert_reassembles(dirs)
    cfg = json.loads((dirs[4, 1] / "config.json").read_text())
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1} and cfg["num_key_value_heads"] == 2
    r0 = load_file(str(dirs[4, 1] / "rank0.safetensors"))
    qkv = r0["transformer.layers.0.attention.qkv.weight"]
    assert qkv.shape[0] == (4 // 4 + 2 * 1) * 32  # 1 query head + 1 KV head (a copy) + 1 V head per rank
    # pipeline stages: embedding on the first, ln_f and lm_head on the last, layers numbered per stage
    first, last = load_file(str(dirs[2, 2] / "rank0.safetensors")), load_file(str(dirs[2, 2] / "rank3.safetensors"))
    assert "transformer.vocab_embedding.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "transformer.ln_f.weight" in last and "transformer.vocab_embedding.weight" not in last
    assert {k.split(".")[2] for k in last if k.startswith("transformer.layers.")} == {"0"}


def test_int4_awq_single_kv_head_over_four_ranks(calib_file, tmp_path):
    """Packed int4 pairs, group scales split on the input for row-parallel layers, one KV head copied 4 times."""
    m = make_tiny_model(tmp_path / "m", hidden=256, intermediate=512, heads=4, kv_heads=1)
    dirs = write_all(m, parse_recipe(W4G64, origin="w4a16-g64"), calib_file, tmp_path / "out", [(1, 1), (2, 1), (4, 1)])
    assert_reassembles(dirs)
    r1 = load_file(str(dirs[4, 1] / "rank1.safetensors"))
    assert r1["transformer.layers.0.mlp.proj.weights_scaling_factor"].shape == (256, 512 // 4 // 64)
    assert r1["transformer.layers.0.attention.qkv.weight"].shape == ((64 + 2 * 64) // 2, 256)


@pytest.mark.parametrize("model_type,extra", [("qwen2", {}), ("qwen3", {"head_dim": 32})])
def test_qwen_biases_and_qk_norms_shard(model_type, extra, calib_file, tmp_path):
    m = make_tiny_model(tmp_path / "m", model_type=model_type, hidden=128, intermediate=256, heads=4, kv_heads=2, **extra)
    dirs = write_all(m, load_recipe("int8-kv8"), calib_file, tmp_path / "out", [(1, 1), (2, 1), (4, 1)])
    assert_reassembles(dirs)
    cfg = json.loads((dirs[2, 1] / "config.json").read_text())
    assert cfg["architecture"] == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    assert cfg["qwen_type"] == model_type and cfg["attn_bias"] == (model_type == "qwen2")
    names = set(load_file(str(dirs[2, 1] / "rank1.safetensors")))
    assert ("transformer.layers.0.attention.qkv.bias" in names) == (model_type == "qwen2")
    assert ("transformer.layers.0.attention.q_layernorm.weight" in names) == (model_type == "qwen3")


def test_reader_merges_ranks_to_the_same_checkpoint(gqa_model, calib_file, tmp_path):
    dirs = write_all(gqa_model, load_recipe("int8-kv8"), calib_file, tmp_path)
    one = open_checkpoint(dirs[1, 1])
    for key in ((4, 1), (2, 2)):
        other = open_checkpoint(dirs[key])
        assert other.format == "trtllm" and other.modules() == one.modules()
        for m in one.modules():
            a, b = one.qtensor(m), other.qtensor(m)
            assert torch.equal(a.values, b.values) and torch.equal(a.scale, b.scale)
        da, db = one.dense_state_dict(), other.dense_state_dict()
        assert set(da) == set(db) and all(torch.equal(da[k], db[k]) for k in da)
        assert [one.kv_scales(i) for i in range(2)] == [other.kv_scales(i) for i in range(2)]
        assert other.hf_config == one.hf_config
