"""Peak memory is O(one layer): converting 24 layers costs about what converting 4 layers costs."""

import os
import sys

import pytest

from models import make_tiny_model, run_measured

WIDTH = dict(hidden=512, intermediate=1536, heads=8, kv_heads=4)


def layer_bytes(hidden, intermediate, heads, kv_heads, **_) -> int:
    kv = hidden // heads * kv_heads
    return 2 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate)  # bf16


def peak_rss_of_convert(model, out, recipe, calib, samples: int = 8, seq_len: int = 64) -> int:
    """Peak RSS (bytes) of a separate `qtk convert` process (see models.run_measured for how it is measured)."""
    exe = os.path.join(os.path.dirname(sys.executable), "qtk")
    _, peak = run_measured([exe, "convert", str(model), "--recipe", recipe, "-o", str(out), "--num-samples", str(samples),
                            "--seq-len", str(seq_len), "--calib", str(calib), "--no-hash"])
    return peak


@pytest.mark.parametrize("recipe", ["int8-kv8"])
def test_peak_rss_does_not_grow_with_layers(tmp_path, calib_file, recipe):
    small = make_tiny_model(tmp_path / "l4", layers=4, **WIDTH)
    big = make_tiny_model(tmp_path / "l24", layers=24, **WIDTH)
    # the smaller of two runs each: a process's peak varies by about +-15 MiB from run to run
    r4 = min(peak_rss_of_convert(small, tmp_path / f"o4-{i}", recipe, calib_file) for i in range(2))
    r24 = min(peak_rss_of_convert(big, tmp_path / f"o24-{i}", recipe, calib_file) for i in range(2))
    extra = 20 * layer_bytes(**WIDTH)
    print(f"peak RSS 4 layers {r4 / 2**20:.0f} MiB, 24 layers {r24 / 2**20:.0f} MiB, 20 layers of bf16 weights {extra / 2**20:.0f} MiB")
    # A converter that kept the layers it has done (or read them all up front) would grow by at least the added
    # bf16 weights (120 MiB). What does grow is bounded: the in-layer peak creeps by ~20 MiB over the first dozen
    # layers (heap fragmentation; the RSS between layers stays flat at +-2 MiB) and then stays put.
    assert r24 - r4 < 0.5 * extra


MOE = dict(hidden=512, intermediate=512, heads=8, kv_heads=4, num_experts=16, num_experts_per_tok=4,
           moe_intermediate_size=512)


def test_calibrated_moe_peak_does_not_grow_with_layers(tmp_path, calib_file):
    """Every MoE expert's Linears see their own row count per batch, so bf16 GEMMs create a oneDNN primitive per
    expert, batch and layer; with the libraries' default caches (1024 entries each, about 1 MB an entry) the peak grew
    by ~30 MiB a layer (qtk.pipeline.memory.bound_kernel_caches keeps 16)."""
    small = make_tiny_model(tmp_path / "m2", model_type="qwen3_moe", layers=2, **MOE)
    big = make_tiny_model(tmp_path / "m8", model_type="qwen3_moe", layers=8, **MOE)
    # two batches of 8 x 128 tokens: each expert's row count differs per batch and layer, as in a real calibration
    r2, r8 = (min(peak_rss_of_convert(m, tmp_path / f"o-{m.name}-{i}", "w4a16-gptq", calib_file, 16, 128) for i in range(2))
              for m in (small, big))
    layer = 2 * (16 * 3 * 512 * 512 + 2 * 512 * 512 + 2 * 512 * 256)  # bf16: experts, q/o, k/v
    print(f"peak RSS 2 layers {r2 / 2**20:.0f} MiB, 8 layers {r8 / 2**20:.0f} MiB, one bf16 layer {layer / 2**20:.0f} MiB")
    # six more layers may cost the in-layer creep of the dense test (~20 MiB), not a layer's worth each
    assert r8 - r2 < 2 * layer


def test_kernel_cache_bounds_stay_out_of_the_engine(monkeypatch):
    """The calibration loop bounds oneDNN's GEMM caches for this process; vLLM's worker, started later by the same
    process, gets the libraries' defaults back, while a capacity the user set reaches it unchanged."""
    from qtk.eval.vllm_process import worker_env
    from qtk.pipeline.memory import KERNEL_CACHES_SET_BY, bound_kernel_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")  # the user's
    monkeypatch.delenv(KERNEL_CACHES_SET_BY, raising=False)
    bound_kernel_caches()
    import os

    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16" and os.environ["LRU_CACHE_CAPACITY"] == "64"
    e = worker_env({"X": "1"})
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in e and e["LRU_CACHE_CAPACITY"] == "64" and e["X"] == "1"
    assert KERNEL_CACHES_SET_BY not in e
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
