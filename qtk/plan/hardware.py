"""GPU table for planning: memory, bandwidth, peak tensor throughput, FP8 / FP4 support, typical price.

Native number formats by generation (what vLLM and TensorRT-LLM run in tensor cores, not emulated):
Ampere / Turing: INT8, INT4 (weight-only kernels); Ada, Hopper: + FP8, incl. 128x128 FP8 blocks (DeepGEMM /
CUTLASS on Hopper, Triton on Ada); Ada, Hopper: + static W4A8 (TensorRT-LLM's W4A8_AWQ); Hopper: + W4A8-FP8
(vLLM's CUTLASS, SM90 only); W4A8-INT8: no GPU here (vLLM runs it on CPUs and Intel XPUs); Blackwell: + FP4 (NVFP4 and MXFP4:
block-scaled FP4 tensor cores) and MXFP8 (block-scaled FP8: vLLM's FlashInfer CUTLASS MXFP8 GEMM, SM100+; before
Blackwell vLLM runs MXFP8 weight-only, Marlin or dequantized to bf16). MI300 (CDNA3): FP8, no FP4.

Data, not logic. Memory is the total the driver reports (nvidia-smi / rocm-smi `memory.total`),
because that is what vLLM multiplies by --gpu-memory-utilization. Throughput figures are dense
(no sparsity) datasheet peaks; prices are typical on-demand cloud rates and vary a lot: override
them with --price.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from qtk.errors import UsageError

MIB = 1024**2
GB = 10**9  # every size qtk plan prints is decimal GB


@dataclass(frozen=True)
class GPU:
    """One accelerator model, as the planner needs it."""

    name: str
    label: str
    mem_bytes: int
    bandwidth: float  # bytes/s
    bf16_tflops: float  # dense; fp16 on GPUs without bf16 (T4)
    int8_tops: float | None
    fp8_tflops: float | None  # None: no FP8 tensor cores
    price_per_hour: float  # USD, typical on-demand
    interconnect: str  # nvlink | pcie | xgmi: sets the default tensor-parallel efficiency
    generation: str
    bf16: bool = True
    base: str | None = None  # a custom GPU: the listed GPU its unstated figures come from
    fp4_tflops: float | None = None  # dense NVFP4 / MXFP4; None: no FP4 tensor cores (before Blackwell)

    @property
    def fp8(self) -> bool:
        return self.fp8_tflops is not None

    @property
    def fp4(self) -> bool:
        return self.fp4_tflops is not None

    @property
    def mxfp8(self) -> bool:
        """MXFP8 (FP8 e4m3 in blocks of 32 under E8M0 scales) runs in Blackwell's block-scaled tensor cores: vLLM's
        CompressedTensorsW8A8Mxfp8 (the scheme of every mxfp8-quantized checkpoint, with or without
        input_activations) takes FlashInfer's CUTLASS MXFP8 GEMM at SM100+, quantizing the activations to MXFP8 at run
        time; on earlier GPUs it runs weight-only (Marlin MXFP8, or an emulation that dequantizes to bf16)."""
        return self.generation == "Blackwell"

    @property
    def w4a8_fp8(self) -> bool:
        """vLLM's W4A8-FP8 kernel (CUTLASS) is built for SM90 (Hopper) only."""
        return self.generation == "Hopper"

    @property
    def w4a8_awq(self) -> bool:
        """TensorRT-LLM's W4A8_AWQ (int4 groups, static per-tensor FP8 activations: w4a8-fp8-static) runs on Ada and
        Hopper only (its hardware support matrix, docs/source/features/quantization.md: not Ampere, not Blackwell)."""
        return self.generation in ("Ada", "Hopper")

    @property
    def w4a8_int8(self) -> bool:
        """W4A8-INT8 (int4 groups, dynamic per-token INT8 activations) has no GPU kernel in this table: vLLM's
        CompressedTensorsW4A8Int runs with INT8 activations on CPUs (Dynamic4bitLinearKernel: Arm KleidiAI) and Intel
        XPUs (XPUW4A8IntLinearKernel); its CUDA kernels take FP8 (CUTLASS W4A8) or 16-bit activations, and
        TensorRT-LLM's INT8-activation W4A8 is QServe's own layout."""
        return False

    def peak_flops(self, activation_type: str | None) -> float:
        """Dense peak for the GEMM input type: 'fp4' (NVFP4), 'float' (fp8), 'int' (int8) or None (bf16/fp16)."""
        if activation_type == "fp4" and self.fp4_tflops:
            return self.fp4_tflops * 1e12
        if activation_type in ("float", "fp4") and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        if activation_type == "int" and self.int8_tops:
            return self.int8_tops * 1e12
        return self.bf16_tflops * 1e12

    def as_dict(self) -> dict:
        return {
            "name": self.name, "label": self.label, "mem_bytes": self.mem_bytes,
            "bandwidth_bytes_per_s": self.bandwidth, "bf16_tflops": self.bf16_tflops,
            "int8_tops": self.int8_tops, "fp8_tflops": self.fp8_tflops, "fp8": self.fp8,
            "fp4_tflops": self.fp4_tflops, "fp4": self.fp4, "mxfp8": self.mxfp8,
            "price_per_hour": self.price_per_hour, "interconnect": self.interconnect,
            "generation": self.generation, "base": self.base,
        }


def _gpu(name, label, mem_mib, tb_s, bf16_tf, int8, fp8, price, link, gen, **kw) -> GPU:
    return GPU(name, label, mem_mib * MIB, tb_s * 1e12, bf16_tf, int8, fp8, price, link, gen, **kw)


GPUS: dict[str, GPU] = {g.name: g for g in (
    _gpu("a100-40g", "A100 40GB SXM", 40960, 1.555, 312, 624, None, 1.29, "nvlink", "Ampere"),
    _gpu("a100-80g", "A100 80GB SXM", 81920, 2.039, 312, 624, None, 1.79, "nvlink", "Ampere"),
    _gpu("h100-sxm", "H100 80GB SXM", 81559, 3.35, 989, 1979, 1979, 2.49, "nvlink", "Hopper"),
    _gpu("h100-pcie", "H100 80GB PCIe", 81559, 2.0, 756, 1513, 1513, 2.19, "pcie", "Hopper"),
    _gpu("h200", "H200 141GB SXM", 143771, 4.8, 989, 1979, 1979, 3.49, "nvlink", "Hopper"),
    _gpu("b200", "B200 180GB", 183359, 8.0, 2250, 4500, 4500, 5.99, "nvlink", "Blackwell", fp4_tflops=9000),
    _gpu("l4", "L4 24GB", 23034, 0.3, 121, 242, 242, 0.80, "pcie", "Ada"),
    # Turing: no bf16 and no FP8; engines serve it in fp16 (same bytes, so sizes are unchanged)
    _gpu("t4", "T4 16GB", 15360, 0.32, 65, 130, None, 0.35, "pcie", "Turing", bf16=False),
    _gpu("rtx-4090", "RTX 4090 24GB", 24564, 1.008, 165, 661, 330, 0.40, "pcie", "Ada"),
    _gpu("rtx-5090", "RTX 5090 32GB", 32607, 1.792, 209, 838, 419, 0.70, "pcie", "Blackwell", fp4_tflops=1676),
    _gpu("mi300x", "MI300X 192GB", 196608, 5.3, 1307, 2615, 2615, 2.50, "xgmi", "CDNA3"),
)}

ALIASES = {
    "a100": "a100-80g", "a100-40gb": "a100-40g", "a100-80gb": "a100-80g",
    "h100": "h100-sxm", "h100-80g": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm",
    "h200-141g": "h200", "b200-180g": "b200", "4090": "rtx-4090", "rtx4090": "rtx-4090",
    "5090": "rtx-5090", "rtx5090": "rtx-5090", "l4-24g": "l4", "t4-16g": "t4",
}

# Fraction of linear scaling kept per doubling of GPUs under tensor parallelism (all-reduce cost):
# NVLink/xGMI keep most of it, PCIe loses more.
TP_EFFICIENCY_PER_DOUBLING = {"nvlink": 0.9, "xgmi": 0.9, "pcie": 0.75}


DEFAULT_GPU = "h100-sxm"


def gpu_names() -> list[str]:
    return list(GPUS)


def get_gpu(name: str | None, *, mem_gb: float | None = None, bandwidth_tb_s: float | None = None,
            price: float | None = None) -> GPU:
    """Look up a GPU by name (or alias) and apply the user's overrides; no name needs --gpu-mem.

    Any override makes a custom GPU: it is named "custom" and labelled with the figures given and the GPU the
    rest (compute, FP8, interconnect, and any figure not given) is taken from, so no report names a GPU the
    numbers do not describe."""
    if name is None:
        if mem_gb is None:
            raise UsageError("no GPU given", f"pass --gpu NAME ({', '.join(GPUS)}) or --gpu-mem GB")
        # a custom accelerator: only memory is known; bandwidth/compute default to an H100 PCIe's, without FP8
        base = replace(GPUS["h100-pcie"], fp8_tflops=None)
    else:
        key = name.strip().lower().replace("_", "-").replace(" ", "-")
        key = ALIASES.get(key, key)
        if key not in GPUS:
            raise UsageError(f"unknown GPU '{name}'", f"use one of {', '.join(GPUS)}, or --gpu-mem/--gpu-bw/--price")
        base = GPUS[key]
    for value, what, least, fix in ((mem_gb, "--gpu-mem", "positive", "give the GPU memory in GB, e.g. --gpu-mem 80"),
                                    (bandwidth_tb_s, "--gpu-bw", "positive", "give the bandwidth in TB/s, e.g. --gpu-bw 3.35"),
                                    (price, "--price", ">= 0", "give the hourly price per GPU in USD, e.g. --price 2.5")):
        if value is not None and not (math.isfinite(value) and (value > 0 if least == "positive" else value >= 0)):
            raise UsageError(f"{what} must be {least}, got {value}", fix)
    gpu, given = base, []
    if mem_gb is not None:
        gpu = replace(gpu, mem_bytes=int(mem_gb * GB))
        given.append(f"{mem_gb:g} GB")
    if bandwidth_tb_s is not None:
        gpu = replace(gpu, bandwidth=bandwidth_tb_s * 1e12)
        given.append(f"{bandwidth_tb_s:g} TB/s")
    if price is not None:
        gpu = replace(gpu, price_per_hour=price)
        given.append(f"${price:.2f}/h")
    if not given:
        return gpu
    inherited = [w for w, v in (("memory", mem_gb), ("bandwidth", bandwidth_tb_s), ("price", price)) if v is None]
    inherited += ["compute"] + (["FP8"] if gpu.fp8 else []) + ["interconnect"]
    label = (f"custom GPU ({', '.join(given)}; {', '.join(inherited[:-1])} and {inherited[-1]} as {base.label}"
             + (", no FP8" if name is None else "") + ")")
    return replace(gpu, name="custom", label=label, base=base.name)


def tp_efficiency(gpu: GPU, tp: int, per_doubling: float | None = None) -> float:
    """Parallel efficiency of tensor parallelism over tp GPUs: per_doubling ** log2(tp)."""
    if tp <= 1:
        return 1.0
    f = per_doubling if per_doubling is not None else TP_EFFICIENCY_PER_DOUBLING.get(gpu.interconnect, 0.75)
    return f ** math.log2(tp)
