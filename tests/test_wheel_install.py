"""qtk installed from its wheel, as a user gets it from `pip install qtk`: built-in recipes and the default
calibration corpus are package data, and the commands work from any directory without the source tree.

The wheel goes into a fresh virtual environment whose only view of the development environment is a plain
path to its site-packages (torch and friends, not reinstalled). A plain path in a .pth file is appended to
sys.path without processing that directory's own .pth files, so the editable install of this checkout stays
inactive there: `qtk.__file__` must lie inside the new environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import qtk

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DATA = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "qtk" / "data").rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)


def _sh(*cmd, cwd: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (the checkout gets no build/ or *.egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / f, src / f)
    shutil.copytree(ROOT / "qtk", src / "qtk", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
            "-w", tmp / "dist", src, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    # setuptools warns on every build of a deprecated pyproject.toml (the license table) and, from a set date,
    # refuses to build it: the build must say nothing of the kind
    assert "deprecat" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("qtk-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "venv"
    r = _sh(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=tmp)
    assert r.returncode == 0, r.stderr
    py = env_dir / "bin" / "python"
    site = _sh(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp).stdout.strip()
    Path(site, "qtk-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    r = _sh(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    return env_dir


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def test_wheel_ships_recipes_and_corpus(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in PACKAGE_DATA if f not in names]
    assert not missing, f"package data left out of the wheel (pyproject.toml package-data): {missing}"
    assert any(f.startswith("qtk/data/recipes/") for f in PACKAGE_DATA) and "qtk/data/calib/default.jsonl" in PACKAGE_DATA
    assert "qtk/quant/native/kernels.c" in names  # the native kernels' source, built on first use


def test_one_source_of_truth():
    """Recipes and the corpus live only in the package: a second copy at the top level could drift from it."""
    for name in ("recipes", "calib_data"):
        p = ROOT / name
        assert not p.exists() or (p.is_symlink() and p.resolve() == (ROOT / "qtk" / "data" / p.name).resolve()), \
            f"{name}/ duplicates qtk/data/: keep one copy"
    from qtk.calib import DEFAULT_CORPUS
    from qtk.recipe import RECIPES_DIR

    assert RECIPES_DIR == ROOT / "qtk" / "data" / "recipes" and DEFAULT_CORPUS.parent == ROOT / "qtk" / "data" / "calib"


def test_installed_wheel_works_from_another_directory(venv, tmp_path):
    env, bin_ = _env(), venv / "bin"
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = _sh(bin_ / "python", "-c", "import qtk; print(qtk.__file__)", cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve().is_relative_to(venv.resolve()), f"qtk imported from {r.stdout.strip()}"

    r = _sh(bin_ / "qtk", "--version", cwd=work, env=env)
    assert r.returncode == 0 and r.stdout.strip() == f"qtk, version {qtk.__version__}", r.stdout + r.stderr

    r = _sh(bin_ / "qtk", "recipes", "list", cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    shipped = sorted(p.stem for p in (ROOT / "qtk" / "data" / "recipes").glob("*.yaml"))
    assert shipped and all(name in r.stdout for name in shipped), r.stdout

    # the default corpus (no --calib), read from the installed package
    r = _sh(bin_ / "qtk", "convert", ROOT / "examples" / "tiny-llama", "--recipe", "int8-kv8", "-o", "out",
            "--num-samples", "8", "--seq-len", "64", "--no-hash", cwd=work, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((work / "out" / "vllm" / "qtk.json").read_text())
    assert manifest["calibration"]["dataset"] == "default" and manifest["calibration"]["num_samples"] == 8
    assert manifest["versions"]["qtk"] == qtk.__version__

    r = _sh(bin_ / "qtk", "inspect", "out/vllm", cwd=work, env=env)
    assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout + r.stderr

    if shutil.which(os.environ.get("CC") or "cc"):  # the native kernels build from the installed package's source
        r = _sh(bin_ / "python", "-c", "import qtk.quant.native as n; print(n.library() is not None, n.SOURCE)", cwd=work,
                env={**env, "QTK_CACHE_DIR": str(tmp_path / "cache")})
        ok, src = r.stdout.split()
        assert ok == "True" and Path(src).resolve().is_relative_to(venv.resolve()), r.stdout + r.stderr
