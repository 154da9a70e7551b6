"""Data-free recipes (fp8-dynamic, w8a16, w4a16 round-to-nearest, any recipe whose only step is `rtn` and that
keeps no KV cache statistics) at disk speed: no decoder layer is materialised as a module. Each layer's tensors are
read by name (the next layer's in a background thread, onto the device), its Linears rounded to nearest there, the
per-weight error taken from the QTensor just made (no second read), and the LayerResult written while the next layer
is read and quantized. The result is the one qtk.pipeline.loop.run builds for these recipes, byte for byte: the
same tensors in the same dtypes and order (the meta skeleton's). Names, shapes and order come from
qtk.model.layout, which `qtk convert` checks against the weight files before any work: from config.json alone, so
this path imports no transformers and builds no module (the skeleton only where config.json leaves a size to
transformers' defaults)."""

from __future__ import annotations

import math
import threading
import time
import weakref
from typing import Callable

import torch

from qtk import interrupts
from qtk.model.layout import is_stored_dtype
from qtk.model.simulate import engine_weight
from qtk.quant.error import ErrorSum, block_rows
from qtk.pipeline.device import compute_dtype, resolve_device
from qtk.io.safetensors import reusing_read_buffers
from qtk.pipeline.memory import map_large_allocations, release_freed_memory
from qtk.pipeline.loop import (WriteBehind, background, check_finite, replay_layers, runnable_steps,
                               write_non_layer)
from qtk.pipeline.result import LayerDone, LayerResult, PipelineStats
from qtk.pipeline.targets import check_group_size, target_linears
from qtk.recipe import Recipe
from qtk.steps import plan_steps
from qtk.steps import rtn  # through the module: the step's function, as the module loop calls it


def streams(recipe: Recipe, calib_ids) -> bool:
    """Whether `recipe` converts without calibration through this path: round-to-nearest alone, nothing observed."""
    if calib_ids is not None or recipe.kv_cache is not None:
        return False
    plan = plan_steps(recipe)
    return not any(step.needs_data for step, _ in plan) and [step.name for step, _ in runnable_steps(plan, None)] == ["rtn"]


class _LayerReader:
    """Layer i+1's tensors read (and moved to the device, in the compute dtype) in a background thread, at most
    `budget` bytes of read tensors alive at a time (layer i's not yet rounded and freed, and layer i+1's read ahead):
    each tensor's bytes are counted while it lives (weakref.finalize), so the read ahead fills what layer i frees
    as its weights are rounded, never a second whole layer. The layer the loop waits for is read without the bound.
    For the CPU the tensors are mapped from the source files, not copied (ModelSource.tensor(mapped=True)): the
    NaN/Inf scan of each one in this thread brings its pages in (from the disk where they are not cached), and the
    rounding reads the page cache's own pages instead of a copy in freshly touched memory (6 Llama-3-8B-shaped
    layers on the 2-core VM, runs alternating with positioned reads: page faults 310-450k -> 200-290k, peak RSS
    1.10-1.29 -> 0.99-1.22 GB, 0.3-0.8 s less system time; while the host was slow to back fresh memory
    fp8-dynamic took 10.0 and 4.1 s where reads took 32.5 and 8.7 s, otherwise as long within the noise)."""

    def __init__(self, source, layout, device, enabled: bool, budget: int | None = None):
        self.source, self.device, self.dtype = source, device, compute_dtype(source)
        self.layers = layout.layers
        self.enabled = enabled
        self.ahead = None
        self.size = torch.empty((), dtype=self.dtype).element_size()
        self.budget = budget if budget is not None else layout.largest_layer_numel() * self.size
        self.cond = threading.Condition(threading.RLock())  # a finalizer may run in the thread that holds it
        self.held = 0  # bytes of read tensors still alive
        self.wanted = -1  # the layer the loop waits for
        self.peak_held = 0

    def _release(self, n: int) -> None:
        with self.cond:
            self.held -= n
            self.cond.notify_all()

    def _room(self, i: int, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.held == 0 or self.held + n <= self.budget or self.wanted >= i)
            self.held += n
            self.peak_held = max(self.peak_held, self.held)

    def _read(self, i: int) -> dict[str, torch.Tensor]:
        """name (relative) -> tensor, in the layer module's state_dict order, as ModelSource.load_module loads it."""
        prefix = self.source.layer_prefix(i)
        out = {}
        for k, shape in self.layers[i]:
            n = math.prod(shape) * self.size
            self._room(i, n)
            try:
                dtype = None if is_stored_dtype(k) else self.dtype
                if self.device.type == "cpu":
                    t = self.source.tensor(prefix + k, mapped=True).to(dtype)
                else:
                    t = self.source.tensor(prefix + k).to(device=self.device, dtype=dtype)
                check_finite(prefix + k, t)
            except BaseException:
                self._release(n)
                raise
            weakref.finalize(t, self._release, n)
            out[k] = t
        return out

    def get(self, i: int, n: int) -> dict[str, torch.Tensor]:
        interrupts.check()  # a Ctrl-C a finalizer swallowed ends the run here, not after waiting for the read
        with self.cond:
            self.wanted = i
            self.cond.notify_all()
        tensors = self.ahead[1].result() if self.ahead is not None and self.ahead[0] == i else self._read(i)
        self.ahead = None
        if self.enabled and i + 1 < n:
            self.ahead = (i + 1, background(self._read, i + 1, name="qtk-read"))
        return tensors

    def close(self) -> None:
        self.ahead = None  # a read in flight after a failure is abandoned (a daemon thread), never left waiting
        with self.cond:
            self.wanted = 1 << 62
            self.cond.notify_all()


class _Measure:
    """rtn.Measure for the stream: each weight's relative error against its float32 source rows (qtk.quant.error,
    summed block by block as the rows are rounded: the figure relative_error gives the whole weight), its max |w| from
    min/max passes over the decoded blocks (NaN when present), and, with a CRC-32 of the QTensor, what the
    self-check needs (qtk.pipeline.result.Measured)."""

    def __init__(self, prefix: str, measured: dict | None):
        self.prefix, self.measured = prefix, measured
        self.errors: dict[str, float] = {}
        self.sums: dict[str, tuple] = {}  # name -> (ErrorSum, min, max) while the weight is rounded

    def block(self, name: str, r0: int, w32: torch.Tensor, qt, decoded: torch.Tensor | None = None) -> None:
        check_finite(f"{self.prefix}{name}.weight", qt.scale)  # a NaN/Inf weight poisons its row's scale
        decoded = engine_weight(qt) if decoded is None else decoded
        lo, hi = torch.aminmax(decoded) if decoded.numel() else (torch.zeros(()), torch.zeros(()))
        err, plo, phi = self.sums.get(name) or (ErrorSum(), lo, hi)
        err.add(decoded, w32)
        self.sums[name] = (err, torch.minimum(plo, lo), torch.maximum(phi, hi))

    def native(self, name: str, qt, sums) -> None:
        # the kernel refuses a weight or scale that is not finite (the torch path then raises): both are finite here
        self.sums[name] = (ErrorSum().add_rows(sums.row_e, sums.row_w, block_rows(qt.shape)),
                           torch.tensor(-sums.amax), torch.tensor(sums.amax))

    def done(self, name: str, qt) -> None:
        from qtk.pipeline.result import Measured
        from qtk.quant.qtensor import qtensor_digest

        err, lo, hi = self.sums.pop(name)
        key = self.prefix + name
        self.errors[key] = err.value()
        if self.measured is not None:
            self.measured[key] = Measured(qtensor_digest(qt.to(torch.device("cpu"))), self.errors[key],
                                          max(-float(lo), float(hi)))


def layer_result(source, recipe: Recipe, i: int, tensors: dict[str, torch.Tensor], targets: list[str],
                 measured: dict | None = None) -> LayerResult:
    """The LayerResult of layer i from its tensors (relative name -> tensor in the compute dtype). measured: filled
    with what the self-check needs of each quantized Linear (qtk.pipeline.result.Measured), taken from the one dequantization
    that gives its error, so the check need not read the source or dequantize again."""
    arch, dtype, prefix = source.arch.at(i), source.dtype, source.layer_prefix(i)
    # model-dtype weights: rtn_weights copies each to float32 a row block at a time where it rounds it (one whole copy
    # where the scheme rounds whole) and shows `measure` each block with its QTensor while both are hot in cache: the
    # one dequantization gives the error and the self-check's figures
    weights = {t: tensors.pop(t + ".weight") for t in targets}
    schemes = {t: recipe.scheme_for(prefix + t).weights for t in targets}
    measure = _Measure(prefix, measured)
    # each source weight leaves `tensors` here and `weights` when rounded (consume): freed then, so the layer's
    # model-dtype bytes shrink as it is rounded and the read ahead of the next layer fills the room
    # the native kernel on every core: the reading and writing threads need little CPU beside it since the writer
    # writes in WRITE_PIECE calls (on 2 cores a Llama-3-8B layer rounds in 0.3 s with both, 0.45-0.8 s with one)
    threads = torch.get_num_threads()
    qweights = rtn.rtn_weights(weights, schemes, arch, dtype, measure, consume=True, threads=threads)
    errors = {prefix + t: measure.errors[prefix + t] for t in qweights}  # in the QTensors' order, as before
    host = torch.device("cpu")
    dense = {prefix + k: v.detach().to(v.dtype if is_stored_dtype(k) else dtype).to(host) for k, v in tensors.items()}
    return LayerResult(index=i, qweights={prefix + t: q.to(host) for t, q in qweights.items()}, dense=dense,
                       input_amax={}, k_amax=None, v_amax=None, weight_error=errors, records={},
                       dense_linears=tuple(prefix + m for m in (*arch.linears, *arch.dense_linears) if m not in targets))


def run_data_free(source, recipe: Recipe, sinks: list, *, on_layer: Callable[[int, int, LayerDone], None] | None = None,
                  resume=None, device=None, overlap: bool = True) -> PipelineStats:
    """qtk.pipeline.run for a recipe `streams` accepts (same arguments, no calibration), without modules."""
    device = resolve_device(device)
    map_large_allocations()  # a float32 copy freed after each weight goes back to the OS, not to a growing heap
    stats = PipelineStats()
    check_group_size(source, recipe)
    t0 = time.perf_counter()
    layout = source.layout()  # checked before any work already: each layer's names, shapes and order
    n = source.num_layers
    start = min(resume.completed, n) if resume is not None else 0
    if resume is not None:  # the sinks see the passthrough tensors, then the layers done before, then the rest
        write_non_layer(source, sinks)
        replay_layers(resume, start, n, sinks, stats, on_layer)
    stats.timings["capture"] = time.perf_counter() - t0
    t_layers = time.perf_counter()
    reader = _LayerReader(source, layout, device, overlap)
    try:
        # layer i+1 read into the buffers layer i's tensors leave (no page faults on them after the first layer), and
        # its codes into the buffers the last written layer's codes left: at most one layer's bytes as stored (the
        # source dtype) and one of codes (a byte each) wait idle
        idle = layout.largest_layer_numel() * (source.dtype.itemsize + 1)
        with reusing_read_buffers(idle), WriteBehind(sinks, resume, overlap) as writer:
            if resume is None:
                # copied from the source shards in bounded chunks (none held whole) by the writing thread, first,
                # while the first layers are read and rounded: disk and CPU overlap
                writer.call(write_non_layer, source, sinks)
            for i in range(start, n):
                result = layer_result(source, recipe, i, reader.get(i, n), target_linears(source, recipe, i), stats.measured)
                stats.record(result)
                writer.put(result, None)
                done = LayerDone.of(result)
                del result
                release_freed_memory()
                if on_layer:
                    on_layer(i + 1, n, done)
    finally:
        reader.close()
    stats.timings["layers"] = time.perf_counter() - t_layers
    return stats
