"""The device seam: a run's device reaches the layers read from disk, the layer-0 capture and the steps'
statistics, and what the sinks receive is on the host. On the CPU (the default) nothing changes."""

import torch

from qtk.calib import calibration_ids, load_texts
from qtk.model.source import ModelSource
from qtk.pipeline import run
from qtk.recipe import load_recipe


class Keep:
    def __init__(self):
        self.results = []

    def add_dense(self, name, t):
        pass

    def add_layer(self, r):
        self.results.append(r)


def test_modules_are_created_on_the_given_device(tiny_llama):
    src = ModelSource(tiny_llama)
    layer0 = src.skeleton().get_submodule(src.arch.layers)[0]
    mod = src.load_module(layer0, src.layer_prefix(0), torch.bfloat16, device="meta")
    assert {t.device.type for t in [*mod.parameters(), *mod.buffers()]} == {"meta"}
    mod = src.layer(src.skeleton(), 0, torch.bfloat16, device="cpu")
    assert {t.device.type for t in mod.parameters()} == {"cpu"}


def test_the_run_device_reaches_layers_capture_and_statistics(tiny_llama, calib_file, monkeypatch):
    import qtk.steps.smoothquant as sq
    import qtk.steps.stats as stats

    src = ModelSource(tiny_llama)
    ids = calibration_ids(src.tokenizer(), load_texts(str(calib_file)), 4, 32, 0)
    loads, accs = [], []
    real_load = ModelSource.load_module

    def load_module(self, module, prefix, dtype=torch.float32, check_finite=False, device=None):
        loads.append((prefix, device))
        return real_load(self, module, prefix, dtype, check_finite, device)

    class SpyChannelMax(stats.ChannelMax):
        def __init__(self, in_features, device=None):
            super().__init__(in_features, device)
            accs.append(self.amax.device)

    monkeypatch.setattr(ModelSource, "load_module", load_module)
    monkeypatch.setattr(sq, "ChannelMax", SpyChannelMax)
    recipe = load_recipe("int8-kv8")
    a, b = Keep(), Keep()
    run(src, recipe, ids, [a], batch_size=2)
    run(src, recipe, ids, [b], batch_size=2, device=torch.device("cpu"))
    assert [d for _, d in loads[:3]] == [torch.device("cpu")] * 3  # embeddings, layer 0, layer 1 (default: the CPU)
    assert {p for p, _ in loads} == {"model.embed_tokens.", "model.layers.0.", "model.layers.1."}
    assert set(accs) == {torch.device("cpu")}
    for ra, rb in zip(a.results, b.results):  # same bytes either way, all on the host
        for name, qt in ra.qweights.items():
            assert qt.values.device.type == "cpu" and torch.equal(qt.values, rb.qweights[name].values)
            assert torch.equal(qt.scale, rb.qweights[name].scale)
        assert ra.k_amax == rb.k_amax and ra.weight_error == rb.weight_error
