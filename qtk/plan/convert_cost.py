"""What `qtk convert` will take: peak host and device memory and wall time for a recipe, on the CPU or on GPUs, in
one or several processes (torchrun), from the model's shapes and a cost model.

Time = the larger of disk time (source read once, output written once: layers are read ahead and written behind
while they compute) and compute time (calibration forwards, GPTQ solves), divided over the processes; plus the
Hessians' all-reduce between processes. The constants and where they were measured:

- CPU_*: benchmarks/convert_cost.py on the shared 2-core CPU machine this was written on
  (benchmarks/results/convert_cost.json: bf16 GEMM 3.1 GFLOP/s, fp32 GPTQ 0.45 GFLOP/s, read 292 MB/s, write
  175 MB/s, 2 torch threads, other sessions running). A different CPU: rerun it and scale.
- GPU_*: NOT measured (no GPU was available): fractions of the GPU's dense bf16 peak (qtk.plan.hardware) assumed
  for calibration forwards (35 %) and GPTQ's fp32 solves (3 %: fp32 without TF32, small triangular solves);
  benchmarks/convert_gpu.py measures what they should be replaced with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qtk.plan.memory import ConversionMemory, ModelShape, model_tensors, scheme_of

CPU_GEMM_FLOPS = 3.1e9
CPU_SOLVE_FLOPS = 0.45e9
CPU_READ_BPS = 292e6
CPU_WRITE_BPS = 175e6
GPU_GEMM_EFFICIENCY = 0.35
GPU_SOLVE_EFFICIENCY = 0.03
GPU_LINK_BPS = 50e9  # NCCL all-reduce bandwidth between GPUs (assumed; NVLink nodes reach more)
CPU_LINK_BPS = 1e9  # gloo on one host (assumed)


@dataclass
class ConversionEstimate:
    device: str  # "cpu" or the GPU's name
    processes: int
    host_peak: int  # bytes, per process
    device_peak: int  # bytes, per GPU (0 on the CPU)
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)  # seconds: read, write, forward, solve, reduce
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"device": self.device, "processes": self.processes, "host_peak": self.host_peak,
                "device_peak": self.device_peak, "seconds": round(self.seconds, 1),
                "parts": {k: round(v, 2) for k, v in self.parts.items()}, "notes": list(self.notes)}


def estimate_conversion(s: ModelShape, recipe, mem: ConversionMemory, source_bytes: int, output_bytes: int, *,
                        gpu=None, processes: int = 1) -> ConversionEstimate:
    """The estimate for `recipe` (None: nothing to convert) on `gpu` (a qtk.plan.hardware.GPU; None: the CPU) in
    `processes` processes. mem: conversion_memory's figures (one process holding every calibration window)."""
    specs = model_tensors(s)
    layers = max(s.layers, 1)
    lin = [x for x in specs if x.role == "linear" and x.layer is not None]
    layer_params = sum(x.numel for x in lin) / layers
    notes = []
    forward = solve = reduce_bytes = 0.0
    if recipe is not None and recipe.needs_calibration:
        n, t = recipe.calibration.num_samples, recipe.calibration.seq_len
        tokens = n * t
        steps = set(recipe.step_names)
        # forwards of each layer over every token: the propagation, plus one per step that observes its inputs
        passes = 1 + sum(1 for st in ("gptq", "smoothquant", "awq") if st in steps)
        if recipe.activations is not None and not recipe.activations.dynamic:
            passes += 1  # static activation ranges are observed
        attention = 4 * tokens * t * s.hidden  # QK^T and AV of each window
        forward = passes * (2 * layer_params * tokens + attention) * layers
        if "gptq" in steps:
            groups = {}
            for x in lin:
                if scheme_of(recipe, x.name) is None:
                    continue
                key = (x.layer, x.input_group)
                rows, inn = groups.get(key, (0, x.shape[1]))
                groups[key] = (rows + x.shape[0] * x.count, inn)
            solve = sum(inn ** 3 + rows * inn ** 2 for rows, inn in groups.values())
            reduce_bytes = sum(4 * inn * inn for _, inn in groups.values())
        if "awq" in steps:
            forward += 20 * 2 * layer_params * min(tokens, 4096) * layers  # the scale grid on the token sample
    if gpu is None:
        gemm, solve_rate, link, name = CPU_GEMM_FLOPS, CPU_SOLVE_FLOPS, CPU_LINK_BPS, "cpu"
    else:
        peak = gpu.peak_flops(None)
        gemm, solve_rate, link, name = peak * GPU_GEMM_EFFICIENCY, peak * GPU_SOLVE_EFFICIENCY, GPU_LINK_BPS, gpu.name
    p = max(processes, 1)
    parts = {"read": source_bytes / CPU_READ_BPS, "write": output_bytes / CPU_WRITE_BPS,
             "forward": forward / gemm / p, "solve": solve / solve_rate / p,
             "reduce": (reduce_bytes * 2 * (p - 1) / p) / link if p > 1 else 0.0}
    seconds = max(parts["read"] + parts["write"], parts["forward"] + parts["solve"] + parts["reduce"])
    seconds += (parts["read"] + parts["write"]) / layers  # the first read and the last write do not overlap
    per_process_acts = mem.calibration // p
    layer = mem.layer_fp32
    if gpu is None:
        host = mem.embeddings + 2 * layer + per_process_acts + mem.hessians + mem.awq_cache
        device_peak = 0
    else:
        # one layer (+ the next read ahead) and its solver state on the GPU, the activations while they fit
        device_peak = min(2 * layer + mem.hessians + mem.awq_cache + per_process_acts, int(gpu.mem_bytes * 0.9))
        spilled = max(0, 2 * layer + mem.hessians + mem.awq_cache + per_process_acts - device_peak)
        host = mem.embeddings + layer + spilled  # the layer read ahead and the one written behind, 16-bit
        if spilled:
            notes.append(f"{spilled / 1e9:.1f} GB of calibration activations per process wait in pinned host memory")
    if p > 1:
        notes.append(f"each of {p} processes holds 1/{p} of the calibration windows; rank 0 writes")
    return ConversionEstimate(name, p, int(host), int(device_peak), seconds, parts, tuple(notes))
