"""Early write-back (qtk.io.atomic.WriteBack): what the writing thread has written goes to disk while the next layer
computes. The flush sees the files asked for (duplicated descriptors: a file closed meanwhile is still the one
flushed), a newer request replaces one not started, close() drops a waiting request and raises what a flush met."""

import errno
import os
import threading

import pytest

from qtk.io import atomic
from qtk.io.atomic import WriteBack


def _spy(monkeypatch, gate: threading.Event | None = None, fail: int | None = None):
    """Record the inode of every fdatasync'd descriptor; optionally hold the first call until `gate` is set, or
    fail every call with errno `fail`."""
    seen, started = [], threading.Event()

    def fdatasync(fd):
        seen.append(os.fstat(fd).st_ino)
        started.set()
        if gate is not None:
            gate.wait(10)
        if fail is not None:
            raise OSError(fail, os.strerror(fail))

    monkeypatch.setattr(atomic.os, "fdatasync", fdatasync)
    return seen, started


def test_a_request_flushes_the_files_even_once_closed(tmp_path, monkeypatch):
    gate = threading.Event()
    seen, started = _spy(monkeypatch, gate)
    a, b = open(tmp_path / "a", "w+b"), open(tmp_path / "b", "w+b")
    ino = {p: os.fstat(f.fileno()).st_ino for p, f in (("a", a), ("b", b))}
    wb = WriteBack()
    wb.request([a, b])
    assert started.wait(10)
    a.close()  # the writer closes a shard while its flush runs: the dup keeps it
    b.close()
    gate.set()
    wb.close()
    assert seen == [ino["a"], ino["b"]]
    assert not [p for p in os.listdir(f"/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{p}").startswith(str(tmp_path))]


def test_a_newer_request_replaces_a_waiting_one_and_close_drops_it(tmp_path, monkeypatch):
    gate = threading.Event()
    seen, started = _spy(monkeypatch, gate)
    files = [open(tmp_path / n, "w+b") for n in "abcd"]
    ino = [os.fstat(f.fileno()).st_ino for f in files]
    wb = WriteBack()
    wb.request([files[0]])
    assert started.wait(10)  # the first flush runs (held): the next requests wait
    wb.request([files[1]])
    wb.request([files[2]])  # replaces the request for b, not started
    gate.set()
    wb.close()
    assert seen[0] == ino[0] and ino[1] not in seen and seen.count(ino[2]) <= 1
    gate.clear()
    wb2 = WriteBack()
    seen.clear()
    started.clear()
    wb2.request([files[0]])
    assert started.wait(10)
    wb2.request([files[3]])
    threading.Timer(0.2, gate.set).start()
    wb2.close()  # waits for the flush in progress, drops the one waiting: the final fsync writes it back
    assert seen == [ino[0]]
    with pytest.raises(RuntimeError, match="closed"):
        wb2.request([files[0]])
    for f in files:
        f.close()


def test_a_flush_error_is_raised_at_close_once(tmp_path, monkeypatch):
    _, started = _spy(monkeypatch, fail=errno.EIO)
    with open(tmp_path / "a", "w+b") as f:
        wb = WriteBack()
        wb.request([f])
        assert started.wait(10)
        with pytest.raises(OSError) as e:
            wb.close()
    assert e.value.errno == errno.EIO
    wb.close()  # reported once


def test_the_stream_writes_layers_back_as_it_goes_and_a_disk_error_ends_it(tmp_path, monkeypatch):
    """The data-free stream asks for a write-back of the open shard after the passthrough tensors and after each
    layer (from its writing thread); the output is the same bytes as without; an ENOSPC met by an early flush ends
    the conversion with the disk-full error and no output."""
    from qtk.api import convert
    from qtk.errors import QtkError
    from models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", layers=3, hidden=128, intermediate=256)
    convert(model, "w8a16", tmp_path / "a")
    requests = []
    real = WriteBack.request
    monkeypatch.setattr(WriteBack, "request", lambda self, files: (requests.append(
        (threading.current_thread().name, [os.path.basename(f.name) for f in files])), real(self, files))[1])
    convert(model, "w8a16", tmp_path / "b")
    assert len(requests) == 1 + 3 and all(t.startswith("qtk-write") and n == [".model-shard-00000.tmp"] for t, n in requests)
    assert (tmp_path / "a/vllm/model.safetensors").read_bytes() == (tmp_path / "b/vllm/model.safetensors").read_bytes()
    _spy(monkeypatch, fail=errno.ENOSPC)
    with pytest.raises(QtkError, match="no space left"):
        convert(model, "w8a16", tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
