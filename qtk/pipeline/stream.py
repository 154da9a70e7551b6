"""Data-free recipes (fp8-dynamic, w8a16, w4a16 round-to-nearest, any recipe whose only step is `rtn` and that
keeps no KV cache statistics) at disk speed: no decoder layer is materialised as a module. Each layer's tensors are
read by name (the next layer's in a background thread, onto the device), its Linears rounded to nearest there, the
per-weight error taken from the QTensor just made (no second read), and the LayerResult written while the next layer
is read and quantized. The result is the one qtk.pipeline.loop.run builds for these recipes, byte for byte: the
same tensors in the same dtypes and order (the meta skeleton's, which `qtk convert` checks before any work)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from qtk.errors import UsageError
from qtk.model.simulate import engine_weight
from qtk.pipeline.device import compute_dtype, resolve_device
from qtk.pipeline.loop import WriteBehind, background, relative_error, replay_layers, runnable_steps
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


def _finite(name: str, t: torch.Tensor) -> None:
    # a sum is non-finite whenever a NaN/Inf is present; the exact scan runs only then
    if t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        raise UsageError(f"tensor {name} contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")


class _LayerReader:
    """Layer i+1's tensors read (and moved to the device, in the compute dtype) in a background thread."""

    def __init__(self, source, skeleton, device, enabled: bool):
        self.source, self.device, self.dtype = source, device, compute_dtype(source)
        self.layers = skeleton.get_submodule(source.arch.layers)
        self.enabled = enabled
        self.ahead = None

    def _read(self, i: int) -> dict[str, torch.Tensor]:
        """name (relative) -> tensor, in the layer module's state_dict order, as ModelSource.load_module loads it."""
        prefix = self.source.layer_prefix(i)
        out = {}
        for k, v in self.layers[i].state_dict(keep_vars=True).items():
            if v.is_meta:  # a parameter: from the checkpoint
                t = self.source.tensor(prefix + k)
                t = t.to(self.dtype) if self.device.type == "cpu" else t.to(device=self.device, dtype=self.dtype)
                _finite(prefix + k, t)
                out[k] = t
            else:  # a persistent buffer the skeleton computed
                out[k] = v.detach().to(self.device)
        return out

    def get(self, i: int, n: int) -> dict[str, torch.Tensor]:
        tensors = self.ahead[1].result() if self.ahead is not None and self.ahead[0] == i else self._read(i)
        self.ahead = None
        if self.enabled and i + 1 < n:
            self.ahead = (i + 1, background(self._read, i + 1, name="qtk-read"))
        return tensors

    def close(self) -> None:
        self.ahead = None  # a read in flight after a failure is abandoned (a daemon thread)


def layer_result(source, recipe: Recipe, i: int, tensors: dict[str, torch.Tensor], targets: list[str],
                 measured: dict | None = None) -> LayerResult:
    """The LayerResult of layer i from its tensors (relative name -> tensor in the compute dtype). measured: filled
    with what the self-check needs of each quantized Linear (qtk.pipeline.result.Measured), taken from the one dequantization
    that gives its error, so the check need not read the source or dequantize again."""
    from qtk.pipeline.result import Measured
    from qtk.quant.qtensor import qtensor_digest

    arch, dtype, prefix = source.arch, source.dtype, source.layer_prefix(i)
    # model-dtype weights: rtn_weights makes each one's float32 copy where it rounds it, one at a time, and hands
    # it to `measure` with its QTensor while it is alive: one dequantization gives the error and the self-check's figures
    weights = {t: tensors[t + ".weight"] for t in targets}
    schemes = {t: recipe.scheme_for(prefix + t).weights for t in targets}
    errors = {}
    host = torch.device("cpu")

    def measure(t: str, w32: torch.Tensor, qt) -> None:
        if not torch.isfinite(qt.scale).all():
            raise UsageError(f"tensor {prefix + t}.weight contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")
        w_hat = engine_weight(qt)
        errors[prefix + t] = relative_error(w_hat, w32)
        if measured is not None:  # max |w| from one min/max pass (NaN in both when present), no |w| copy
            lo, hi = torch.aminmax(w_hat) if w_hat.numel() else (torch.zeros(()), torch.zeros(()))
            measured[prefix + t] = Measured(qtensor_digest(qt.to(host)), errors[prefix + t], max(-float(lo), float(hi)))

    qweights = rtn.rtn_weights(weights, schemes, arch, dtype, measure)
    errors = {prefix + t: errors[prefix + t] for t in qweights}  # in the QTensors' order, as before
    quantized = {t + ".weight" for t in targets}
    dense = {prefix + k: v.detach().to(dtype).to(host) for k, v in tensors.items() if k not in quantized}
    return LayerResult(index=i, qweights={prefix + t: q.to(host) for t, q in qweights.items()}, dense=dense,
                       input_amax={}, k_amax=None, v_amax=None, weight_error=errors, records={},
                       dense_linears=tuple(prefix + m for m in (*arch.linears, *arch.dense_linears) if m not in targets))


def run_data_free(source, recipe: Recipe, sinks: list, *, on_layer: Callable[[int, int, LayerDone], None] | None = None,
                  resume=None, device=None, overlap: bool = True) -> PipelineStats:
    """qtk.pipeline.run for a recipe `streams` accepts (same arguments, no calibration), without modules."""
    device = resolve_device(device)
    stats = PipelineStats()
    check_group_size(source, recipe)
    t0 = time.perf_counter()
    skeleton = source.skeleton()  # built and checked before any work already: its layer modules give names and order
    for name in source.non_layer_tensor_names():
        t = source.tensor(name)
        _finite(name, t)  # no bool copy of an embedding (0.5 GB on Llama-3-8B) unless its sum is not finite
        for s in sinks:
            s.add_dense(name, t.to(source.dtype) if t.is_floating_point() else t)
        del t
    stats.timings["capture"] = time.perf_counter() - t0
    n = source.num_layers
    start = min(resume.completed, n) if resume is not None else 0
    if resume is not None:
        replay_layers(resume, start, n, sinks, stats, on_layer)
    t_layers = time.perf_counter()
    reader = _LayerReader(source, skeleton, device, overlap)
    try:
        with WriteBehind(sinks, resume, overlap) as writer:
            for i in range(start, n):
                result = layer_result(source, recipe, i, reader.get(i, n), target_linears(source, recipe, i), stats.measured)
                stats.record(result)
                writer.put(result, None)
                done = LayerDone.of(result)
                del result
                if on_layer:
                    on_layer(i + 1, n, done)
    finally:
        reader.close()
    stats.timings["layers"] = time.perf_counter() - t_layers
    return stats
