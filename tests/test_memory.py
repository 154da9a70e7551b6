"""Peak memory is O(one layer): converting 16 layers costs about what converting 2 layers costs."""

import os
import sys

import pytest

from models import make_tiny_model, run_measured

WIDTH = dict(hidden=512, intermediate=1536, heads=8, kv_heads=4)


def layer_bytes(hidden, intermediate, heads, kv_heads, **_) -> int:
    kv = hidden // heads * kv_heads
    return 2 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate)  # bf16


def peak_rss_of_convert(model, out, recipe, calib) -> int:
    """Peak RSS (bytes) of a separate `qtk convert` process (see models.run_measured for how it is measured)."""
    exe = os.path.join(os.path.dirname(sys.executable), "qtk")
    _, peak = run_measured([exe, "convert", str(model), "--recipe", recipe, "-o", str(out), "--num-samples", "8",
                            "--seq-len", "64", "--calib", str(calib), "--no-hash"])
    return peak


@pytest.mark.parametrize("recipe", ["int8-kv8"])
def test_peak_rss_does_not_grow_with_layers(tmp_path, calib_file, recipe):
    small = make_tiny_model(tmp_path / "l2", layers=2, **WIDTH)
    big = make_tiny_model(tmp_path / "l16", layers=16, **WIDTH)
    r2 = peak_rss_of_convert(small, tmp_path / "o2", recipe, calib_file)
    r16 = peak_rss_of_convert(big, tmp_path / "o16", recipe, calib_file)
    extra = 14 * layer_bytes(**WIDTH)
    print(f"peak RSS 2 layers {r2 / 2**20:.0f} MiB, 16 layers {r16 / 2**20:.0f} MiB, 14 layers of bf16 weights {extra / 2**20:.0f} MiB")
    assert r16 - r2 < 0.25 * extra
