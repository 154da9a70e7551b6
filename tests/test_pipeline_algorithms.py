"""The calibration algorithms inside the layer loop: GPTQ and AWQ beat RTN end to end, SmoothQuant is
folded into what is stored, and the searched records land in the manifest."""

import json

import pytest
import torch

from models import write_calib
from qtk import api
from qtk.calib import calibration_ids, load_texts
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("alg")
    calib = write_calib(d / "calib.jsonl", n=60, seed=1)
    held = write_calib(d / "held.jsonl", n=20, seed=2)
    ids = calibration_ids(AutoTokenizer.from_pretrained(str(tiny_llama)), load_texts(str(held)), 8, 64, 5)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = base(ids).logits.log_softmax(-1)
    return d, calib, ids, ref


def _kl(tiny_llama, setup, recipe, tag):
    d, calib, ids, ref = setup
    res = api.convert(tiny_llama, recipe, d / tag, calib=str(calib), num_samples=16, seq_len=64, hash_source=False)
    m = build_simulated_model(open_checkpoint(res.outputs["vllm"]), simulate_kv=False)
    with torch.no_grad():
        lq = m(ids).logits.log_softmax(-1)
    return float((ref.exp() * (ref - lq)).sum(-1).mean()), res


def test_gptq_and_awq_beat_rtn_at_4_bits(tiny_llama, setup):
    rtn, _ = _kl(tiny_llama, setup, "w4a16", "rtn")
    gptq, res = _kl(tiny_llama, setup, "w4a16-gptq", "gptq")
    awq, res_awq = _kl(tiny_llama, setup, "w4a16-awq", "awq")
    print(f"KL to bf16: rtn {rtn:.4f} gptq {gptq:.4f} awq {awq:.4f}")
    assert gptq < 0.5 * rtn
    assert awq < rtn
    man = json.loads((res.outputs["vllm"] / "qtk.json").read_text())
    info = man["stats"]["algorithm"]["0"]["gptq"]
    assert set(info) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert all(v["retries"] == 0 and v["loss"] > 0 for v in info.values())
    ck = open_checkpoint(res_awq.outputs["vllm"])
    qt = ck.qtensor("model.layers.0.mlp.down_proj")
    assert qt.zero_point is not None and qt.scale.shape == (128, 2)  # asymmetric int4 g128


def test_gptq_int8_beats_rtn_int8(tiny_llama, setup):
    rtn, _ = _kl(tiny_llama, setup, "w8a16", "r8")
    gptq, _ = _kl(tiny_llama, setup, "w8a16-gptq", "g8")
    assert gptq < rtn


def test_full_range_gptq_is_an_ordinary_checkpoint_with_negative_scales(tiny_llama, setup, tmp_path):
    """gptq: {full_range: true} end to end: the vllm checkpoint stores negative scales beside positive ones, passes
    inspect, reloads in transformers + compressed-tensors equal to qtk's simulation, and keeps GPTQ's gain over RTN."""
    p = _recipe_file(tmp_path, "w4a16-gptq", _gptq_full_range)
    rtn, _ = _kl(tiny_llama, setup, "w4a16", "rtn-fr")
    kl, res = _kl(tiny_llama, setup, p, "gptq-fr")
    assert kl < 0.5 * rtn
    d = res.outputs["vllm"]
    scale = open_checkpoint(d).qtensor("model.layers.0.mlp.down_proj").scale
    assert (scale < 0).any() and (scale > 0).any()
    assert api.inspect(d).ok
    _assert_reloads_as_simulated(d, setup[2])


def _assert_reloads_as_simulated(d, ids) -> None:
    """The checkpoint in d, decompressed by transformers + compressed-tensors, gives qtk's simulated logits."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    sim = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)
    with torch.no_grad():
        assert (ref(ids).logits - sim(ids).logits).abs().max().item() <= 1e-3


def _gptq_full_range(doc) -> None:
    doc["algorithm"] = [{"gptq": {**s["gptq"], "full_range": True}} if isinstance(s, dict) and "gptq" in s else s
                        for s in doc["algorithm"]]


def _recipe_file(tmp_path, name: str, edit) -> str:
    """A built-in recipe with `edit` applied to its document, as a file."""
    import yaml

    from qtk.recipe import builtin_recipes

    doc = yaml.safe_load(builtin_recipes()[name].read_text())
    edit(doc)
    p = tmp_path / f"{name}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def test_full_range_observer_rounds_to_nearest_on_the_full_range_grid(tiny_llama, setup, tmp_path):
    """weights: {observer: full_range} on the data-free w4a16 recipe: every stored scale is the full-range one of the
    source weight's group (amax / 8, signed toward the larger extreme), so the native min-max kernel was not taken;
    the checkpoint passes inspect, reloads in transformers + compressed-tensors equal to the simulation, and is closer
    to the float model than compressed-tensors' amax / 7.5 grid."""
    from safetensors.torch import load_file

    from qtk.quant.formats import format_for

    recipe = _recipe_file(tmp_path, "w4a16", lambda d: d["weights"].update(observer="full_range"))
    minmax, _ = _kl(tiny_llama, setup, "w4a16", "rtn-minmax")
    kl, res = _kl(tiny_llama, setup, recipe, "rtn-full-range")
    assert kl < minmax
    d = res.outputs["vllm"]
    ck = open_checkpoint(d)
    src = load_file(str(tiny_llama / "model.safetensors"))
    for m in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
        qt = ck.qtensor(m)
        w = src[f"{m}.weight"].float()
        wg = w.reshape(w.shape[0], -1, qt.scheme.group_size)
        want = format_for(qt.scheme).full_range_scale(wg.amin(-1), wg.amax(-1), qt.scheme, src[f"{m}.weight"].dtype)
        assert torch.equal(qt.scale.float(), want)
        assert (qt.scale < 0).any() and (qt.scale > 0).any()
    assert api.inspect(d).ok
    _assert_reloads_as_simulated(d, setup[2])


def test_gptq_full_range_is_the_full_range_observer(tiny_llama, setup, tmp_path):
    """gptq: {full_range: true} and weights: {observer: full_range} under GPTQ write the same codes and scales."""
    from safetensors.torch import load_file

    calib = dict(calib=str(setup[1]), num_samples=16, seq_len=64, hash_source=False)
    a = api.convert(tiny_llama, _recipe_file(tmp_path, "w4a16-gptq", _gptq_full_range), tmp_path / "out-a", **calib)
    observer = _recipe_file(tmp_path, "w4a16-gptq", lambda d: d["weights"].update(observer="full_range"))
    b = api.convert(tiny_llama, observer, tmp_path / "out-b", **calib)
    ta = load_file(str(a.outputs["vllm"] / "model.safetensors"))
    tb = load_file(str(b.outputs["vllm"] / "model.safetensors"))
    assert ta.keys() == tb.keys()
    assert any((t < 0).any() for k, t in ta.items() if k.endswith("weight_scale"))
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_awq_then_gptq_smooths_and_solves(tiny_llama, setup, tmp_path):
    """[awq, gptq]: AWQ's scales are folded into the stored norms and GPTQ rounds (its records, no round-to-nearest);
    the checkpoint reloads in transformers + compressed-tensors equal to the simulation and beats RTN."""
    from safetensors.torch import load_file
    recipe = _recipe_file(tmp_path, "w4a16-awq", lambda d: d.update(algorithm=["awq", "gptq"]))
    rtn, _ = _kl(tiny_llama, setup, "w4a16", "rtn-for-awq-gptq")
    kl, res = _kl(tiny_llama, setup, recipe, "awq-gptq")
    assert kl < rtn
    d = res.outputs["vllm"]
    man = json.loads((d / "qtk.json").read_text())
    steps = man["stats"]["algorithm"]["0"]
    assert "awq" in steps and "gptq" in steps and "rtn" not in steps
    src = load_file(str(tiny_llama / "model.safetensors"))
    out = load_file(str(d / "model.safetensors"))
    assert not torch.equal(src["model.layers.0.input_layernorm.weight"], out["model.layers.0.input_layernorm.weight"])
    _assert_reloads_as_simulated(d, setup[2])


def test_smoothquant_is_folded_into_the_stored_norms(tiny_llama, setup):
    from safetensors.torch import load_file

    _, res = _kl(tiny_llama, setup, "w8a8-sq", "sq")
    d = res.outputs["vllm"]
    src = load_file(str(tiny_llama / "model.safetensors"))
    out = load_file(str(d / "model.safetensors"))
    for norm in ("input_layernorm", "post_attention_layernorm"):
        n = f"model.layers.0.{norm}.weight"
        assert not torch.equal(src[n], out[n]), f"{norm} not smoothed"
    man = json.loads((d / "qtk.json").read_text())
    scales = man["stats"]["algorithm"]["0"]["smoothquant"]
    # GQA (2 KV heads of 4): v_proj -> o_proj does not chain, so three pairs are smoothed
    assert set(scales) == {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}


def test_post_conversion_checks_refuse_a_broken_quantizer(tiny_llama, tmp_path, monkeypatch):
    """A quantizer bug that collapses weights is caught at the end of convert: exit 1, nothing written."""
    import qtk.steps.rtn as rtn
    from qtk.errors import CheckFailed
    from qtk.quant.qtensor import QTensor

    real = rtn.rtn_weights

    def broken(weights, schemes, arch, dtype, measure=None, consume=False, threads=None):  # the stream measured the
        out = real(weights, schemes, arch, dtype, measure, consume, threads)  # good QTensor; the bytes on disk differ
        qt = out["mlp.down_proj"]
        out["mlp.down_proj"] = QTensor(torch.zeros_like(qt.values), qt.scale, qt.scheme, qt.zero_point, None, qt.dtype)
        return out

    monkeypatch.setattr(rtn, "rtn_weights", broken)
    with pytest.raises(CheckFailed) as e:
        api.convert(tiny_llama, "w8a16", tmp_path / "o", hash_source=False)
    assert e.value.exit_code == 1 and "mlp.down_proj" in str(e.value) and "collapsed" in str(e.value)
    assert not (tmp_path / "o").exists()
