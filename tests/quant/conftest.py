"""Fixtures of the quant tests."""

import pytest

import qtk.quant.native as native


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """qtk's native kernels loaded afresh, built into a cache of the test's own (and forgotten again after it)."""
    monkeypatch.setenv("QTK_CACHE_DIR", str(tmp_path / "cache"))
    native.library.cache_clear()
    yield
    native.library.cache_clear()
