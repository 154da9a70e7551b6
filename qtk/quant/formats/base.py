"""The format registry: one object per number format, looked up by `format_for(scheme)`, that answers every question
about its schemes, from a recipe's vocabulary to the bytes on disk.

- Which schemes: `claims` (the family whose refusals speak for a scheme), `accepts`, `validate` (a recipe's scheme
  for a role, every refusal naming the key and the fix), `pairs` (the activations its weights run with).
- The arithmetic: quantization parameters of a weight (`qparams`), its stored values (`quantize`, `storage_dtype`),
  how they decode (`dequantize`), GPTQ's column by column quantization (`column_quantizer`), how the engines quantize
  activations at run time (`fake_quant_activation`, `static_scale`, `static_amax`).
- Its tensors in a compressed-tensors checkpoint (the vllm target): the format name (`ct_format`), what a writer
  writes and a reader decodes (`encode`, `decode`), what a reader checks (`check_stored`), and the planner's list of
  those tensors with their dtypes and shapes (`stored`), from which it counts bytes.
- How the data-free stream rounds it: the native kernel's plan (`native_plan`), rows that round on their own
  (`row_slab`), the key of the stream's measured rate (`stream_key`).
- What the checks of a written checkpoint hold it to (`error_bound`, `value_problems`, `scale_problems`).

A format whose quantization needs more than a scale and a zero point (NVFP4's per-tensor global scale) returns them
in `QParams.extra`; QTensor carries them in its `extra` mapping, under the format's names. Adding a format is one
module with one Format subclass decorated with @register_format (tests/quant/test_format_in_one_file.py adds one and
converts, reads back, inspects and plans with it). Only the tables of what each engine runs (qtk.export.trtllm.algo,
qtk.export.modelopt, qtk.plan.serving) name formats.

Importing a format imports no torch (qtk.quant.lazy): the recipe parser and `qtk plan` ask formats too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

from qtk.errors import UsageError
from qtk.quant.lazy import torch
from qtk.quant.scheme import QuantScheme
from qtk.registry import Registry

SCALAR = ([], [1], [1, 1])  # shapes a per-tensor scale is stored with


@dataclass(frozen=True)
class QParams:
    """What a format computes from a weight before rounding it: scale, zero point (asymmetric int) and the tensors a
    format needs beyond them (`extra`, e.g. a global scale), which QTensor carries under the same names."""

    scale: "torch.Tensor"
    zero_point: "torch.Tensor | None" = None
    extra: Mapping[str, "torch.Tensor"] = field(default_factory=dict)


class Stored(NamedTuple):
    """One tensor a quantized Linear is stored as (compressed-tensors, the vllm target): its key after the Linear's
    name, shape, safetensors dtype name ("int32", "float8_e4m3fn", the model's "bfloat16") and the part of the
    checkpoint it counts to ("quantized" values or "scales")."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    part: str


# GPTQ's quantizer of one column w [out] with that column's scale s and zero point z -> (q, dequantized q)
ColumnQuantizer = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"]


class StoredView:
    """What a reader shows a format of one module's stored tensors when it checks them (Format.check_stored)."""

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def tensor(self, name: str) -> "torch.Tensor":
        raise NotImplementedError

    def expect(self, name: str, dtypes, shape, problems: list[str], what: str = "") -> bool:
        """Append a problem naming `name` unless it is stored with one of `dtypes` and the shape `shape` (a list, or
        a tuple of acceptable lists); True when it is fine."""
        raise NotImplementedError


def float_dtypes() -> tuple:
    """The dtypes a float scale may be stored in."""
    return (torch.float32, torch.float16, torch.bfloat16)


def as_float32(t: "torch.Tensor") -> "torch.Tensor":
    """t as float32, a copy in a recycled buffer (qtk.io.safetensors.recycled_empty: the self-check decodes layer
    after layer, each scale the size of the last layer's) unless it is float32 already; fp8 scales (NVFP4's) through
    the native byte table (torch converts float8 a value at a time)."""
    if t.dtype == torch.float32:
        return t
    from qtk.io.safetensors import recycled_empty
    from qtk.quant.native.packing import e4m3_to_float

    fast = e4m3_to_float(t)
    return fast if fast is not None else recycled_empty(t.shape, torch.float32).copy_(t)


def all_equal(v: "torch.Tensor") -> bool:
    """Whether every element of the 1-D tensor `v` equals the first (as `(v == v[0]).all()`: +0 equals -0, NaN equals
    nothing). FP8's == has no vectorized kernel; its bytes are compared instead."""
    if v.element_size() != 1:
        return bool((v == v[0]).all())
    u = v.view(torch.uint8)
    lo, hi = (int(x) for x in torch.aminmax(u))
    if not v.is_floating_point():  # one-byte codes: equal values are equal bytes
        return lo == hi
    if lo != hi:  # several bytes: equal values only if every one is +0 (0x00) or -0 (0x80), which needs lo 0, hi 0x80
        return lo == 0 and hi == 0x80 and int(torch.aminmax(u & 0x7F)[1]) == 0
    return not bool(torch.isnan(v[0].float()))


def check_float(s: QuantScheme, where: str) -> None:
    """What every float format refuses: element widths other than fp8 (e4m3) and fp4 (e2m1), and a zero point."""
    if s.num_bits not in (4, 8):
        raise UsageError(f"{where}.num_bits: float quantization is fp8 (e4m3) or fp4 (e2m1), got {s.num_bits}",
                         "set num_bits: 8 or 4")
    if not s.symmetric:
        raise UsageError(f"{where}.symmetric: float formats have no zero point, asymmetric {s.describe().split()[0]} is impossible",
                         "set symmetric: true")


class Format:
    """A number format. The spec is stateless (everything comes from the scheme); subclasses implement the methods
    that raise NotImplementedError and override the defaults that do not fit."""

    name: str = ""
    # the compressed-tensors formats a checkpoint may store this format's weights in (a reader holds a config to them)
    ct_formats: tuple[str, ...] = ()
    ct_scale_dtype: str | None = None  # compressed-tensors' scale_dtype, for a format whose scales are not model-dtype
    input_scale_key: str = "input_scale"  # the tensor holding a static input scale of activations in this format
    input_scale_multiplies = False  # the static input scale multiplies (a global scale, 448·6/amax): not amax/max
    run_time_local = False  # activations may take `dynamic: local` (group scales at run time under a static one)
    scale_checks: str | None = None  # the check a written checkpoint reports for scale_problems, when there is one

    # ---- which schemes (no torch) ----

    def accepts(self, scheme: QuantScheme) -> bool:
        """Whether this spec quantizes `scheme` (type, bits, strategy)."""
        raise NotImplementedError

    def claims(self, scheme: QuantScheme) -> bool:
        """Whether `scheme` is of this format's family, valid or not: its `validate` then says what is wrong with it
        (format_claiming). By default the schemes it accepts."""
        return self.accepts(scheme)

    def validate(self, scheme: QuantScheme, where: str, role: str) -> None:
        """Refuse (UsageError naming the key and the fix) a scheme of this family that `role` (weights | activations |
        kv_cache) cannot have. Called after the checks every scheme shares (qtk.recipe.schema.validate_scheme)."""

    def activation_strategies(self, scheme: QuantScheme) -> bool:
        """Whether activations in this format may use a strategy other than per tensor or per token (a per-group
        run-time scale: NVFP4's, MX's, FP8 block's per token group)."""
        return False

    def activation_bits(self, scheme: QuantScheme) -> bool:
        """Whether activations in this format may have other than 8 bits (NVFP4's 4)."""
        return False

    def pairs(self, weights: QuantScheme, activations: QuantScheme, where: str) -> bool | None:
        """Whether weights and activations (one of them this format's) run together in one kernel: True, a
        UsageError naming the fix, or None (no opinion: the common rules of qtk.recipe.schema decide)."""
        return None

    # ---- the arithmetic ----

    def storage_dtype(self, scheme: QuantScheme) -> "torch.dtype":
        """The dtype of QTensor.values: unpacked codes [out, in]."""
        raise NotImplementedError

    def has_zero_point(self, scheme: QuantScheme) -> bool:
        """Whether qparams carry a zero point (asymmetric int)."""
        raise NotImplementedError

    def scale_dtype(self, scheme: QuantScheme, model_dtype: "torch.dtype") -> "torch.dtype | None":
        """The dtype scales are stored (and rounded to before use) in; None: float32."""
        raise NotImplementedError

    def decodes_in_model_dtype(self, scheme: QuantScheme) -> bool:
        """Whether the engines (and compressed-tensors' decompressors) form the dequantized weight in the model dtype
        (True: int scales in the model dtype; NVFP4, MX, FP8 blocks decompressed to it) rather than in float32."""
        return True

    def qparams(self, w: "torch.Tensor", scheme: QuantScheme, model_dtype: "torch.dtype") -> QParams:
        """Quantization parameters of weight w [out, in] (model_dtype: the dtype the model stores, for scales)."""
        raise NotImplementedError

    def quantize(self, w: "torch.Tensor", qp: QParams, scheme: QuantScheme,
                 model_dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """Stored values of w [out, in] under qp, in storage_dtype; model_dtype: the dtype the model stores w in,
        for formats whose reference quantizer rounds its arithmetic to it (None: float32 arithmetic)."""
        raise NotImplementedError

    def dequantize(self, values: "torch.Tensor", qp: QParams, scheme: QuantScheme,
                   g_idx: "torch.Tensor | None" = None) -> "torch.Tensor":
        """float32 [out, in] from stored values; g_idx [in] maps each input column to its group (act-order)."""
        raise NotImplementedError

    def quantize_decoded(self, w: "torch.Tensor", qp: QParams, scheme: QuantScheme,
                         model_dtype: "torch.dtype") -> "tuple[torch.Tensor, torch.Tensor] | None":
        """(quantize(w.float(), qp, scheme, model_dtype), the engine's float32 decode of those values, i.e.
        qtk.model.simulate.engine_weight) from w [rows, in] given in the model dtype, computed in that dtype where
        that gives the same bits with fewer passes (the data-free stream's fast path); None where it does not."""
        return None

    def signed_scales(self, scheme: QuantScheme) -> bool:
        """Whether a stored scale of `scheme` may be negative: an int grid decodes (q - z) · s, the same map whatever
        the sign, and the full-range grid of qtk.steps.autoround maps a group's positive extreme onto the most
        negative code with a negative scale; the checks then hold the scale's magnitude positive."""
        return False

    def learned_grid(self, scheme: QuantScheme) -> str | None:
        """The grid AutoRound (qtk.steps.autoround) learns rounding offsets and clipping on for weights of `scheme`:
        "int" (a uniform grid with per-channel or per-group scales and zero points: scale_zero, quantize_grouped),
        "fp4" (e2m1 values with a scale per group taken from the group's max |w|: group_scales_from_amax), or None
        where it cannot (per-tensor or block scales, fp8 elements)."""
        return None

    def group_scales_from_amax(self, amax: "torch.Tensor", scheme: QuantScheme, model_dtype: "torch.dtype",
                               extra: "dict[str, torch.Tensor] | None" = None) -> "tuple[QParams, torch.Tensor]":
        """For an "fp4" learned grid: the QParams (stored group scales, and `extra`, the tensor-wide part) of groups
        whose max |w| is `amax` [out, G] (float32), as qparams computes them from a weight with those maxima, and
        the float32 multiplier [out, G] each group's e2m1 values decode with."""
        raise NotImplementedError

    def tensor_wide(self, scheme: QuantScheme) -> bool:
        """Whether qparams hold a tensor-wide part beyond the per-group scales (NVFP4's global scale), which GPTQ fixes
        before its column loop and fusion groups share."""
        return False

    def group_qparams(self, cols: "torch.Tensor", scheme: QuantScheme, model_dtype: "torch.dtype",
                      qp: QParams | None = None) -> QParams:
        """For GPTQ: the scale (and zero point) [out, 1] of one group of columns cols [out, group], taken when the
        group starts; qp holds the tensor-wide extras fixed up front (tensor_wide)."""
        from dataclasses import replace

        return self.qparams(cols, replace(scheme, strategy="channel", group_size=None), model_dtype)

    def shared_extra(self, weights: "list[torch.Tensor]", scheme: QuantScheme,
                     model_dtype: "torch.dtype") -> "dict[str, torch.Tensor] | None":
        """The tensor-wide part of qparams (tensor_wide: NVFP4's global scale) that `weights` share: one weight's, or
        the members' of a fusion group the engines run as one GEMM (q/k/v, gate/up). Taken from min/max passes over
        the weights as given (model-dtype tensors need no float32 copy); None for a format without one."""
        return None

    def row_qparams(self, w: "torch.Tensor", scheme: QuantScheme, model_dtype: "torch.dtype",
                    extra: "dict[str, torch.Tensor] | None" = None) -> QParams:
        """QParams of w [rows, in], some rows of a weight whose tensor-wide part is `extra` (shared_extra of the whole
        weight or its fusion group), for a format whose other qparams are per row; qparams(w) when extra is None."""
        return self.qparams(w, scheme, model_dtype)

    def column_quantizer(self, scheme: QuantScheme, qp: QParams | None = None,
                         model_dtype: "torch.dtype | None" = None) -> ColumnQuantizer:
        """For GPTQ: quantize one column with its scale (and zero point); qp holds tensor-wide extras if any;
        model_dtype as in quantize, so a column is rounded as quantize rounds the same values."""
        raise NotImplementedError

    def dequantize_columns(self, q: "torch.Tensor", scale: "torch.Tensor", zero: "torch.Tensor | None",
                           qp: QParams | None = None) -> "torch.Tensor":
        """For GPTQ: float32 values of a block of quantized columns q [count, out] with per-column scale / zero
        [count | 1, out] (qp: as given to column_quantizer), elementwise as column_quantizer dequantizes each."""
        raise NotImplementedError

    def fake_quant_activation(self, x: "torch.Tensor", scheme: QuantScheme,
                              scale: "torch.Tensor | None" = None) -> "torch.Tensor":
        """Quantize-dequantize activations as the engine does at run time (dynamic, or static with `scale`)."""
        raise NotImplementedError

    def static_scale(self, amax: "float | torch.Tensor", scheme: QuantScheme) -> "torch.Tensor":
        """Static per-tensor activation scale [1] from a calibrated absolute maximum."""
        raise NotImplementedError

    def static_amax(self, scale: float, scheme: QuantScheme) -> float:
        """The activation range a stored static input scale implies (the inverse of static_scale)."""
        raise NotImplementedError

    # ---- the compressed-tensors layout (the vllm target) ----

    def ct_format(self, module) -> str:
        """The compressed-tensors format of a module whose ModuleScheme (weights, activations) is `module`."""
        return self.ct_formats[0]

    def scale_shape(self, scheme: QuantScheme, out_f: int, in_f: int) -> list[int]:
        """The shape of a weight's scale (and zero point) [out, in] under `scheme`."""
        raise NotImplementedError

    def stored(self, module, shape: tuple[int, int], dtype: str) -> list[Stored]:
        """The tensors a quantized Linear of `shape` [out, in] and ModuleScheme `module` is written as, a model in
        `dtype` (a dtype name, "bfloat16"): what the planner counts, without torch. Static input scales are added by
        the caller (the activations' format names them)."""
        raise NotImplementedError

    def encode(self, qt: "qtk.quant.qtensor.QTensor", dtype: "torch.dtype", fmt: str) -> "dict[str, torch.Tensor]":
        """The tensors qt is written as in compressed-tensors format `fmt`, keyed after the Linear's name."""
        raise NotImplementedError

    def decode(self, tensors: "Mapping[str, torch.Tensor]", scheme: QuantScheme, dtype: "torch.dtype") -> "qtk.quant.qtensor.QTensor":
        """The QTensor of one module from its stored tensors (a reader's lazy mapping of the keys encode writes)."""
        raise NotImplementedError

    def check_stored(self, view: StoredView, module: str, scheme, fmt: str, shape: tuple[int, int]) -> list[str]:
        """Problems of one module's stored tensors against its ModuleScheme `scheme` and config format `fmt`."""
        raise NotImplementedError

    # ---- the data-free stream ----

    def native_plan(self, w: "torch.Tensor", scheme: QuantScheme, model_dtype: "torch.dtype",
                    extra=None) -> "qtk.quant.native.rounding.NativePlan | None":
        """How qtk's native kernel rounds w [rows, cols] (qtk.quant.native.rounding), or None where it does not (the
        torch path then gives the same codes and scales)."""
        return None

    def row_slab(self, scheme: QuantScheme) -> int | None:
        """Rows that round together, independently of every other row (1: each row on its own; a tile's height), when
        the scheme's qparams and codes are a function of those rows alone (the tensor-wide part fixed first); None
        when they are not (a per-tensor scale, the MSE observer)."""
        return None

    def stream_key(self, scheme: QuantScheme) -> str:
        """The name the data-free stream's measured CPU rate is kept under (benchmarks/convert_io.py,
        qtk.plan.convert_cost; a format without a measurement is planned at the slowest measured rate)."""
        return self.name

    # ---- the checks of a written checkpoint ----

    def error_bound(self, scheme: QuantScheme) -> float:
        """The relative error ||W - Q(W)|| / ||W|| a sane quantizer of this scheme stays far below; a broken one (wrong
        scale, collapsed packing, swapped layout) lands at or above it."""
        return float("inf")

    def value_problems(self, module: str, values: "torch.Tensor", scheme: QuantScheme) -> tuple[bool, list[str]]:
        """(collapsed: every stored value equal, the values off the format's grid) of a weight's flattened values."""
        return values.numel() > 1 and all_equal(values), []

    def scale_problems(self, module: str, qt: "qtk.quant.qtensor.QTensor") -> list[str]:
        """Scales a checkpoint stores that this format cannot hold (reported under scale_checks)."""
        return []

    def fused_weights(self, qts: "list[qtk.quant.qtensor.QTensor]") -> "list[torch.Tensor] | None":
        """float32 weights of the members of a fusion group (q/k/v, gate/up) as the engines run them in one GEMM, when
        that differs from each member's own decode (per-tensor scales requantized to one); None when it does not."""
        return None

    def shared_value(self, qt: "qtk.quant.qtensor.QTensor") -> float | None:
        """The tensor-wide value fusion-group members must share on disk (NVFP4's global scale), when valid."""
        return None


_REGISTRY = Registry("number format")
FORMATS = _REGISTRY.values()  # the registered formats, in registration order (a live view)
_by_scheme: dict[QuantScheme, Format] = {}


def register_format(cls: type[Format]) -> type[Format]:
    """Class decorator: add a spec to the registry (schemes are matched against specs in registration order)."""
    _REGISTRY.add(cls.name, cls())
    _by_scheme.clear()
    return cls


def unregister_format(name: str) -> None:
    """Remove a spec (for tests that register a format of their own)."""
    _REGISTRY.remove(name)
    _by_scheme.clear()


def format_for(scheme: QuantScheme) -> Format:
    """The spec that quantizes `scheme`; a scheme no spec accepts is an internal error (recipes are validated first)."""
    f = _by_scheme.get(scheme)
    if f is None:
        f = next((f for f in FORMATS if f.accepts(scheme)), None)
        if f is None:
            raise ValueError(f"no number format quantizes {scheme.describe()} "
                             f"(registered: {', '.join(f.name for f in FORMATS) or 'none'})")
        _by_scheme[scheme] = f
    return f


def format_claiming(scheme: QuantScheme) -> Format | None:
    """The format whose family `scheme` is (Format.claims), valid or not; None when no format knows it."""
    return next((f for f in FORMATS if f.claims(scheme)), None)


def groups_misfit(module: str, fmt: str, in_f: int, group: int) -> list[str]:
    """A module whose input width its format's groups do not divide, as a check_stored problem (else none)."""
    return [f"{module}: in_features {in_f} is not a multiple of the {fmt} group of {group}"] if in_f % group else []


def input_scale_key(module) -> str:
    """The tensor holding the static input scale of a module whose ModuleScheme is `module` (its activations'
    format names it: NVFP4's global input scale, else input_scale)."""
    a = module.activations
    return "input_scale" if a is None else format_for(a).input_scale_key


def check_input_scale(view: StoredView, module: str, scheme, problems: list[str]) -> None:
    """A module's static input scale is stored when its ModuleScheme's activations have one, and only then."""
    key = f"{module}.{input_scale_key(scheme)}"
    if scheme.static_activations:
        view.expect(key, float_dtypes(), SCALAR, problems, " (the config declares static activations)")
    elif view.has(key):
        problems.append(f"{key} is present but the config declares "
                        f"{'dynamic' if scheme.activations else 'no'} activation quantization")
