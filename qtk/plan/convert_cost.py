"""What `qtk convert` will take: peak host and device memory and wall time for a recipe, on the CPU or on GPUs, in
one or several processes (torchrun), from the model's shapes and a cost model.

Time = the larger of disk time (source read once, output written once: layers are read ahead and written behind
while they compute) and compute time (calibration forwards, each step's own work as the step declares it
(qtk.recipe.params: StepParams.cost), or a data-free recipe's streaming), divided over the processes; plus the
solvers' all-reduce between processes. The constants and where they were measured:

- CPU_*: benchmarks/convert_cost.py on a 2-core AVX512-BF16 CPU VM (benchmarks/results/convert_cost.json: bf16 GEMM,
  fp32 GPTQ solves, disk read and write with fsync, 2 torch threads). A different CPU: rerun it and scale.
- CPU_STREAM_PARAMS_PER_S: a data-free recipe's stream (qtk.pipeline.stream: rounding by qtk's native kernels, the
  decode and error in the same pass, packing, the page-cache copies, the self-check reading every written Linear back,
  the write-back it overlaps) per parameter of the decoder layers, by weight format (Format.stream_key; a format not
  measured is planned at the slowest rate): benchmarks/convert_io.py on Llama-3-8B's shapes, the 6-layer run minus
  the 2-layer run (benchmarks/results/convert_io_datafree_llama3_8b.json, its `per_layer`, on a quiet VM: a loaded
  one is several times slower, as is the torch path without a C compiler). CPU_PROCESS_BYTES, by weight format: the
  host memory of that stream beside two layers of source tensors and one of output, from the same runs' peak RSS.
- GPU_*: NOT measured (no GPU was available): fractions of the GPU's dense bf16 peak (qtk.plan.hardware) assumed
  for calibration forwards (35 %) and GPTQ's fp32 solves (3 %: fp32 without TF32, small triangular solves);
  benchmarks/convert_gpu.py measures what they should be replaced with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qtk.plan.memory import DTYPE_BYTES, ConversionMemory, ModelShape, model_tensors, scheme_of, step_costs
from qtk.quant.formats import format_for

CPU_GEMM_FLOPS = 705e9
CPU_SOLVE_FLOPS = 48e9
CPU_READ_BPS = 1.6e9
CPU_WRITE_BPS = 0.42e9
CPU_STREAM_PARAMS_PER_S = {"fp8": 1728.7e6, "int8": 1303.7e6, "int4": 1984.5e6, "nvfp4": 755.2e6, "mx": 965.4e6,
                           "fp8-block": 1322.9e6}
CPU_PROCESS_BYTES = {"fp8": 30e6, "int8": 170e6, "int4": 150e6, "nvfp4": 230e6, "mx": 210e6, "fp8-block": 30e6}
GPU_HOST_LINK_BPS = 20e9  # host <-> GPU copies of the data-free stream (assumed: PCIe Gen4/5 x16, pageable memory)
GPU_GEMM_EFFICIENCY = 0.35
GPU_SOLVE_EFFICIENCY = 0.03
GPU_LINK_BPS = 50e9  # NCCL all-reduce bandwidth between GPUs (assumed; NVLink nodes reach more)
CPU_LINK_BPS = 1e9  # gloo on one host (assumed)


def stream_rate(scheme) -> tuple[float, float]:
    """(parameters per second, process bytes) of the data-free stream for a weight scheme on the CPU: its format's
    measurement (Format.stream_key), or the slowest measured one for a format without its own."""
    key = format_for(scheme).stream_key(scheme)
    if key in CPU_STREAM_PARAMS_PER_S:
        return CPU_STREAM_PARAMS_PER_S[key], CPU_PROCESS_BYTES[key]
    return min(CPU_STREAM_PARAMS_PER_S.values()), max(CPU_PROCESS_BYTES.values())


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
    forward = solve = reduce_bytes = stream = 0.0
    data_free = recipe is not None and not recipe.needs_calibration
    process_bytes = []
    if data_free:
        # data-free: each quantized Linear streams once (the rest is copied, part of the disk time)
        for x in lin:
            sch = scheme_of(recipe, x.name)
            if sch is not None:
                rate, held = stream_rate(sch.weights)
                process_bytes.append(held)
                n = x.numel
                stream += (n * 3 / GPU_HOST_LINK_BPS if gpu is not None  # 2 bytes there, about 1 back
                           else n / rate)
    elif recipe is not None:
        n, t = recipe.calibration.num_samples, recipe.calibration.seq_len
        tokens = n * t
        costs = step_costs(s, recipe, n, t)
        # forwards of each layer over every token: the propagation, plus each pass a step makes over its inputs
        passes = 1 + sum(c.input_passes for c in costs)
        if recipe.activations is not None and not recipe.activations.dynamic:
            passes += 1  # static activation ranges are observed
        attention = 4 * tokens * t * s.hidden  # QK^T and AV of each window
        forward = passes * (2 * layer_params * tokens + attention) * layers + sum(c.forward_flops for c in costs)
        solve = sum(c.solve_flops for c in costs)
        reduce_bytes = sum(c.reduce_bytes for c in costs)
    if gpu is None:
        gemm, solve_rate, link, name = CPU_GEMM_FLOPS, CPU_SOLVE_FLOPS, CPU_LINK_BPS, "cpu"
    else:
        peak = gpu.peak_flops(None)
        gemm, solve_rate, link, name = peak * GPU_GEMM_EFFICIENCY, peak * GPU_SOLVE_EFFICIENCY, GPU_LINK_BPS, gpu.name
    p = max(processes, 1)
    parts = {"read": source_bytes / CPU_READ_BPS, "write": output_bytes / CPU_WRITE_BPS,
             "forward": forward / gemm / p, "solve": solve / solve_rate / p,
             "reduce": (reduce_bytes * 2 * (p - 1) / p) / link if p > 1 else 0.0, "stream": stream}
    # one process streams a data-free recipe (the others of a torchrun have nothing to share)
    seconds = max(parts["read"] + parts["write"], parts["forward"] + parts["solve"] + parts["reduce"] + stream)
    seconds += (parts["read"] + parts["write"]) / layers  # the first read and the last write do not overlap
    per_process_acts = mem.calibration // p
    layer = mem.layer_fp32
    if data_free:
        # the stream: one layer in the model dtype read ahead while one is rounded, the written layer behind them;
        # the embedding and lm_head are copied in 64 MiB chunks (never whole)
        src_layer = layer // 4 * DTYPE_BYTES[s.dtype]
        outer = sum(x.numel for x in specs if x.layer is None) * DTYPE_BYTES[s.dtype]  # copied as they are
        out_layer = max(output_bytes - outer, 0) // layers
        host = max(process_bytes or [CPU_PROCESS_BYTES["fp8"]]) + 2 * src_layer + out_layer
        device_peak = 0 if gpu is None else 2 * src_layer
        notes.append("no calibration: the layers stream through one process" + (" (rank 0; the others wait)" if p > 1 else ""))
        return ConversionEstimate(name, p, int(host), int(device_peak), seconds, parts, tuple(notes))
    if gpu is None:
        host = mem.embeddings + 2 * layer + per_process_acts + mem.solver_state
        device_peak = 0
    else:
        # one layer (+ the next read ahead) and its solver state on the GPU, the activations while they fit
        device_peak = min(2 * layer + mem.solver_state + per_process_acts, int(gpu.mem_bytes * 0.9))
        spilled = max(0, 2 * layer + mem.solver_state + per_process_acts - device_peak)
        host = mem.embeddings + layer + spilled  # the layer read ahead and the one written behind, 16-bit
        if spilled:
            notes.append(f"{spilled / 1e9:.1f} GB of calibration activations per process wait in pinned host memory")
    if p > 1:
        notes.append(f"each of {p} processes holds 1/{p} of the calibration windows; rank 0 writes")
    return ConversionEstimate(name, p, int(host), int(device_peak), seconds, parts, tuple(notes))
