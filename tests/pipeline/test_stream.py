"""Data-free recipes stream tensors layer by layer without materialising modules (qtk/pipeline/stream.py) and
write what the module loop writes, byte for byte."""

import pytest

from models import make_tiny_model
from qtk.model.source import ModelSource
from qtk.pipeline import run
from qtk.pipeline.stream import run_data_free, streams
from qtk.recipe import load_recipe


class Keep:
    def __init__(self):
        self.dense, self.layers = {}, []

    def add_dense(self, name, t):
        self.dense[name] = t

    def add_layer(self, r):
        self.layers.append(r)


def test_which_recipes_stream():
    assert streams(load_recipe("fp8-dynamic"), None) and streams(load_recipe("w8a16"), None)
    assert streams(load_recipe("w4a16"), None)
    assert not streams(load_recipe("w4a16-gptq"), None) and not streams(load_recipe("fp8"), None)
    assert not streams(load_recipe("fp8-kv8"), None)


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "w8a16", "w4a16"])
def test_stream_builds_the_module_loops_results_without_modules(recipe, tmp_path, monkeypatch):
    import torch

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    r = load_recipe(recipe)
    a, b = Keep(), Keep()
    run(ModelSource(model), r, None, [a])
    src = ModelSource(model)
    src.skeleton()
    monkeypatch.setattr(ModelSource, "load_module", lambda *a, **k: pytest.fail("a module was materialised"))
    stats = run_data_free(src, r, [b])
    assert stats.layers == 2
    assert list(a.dense) == list(b.dense) and all(torch.equal(a.dense[k], b.dense[k]) for k in a.dense)
    for x, y in zip(a.layers, b.layers):
        assert list(x.qweights) == list(y.qweights) and list(x.dense) == list(y.dense)
        for k, q in x.qweights.items():
            assert torch.equal(q.values, y.qweights[k].values) and torch.equal(q.scale, y.qweights[k].scale)
        for k, t in x.dense.items():
            assert t.dtype == y.dense[k].dtype and torch.equal(t, y.dense[k])
        assert x.weight_error == y.weight_error and x.dense_linears == y.dense_linears


def test_stream_refuses_a_nan_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    from qtk.errors import UsageError

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    sd = load_file(str(model / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match="model.layers.1.mlp.up_proj.weight contains NaN"):
        run_data_free(ModelSource(model), load_recipe("w8a16"), [Keep()])


def test_stream_holds_one_float32_copy_at_a_time_and_measures_for_the_self_check(tmp_path, monkeypatch):
    """The layer's weights reach rtn_weights in the model dtype (it makes each float32 copy where it rounds it, so a
    Llama-3-8B layer holds one 235 MB copy, not 872 MB of them); and every quantized Linear gets what the self-check
    needs (qtk.pipeline.result.Measured): its error as recorded, its QTensor's digest, its max |w|."""
    import torch

    from qtk.quant.qtensor import qtensor_digest
    from qtk.model.simulate import engine_weight
    from qtk.steps import rtn

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    seen, rtn_weights = [], rtn.rtn_weights

    def spy(weights, *a):
        seen.extend(w.dtype for w in weights.values())
        return rtn_weights(weights, *a)

    monkeypatch.setattr(rtn, "rtn_weights", spy)
    b = Keep()
    stats = run_data_free(ModelSource(model), load_recipe("w4a16"), [b])
    assert seen and set(seen) == {torch.bfloat16}
    qweights = {k: q for r in b.layers for k, q in r.qweights.items()}
    assert set(stats.measured) == set(qweights) == set(stats.weight_error)
    for k, q in qweights.items():
        m = stats.measured[k]
        assert m.error == stats.weight_error[k] and m.digest == qtensor_digest(q)
        assert m.amax == float(engine_weight(q).abs().max())
