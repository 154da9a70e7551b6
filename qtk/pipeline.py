"""The sequential calibration loop (DESIGN.md §1): capture the inputs of layer 0, then per decoder layer:
load it from disk, observe its inputs, quantize it, run the quantized layer to produce the next
layer's inputs, hand a LayerResult to the writers, free it. Memory stays O(one layer)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from qtk.errors import UsageError
from qtk.model.moe import moe_blocks, report_starved_experts
from qtk.model.simulate import (
    KVAmax,
    QLinear,
    engine_weight,
    replace_module,
    set_kv_hook,
    use_qtk_attention,
)
from qtk.quant.qtensor import QTensor
from qtk.recipe import Recipe


@dataclass
class LayerResult:
    """Everything a writer needs for one decoder layer. Writers read it and never modify it."""

    index: int
    qweights: dict[str, QTensor]  # full module name -> QTensor
    dense: dict[str, torch.Tensor]  # full tensor name -> tensor in the model dtype (norms, biases, ignored Linears)
    input_amax: dict[str, float] = field(default_factory=dict)  # full module name -> calibrated |x| max
    k_amax: float | None = None  # K after RoPE, this layer
    v_amax: float | None = None
    weight_error: dict[str, float] = field(default_factory=dict)  # full module name -> ||W - Q(W)|| / ||W||
    records: dict = field(default_factory=dict)  # small search results (smoothing scales, clips, GPTQ damping)


class _StopForward(Exception):
    """Raised by the layer-0 catcher: the rest of the model need not (and cannot, on meta) run."""


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer `index`: records the kwargs the model passes it (masks and rotary
    embeddings differ per layer type, e.g. sliding-window layers), and the hidden states at layer 0."""

    def __init__(self, store: list, index: int, last: bool, attention_type=None):
        super().__init__()
        self.store, self.index, self.last = store, index, last
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, hidden_states, *args, **kwargs):
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        kwargs["use_cache"] = False
        self.store.append((self.index, hidden_states, kwargs))
        if self.last:
            raise _StopForward
        return hidden_states


def matches(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors-style ignore: exact name, a dotted suffix, or 're:' regex (full match)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def target_linears(source, recipe: Recipe, i: int) -> list[str]:
    """The layer's Linears (relative names) that the recipe quantizes; an ignore that splits a fused
    group (q/k/v, gate/up) is refused, since engines fuse those into one GEMM."""
    arch = source.arch
    prefix = source.layer_prefix(i)
    kept = [r for r in arch.linears if not matches(prefix + r, recipe.ignore)]
    for g in arch.fusion_groups:
        inside = [m for m in g if m in kept]
        if inside and len(inside) != len(g):
            raise UsageError(f"ignore splits the fused group {', '.join(g)} in layer {i}",
                             "ignore all of q/k/v (or gate/up) together, or none")
    return kept


GROUP_SIZES = (256, 128, 64, 32, 16)  # what the engines' group-wise kernels are built for, largest first


def check_group_size(source, recipe: Recipe) -> None:
    """Every targeted Linear's in_features (from the safetensors headers, no data read) must be a multiple of the
    recipe's group size; refused before any work, suggesting only group sizes that divide all of them."""
    import math

    w = recipe.weights
    if w.strategy != "group":
        return
    sizes: dict[int, str] = {}  # in_features -> the first Linear with it
    for i in range(source.num_layers):
        prefix = source.layer_prefix(i)
        for t in target_linears(source, recipe, i):
            name = f"{prefix}{t}.weight"
            if name not in source.weight_map:
                continue  # the skeleton check names missing tensors
            shape = source.shape(name)
            if len(shape) == 2:
                sizes.setdefault(int(shape[1]), prefix + t)
    bad = {n: m for n, m in sizes.items() if n % w.group_size}
    if not bad:
        return
    n, m = min(bad.items())
    common = math.gcd(*sizes)
    fits = [g for g in GROUP_SIZES if common % g == 0 and g != w.group_size][:2]
    fix = (f"use group_size {' or '.join(map(str, fits))} (they divide every quantized Linear's input size: "
           f"{', '.join(map(str, sorted(sizes)))})" if fits else
           f"no group size of {', '.join(map(str, GROUP_SIZES))} divides every input size ({', '.join(map(str, sorted(sizes)))}): "
           "use strategy: channel, or ignore the Linears that do not fit")
    raise UsageError(f"group_size {w.group_size} does not divide in_features {n} of {m}", fix)


def compute_dtype(source) -> torch.dtype:
    """The dtype calibration forwards run in: the model's (bf16 matmuls are several times faster than fp32 on
    CPUs, and it is what the engine runs), except float16, whose range real activations can overflow."""
    return torch.float32 if source.dtype == torch.float16 else source.dtype


def capture_layer_inputs(source, skeleton, ids: torch.Tensor, batch_size: int):
    """Run embeddings (+ rotary, masks) once per batch with every layer replaced by a catcher.

    Returns (batches, layer_kwargs): batches = [(hidden states into layer 0, its kwargs)] and
    layer_kwargs[i][b] = the kwargs layer i gets for batch b (shared tensors, so this costs no memory)."""
    arch = source.arch
    embed_meta = skeleton.get_submodule(arch.embed)
    replace_module(skeleton, arch.embed, source.load_module(embed_meta, arch.embed + ".", compute_dtype(source)))
    layers = skeleton.get_submodule(arch.layers)
    originals = list(layers)
    store: list = []
    n = len(originals)
    for i, layer in enumerate(originals):
        layers[i] = _Catcher(store, i, i == n - 1, getattr(layer, "attention_type", None))
    try:
        with torch.no_grad():
            for batch in ids.split(batch_size):
                try:
                    skeleton(input_ids=batch, use_cache=False)
                except _StopForward:
                    pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        replace_module(skeleton, arch.embed, embed_meta)
    batches = [(h, kw) for i, h, kw in store if i == 0]
    layer_kwargs = [[kw for j, _, kw in store if j == i] for i in range(n)]
    return batches, layer_kwargs


def _forward_all(layer, batches):
    with torch.no_grad():
        return [(layer(h, **kw), kw) for h, kw in batches]


def process_layer(source, recipe: Recipe, i: int, layer: torch.nn.Module, batches, targets: list[str]):
    """Quantize one materialised layer; returns its LayerResult and the next layer's inputs."""
    from qtk import calibrate as cal

    arch, dtype = source.arch, source.dtype
    prefix = source.layer_prefix(i)
    for t in targets:
        if t not in dict(layer.named_modules()):
            raise UsageError(f"layer {i} has no module {t}", f"this checkpoint does not match the {arch.name} architecture table")

    records: dict = {}
    steps = {s.name: s.params for s in recipe.algorithm}
    # fp32 copies of the weights to quantize while smoothing folds scales into them (the layer keeps rounded ones)
    smoothing = batches and ("smoothquant" in steps or "awq" in steps)
    master = {t: layer.get_submodule(t).weight.detach().float() for t in targets} if smoothing else {}
    if batches and "smoothquant" in steps:
        records["smoothquant"] = cal.apply_smoothquant(layer, arch, targets, batches, steps["smoothquant"], master)
    if batches and "awq" in steps:
        records["awq"] = cal.apply_awq(layer, arch, targets, batches, recipe, steps["awq"], dtype, master)
    if records:  # folded norms/biases are stored in the model dtype: propagate exactly what is stored
        quantized_w = {t + ".weight" for t in targets}
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name not in quantized_w:
                    p.copy_(p.to(dtype).float())
    amax = cal.observe_input_amax(layer, arch, targets, batches) if (batches and recipe.static_activations) else {}
    weights = master or {t: layer.get_submodule(t).weight.detach() for t in targets}  # swap_in replaces, never writes
    if "gptq" in steps:
        if not batches:
            raise UsageError("GPTQ needs calibration data", "remove the gptq step or give --calib")
        qweights, records["gptq"] = cal.gptq_weights(layer, arch, targets, batches, recipe, steps["gptq"], dtype, prefix,
                                                     amax, master)
    else:
        qweights = cal.rtn_weights({t: w.float() for t, w in weights.items()}, recipe, arch, dtype)

    errors = {}
    for t, qt in qweights.items():
        if not torch.isfinite(qt.scale).all():  # a NaN/Inf weight poisons its row's scale: cheaper than scanning W
            raise UsageError(f"tensor {prefix + t}.weight contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")
        if batches and not isinstance(layer.get_submodule(t), QLinear):
            w_hat = cal.swap_in(layer, t, qt, recipe, amax)  # the next layer sees what the engine computes
        else:
            w_hat = layer.get_submodule(t).weight if batches else engine_weight(qt)
        w = weights[t].float()
        errors[prefix + t] = float((w_hat.float() - w).norm() / w.norm().clamp_min(1e-12))
        del w_hat
    del weights, master  # only the quantized layer is needed from here

    kv = None
    next_batches = None
    if batches:
        if recipe.kv_cache is not None:
            kv = KVAmax()
            set_kv_hook(layer.get_submodule(arch.attn), kv)
        blocks = moe_blocks(layer, arch)
        for b in blocks.values():
            b.reset_counts()
        next_batches = _forward_all(layer, batches)
        if blocks:  # tokens each expert received on the calibration set (with the quantized layer upstream)
            records["expert_tokens"] = {prefix + n: b.routed.tolist() for n, b in blocks.items()}
            report_starved_experts(records["expert_tokens"], recipe.calibration.min_expert_tokens)
        if kv is not None:
            set_kv_hook(layer.get_submodule(arch.attn), None)

    quantized = {t + ".weight" for t in targets}
    dense = {prefix + k: v.detach().to(dtype) for k, v in layer.state_dict().items() if k not in quantized}
    for k, v in dense.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise UsageError(f"tensor {k} contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")
    result = LayerResult(
        index=i,
        qweights={prefix + t: q for t, q in qweights.items()},
        dense=dense,
        input_amax={prefix + t: a for t, a in amax.items()},
        k_amax=None if kv is None else kv.k,
        v_amax=None if kv is None else kv.v,
        weight_error=errors,
        records={k: v for k, v in records.items() if v},
    )
    return result, next_batches


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


def _release_freed_memory() -> None:
    """Hand memory freed with the last layer back to the OS. glibc keeps freed heap chunks (and raises its
    mmap threshold after large frees), so without this RSS creeps up layer by layer although nothing is held."""
    if _glibc():
        _libc.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 16 << 20


def _map_large_allocations() -> None:
    """Serve every allocation of 16 MiB or more (wide activations, Hessians, GPTQ buffers) from its own mmap,
    returned to the OS when freed. glibc's default threshold grows up to 32 MiB after large frees, and the heap then
    keeps tensors freed during a layer. Measured (SmoothQuant+GPTQ, 2 layers): hidden 2048 peak RSS 1293-1334 ->
    1176-1196 MB at about the same speed; hidden 1024 unchanged in time. A 4-8 MiB threshold saved more memory but
    made hidden-1024 layers 25-45% slower (page faults on every activation). Process-wide and left in place."""
    if MMAP_THRESHOLD_BYTES and _glibc():
        _libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


_libc = None


@dataclass
class PipelineStats:
    """Small per-layer records kept for the manifest (reports, plots), not the tensors."""

    timings: dict[str, float] = field(default_factory=dict)
    layers: int = 0
    weight_error: dict[str, float] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    kv_amax: dict[int, list[float]] = field(default_factory=dict)
    records: dict[int, dict] = field(default_factory=dict)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # MoE block -> calibration tokens per expert

    def record(self, r: LayerResult) -> None:
        self.layers += 1
        self.weight_error.update(r.weight_error)
        self.input_amax.update(r.input_amax)
        if r.k_amax is not None:
            self.kv_amax[r.index] = [r.k_amax, r.v_amax]
        if r.records:
            self.records[r.index] = r.records
            self.expert_tokens.update(r.records.get("expert_tokens", {}))


def run(source, recipe: Recipe, calib_ids: torch.Tensor | None, sinks: list, *, batch_size: int = 8,
        on_layer: Callable[[int, int], None] | None = None, resume=None) -> PipelineStats:
    """Stream the model through the recipe into every sink (writer): dense tensors, then layer by layer.

    resume: a qtk.resume.ResumeState; completed layers are replayed from it and each new one saved to it."""
    stats = PipelineStats()
    check_group_size(source, recipe)
    if calib_ids is not None:
        _map_large_allocations()
    t0 = time.perf_counter()
    skeleton = source.skeleton()
    if calib_ids is not None:
        use_qtk_attention(skeleton)
    for name in source.non_layer_tensor_names():
        t = source.tensor(name)
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise UsageError(f"tensor {name} contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")
        for s in sinks:
            s.add_dense(name, t.to(source.dtype) if t.is_floating_point() else t)
    batches, layer_kwargs = capture_layer_inputs(source, skeleton, calib_ids, batch_size) if calib_ids is not None else (None, None)
    stats.timings["capture"] = time.perf_counter() - t0

    n = source.num_layers
    start = 0
    if resume is not None and resume.completed:
        start = min(resume.completed, n)
        for i in range(start):  # replay finished layers into fresh writers
            r = resume.load_layer(i)
            for s in sinks:
                s.add_layer(r)
            stats.record(r)
            if on_layer:
                on_layer(i + 1, n)
        if batches is not None and start < n:
            batches = [(h, kw) for h, (_, kw) in zip(resume.load_hidden(), batches)]
    t_layers = time.perf_counter()
    for i in range(start, n):
        targets = target_linears(source, recipe, i)
        layer = source.layer(skeleton, i, compute_dtype(source))
        if batches is not None:
            batches = [(h, kw) for (h, _), kw in zip(batches, layer_kwargs[i])]
        result, batches = process_layer(source, recipe, i, layer, batches, targets)
        del layer
        for s in sinks:
            s.add_layer(result)
        stats.record(result)
        _release_freed_memory()
        if resume is not None:
            resume.save_layer(result, None if batches is None else [h for h, _ in batches])
        del result
        if on_layer:
            on_layer(i + 1, n)
    stats.timings["layers"] = time.perf_counter() - t_layers
    return stats
