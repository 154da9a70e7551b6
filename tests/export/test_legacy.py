"""Legacy GPTQ and AWQ GEMM targets (FORMATS.md §4–5): written in the same convert call as the vLLM checkpoint,
then decoded by a dequantizer written here from the format description alone (bit shifts, v1's −1, AWQ's
interleave, g_idx) and compared with the vLLM checkpoint read through qtk's reader; qtk's own readers round
trip; transformers parses the configs; refusals are one line; a zero point v1 cannot hold switches the
checkpoint to gptq_v2. A real client (GPTQModel, through transformers) is used where it is installed."""

import json

import pytest
import torch
from click.testing import CliRunner

from qtk import api
from qtk.cli import main
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from qtk.quant.qtensor import QTensor

ASYM_G64 = """\
name: w4-asym-g64
description: int4 asymmetric, group size 64, round-to-nearest; layer 1's down_proj left in 16 bits
weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 64}
algorithm: [rtn]
ignore: [lm_head, 're:model\\.layers\\.1\\.mlp\\.down_proj']
"""
AWQ_ORDER_SPEC = [0, 2, 4, 6, 1, 3, 5, 7]  # FORMATS.md §5: slot k of a word holds output column ORDER[k] of its 8


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def converted(tiny_llama, tmp_path_factory):
    """One `qtk convert --target vllm --target gptq --target awq` per recipe (w8a16: vllm + gptq)."""
    root = tmp_path_factory.mktemp("legacy")
    asym = root / "w4-asym-g64.yaml"
    asym.write_text(ASYM_G64)
    out = {}
    for label, recipe, targets in [("w4a16", "w4a16", ("vllm", "gptq", "awq")),
                                   ("asym", asym, ("vllm", "gptq", "awq")),
                                   ("w8a16", "w8a16", ("vllm", "gptq"))]:
        args = ["convert", tiny_llama, "--recipe", recipe, "-o", root / label, "--no-hash"]
        for t in targets:
            args += ["--target", t]
        code, output = cli(*args)
        assert code == 0, output
        out[label] = {t: root / label / t for t in targets}
        out[label]["output"] = output
    return out


# ---- an independent decoder, from the format description ----

def nibbles(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., n] -> unsigned values [..., n * 32/bits]: value k of a word at bits·k, LSB first."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    vals = [(w >> (bits * k)) & ((1 << bits) - 1) for k in range(32 // bits)]
    return torch.stack(vals, dim=-1).reshape(*w.shape[:-1], -1)


def gptq_dequant(d, module: str, bits: int, v1: bool) -> torch.Tensor:
    """W [out, in] = (q_u − z_u) · s, with q_u packed along the input dim, z stored z − 1 in v1, groups by g_idx."""
    from safetensors.torch import load_file

    t = {}
    for f in d.glob("*.safetensors"):
        t.update(load_file(str(f)))
    qweight, qzeros, scales, g_idx = (t[f"{module}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx"))
    assert qweight.dtype == qzeros.dtype == g_idx.dtype == torch.int32 and scales.dtype == torch.float16
    q_u = nibbles(qweight.t(), bits)  # [out, in]
    z_u = nibbles(qzeros, bits) + (1 if v1 else 0)  # [groups, out]
    g = g_idx.long()  # [in]
    assert q_u.shape[1] == g.numel() and z_u.shape == scales.shape
    return ((q_u - z_u[g].t()).float() * scales.float()[g].t())


def awq_dequant(d, module: str, group_size: int) -> torch.Tensor:
    """W [out, in] = (q_u − z_u) · s, both packed along the output dim in AWQ's order, zeros raw."""
    from safetensors.torch import load_file

    t = {}
    for f in d.glob("*.safetensors"):
        t.update(load_file(str(f)))
    qweight, qzeros, scales = (t[f"{module}.{k}"] for k in ("qweight", "qzeros", "scales"))
    assert qweight.dtype == qzeros.dtype == torch.int32 and scales.dtype == torch.float16

    def unshuffle(words):  # [rows, out/8] -> [rows, out]
        slots = nibbles(words, 4).reshape(words.shape[0], -1, 8)
        cols = torch.empty_like(slots)
        for k, c in enumerate(AWQ_ORDER_SPEC):
            cols[:, :, c] = slots[:, :, k]
        return cols.reshape(words.shape[0], -1)

    q_u, z_u = unshuffle(qweight), unshuffle(qzeros)  # [in, out], [in/group, out]
    g = torch.arange(q_u.shape[0]) // group_size
    return ((q_u - z_u[g]).float() * scales.float()[g]).t()


def vllm_reference(v, module: str) -> torch.Tensor:
    """The vLLM checkpoint's weight through qtk's reader, with its scales rounded to fp16 as the legacy formats store them."""
    qt = v.qtensor(module)
    return QTensor(qt.values, qt.scale.half().float(), qt.scheme, qt.zero_point).dequantize()


def u32(x: torch.Tensor) -> set[int]:
    return set((x.to(torch.int64) & 0xFFFFFFFF).reshape(-1).tolist())


# ---- tests ----

@pytest.mark.parametrize("label,bits,group", [("w4a16", 4, 128), ("asym", 4, 64), ("w8a16", 8, None)])
def test_gptq_decodes_to_the_vllm_weights(converted, label, bits, group):
    d, v = converted[label]["gptq"], open_checkpoint(converted[label]["vllm"])
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == bits and qc["checkpoint_format"] == "gptq"
    assert qc["group_size"] == (group or -1) and qc["desc_act"] is False
    assert qc["sym"] is (label != "asym")
    assert json.loads((d / "quantize_config.json").read_text()) == qc
    mods = v.modules()
    assert len(mods) == (13 if label == "asym" else 14)
    for m in mods:
        ref = vllm_reference(v, m)
        got = gptq_dequant(d, m, bits, v1=True)
        assert torch.equal(got, ref), m
        # bf16 scales are fp16-exact at these magnitudes: the legacy weight is the vLLM weight itself
        assert torch.equal(got, v.qtensor(m).dequantize()), m


@pytest.mark.parametrize("label,group", [("w4a16", 128), ("asym", 64)])
def test_awq_decodes_to_the_vllm_weights(converted, label, group):
    d, v = converted[label]["awq"], open_checkpoint(converted[label]["vllm"])
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": ["lm_head"] + (["model.layers.1.mlp.down_proj"] if label == "asym" else [])}
    for m in v.modules():
        assert torch.equal(awq_dequant(d, m, group), vllm_reference(v, m)), m


def test_symmetric_zero_point_words(converted):
    """Symmetric int4 in GPTQ v1 stores 8 − 1 in every nibble; int8 stores 127; AWQ stores a raw 8."""
    from safetensors.torch import load_file

    for label, target, suffix, word in [("w4a16", "gptq", "qzeros", 0x77777777), ("w8a16", "gptq", "qzeros", 0x7F7F7F7F),
                                        ("w4a16", "awq", "qzeros", 0x88888888)]:
        t = load_file(str(converted[label][target] / "model.safetensors"))
        zs = [x for n, x in t.items() if n.endswith("." + suffix)]
        assert len(zs) == 14
        assert set().union(*(u32(z) for z in zs)) == {word}, (label, target)
    # the asymmetric checkpoint's zero points are real: many distinct words
    t = load_file(str(converted["asym"]["gptq"] / "model.safetensors"))
    assert len(set().union(*(u32(x) for n, x in t.items() if n.endswith(".qzeros")))) > 50


def test_gptq_g_idx_and_shapes(converted):
    from safetensors.torch import load_file

    t = load_file(str(converted["asym"]["gptq"] / "model.safetensors"))
    assert t["model.layers.0.mlp.down_proj.qweight"].shape == (256 * 4 // 32, 128)  # [in*bits/32, out]
    assert t["model.layers.0.mlp.down_proj.qzeros"].shape == (256 // 64, 128 * 4 // 32)  # [groups, out*bits/32]
    assert t["model.layers.0.mlp.down_proj.scales"].shape == (256 // 64, 128)
    assert torch.equal(t["model.layers.0.mlp.down_proj.g_idx"], torch.arange(256, dtype=torch.int32) // 64)
    assert "model.layers.1.mlp.down_proj.weight" in t and "model.layers.1.mlp.down_proj.qweight" not in t
    t8 = load_file(str(converted["w8a16"]["gptq"] / "model.safetensors"))
    assert t8["model.layers.0.self_attn.k_proj.scales"].shape == (1, 64)  # per channel: one group
    assert torch.equal(t8["model.layers.0.self_attn.k_proj.g_idx"], torch.zeros(128, dtype=torch.int32))


@pytest.mark.parametrize("label", ["w4a16", "asym", "w8a16"])
def test_readers_round_trip(converted, label):
    v = open_checkpoint(converted[label]["vllm"])
    for target in ("gptq", "awq"):
        if target not in converted[label]:
            continue
        ck = open_checkpoint(converted[label][target])
        assert ck.format == target and ck.modules() == v.modules()
        assert "quantization_config" not in ck.hf_config and ck.hf_config["model_type"] == "llama"
        for m in v.modules():
            a, b = v.qtensor(m), ck.qtensor(m)
            assert torch.equal(a.values, b.values) and b.values.dtype == torch.int8, m
            assert torch.equal(b.scale, a.scale.half().float()) and b.scale.shape == a.scale.shape, m
            assert b.g_idx is None
            if a.zero_point is None and target == "awq":  # AWQ always carries zero points: 0 in qtk's convention
                assert b.zero_point is not None and not b.zero_point.any()
            elif a.zero_point is None:
                assert b.zero_point is None
            else:
                assert torch.equal(b.zero_point, a.zero_point.float()), m
        dense = ck.dense_state_dict()
        assert set(dense) == set(v.dense_state_dict())
        assert all(torch.equal(dense[k], t) for k, t in v.dense_state_dict().items())
        rep = api.inspect(converted[label][target])
        assert rep.ok, rep.checks
        assert rep.summary["quantized_modules"] == len(v.modules())


def test_eval_reads_the_legacy_checkpoints(converted):
    """The model qtk eval builds from each checkpoint: GPTQ and AWQ describe the same weights, so the same
    logits; close to the vLLM checkpoint's (which dequantizes in bf16, the legacy kernels in fp16)."""
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    for label in ("w4a16", "asym"):
        with torch.no_grad():
            lg = {t: build_simulated_model(open_checkpoint(converted[label][t])).eval()(ids).logits for t in ("vllm", "gptq", "awq")}
        assert torch.equal(lg["gptq"], lg["awq"]), label
        assert (lg["gptq"] - lg["vllm"]).abs().max() < 0.05, label


def test_notes_and_manifest(converted):
    out = converted["w4a16"]["output"]
    assert "wrote gptq:" in out and "wrote awq:" in out
    notes = json.loads((converted["w4a16"]["awq"] / "qtk.json").read_text())["notes"]
    assert any("all 2304 bfloat16 scales converted exactly" in n for n in notes), notes  # 1152 per layer
    assert any("zero point 8" in n for n in notes), notes
    assert json.loads((converted["w4a16"]["gptq"] / "qtk.json").read_text())["target"] == "gptq"


def test_transformers_reads_the_configs(converted):
    from transformers import AutoConfig, AwqConfig, GPTQConfig

    g = GPTQConfig.from_dict(AutoConfig.from_pretrained(str(converted["w4a16"]["gptq"])).quantization_config)
    assert (g.bits, g.group_size, g.sym, g.desc_act, g.format) == (4, 128, True, False, "gptq")
    a = AwqConfig.from_dict(AutoConfig.from_pretrained(str(converted["asym"]["awq"])).quantization_config)
    assert (a.bits, a.group_size, a.zero_point, a.format) == (4, 64, True, "gemm")
    assert a.modules_to_not_convert == ["lm_head", "model.layers.1.mlp.down_proj"]


def test_ignored_modules_declared(converted):
    """The asym recipe left layer 1's down_proj dense: GPTQModel/vLLM `dynamic` excludes exactly it."""
    import re

    qc = json.loads((converted["asym"]["gptq"] / "config.json").read_text())["quantization_config"]
    rules = [p[2:] for p in qc["dynamic"]]
    assert [p for p in qc["dynamic"]][0].startswith("-:") and len(rules) == 1
    names = [f"model.layers.{i}.{m}" for i in range(12) for m in ("mlp.down_proj", "mlp.up_proj")]
    assert [n for n in names if re.match(rules[0], n)] == ["model.layers.1.mlp.down_proj"]
    # optimum (transformers) keeps only the modules whose names end with one of these
    kept = qc["modules_in_block_to_quantize"][0]
    assert len(kept) == 13 and "model.layers.1.mlp.down_proj" not in kept and "model.layers.0.mlp.down_proj" in kept
    from qtk.pipeline import matches

    for target in ("gptq", "awq"):
        ck = open_checkpoint(converted["asym"][target])
        assert [n for n in names + ["lm_head"] if matches(n, ck.ignore_patterns())] == ["model.layers.1.mlp.down_proj", "lm_head"]


# ---- refusals: one line, exit 2, before any work ----

@pytest.mark.parametrize("recipe,target,needle", [
    ("fp8", "gptq", "use --target vllm"),
    ("fp8", "awq", "use --target vllm"),
    ("int8-kv8", "gptq", "cannot store quantized activations"),
    ("w8a16", "awq", "int4 group-wise only"),
])
def test_refusals(tiny_llama, tmp_path, recipe, target, needle):
    out = tmp_path / "out"
    code, output = cli("convert", tiny_llama, "--recipe", recipe, "-o", out, "--target", "vllm", "--target", target)
    lines = [x for x in output.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), output
    assert needle in lines[0] and "—" in lines[0], lines[0]
    assert not out.exists()


def test_refusals_bits_and_act_order(tiny_llama, tmp_path):
    int2 = tmp_path / "int2.yaml"
    int2.write_text("name: int2\nweights: {num_bits: 2, type: int, strategy: group, group_size: 64}\n")
    code, output = cli("convert", tiny_llama, "--recipe", int2, "-o", tmp_path / "o1", "--target", "gptq")
    assert code == 2 and "not int2" in output and len(output.strip().splitlines()) == 1, output
    act = tmp_path / "act.yaml"
    act.write_text("name: act\nweights: {num_bits: 4, type: int, strategy: group, group_size: 64}\n"
                   "algorithm: [{gptq: {actorder: group}}]\n")
    code, output = cli("convert", tiny_llama, "--recipe", act, "-o", tmp_path / "o2", "--target", "awq")
    assert code == 2 and "g_idx" in output and "actorder: static" in output and len(output.strip().splitlines()) == 1, output


# ---- writer-level: act-order g_idx, and the switch to gptq_v2 ----

def _layer_results(source, scheme, seed=0):
    """LayerResults for every layer with random weights of the model's shapes (the writer only sees records)."""
    from qtk.pipeline import LayerResult

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(source.num_layers):
        prefix = source.layer_prefix(i)
        qw = {}
        for lin in source.arch.linears:
            shape = tuple(source.tensor(f"{prefix}{lin}.weight").shape)
            qw[prefix + lin] = QTensor.quantize(torch.randn(shape, generator=g) * 0.05, scheme, torch.bfloat16)
        out.append(LayerResult(index=i, qweights=qw, dense={}))
    return out


def test_act_order_and_v2_switch(tiny_llama, tmp_path):
    """Layer 0 carries an act-order q_proj (non-monotone g_idx); layer 1's down_proj has an all-positive group,
    whose zero point (unsigned 0) GPTQ v1 cannot store: the whole checkpoint becomes gptq_v2, including the
    qzeros already written for layer 0, and everything decodes to the records' weights."""
    from dataclasses import replace

    from qtk.export import ExportOptions
    from qtk.export.awq import AWQWriter
    from qtk.export.gptq import GPTQWriter
    from qtk.model.source import ModelSource
    from qtk.recipe import QuantScheme, load_recipe

    source = ModelSource(tiny_llama)
    scheme = QuantScheme(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64)
    recipe = replace(load_recipe("w4a16"), weights=scheme)
    results = _layer_results(source, scheme)
    q0 = "model.layers.0.self_attn.q_proj"
    qt = results[0].qweights[q0]
    g_idx = (torch.arange(128, dtype=torch.int32) // 64)[torch.randperm(128, generator=torch.Generator().manual_seed(1))]
    results[0].qweights[q0] = QTensor(qt.values, qt.scale, scheme, qt.zero_point, g_idx, qt.dtype)
    d1 = "model.layers.1.mlp.down_proj"
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    w[:5, :64] = w[:5, :64].abs()  # group 0 of rows 0-4 is all non-negative: zero point qmin = -8, unsigned 0
    results[1].qweights[d1] = QTensor.quantize(w, scheme, torch.bfloat16)
    assert (results[1].qweights[d1].zero_point == -8).any()
    assert not any((q.zero_point == -8).any() for q in results[0].qweights.values())

    (tmp_path / "gptq").mkdir()
    writer = GPTQWriter(tmp_path / "gptq", source, recipe, ExportOptions())
    for r in results:
        writer.add_layer(r)
    writer.finish({})
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == "gptq_v2" and qc["desc_act"] is True and qc["sym"] is False
    assert any("gptq_v2" in n for n in writer.notes)
    ck = open_checkpoint(tmp_path / "gptq")
    for r in results:
        for m, q in r.qweights.items():
            ref = QTensor(q.values, q.scale.half().float(), scheme, q.zero_point, q.g_idx).dequantize()
            assert torch.equal(gptq_dequant(tmp_path / "gptq", m, 4, v1=False), ref), m
            back = ck.qtensor(m)
            assert torch.equal(back.zero_point, q.zero_point) and torch.equal(back.values, q.values), m
            assert (back.g_idx is None) == (m != q0)
    assert torch.equal(ck.qtensor(q0).g_idx, g_idx)

    awq_dir = tmp_path / "awq"
    awq_dir.mkdir()
    awq = AWQWriter(awq_dir, source, recipe, ExportOptions())
    from qtk.errors import UsageError

    with pytest.raises(UsageError, match="g_idx"):
        awq.add_layer(results[0])
    awq.shards.close()


# ---- gptq_v2 through a real convert ----

@pytest.fixture(scope="module")
def positive_group_model(tmp_path_factory):
    """The tiny Llama with one all-positive weight group in layer 1's down_proj: its asymmetric zero point is
    qmin (unsigned 0), which GPTQ v1 cannot store."""
    from models import make_tiny_model
    from safetensors.torch import load_file, save_file

    d = make_tiny_model(tmp_path_factory.mktemp("pos") / "m", hidden=128, intermediate=256, seed=3)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.mlp.down_proj.weight"][:3, :64] = t["model.layers.1.mlp.down_proj.weight"][:3, :64].abs()
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def converted_v2(positive_group_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("v2")
    recipe = [line if not line.startswith("ignore:") else "ignore: [lm_head]" for line in ASYM_G64.splitlines()]
    (root / "r.yaml").write_text("\n".join(recipe) + "\n")
    code, output = cli("convert", positive_group_model, "--recipe", root / "r.yaml", "-o", root / "out", "--no-hash",
                       "--target", "vllm", "--target", "gptq", "--target", "awq", "--max-shard-size", "50KB")
    assert code == 0, output
    assert len(list((root / "out" / "gptq").glob("model-*-of-*.safetensors"))) > 2  # the rewrite finds qzeros in any shard
    return {t: root / "out" / t for t in ("vllm", "gptq", "awq")} | {"output": output}


def test_convert_switches_to_v2_and_rewrites_earlier_qzeros(converted_v2):
    d, v = converted_v2["gptq"], open_checkpoint(converted_v2["vllm"])
    assert json.loads((d / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq_v2"
    assert "gptq_v2" in converted_v2["output"]
    assert (v.qtensor("model.layers.1.mlp.down_proj").zero_point == -8).any()
    for m in v.modules():  # layer 0's qzeros were written in v1 before the switch, then rewritten
        assert torch.equal(gptq_dequant(d, m, 4, v1=False), vllm_reference(v, m)), m
        assert torch.equal(awq_dequant(converted_v2["awq"], m, 64), vllm_reference(v, m)), m


@pytest.fixture(scope="module")
def converted_act(tiny_llama, calib_file, tmp_path_factory):
    """GPTQ with act-order and dynamic groups (the QTensors carry g_idx), to the gptq target."""
    root = tmp_path_factory.mktemp("act")
    r = root / "act.yaml"
    r.write_text("name: act\nweights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}\n"
                 "algorithm: [{gptq: {actorder: group, true_sequential: true}}]\n")
    code, output = cli("convert", tiny_llama, "--recipe", r, "-o", root / "out", "--target", "gptq", "--no-hash",
                       "--calib", calib_file, "--num-samples", "8", "--seq-len", "64")
    assert code == 0, output
    return {"gptq": root / "out" / "gptq"}


def test_act_order_gptq_through_convert(tiny_llama, converted_act):
    """g_idx from the pipeline reaches the file; decoded independently, each weight's error against the source
    matches the error the pipeline recorded for its own weights (a misapplied g_idx would not)."""
    from safetensors.torch import load_file

    d = converted_act["gptq"]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is True and qc["true_sequential"] is True and qc["group_size"] == 32
    recorded = json.loads((d / "qtk.json").read_text())["stats"]["weight_error"]
    src = load_file(str(tiny_llama / "model.safetensors"))
    ck = open_checkpoint(d)
    for m in ck.modules():
        g_idx = load_file(str(d / "model.safetensors"))[f"{m}.g_idx"]
        assert not torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=torch.int32) // 32), m  # act-order: permuted
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((g_idx.numel() // 32,), 32)), m
        assert ck.qtensor(m).g_idx is not None
        w = src[f"{m}.weight"].float()
        got = gptq_dequant(d, m, 4, v1=True)
        err = float((got - w).norm() / w.norm())
        assert abs(err - recorded[m]) < 1e-3 * recorded[m], (m, err, recorded[m])


# ---- a real client: GPTQModel's kernels, loaded through transformers ----

def _client_weight(mod) -> torch.Tensor:
    """The dequantized [out, in] weight a GPTQModel kernel module computes with."""
    if hasattr(mod, "awq_weight_dequantize"):
        w = mod.awq_weight_dequantize(torch.device("cpu"), torch.float16)
    else:
        w = mod.dequantize_weight()
    return w.float().t()


@pytest.mark.parametrize("case", ["w4a16/gptq", "w4a16/awq", "asym/gptq", "asym/awq", "w8a16/gptq", "v2/gptq", "act/gptq"])
def test_gptqmodel_loads_through_transformers(converted, converted_v2, converted_act, case):
    pytest.importorskip("gptqmodel", reason="GPTQModel is not installed (7.6 works with torch 2.13 / transformers 5.24 "
                                            "but must be built from its sdist; qtk does not install it)")
    from transformers import AutoModelForCausalLM

    from qtk.model.simulate import engine_weight

    label, target = case.split("/")
    if target == "gptq":
        pytest.importorskip("optimum", reason="transformers loads GPTQ checkpoints through optimum")
    d = {"v2": converted_v2, "act": converted_act}.get(label, converted.get(label))[target]
    ck = open_checkpoint(d)
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, device_map="cpu").eval()
    for m in ck.modules():  # before any forward: some kernels repack their buffers on first use
        assert torch.equal(_client_weight(model.get_submodule(m)), engine_weight(ck.qtensor(m))), m
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(ids).logits
        b = build_simulated_model(ck).eval()(ids).logits
    # the kernels round activations to fp16; the weights themselves were compared exactly above
    assert (a - b).abs().max() < 0.1


def test_gptq_config_says_whether_true_sequential_ran(tiny_llama, calib_file, tmp_path):
    code, output = cli("convert", tiny_llama, "--recipe", "w4a16-gptq", "-o", tmp_path / "o", "--target", "gptq",
                       "--no-hash", "--calib", calib_file, "--num-samples", "8", "--seq-len", "64")
    assert code == 0, output
    assert json.loads((tmp_path / "o" / "gptq" / "config.json").read_text())["quantization_config"]["true_sequential"] is False
