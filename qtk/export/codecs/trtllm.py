"""TensorRT-LLM layouts per quant_algo (docs/formats.md, trtllm), as NVIDIA ModelOpt exports them: the logical tensors
of one Linear before tensor-parallel sharding, each with the axes it is split and concatenated along (`axes`, used by
the writer to shard and by the reader to merge ranks back), what the reader expects of them (`layout`), and how the
engine decodes them (`decode`).

    FP8                                  weight fp8 [out, in], weights_scaling_factor f32 [1], activation_scaling_factor [1]
    FP8_PER_CHANNEL_PER_TOKEN            weight fp8, per_channel_scale f32 [out]
    W8A8_SQ_PER_CHANNEL                  weight int8, weights_scaling_factor [out], activation_scaling_factor [1],
                                         prequant_scaling_factor [in] (ones: smoothing is folded)
    W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN weight int8, per_channel_scale [1, out], smoother [1, in] on row-parallel ones
    W4A16_AWQ                            weight int8 [out/2, in] (int4 pairs), weights_scaling_factor f32 [out, groups],
                                         prequant_scaling_factor [in] (ones)
    W4A8_AWQ                             as W4A16_AWQ (weights_scaling_factor is the real int4 scale, amax/7 in ModelOpt,
                                         qtk's own grid here), plus weights_scaling_factor_2 f32 [1] = max |q·s| of the
                                         fused module / 448 and activation_scaling_factor f32 [1] = input amax / 448;
                                         TensorRT-LLM divides the group scales by the first and the pre-quant scale by
                                         the second, and multiplies the output by alpha = their product, so the engine's
                                         weight is q·s (as an FP8 value times weights_scaling_factor_2) and its input is
                                         x quantized to FP8 per tensor
    W8A16, W4A16                         plain weights in the model dtype: trtllm-build quantizes them itself
    NVFP4, W4A16_NVFP4                   weight uint8 [out, in/2] (e2m1 codes, low nibble first), weights_scaling_factor
                                         fp8 [out, in/16], weights_scaling_factor_2 f32 [] (1/global scale, one per fused
                                         module), activation_scaling_factor f32 [] (amax/2688, NVFP4 only)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from qtk.errors import UsageError
from qtk.quant.formats.nvfp4 import GLOBAL
from qtk.quant.fp4 import pack_fp4, unpack_fp4
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import FP8_MAX, QuantScheme

INT8_MAX = 127.0
# weight-only algorithms whose checkpoint holds plain weights: trtllm-build quantizes them per channel
PLAIN_ALGOS = {"W8A16": 8, "W4A16": 4}
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
INT4_GROUP_ALGOS = ("W4A16_AWQ", "W4A8_AWQ")
_FP4_INPUT_MAX = 448.0 * 6.0  # NVFP4's activation_scaling_factor is amax / (448 · 6), ModelOpt's inverse global scale


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM / ModelOpt W4A16_AWQ weight: signed int4 q [out, in] -> int8 [out/2, in]; byte j of a column
    holds rows 2j (low nibble) and 2j+1 (high nibble), two's complement."""
    if q.shape[0] % 2:
        raise ValueError(f"pack_int4_pairs: {q.shape[0]} output rows do not pair up")
    q = q.to(torch.int16)
    lo, hi = q[0::2] & 0xF, q[1::2] & 0xF
    b = lo | (hi << 4)  # 0..255
    return torch.where(b >= 128, b - 256, b).to(torch.int8)


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_pairs: int8 or uint8 [out/2, in] -> signed int8 [out, in]."""
    b = packed.to(torch.int16) & 0xFF
    lo, hi = b & 0xF, b >> 4
    lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


def axes(key: str, shape) -> tuple[int | None, int | None]:
    """(out_axis, in_axis) of a stored tensor: the axis it splits along under column parallelism (and q/k/v are
    concatenated along), and under row parallelism; None: the same on every rank."""
    n = len(shape)
    if key == "weight":
        return 0, 1
    if key == "bias":
        return 0, None
    if key == "weights_scaling_factor":
        return (None, None) if n == 1 and shape[0] == 1 else ((0, None) if n == 1 else (0, 1))
    if key == "per_channel_scale":
        return (0, None) if n == 1 else (1, None)
    if key == "prequant_scaling_factor":
        return None, n - 1
    if key == "smoother":
        return None, 1
    return None, None


@dataclass
class Part:
    """One logical tensor of a TensorRT-LLM module before sharding; out_axis / in_axis say how it splits for
    column- / row-parallel modules (None: the same on every rank). pack runs per rank (int4 pairs)."""

    tensor: torch.Tensor
    out_axis: int | None
    in_axis: int | None
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor, pack=None, shape=None) -> "Part":
        """The part with the axes `axes` gives its key (for the shape it is stored with, when packing changes it)."""
        return cls(tensor, *axes(key, list(tensor.shape) if shape is None else shape), pack)


def act_scale(amax: float | None, qmax: float) -> torch.Tensor:
    if amax is None:
        raise ValueError("static activation quantization needs a calibrated input amax")  # pipeline guarantees it
    return torch.tensor([amax / qmax if amax > 0 else 1.0], dtype=torch.float32)


def w4a8_weight_amax(qt: QTensor) -> float:
    """max |q·s| of an int4 group QTensor: what ModelOpt's FP8 weight quantizer of W4A8_AWQ sees (over a fused
    module, their maximum)."""
    return float((qt.values.float().unflatten(1, (-1, qt.shape[1] // qt.scale.shape[1])) * qt.scale.float()[..., None])
                 .abs().max())


def w4a8_range_problem(qt: QTensor, scale_2: torch.Tensor, name: str) -> str | None:
    """W4A8_AWQ's engine divides the group scales by scale_2 and runs q·s/scale_2 as FP8: a weight beyond 448·scale_2
    would overflow it."""
    s2 = float(scale_2.float().reshape(-1)[0])
    wa = w4a8_weight_amax(qt)
    if not s2 > 0 or wa > s2 * FP8_MAX * (1 + 2**-20):
        return f"{name}: max |q·s| {wa:.4g} exceeds 448 × scale_2 ({s2:.4g}): the engine's FP8 weights would overflow"
    return None


def encode(algo: str, qt: QTensor, amax: float | None, dtype: torch.dtype, row: bool,
           weight_amax: float | None = None) -> dict[str, Part]:
    """The logical tensors of one quantized Linear (before fusion and sharding). amax: its calibrated input range
    (static activation algorithms); row: row-parallel (o_proj, down_proj); weight_amax: W4A8_AWQ's max |q·s| over
    the fused module (weights_scaling_factor_2)."""
    out_f, in_f = qt.shape
    f32 = torch.float32
    if algo in PLAIN_ALGOS:
        return {"weight": Part.of("weight", qt.dequantize().to(dtype))}
    if algo == "FP8":
        return {"weight": Part.of("weight", qt.values),
                "weights_scaling_factor": Part.of("weights_scaling_factor", qt.scale.to(f32).reshape(1)),
                "activation_scaling_factor": Part.of("activation_scaling_factor", act_scale(amax, FP8_MAX))}
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return {"weight": Part.of("weight", qt.values),
                "per_channel_scale": Part.of("per_channel_scale", qt.scale.to(f32).reshape(out_f))}
    if algo == "W8A8_SQ_PER_CHANNEL":  # ModelOpt layout: TensorRT-LLM's Int8SmoothQuantLinear
        return {"weight": Part.of("weight", qt.values),
                "weights_scaling_factor": Part.of("weights_scaling_factor", qt.scale.to(f32).reshape(out_f)),
                "activation_scaling_factor": Part.of("activation_scaling_factor", act_scale(amax, INT8_MAX)),
                # SmoothQuant is folded into the weights and norms by qtk: the pre-quant multiplier is one
                "prequant_scaling_factor": Part.of("prequant_scaling_factor", torch.ones(in_f, dtype=dtype))}
    if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":  # SmoothQuantLinear / SmoothQuantRowLinear (plugin)
        parts = {"weight": Part.of("weight", qt.values),
                 "per_channel_scale": Part.of("per_channel_scale", qt.scale.to(f32).reshape(1, out_f))}
        if row:
            parts["smoother"] = Part.of("smoother", torch.ones(1, in_f, dtype=f32))
        return parts
    if algo in INT4_GROUP_ALGOS:
        # qtk's full grid (-8..7, amax/7.5; ModelOpt exports amax/7): the group-wise kernel computes q * s for any code
        parts = {"weight": Part.of("weight", qt.values, pack_int4_pairs),
                 "weights_scaling_factor": Part.of("weights_scaling_factor", qt.scale.to(f32)),
                 "prequant_scaling_factor": Part.of("prequant_scaling_factor", torch.ones(in_f, dtype=dtype))}
        if algo == "W4A8_AWQ":
            wa = w4a8_weight_amax(qt) if weight_amax is None else weight_amax
            parts["weights_scaling_factor_2"] = Part.of("weights_scaling_factor_2", act_scale(wa, FP8_MAX))
            parts["activation_scaling_factor"] = Part.of("activation_scaling_factor", act_scale(amax, FP8_MAX))
        return parts
    if algo in NVFP4_ALGOS:
        gs = float(qt.extra[GLOBAL].reshape(()))
        parts = {"weight": Part.of("weight", qt.values, pack_fp4),  # split as codes, packed per rank
                 "weights_scaling_factor": Part.of("weights_scaling_factor", qt.scale.to(torch.float8_e4m3fn)),
                 "weights_scaling_factor_2": Part.of("weights_scaling_factor_2", torch.tensor(1.0 / gs, dtype=f32))}
        if algo == "NVFP4":
            a = amax if amax is not None and amax > 0 else _FP4_INPUT_MAX
            parts["activation_scaling_factor"] = Part.of("activation_scaling_factor", torch.tensor(a / _FP4_INPUT_MAX, dtype=f32))
        return parts
    raise AssertionError(f"no layout for {algo}")


def layout(algo: str, out_f: int, in_f: int, group_size: int | None, dtype: torch.dtype) -> dict[str, tuple]:
    """What a reader expects of one Linear under `algo`, merged over ranks: key -> (dtypes, shape)."""
    f32 = torch.float32
    return {
        "FP8": {"weight": ((torch.float8_e4m3fn,), [out_f, in_f]), "weights_scaling_factor": ((f32,), [1]),
                "activation_scaling_factor": ((f32,), [1])},
        "FP8_PER_CHANNEL_PER_TOKEN": {"weight": ((torch.float8_e4m3fn,), [out_f, in_f]), "per_channel_scale": ((f32,), [out_f])},
        "W8A8_SQ_PER_CHANNEL": {"weight": ((torch.int8,), [out_f, in_f]), "weights_scaling_factor": ((f32,), [out_f]),
                                "activation_scaling_factor": ((f32,), [1])},
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": {"weight": ((torch.int8,), [out_f, in_f]), "per_channel_scale": ((f32,), [1, out_f])},
        "W4A16_AWQ": {"weight": ((torch.int8, torch.uint8), [out_f // 2, in_f]),
                      "weights_scaling_factor": ((f32,), [out_f, in_f // group_size if group_size else 0])},
        "W4A8_AWQ": {"weight": ((torch.int8, torch.uint8), [out_f // 2, in_f]),
                     "weights_scaling_factor": ((f32,), [out_f, in_f // group_size if group_size else 0]),
                     "weights_scaling_factor_2": ((f32,), [1]), "activation_scaling_factor": ((f32,), [1])},
        "NVFP4": {"weight": ((torch.uint8,), [out_f, in_f // 2]), "weights_scaling_factor": ((torch.float8_e4m3fn,), [out_f, in_f // 16]),
                  "weights_scaling_factor_2": ((f32,), []), "activation_scaling_factor": ((f32,), [])},
        "W4A16_NVFP4": {"weight": ((torch.uint8,), [out_f, in_f // 2]),
                        "weights_scaling_factor": ((torch.float8_e4m3fn,), [out_f, in_f // 16]), "weights_scaling_factor_2": ((f32,), [])},
    }.get(algo, {"weight": ((dtype,), [out_f, in_f])})


def trtllm_build_weight_only(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype) -> QTensor:
    """What trtllm-build does to the plain weights of a W8A16 / W4A16 checkpoint (TensorRT-LLM's
    symmetric_quantize, cutlass_preprocessors.cpp): per output row, scale = amax / 2^(b-1) (amax/128, amax/8), kept in
    float32 to quantize, q = round-half-away-from-zero(w / scale) clamped to [-2^(b-1), 2^(b-1)-1], and the scale
    stored in the model dtype for the kernel, which computes q * scale. Not qtk's grid (amax/127.5, amax/7.5): the
    build re-quantizes whatever it is given, so this is the only faithful simulation of what the engine runs."""
    wf = w.float()  # [out, in]
    scale = wf.abs().amax(1, keepdim=True) / (1 << (scheme.num_bits - 1))  # [out, 1], float32
    x = torch.where(scale > 0, wf / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(wf))
    q = (x.sign() * (x.abs() + 0.5).floor()).clamp(scheme.qmin, scheme.qmax).to(torch.int8)
    return QTensor(q, scale.to(dtype).float(), scheme, None, None, dtype)


def decode(algo: str, t: Mapping[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype, where: str = "") -> QTensor:
    """The QTensor the engine computes with, from one Linear's tensors merged over ranks."""
    if algo in PLAIN_ALGOS:  # plain weights: what trtllm-build's own quantization makes of them
        return trtllm_build_weight_only(t["weight"].to(dtype), scheme, dtype)
    for k in ("prequant_scaling_factor", "smoother"):
        if k in t and not bool((t[k] == 1).all()):
            raise UsageError(f"{where}: {k} is not all ones (smoothing kept outside the weights)",
                             "qtk simulates checkpoints whose smoothing is folded into the weights, as qtk writes them")
    if algo in INT4_GROUP_ALGOS:  # W4A8_AWQ: the weights_scaling_factor_2 TensorRT-LLM divides out, it multiplies back
        return QTensor(unpack_int4_pairs(t["weight"]), t["weights_scaling_factor"].float(), scheme, None, None, dtype)
    if algo in NVFP4_ALGOS:
        gs = 1.0 / t["weights_scaling_factor_2"].float().reshape(1)
        return QTensor(unpack_fp4(t["weight"]), t["weights_scaling_factor"].float(), scheme, None, None, dtype, {GLOBAL: gs})
    w = t["weight"]
    if algo == "FP8":
        scale = t["weights_scaling_factor"].float().reshape(1)
    elif "per_channel_scale" in t:
        scale = t["per_channel_scale"].float().reshape(-1, 1)
    else:
        scale = t["weights_scaling_factor"].float().reshape(-1, 1)
    return QTensor(w, scale, scheme, None, None, dtype)
