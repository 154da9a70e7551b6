"""The sequential layer loop (docs/architecture.md): capture the inputs of layer 0, then per decoder layer: load it
from disk, run the recipe's steps phase by phase (transform, observe, solve), run the quantized layer to produce the
next layer's inputs, hand a LayerResult to the sinks, free it. Memory stays O(one layer). The loop never names an
algorithm: the steps registry (qtk.steps) says what runs, in which phase."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from qtk import interrupts
from qtk.errors import UsageError
from qtk.io.atomic import WriteBack
from qtk.model.moe import moe_blocks, report_starved_experts
from qtk.model.simulate import QLinear, engine_weight, set_kv_hook, use_qtk_attention
from qtk.pipeline.capture import capture_layer_inputs
from qtk.pipeline.device import Activations, activation_budget, compute_dtype, resolve_device
from qtk.pipeline.memory import bound_kernel_caches, map_large_allocations, release_freed_memory
from qtk.quant.finite import all_finite
from qtk.pipeline.result import LayerDone, LayerResult, PipelineStats
from qtk.quant.error import relative_error
from qtk.pipeline.targets import check_group_size, target_linears
from qtk.recipe import Recipe
from qtk.steps import LOCAL, LayerContext, Phase, Reducer, in_frame, needs_float_stream, plan_steps, source_view
from qtk.steps.records import ExpertTokensRecord
from qtk.steps.stats import ExpertTokens, KVAmax
from qtk.steps.swap import swap_in


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse a float tensor holding NaN/Inf (qtk.quant.finite.all_finite: the exact scan only when its sum is not
    finite)."""
    if t.is_floating_point() and not all_finite(t):
        raise UsageError(f"tensor {name} contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")


def write_non_layer(source, sinks: list) -> None:
    """The tensors outside the decoder layers (embeddings, final norm, lm_head) to every sink, which writes them as
    they are. One stored in the model dtype (or not a float) goes as its bytes on disk (a StoredTensor): each sink
    copies it in bounded chunks, every chunk checked for NaN/Inf as it is read, so the 1 GB embedding of Llama-3-8B is
    never whole in memory. One in another dtype is read whole, checked and converted."""
    from functools import partial

    for name in source.non_layer_tensor_names():
        check = partial(check_finite, name)
        dtype = source.tensor_dtype(name)
        if dtype == source.dtype or not dtype.is_floating_point:
            t = source.stored(name, check)
        else:
            t = source.tensor(name)
            check(t)
            t = t.to(source.dtype)
        for s in sinks:
            s.add_dense(name, t)
        del t


def replay_layers(resume, start: int, n: int, sinks, stats: PipelineStats, on_layer) -> None:
    """Feed the resume state's first `start` finished layers to fresh writers, as if they had just been computed."""
    for i in range(start):
        r = resume.load_layer(i)
        for s in sinks:
            s.add_layer(r)
        stats.record(r)
        if on_layer:
            on_layer(i + 1, n, LayerDone.of(r, replayed=True))


def _forward_all(layer, batches):
    """The layer's outputs for every batch, each kept where its input was (on the device, or spilled to the host)."""
    keep = batches.keep if isinstance(batches, Activations) else (lambda j, y: y)
    with torch.no_grad():
        return [(keep(j, layer(h, **kw)), kw) for j, (h, kw) in enumerate(batches)]


def runnable_steps(plan, batches) -> list:
    """The planned (step, params) that can run: steps that need data are skipped without calibration batches, except
    a solver, which nothing can stand in for."""
    out = []
    for step, params in plan:
        if step.needs_data and not batches:
            if step.phase is Phase.SOLVE:
                raise UsageError(f"{step.title} needs calibration data", f"remove the {step.name} step or give --calib")
            continue
        out.append((step, params))
    return out


def run_phase(ctx: LayerContext, steps, phase: Phase) -> None:
    """Run the steps of one phase on the layer, in plan order, keeping each one's record."""
    for step, params in steps:
        if step.phase is phase:
            record = step.run(ctx, params)
            if record is not None:
                ctx.records[step.name] = record


def _store_transformed(ctx: LayerContext) -> None:
    """Folded norms and biases are stored in the model dtype: from here on the layer computes with exactly what is
    stored (the quantized weights are replaced when solved)."""
    quantized_w = {t + ".weight" for t in ctx.targets}
    with torch.no_grad():
        for name, p in ctx.layer.named_parameters():
            if name not in quantized_w:
                p.copy_(p.to(ctx.dtype).float())


def process_layer(source, recipe: Recipe, i: int, layer: torch.nn.Module, batches, targets: list[str], *,
                  device=None, reducer: Reducer = LOCAL, float_batches=None):
    """Quantize one materialised layer; returns its LayerResult, the next layer's inputs and, given the float model's
    inputs to this layer (`float_batches`, for a step that reads the float stream), its hidden states after it."""
    arch, dtype = source.arch.at(i), source.dtype
    prefix = source.layer_prefix(i)
    for t in targets:
        if t not in dict(layer.named_modules()):
            raise UsageError(f"layer {i} has no module {t}", f"this checkpoint does not match the {arch.name} architecture table")

    ctx = LayerContext(i, prefix, layer, arch, recipe, targets, batches, dtype, resolve_device(device), reducer)
    steps = runnable_steps(plan_steps(recipe), batches)
    transformed = any(step.phase is Phase.TRANSFORM for step, _ in steps)
    if transformed:  # fp32 copies of the weights to quantize while transforms fold scales into them
        ctx.master = {t: layer.get_submodule(t).weight.detach().float() for t in targets}
    run_phase(ctx, steps, Phase.TRANSFORM)
    if transformed:
        _store_transformed(ctx)
    if float_batches is not None and batches:
        ctx.float_outputs = ctx.float_layer_outputs(float_batches)
    run_phase(ctx, steps, Phase.OBSERVE)
    # the weights as they enter the solver, the reference of the errors below (swap_in replaces, never writes)
    weights = ctx.master or {t: layer.get_submodule(t).weight.detach() for t in targets}
    run_phase(ctx, steps, Phase.SOLVE)
    qweights, amax, records = ctx.qweights, ctx.amax, ctx.records

    errors = {}
    reframed = any(step.changes_frame for step, _ in steps)  # the steps' records rebuild the frame they left
    for t, qt in qweights.items():
        check_finite(f"{prefix}{t}.weight", qt.scale)  # a NaN/Inf weight poisons its row's scale: cheaper than scanning W
        if batches and not isinstance(layer.get_submodule(t), QLinear):
            w_hat = swap_in(layer, t, qt, ctx.scheme(t).engine_activations, amax)  # the next layer sees what the engine computes
        else:
            w_hat = layer.get_submodule(t).weight if batches else engine_weight(qt)
        # measured against the source weight in the frame it was quantized in (smoothing folded, AWQ's clipping not:
        # it is part of the error), the reference `qtk inspect` rebuilds from the source and the records
        if reframed:
            w = in_frame(source.tensor(f"{prefix}{t}.weight").to(ctx.device).to(compute_dtype(source)).float(), t,
                         arch, records)
        else:
            w = weights[t].float()
        errors[prefix + t] = relative_error(w_hat, w)
        del w_hat, w
    del weights  # only the quantized layer is needed from here
    ctx.master = {}

    kv, next_batches = None, None
    if batches:
        kv, next_batches = _propagate(ctx)

    quantized = {t + ".weight" for t in targets}
    buffers = {k for k, _ in layer.named_buffers()}  # kept in their own dtype (a float32 routing bias)
    dense = {prefix + k: v.detach().to(v.dtype if k in buffers else dtype) for k, v in layer.state_dict().items()
             if k not in quantized}
    for k, v in dense.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise UsageError(f"tensor {k} contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")
    host = torch.device("cpu")  # what the sinks receive lives on the host, whatever the device the layer ran on
    result = LayerResult(
        index=i,
        qweights={prefix + t: q.to(host) for t, q in qweights.items()},
        dense={k: v.to(host) for k, v in dense.items()},
        input_amax={prefix + t: a for t, a in amax.items()},
        k_amax=None if kv is None else kv.k.value,
        v_amax=None if kv is None else kv.v.value,
        weight_error=errors,
        records={k: r for k, r in records.items() if r.to_json()},  # a step that chose nothing leaves no record
        dense_linears=tuple(prefix + m for m in (*arch.linears, *arch.dense_linears) if m not in targets),
    )
    return result, next_batches, ctx.float_outputs


def _propagate(ctx: LayerContext):
    """Run the quantized layer on its inputs: its outputs are the next layer's inputs. Observes K (after RoPE) and V
    for a quantized KV cache, and counts the tokens routed to each MoE expert. Returns (KVAmax | None, outputs)."""
    layer, arch, recipe = ctx.layer, ctx.arch, ctx.recipe
    kv = None
    if recipe.kv_cache is not None:
        kv = KVAmax()
        set_kv_hook(layer.get_submodule(arch.attn), kv)
    blocks = moe_blocks(layer, arch)
    for b in blocks.values():
        b.reset_counts()
    next_batches = _forward_all(layer, ctx.batches)
    if blocks:  # tokens each expert received on the calibration set (with the quantized layer upstream)
        experts = ExpertTokens()
        for n, b in blocks.items():
            experts.update(ctx.prefix + n, b.routed)
        counts = experts.reduce(ctx.reducer).as_lists()
        ctx.records["expert_tokens"] = ExpertTokensRecord(counts)
        report_starved_experts(counts, recipe.calibration.min_expert_tokens)
    if kv is not None:
        set_kv_hook(layer.get_submodule(arch.attn), None)
        kv.reduce(ctx.reducer)
    return kv, next_batches


def run(source, recipe: Recipe, calib_ids: torch.Tensor | None, sinks: list, *, batch_size: int = 8,
        on_layer: Callable[[int, int, LayerDone], None] | None = None, resume=None, device=None,
        reducer: Reducer = LOCAL, max_device_memory: int | None = None, overlap: bool = True,
        images=None) -> PipelineStats:
    """Stream the model through the recipe into every sink (writer): dense tensors, then layer by layer.

    on_layer(done, total, LayerDone) after each layer. resume: a qtk.convert.resume.ResumeState; completed layers
    are replayed from it and each new one saved to it. device: where layers, activations and statistics live (default
    the CPU); what the sinks receive is on the host. reducer: how statistics of several processes combine (LOCAL:
    one process); with several, calib_ids are this process's windows, and only the process that writes passes sinks
    and resume. max_device_memory: bytes of calibration activations kept on the device (the rest wait in pinned host
    memory). overlap: load layer i+1 and write layer i in background threads while layer i computes (the same
    bytes are written either way: each sink sees the layers in order, from one thread). images: the image inputs of
    image+text calibration windows (qtk.calib_images.ImageInputs)."""
    device = resolve_device(device)
    stats = PipelineStats()
    source = source_view(source, recipe)  # the job's own view already (a view of a view is itself)
    check_group_size(source, recipe)
    if calib_ids is not None:
        map_large_allocations()
        bound_kernel_caches()  # before the first forward: per-expert GEMM shapes would fill oneDNN's caches
    t0 = time.perf_counter()
    skeleton = source.skeleton()
    if calib_ids is not None:
        use_qtk_attention(skeleton)
    if sinks:  # a process that writes nothing need not read them
        write_non_layer(source, sinks)
    batches, layer_kwargs = (capture_layer_inputs(source, skeleton, calib_ids, batch_size, device, images)
                             if calib_ids is not None else (None, None))
    stats.timings["capture"] = time.perf_counter() - t0

    n = source.num_layers
    completed = resume.completed if resume is not None else 0
    start = min(int(reducer.broadcast_object(completed)), n)  # the writing process's resume state decides
    keep_hidden = bool(reducer.broadcast_object(resume is not None))
    if resume is not None:  # only the writing process holds the state; the others just skip to `start`
        replay_layers(resume, start, n, sinks, stats, on_layer)
    # the float model's own hidden states, carried beside the quantized model's for a step that reads them (AutoRound's
    # target); at layer 0 both streams are the embeddings' outputs
    floats = [h for h, _ in batches] if batches is not None and needs_float_stream(recipe) else None
    if batches is not None and 0 < start < n:
        hidden, saved_floats = resume.load_hidden(floats is not None) if resume is not None else (None, None)
        batches = [(h.to(device), kw) for h, (_, kw) in zip(_scatter_hidden(hidden, len(batches), reducer), batches)]
        if floats is not None:
            floats = [h.to(device) for h in _scatter_hidden(saved_floats, len(floats), reducer)]
    t_layers = time.perf_counter()
    with LayerPrefetch(source, skeleton, device, overlap) as prefetch, WriteBehind(sinks, resume, overlap) as writer:
        for i in range(start, n):
            targets = target_linears(source, recipe, i)
            layer = prefetch.get(i, n)
            float_batches = None
            if batches is not None:
                budget = activation_budget(device, _module_bytes(layer), max_device_memory)
                if floats is not None and budget is not None:  # two streams share what the device can hold
                    budget //= 2
                batches = Activations(list(zip([h for h, _ in batches], layer_kwargs[i])), device, budget)
                stats.spilled_batches += batches.spilled
                if floats is not None:
                    float_batches = Activations(list(zip(floats, layer_kwargs[i])), device, budget)
                    stats.spilled_batches += float_batches.spilled
            result, batches, floats = process_layer(source, recipe, i, layer, batches, targets, device=device,
                                                    reducer=reducer, float_batches=float_batches)
            del layer, float_batches
            stats.record(result)
            hidden = None
            if keep_hidden and batches is not None:
                hidden = (_gather_hidden([h for h, _ in batches], reducer),
                          None if floats is None else _gather_hidden(floats, reducer))
            writer.put(result, hidden)
            done = LayerDone.of(result)
            del result, hidden
            release_freed_memory()
            if on_layer:
                on_layer(i + 1, n, done)
    stats.timings["layers"] = time.perf_counter() - t_layers
    return stats


def _module_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _gather_hidden(hidden: list[torch.Tensor], reducer: Reducer) -> list[torch.Tensor] | None:
    """Every process's next-layer inputs on the writing process (rank order), for its resume state; None elsewhere."""
    host = [h.cpu() for h in hidden]
    if reducer.world_size == 1:
        return host
    parts = reducer.gather_objects(host)
    return None if parts is None else [h for part in parts for h in part]


def _scatter_hidden(hidden: list[torch.Tensor] | None, count: int, reducer: Reducer) -> list[torch.Tensor]:
    """This process's share (`count` batches) of the hidden states the writing process read from its resume state."""
    if reducer.world_size == 1:
        return hidden
    counts = reducer.gather_objects(count)
    parts = None
    if counts is not None:
        if len(hidden) != sum(counts):
            raise UsageError("the resume state was written by a run with other calibration batches per process",
                             "rerun with the same number of processes and --batch-size, or without --resume")
        offsets = [sum(counts[:r]) for r in range(len(counts))]
        parts = [hidden[o:o + c] for o, c in zip(offsets, counts)]
    return reducer.scatter_objects(parts)


def background(fn, *args, name: str = "qtk-prefetch") -> Future:
    """fn(*args) in a daemon thread: a read ahead that a failure or Ctrl-C abandons is never waited for (an executor's
    threads are joined at exit; a stalled read would hold the process)."""
    f: Future = Future()

    def target():
        if f.set_running_or_notify_cancel():
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (raised where the result is asked for)
                f.set_exception(e)

    threading.Thread(target=target, name=name, daemon=True).start()
    return f


class LayerPrefetch:
    """Decoder layer i+1 read from disk (and copied to the device) in a background thread while layer i computes.
    Holds at most one layer ahead; an error reading it (a NaN, a truncated shard) is raised when it is asked for."""

    def __init__(self, source, skeleton, device, enabled: bool = True):
        self.source, self.skeleton, self.device = source, skeleton, device
        self.dtype = compute_dtype(source)
        self.enabled = enabled
        self.ahead: tuple[int, Future] | None = None

    def _load(self, i: int):
        return self.source.layer(self.skeleton, i, self.dtype, device=self.device)

    def get(self, i: int, n: int) -> torch.nn.Module:
        interrupts.check()  # a Ctrl-C a finalizer swallowed ends the run here, not after waiting for the read
        if self.ahead is not None and self.ahead[0] == i:
            layer = self.ahead[1].result()
        else:
            layer = self._load(i)
        self.ahead = None
        if self.enabled and i + 1 < n:
            self.ahead = (i + 1, background(self._load, i + 1))
        return layer

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.ahead = None  # after a failure a read in flight is abandoned (its thread is a daemon)


class WriteBehind:
    """Layer i handed to the sinks (and saved to the resume state) in a background thread while layer i+1
    computes. One write in flight at a time and one thread, so every sink sees the layers in order, exactly as a
    synchronous loop hands them; a failed write is raised at the next put or at the end. On any failure of the loop
    the write in flight finishes first (a Ctrl-C leaves the resume state at the last layer handed over). What the
    writers wrote is written back to disk while the next layer computes (qtk.io.atomic.WriteBack)."""

    def __init__(self, sinks: list, resume, enabled: bool = True):
        self.sinks, self.resume = sinks, resume
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="qtk-write") if enabled else None
        self.pending: Future | None = None
        # what was written goes to disk while the next layer computes (qtk.io.atomic.WriteBack), not all at the end
        self.writeback = WriteBack() if enabled else None

    def _then_write_back(self, fn: Callable, *args) -> None:
        fn(*args)
        files = [f for s in self.sinks for f in (s.open_files() if hasattr(s, "open_files") else ())]
        if files:
            self.writeback.request(files)

    def _write(self, result: LayerResult, hidden) -> None:
        for s in self.sinks:
            s.add_layer(result)
        if self.resume is not None:  # hidden: (the quantized model's next inputs, the float model's or None) or None
            quantized, floats = hidden if hidden is not None else (None, None)
            self.resume.save_layer(result, quantized, floats)

    def put(self, result: LayerResult, hidden) -> None:
        self.call(self._write, result, hidden)

    def call(self, fn: Callable, *args) -> None:
        """fn(*args) in the writing thread, after what was handed over before it and before what comes after (the
        data-free stream's passthrough tensors, copied while the first layers are rounded)."""
        self.wait()
        if self.pool is None:
            fn(*args)
        else:
            self.pending = self.pool.submit(self._then_write_back, fn, *args)

    def wait(self) -> None:
        if self.pending is not None:
            f, self.pending = self.pending, None
            f.result()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.wait()
            elif self.pending is not None:
                self.pending.exception()  # let it finish; the loop's own error is the one reported
                self.pending = None
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
                try:
                    self.writeback.close()  # a disk error of an early flush ends the run (the final fsync misses it)
                except BaseException:
                    if exc_type is None:
                        raise
