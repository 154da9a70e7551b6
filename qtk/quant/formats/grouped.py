"""What formats with one scale (and zero point) per tensor, output channel or group of input columns share: the
grouped views of a weight, the min-max, full-range (int) and MSE-grid observers, the quantize / dequantize skeleton, the scale's
shape and check, the native kernel's plan and the rows that round on their own. A format (integer.py, fp8.py)
supplies its scale rule, zero point, rounding, storage dtype and compressed-tensors layout.

Dequantized w = (q - zero) * scale.
"""

from __future__ import annotations

from qtk.quant.e4m3 import to_float32
from qtk.quant.formats.base import SCALAR, Format, QParams, float_dtypes
from qtk.quant.lazy import torch
from qtk.quant.scheme import QuantScheme, Strategy

STRATEGIES = (Strategy.TENSOR, Strategy.CHANNEL, Strategy.GROUP)
_TINY = 2.0 ** -126  # float32's smallest normal number


def is_half(dtype) -> bool:
    """Whether `dtype` is a 16-bit float (bf16, fp16): the dtypes whose reference quantizers round their arithmetic."""
    return dtype in (torch.bfloat16, torch.float16)


def g_idx_of(tensors) -> "torch.Tensor | None":
    """An older compressed-tensors checkpoint's act-order g_idx (actorder "group"); decoding without it would be
    wrong. Read, never written (compressed-tensors 0.20 rejects it)."""
    return tensors["weight_g_idx"].to(torch.int32) if "weight_g_idx" in tensors else None


def decode_unpacked(t, scheme: QuantScheme, dtype) -> "qtk.quant.qtensor.QTensor":
    """The QTensor of a weight stored unpacked: `weight` holds its values, `weight_scale` its scales (as float32),
    and an older checkpoint's g_idx when there is one."""
    from qtk.quant.formats.base import as_float32
    from qtk.quant.qtensor import QTensor

    return QTensor(t["weight"], as_float32(t["weight_scale"]), scheme, None, g_idx_of(t), dtype)


def check_unpacked(view, module: str, scheme: QuantScheme, shape, values_dtype, scale_shape: list[int]) -> list[str]:
    """Problems of a weight stored unpacked: `weight` [out, in] in values_dtype, its scale and any g_idx."""
    problems: list[str] = []
    view.expect(f"{module}.weight", (values_dtype,), list(shape), problems)
    check_scale_and_g_idx(view, module, scale_shape, scheme.describe(), shape[1], problems)
    return problems


def check_scale_and_g_idx(view, module: str, scale_shape: list[int], describe: str, in_f: int,
                          problems: list[str]) -> None:
    """A module's float weight_scale in its scheme's shape, and a g_idx [in] when one is stored."""
    view.expect(f"{module}.weight_scale", float_dtypes(), SCALAR if scale_shape == [1] else scale_shape, problems,
                f" ({describe})")
    gi = f"{module}.weight_g_idx"
    if view.has(gi):
        view.expect(gi, (torch.int32, torch.int64), [in_f], problems)


def grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """View w [out, in] as [out, n_groups, group] so each statistic reduces over the last dim."""
    out, inp = w.shape
    if scheme.strategy == Strategy.TENSOR:
        return w.reshape(1, 1, -1)
    if scheme.strategy == Strategy.CHANNEL:
        return w.reshape(out, 1, inp)
    if scheme.strategy == Strategy.GROUP:
        g = scheme.group_size
        assert inp % g == 0, f"group_size {g} does not divide in_features {inp}"  # validated upstream
        return w.reshape(out, inp // g, g)
    raise ValueError(f"weights cannot use strategy '{scheme.strategy}'")


def ungroup(t: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """[out|1, n_groups, 1] -> the storage shape of a scale for the strategy: [1], [out, 1] or [out, in/group]."""
    if scheme.strategy == Strategy.TENSOR:
        return t.reshape(1)
    if scheme.strategy == Strategy.CHANNEL:
        return t.reshape(-1, 1)
    return t.reshape(t.shape[0], t.shape[1])


def regroup(t: torch.Tensor, w_shape, scheme: QuantScheme) -> torch.Tensor:
    """A scale in its storage shape -> [out|1, n_groups, 1], to broadcast over grouped(w)."""
    out, inp = w_shape
    if scheme.strategy == Strategy.TENSOR:
        return t.reshape(1, 1, 1)
    if scheme.strategy == Strategy.CHANNEL:
        return t.reshape(out, 1, 1)
    return t.reshape(out, inp // scheme.group_size, 1)


def dequantize_grouped(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    qf = to_float32(q)  # int codes, or fp8 decoded by bit arithmetic (qtk.quant.e4m3)
    keeps = all(x is None or (torch.result_type(qf, x) == qf.dtype and torch.broadcast_shapes(qf.shape, x.shape) == qf.shape)
                for x in (zero, scale))  # the float32 result has qf's shape and dtype: in place gives the same values
    if qf is q or not keeps:  # q's own tensor, or a result another shape or dtype
        return (qf - zero if zero is not None else qf) * scale
    if zero is not None:  # in place on the new float32 copy: no second weight-sized temporary
        qf.sub_(zero)
    return qf.mul_(scale)


class GroupedFormat(Format):
    """Base of the int and fp8 specs. Subclasses define raw_scale, zero_point, quantize_grouped, max_value,
    round_activation_, storage_dtype and their native kernel's plan (_native_kind); the arithmetic around them is
    shared."""

    def accepts(self, scheme: QuantScheme) -> bool:
        raise NotImplementedError

    def scale_shape(self, scheme: QuantScheme, out_f: int, in_f: int) -> list[int]:
        if scheme.strategy == Strategy.TENSOR:
            return [1]
        if scheme.strategy == Strategy.CHANNEL:
            return [out_f, 1]
        return [out_f, in_f // scheme.group_size if scheme.group_size else 0]

    def stored_scale_shape(self, scheme: QuantScheme, out_f: int, in_f: int) -> tuple[int, ...]:
        """The planner's scale shape: groups rounded up (a ragged last group, which qtk's targets refuse)."""
        if scheme.strategy == Strategy.TENSOR:
            return (1,)
        return (out_f, -(-in_f // scheme.group_size) if scheme.strategy == Strategy.GROUP else 1)

    def static_amax(self, scale: float, scheme: QuantScheme) -> float:
        return scale * self.max_value(scheme)

    def row_slab(self, scheme: QuantScheme) -> int | None:
        """Per-channel and per-group scales from the min-max observer: each scale is a min/max over part of one row,
        each code an elementwise function of the row and its scales."""
        return 1 if scheme.strategy in (Strategy.CHANNEL, Strategy.GROUP) and scheme.observer in ("minmax", "full_range") \
            else None

    def native_plan(self, w, scheme, model_dtype, extra=None):
        from qtk.quant.native.rounding import NativePlan

        if extra or scheme.strategy not in (Strategy.CHANNEL, Strategy.GROUP):
            return None
        rows, cols = w.shape
        group = cols if scheme.strategy == Strategy.CHANNEL else int(scheme.group_size)
        if cols % group or self.scale_dtype(scheme, model_dtype) != model_dtype:
            return None
        kind = self._native_kind(scheme)
        if kind is None:
            return None
        # compressed-tensors' guard: a zero scale becomes the model dtype's eps; a float32 model's all-zero group: 1.0
        zero = torch.finfo(model_dtype).eps if is_half(model_dtype) else 1.0
        return NativePlan(kind, group, 1, (rows, cols // group), self.storage_dtype(scheme), *self._native_grid(scheme),
                          zero_scale=zero)

    def _native_kind(self, scheme: QuantScheme) -> int | None:
        """The kernel's kind for this scheme (qtk.quant.native.rounding), None where it has none."""
        return None

    def _native_grid(self, scheme: QuantScheme) -> tuple[float, float, float]:
        """(divisor of amax for the scale, qmin, qmax) the kernel rounds with."""
        raise NotImplementedError

    # ---- what a subclass defines ----

    def raw_scale(self, xmin: torch.Tensor, xmax: torch.Tensor, scheme: QuantScheme,
                  half: torch.dtype | None = None) -> torch.Tensor:
        """Scale from per-group min <= 0 <= max, before the zero-scale guard and the storage rounding.
        half: the dtype each intermediate is rounded to (see quotient_dtype), None for float32."""
        raise NotImplementedError

    def zero_point(self, xmin: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme,
                   half: torch.dtype | None = None) -> torch.Tensor | None:
        return None

    def quantize_grouped(self, wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         scheme: QuantScheme, half: torch.dtype | None = None) -> torch.Tensor:
        """q for w viewed [*, n_groups, group] with scale/zero [*, n_groups, 1] (values of the grid, any float dtype);
        half: as in raw_scale."""
        raise NotImplementedError

    def quotient_dtype(self, model_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype in which the weight's quantization arithmetic (w / scale, zero point, asymmetric range) is
        rounded for a model stored in model_dtype, as the reference quantizer computes it; None: float32."""
        return None

    def max_value(self, scheme: QuantScheme) -> float:
        """The largest magnitude of the grid, in units of the scale (activation scale = amax / max_value)."""
        raise NotImplementedError

    def round_activation_(self, y: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        """Round scaled float32 activations onto the grid, in place where possible."""
        raise NotImplementedError

    # ---- shared ----

    def scale_zero(self, xmin: torch.Tensor, xmax: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None):
        """Scale (and zero point) from per-group min/max; scales rounded to their storage dtype first."""
        xmin = torch.minimum(xmin, torch.zeros_like(xmin))
        xmax = torch.maximum(xmax, torch.zeros_like(xmax))
        half = self.quotient_dtype(scale_dtype)
        scale = self.raw_scale(xmin, xmax, scheme, half)
        if half is not None:
            # compressed-tensors' guard, so all-zero groups get its scale too: a zero scale becomes the dtype's eps
            scale = scale.to(half).float()
            zero = self.zero_point(xmin, scale, scheme, half)  # before the guard: an all-zero group's is 0/0,
            if zero is not None:                               # which compressed-tensors casts to 0
                zero = torch.nan_to_num(zero, nan=0.0)
            return torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(half).eps)), zero
        # an all-zero group quantizes to zeros with any scale; 1.0 keeps every scale finite and positive
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if scale_dtype is not None:
            scale = scale.to(scale_dtype).float()
            scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(scale_dtype).tiny))
        return scale, self.zero_point(xmin, scale, scheme)

    def _mse_shrink(self, wg, xmin, xmax, scheme, scale_dtype, grid: int = 80, max_shrink: float = 0.8, norm: float = 2.4):
        """MSE-grid observer: per group, the shrink of [min, max] that minimises |Q(w) - w|^norm."""
        half = self.quotient_dtype(scale_dtype)
        best_err = torch.full(xmin.shape, float("inf"), device=wg.device)
        best_min, best_max = xmin.clone(), xmax.clone()
        for i in range(int(max_shrink * grid)):
            p = 1 - i / grid
            smin, smax = p * xmin, p * xmax
            scale, zero = self.scale_zero(smin, smax, scheme, scale_dtype)
            err = (dequantize_grouped(self.quantize_grouped(wg, scale, zero, scheme, half), scale, zero) - wg).abs().pow(norm).sum(-1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_min = torch.where(better, smin, best_min)
            best_max = torch.where(better, smax, best_max)
        return best_min, best_max

    def grouped_qparams(self, w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None):
        """(scale, zero) of weight w [out, in] with scales rounded to scale_dtype; shapes [1], [out, 1] or [out, in/group]."""
        wg = grouped(w.float(), scheme)
        xmin = wg.amin(-1, keepdim=True)
        xmax = wg.amax(-1, keepdim=True)
        if scheme.observer == "mse":
            xmin, xmax = self._mse_shrink(wg, xmin, xmax, scheme, scale_dtype)
        if scheme.observer == "full_range":  # symmetric int only (the recipe refuses the rest): no zero point
            return ungroup(self.full_range_scale(xmin, xmax, scheme, scale_dtype), scheme), None
        scale, zero = self.scale_zero(xmin, xmax, scheme, scale_dtype)
        return ungroup(scale, scheme), (None if zero is None else ungroup(zero, scheme))

    def qparams(self, w: torch.Tensor, scheme: QuantScheme, model_dtype: torch.dtype) -> QParams:
        scale, zero = self.grouped_qparams(w, scheme, self.scale_dtype(scheme, model_dtype))
        return QParams(scale, zero)

    def quantize(self, w: torch.Tensor, qp: QParams, scheme: QuantScheme,
                 model_dtype: torch.dtype | None = None) -> torch.Tensor:
        wg = grouped(w.float(), scheme)
        zero = qp.zero_point
        q = self.quantize_grouped(wg, regroup(qp.scale, w.shape, scheme),
                                  None if zero is None else regroup(zero, w.shape, scheme), scheme,
                                  self.quotient_dtype(model_dtype))
        return q.reshape(w.shape).to(self.storage_dtype(scheme))

    def quantize_decoded(self, w: torch.Tensor, qp: QParams, scheme: QuantScheme,
                         model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """In a bf16 / fp16 model's own dtype: quantize() rounds the float32 quotient w / s to that dtype (the
        reference quantizers divide half tensors), and each later step is exact there (integer codes up to 256 for
        round, clamp and the zero point's add; fp8's clamp), so dividing the half weight by the half scale gives the
        same values without a float32 pass. The engine's decode of an int format is (q - z)·s rounded once to the
        model dtype, which the half ops give too ((q - z) has <= 9 bits, s 8 or 11: the float product is exact);
        fp8's is q·s in float32 (exact). Per-channel and per-group scales only."""
        if (w.dtype != model_dtype or self.quotient_dtype(model_dtype) != model_dtype
                or scheme.strategy not in (Strategy.CHANNEL, Strategy.GROUP) or w.dim() != 2):
            return None
        wg = grouped(w, scheme)
        s = regroup(qp.scale, w.shape, scheme).to(model_dtype)
        z = None if qp.zero_point is None else regroup(qp.zero_point, w.shape, scheme).to(model_dtype)
        q = self.quantize_grouped(wg, s, z, scheme, None)  # half in, half arithmetic
        values = q.reshape(w.shape).to(self.storage_dtype(scheme))
        if self.decodes_in_model_dtype(scheme):
            decoded = (q if z is None else q.sub_(z)).mul_(s).float()
        else:
            decoded = dequantize_grouped(values.reshape(wg.shape), s.float(), None if z is None else z.float())
        return values, decoded.reshape(w.shape)

    def dequantize(self, values: torch.Tensor, qp: QParams, scheme: QuantScheme,
                   g_idx: torch.Tensor | None = None) -> torch.Tensor:
        scale, zero = qp.scale, qp.zero_point
        if g_idx is not None:
            s = scale[:, g_idx.long()]
            z = None if zero is None else zero[:, g_idx.long()].float()
            qf = to_float32(values)
            return ((qf - z) if z is not None else qf) * s
        qg = grouped(to_float32(values), scheme)
        w = dequantize_grouped(qg, regroup(scale.float(), values.shape, scheme),
                               None if zero is None else regroup(zero.float(), values.shape, scheme))
        return w.reshape(values.shape)

    def column_quantizer(self, scheme: QuantScheme, qp: QParams | None = None, model_dtype: torch.dtype | None = None):
        half = self.quotient_dtype(model_dtype)

        def quantize_column(w, s, z):
            q = self.quantize_grouped(w, s, z, scheme, half)
            return q, dequantize_grouped(q, s, z)

        return quantize_column

    def dequantize_columns(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                           qp: QParams | None = None) -> torch.Tensor:
        return dequantize_grouped(q, scale, zero)

    def fake_quant_activation(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token dynamic (scale = row amax / max) or static per-tensor; runs on every Linear input of a simulated
        model, so it works in place on one float32 buffer."""
        qmax = self.max_value(scheme)
        if scheme.dynamic and not scheme.symmetric and scheme.type == "int" and scheme.strategy == Strategy.TOKEN:
            return self._fake_quant_asymmetric_tokens(x, scheme)
        if scheme.dynamic:
            amax = x.abs().amax(-1, keepdim=True) if scheme.strategy == Strategy.TOKEN else x.abs().amax()
            if amax.dtype != torch.float32:
                amax = amax.float()
            # an all-zero row quantizes to zeros with any positive scale: the smallest normal float stands in for 0
            s = amax.div_(qmax).clamp_min_(_TINY)
        else:
            if scale is None:
                raise ValueError("static activation quantization needs a calibrated input scale")
            s = scale.float().reshape(())
        y = x.float().div(s) if x.dtype != torch.float32 else x.div(s)
        y = self.round_activation_(y, scheme)
        y = y.mul_(s)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def _fake_quant_asymmetric_tokens(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        """Per-token asymmetric int-N, as torch's dynamic 4-bit matmul quantizes its input (W4A8-INT8): each row's
        range [min(x, 0), max(x, 0)] spans qmin..qmax, scale = range / (qmax - qmin), zero point round(qmin -
        min/scale); x -> (clamp(round(x/scale) + zp) - zp) * scale, in float32."""
        xf = x.float()
        lo = xf.amin(-1, keepdim=True).clamp_max_(0)
        hi = xf.amax(-1, keepdim=True).clamp_min_(0)
        s = (hi - lo).div_(scheme.qmax - scheme.qmin).clamp_min_(_TINY)
        zp = (scheme.qmin - lo / s).round_()
        y = (xf / s).round_().add_(zp).clamp_(scheme.qmin, scheme.qmax).sub_(zp).mul_(s)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def static_scale(self, amax: float | torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
        s = a / self.max_value(scheme)
        return torch.where(s > 0, s, torch.ones_like(s))
