"""The README's Python API example runs as written (so it cannot rot), and `qtk --version` is the package's."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from click.testing import CliRunner

import qtk
from qtk.cli import main

ROOT = Path(__file__).resolve().parent.parent


def readme_api_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_readme_api_example_runs(tmp_path, monkeypatch):
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the example's relative paths, from a scratch directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QTK_CACHE_DIR", str(tmp_path / "cache"))
    ns: dict = {}
    exec(compile(readme_api_example(), "README.md", "exec"), ns)
    assert ns["plan"].memory.fits
    assert ns["report"].ok and ns["checkpoint"] == Path("out/tiny-w4/vllm")
    assert (tmp_path / "out" / "tiny-w4" / "gptq" / "qtk.json").is_file()
    assert ns["gate"].passed and ns["gate"].exit_code == 0


def test_version():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0
    assert r.output.strip() == f"qtk, version {qtk.__version__}"
    assert importlib.metadata.version("qtk") == qtk.__version__  # pyproject reads the version from qtk/__init__.py


def test_readme_vllm_cpu_column_is_the_measured_table():
    """The recipe table's vLLM CPU column says what qtk.plan.serving.vllm_cpu_support says, which the engine tests
    (tests/engine/test_engine_matrix.py) hold to what the installed vLLM does."""
    from qtk.plan.serving import vllm_cpu_support
    from qtk.recipe import builtin_recipes, load_recipe

    text = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \|.*\| ([✓–]) \|$", text, re.M))
    assert set(rows) == set(builtin_recipes())
    for name, cell in rows.items():
        assert (cell == "✓") == vllm_cpu_support(load_recipe(name)).runs, name
