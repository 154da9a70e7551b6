"""The autoround step (qtk.steps.autoround, SignRound): on every layer of a tiny model its quantized outputs are
closer to the float ones than round-to-nearest's; it pulls the layer toward the float model's own hidden states,
which the loop carries beside the quantized stream (or, with target: layer, toward the layer's float outputs on the
quantized inputs); with nothing learned it writes exactly RTN's codes and scales (so
the learned ones go through the format's own arithmetic); its checkpoints (int4 groups symmetric and asymmetric,
int8 per channel) reload in transformers + compressed-tensors as qtk simulates them, pass `qtk inspect` and record
each layer's losses; schemes it cannot learn and bad parameters are refused before any work; --resume after a
kill gives the same bytes. With `smooth` it learns smoothing scales too: they move W4A4 activation outliers into the
weights (far below AutoRound alone's error on a layer that has them), leave the float layer's function unchanged,
are recorded as the frame the weights were quantized in, and the static input ranges are re-observed after them."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from click.testing import CliRunner

from models import ResumeSink, make_tiny_model, message_lines
from qtk import api
from qtk.cli import main
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from qtk.model.source import ModelSource
from qtk.recipe import parse_recipe
from qtk.recipe.params import AutoRoundParams, RTNParams
from qtk.steps import LayerContext, autoround, rtn
from qtk.steps.swap import swap_in

IDS = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))


def recipe_text(weights: str, iters: int = 30, name: str = "ar") -> str:
    return (f"name: {name}\nweights: {weights}\nalgorithm:\n  - autoround: {{iters: {iters}}}\nignore: [lm_head]\n")


INT4_G32 = "{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}"
INT4_G32_ASYM = "{num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}"
INT8_CHANNEL = "{num_bits: 8, type: int, symmetric: true, strategy: channel}"
NVFP4 = "{num_bits: 4, type: float, strategy: tensor_group, group_size: 16}"
MXFP4 = "{num_bits: 4, type: float, symmetric: true, strategy: group, group_size: 32, scale_dtype: e8m0}"
NVFP4_W4A4 = (NVFP4 + "\nactivations: {num_bits: 4, type: float, strategy: tensor_group, group_size: 16, dynamic: local}")
INT4_W4A8 = ("{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}"
             "\nactivations: {num_bits: 8, type: int, symmetric: true, strategy: token, dynamic: true}")


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ar") / "m", hidden=128, intermediate=256, dtype=torch.float32)


def layer_batches(model, ids):
    """Each decoder layer's calibration batches [(hidden states, kwargs)] from one float forward, one batch per
    row of ids."""
    layers = model.model.layers
    seen: dict[int, list] = {i: [] for i in range(len(layers))}

    def hook(i):
        def f(mod, args, kwargs):
            kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache")}
            seen[i].append((args[0].detach() if args else kw.pop("hidden_states").detach(), kw))
        return f

    hs = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for row in ids:
            model(input_ids=row[None], use_cache=False)
    for h in hs:
        h.remove()
    return seen


def input_amax(layer, names, batches) -> dict[str, float]:
    """Each Linear's largest |input| over the batches (what OBSERVE measures for a static activation scale)."""
    amax = {t: 0.0 for t in names}
    hs = [layer.get_submodule(t).register_forward_pre_hook(
        lambda m, a, _t=t: amax.__setitem__(_t, max(amax[_t], float(a[0].abs().max())))) for t in names]
    with torch.no_grad():
        for h, kw in batches:
            layer(h, **kw)
    for h in hs:
        h.remove()
    return amax


def solved_outputs(layer, i, source, recipe, batches, step, params, dtype=torch.float32):
    """The layer's outputs on its batches once `step` solved its weights and the engine's view is swapped in (inputs
    quantized as the recipe's activations say), and the step's QTensors and record (dtype: the model's, which scales
    and int quotients are rounded to)."""
    layer = copy.deepcopy(layer)
    arch = source.arch.at(i)
    ctx = LayerContext(i, source.layer_prefix(i), layer, arch, recipe, list(arch.linears), batches, dtype)
    with torch.no_grad():  # the batches are the float model's own inputs here: its stream after the layer, as the loop gives it
        ctx.float_outputs = [_out(layer(h, **kw)) for h, kw in batches]
    ctx.amax = input_amax(layer, ctx.targets, batches)
    record = step(ctx, params)
    for t, qt in ctx.qweights.items():
        swap_in(layer, t, qt, ctx.scheme(t).engine_activations, ctx.amax)
    with torch.no_grad():
        out = [_out(layer(h, **kw)) for h, kw in batches]
    return out, ctx.qweights, record


def _out(y):
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("weights", [INT4_G32, INT4_G32_ASYM, NVFP4, MXFP4, NVFP4_W4A4, INT4_W4A8])
def test_autoround_lowers_every_layers_output_error_below_rtn(fp32_model, weights):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fp32_model), dtype=torch.float32).eval()
    source = ModelSource(fp32_model)
    recipe = parse_recipe(yaml.safe_load(recipe_text(weights)), "", "ar")
    ids = torch.randint(3, 90, (6, 48), generator=torch.Generator().manual_seed(1))
    inputs = layer_batches(model, ids)
    for i, layer in enumerate(model.model.layers):
        batches = inputs[i]
        with torch.no_grad():
            ref = [layer(h, **kw) for h, kw in batches]
        ref = [o[0] if isinstance(o, tuple) else o for o in ref]

        def mse(outs):
            return sum(float((a - b).pow(2).mean()) for a, b in zip(outs, ref)) / len(ref)

        rtn_out, _, _ = solved_outputs(layer, i, source, recipe, batches, rtn.run, RTNParams())
        ar_out, _, rec = solved_outputs(layer, i, source, recipe, batches, autoround.run, AutoRoundParams(iters=60))
        assert rec.iters == 60 and rec.best_loss < rec.initial_loss and 0 <= rec.best_iter < 60
        assert mse(ar_out) < 0.8 * mse(rtn_out), (i, mse(ar_out), mse(rtn_out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_nothing_learned_it_writes_rtns_codes_and_scales(fp32_model, tiny_llama, dtype):
    """One iteration keeps the starting point (V = 0, factors 1: the loss of iteration 0 is the lowest seen), whose
    QTensors must be exactly round-to-nearest's with min-max scales, for a float32 model and a bf16 one (whose scales
    and int quotients are rounded to bf16): the learned ones go through the same format arithmetic."""
    from transformers import AutoModelForCausalLM

    src = fp32_model if dtype == torch.float32 else tiny_llama
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    source = ModelSource(src)
    for weights in (INT4_G32, INT4_G32_ASYM, INT8_CHANNEL, NVFP4, MXFP4):
        recipe = parse_recipe(yaml.safe_load(recipe_text(weights)), "", "ar")
        batches = layer_batches(model, IDS)[0]
        layer = model.model.layers[0]
        _, want, _ = solved_outputs(layer, 0, source, recipe, batches, rtn.run, RTNParams(), dtype)
        _, got, rec = solved_outputs(layer, 0, source, recipe, batches, autoround.run,
                                     AutoRoundParams(iters=1, full_range=False), dtype)
        assert rec.best_iter == 0
        for t in want:
            assert torch.equal(got[t].values, want[t].values), (weights, t)
            assert torch.equal(got[t].scale, want[t].scale), (weights, t)
            assert sorted(got[t].extra) == sorted(want[t].extra), (weights, t)  # NVFP4's global scale, shared when fused
            assert all(torch.equal(got[t].extra[k], want[t].extra[k]) for k in want[t].extra), (weights, t)
            assert (got[t].zero_point is None) == (want[t].zero_point is None)
            if want[t].zero_point is not None:
                assert torch.equal(got[t].zero_point.float(), want[t].zero_point.float())


@pytest.mark.parametrize("weights", [INT4_G32, INT8_CHANNEL])
def test_full_range_puts_each_groups_larger_extreme_on_the_most_negative_code(fp32_model, weights):
    """With nothing learned, the full-range grid (the default) scales each group by amax / -qmin, signed so that its
    larger-magnitude weight is exactly qmin · scale: the scale is negative where that weight is positive, every code
    is on the grid, and the weight error is below compressed-tensors' amax / ((qmax - qmin) / 2) grid's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fp32_model), dtype=torch.float32).eval()
    source = ModelSource(fp32_model)
    recipe = parse_recipe(yaml.safe_load(recipe_text(weights)), "", "ar")
    batches = layer_batches(model, IDS)[0]
    layer = model.model.layers[0]
    _, full, _ = solved_outputs(layer, 0, source, recipe, batches, autoround.run, AutoRoundParams(iters=1))
    _, ct, _ = solved_outputs(layer, 0, source, recipe, batches, autoround.run,
                              AutoRoundParams(iters=1, full_range=False))
    s = recipe.weights
    err = {"full": 0.0, "ct": 0.0}
    for t, qt in full.items():
        w = layer.get_submodule(t).weight.detach().float()
        g = s.group_size or w.shape[1]
        wg, q = w.reshape(w.shape[0], -1, g), qt.values.reshape(w.shape[0], -1, g).float()
        scale = qt.scale.reshape(w.shape[0], -1)
        at = wg.abs().argmax(-1, keepdim=True)
        extreme = wg.gather(-1, at).squeeze(-1)
        assert (q.gather(-1, at).squeeze(-1) == s.qmin).all(), t
        assert torch.equal(torch.sign(scale), -torch.sign(extreme)), t
        torch.testing.assert_close(scale.abs(), wg.abs().amax(-1) / -s.qmin, rtol=0, atol=0)
        assert q.min() >= s.qmin and q.max() <= s.qmax
        err["full"] += float((qt.dequantize().float() - w).pow(2).sum())
        err["ct"] += float((ct[t].dequantize().float() - w).pow(2).sum())
    assert err["full"] < err["ct"], err
    # the weights' observer: full_range is the same grid, whatever the parameter, and round-to-nearest takes it too
    observed = parse_recipe(yaml.safe_load(recipe_text(weights.replace("}", ", observer: full_range}"))), "", "ar")
    _, by_observer, _ = solved_outputs(layer, 0, source, observed, batches, autoround.run,
                                       AutoRoundParams(iters=1, full_range=False))
    _, nearest, _ = solved_outputs(layer, 0, source, observed, batches, rtn.run, RTNParams())
    for t, qt in full.items():
        for other in (by_observer[t], nearest[t]):
            assert torch.equal(other.values, qt.values) and torch.equal(other.scale, qt.scale), t


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def convert_reload_as_simulated(model, calib_file, recipe_path, out):
    """Convert with the recipe file for vLLM; assert the checkpoint passes `qtk inspect` (every weight compared with
    the source in its frame) and reloads in transformers + compressed-tensors as qtk simulates it. Returns the
    checkpoint and its per-layer step records."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    d = api.convert(model, str(recipe_path), out, calib=str(calib_file), num_samples=8, seq_len=64,
                    hash_source=False).outputs["vllm"]
    rep = api.inspect(d)
    assert rep.ok and rep.errors, rep
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    sim = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)
    assert (_logits(ref) - _logits(sim)).abs().max().item() <= 1e-3
    return d, json.loads((d / "qtk.json").read_text())["stats"]["algorithm"]


@pytest.mark.parametrize("weights", [INT4_G32, INT4_G32_ASYM, INT8_CHANNEL, NVFP4, MXFP4])
def test_the_checkpoint_is_an_ordinary_one_that_reloads_as_simulated(tiny_llama, calib_file, tmp_path, weights):
    """The vllm checkpoint reloads in transformers + compressed-tensors equal to qtk's simulation, passes inspect,
    holds codes other than round-to-nearest's (the learned rounding is what is stored) and records each layer's
    losses in qtk.json."""
    p = tmp_path / "ar.yaml"
    p.write_text(recipe_text(weights))
    d, recs = convert_reload_as_simulated(tiny_llama, calib_file, p, tmp_path / "o")
    for layer in ("0", "1"):
        r = recs[layer]["autoround"]
        assert r["iters"] == 30 and r["best_loss"] <= r["initial_loss"] and 0 <= r["best_iter"] < 30
    p.write_text(recipe_text(weights).replace("  - autoround: {iters: 30}", "  - rtn"))
    plain = api.convert(tiny_llama, str(p), tmp_path / "rtn", hash_source=False).outputs["vllm"]
    ours, theirs = open_checkpoint(d), open_checkpoint(plain)
    name = "model.layers.0.mlp.down_proj"
    assert not torch.equal(ours.qtensor(name).values, theirs.qtensor(name).values)
    if "int" in weights and "symmetric: true" in weights:  # the full-range grid: negative scales on disk, decoded as q · s
        assert (ours.qtensor(name).scale < 0).any() and (ours.qtensor(name).scale > 0).any()


@pytest.mark.parametrize("weights,needle", [
    ("{num_bits: 8, type: float, strategy: channel}", "autoround learns int weights"),
    ("{num_bits: 8, type: int, symmetric: true, strategy: tensor}", "autoround learns int weights"),
])
def test_a_scheme_it_cannot_learn_is_refused_before_any_work(tiny_llama, tmp_path, weights, needle):
    p = tmp_path / "ar.yaml"
    text = recipe_text(weights)
    p.write_text(text)
    r = CliRunner().invoke(main, ["convert", str(tiny_llama), "--recipe", str(p), "-o", str(tmp_path / "o")],
                           prog_name="qtk")
    lines = message_lines(r.output)
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert needle in lines[0] and "w4a16-autoround or nvfp4-autoround as a template" in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("params,needle", [
    ("{iters: 0}", "iters: must be in 1..100000"), ("{lr: -0.5}", "lr: must be in [0, 1]"),
    ("{minmax_lr: 2.0}", "minmax_lr: must be in [0, 1]"), ("{iter: 10}", "did you mean 'iters'"),
    ("{iters: ten}", "expected int"), ("{target: float}", "target: must be model or layer"),
    ("{smooth: true, smooth_lr: 3}", "smooth_lr: must be in [0, 1]"), ("{keep: best}", "keep: must be batch or all"),
])
def test_bad_parameters_are_refused_in_one_line(tiny_llama, tmp_path, params, needle):
    p = tmp_path / "ar.yaml"
    p.write_text(recipe_text(INT4_G32).replace("{iters: 30}", params))
    r = CliRunner().invoke(main, ["convert", str(tiny_llama), "--recipe", str(p), "-o", str(tmp_path / "o")],
                           prog_name="qtk")
    lines = message_lines(r.output)
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output
    assert not (tmp_path / "o").exists()


def test_it_is_listed_as_a_solver_of_its_own():
    """A recipe lists one solver: autoround with gptq (or awq) is refused, naming autoround among the solvers."""
    from qtk.errors import UsageError

    doc = yaml.safe_load(recipe_text(INT4_G32))
    doc["algorithm"] = ["gptq", "autoround"]
    with pytest.raises(UsageError, match="exactly one of rtn, gptq, awq, autoround"):
        parse_recipe(doc, "", "r.yaml")
    assert AutoRoundParams().step_lr == 1 / 200 and AutoRoundParams(iters=50).clip_lr == 1 / 50
    assert AutoRoundParams(lr=0.01, minmax_lr=0.002).clip_lr == 0.002


def test_resume_after_a_kill_gives_the_same_bytes(calib_file, tmp_path):
    model = make_tiny_model(tmp_path / "m", layers=5, hidden=128, intermediate=256)
    p = tmp_path / "ar.yaml"
    p.write_text(recipe_text(INT4_G32, iters=40))
    exe = os.path.join(os.path.dirname(sys.executable), "qtk")

    def cmd(out, *extra):
        return [exe, "convert", str(model), "--recipe", str(p), "-o", str(out), "--calib", str(calib_file),
                "--num-samples", "8", "--seq-len", "64", "--no-hash", *extra]

    subprocess.run(cmd(tmp_path / "ref"), check=True, capture_output=True)
    out = tmp_path / "out"
    proc = subprocess.Popen(cmd(out, "--resume"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    state = out / ".qtk-resume"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(list(state.glob("layer-*"))) < 2:
        time.sleep(0.01)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    done = len(list(state.glob("layer-*")))
    assert 1 <= done < 5
    r = subprocess.run(cmd(out, "--resume"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"resumed at layer {done} of 5" in r.stderr

    def files(d):
        got = {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.name not in ("qtk.json", "README.md")}
        m = json.loads((d / "qtk.json").read_text())
        return got, m["stats"]["algorithm"]

    assert files(out / "vllm") == files(tmp_path / "ref" / "vllm")


def test_qtk_tune_refuses_an_autoround_candidate_rather_than_dropping_its_solver():
    """qtk tune's mixed recipe is solved by rtn or gptq: an autoround candidate would silently lose its solver."""
    from qtk.errors import UsageError
    from qtk.tune.search import load_candidates

    with pytest.raises(UsageError) as e:
        load_candidates(["w4a16-autoround", "w8a16", "bf16"])
    assert str(e.value) == ("candidate w4a16-autoround is solved by autoround; qtk tune mixes schemes solved by rtn or "
                            "gptq — drop w4a16-autoround from --candidates or use its rtn/gptq variant (e.g. w4a16-gptq)")
    assert e.value.exit_code == 2


def test_the_loop_carries_the_float_models_own_hidden_states(tmp_path):
    """With AutoRound's default target the loop hands each layer the float model's hidden states beside the quantized
    model's: after every layer they are transformers' own hidden states of the unquantized model, while the other
    stream has moved away from them (the quantized layers' outputs). Without the float stream (target: layer, or
    another solver) none is carried."""
    from transformers import AutoModelForCausalLM

    from qtk.pipeline import run

    model_dir = make_tiny_model(tmp_path / "m", layers=4, hidden=128, intermediate=256, dtype=torch.float32)
    src = ModelSource(model_dir)
    ids = torch.randint(3, 90, (4, 24), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states  # embeddings, then each layer's (the last normed)
    sink = ResumeSink()
    run(src, parse_recipe(yaml.safe_load(recipe_text(INT4_G32, iters=4)), "", "ar"), ids, [sink], batch_size=2,
        resume=sink)
    assert len(sink.floats) == 4
    for i in range(3):
        floats, quantized = torch.cat(sink.floats[i]), torch.cat(sink.hidden[i])
        torch.testing.assert_close(floats, want[i + 1], rtol=1e-4, atol=1e-5)
        assert (quantized - want[i + 1]).abs().max() > 1e-3, i
    for text in (recipe_text(INT4_G32, iters=2).replace("{iters: 2}", "{iters: 2, target: layer}"),
                 recipe_text(INT4_G32).replace("autoround: {iters: 30}", "gptq: {}")):
        sink = ResumeSink()
        run(src, parse_recipe(yaml.safe_load(text), "", "x"), ids, [sink], batch_size=2, resume=sink)
        assert sink.floats == [None] * 4 and all(h is not None for h in sink.hidden[:3])


@pytest.mark.parametrize("target,weights", [("model", INT4_G32), ("layer", INT4_G32), ("model", NVFP4_W4A4),
                                            ("model", INT4_W4A8)])
def test_the_first_loss_is_round_to_nearest_against_the_chosen_target(fp32_model, target, weights):
    """The loss AutoRound starts from (no offset, full ranges: round-to-nearest) is measured against the float model's
    stream the loop hands it (target: model) or against the layer's own float outputs on its inputs (target: layer):
    given quantized inputs and a float stream that differ, the first loss is the MSE to the one asked for. With
    quantized activations (W4A4, W4A8) it is round-to-nearest's layer as the engine runs it, inputs quantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fp32_model), dtype=torch.float32).eval()
    source = ModelSource(fp32_model)
    recipe = parse_recipe(yaml.safe_load(recipe_text(weights)), "", "ar")
    i, layer = 1, model.model.layers[1]
    g = torch.Generator().manual_seed(4)
    batches = [(h + 0.05 * torch.randn(h.shape, generator=g), kw) for h, kw in layer_batches(model, IDS)[i]]
    with torch.no_grad():
        stream = [_out(layer(h, **kw)) + 0.1 for h, kw in batches]  # not the layer's outputs on these inputs
        own = [_out(layer(h, **kw)) for h, kw in batches]
    rtn_out, _, _ = solved_outputs(layer, i, source, recipe, batches, rtn.run, RTNParams())

    params = AutoRoundParams(iters=1, target=target, full_range=False)  # its starting point is then RTN's
    ctx = LayerContext(i, source.layer_prefix(i), copy.deepcopy(layer), source.arch.at(i), recipe,
                       list(source.arch.at(i).linears), batches, torch.float32)
    ctx.float_outputs = stream
    ctx.amax = input_amax(layer, ctx.targets, batches)
    record = autoround.run(ctx, params)
    j = autoround.batch_order(len(batches), 1, params.seed + i)[0]
    ref = (stream if target == "model" else own)[j]
    other = (own if target == "model" else stream)[j]
    assert record.initial_loss == pytest.approx(float((rtn_out[j] - ref).pow(2).mean()), rel=1e-4)
    assert abs(record.initial_loss - float((rtn_out[j] - other).pow(2).mean())) > 1e-3


def outlier_model(fp32_model, factor: float = 40.0):
    """The float model with 4 channels of each norm's output made `factor` times larger and the Linears reading them
    divided by it: the same function, with activation outliers as real LLMs have; and those channels
    ({(layer, norm): indices})."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fp32_model), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    outliers = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for norm, nexts in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
                f = torch.ones(128)
                outliers[i, norm] = torch.randperm(128, generator=g)[:4]
                f[outliers[i, norm]] = factor
                layer.get_submodule(norm).weight.mul_(f)
                for n in nexts:
                    layer.get_submodule(n).weight.div_(f)
    return model, outliers


def test_learned_smoothing_moves_activation_outliers_into_the_weights(fp32_model):
    """NVFP4 W4A4 on layers whose inputs have outlier channels: AutoRound with `smooth` ends far below AutoRound alone
    (the scales learned through the activations' rounding error shrink the outlier groups' maxima): every outlier
    channel's scale grows well past the others'."""
    model, outliers = outlier_model(fp32_model)
    source = ModelSource(fp32_model)
    recipe = parse_recipe(yaml.safe_load(recipe_text(NVFP4_W4A4)), "", "ar")
    inputs = layer_batches(model, torch.randint(3, 90, (6, 48), generator=torch.Generator().manual_seed(1)))
    for i, layer in enumerate(model.model.layers):
        batches = inputs[i]
        with torch.no_grad():
            ref = [_out(layer(h, **kw)) for h, kw in batches]

        def mse(outs):
            return sum(float((a - b).pow(2).mean()) for a, b in zip(outs, ref)) / len(ref)

        plain, _, _ = solved_outputs(layer, i, source, recipe, batches, autoround.run, AutoRoundParams(iters=40))
        smooth, _, rec = solved_outputs(layer, i, source, recipe, batches, autoround.run,
                                        AutoRoundParams(iters=40, smooth=True, smooth_lr=0.05))
        assert mse(smooth) < 0.5 * mse(plain), (i, mse(smooth), mse(plain))
        assert set(rec.scales) == {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}  # v -> o: GQA
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sc = torch.tensor(rec.scales[norm])
            rest = torch.ones(128, dtype=torch.bool)
            rest[outliers[i, norm]] = False
            assert sc[outliers[i, norm]].min() > 2 * sc[rest].median(), (i, norm, sc[outliers[i, norm]])


def test_keep_all_keeps_the_lower_loss_over_every_batch(fp32_model):
    """keep: all: of the lowest single-batch loss's parameters and the last step's, the ones kept have the lower loss
    over every calibration batch, which the record holds: measured here on the engine's view of the solved layer, it
    is the recorded loss and never above what keep: batch (the same run, auto-round's choice) leaves; where the last
    step's parameters win, the record says so (best_iter = iters) and the two choices differ."""
    model, _ = outlier_model(fp32_model)
    source = ModelSource(fp32_model)
    recipe = parse_recipe(yaml.safe_load(recipe_text(NVFP4_W4A4)), "", "ar")
    inputs = layer_batches(model, torch.randint(3, 90, (6, 48), generator=torch.Generator().manual_seed(1)))
    last_won = 0
    for i, layer in enumerate(model.model.layers):
        with torch.no_grad():
            ref = [_out(layer(h, **kw)) for h, kw in inputs[i]]

        def loss(outs):
            return sum(float((a - b).pow(2).mean()) for a, b in zip(outs, ref)) / len(ref)

        params = dict(iters=12)
        by_batch, _, rec_b = solved_outputs(layer, i, source, recipe, inputs[i], autoround.run,
                                            AutoRoundParams(**params))
        by_all, _, rec_a = solved_outputs(layer, i, source, recipe, inputs[i], autoround.run,
                                          AutoRoundParams(keep="all", **params))
        assert rec_b.kept_loss == 0 and "kept_loss" not in rec_b.to_json()
        assert rec_a.kept_loss == pytest.approx(loss(by_all), rel=1e-3)
        assert loss(by_all) <= loss(by_batch) * (1 + 1e-4), (i, loss(by_all), loss(by_batch))
        if rec_a.best_iter == 12:
            last_won += 1
            assert loss(by_all) < loss(by_batch)
        else:
            assert rec_a.best_iter == rec_b.best_iter and loss(by_all) == pytest.approx(loss(by_batch), rel=1e-5)
        assert autoround.AutoRoundRecord.from_json(json.loads(json.dumps(rec_a.to_json()))) == rec_a
    assert last_won  # the case keep: all exists for


def test_learned_smoothing_is_folded_as_recorded(fp32_model):
    """After the step, the layer holds the scales folded in: its float function is the source layer's; each quantized
    Linear's weight is the source's put through the record's frame (what the loop and `qtk inspect` measure errors
    against); the QTensors are the folded weights' (not the source's); and the static input ranges are the folded
    layer's, re-observed (they differ from the ones OBSERVE measured before the scales)."""
    model, _ = outlier_model(fp32_model)
    source = ModelSource(fp32_model)
    recipe = parse_recipe(yaml.safe_load(recipe_text(NVFP4_W4A4)), "", "ar")
    i, layer = 0, model.model.layers[0]
    batches = layer_batches(model, IDS)[i]
    arch = source.arch.at(i)
    ctx = LayerContext(i, source.layer_prefix(i), copy.deepcopy(layer), arch, recipe, list(arch.linears), batches,
                       torch.float32)
    with torch.no_grad():
        ctx.float_outputs = [_out(layer(h, **kw)) for h, kw in batches]
    before = input_amax(layer, ctx.targets, batches)
    ctx.amax = dict(before)
    rec = autoround.run(ctx, AutoRoundParams(iters=20, smooth=True, smooth_lr=0.05))
    with torch.no_grad():
        for (h, kw), want in zip(batches, ctx.float_outputs):
            torch.testing.assert_close(_out(ctx.layer(h, **kw)), want, rtol=1e-4, atol=1e-4)
    back = autoround.AutoRoundRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back.scales == rec.scales
    for t in ctx.targets:
        folded = ctx.layer.get_submodule(t).weight.detach()
        framed = back.reframe(layer.get_submodule(t).weight.detach(), t, arch)
        torch.testing.assert_close(framed, folded, rtol=1e-5, atol=1e-6)
        source_w = layer.get_submodule(t).weight.detach()
        if t != "self_attn.o_proj":  # v -> o is no pair under GQA: o_proj keeps the source's weight
            deq = ctx.qweights[t].dequantize()
            assert (deq - folded).norm() < (deq - source_w).norm(), t
    assert ctx.amax == pytest.approx(input_amax(ctx.layer, ctx.targets, batches), rel=1e-6)
    assert any(abs(ctx.amax[t] - before[t]) > 1e-3 * before[t] for t in ctx.targets)


def test_a_smoothed_w4a4_checkpoint_reloads_as_simulated_and_passes_inspect(tiny_llama, calib_file, tmp_path):
    """[awq, autoround {smooth}] end to end: NVFP4 W4A4 written for vLLM reloads in transformers + compressed-tensors
    as qtk simulates it, `qtk inspect` rebuilds every weight's frame from both steps' records (AWQ's scales, then the
    learned ones) within the format's bound and the recorded errors, and each layer's record holds the learned
    scales."""
    p = tmp_path / "ar.yaml"
    p.write_text(recipe_text(NVFP4_W4A4).replace("  - autoround: {iters: 30}",
                                                 "  - awq\n  - autoround: {iters: 12, smooth: true, smooth_lr: 0.05}"))
    _, recs = convert_reload_as_simulated(tiny_llama, calib_file, p, tmp_path / "o")
    for layer in ("0", "1"):
        s = recs[layer]["autoround"]["s"]
        assert set(s) >= {"input_layernorm", "post_attention_layernorm"} and any(
            abs(x - 1) > 1e-3 for v in s.values() for x in v), s
