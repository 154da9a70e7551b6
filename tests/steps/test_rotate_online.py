"""The online rotation step (qtk.steps.rotate_online, R4 on down_proj's input): the float model with the rotation
folded into down_proj and applied to its input computes the source's logits (and a wrong one does not); the
written compressed-tensors transform, decoded by compressed-tensors' own transform code on the model transformers
loads, computes what qtk's simulation computes; `qtk inspect` checks the transform from the bytes and fails a matrix
that is not orthogonal; targets that cannot apply it refuse before any work."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from models import apply_ct_transforms, make_tiny_model
from qtk import api
from qtk.cli import main
from qtk.export import open_checkpoint
from qtk.export.codecs import ct_transform
from qtk.model.simulate import build_simulated_model
from qtk.model.source import ModelSource
from qtk.quant.hadamard import RepeatedRotation, orthogonality_error
from qtk.recipe.params import OnlineRotateParams
from qtk.steps import LayerContext, records_from_json, rotate_online

ONLINE = "online transforms"
IDS = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))

R4_W4 = """
name: r4-w4
weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
algorithm: [ALGO]
ignore: [lm_head]
"""


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """fp32 Llama whose MLP width 384 = 12 x 32 is no power of two (Paley I(11) ⊗ Sylvester(32))."""
    return make_tiny_model(tmp_path_factory.mktemp("r4") / "m", hidden=128, intermediate=384, dtype=torch.float32)


def rotated_float_model(src, params, *, online: bool = True):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    source = ModelSource(src)
    rotate_online.source_view(source, params)
    for i, layer in enumerate(model.get_submodule(source.arch.layers)):
        ctx = LayerContext(i, source.layer_prefix(i), layer, source.arch, None, list(source.arch.linears), None,
                           torch.float32)
        rec = rotate_online.run(ctx, params)
        assert rec.modules == (list(source.arch.linears) if params.modules == "all" else ["mlp.down_proj"])
        if not online:  # the weight rotated, the input not: what an engine that ignores the transform computes
            for rel in rec.modules:
                layer.get_submodule(rel)._forward_pre_hooks.clear()
    return model


@pytest.mark.parametrize("block,modules", [(0, "down_proj"), (128, "down_proj"), (32, "down_proj"), (16, "all")])
def test_the_rotated_float_model_computes_the_source_logits(wide, block, modules):
    from transformers import AutoModelForCausalLM

    base = _logits(AutoModelForCausalLM.from_pretrained(str(wide), dtype=torch.float32).eval())
    model = rotated_float_model(wide, OnlineRotateParams(seed=5, block=block, modules=modules))
    assert (_logits(model) - base).abs().max().item() <= 2e-5 * base.abs().max().item()
    w = model.get_submodule("model.layers.0.mlp.down_proj").weight
    assert (w - ModelSource(wide).tensor("model.layers.0.mlp.down_proj.weight")).abs().max() > 0.01


def test_without_the_online_half_the_logits_change(wide):
    from transformers import AutoModelForCausalLM

    base = _logits(AutoModelForCausalLM.from_pretrained(str(wide), dtype=torch.float32).eval())
    model = rotated_float_model(wide, OnlineRotateParams(seed=5), online=False)
    assert (_logits(model) - base).abs().max().item() > 0.05 * base.abs().max().item()


def test_the_repeated_rotation_is_orthogonal_and_its_stored_matrix_is_pm1():
    for width, block in ((384, 0), (1536, 0), (1536, 512), (14336, 2048), (576, 64)):
        r = RepeatedRotation.for_width(width, 7, block)
        m = r.stored()
        assert set(m.unique().tolist()) == {-1.0, 1.0} and orthogonality_error(m) == 0.0
        x = torch.randn(3, width, dtype=torch.float64)
        assert torch.allclose(r.apply(r.apply(x), transpose=True), x, atol=1e-10)
        # the engine's view: x blockdiag(M/√b, ...) with the stored matrix
        assert torch.allclose(ct_transform.DenseRotation(m).apply(x), r.apply(x), atol=1e-10)


def test_the_record_rebuilds_the_rotated_weight(wide):
    source = ModelSource(wide)
    layer = source.layer(source.skeleton(), 1)
    ctx = LayerContext(1, "model.layers.1.", layer, source.arch, None, list(source.arch.linears), None, torch.float32)
    rec = rotate_online.run(ctx, OnlineRotateParams(seed=2, block=128))
    back = records_from_json({"rotate_online": json.loads(json.dumps(rec.to_json()))})["rotate_online"]
    for rel in source.arch.linears:
        W = source.tensor(f"model.layers.1.{rel}.weight").float()
        assert torch.equal(back.reframe(W, rel, source.arch), layer.get_submodule(rel).weight.detach()), rel


def _convert(src, tmp_path, calib_file, algo: str, **kw):
    p = tmp_path / "r.yaml"
    p.write_text(R4_W4.replace("ALGO", algo))
    return api.convert(src, str(p), tmp_path / "o", calib=str(calib_file), num_samples=8, seq_len=64,
                       hash_source=False, **kw)


def ct_decoded_model(d):
    """The checkpoint as transformers + compressed-tensors load it, with compressed-tensors' own transforms on."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    assert any("R4_input" in n for n, _ in model.named_modules()) is False
    return apply_ct_transforms(model, d)


@pytest.mark.parametrize("algo,block", [("rotate, {rotate_online: {seed: 3}}, gptq", 0),
                                        ("{rotate_online: {seed: 4, block: 128}}, rtn", 128),
                                        ("{rotate_online: {seed: 4, block: 16, modules: all}}, gptq", 16)])
def test_compressed_tensors_own_transform_code_computes_the_simulation(wide, calib_file, tmp_path, algo, block):
    """R1/R2 + R4 with GPTQ, R4 alone block-diagonal with RTN, and every Linear's input rotated within blocks of 16
    with GPTQ: the same logits through compressed-tensors' transforms as through qtk's simulation; int4 noise, not a
    wrong frame."""
    from transformers import AutoModelForCausalLM

    d = _convert(wide, tmp_path, calib_file, algo).outputs["vllm"]
    tc = json.loads((d / "config.json").read_text())["quantization_config"]["transform_config"]
    every = "modules: all" in algo
    (name, g), = tc["config_groups"].items()
    assert name == ("HG" if every else "R4")
    assert g["type"] == "random-hadamard" and g["head_dim"] == (block or None)
    want = [f"model.layers.{i}.{m}" for i in range(2) for m in (ModelSource(wide).arch.linears if every else ["mlp.down_proj"])]
    assert g["apply"][0]["targets"] == sorted(want)
    sim = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)
    a, b = _logits(ct_decoded_model(d)), _logits(sim)
    assert (a - b).abs().max().item() <= 1e-4
    # int4 noise, not a wrong frame: the same weights served without the transform are much further from the source
    base = _logits(AutoModelForCausalLM.from_pretrained(str(wide), dtype=torch.float32).eval())
    plain = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)
    for m in want:
        plain.get_submodule(m).input_rotation = None
    assert (_logits(plain) - base).pow(2).mean() > 2 * (a - base).pow(2).mean()
    rec = json.loads((d / "qtk.json").read_text())["stats"]["algorithm"]["1"]["rotate_online"]
    assert sorted(rec["modules"]) == sorted(m.partition("layers.1.")[2] for m in want if ".1." in m)
    assert rec["rotation"]["block"] == (block or 384)
    rep = api.inspect(d)
    assert rep.ok and any(c.name == ONLINE and c.ok for c in rep.checks)


def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg["quantization_config"]["transform_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def test_a_transform_spelled_as_llm_compressors_quip_reads_the_same(wide, calib_file, tmp_path):
    """llm-compressor's QuIPModifier (rotations ["v"]) writes every Linear's input rotation as group `v` with the
    class name `Linear` as its target, lm_head ignored, and its offline half as a `weight_input` location: the same
    transform as qtk's `modules: all`. Read so, the simulation is unchanged and compressed-tensors' own transform
    code decodes it to the same logits; a reader that matched targets by module name only would find none.
    llm-compressor stores the shared matrix once."""
    d = _convert(wide, tmp_path, calib_file, "{rotate_online: {seed: 4, block: 16, modules: all}}, rtn").outputs["vllm"]
    before = _logits(build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False))

    def quip(tc):
        (g,) = tc["config_groups"].values()
        g["apply"] = [{"targets": ["Linear"], "location": "input", "inverse": False, "ignore": ["lm_head"]},
                      {"targets": ["Linear"], "location": "weight_input", "inverse": True, "ignore": ["lm_head"]}]
        tc["config_groups"] = {"v": g}

    _edit_config(d, quip)
    # and stores the matrix once, under the first module's name (vLLM keeps one per group and order, loaded from
    # whichever name holds it): a reader that looked only beside each module would leave the rest unrotated
    def once(sd):
        names = sorted(k for k in sd if ".HG_input." in k)
        sd[names[0].replace(".HG_input.", ".v_input.")] = sd.pop(names[0])
        for k in names[1:]:
            del sd[k]

    _rewrite(d, once)
    ck = open_checkpoint(d)
    transforms, problems = ck.input_transforms()
    assert not problems and sorted(transforms) == sorted(ck.modules())
    sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
    assert torch.equal(_logits(sim), before)
    assert (_logits(ct_decoded_model(d)) - before).abs().max().item() <= 1e-4
    assert api.inspect(d).ok


def test_a_group_may_hold_one_matrix_per_order(wide, calib_file, tmp_path):
    """vLLM keeps one matrix per transform group and order (a QuIP group without a block rotates 576- and 1536-wide
    inputs with a matrix of each width): a second order in a group is not a matrix that differs from the first; a
    second matrix of the same order still is."""
    d = _convert(wide, tmp_path, calib_file, "{rotate_online: {seed: 3}}, rtn").outputs["vllm"]
    q = [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    _edit_config(d, lambda tc: tc["config_groups"]["R4"]["apply"][0]["targets"].extend(q))
    h = RepeatedRotation.for_width(128, 0, 0).unit().stored(torch.float32)
    _rewrite(d, lambda sd: sd.update({f"{m}.R4_input.weight": h.clone() for m in q}))
    rep = api.inspect(d)
    assert rep.ok, [c.detail for c in rep.checks if not c.ok]
    _rewrite(d, lambda sd: sd.update({f"{q[1]}.R4_input.weight": h[torch.randperm(128)]}))
    bad = {c.name: c.detail for c in api.inspect(d).checks if not c.ok}
    assert ONLINE in bad and f"{q[1]}.R4_input.weight" in bad[ONLINE] and "order 128" in bad[ONLINE], bad


def _rewrite(d, fn):
    f = d / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("damage", ["not orthogonal", "not ±1", "differs between layers", "missing", "no config"])
def test_inspect_fails_a_damaged_transform(wide, calib_file, tmp_path, damage):
    d = _convert(wide, tmp_path, calib_file, "{rotate_online: {block: 128}}, rtn").outputs["vllm"]
    name = "model.layers.1.mlp.down_proj.R4_input.weight"

    def hurt(sd):
        m = sd[name].clone()
        if damage == "not orthogonal":
            m[0] = m[1]
        elif damage == "not ±1":
            m = m * 0.5
        elif damage == "differs between layers":
            m = m[torch.randperm(m.shape[0])]
        if damage == "missing":  # every copy: one left would serve them all (vLLM shares it per group and order)
            for k in [k for k in sd if ".R4_input." in k]:
                del sd[k]
        else:
            sd[name] = m

    if damage == "no config":
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["transform_config"] = {}
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        _rewrite(d, hurt)
    rep = api.inspect(d)
    assert not rep.ok
    bad = {c.name: c.detail for c in rep.checks if not c.ok}
    assert ONLINE in bad and "model.layers.1.mlp.down_proj" in bad[ONLINE], bad
    if damage == "missing":  # the simulation (qtk eval) refuses it too, rather than leave down_proj unrotated
        from qtk.errors import UsageError

        with pytest.raises(UsageError, match="no matrix of its order is stored"):
            build_simulated_model(open_checkpoint(d))


@pytest.mark.parametrize("target", ["trtllm", "hf-modelopt", "gptq", "awq"])
def test_targets_without_online_transforms_refuse_before_any_work(wide, tmp_path, target):
    r = CliRunner().invoke(main, ["convert", str(wide), "--recipe", "w4a16-rot4-gptq", "-o", str(tmp_path / "o"),
                                  "-t", target], prog_name="qtk")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert f"target {target} cannot apply the online rotation" in lines[0] and "--target vllm" in lines[0]
    assert not (tmp_path / "o").exists()


def test_a_block_that_does_not_divide_the_width_is_refused_before_any_work(wide, tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(R4_W4.replace("ALGO", "{rotate_online: {block: 256}}, rtn"))
    r = CliRunner().invoke(main, ["convert", str(wide), "--recipe", str(p), "-o", str(tmp_path / "o")], prog_name="qtk")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "cannot rotate llama" in lines[0], r.output
    assert not (tmp_path / "o").exists()


def test_rotate_online_conflicts_with_smoothing_steps():
    from qtk.errors import UsageError
    from qtk.recipe import parse_recipe

    doc = {"name": "x", "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                    "group_size": 32}, "algorithm": ["rotate_online", "awq"]}
    with pytest.raises(UsageError, match="rotate_online and awq"):
        parse_recipe(doc, json.dumps(doc), "x")


def test_a_moe_family_is_refused_before_any_work(tmp_path):
    src = make_tiny_model(tmp_path / "moe", model_type="qwen3_moe", hidden=128, intermediate=256, head_dim=32,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
    p = tmp_path / "r.yaml"
    p.write_text(R4_W4.replace("ALGO", "rotate_online, rtn"))
    r = CliRunner().invoke(main, ["convert", str(src), "--recipe", str(p), "-o", str(tmp_path / "o")], prog_name="qtk")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0] == ("error: the rotate_online step cannot rotate qwen3_moe: it rotates a dense MLP's down_proj, "
                        "which this family does not have in every layer — use a recipe without rotate_online for this "
                        "model")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("params,message", [
    ("{modules: attn}", "rotate_online.modules: must be down_proj or all, got 'attn' — use modules: down_proj"),
    ("{modules: all}", "rotate_online.modules: all rotates inputs of several widths, within blocks of one order — "
                       "set block, e.g. the weights' group size (16 for NVFP4)"),
    ("{block: 6}", "rotate_online.block: must be 0 (the whole width) or a Hadamard order (1, 2 or a multiple of 4), "
                   "got 6 — use 0, or a power of two such as 128"),
    ("{seed: -1}", "rotate_online.seed: must be in [0, 2^63), got -1 — use e.g. 0"),
])
def test_bad_parameters_are_refused_in_one_line(tmp_path, params, message):
    p = tmp_path / "r.yaml"
    p.write_text(R4_W4.replace("ALGO", f"{{rotate_online: {params}}}, rtn"))
    r = CliRunner().invoke(main, ["recipes", "show", str(p)], prog_name="qtk")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and lines == [f"error: r.yaml: algorithm[0].{message}"], r.output
