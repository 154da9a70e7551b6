"""Statistics as accumulators: each takes the batches of one process with `update` and becomes the statistic of
every process with `reduce(reducer)`.

The reducer is the seam where several processes meet (qtk.pipeline.distributed: sums and maxima all-reduced, token
samples gathered). A single process uses LOCAL, whose operations leave every tensor as it is, so a statistic reduced
with it is bit for bit the one accumulated. Accumulators create their tensors on the device of the data they see (or
the one they are given).
"""

from __future__ import annotations

import torch

from qtk.algorithms.gptq import hessian_sum_, hessian_from_sum


class Reducer:
    """How processes that calibrated on different tokens combine a statistic. This one is a single process: there is
    nothing to combine, and each method returns its argument untouched. A multi-process reducer overrides the methods
    (in place on the tensors given), world_size and rank."""

    world_size = 1
    rank = 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over processes."""
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over processes."""
        return t

    # Objects (picklable, on the host) between processes: resume state, solved weights, decisions of one process.

    def broadcast_object(self, obj, src: int = 0):
        """The object of process `src`, on every process."""
        return obj

    def gather_objects(self, obj, dst: int = 0) -> list | None:
        """[the object of each process] in rank order on process `dst`, None elsewhere."""
        return [obj]

    def all_gather_objects(self, obj) -> list:
        """[the object of each process] in rank order, on every process."""
        return [obj]

    def scatter_objects(self, objs: list | None, src: int = 0):
        """objs[rank] of process `src`'s list, on each process (objs is only read on `src`)."""
        return objs[0]

    def owners(self, costs: list[float]) -> list[int]:
        """The process that does each of several jobs of the given costs: the costliest first, each to the least
        loaded process (ties to the lowest rank), so every process computes the same assignment."""
        load = [0.0] * self.world_size
        out = [0] * len(costs)
        for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
            r = min(range(self.world_size), key=lambda r: (load[r], r))
            out[j] = r
            load[r] += costs[j]
        return out


LOCAL = Reducer()


def _scalar_max(value: float, reducer: Reducer) -> float:
    # float64 holds a Python float exactly, so a single process gets back the very value it passed
    return float(reducer.max_(torch.tensor([value], dtype=torch.float64))[0])


class Hessian:
    """H = 2/n Σ x xᵀ over the n tokens seen (float32 [in, in]), kept as a float64 sum (qtk.algorithms.gptq.hessian_sum_)
    until H is read. Processes add their sums and token counts: H read from the total is bit for bit the H of one
    process that saw every micro-batch, so GPTQ under torch.distributed solves with the same Hessian and writes the
    same codes as one process. Each process forms the float32 products of the very micro-batches one process forms
    (qtk.pipeline.distributed.micro_batch_shares); only the order of their float64 additions differs, and a float64 sum
    of float32 values (24 significant bits in 53) is exact, so independent of that order, while every value added to
    an entry is at least 2^-28 of the largest of its running sums; a smaller one moves the float64 sum in its last
    bit, which reaches the float32 H only where that sum lies on a float32 rounding tie. (A float32 running mean
    differed in its last bits with the split, and GPTQ's rounding amplified that: a code flipped in one layer changed
    every later layer's inputs.) The sum takes twice the memory of a float32 H while the layer calibrates; reading H
    frees it, and no batch may follow."""

    def __init__(self, in_features: int, device=None):
        self.in_features, self.device = in_features, device
        self._sum: torch.Tensor | None = None  # float64 Σ x xᵀ (upper triangle), None until the first token
        self._H: torch.Tensor | None = None
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        """x [..., in]: a batch of inputs of the Linears that share this Hessian."""
        if self._H is not None:
            raise RuntimeError("Hessian.update after H was read: the float64 sum is gone")
        t = x.numel() // x.shape[-1]
        if t == 0:
            return
        if self._sum is None:
            self._sum = torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=x.device)
        hessian_sum_(self._sum, x)
        self.tokens += t

    @property
    def H(self) -> torch.Tensor | None:
        """The float32 Hessian (None when no process saw a token); reading it ends accumulation."""
        if self._H is None and self._sum is not None:
            self._H, self._sum = hessian_from_sum(self._sum, self.tokens), None
        return self._H

    def reduce(self, reducer: Reducer = LOCAL) -> "Hessian":
        if reducer.world_size == 1:
            return self  # nothing to combine
        if self._H is not None:
            raise RuntimeError("Hessian.reduce after H was read")
        if self._sum is None:  # no tokens here: this process joins the collective with zeros
            self._sum = torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=self.device)
        reducer.sum_(self._sum)
        self.tokens = int(reducer.sum_(torch.tensor([self.tokens], dtype=torch.int64))[0])
        return self


class Amax:
    """Running absolute maximum of everything seen (a Python float, 0.0 before any input)."""

    def __init__(self):
        self.value = 0.0

    def update(self, x: torch.Tensor) -> None:
        self.value = max(self.value, float(x.detach().abs().amax()))

    def reduce(self, reducer: Reducer = LOCAL) -> "Amax":
        self.value = _scalar_max(self.value, reducer)
        return self


class ChannelMax:
    """Per input channel absolute maximum [in] (float32) and the number of tokens seen (SmoothQuant's statistic)."""

    def __init__(self, in_features: int, device=None):
        self.amax = torch.zeros(in_features, device=device)
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.amax.shape[0])
        self.tokens += x.shape[0]
        if x.shape[0]:
            torch.maximum(self.amax, x.abs().amax(0).float(), out=self.amax)

    def reduce(self, reducer: Reducer = LOCAL) -> "ChannelMax":
        reducer.max_(self.amax)
        self.tokens = int(reducer.sum_(torch.tensor([self.tokens], dtype=torch.int64))[0])
        return self


def evenly_spaced(x: torch.Tensor, limit: int) -> torch.Tensor:
    """At most `limit` evenly spaced rows of x [tokens, in] (deterministic, so a search can be repeated)."""
    if x.shape[0] > limit:
        x = x[torch.linspace(0, x.shape[0] - 1, limit).round().long()]
    return x


class TokenSample:
    """Up to `limit` evenly spaced input tokens (float32 [tokens, in]), spread over the calibration's `batches`
    micro-batches (AWQ's searches run on them): `limit // batches` evenly spaced tokens of each micro-batch, then
    `limit` evenly spaced tokens of them all. Processes gather their micro-batches' tokens in rank order, which is the
    micro-batches' own order (qtk.pipeline.distributed.micro_batch_shares), so every process holds the sample of one
    process and the searches on it choose what one process chooses."""

    def __init__(self, limit: int, batches: int, device=None):
        self.limit, self.device = limit, device
        self.per_batch = max(1, limit // max(1, batches))
        self.parts: list[torch.Tensor] = []

    def update(self, x: torch.Tensor) -> None:
        x = evenly_spaced(x.reshape(-1, x.shape[-1]), self.per_batch)
        self.parts.append(x.float().clone())

    def reduce(self, reducer: Reducer = LOCAL) -> "TokenSample":
        if reducer.world_size == 1:
            return self  # nothing to combine
        # through the host: a CUDA tensor would unpickle on its sender's GPU index
        parts = reducer.all_gather_objects([t.cpu() for t in self.parts])
        self.parts = [t.to(self.device) for part in parts for t in part]
        return self

    def sample(self) -> torch.Tensor | None:
        """The sample, None when nothing was seen (an MoE expert no token was routed to)."""
        if not self.parts:
            return None
        return evenly_spaced(torch.cat([t.reshape(-1, t.shape[-1]) for t in self.parts]).float(), self.limit)


class KVAmax:
    """Absolute maxima of K (after RoPE) and of V in one attention module; the object is the attention hook
    (qtk.model.simulate.set_kv_hook) that observes them."""

    def __init__(self):
        self.k, self.v = Amax(), Amax()

    def __call__(self, key: torch.Tensor, value: torch.Tensor):
        self.update(key, value)
        return key, value

    def update(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.k.update(key)
        self.v.update(value)

    def reduce(self, reducer: Reducer = LOCAL) -> "KVAmax":
        self.k.reduce(reducer)
        self.v.reduce(reducer)
        return self


class ExpertTokens:
    """Calibration tokens routed to each expert of each MoE block: block name -> counts [experts] (int64)."""

    def __init__(self):
        self.counts: dict[str, torch.Tensor] = {}

    def update(self, block: str, routed: torch.Tensor) -> None:
        prev = self.counts.get(block)
        self.counts[block] = routed.clone() if prev is None else prev + routed

    def reduce(self, reducer: Reducer = LOCAL) -> "ExpertTokens":
        for c in self.counts.values():
            reducer.sum_(c)
        return self

    def as_lists(self) -> dict[str, list[int]]:
        return {b: c.tolist() for b, c in self.counts.items()}
