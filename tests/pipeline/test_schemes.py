"""A scheme per module on the calibration side: every step asks recipe.scheme_for. Two-scheme recipes convert on a
tiny random Llama with each module's QTensor carrying the scheme its rule gave, static input ranges only where a
module's scheme has static activations, Hessians taken on inputs quantized with each group's activation scheme, and
the activations the loop propagates equal to a reference built module by module from those schemes."""

import pytest
import torch

from models import ResumeSink, make_tiny_model
from qtk.calib import calibration_ids, load_texts
from qtk.model.simulate import QLinear, engine_weight, replace_module
from qtk.model.source import ModelSource
from qtk.pipeline import capture_layer_inputs, compute_dtype, run
from qtk.quant.formats import static_scale
from qtk.recipe import parse_recipe

INT4_G128 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
INT8_CH = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
INT8_STATIC = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}


def two_scheme(algorithm):
    return parse_recipe({"name": "w4-int8-sensitive", "weights": INT4_G128, "algorithm": algorithm,
                         "overrides": [{"targets": ["re:.*layers\\.0\\..*", "re:.*down_proj"], "weights": INT8_CH}]})


def w8a8_o_weight_only(algorithm):
    return parse_recipe({"name": "w8a8-o16", "weights": INT8_CH, "activations": INT8_STATIC, "algorithm": algorithm,
                         "overrides": [{"targets": ["re:.*o_proj"], "weights": INT8_CH, "activations": None}]})


@pytest.fixture(scope="module")
def mha_llama(tmp_path_factory):
    """No GQA, so the v_proj -> o_proj smoothing pair chains."""
    return make_tiny_model(tmp_path_factory.mktemp("mha") / "m", hidden=128, intermediate=256, heads=4, kv_heads=4, seed=5)


def convert(model, recipe, calib_file):
    src = ModelSource(model)
    ids = calibration_ids(src.tokenizer(), load_texts(str(calib_file)), 6, 32, 0)
    c = ResumeSink()
    stats = run(src, recipe, ids, [c], batch_size=3, resume=c)
    return src, ids, c, stats


def reference_outputs(src, recipe, ids, results):
    """Each layer rebuilt from the source: its dense tensors as stored, each quantized Linear replaced by a QLinear of
    its QTensor with its module's activation scheme and static scale; run on the reference's own inputs."""
    skeleton = src.skeleton()
    batches, layer_kwargs = capture_layer_inputs(src, skeleton, ids, 3)
    outs = []
    for i, r in enumerate(results):
        layer = src.layer(skeleton, i, compute_dtype(src))
        prefix = src.layer_prefix(i)
        with torch.no_grad():
            for k, v in r.dense.items():
                layer.get_submodule(k[len(prefix):].rpartition(".")[0]).get_parameter(k.rpartition(".")[2]).copy_(v)
        for name, qt in r.qweights.items():
            act = recipe.scheme_for(name).activations
            scale = static_scale(r.input_amax[name], act) if act is not None and not act.dynamic else None
            rel = name[len(prefix):]
            lin = layer.get_submodule(rel)
            replace_module(layer, rel, QLinear(engine_weight(qt).to(lin.weight.dtype), None, act, scale))
        with torch.no_grad():
            batches = [(layer(h, **kw), kw) for (h, _), kw in zip(batches, layer_kwargs[i])]
        outs.append([h for h, _ in batches])
    return outs


@pytest.mark.parametrize("algorithm", [["rtn"], ["gptq"], ["awq"]])
def test_two_scheme_recipe_gives_each_module_its_rule(tiny_llama, calib_file, algorithm):
    recipe = two_scheme(algorithm)
    src, ids, c, _ = convert(tiny_llama, recipe, calib_file)
    int4, int8 = recipe.weights, recipe.overrides[0].scheme.weights
    seen = {}
    for r in c.results:
        for name, qt in r.qweights.items():
            assert qt.scheme == recipe.scheme_for(name).weights, name
            seen[name] = qt.scheme
            assert qt.scale.shape == ((qt.shape[0], qt.shape[1] // 128) if qt.scheme == int4 else (qt.shape[0], 1)), name
            assert qt.values.min() >= qt.scheme.qmin and qt.values.max() <= qt.scheme.qmax
        assert not r.input_amax  # weight-only: no static input ranges
    assert all(s == int8 for n, s in seen.items() if ".layers.0." in n or n.endswith("down_proj"))
    assert {n for n, s in seen.items() if s == int4} == {f"model.layers.1.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    ref = reference_outputs(src, recipe, ids, c.results)
    assert len(c.hidden) == len(ref) == 2
    for got, want in zip(c.hidden, ref):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_w8a8_with_a_weight_only_override(mha_llama, calib_file):
    recipe = w8a8_o_weight_only([{"smoothquant": {"alpha": 0.5}}, "rtn"])
    src, ids, c, stats = convert(mha_llama, recipe, calib_file)
    for r in c.results:
        o = f"model.layers.{r.index}.self_attn.o_proj"
        assert set(r.input_amax) == set(r.qweights) - {o}  # static input ranges only where the scheme has them
        assert all(a > 0 for a in r.input_amax.values())
        # SmoothQuant migrates outliers only into Linears that quantize their inputs: v_proj -> o_proj is left alone
        assert set(r.records["smoothquant"].scales) == {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}
    ref = reference_outputs(src, recipe, ids, c.results)
    for got, want in zip(c.hidden, ref):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    # without the override the same pair is smoothed, and o_proj's input range observed
    plain = parse_recipe({"name": "w8a8", "weights": INT8_CH, "activations": INT8_STATIC,
                          "algorithm": [{"smoothquant": {"alpha": 0.5}}, "rtn"]})
    _, _, c2, _ = convert(mha_llama, plain, calib_file)
    assert "self_attn.v_proj" in c2.results[0].records["smoothquant"].scales
    assert "model.layers.0.self_attn.o_proj" in c2.results[0].input_amax


def test_gptq_hessians_see_inputs_as_each_module_scheme_quantizes_them(mha_llama, calib_file):
    """q/k/v's Hessian is taken on int8 fake-quantized inputs (static scale), o_proj's (weight-only) on the float ones:
    rebuilding both by hand from the layer reproduces GPTQ's QTensors exactly."""
    from qtk.algorithms.gptq import gptq_quantize_shared
    from qtk.quant.formats import fake_quant_activation
    from qtk.steps.capture import capture_many
    from qtk.steps.stats import Hessian

    recipe = w8a8_o_weight_only(["gptq"])
    src, ids, c, _ = convert(mha_llama, recipe, calib_file)
    r0 = c.results[0]
    skeleton = src.skeleton()
    batches, _ = capture_layer_inputs(src, skeleton, ids, 3)
    layer = src.layer(skeleton, 0, compute_dtype(src))
    act = recipe.scheme_for("model.layers.0.self_attn.q_proj").activations
    s_q = static_scale(r0.input_amax["model.layers.0.self_attn.q_proj"], act)
    hq, ho = Hessian(128), Hessian(128)
    capture_many(layer, batches, {"self_attn.q_proj": lambda x: hq.update(fake_quant_activation(x, act, s_q)),
                                  "self_attn.o_proj": ho.update}, stop_when_all=True)
    params = recipe.step("gptq").params
    for group, h in ((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), hq), (("self_attn.o_proj",), ho)):
        weights = [layer.get_submodule(t).weight.detach() for t in group]
        solved = gptq_quantize_shared(weights, h.H, recipe.weights, params, src.dtype)
        for t, (qt, _) in zip(group, solved):
            got = r0.qweights["model.layers.0." + t]
            assert torch.equal(got.values, qt.values) and torch.equal(got.scale, qt.scale), t
    # a Hessian on the float inputs would have given q/k/v other values (the check above can fail)
    hf = Hessian(128)
    capture_many(layer, batches, {"self_attn.q_proj": hf.update}, stop_when_all=True)
    wq = [layer.get_submodule("self_attn.q_proj").weight.detach()]
    other = gptq_quantize_shared(wq, hf.H, recipe.weights, params, src.dtype)[0][0]
    assert not torch.equal(other.values, r0.qweights["model.layers.0.self_attn.q_proj"].values)
