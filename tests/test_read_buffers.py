"""Read buffers reused from tensor to tensor (qtk.io.safetensors.ReadBuffers): a buffer goes back to the pool only
when no tensor or view of it is alive, tensors read into a reused buffer hold their own bytes, and at most
`max_idle` bytes wait in the pool."""

import errno
import gc
import os

import pytest
import torch
from safetensors.torch import save_file

from qtk.io.safetensors import ReadBuffers, SafetensorsFile, reusing_read_buffers


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone():
    pool = ReadBuffers(max_idle=1 << 20)
    a = pool.take(4096)
    ptr = a.data_ptr()
    view = a.view(torch.int32)[10:20]  # a view outliving its tensor keeps the buffer
    del a
    gc.collect()
    b = pool.take(4096)
    assert b.data_ptr() != ptr and pool.idle == 0
    del view
    gc.collect()
    assert pool.idle == 4096
    c = pool.take(4096)
    assert c.data_ptr() == ptr and pool.idle == 0
    d = pool.take(2048)  # another size: a new buffer
    assert d.data_ptr() not in (ptr, b.data_ptr())


def test_at_most_max_idle_bytes_wait_and_a_closed_pool_keeps_nothing():
    pool = ReadBuffers(max_idle=10_000)
    bufs = [pool.take(4000) for _ in range(3)]
    del bufs
    gc.collect()
    assert pool.idle == 8000  # the third did not fit
    pool.close()
    assert pool.idle == 0 and not pool.free
    e = pool.take(4000)
    del e
    gc.collect()
    assert pool.idle == 0


def test_tensors_read_into_reused_buffers_hold_their_own_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(64, 33, generator=g).to(torch.bfloat16) for i in range(4)}
    tensors["n"] = torch.randn(7, generator=g)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    with reusing_read_buffers(1 << 20) as pool:
        first = f.get_tensor("w0")
        ptr = first.data_ptr()
        assert torch.equal(first, tensors["w0"])
        kept = f.get_tensor("w1")  # alive: never handed out again while it lives
        del first
        gc.collect()
        for name in ("w2", "w3", "w0"):
            t = f.get_tensor(name)
            assert t.data_ptr() == ptr and torch.equal(t, tensors[name])  # every byte overwritten by the read
            assert t.data_ptr() != kept.data_ptr()
            del t
            gc.collect()
        assert torch.equal(kept, tensors["w1"]) and torch.equal(f.get_tensor("n"), tensors["n"])
    assert pool.closed
    outside = f.get_tensor("w0")  # outside the block: a fresh buffer each read
    assert torch.equal(outside, tensors["w0"])


def _mapped_ranges(path) -> int:
    """How many of this process's mappings are of `path` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(str(path)))


def test_mapped_reads_give_the_files_bytes_and_unmap_with_the_last_view(tmp_path):
    """Within mapped_reads, tensors and chunks are the file's bytes mapped (private: writing to one leaves the file
    as it was), at unaligned offsets and odd sizes, and each mapping goes when its last tensor or view dies."""
    import qtk.io.safetensors as st
    from qtk.io.safetensors import mapped_reads

    path = tmp_path / "t.safetensors"
    x = torch.randn(300, 77).to(torch.bfloat16)
    y = torch.arange(13, dtype=torch.int8)
    z = torch.randn(5, 3)
    save_file({"y": y, "x": x, "z": z}, str(path))
    raw = path.read_bytes()
    f = SafetensorsFile(path)
    assert _mapped_ranges(path) == 0
    with mapped_reads():
        got = {k: f.get_tensor(k) for k in ("x", "y", "z")}
        assert all(torch.equal(got[k], v) for k, v in (("x", x), ("y", y), ("z", z)))
        assert _mapped_ranges(path) == 3
        got["x"][0, 0] = 123.0  # private: the file is untouched
        chunks = [c.clone() for c in f.stored("x").chunks(1000)]
        assert torch.equal(torch.cat(chunks), x.reshape(-1))
    assert path.read_bytes() == raw
    view = got["x"][5:7]
    del got
    gc.collect()
    assert _mapped_ranges(path) == 1  # x's mapping, held by the view
    del view
    gc.collect()
    assert _mapped_ranges(path) == 0
    assert not st._mapped_reads  # off again outside the block: positioned reads


def test_map_tensor_maps_privately_reads_what_it_cannot_map_and_unmaps_with_the_last_view(tmp_path, monkeypatch):
    """map_tensor gives the file's bytes mapped (private: a write to the tensor leaves the file as it was), counted
    among the live mappings until the last view dies; a tensor whose bytes do not start at a multiple of its element
    size, or one past MAX_LIVE_MAPPINGS, is read instead, with the same values."""
    import qtk.io.safetensors as st
    from qtk.io.safetensors import save_file as qtk_save_file

    path = tmp_path / "t.safetensors"
    x = torch.randn(300, 77).to(torch.bfloat16)
    y = torch.arange(13, dtype=torch.int8)
    z = torch.randn(5, 3)
    qtk_save_file({"x": x, "y": y, "z": z}, path)  # in this order: z starts 13 bytes after y, at an odd offset
    f = SafetensorsFile(path)
    assert (f.data_start + f.entries["z"]["data_offsets"][0]) % 4  # the layout the test needs
    raw, live = path.read_bytes(), st._live_mappings
    reads = []
    get_tensor = SafetensorsFile.get_tensor
    monkeypatch.setattr(SafetensorsFile, "get_tensor", lambda self, name: (reads.append(name), get_tensor(self, name))[1])
    got = {k: f.map_tensor(k) for k in ("x", "y", "z")}
    assert all(torch.equal(got[k], v) for k, v in (("x", x), ("y", y), ("z", z)))
    assert reads == ["z"] and _mapped_ranges(path) == 2 and st._live_mappings == live + 2
    got["x"][0, 0] = 123.0
    got["y"][0] = 99
    assert path.read_bytes() == raw
    view = got["x"][5:7]
    del got
    gc.collect()
    assert _mapped_ranges(path) == 1 and st._live_mappings == live + 1  # x's mapping, held by the view
    monkeypatch.setattr(st, "MAX_LIVE_MAPPINGS", live + 1)
    assert torch.equal(f.map_tensor("y"), y) and reads == ["z", "y"]  # no room: read
    del view
    gc.collect()
    assert _mapped_ranges(path) == 0 and st._live_mappings == live
    assert torch.equal(f.map_tensor("y"), y) and reads == ["z", "y"]  # room again: mapped


def test_map_tensor_reads_a_file_it_cannot_map(tmp_path, monkeypatch):
    """A file system that refuses mmap (ENODEV): the tensor is read, and the mapping it did not get is not counted."""
    import mmap

    import qtk.io.safetensors as st

    path = tmp_path / "t.safetensors"
    x = torch.randn(40, 8).to(torch.bfloat16)
    save_file({"x": x}, str(path))
    live = st._live_mappings

    def refuse(*a, **k):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert torch.equal(SafetensorsFile(path).map_tensor("x"), x) and st._live_mappings == live


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.ENOSYS, errno.EINVAL])
def test_a_kernel_copy_refused_goes_through_memory_and_a_disk_error_is_raised(tmp_path, monkeypatch, refusal):
    """Where copy_file_range is refused (file systems it does not copy across, no such call), the StoredTensor is
    copied through memory with the same bytes, and later copies do not try the kernel again; ENOSPC from the kernel
    copy is the copy's own error."""
    import qtk.io.safetensors as st
    from qtk.io.safetensors import ShardedWriter

    x = torch.randn(700, 33).to(torch.bfloat16)
    save_file({"x": x}, str(tmp_path / "src.safetensors"))
    src = SafetensorsFile(tmp_path / "src.safetensors")
    calls = []

    def refuse(*a):
        calls.append(a)
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(st, "_kernel_copy", True)
    monkeypatch.setattr(os, "copy_file_range", refuse)
    seen = []
    for i in range(2):
        out = tmp_path / f"out{i}"
        out.mkdir()
        w = ShardedWriter(out)
        w.add("x", src.stored("x", check=seen.append))
        w.close()
        assert torch.equal(SafetensorsFile(out / "model.safetensors").get_tensor("x"), x)
        assert not w.checked_in_place  # the check saw the source's bytes, not the shard's
    assert len(calls) == 1 and not st._kernel_copy and sum(c.numel() for c in seen) == 2 * x.numel()

    monkeypatch.setattr(st, "_kernel_copy", True)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    (tmp_path / "full").mkdir()
    with pytest.raises(OSError) as e:
        ShardedWriter(tmp_path / "full").add("x", src.stored("x"))
    assert e.value.errno == errno.ENOSPC


def test_a_kernel_copy_checks_the_bytes_where_they_landed_and_says_so(tmp_path, monkeypatch):
    """A StoredTensor copied by the kernel is shown to its check chunk by chunk mapped from the shard it landed in, at
    its place there (a byte changed in the shard after the copy is what the check sees); the writer lists it as
    checked in place, and nothing else: a tensor without a check, a tensor from memory, one of another shard."""
    import qtk.io.safetensors as st
    from qtk.io.safetensors import ShardedWriter

    if not st._kernel_copy:
        pytest.skip("this file system refuses copy_file_range")
    x = torch.arange(3000, dtype=torch.int16).reshape(100, 30)
    save_file({"x": x, "y": x + 1}, str(tmp_path / "src.safetensors"))
    src = SafetensorsFile(tmp_path / "src.safetensors")
    monkeypatch.setattr(st, "COPY_CHUNK", 1000, raising=False)
    seen = []
    w = ShardedWriter(tmp_path, max_shard_bytes=7000)
    w.add("m", torch.ones(3))
    real_copy = os.copy_file_range

    def copy_then_change(fd_in, fd_out, n, off_in, off_out):  # the shard's bytes differ from the source's
        k = real_copy(fd_in, fd_out, n, off_in, off_out)
        os.pwrite(fd_out, b"\x07\x00", off_out)
        return k

    monkeypatch.setattr(os, "copy_file_range", copy_then_change)
    w.add("x", src.stored("x", check=lambda c: seen.append(c.clone())))
    w.add("y", src.stored("y"))  # no check; and a new shard (7000 bytes each)
    assert w.checked_in_place == {"x"} and len(w.shards) == 2
    assert len(seen) == 6 and all(int(c[0]) == 7 for c in seen)
    w.close()
    got = SafetensorsFile(next(tmp_path.glob("model-00001-*.safetensors"))).get_tensor("x").reshape(-1)
    assert torch.equal(torch.cat(seen), got)
