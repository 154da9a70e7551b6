"""How a recipe is expressed in a TensorRT-LLM checkpoint: the quant_algo of each scheme, the config sections that
declare it (config.json's `quantization`; quant_cfg.json for MIXED_PRECISION), and the schemes a reader gets back
from an algorithm.

Mixed precision (TensorRT-LLM models/modeling_utils.py): config.json says quant_algo MIXED_PRECISION and
PretrainedConfig.from_json_file reads quant_cfg.json beside it into a LayerQuantConfig {quant_algo,
kv_cache_quant_algo, quantized_layers: {module name pattern: QuantConfig}}; preprocess_weights and quantize() take each
module's algorithm from the first pattern that fnmatch-es its name, and a module no pattern names stays unquantized.
qtk writes the weight-only algorithms that way (W8A16, W4A16, W4A16_AWQ), whose per-layer loading is the one traced
through that code (weight_only_quantize_dict / preprocess_weights_for_mixed_gemm per module); a mix with quantized
activations (FP8, SmoothQuant), whose scales TensorRT-LLM also attaches to norms and attention, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qtk.errors import UsageError
from qtk.export.codecs.trtllm import INT4_GROUP_ALGOS, NVFP4_ALGOS, PLAIN_ALGOS
from qtk.plan.serving import kernel_family
from qtk.quant.scheme import QuantScheme, Strategy
from qtk.recipe.rules import ModuleScheme
from qtk.recipe.schema import checked_scheme

# TensorRT-LLM's group-wise int4 GEMM (weight_only_groupwise_quant_matmul) is built for these group sizes
AWQ_GROUP_SIZES = (64, 128)
MIXED = "MIXED_PRECISION"
WEIGHT_ONLY = ("W8A16", "W4A16", "W4A16_AWQ")  # the algorithms qtk mixes in one checkpoint


@dataclass(frozen=True)
class LayerAlgo:
    """The quant_algo of one module (and its group size for W4A16_AWQ), as a QuantConfig section declares it."""

    algo: str
    group_size: int | None = None

    def config(self) -> dict:
        q = {"quant_algo": self.algo}
        if self.algo in INT4_GROUP_ALGOS:
            q.update(group_size=self.group_size, has_zero_point=False, pre_quant_scale=True)
        elif self.algo in NVFP4_ALGOS:
            q["group_size"] = self.group_size
        return q


@dataclass(frozen=True)
class TRTQuant:
    """How a recipe is expressed in a TensorRT-LLM checkpoint. algos: the algorithm of each of the recipe's schemes
    (one for a single-scheme recipe; several under quant_algo MIXED_PRECISION)."""

    quant_algo: str
    kv_cache_quant_algo: str | None
    group_size: int | None = None
    notes: tuple[str, ...] = ()
    algos: dict = field(default_factory=dict)  # ModuleScheme -> LayerAlgo

    @property
    def mixed(self) -> bool:
        return self.quant_algo == MIXED

    def algo_for(self, scheme: ModuleScheme) -> LayerAlgo:
        return self.algos[scheme] if self.mixed else LayerAlgo(self.quant_algo, self.group_size)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({a.group_size for a in self.algos.values() if a.group_size} | ({self.group_size} - {None})))

    def config(self, exclude: list[str]) -> dict:
        """config.json's `quantization`."""
        if self.mixed:  # the per-layer algorithms are quant_cfg.json's
            return {"quant_algo": MIXED, "kv_cache_quant_algo": self.kv_cache_quant_algo}
        q = {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo}
        if self.quant_algo in INT4_GROUP_ALGOS:
            q.update(group_size=self.group_size, has_zero_point=False, pre_quant_scale=True)
        elif self.quant_algo in NVFP4_ALGOS:
            q["group_size"] = self.group_size
        q["exclude_modules"] = exclude
        return q

    def layer_config(self, quantized_layers: dict[str, LayerAlgo]) -> dict:
        """quant_cfg.json of a MIXED_PRECISION checkpoint: each quantized module by its exact TensorRT-LLM name."""
        return {"quant_algo": MIXED, "kv_cache_quant_algo": self.kv_cache_quant_algo,
                "quantized_layers": {name: a.config() for name, a in quantized_layers.items()}}


def module_algo(scheme: ModuleScheme, recipe) -> tuple[LayerAlgo, list[str]]:
    """The quant_algo for one scheme, with notes, or a UsageError naming the fix when TensorRT-LLM cannot express it.

    | weights                 | activations          | quant_algo                           |
    | fp8 tensor              | fp8 tensor static    | FP8                                  |
    | fp8 channel             | fp8 token dynamic    | FP8_PER_CHANNEL_PER_TOKEN            |
    | int8 channel            | int8 tensor static   | W8A8_SQ_PER_CHANNEL                  |
    | int8 channel            | int8 token dynamic   | W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN |
    | int8 channel            | -                    | W8A16 (plain weights)                |
    | int4 channel, symmetric | -                    | W4A16 (plain weights)                |
    | int4 group 64/128, sym  | -                    | W4A16_AWQ (also for RTN and GPTQ)    |
    | NVFP4                   | NVFP4 (dynamic local)| NVFP4                                |
    | NVFP4                   | -                    | W4A16_NVFP4                          |
    | int4 group 128, sym     | fp8 tensor static    | W4A8_AWQ (also for RTN and GPTQ)     |

    Refused, naming the target that runs them: W4A8-FP8 with dynamic per-token activations (TensorRT-LLM's W4A8_AWQ
    takes one static FP8 input scale per tensor: the w4a8-fp8-static recipe), W4A8-INT8 (TensorRT-LLM's int8-activation
    W4A8 is QServe's layout), FP8 blocks (TensorRT-LLM runs FP8_BLOCK_SCALES only in its PyTorch
    backend, from a Hugging Face checkpoint; ModelOpt's TensorRT-LLM export of its FP8 block config fails too), MX (TensorRT-LLM's
    QuantAlgo.MXFP8 is a PyTorch-backend method).
    """
    w, a, steps = scheme.weights, scheme.activations, recipe.step_names
    where = f"recipe {recipe.name}"
    notes: list[str] = []
    if w.is_nvfp4:  # ModelOpt's export_tensorrt_llm_checkpoint of NVFP4_DEFAULT_CFG / W4A16_NVFP4_CFG
        return LayerAlgo("NVFP4" if a is not None else "W4A16_NVFP4", w.group_size), notes
    new = kernel_family(scheme)
    if new == "W4A8-FP8":  # ModelOpt's export_tensorrt_llm_checkpoint of W4A8_AWQ_BETA_CFG
        if a.dynamic:
            raise UsageError(f"{where}: TensorRT-LLM's W4A8_AWQ quantizes activations to FP8 per tensor with a static "
                             f"(calibrated) scale, not {a.describe()}",
                             "use the w4a8-fp8-static recipe (activations {strategy: tensor, dynamic: false}) for "
                             "TensorRT-LLM, or --target vllm for per-token W4A8-FP8")
        if recipe.writes_g_idx:
            raise UsageError(f"{where}: TensorRT-LLM's group-wise int4 kernels have no g_idx for GPTQ actorder group",
                             "set gptq actorder: static (no g_idx)")
        if "awq" not in steps:
            notes.append(f"TensorRT-LLM: wrote the {'/'.join(steps)} int4 group-{w.group_size} weights as W4A8_AWQ "
                         "(identity pre-quant scale)")
        return LayerAlgo("W4A8_AWQ", w.group_size), notes
    if new == "W4A8-INT8":  # no fix of our own: the targets that accept the recipe are named by check_targets
        raise UsageError(f"{where}: qtk does not write W4A8-INT8 as a TensorRT-LLM checkpoint: TensorRT-LLM runs int4 "
                         "weights with INT8 activations only as QServe "
                         "(W4A8_QSERVE_PER_GROUP / _PER_CHANNEL: asymmetric int4 under per-channel int8 scales, from "
                         "QServe's progressive quantization), a layout qtk does not write; its W4A8_AWQ takes FP8 "
                         "activations (the w4a8-fp8-static recipe)")
    if new == "FP8 block":  # no fix of our own: the targets that accept the recipe are named by check_targets
        raise UsageError(f"{where}: qtk does not write FP8 block as a TensorRT-LLM checkpoint: TensorRT-LLM runs FP8 "
                         "block scales (FP8_BLOCK_SCALES) only in its PyTorch backend, which loads them from a Hugging "
                         "Face checkpoint (quant_method fp8, as --target hf-fp8 writes)")
    if new == "MXFP8":  # no fix of our own: the targets that accept the recipe are named by check_targets
        raise UsageError(f"{where}: qtk does not write MXFP8 as a TensorRT-LLM checkpoint: TensorRT-LLM runs MXFP8 "
                         "(QuantAlgo.MXFP8, MXFP8 activations taken at run time) in its PyTorch backend's "
                         "MXFP8LinearMethod, which loads Hugging Face checkpoints")
    if new:  # no fix of our own: the targets that accept the recipe are named by qtk.export.check_targets
        raise UsageError(f"{where}: qtk does not write {new} as a TensorRT-LLM checkpoint")
    if w.is_fp8:
        if a is None:
            raise UsageError(f"{where}: TensorRT-LLM has no FP8 weight-only checkpoint mode", "add fp8 activations (recipes fp8, fp8-dynamic)")
        if w.strategy == Strategy.TENSOR and not a.dynamic:
            algo = "FP8"
        elif w.strategy == Strategy.CHANNEL and a.dynamic and a.strategy == Strategy.TOKEN:
            algo = "FP8_PER_CHANNEL_PER_TOKEN"
        else:
            raise UsageError(f"{where}: TensorRT-LLM runs FP8 as per-tensor weights with static activations or per-channel "
                             f"weights with per-token dynamic activations, not {w.describe()} weights with {a.describe()} activations",
                             "use the fp8 or fp8-dynamic recipe")
    elif a is not None:
        if w.num_bits != 8 or w.strategy != Strategy.CHANNEL:
            raise UsageError(f"{where}: TensorRT-LLM's W8A8 checkpoints need int8 per-channel weights, not {w.describe()}",
                             "set weights: {num_bits: 8, strategy: channel}")
        if a.dynamic and a.strategy == Strategy.TOKEN:
            algo = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
        elif not a.dynamic:
            algo = "W8A8_SQ_PER_CHANNEL"
        else:
            raise UsageError(f"{where}: TensorRT-LLM quantizes int8 activations per token (dynamic) or per tensor (static), not {a.describe()}",
                             "set activations to {strategy: token, dynamic: true} or {strategy: tensor, dynamic: false}")
    elif w.num_bits == 8:
        if w.strategy != Strategy.CHANNEL:
            raise UsageError(f"{where}: TensorRT-LLM's int8 weight-only mode (W8A16) is per-channel, not {w.strategy}", "set weights.strategy: channel")
        algo = "W8A16"
    elif w.num_bits == 4:
        if not w.symmetric:
            raise UsageError(f"{where}: TensorRT-LLM's int4 checkpoints (W4A16, W4A16_AWQ) are symmetric; asymmetric int4 has no layout there",
                             "set weights.symmetric: true (or write the asymmetric model with --target vllm)")
        if w.strategy == Strategy.CHANNEL:
            algo = "W4A16"
        elif w.strategy == Strategy.GROUP:
            if w.group_size not in AWQ_GROUP_SIZES:
                raise UsageError(f"{where}: TensorRT-LLM's group-wise int4 kernels take group_size 64 or 128, not {w.group_size}",
                                 "set weights.group_size: 128")
            if recipe.writes_g_idx:
                raise UsageError(f"{where}: TensorRT-LLM's group-wise int4 kernels have no g_idx for GPTQ actorder group",
                                 "set gptq actorder: static (no g_idx)")
            algo = "W4A16_AWQ"
            if "awq" not in steps:
                notes.append(f"TensorRT-LLM: wrote the {'/'.join(steps)} int4 group-{w.group_size} weights as W4A16_AWQ (identity "
                             "pre-quant scale): W4A16_GPTQ checkpoints need CUTLASS-interleaved weights that only TensorRT-LLM's "
                             "own converter produces; both run the same group-wise int4 kernel")
        else:
            raise UsageError(f"{where}: TensorRT-LLM's int4 modes are per-channel or group-wise, not per-tensor", "set weights.strategy: group")
    else:
        raise UsageError(f"{where}: TensorRT-LLM has no int{w.num_bits} weight mode", "use 4- or 8-bit weights")
    if algo in PLAIN_ALGOS:
        notes.append(f"TensorRT-LLM: {algo} checkpoints hold plain weights (the dequantized qtk weights) and trtllm-build "
                     f"re-quantizes them per channel (scale amax/{2 ** (w.num_bits - 1)})" + (
                         f"; GPTQ's rounding survives exactly only in rows that use the code {-(2 ** (w.num_bits - 1))}, "
                         "where that scale equals qtk's" if "gptq" in steps else ""))
    return LayerAlgo(algo, w.group_size if algo == "W4A16_AWQ" else None), notes


def trtllm_quant(recipe) -> TRTQuant:
    """The quant_algo for a recipe (MIXED_PRECISION when its schemes differ), or a UsageError naming the fix when
    TensorRT-LLM (or qtk's writer) cannot express it. kv_cache int8 -> kv_cache_quant_algo INT8, float -> FP8."""
    kv = recipe.kv_cache
    kv_algo = None if kv is None else ("FP8" if kv.is_fp8 else "INT8")
    if not recipe.mixed:
        a, notes = module_algo(recipe.default_scheme, recipe)
        return TRTQuant(a.algo, kv_algo, a.group_size, tuple(notes))
    algos, notes = {}, []
    for scheme in recipe.schemes:
        algos[scheme], n = module_algo(scheme, recipe)
        notes += [x for x in n if x not in notes]
    others = sorted({a.algo for a in algos.values()} - set(WEIGHT_ONLY))
    if others:  # no fix of our own: the targets that accept the recipe are named by qtk.export.check_targets
        raise UsageError(f"recipe {recipe.name}: qtk writes TensorRT-LLM mixed precision (MIXED_PRECISION with a per-layer "
                         f"quant_cfg.json) for weight-only schemes only ({', '.join(WEIGHT_ONLY)}), not {', '.join(others)}")
    return TRTQuant(MIXED, kv_algo, None, tuple(notes), algos)


def algo_scheme(algo: str | None, group_size: int | None) -> ModuleScheme:
    """The scheme TensorRT-LLM runs for a quant_algo (what a reader reports)."""
    table = {
        "FP8": (QuantScheme(8, "float", True, "tensor"), QuantScheme(8, "float", True, "tensor")),
        "FP8_PER_CHANNEL_PER_TOKEN": (QuantScheme(8, "float", True, "channel"), QuantScheme(8, "float", True, "token", dynamic=True)),
        "W8A8_SQ_PER_CHANNEL": (QuantScheme(8, "int", True, "channel"), QuantScheme(8, "int", True, "tensor")),
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": (QuantScheme(8, "int", True, "channel"), QuantScheme(8, "int", True, "token", dynamic=True)),
        "W8A16": (QuantScheme(8, "int", True, "channel"), None),
        "W4A16": (QuantScheme(4, "int", True, "channel"), None),
        "W4A16_AWQ": (QuantScheme(4, "int", True, "group", group_size or 128), None),
        "W4A8_AWQ": (QuantScheme(4, "int", True, "group", group_size or 128), QuantScheme(8, "float", True, "tensor")),
        "NVFP4": (QuantScheme(4, "float", True, "tensor_group", 16), QuantScheme(4, "float", True, "tensor_group", 16, dynamic="local")),
        "W4A16_NVFP4": (QuantScheme(4, "float", True, "tensor_group", 16), None),
    }
    if algo not in table:
        raise UsageError(f"qtk cannot read TensorRT-LLM checkpoints with quant_algo {algo}", f"readable: {', '.join(table)}, {MIXED}")
    return checked_scheme(*table[algo], where=f"TensorRT-LLM quant_algo {algo}")
