"""Where qtk's native kernels cannot be built (no C compiler: slim containers), the run goes on in torch and says so
once, at warning level, with what it costs; turning them off on purpose (QTK_NATIVE=0) says nothing."""

import logging

import pytest

import qtk.quant.native as native


def test_no_compiler_is_one_warning_that_names_the_cost(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv("QTK_NATIVE", "1")
    monkeypatch.setenv("CC", "qtk-no-such-compiler")
    with caplog.at_level(logging.INFO, logger="qtk"):
        assert native.library() is None
        assert native.library() is None  # asked again: the same answer, no second line
    lines = [r for r in caplog.records if r.name.startswith("qtk.quant.native")]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    msg = lines[0].getMessage()
    assert "no C compiler (qtk-no-such-compiler)" in msg and "several times slower" in msg and "QTK_NATIVE=0" in msg


def test_turned_off_on_purpose_says_nothing(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv("QTK_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="qtk"):
        assert native.library() is None
    assert not [r for r in caplog.records if r.name.startswith("qtk.quant.native")]
