"""--device (issue 13): parsed and refused up front; the device code paths (layer prefetch, write-behind, activations spilled to
host memory over a budget) run on the CPU in CI and write the very bytes of the plain loop; CUDA runs where a GPU is
visible (skipped otherwise)."""

import threading

import pytest
import torch

from models import make_tiny_model
from qtk import api
from qtk.errors import UsageError
from qtk.pipeline import device as dev

NO_GPU = not torch.cuda.is_available()


def test_parse_device():
    assert dev.parse_device("cpu") == torch.device("cpu")
    assert dev.parse_device(None) == torch.device("cpu")
    assert dev.parse_device("auto") == (torch.device("cuda", 0) if not NO_GPU else torch.device("cpu"))
    with pytest.raises(UsageError, match="not a device"):
        dev.parse_device("gpu0")
    with pytest.raises(UsageError, match="not a device"):
        dev.parse_device("cuda:x")


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
def test_cuda_without_a_gpu_is_refused_before_any_work(tiny_llama, tmp_path):
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(UsageError, match="asks for a GPU but torch sees none") as e:
            api.convert(tiny_llama, "w8a16", tmp_path / "o", device=spec)
        assert "--device cpu" in e.value.fix
    assert not (tmp_path / "o").exists()


def test_negative_device_memory_is_refused(tiny_llama, tmp_path):
    with pytest.raises(UsageError, match="--max-device-memory must be >= 0"):
        api.convert(tiny_llama, "w8a16", tmp_path / "o", max_device_memory=-1)


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name not in ("qtk.json", "README.md")}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("dev") / "m", layers=3, hidden=128, intermediate=256)


@pytest.mark.parametrize("recipe", ["int8-kv8", "w8a16"])
def test_prefetch_write_behind_and_spill_write_the_same_bytes(recipe, model, calib_file, tmp_path, monkeypatch):
    """The overlapped loop (layer i+1 read and layer i written in background threads) with every calibration batch
    over a zero budget (kept in host memory, brought back per use) writes byte-identical files to the plain loop."""
    from qtk.pipeline import loop

    opts = dict(calib=str(calib_file), num_samples=4, seq_len=16, batch_size=2, hash_source=False)
    from qtk.convert import ConvertJob, ConvertOptions
    from qtk.recipe import load_recipe

    ConvertJob(model, load_recipe(recipe), tmp_path / "plain", ConvertOptions(overlap=False, **opts)).run()

    threads, spilled, real_write, real_host = set(), [], loop.WriteBehind._write, dev._to_host
    monkeypatch.setattr(loop.WriteBehind, "_write",
                        lambda self, r, h: (threads.add(threading.current_thread().name), real_write(self, r, h))[1])
    monkeypatch.setattr(dev, "_to_host", lambda h, d: (spilled.append(h.shape), real_host(h, d))[1])
    api.convert(model, recipe, tmp_path / "overlap", device="cpu", max_device_memory=0, **opts)
    assert _files(tmp_path / "overlap" / "vllm") == _files(tmp_path / "plain" / "vllm")
    assert threads and all(t.startswith("qtk-write") for t in threads)
    if load_recipe(recipe).needs_calibration:
        assert spilled  # every batch went to host memory and back
    else:
        assert not spilled


def test_activations_keep_the_first_batches_on_the_device_within_the_budget():
    h = [torch.randn(2, 4, 8) for _ in range(3)]  # 256 bytes each
    acts = dev.Activations([(x, {}) for x in h], torch.device("cpu"), budget=600)
    assert acts.on_host == {2} and acts.spilled == 1 and len(acts) == 3
    for (a, _), b in zip(acts, h):
        assert torch.equal(a, b)
    assert dev.Activations([(x, {}) for x in h], torch.device("cpu"), budget=None).spilled == 0


@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
def test_cuda_conversion_matches_the_cpu_one(model, calib_file, tmp_path):
    """On a GPU: codes agree with the CPU run's up to matmul reassociation, spill included."""
    from qtk.export import open_checkpoint

    opts = dict(calib=str(calib_file), num_samples=4, seq_len=16, batch_size=2, hash_source=False)
    api.convert(model, "w4a16-gptq", tmp_path / "cpu", device="cpu", **opts)
    api.convert(model, "w4a16-gptq", tmp_path / "gpu", device="cuda", max_device_memory=1, **opts)
    a, b = open_checkpoint(tmp_path / "cpu" / "vllm"), open_checkpoint(tmp_path / "gpu" / "vllm")
    same = sum((a.qtensor(m).values == b.qtensor(m).values).sum().item() for m in a.modules())
    total = sum(a.qtensor(m).values.numel() for m in a.modules())
    assert same / total >= 0.99
