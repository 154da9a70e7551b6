"""gpt-oss (GptOssForCausalLM): attention with biases and a sink logit per head, sliding and full layers alternating;
an MoE block whose router is a Linear with a bias and whose experts carry biases and a clamped SwiGLU, stored fused
([E, H, 2I], gate/up interleaved) in the BF16 release and as MXFP4 blocks/scales in OpenAI's. qtk reads either as
per-expert Linears, quantizes them, keeps the sinks and the router as stored, and writes each expert as its own
Linears (`mlp.experts.{e}.gate_proj/up_proj/down_proj`, with biases), which compressed-tensors decodes and
transformers computes with (after putting them back into its fused layout: it has no per-expert loading for gpt-oss).

Every recipe's round trip through transformers + compressed-tensors is in test_architectures.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_sources import read_tensors
from models import make_tiny_model
from mxfp4_sources import make_mxfp4_source
from qtk import api
from qtk.export import open_checkpoint
from qtk.model.source import ModelSource
from test_architectures import _moe_ct_reference

E, LAYERS, HIDDEN, INTER = 4, 2, 256, 128
CONFIG = dict(model_type="gpt_oss", layers=LAYERS, hidden=HIDDEN, intermediate=INTER, heads=4, kv_heads=2, head_dim=64,
              num_local_experts=E, num_experts_per_tok=2, sliding_window=16)
NS, T = 8, 48
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
def _give_values(d):
    """The tiny model's experts get weights as large as its Linears' and every bias, sink and router bias a value
    (the init leaves them zero or small), so a dropped or misplaced one changes the logits."""
    f = d / "model.safetensors"
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(3)
    for k, t in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            sd[k] = (torch.randn(t.shape, generator=g) * 0.08).to(t.dtype)
        elif k.endswith(("_bias", ".sinks", "router.bias")):
            sd[k] = (torch.randn(t.shape, generator=g) * 0.5).to(t.dtype)
    save_file(sd, str(f), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    bf16 = _give_values(make_tiny_model(root / "bf16", **CONFIG))
    mx, deq = make_mxfp4_source(bf16, root / "mxfp4")
    return {"bf16": bf16, "mxfp4": mx, "deq": deq}


def _logits_vs_transformers(d, tmp) -> float:
    """max |logit difference| between qtk's simulation of checkpoint d and transformers computing with the weights
    compressed-tensors decodes from it (weights only, float32)."""
    from qtk.model.simulate import build_simulated_model

    ck = open_checkpoint(d)
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
    ref = _moe_ct_reference(ck, tmp).float().eval()
    with torch.no_grad():
        return (ref(ids).logits - sim(ids).logits).abs().max().item()


def test_unfused_experts_compute_what_transformers_computes(models):
    """qtk's per-expert Linears inside the model's own MoE block give GptOssMLP's output: the interleaved gate/up
    split, the biases, the clamped SwiGLU and the router's top-k softmax."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qtk.model.arch import arch_for
    from qtk.model.moe import unfuse_experts

    cfg = AutoConfig.from_pretrained(str(models["bf16"]))
    fused = AutoModelForCausalLM.from_pretrained(str(models["bf16"]), dtype=torch.float32).eval()
    sd = fused.state_dict()
    arch = arch_for("gpt_oss", cfg.to_dict())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    unfuse_experts(skeleton, arch)
    src = ModelSource(models["bf16"])
    per_expert = {k: src.tensor(k).float() for k in src.weight_map}
    skeleton.load_state_dict(per_expert, strict=True, assign=True)
    skeleton.eval()
    x = torch.randn(2, 24, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3  # reaches the clamp
    for i in range(LAYERS):
        a, b = fused.model.layers[i].mlp, skeleton.model.layers[i].mlp
        with torch.no_grad():
            ya, yb = a(x)[0], b(x)[0]
        assert (ya - yb).abs().max() <= 1e-5 * ya.abs().max()
    # the clamp is reached, so the activation is exercised beyond plain SwiGLU
    e0 = skeleton.model.layers[0].mlp.experts[0]
    assert (e0.gate_proj(x).max() > 7.0) or (e0.up_proj(x).abs().max() > 7.0)
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, HIDDEN, 2 * INTER)


def test_source_reads_fused_experts_per_expert(models):
    """The BF16 checkpoint's fused experts come out as each expert's Linears and biases: gate the even columns of
    gate_up_proj[e], up the odd ones, transposed to [out, in]; the stored bytes, in bf16."""
    src = ModelSource(models["bf16"])
    stored = read_tensors(models["bf16"])
    gu = stored["model.layers.1.mlp.experts.gate_up_proj"]
    assert "model.layers.1.mlp.experts.gate_up_proj" not in src.weight_map
    for e in range(E):
        p = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(src.tensor(f"{p}.gate_proj.weight"), gu[e][:, 0::2].T)
        assert torch.equal(src.tensor(f"{p}.up_proj.weight"), gu[e][:, 1::2].T)
        assert torch.equal(src.tensor(f"{p}.down_proj.weight"), stored["model.layers.1.mlp.experts.down_proj"][e].T)
        assert torch.equal(src.tensor(f"{p}.up_proj.bias"), stored["model.layers.1.mlp.experts.gate_up_proj_bias"][e, 1::2])
        assert src.tensor_dtype(f"{p}.gate_proj.weight") == torch.bfloat16
        assert src.shape(f"{p}.down_proj.weight") == [HIDDEN, INTER]


@pytest.mark.parametrize("recipe", ["w4a16", "fp8-dynamic", "w4a16-gptq", "w8a8-sq"])
def test_converts_and_reloads_as_simulated(models, calib_file, tmp_path, recipe):
    """Data-free (w4a16, fp8-dynamic: the stream) and calibrated (w4a16-gptq, w8a8-sq: the layer loop) recipes: every
    attention and expert Linear quantized under its per-expert name, biases kept, the sinks and the router written as
    the source stores them, the router excluded; transformers computing with compressed-tensors' decode of the files
    gives qtk's simulated logits; qtk inspect passes."""
    res = api.convert(models["bf16"], recipe, tmp_path / "o", calib=str(calib_file), num_samples=NS, seq_len=T,
                      hash_source=False)
    d = res.outputs["vllm"]
    ck = open_checkpoint(d)
    mods = set(ck.modules())
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        assert {f"{p}.self_attn.{m}_proj" for m in "qkvo"} <= mods
        assert {f"{p}.mlp.experts.{e}.{w}" for e in range(E) for w in ("gate_proj", "up_proj", "down_proj")} <= mods
    assert len(mods) == LAYERS * (4 + 3 * E)
    source, written = read_tensors(models["bf16"]), read_tensors(d)
    for i in range(LAYERS):
        # SmoothQuant folds its scales into the router's input columns, as into the experts', so the router computes
        # what it did (tests/test_moe.py); every other recipe writes its weight as stored
        router_weight = () if recipe == "w8a8-sq" else (f"model.layers.{i}.mlp.router.weight",)
        for k in (f"model.layers.{i}.self_attn.sinks", *router_weight, f"model.layers.{i}.mlp.router.bias",
                  f"model.layers.{i}.self_attn.q_proj.bias"):
            assert written[k].dtype == source[k].dtype and torch.equal(written[k], source[k]), k
        gub = source[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"]
        for e in range(E):
            # (SmoothQuant's fold scales the Linears' input columns: the biases, added after the GEMM, stay)
            assert torch.equal(written[f"model.layers.{i}.mlp.experts.{e}.gate_proj.bias"], gub[e, 0::2])
    assert not [k for k in written if re.search(r"experts\.(gate_up|down)_proj", k)]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert "re:.*mlp\\.router$" in qc["ignore"]
    assert _logits_vs_transformers(d, tmp_path / "ref") <= 1e-4
    # vLLM's gpt_oss loader does not read these experts: the output says so (tests/engine records its refusal)
    assert any("vLLM's gpt_oss loader" in n and "refuses to load" in n for n in res.notes["vllm"])
    assert "vLLM's gpt_oss loader" in (d / "README.md").read_text()
    report = api.inspect(d)
    assert report.ok, [c for c in report.checks if not c.ok]


def test_expert_no_token_reaches_is_rounded_to_nearest(models, calib_file, tmp_path):
    """The router's bias keeps expert 3 from every token (bias -50): it is reported, rounded to nearest with finite,
    non-zero scales, and the manifest says so; the router bias routes (it was loaded, not the skeleton's zeros)."""
    d = tmp_path / "starved"
    d.mkdir()
    for p in models["bf16"].iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    sd = load_file(str(d / "model.safetensors"))
    for i in range(LAYERS):
        sd[f"model.layers.{i}.mlp.router.bias"][3] = -50.0
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    res = api.convert(d, "w4a16-gptq", tmp_path / "o", calib=str(calib_file), num_samples=NS, seq_len=T,
                      hash_source=False)
    stats = res.manifest["stats"]
    ck = open_checkpoint(res.outputs["vllm"])
    for i in range(LAYERS):
        tokens = stats["expert_tokens"][f"model.layers.{i}.mlp"]
        assert tokens[3] == 0 and sum(tokens) == NS * T * 2
        assert stats["expert_treatment"][f"model.layers.{i}.mlp.experts.3"] == {"tokens": 0,
                                                                               "weights": "rtn: no calibration tokens"}
        for w in ("gate_proj", "up_proj", "down_proj"):
            qt = ck.qtensor(f"model.layers.{i}.mlp.experts.3.{w}")
            assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all() and qt.values.unique().numel() > 4
    assert api.inspect(res.outputs["vllm"]).ok


def test_mxfp4_source_is_read_as_transformers_dequantizes_it(models):
    """The MXFP4 file built here decodes, in transformers' own integration (Mxfp4Config(dequantize=True)), to the
    BF16 model it stands for; qtk's reading of it gives the same experts, per expert."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    m = AutoModelForCausalLM.from_pretrained(str(models["mxfp4"]), quantization_config=Mxfp4Config(dequantize=True),
                                             dtype=torch.bfloat16)
    sd, deq = m.state_dict(), read_tensors(models["deq"])
    for i in range(LAYERS):
        for t in ("gate_up_proj", "down_proj"):
            k = f"model.layers.{i}.mlp.experts.{t}"
            assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], deq[k]), k
    src, ref = ModelSource(models["mxfp4"]), ModelSource(models["deq"])
    assert set(src.weight_map) == set(ref.weight_map)
    assert not any(n.endswith(("_blocks", "_scales")) for n in src.weight_map)
    for n in ref.weight_map:
        a, b = src.tensor(n), ref.tensor(n)
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), n
    assert src.quant.record()["quantized_weights"] == 2 * LAYERS


@pytest.mark.parametrize("recipe", ["w4a16", "w4a16-gptq"])
def test_mxfp4_source_converts_as_its_dequantized_model(models, calib_file, tmp_path, recipe):
    got = api.convert(models["mxfp4"], recipe, tmp_path / "a", calib=str(calib_file), num_samples=NS, seq_len=T,
                      hash_source=False)
    want = api.convert(models["deq"], recipe, tmp_path / "b", calib=str(calib_file), num_samples=NS, seq_len=T,
                       hash_source=False)
    a, b = read_tensors(got.outputs["vllm"]), read_tensors(want.outputs["vllm"])
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    assert got.manifest["stats"]["weight_error"] == want.manifest["stats"]["weight_error"]
    assert got.manifest["source"]["quantization"]["quant_method"] == "mxfp4"
    assert api.inspect(got.outputs["vllm"]).ok


def test_mxfp4_source_to_mxfp4_is_refused_in_one_line(models, tmp_path):
    from click.testing import CliRunner

    from qtk.cli import main

    r = CliRunner().invoke(main, ["convert", str(models["mxfp4"]), "-r", "mxfp4-a16", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    line = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "already holds its experts in MXFP4" in line[0] and "serve the source as it is" in line[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("recipe", ["w4a16", "fp8-dynamic"])
def test_plan_counts_the_bytes_the_conversion_writes(models, tmp_path, recipe):
    """qtk plan from config.json alone counts the sinks, the router's bias and every expert's biases: the bytes it
    plans are the bytes the conversion writes, and it plans the alternating sliding window."""
    from qtk.plan.memory import ModelShape, read_config, weight_bytes
    from qtk.recipe import load_recipe

    s = ModelShape.from_config(read_config(models["bf16"] / "config.json"))
    assert s.sinks and s.expert_bias and s.router_linear_bias and s.windows == (16, None)
    res = api.convert(models["bf16"], recipe, tmp_path / "o", hash_source=False)
    written = sum(t.numel() * t.element_size() for t in read_tensors(res.outputs["vllm"]).values())
    assert weight_bytes(s, load_recipe(recipe)).total == written


def _damaged(models, tmp_path, edit, config=None):
    d = tmp_path / "damaged"
    d.mkdir()
    for p in models["mxfp4"].iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    sd = load_file(str(d / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config(cfg)))
    return d


@pytest.mark.parametrize("case,edit,config,message", [
    ("scales misshapen", lambda sd: sd.update({"model.layers.0.mlp.experts.gate_up_proj_scales":
                                              sd["model.layers.0.mlp.experts.gate_up_proj_scales"][:, :8].contiguous()}), None,
     r"MXFP4 experts are blocks \[E, out, in/32, 16\] with scales \[E, out, in/32\]"),
    ("blocks not bytes", lambda sd: sd.update({"model.layers.0.mlp.experts.down_proj_blocks":
                                              sd["model.layers.0.mlp.experts.down_proj_blocks"].to(torch.int16)}), None,
     "model.layers.0.mlp.experts.down_proj_blocks is stored as int16, not uint8"),
    ("blocks no expert reads", lambda sd: sd.update({
        "model.layers.0.mlp.shared.gate_up_proj_blocks": sd["model.layers.0.mlp.experts.gate_up_proj_blocks"].clone(),
        "model.layers.0.mlp.shared.gate_up_proj_scales": sd["model.layers.0.mlp.experts.gate_up_proj_scales"].clone()}),
     None, r"1 MXFP4 tensor\(s\) belong to no expert of the gpt_oss model"),
])
def test_damaged_mxfp4_sources_are_refused_before_any_work(models, tmp_path, case, edit, config, message):
    """(More refusals, with their exact lines, in tests/test_bad_inputs.py and docs/errors.md.)"""
    from qtk.errors import UsageError

    d = _damaged(models, tmp_path, edit, config)
    with pytest.raises(UsageError, match=message):
        api.convert(d, "w4a16", tmp_path / "o", hash_source=False)
    assert not (tmp_path / "o").exists()


def test_mxfp4_experts_are_decoded_one_expert_at_a_time(models, tmp_path, monkeypatch):
    """The MXFP4 source is never whole in 16 bits: every decode the conversion makes is one expert's Linear (at most
    I x H values), never a layer's fused [E, 2I, H], so what the experts cost in memory is one layer's, read as the
    stream goes (the path FP8-block sources take too, whose peak benchmarks/convert_fp8_source.py measures)."""
    from qtk.model.prequantized import MXFP4Experts

    sizes = []
    decode = MXFP4Experts.decode

    def counted(blocks, scales, dtype):
        out = decode(blocks, scales, dtype)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(MXFP4Experts, "decode", staticmethod(counted))
    api.convert(models["mxfp4"], "w4a16", tmp_path / "o", hash_source=False)
    assert len(sizes) >= LAYERS * E * 3 and max(sizes) == INTER * HIDDEN


@pytest.mark.parametrize("source", ["bf16", "mxfp4"])
def test_data_free_conversion_imports_no_transformers(models, tmp_path, source):
    """The layout config.json implies (sinks, router bias, expert biases) and the per-expert reading of fused or MXFP4
    experts need no transformers: a data-free conversion of either source never imports it."""
    import subprocess
    import sys

    code = ("import sys; from qtk import api; "
            f"api.convert({str(models[source])!r}, 'fp8-dynamic', {str(tmp_path / 'o')!r}, hash_source=False); "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
