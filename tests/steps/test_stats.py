"""Statistics as accumulators: one process's reduce (LOCAL) leaves every statistic bit for bit as accumulated, and the
reduce seam is enough for several processes — simulated here with two — to get the statistics of all their tokens
(Hessians summed in float64, bit for bit the one process's, maxima maxed, counts summed, token samples gathered into the
one process's sample)."""

import pytest
import torch

from qtk.steps.stats import (LOCAL, Amax, ChannelMax, ExpertTokens, Hessian, KVAmax, Reducer, TokenSample,
                             evenly_spaced)

G = torch.Generator().manual_seed(0)
BATCHES = [torch.randn(2, 7 + i, 32, generator=G) * (1 + i) for i in range(5)]


class Recording(Reducer):
    """One process of two, first to reduce: its tensors as the collective would receive them."""

    world_size = 2

    def __init__(self):
        self.sent = []

    def sum_(self, t):
        self.sent.append(t.clone())
        return t

    max_ = sum_


class Peer(Reducer):
    """The other process: combines its tensors with what Recording saw, call by call, as an all-reduce would."""

    world_size = 2

    def __init__(self, sent):
        self.sent = list(sent)

    def sum_(self, t):
        return t.add_(self.sent.pop(0))

    def max_(self, t):
        return torch.maximum(t, self.sent.pop(0), out=t)


def test_local_reduce_leaves_every_statistic_as_accumulated():
    h = Hessian(32)
    for x in BATCHES:
        h.update(x)
    n = sum(x.shape[0] * x.shape[1] for x in BATCHES)
    assert h.reduce(LOCAL) is h and h.tokens == n
    before = h.H
    assert h.H is before
    X = torch.cat([x.reshape(-1, 32) for x in BATCHES]).double()
    torch.testing.assert_close(h.H, (2 / n * X.t() @ X).float(), rtol=1e-6, atol=1e-6)  # 2/n Σ xxᵀ
    assert torch.equal(h.H, h.H.t())  # exactly symmetric
    with pytest.raises(RuntimeError, match="after H was read"):
        h.update(BATCHES[0])  # reading H ends accumulation: the float64 sum is gone
    cm = ChannelMax(32)
    a = Amax()
    for x in BATCHES:
        cm.update(x)
        a.update(x)
    amax = cm.amax.clone()
    assert torch.equal(cm.reduce(LOCAL).amax, amax) and cm.tokens == n
    assert a.reduce(LOCAL).value == max(float(x.abs().amax()) for x in BATCHES)
    sample = TokenSample(8, len(BATCHES))
    for x in BATCHES:
        sample.update(x)
    parts = list(sample.parts)
    assert sample.reduce(LOCAL) is sample and all(a is b for a, b in zip(sample.parts, parts))
    empty = Hessian(8)
    assert empty.reduce(LOCAL).H is None and empty.tokens == 0  # no tokens, nothing allocated


def _two_processes(make, feed):
    """Accumulate the batches split over two processes and reduce through the seam; returns both processes' view."""
    a, b = make(), make()
    for k, x in enumerate(BATCHES):
        feed(a if k % 2 else b, x)
    rec = Recording()
    b.reduce(rec)
    a.reduce(Peer(rec.sent))
    return a


def test_two_processes_get_the_statistics_of_all_their_tokens():
    whole = Hessian(32)
    for x in BATCHES:
        whole.update(x)
    h = _two_processes(lambda: Hessian(32), lambda acc, x: acc.update(x))
    assert h.tokens == whole.tokens
    # bit for bit: float64 sums reassociated by the split round to the same float32 H (a float32 running mean did not)
    assert torch.equal(h.H, whole.H)

    cm = _two_processes(lambda: ChannelMax(32), lambda acc, x: acc.update(x))
    assert torch.equal(cm.amax, torch.cat([x.reshape(-1, 32) for x in BATCHES]).abs().amax(0))
    assert cm.tokens == whole.tokens

    a = _two_processes(Amax, lambda acc, x: acc.update(x))
    assert a.value == max(float(x.abs().amax()) for x in BATCHES)

    kv = _two_processes(KVAmax, lambda acc, x: acc(x, 2 * x))
    assert (kv.k.value, kv.v.value) == (a.value, 2 * a.value)

    e = _two_processes(ExpertTokens, lambda acc, x: acc.update("block", torch.tensor([x.shape[1], 1, 0])))
    assert e.as_lists() == {"block": [sum(x.shape[1] for x in BATCHES), 5, 0]}


def test_an_empty_hessian_joins_the_reduction_with_zeros():
    """A process no token reached still takes part (collectives need every process), with weight 0."""
    full, ref = Hessian(32), Hessian(32)
    for x in BATCHES:
        full.update(x)
        ref.update(x)
    rec = Recording()
    H = ref.H
    full.reduce(rec)
    empty = Hessian(32).reduce(Peer(rec.sent))
    assert empty.tokens == full.tokens
    assert torch.equal(empty.H, H)


def test_token_sample_keeps_evenly_spaced_tokens_per_batch():
    s = TokenSample(limit=12, batches=len(BATCHES))
    for x in BATCHES:
        s.update(x)
    per_batch = 12 // len(BATCHES)
    parts = [evenly_spaced(x.reshape(-1, 32), per_batch) for x in BATCHES]
    assert torch.equal(s.sample(), evenly_spaced(torch.cat(parts), 12))
    assert s.sample().shape == (10, 32)
    assert TokenSample(4, 1).sample() is None  # nothing seen: an expert no token reached


class Gathering(Reducer):
    """Process `rank` of two gathering objects, the other process's object given."""

    world_size = 2

    def __init__(self, rank, other):
        self.rank, self.other = rank, other

    def all_gather_objects(self, obj):
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def test_token_samples_of_two_processes_gather_into_the_sample_of_one():
    """Each process samples its micro-batches at the whole calibration's rate (limit // all micro-batches) and the
    processes gather their tokens in micro-batch order: both hold the very sample of one process, so AWQ's searches
    choose what one process chooses. Sampling at a process's own rate (limit // its micro-batches) would not."""
    whole = TokenSample(12, len(BATCHES))
    for x in BATCHES:
        whole.update(x)
    shares = [BATCHES[:3], BATCHES[3:]]  # contiguous, as qtk.pipeline.distributed.micro_batch_shares assigns them
    procs = [TokenSample(12, len(BATCHES)) for _ in shares]
    for acc, share in zip(procs, shares):
        for x in share:
            acc.update(x)
    sent = [[t.clone() for t in acc.parts] for acc in procs]
    for rank, acc in enumerate(procs):
        assert torch.equal(acc.reduce(Gathering(rank, sent[1 - rank])).sample(), whole.sample())
    own_rate = TokenSample(12, len(shares[0]))
    for x in shares[0]:
        own_rate.update(x)
    assert not torch.equal(own_rate.reduce(Gathering(0, sent[1])).sample(), whole.sample())


def test_kv_hook_passes_key_and_value_through():
    kv = KVAmax()
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    assert kv(k, v) == (k, v)
    assert kv.k.value == float(k.abs().amax()) and kv.v.value == float(v.abs().amax())
