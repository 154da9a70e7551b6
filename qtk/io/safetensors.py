"""Safetensors on disk. Writing streams: tensor bytes go to disk as they arrive, so a writer holds no more than
one tensor in memory whatever the shard size (ShardedWriter), or one small file is written and hashed (save_file).
Reading uses positioned reads and treats every header as untrusted input (SafetensorsFile); a file this process has
just written is mapped instead (mapped_reads: the convert self-check), and so is a source tensor the data-free
stream asks for mapped (SafetensorsFile.map_tensor: no copy, no fresh memory). A tensor that passes through unchanged (an
embedding, lm_head, a norm) is copied from its source file to a shard in bounded chunks (StoredTensor: its bytes on
disk, COPY_CHUNK at a time), never held whole: by the kernel (copy_file_range; on the 2-core VM of
benchmarks/convert_io.py 1 GB in 0.35 s where reading and writing it through memory took 1.5-2.6 s, and a
reflink on file systems that share extents), else through memory.

The header is written last into space reserved at the front of each shard; safetensors allows the
JSON header to be padded with spaces, so the reserved space never needs an extra copy of the data.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import struct
import threading
import weakref
from pathlib import Path

import torch

ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
HEADER_BYTES_PER_TENSOR = 192  # generous: name + dtype + shape + offsets in JSON
# The safetensors library refuses headers over 100 MB. The reserve is capped well below that: a shard whose
# header would outgrow it is closed and the next tensor starts a new shard, so no count of tensors makes a file
# that cannot be read back (and a huge expected count cannot make every shard carry a huge padded header).
MAX_HEADER_RESERVE = 32 * 2**20
SAFETENSORS_MAX_HEADER = 100_000_000
DEFAULT_MAX_SHARD = 5 * 10**9
COPY_CHUNK = 64 * 2**20  # bytes per positioned read when a stored tensor is copied or scanned in chunks


# copy_file_range refused: no such call (not Linux), files on file systems it does not copy across, descriptors it
# does not take; any other error (ENOSPC, EIO) is the copy's own
_NO_KERNEL_COPY = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}
_kernel_copy = hasattr(os, "copy_file_range")  # off after the first refusal: every later copy goes through memory


def map_range(fd: int, pos: int, n: int, on_unmap=None) -> torch.Tensor:
    """n > 0 bytes of the file `fd` (open for reading) from `pos` on, mapped privately (no copy; writing to the
    tensor leaves the file as it is), as a uint8 tensor whose storage holds the mapping (unmapped when it dies, and
    `on_unmap()` called then)."""
    base = pos - pos % mmap.ALLOCATIONGRANULARITY
    m = mmap.mmap(fd, pos + n - base, offset=base, access=mmap.ACCESS_COPY)
    if on_unmap is not None:
        weakref.finalize(m, on_unmap)
    return torch.frombuffer(m, dtype=torch.uint8, count=n, offset=pos - base)


# Source tensors mapped at once (SafetensorsFile.map_tensor). Each mapping holds a file descriptor of its own (Python's
# mmap duplicates the file's), so a MoE layer of hundreds of expert tensors, with the next layer mapped ahead, could
# reach the open-files limit; past this many a tensor is read instead.
MAX_LIVE_MAPPINGS = 256
_live_mappings = 0
_mappings_lock = threading.Lock()


def _take_mapping() -> bool:
    global _live_mappings
    with _mappings_lock:
        if _live_mappings >= MAX_LIVE_MAPPINGS:
            return False
        _live_mappings += 1
        return True


def _give_mapping() -> None:
    global _live_mappings
    with _mappings_lock:
        _live_mappings -= 1


class StoredTensor:
    """A tensor's bytes in a safetensors file, not read: dtype and shape from the header, the data in chunks of at
    most COPY_CHUNK bytes (each a 1-D tensor of the dtype, in one buffer reused from chunk to chunk), so the bytes can
    be copied to a shard or scanned without the tensor ever being whole in memory. `check(chunk)` (optional) sees
    every chunk read, and the whole tensor when one is read whole (`read`). Quacks like a tensor for what the writers
    ask of it: shape, dtype, numel, element_size, is_floating_point."""

    def __init__(self, file: "SafetensorsFile", name: str, check=None):
        self.file, self.name, self.check = file, name, check
        e = file.entries[name]
        self.dtype = ST_TO_TORCH[e["dtype"]]
        self.shape = torch.Size(e["shape"])
        self._start, end = e["data_offsets"]
        self.nbytes = end - self._start

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def chunks(self, max_bytes: int | None = None):
        """The data in order, as 1-D tensors of whole elements, at most max_bytes (COPY_CHUNK) each. Each chunk is
        valid until the next is asked for (one buffer)."""
        es = self.element_size()
        step = max(es, (max_bytes or COPY_CHUNK) // es * es)
        mapped = _mapped_reads
        buf = bytearray(min(step, self.nbytes)) if not mapped else None
        for off in range(0, self.nbytes, step):
            n = min(step, self.nbytes - off)
            if mapped:
                chunk = self.file.mapped(self._start + off, n, torch.uint8, (n,)).view(self.dtype)
            else:
                view = memoryview(buf)[:n]
                self.file.read_into(view, self._start + off, self.name)
                chunk = torch.frombuffer(view, dtype=torch.uint8).view(self.dtype)
            if self.check is not None:
                self.check(chunk)
            yield chunk

    def copy_into(self, f, pos: int) -> bool:
        """Copy the bytes into the file `f` (open for reading and writing) at `pos` inside the kernel
        (copy_file_range: no pass through this process's memory; a shared extent where the file system can reflink),
        COPY_CHUNK at a time, `check` seeing each chunk as landed, mapped from the output's page cache. f's position
        is left after the copy. False, with nothing written, where the kernel cannot copy between these files
        (another OS, file systems it does not copy across): the caller copies through memory (chunks)."""
        global _kernel_copy
        if not _kernel_copy or not self.nbytes:
            return False
        f.flush()
        out, src = f.fileno(), self.file.data_start + self._start
        step = max(self.element_size(), COPY_CHUNK // self.element_size() * self.element_size())
        done = 0
        while done < self.nbytes:
            n = min(step, self.nbytes - done)
            got = 0
            while got < n:
                try:
                    k = os.copy_file_range(self.file._fd, out, n - got, src + done + got, pos + done + got)
                except OSError as e:
                    if done or got or e.errno not in _NO_KERNEL_COPY:
                        raise
                    _kernel_copy = False
                    return False
                if k <= 0:
                    raise ValueError(f"short read for {self.name}")
                got += k
            if self.check is not None:
                self.check(map_range(out, pos + done, n).view(self.dtype))
            done += n
        f.seek(pos + self.nbytes)
        return True

    def read(self) -> torch.Tensor:
        """The whole tensor (for a writer that reshapes or converts it)."""
        t = self.file.get_tensor(self.name)
        if self.check is not None:
            self.check(t)
        return t


def as_tensor(t) -> torch.Tensor:
    """A tensor, reading a StoredTensor whole."""
    return t.read() if isinstance(t, StoredTensor) else t


# bytes per write() call. The page cache takes folios as large as a write (ext4's large folios, Linux 6.x): one call
# of tens of MB asks for high-order folios, which a machine whose free memory is fragmented assembles by compaction.
# On the VM of benchmarks/convert_io.py (Linux 6.18) 1 GB written in 64 MiB calls took 1.9-2.7 s of system time, in
# 16 KiB-512 KiB calls 0.25-0.35 s, in 1 MiB calls 0.5-2.4 s.
WRITE_PIECE = 256 * 2**10


def write_pieces(f, data) -> None:
    """`data` (bytes-like) written to the file object `f` in write() calls of at most WRITE_PIECE bytes."""
    mv = memoryview(data).cast("B")
    for k in range(0, len(mv), WRITE_PIECE):
        f.write(mv[k:k + WRITE_PIECE])


def tensor_bytes(t: torch.Tensor) -> bytes | memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # size-1 dims can leave a "contiguous" tensor with odd strides
        flat = flat.clone()
    return flat.view(torch.uint8).numpy().data if flat.numel() else b""


class _Shard:
    def __init__(self, path: Path, reserve: int, metadata: dict):
        self.path = path
        self.reserve = reserve  # bytes for the 8-byte length + JSON header
        self.entries: dict[str, dict] = {}
        self.checked_in_place: set[str] = set()  # StoredTensors whose check saw their bytes here, after the copy
        self.size = 0
        self.metadata = metadata
        self.header_len = len(json.dumps({"__metadata__": metadata}, separators=(",", ":")))
        self.f = open(path, "w+b")  # readable too: StoredTensor.copy_into checks what it copied through a mapping
        self.f.seek(reserve)

    @staticmethod
    def _entry_len(name: str, entry: dict) -> int:
        return len(json.dumps({name: entry}, separators=(",", ":"))) - 1  # minus braces, plus a comma

    def header_size_with(self, name: str, t: torch.Tensor | StoredTensor) -> int:
        n = t.numel() * t.element_size()
        entry = {"dtype": "F8_E4M3", "shape": list(t.shape), "data_offsets": [self.size, self.size + n]}
        return self.header_len + self._entry_len(name, entry)

    def add(self, name: str, t: torch.Tensor | StoredTensor) -> None:
        if t.dtype not in ST_DTYPES:
            raise TypeError(f"safetensors cannot store dtype {t.dtype} ({name})")
        n = t.numel() * t.element_size()
        if isinstance(t, StoredTensor):  # its bytes as stored: by the kernel, else chunk by chunk through memory
            if t.copy_into(self.f, self.reserve + self.size):
                if t.check is not None:  # copy_into showed the check every byte where it landed in this file
                    self.checked_in_place.add(name)
            else:
                for chunk in t.chunks():
                    write_pieces(self.f, chunk.view(torch.uint8).numpy().data)
        else:
            write_pieces(self.f, tensor_bytes(t))
        self.entries[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [self.size, self.size + n]}
        self.header_len += self._entry_len(name, self.entries[name])
        self.size += n

    def close(self) -> None:
        header = json.dumps({"__metadata__": self.metadata, **self.entries}, separators=(",", ":")).encode()
        room = self.reserve - 8
        assert len(header) <= room <= SAFETENSORS_MAX_HEADER, "header outgrew its reserved space"  # guarded by ShardedWriter
        header += b" " * (room - len(header))
        self.f.seek(0)
        self.f.write(struct.pack("<Q", len(header)))
        self.f.write(header)
        # no fsync here: the shard's bytes stay in the page cache for the self-check that reads them next, while
        # the convert job flushes the whole output in the background (qtk.io.atomic.BackgroundFlush) and waits for
        # it before the rename that publishes it; a writer thread that fsync'd each shard stalled on the disk
        self.f.close()


class ShardedWriter:
    """Writes model-0000i-of-0000N.safetensors (or model.safetensors) + index into `directory`."""

    def __init__(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD, expected_tensors: int = 1024,
                 metadata: dict | None = None, prefix: str = "model"):
        self.dir = Path(directory)
        self.max_shard = max_shard_bytes
        self.prefix = prefix
        self.metadata = {"format": "pt", **(metadata or {})}
        self.reserve = 8 + min(max(4096, HEADER_BYTES_PER_TENSOR * expected_tensors), MAX_HEADER_RESERVE)
        self.reserve += (-self.reserve) % 8
        self.shards: list[_Shard] = []
        self.total_size = 0

    def _new_shard(self) -> _Shard:
        s = _Shard(self.dir / f".{self.prefix}-shard-{len(self.shards):05d}.tmp", self.reserve, self.metadata)
        self.shards.append(s)
        return s

    def add(self, name: str, t: torch.Tensor | StoredTensor) -> None:
        """Append one tensor; a StoredTensor is copied from its file in chunks (the same bytes as its tensor's)."""
        cur = self.shards[-1] if self.shards else self._new_shard()
        n = t.numel() * t.element_size()
        too_big = cur.entries and cur.size + n > self.max_shard
        if too_big or cur.header_size_with(name, t) > self.reserve - 8 - 64:
            cur.close()
            cur = self._new_shard()
        cur.add(name, t)
        self.total_size += n

    def open_files(self) -> list:
        """The shard still being written (for qtk.io.atomic.WriteBack), if any."""
        return [s.f for s in self.shards if not s.f.closed]

    @property
    def checked_in_place(self) -> set[str]:
        """Tensors added as StoredTensors with a check that saw their bytes in the shard, where they lie (copied by
        the kernel, then mapped from the output): what a scan of the written files would read."""
        return set().union(*(s.checked_in_place for s in self.shards))

    def close(self) -> dict[str, str]:
        """Finish every shard; returns the weight map (tensor name -> file name)."""
        if not self.shards:
            self._new_shard()
        if not self.shards[-1].f.closed:
            self.shards[-1].close()
        n = len(self.shards)
        weight_map = {}
        for i, s in enumerate(self.shards):
            fname = f"{self.prefix}.safetensors" if n == 1 else f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(s.path, self.dir / fname)
            weight_map.update({k: fname for k in s.entries})
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / f"{self.prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def save_file(tensors: dict[str, torch.Tensor], path: Path) -> str:
    """Write one safetensors file through a plain file object and fsync it; returns the sha256 of its bytes.
    Unlike safetensors.torch.save_file, a full disk surfaces as OSError(ENOSPC), and the hash comes for free."""
    import hashlib

    entries, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(header)), header, *(tensor_bytes(t) for t in tensors.values())):
            h.update(chunk)
            write_pieces(f, chunk)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


ST_TO_TORCH = {v: k for k, v in ST_DTYPES.items()}


class ReadBuffers:
    """Buffers that tensors are read into, handed out again once every tensor and view of one is gone. A fresh
    buffer costs a page fault per 4 KiB page on its first write (the kernel zeroes each page; on a VM the host may
    back it first), and a layer's reads are the same sizes as the last layer's: reading layer i+1 into layer i's
    freed buffers skips that cost (the data-free stream of 6 Llama-3-8B layers faulted 1.65M pages, most of them
    its reads). A buffer is returned when the numpy view the tensor's storage holds dies (weakref.finalize): the
    storage keeps that view alive while any tensor or view of it lives, so a buffer is never reused under a
    living tensor. At most `max_idle` bytes wait unused; beyond that a freed buffer goes back to the allocator."""

    def __init__(self, max_idle: int):
        self.max_idle, self.idle = max_idle, 0
        self.free: dict[int, list] = {}
        self.lock = threading.RLock()  # a finalizer may run in the thread that holds it
        self.closed = False

    def take(self, n: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of n bytes."""
        with self.lock:
            stack = self.free.get(n)
            base = stack.pop() if stack else None
            if base is not None:
                self.idle -= n
        if base is None:
            base = torch.empty(n, dtype=torch.uint8).numpy()  # torch's allocator: no huge-page advice on it
        view = base[:]  # a new array object on the same bytes: the storage of the tensor below holds it
        weakref.finalize(view, self._give_back, base)
        return torch.from_numpy(view)

    def _give_back(self, base) -> None:
        with self.lock:
            if not self.closed and self.idle + base.nbytes <= self.max_idle:
                self.free.setdefault(base.nbytes, []).append(base)
                self.idle += base.nbytes

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.free.clear()
            self.idle = 0


_read_buffers: ReadBuffers | None = None


@contextlib.contextmanager
def reusing_read_buffers(max_idle: int):
    """Within the block, SafetensorsFile.get_tensor reads into recycled buffers (ReadBuffers), in every thread; the
    idle ones are freed on leaving it."""
    global _read_buffers
    outer, _read_buffers = _read_buffers, ReadBuffers(max_idle)
    try:
        yield _read_buffers
    finally:
        _read_buffers.close()
        _read_buffers = outer


_mapped_reads = False


@contextlib.contextmanager
def mapped_reads():
    """Within the block, SafetensorsFile.get_tensor and StoredTensor.chunks map the tensor's bytes from the file
    (mmap, private: a tensor may be written to without touching the file) instead of copying them into a buffer:
    for reading back a file this process has just written, whose pages are in the page cache (the convert
    self-check: 3.4 GB read back without a 0.8 s copy). Each mapping is unmapped when its last tensor or view dies,
    so resident memory stays what a copy would hold. Only for files nothing else changes meanwhile: a file cut
    short under a mapping faults the process, where a positioned read reports a short read."""
    global _mapped_reads
    outer, _mapped_reads = _mapped_reads, True
    try:
        yield
    finally:
        _mapped_reads = outer


def recycled_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, from the recycled buffers when reusing_read_buffers is active (a layer's outputs
    are the same sizes as the last layer's: the data-free stream's codes reuse the buffers the written layer left,
    without a page fault per 4 KiB), else torch.empty."""
    pool = _read_buffers
    n = math.prod(shape) * dtype.itemsize
    if pool is None or n == 0:
        return torch.empty(shape, dtype=dtype)
    return pool.take(n).view(dtype).reshape(shape)


class SafetensorsFile:
    """Reads tensors from a .safetensors file with positioned reads (get_tensor), or maps one on request (map_tensor);
    either way the memory a tensor holds is released when the tensor dies (a mapping is per tensor and unmapped then;
    one mapping of the whole file would stay resident and grow with the model)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 2**20):
                raise ValueError("its header length field exceeds the file size")  # never print the bytes: they may be anything
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ValueError("header is not valid JSON") from None
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries = header
        self.data_start = 8 + n
        for name, e in header.items():
            # a header is untrusted input: offsets and shape must be non-negative integers (not null, strings, floats
            # or booleans), or arithmetic on them fails far from here
            try:
                start, end = e["data_offsets"]
                dtype = ST_TO_TORCH[e["dtype"]]
                shape = e["shape"]
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"bad header entry for {name}") from None
            if not (_is_count(start) and _is_count(end) and start <= end and isinstance(shape, list)
                    and all(_is_count(d) for d in shape)):
                raise ValueError(f"bad header entry for {name} (shape {shape!r}, data_offsets {e['data_offsets']!r})")
            if self.data_start + end > size:
                raise ValueError(f"tensor {name} extends past the end of the file (truncated download?)")
            if end - start != _numel(shape) * torch.tensor([], dtype=dtype).element_size():
                raise ValueError(f"tensor {name}: byte range does not match its shape and dtype")
        if not (isinstance(self.metadata, dict) and all(isinstance(v, str) for v in self.metadata.values())):
            raise ValueError("its __metadata__ is not a map of text to text")
        _check_layout(header, size - self.data_start)
        self._fd = os.open(self.path, os.O_RDONLY)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return ST_TO_TORCH[self.entries[name]["dtype"]]

    def read_into(self, view: memoryview, offset: int, name: str) -> None:
        """Fill `view` with the data section's bytes from `offset` on (positioned reads; `name` for the error)."""
        off = 0
        while off < len(view):
            got = os.preadv(self._fd, [view[off:]], self.data_start + offset + off)
            if got <= 0:
                raise ValueError(f"short read for {name}")
            off += got

    def stored(self, name: str, check=None) -> StoredTensor:
        """`name` unread: its bytes, to copy or scan in chunks."""
        return StoredTensor(self, name, check)

    def get_tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        start, end = e["data_offsets"]
        dtype = ST_TO_TORCH[e["dtype"]]
        if end == start:
            return torch.empty(e["shape"], dtype=dtype)
        if _mapped_reads:
            return self.mapped(start, end - start, dtype, e["shape"])
        # uninitialised (a bytearray is zero-filled first: a pass over every page before the read writes them)
        buf = recycled_empty((end - start,), torch.uint8)
        self.read_into(memoryview(buf.numpy()).cast("B"), start, name)
        return buf.view(dtype).reshape(e["shape"])

    def map_tensor(self, name: str) -> torch.Tensor:
        """The tensor mapped from the file, not copied: its pages are the page cache's own, mapped as they are
        touched, where a read copies them into memory the process touches for the first time (on the VM of
        benchmarks/convert_io.py a data-free conversion of 6 Llama-3-8B-shaped layers faulted 1.17 GB of pages, 0.56 GB
        of them read buffers, and fresh memory cost up to 6 s per GB while the host was busy). The mapping is private (a write
        to the tensor leaves the file as it is) and unmapped when the tensor's last view dies. Read (get_tensor)
        where its bytes do not start at a multiple of its element size (a misaligned view would reach the kernels),
        where MAX_LIVE_MAPPINGS are alive, or where the file cannot be mapped. Only for files nothing changes
        meanwhile, as every mapping reader (safetensors, vLLM): a file cut short under a mapping faults the process,
        where a positioned read reports a short read."""
        e = self.entries[name]
        start, end = e["data_offsets"]
        dtype = ST_TO_TORCH[e["dtype"]]
        if end == start or (self.data_start + start) % dtype.itemsize or not _take_mapping():
            return self.get_tensor(name)
        try:
            t = map_range(self._fd, self.data_start + start, end - start, on_unmap=_give_mapping)
        except (OSError, ValueError):  # ENODEV (a file system without mmap), ENOMEM (address space): read it
            _give_mapping()
            return self.get_tensor(name)
        return t.view(dtype).reshape(e["shape"])

    def mapped(self, offset: int, n: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """The n bytes of the data section from `offset` on, mapped (mapped_reads), as a tensor of `dtype` and
        `shape`; the mapping lives as long as the tensor's storage does."""
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return map_range(self._fd, self.data_start + offset, n).view(dtype).reshape(shape)

    def __del__(self, _close=os.close):  # bound early: module globals may be gone at interpreter exit
        fd = getattr(self, "_fd", None)
        if fd is not None:
            _close(fd)
            self._fd = None


def _check_layout(entries: dict, data_size: int) -> None:
    """The data section's layout, held to the safetensors format's own rule (the reference reader's validation):
    taken in order of their offsets, each tensor starts where the one before ended, the first at 0, and the last
    ends where the file does. Tensors that share or overlap bytes, gaps and trailing bytes are refused: the
    safetensors library refuses such a file ("invalid offset"), so an engine could not load what qtk read as fine,
    and two tensors over the same bytes are not the model the names say."""
    order = sorted(entries.items(), key=lambda kv: (kv[1]["data_offsets"][0], kv[1]["data_offsets"][1]))
    at, prev = 0, None
    for name, e in order:  # overlaps first: sharing bytes also leaves the bytes of the one moved to no tensor
        start, end = e["data_offsets"]
        if start < at:
            raise ValueError(f"tensor {name} overlaps the bytes of tensor {prev} (bytes {start}-{end}, {prev} ends at {at})")
        at, prev = end, name
    at = 0
    for name, e in order:
        start, end = e["data_offsets"]
        if start != at:
            raise ValueError(f"tensor {name} starts at byte {start} of the data, leaving bytes {at}-{start} to no "
                             "tensor")
        at = end
    if at != data_size:
        raise ValueError(f"the tensors cover {at} bytes of data but the file holds {data_size} (bytes no tensor "
                         "covers)")


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
