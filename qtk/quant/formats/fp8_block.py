"""FP8 e4m3 in 2-D blocks (DeepSeek-V3's layout; compressed-tensors strategy block, block_structure [128, 128]): one
scale per block of the weight, and the activations that go with it, FP8 per token per group of `group_size` input
channels, dynamic (compressed-tensors strategy group on float 8 activations).

Weights: scale = amax(block) / 448, shape [ceil(out/128), ceil(in/128)]; a ragged last block row or column is scaled
over its real elements only (compressed-tensors pads with zeros, which cannot raise an amax). q = fp8_e4m3(w /
scale), dequantized w ≈ q · scale. compressed-tensors writes it as ``float-quantized`` with ``strategy: block,
block_structure: [128, 128]`` (``weight`` float8_e4m3fn [out, in], ``weight_scale`` in the model dtype); Hugging
Face's own format (``quant_method: fp8``) stores the same multiplier as ``weight_scale_inv`` float32.

Arithmetic follows compressed-tensors 0.20 bit for bit: the scale is amax/448 rounded to its storage dtype (a bf16
scale for a bf16 weight), an all-zero block gets that dtype's eps, and w / scale runs in torch's promoted dtype of the
two (bf16 ÷ bf16 rounds to bf16 before the fp8 cast). With float32 inputs this is plain float32 arithmetic, which is
what vLLM's kernels do.

QTensor layout: values float8_e4m3fn [out, in], scale float32 [ceil(out/bm), ceil(in/bn)] (model-dtype values).
"""

from __future__ import annotations

from qtk.errors import UsageError
from qtk.quant.e4m3 import to_float32
from qtk.quant.formats.base import Format, QParams, Stored, check_float, register_format
from qtk.quant.formats.grouped import check_unpacked, decode_unpacked, is_half
from qtk.quant.lazy import torch
from qtk.quant.scheme import QuantScheme, Strategy

FP8_BLOCK = (128, 128)
FP8_ACT_GROUP = 128
FP8_E4M3_MAX = 448.0


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [out, in] -> zero-padded [R, C, bm, bn] with R = ceil(out/bm), C = ceil(in/bn)."""
    bm, bn = block
    out, inp = w.shape
    R, C = -(-out // bm), -(-inp // bn)
    w = torch.nn.functional.pad(w, (0, C * bn - inp, 0, R * bm - out))
    return w.reshape(R, bm, C, bn).transpose(1, 2)


def _unblock(b: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[R, C, bm, bn] -> [out, in], dropping the padding."""
    R, C, bm, bn = b.shape
    return b.transpose(1, 2).reshape(R * bm, C * bn)[: shape[0], : shape[1]].contiguous()


def fp8_block_scales(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                     scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-block scales of w [out, in] -> scale_dtype (default w's dtype) [ceil(out/bm), ceil(in/bn)]."""
    scale_dtype = scale_dtype or w.dtype
    amax = _blocks(w.detach(), block).abs().amax(dim=(-2, -1))  # [R, C], exact in w's dtype
    s = (amax.float() / FP8_E4M3_MAX).to(scale_dtype)
    return torch.where(s == 0, torch.finfo(scale_dtype).eps, s)


def fp8_block_quantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """float8_e4m3fn [out, in] = fp8(w / scale) per block; scale [ceil(out/bm), ceil(in/bn)]."""
    b = _blocks(w, block) / scale[:, :, None, None]  # [R, C, bm, bn]
    return _unblock(b.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), tuple(w.shape))


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
    """w ≈ q · scale per block: float8_e4m3fn [out, in] -> dtype (default the scale's) [out, in]."""
    dtype = dtype or scale.dtype
    b = _blocks(to_float32(q), block) * scale.float()[:, :, None, None]
    return _unblock(b, tuple(q.shape)).to(dtype)


def fp8_group_fake_quant(x: torch.Tensor, group_size: int | None = FP8_ACT_GROUP) -> torch.Tensor:
    """Quantize-dequantize activations x [..., n] with dynamic FP8 scales per token per group of group_size
    input channels (None = the whole row: per token, W4A8-FP8 and FP8-dynamic). Returns x's dtype.

    As compressed-tensors simulates it: scale = amax/448 in x's dtype (eps where 0), q = fp8(x / scale). When
    group_size does not divide n the last group is partial (ceil(n/g) groups, its scale over its real elements), as
    vLLM's native QuantFP8 computes it (zero padding cannot raise an amax); compressed-tensors' own fake-quant and
    vLLM's CUDA quantizer refuse such an n, which is why qtk's targets do (qtk.model.config_check.fp8_block_misfit)."""
    n = x.shape[-1]
    g = n if group_size is None else group_size
    G = -(-n // g)
    xp = torch.nn.functional.pad(x, (0, G * g - n)) if G * g != n else x
    xg = xp.reshape(*x.shape[:-1], G, g)  # [..., G, g]
    amax = xg.detach().abs().amax(-1, keepdim=True)
    s = (amax.float() / FP8_E4M3_MAX).to(x.dtype)
    s = torch.where(s == 0, torch.finfo(x.dtype).eps, s)
    q = (xg / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    return (q * s).reshape(*x.shape[:-1], G * g)[..., :n]


def _e4m3(s: QuantScheme) -> bool:
    return s.type == "float" and s.num_bits == 8 and s.scale_dtype is None


@register_format
class FP8BlockFormat(Format):
    name = "fp8-block"
    ct_formats = ("float-quantized",)

    def accepts(self, scheme: QuantScheme) -> bool:
        if not _e4m3(scheme):
            return False
        return (scheme.strategy == Strategy.BLOCK and scheme.block_structure is not None) or (
            scheme.strategy == Strategy.GROUP and scheme.dynamic is True)  # per-token-group activations

    def claims(self, scheme: QuantScheme) -> bool:
        return _e4m3(scheme) and scheme.strategy in (Strategy.BLOCK, Strategy.GROUP)

    def validate(self, s: QuantScheme, where: str, role: str) -> None:
        check_float(s, where)
        if s.strategy == Strategy.GROUP and not (role == "activations" and s.dynamic is True):
            raise UsageError(f"{where}.strategy: group-wise fp8 is not supported by the target engines (except dynamic "
                             "per-token-group activations of FP8 block)", "use strategy: channel, tensor or block")
        if s.observer == "mse" and s.strategy == Strategy.BLOCK:
            raise UsageError(f"{where}.observer: the mse observer searches int / fp8 per-channel grids only",
                             "use observer: minmax")

    def activation_strategies(self, scheme: QuantScheme) -> bool:
        return scheme.strategy == Strategy.GROUP and scheme.dynamic is True

    def pairs(self, w: QuantScheme, a: QuantScheme, where: str) -> bool | None:
        if not (w.strategy == Strategy.BLOCK or a.strategy == Strategy.GROUP):
            return None
        if not (w.strategy == Strategy.BLOCK and a.strategy == Strategy.GROUP and _e4m3(a)):
            raise UsageError(f"{where}: FP8 block weights run with dynamic FP8 activations per token group of 128, and "
                             "only they", "use the fp8-block recipe as a template")
        if a.group_size != w.block_structure[1]:
            raise UsageError(f"{where}: activation groups of {a.group_size} do not match weight blocks of "
                             f"{w.block_structure[1]} input columns", f"set activations group_size: {w.block_structure[1]}")
        return True

    def storage_dtype(self, scheme):
        return torch.float8_e4m3fn

    def has_zero_point(self, scheme):
        return False

    def scale_dtype(self, scheme, model_dtype):
        return model_dtype

    def qparams(self, w, scheme, model_dtype):
        return QParams(fp8_block_scales(w.float(), tuple(scheme.block_structure), model_dtype).float())

    def quantize(self, w, qp, scheme, model_dtype=None):
        # a bf16 / fp16 model divides in its dtype, as compressed-tensors does on the weight tensor (fp8.py)
        dt = model_dtype if is_half(model_dtype) else torch.float32
        return fp8_block_quantize(w.to(dt), qp.scale.to(dt), tuple(scheme.block_structure))

    def dequantize(self, values, qp, scheme, g_idx=None):
        if g_idx is not None:
            raise ValueError("FP8 block weights have no act-order g_idx")
        return fp8_block_dequantize(values, qp.scale.float(), tuple(scheme.block_structure), torch.float32)

    def column_quantizer(self, scheme, qp=None, model_dtype=None):
        def quantize_column(w, s, z):
            q = torch.div(w, s).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            return q, to_float32(q).mul_(s)

        return quantize_column

    def dequantize_columns(self, q, scale, zero, qp=None):
        return to_float32(q) * scale

    def fake_quant_activation(self, x, scheme, scale=None):
        return fp8_group_fake_quant(x, scheme.group_size)

    def static_scale(self, amax, scheme):
        raise ValueError("FP8 per-token-group activations are quantized dynamically; they have no static scale")

    # ---- compressed-tensors: float-quantized, weight_scale in the model dtype ----

    def scale_shape(self, scheme, out_f, in_f):
        bm, bn = scheme.block_structure
        return [-(-out_f // bm), -(-in_f // bn)]

    def stored(self, module, shape, dtype):
        out, inn = shape
        return [Stored("weight", (out, inn), "float8_e4m3fn", "quantized"),
                Stored("weight_scale", tuple(self.scale_shape(module.weights, out, inn)), dtype, "scales")]

    def encode(self, qt, dtype, fmt):
        return {"weight": qt.values, "weight_scale": qt.scale.to(dtype)}

    def decode(self, t, scheme, dtype):
        return decode_unpacked(t, scheme, dtype)

    def check_stored(self, view, module, scheme, fmt, shape):
        s = scheme.weights
        return check_unpacked(view, module, s, shape, torch.float8_e4m3fn, self.scale_shape(s, *shape))

    # ---- the data-free stream and the checks ----

    def native_plan(self, w, scheme, model_dtype, extra=None):
        from qtk.quant.native.rounding import BLOCK, NativePlan

        if extra or scheme.strategy != Strategy.BLOCK:
            return None
        rows, cols = w.shape
        bm, bn = (int(x) for x in scheme.block_structure)
        return NativePlan(BLOCK, bn, bm, (-(-rows // bm), -(-cols // bn)), torch.float8_e4m3fn, FP8_E4M3_MAX,
                          zero_scale=torch.finfo(model_dtype).eps)

    def row_slab(self, scheme):
        """Slabs of whole tile rows (a scale per 128 x 128 tile)."""
        if scheme.observer != "minmax" or scheme.block_structure is None:
            return None
        return int(scheme.block_structure[0])

    def error_bound(self, scheme):
        return 0.2

    def static_amax(self, scale, scheme):
        raise ValueError("FP8 per-token-group activations are quantized dynamically; they have no static scale")
