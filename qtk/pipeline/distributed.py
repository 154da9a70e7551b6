"""Several processes converting one model (`torchrun --nproc-per-node N -m qtk convert ...`): the torch.distributed
Reducer behind the steps' statistics, how a process learns its rank and device, how the calibration windows are
split, and how one process's failure becomes every process's end.

Every process runs the whole layer loop on its share of the calibration windows, whole micro-batches of the ones one
process forms (`micro_batch_shares`), so each forward is one process's forward, bit for bit; statistics meet in the
reducer (Hessians as float64 sums, channel/activation/KV maxima, token counts summed, AWQ's token samples gathered),
GPTQ solves are spread over the processes and broadcast (qtk.steps.gptq), and only rank 0 writes. gloo carries the
collectives on the CPU, NCCL on GPUs (host-side tensors of a NCCL run are copied to the process's GPU for the
collective).

Failures: a process that fails records one line in the rendezvous store (`record_failure`) before it leaves; a
process whose collective then breaks reads it (`peer_failure`), so rank 0 reports the first failure, as one line.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from qtk.errors import QtkError, UsageError
from qtk.steps.stats import Reducer

FAILURE_KEY = "qtk/failure"


class PeerFailed(QtkError):
    """Another process of the run failed (or vanished): this one stops too, writing nothing. `message` is the
    failing process's own error line when it left one."""

    exit_code = 1

    def __init__(self, problem: str, fix: str, origin: int | None):
        super().__init__(problem, fix)
        self.origin = origin  # the rank that failed, None when unknown


def env_world_size() -> int:
    """The number of processes torchrun (or any launcher setting WORLD_SIZE) started; 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class DistReducer(Reducer):
    """Statistics of every process of the default torch.distributed group, combined in place."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.dist = dist
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.nccl = dist.get_backend() == "nccl"
        self.device = device

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.nccl and t.device.type != "cuda":  # NCCL reduces GPU tensors only
            d = t.to(self.device)
            self.dist.all_reduce(d, op=op)
            t.copy_(d)
        else:
            self.dist.all_reduce(t, op=op)
        return t

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, self.dist.ReduceOp.SUM)

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, self.dist.ReduceOp.MAX)

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, device=self.device if self.nccl else None)
        return box[0]

    def gather_objects(self, obj, dst: int = 0) -> list | None:
        out = [None] * self.world_size if self.rank == dst else None
        self.dist.gather_object(obj, out, dst=dst)
        return out

    def all_gather_objects(self, obj) -> list:
        out = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def scatter_objects(self, objs: list | None, src: int = 0):
        box = [None]
        self.dist.scatter_object_list(box, objs if self.rank == src else None, src=src)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier()


def init_process_group(device: torch.device, timeout_s: float = 6 * 3600) -> DistReducer:
    """Join the processes torchrun started (env:// rendezvous: MASTER_ADDR/PORT, RANK, WORLD_SIZE): NCCL when this
    process computes on a GPU, else gloo. Idempotent. The timeout is long because the other ranks wait in one
    collective while rank 0 writes and self-checks the outputs (hours for the largest models); a rank that dies
    breaks the collectives at once, whatever the timeout."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistReducer(device)


def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no group (never joined, or already torn down)
        return None


def record_failure(rank: int, line: str) -> None:
    """Leave this process's error line for the others (the first failure wins), best effort."""
    store = _store()
    if store is None:
        return
    try:
        if store.add(FAILURE_KEY + "/n", 1) == 1:
            store.set(FAILURE_KEY, f"{rank}\n{line}")
    except Exception:
        pass


def peer_failure(rank: int, wait_s: float = 5.0) -> PeerFailed:
    """What this process reports when another one failed: the failing process's own line when it left one (waited
    for briefly: its collective may break before the line is stored), else that a process vanished."""
    import time

    store = _store()
    deadline = time.monotonic() + wait_s
    while store is not None:
        try:
            if store.check([FAILURE_KEY]):
                origin, _, line = store.get(FAILURE_KEY).decode().partition("\n")
                problem, _, fix = line.partition(" — ")
                return PeerFailed(f"rank {origin}: {problem}", fix or "see that process's error", int(origin))
        except Exception:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return PeerFailed("another process of this run stopped without a message (killed, or out of memory?)",
                      "check the other processes' logs and system memory, then rerun; nothing was written", None)


def is_collective_error(e: BaseException) -> bool:
    """An error raised by a collective because a peer left (gloo: connection closed/reset; NCCL: a DistBackendError
    or an aborted communicator)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Gloo", "NCCL", "ProcessGroup",
        "Socket Timeout", "connection closed"))


def destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def micro_batch_shares(windows: int, batch_size: int, world_size: int) -> list[tuple[int, int]]:
    """[(first, end)] calibration windows of each process: whole micro-batches of `batch_size` windows, the ones one
    process forms (`ids.split(batch_size)`: the last may be shorter), contiguous and in rank order, each process's
    share as near windows / world_size as whole micro-batches allow. Every forward, and every statistic a forward
    feeds, then sees the very micro-batches of one process (a GEMM's rounding depends on its shape: a rank that cut
    its share into other micro-batches computed other activations). Needs at least one micro-batch per process."""
    batches = -(-windows // batch_size)
    if batches < world_size:
        raise UsageError(f"{windows} calibration windows make {batches} micro-batch(es) of --batch-size {batch_size}, "
                         f"which cannot be shared by {world_size} processes",
                         "use at least one micro-batch per process (more --num-samples or a smaller --batch-size), "
                         "or fewer processes")
    # process r starts at the micro-batch boundary nearest to r / world_size of the windows, one micro-batch at least
    # after process r - 1 and early enough for one micro-batch each to the processes after it
    starts = [0]
    for r in range(1, world_size):
        b = round(r * windows / world_size / batch_size)
        starts.append(min(max(b, starts[-1] + 1), batches - (world_size - r)))
    bounds = [b * batch_size for b in starts] + [windows]
    return [(bounds[r], bounds[r + 1]) for r in range(world_size)]


def split_windows(ids: torch.Tensor, rank: int, world_size: int, batch_size: int) -> torch.Tensor:
    """This process's calibration windows [n, seq_len] (micro_batch_shares)."""
    first, end = micro_batch_shares(ids.shape[0], batch_size, world_size)[rank]
    return ids[first:end]
