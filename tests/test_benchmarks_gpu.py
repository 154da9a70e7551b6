"""benchmarks/convert_gpu.py is prepared for one command on a GPU machine; its CPU-side logic (the 8B-shaped model
builder at a tiny shape, the qtk child process and its report, the summary rows) runs here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_convert_gpu_benchmark_runs_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "convert_gpu.py"), "--tiny", "--device", "cpu",
                    "--skip-llmc", "--recipes", "w4a16-gptq", "--json", str(out), "--workdir", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    (row,) = json.loads(out.read_text())
    assert row["tool"] == "qtk" and row["recipe"] == "w4a16-gptq"
    assert row["per_layer_s"] > 0 and row["extrapolated_32_layers_s"] > row["total_s"]
    assert row["peak_gpu_gib"] == 0 and row["peak_rss_gib"] > 0


def test_python_dash_m_qtk_is_the_cli():
    """torchrun starts `python -m qtk ...`."""
    r = subprocess.run([sys.executable, "-m", "qtk", "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.startswith("qtk")
