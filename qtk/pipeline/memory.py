"""Keeping the loop's memory at one layer: freed heap handed back to the OS after each layer, large allocations
served from their own mappings (glibc); how much memory this process can still take."""

from __future__ import annotations

import os
from pathlib import Path

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 (not glibc: no trim)
            _libc.mallopt  # noqa: B018
        except (OSError, AttributeError):
            _libc = False
    return _libc


def release_freed_memory() -> None:
    """Hand memory freed with the last layer back to the OS. glibc keeps freed heap chunks (and raises its
    mmap threshold after large frees), so without this RSS creeps up layer by layer although nothing is held."""
    if _glibc():
        _libc.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 16 << 20
_M_TRIM_THRESHOLD = -1
TRIM_THRESHOLD_BYTES = 64 << 20


def map_large_allocations() -> None:
    """Serve every allocation of 16 MiB or more (wide activations, Hessians, GPTQ buffers) from its own mmap,
    returned to the OS when freed. glibc's default threshold grows up to 32 MiB after large frees, and the heap then
    keeps tensors freed during a layer. Measured (SmoothQuant+GPTQ, 2 layers): hidden 2048 peak RSS 1293-1334 ->
    1176-1196 MB at about the same speed; hidden 1024 unchanged in time. A 4-8 MiB threshold saved more memory but
    made hidden-1024 layers 25-45% slower (page faults on every activation). Process-wide and left in place."""
    if MMAP_THRESHOLD_BYTES and _glibc():
        _libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        _libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


KERNEL_CACHE_ENTRIES = 16


def bound_kernel_caches() -> None:
    """Keep few GEMM primitives of oneDNN (and of ideep, torch's wrapper of it): bf16 matmuls on the CPU create one
    per input shape and both caches keep up to 1024 of them, 0.5-2 MB each. An MoE expert's Linears see a new row
    count for nearly every expert, batch and layer, so the caches grew by tens of MB per layer until they held 1024
    (benchmarks/moe_depth.py); dense layers reuse a handful of shapes, which 16 entries hold. Creating a primitive
    again costs no measurable time next to the GEMM, and the kernels are the same (outputs are bit-identical). Both
    libraries read the capacity when they first create a primitive, so this must run before the process's first
    bf16 matmul; a value already in the environment wins (LRU_CACHE_CAPACITY must be at least 1: 0 crashes ideep).
    Process-wide and left in place; the variables set here (not the user's) are named in KERNEL_CACHES_SET_BY, so a
    process this one starts (vLLM's worker, for --verify-engine or --gate) gets the libraries' defaults back."""
    mine = [var for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY") if var not in os.environ]
    for var in mine:
        os.environ[var] = str(KERNEL_CACHE_ENTRIES)
    if mine:
        os.environ[KERNEL_CACHES_SET_BY] = ",".join(sorted(set(mine) | set(filter(None, os.environ.get(KERNEL_CACHES_SET_BY, "").split(",")))))


# the environment variable naming the cache capacities qtk set (bound_kernel_caches), which child processes drop
KERNEL_CACHES_SET_BY = "QTK_KERNEL_CACHES_SET"


def available_memory() -> int | None:
    """Bytes of memory this process can still take: MemAvailable, bounded by a cgroup v2 limit; None if unknown."""
    try:
        avail = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration):
        return None
    try:
        limit, used = ((Path("/sys/fs/cgroup") / f).read_text().strip() for f in ("memory.max", "memory.current"))
        if limit != "max":
            avail = min(avail, int(limit) - int(used))
    except (OSError, ValueError):
        pass
    return avail
