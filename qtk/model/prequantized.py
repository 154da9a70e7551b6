"""Sources stored otherwise than the model qtk reads: already quantized, or with fused experts; each read as the
16-bit model it stands for, one tensor at a time, so the whole model never exists in 16 bits.

A tensor the model reads that the checkpoint stores otherwise is a `Derived`: the stored tensors it comes from and how
(`make`). `ModelSource` lists derived names in its weight map, hides the stored tensors they come from, and computes
each one when the layer loop or the stream reads it. Three kinds:

- FP8 e4m3 weights in blocks (Hugging Face `quantization_config: {quant_method: fp8, weight_block_size: [bn, bk]}`, as
  DeepSeek-V3/R1, Kimi-K2 and the Qwen3 "FP8" releases ship). Each quantized Linear stores `X.weight`
  (float8_e4m3fn, [out, in]) and `X.weight_scale_inv` (float32, [ceil(out/bn), ceil(in/bk)]): despite its name the
  scale multiplies, w = q * s blockwise, the last block row and column partial where 128 does not divide (vLLM's loader
  and DeepSeek's own weight_dequant read it so). The arithmetic is transformers' `Fp8Dequantize` (float32 product, one
  rounding to the model dtype), with partial edge blocks, which its grid-derived block size does not cover.
- Experts stored fused (gpt-oss: `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved on the last axis,
  `down_proj` [E, I, H], their `_bias`es; the family's `FusedExperts`): each expert's gate/up/down Linear and bias is
  a slice of them, copied out when read.
- gpt-oss's MXFP4 experts (`quantization_config: {quant_method: mxfp4}`, as OpenAI ships gpt-oss): `X_blocks` uint8
  [E, out, in/32, 16], two e2m1 codes per byte, the even element in the low nibble, and `X_scales` uint8 [E, out,
  in/32], E8M0 exponents biased by 127 (transformers' integrations/mxfp4.py reads them so: lut[nibble] * 2^(s - 127)).
  Each expert's rows are decoded when read (float32 product, one rounding to the model dtype).
- compressed-tensors checkpoints (`quantization_config: {quant_method: compressed-tensors}`, as qtk's vllm target and
  llm-compressor write them: pack-quantized int4/int8, int-quantized, float-quantized FP8, nvfp4-pack-quantized,
  mxfp4-pack-quantized): each quantized Linear decoded through its config group's number format, the decode qtk's
  reader uses (qtk.quant.formats via qtk.export.codecs.ct), rounded once to the model dtype.

Everything is checked from the headers before any work: a quantized weight with no scale, a scale with no weight,
a scale grid that is not the blocks' (a damaged or mislabelled source), a weight in another dtype than its format's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from qtk.errors import UsageError
from qtk.quant.lazy import torch

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
INPUT_SCALE = ".input_scale"  # activation_scheme static: each quantized Linear's input scale, not needed to dequantize
SCALE_DTYPES = ("float32", "bfloat16")
FIX_DAMAGED = "the FP8 checkpoint is damaged or incomplete: re-download it"
MX_FIX_DAMAGED = "the MXFP4 checkpoint is damaged or incomplete: re-download it"
MX_GROUP = 32  # elements per E8M0 scale (16 bytes of two e2m1 codes)


@dataclass(frozen=True)
class Derived:
    """A tensor the model reads, computed from stored ones: `make(model_dtype, *inputs read)`."""

    inputs: tuple[str, ...]
    shape: tuple[int, ...]
    make: Callable
    stored_dtype: bool = False  # True: it comes out in its first input's stored dtype (a slice), else the model's
    # it reads a part of its inputs (one expert's rows): they are mapped, so only those bytes are touched; False:
    # the whole inputs, read as the caller asks
    partial: bool = True


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def source_quantization(config: dict, name: str, path=None) -> "FP8Blocks | MXFP4Experts | CompressedTensors | None":
    """The quantization of a source from its config.json: None for a 16-bit model, FP8Blocks for an FP8-block source,
    MXFP4Experts for gpt-oss's MXFP4 experts, CompressedTensors for a compressed-tensors checkpoint; any other
    quantized source is refused (one line, before any work)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    if method == "mxfp4":
        return MXFP4Experts.of(qc, config, name)
    if method == CompressedTensors.method:
        return CompressedTensors.of(qc, config, name, path)
    if method != "fp8":
        why = ("qtk dequantizes only compressed-tensors sources, FP8-block sources (quant_method fp8 with "
               "weight_block_size) and gpt-oss's MXFP4 experts (quant_method mxfp4)")
        raise UsageError(f"{name} is already quantized (config.json has a {str(method)[:40]} quantization_config): {why}",
                         "give the original unquantized (bf16/fp16) model")
    return FP8Blocks.of(qc, name)


class FP8Blocks:
    """An FP8-block source: which weights are quantized (`scales`: weight name -> its scale's name) and their blocks."""

    method = "fp8"

    def __init__(self, block: tuple[int, int], qc: dict):
        self.block = block
        self.qc = qc
        self.scales: dict[str, str] = {}
        self.hidden: dict[str, object] = {}  # scale (and static input-scale) tensors: name -> file
        self.derived: dict[str, Derived] = {}  # each FP8 weight, dequantized

    @classmethod
    def of(cls, qc: dict, name: str) -> "FP8Blocks":
        b = qc.get("weight_block_size")
        if b is None:
            raise UsageError(f"{name} is FP8 without weight_block_size (one scale per tensor), which qtk does not "
                             "dequantize", "give the original unquantized (bf16/fp16) model, or an FP8-block release")
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= 65536
                                                             for x in b)):
            raise UsageError(f"{name}'s quantization_config.weight_block_size is {str(b)[:60]}, not two positive whole "
                             "numbers", "restore the model's original config.json")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UsageError(f"{name}'s FP8 weights are {str(fmt)[:20]}, not e4m3 (float8_e4m3fn)",
                             "give the original unquantized (bf16/fp16) model")
        return cls((b[0], b[1]), qc)

    # ---- the headers ----

    def index(self, weight_map: dict, shape, dtype, where: str) -> dict:
        """weight_map without the scale tensors (kept in `hidden`), every quantized weight checked against its scale
        from the headers: `shape(name)`, `dtype(name)`."""
        out = {}
        for n, f in weight_map.items():
            if n.endswith(".weight" + SCALE_SUFFIX):
                self.hidden[n] = f
                self.scales[n[: -len(SCALE_SUFFIX)]] = n
            elif n.endswith(INPUT_SCALE) and f"{n[: -len(INPUT_SCALE)]}.weight{SCALE_SUFFIX}" in weight_map:
                self.hidden[n] = f
            else:
                out[n] = f
        bn, bk = self.block
        for w, s in self.scales.items():
            if w not in out:
                raise UsageError(f"{where} holds the scale {s} but no weight {w}", FIX_DAMAGED)
            wdt, sdt = dtype(w), dtype(s)
            if wdt != torch.float8_e4m3fn:
                raise UsageError(f"tensor {w} has an FP8 block scale but is stored as {str(wdt).replace('torch.', '')}, "
                                 "not float8_e4m3fn", FIX_DAMAGED)
            if str(sdt).replace("torch.", "") not in SCALE_DTYPES:
                raise UsageError(f"the scale {s} is stored as {str(sdt).replace('torch.', '')}, not float32", FIX_DAMAGED)
            ws, ss = list(shape(w)), list(shape(s))
            if len(ws) != 2:
                raise UsageError(f"tensor {w} is an FP8 weight of shape {ws}, not a Linear's [out, in]", FIX_DAMAGED)
            grid = [_ceil(ws[0], bn), _ceil(ws[1], bk)]
            if ss != grid:
                raise UsageError(f"the scale {s} has shape {ss}, but {bn}x{bk} blocks of the weight {ws} make {grid} "
                                 "(weight_block_size disagrees with the checkpoint)",
                                 "restore the model's original config.json, or re-download the checkpoint")
        for n in out:
            if n not in self.scales and dtype(n) == torch.float8_e4m3fn:
                raise UsageError(f"tensor {n} is FP8 but the checkpoint has no {n}{SCALE_SUFFIX} for it", FIX_DAMAGED)
        for w, s in self.scales.items():
            self.derived[w] = Derived((w, s), tuple(shape(w)), self.dequantize_into, partial=False)
        return out

    def dequantize_into(self, dtype, q, s):
        return self.dequantize(q, s, dtype)

    # ---- the values ----

    def dequantize(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q [out, in] e4m3 times its block scales s, rounded once to `dtype`; partial edge blocks take their block's
        scale."""
        from qtk.quant.e4m3 import to_float32

        bn, bk = self.block
        rows, cols = q.shape
        s = s.to(torch.float32)
        full, rem = divmod(cols, bk)
        out = torch.empty((rows, cols), dtype=dtype)
        # one block row at a time: the float32 product is a slab of bn rows, not a second weight-sized tensor
        for i, r0 in enumerate(range(0, rows, bn)):
            w = to_float32(q[r0:r0 + bn])
            if full:
                w[:, : full * bk].unflatten(1, (full, bk)).mul_(s[i, :full, None])
            if rem:
                w[:, full * bk:].mul_(s[i, full:])
            out[r0:r0 + bn] = w
        return out

    # ---- what it means for a recipe ----

    def same_format(self, scheme) -> bool:
        """True when `scheme` (a weight QuantScheme) is this source's own format: FP8 e4m3 in the same blocks."""
        return (scheme is not None and getattr(scheme, "type", None) == "float" and getattr(scheme, "num_bits", None) == 8
                and getattr(scheme, "strategy", None) == "block"
                and tuple(getattr(scheme, "block_structure", None) or ()) == self.block)

    def same_format_problem(self, recipe_name: str) -> str:
        bn, bk = self.block
        return (f"is already FP8 in {bn}x{bk} blocks, the format recipe {recipe_name} writes: converting it would only "
                "round its weights again")

    def record(self) -> dict:
        """What the manifest says of the source's quantization."""
        return {"quant_method": self.method, "weight_block_size": list(self.block), "quantized_weights": len(self.scales),
                "read_as": "each weight dequantized to the model dtype as it is read (float32 product, one rounding)"}


class MXFP4Experts:
    """gpt-oss's MXFP4 experts (quant_method mxfp4): which fused expert tensors are stored as blocks and scales
    (`packed`: fused name, e.g. model.layers.0.mlp.experts.gate_up_proj -> (its _blocks, its _scales)). Each expert's
    rows are decoded when read (`expert`); what is not an expert tensor is stored in 16 bits."""

    method = "mxfp4"

    def __init__(self, qc: dict):
        self.qc = qc
        self.packed: dict[str, tuple[str, str]] = {}
        self.hidden: dict[str, object] = {}  # blocks and scales: name -> file
        self.derived: dict[str, Derived] = {}  # none of its own: split_fused_experts, which knows the family's
        # experts, asks `expert` for each one's weights

    @classmethod
    def of(cls, qc: dict, config: dict, name: str) -> "MXFP4Experts":
        from qtk.model.arch import ARCHS

        arch = ARCHS.get(config.get("model_type"))
        if arch is None or arch.moe is None or not arch.moe.fused.stored_fused:
            raise UsageError(f"{name} has an mxfp4 quantization_config, which qtk reads only for gpt-oss's fused MXFP4 "
                             f"experts, not for a {str(config.get('model_type'))[:40]} model",
                             "give the original unquantized (bf16/fp16) model")
        return cls(qc)

    def index(self, weight_map: dict, shape, dtype, where: str) -> dict:
        """weight_map without the blocks and scales (kept in `hidden`), each pair checked against the other from the
        headers: uint8 blocks [E, out, in/32, 16], uint8 scales [E, out, in/32]."""
        out = {}
        for n, f in weight_map.items():
            if n.endswith(("_blocks", "_scales")):
                self.hidden[n] = f
            else:
                out[n] = f
        for n in self.hidden:
            base, _, kind = n.rpartition("_")
            other = f"{base}_{'scales' if kind == 'blocks' else 'blocks'}"
            if other not in self.hidden:
                raise UsageError(f"{where} holds {n} but not {other}", MX_FIX_DAMAGED)
            if kind != "blocks":
                continue
            bs, ss = list(shape(n)), list(shape(other))
            for t, want in ((n, torch.uint8), (other, torch.uint8)):
                if dtype(t) != want:
                    raise UsageError(f"tensor {t} is stored as {str(dtype(t)).replace('torch.', '')}, not uint8",
                                     MX_FIX_DAMAGED)
            if len(bs) != 4 or bs[3] != MX_GROUP // 2 or ss != bs[:3]:
                raise UsageError(f"{n} has shape {bs} and {other} {ss}: MXFP4 experts are blocks [E, out, in/32, 16] "
                                 "with scales [E, out, in/32]", MX_FIX_DAMAGED)
            self.packed[base] = (n, other)
        return out

    def expert(self, fused: str, e: int, rows: slice) -> Derived:
        """Expert e's rows `rows` of the fused MXFP4 tensor `fused` as a [rows, in] weight in the model dtype."""
        blocks, scales = self.packed[fused]
        return Derived((blocks, scales), (), lambda dtype, b, s: self.decode(b[e, rows], s[e, rows], dtype))

    @staticmethod
    def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 blocks [rows, G, 16] and E8M0 scales [rows, G] -> [rows, G * 32] in `dtype`: e2m1(code) * 2^(s - 127)
        in float32, one rounding."""
        from qtk.quant.formats.mx import mxfp4_dequantize
        from qtk.quant.fp4 import unpack_fp4

        rows, groups = scales.shape
        codes = unpack_fp4(blocks.reshape(rows, groups * (MX_GROUP // 2)).contiguous())
        return mxfp4_dequantize(codes, scales.contiguous(), dtype)

    def same_format(self, scheme) -> bool:
        """True when `scheme` is MXFP4 (e2m1 elements, E8M0 scales per 32): the experts' own format."""
        return (scheme is not None and getattr(scheme, "type", None) == "float" and getattr(scheme, "num_bits", None) == 4
                and getattr(scheme, "group_size", None) == MX_GROUP and getattr(scheme, "scale_dtype", None) == "e8m0")

    def same_format_problem(self, recipe_name: str) -> str:
        return (f"already holds its experts in MXFP4, the format recipe {recipe_name} writes: converting them would only "
                "round them again")

    def record(self) -> dict:
        return {"quant_method": self.method, "quantized_weights": len(self.packed),
                "read_as": "each expert's MXFP4 rows decoded to the model dtype as they are read (float32 product, one "
                           "rounding)"}


CT_FIX_DAMAGED = "the compressed-tensors checkpoint does not match its config: re-download it, or convert it again"
CT_FIX_CONFIG = "give the original unquantized (bf16/fp16) model"
# the tensors compressed-tensors stores beside (or instead of) a quantized Linear's weight; the weight ones are what its
# number format decodes, the input ones only what the engine does to activations (not part of the 16-bit model)
CT_WEIGHT_KEYS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                  "weight_global_scale")
CT_INPUT_KEYS = ("input_scale", "input_zero_point", "input_global_scale")
CT_KV_SUFFIXES = (".k_scale", ".v_scale")  # the KV cache's scales: the 16-bit model keeps its cache in 16 bits


class CompressedTensors:
    """A compressed-tensors source (quant_method compressed-tensors, as qtk's vllm target and llm-compressor write
    it): each quantized Linear decoded as qtk's own reader decodes it (qtk.export.vllm.CompressedTensorsCheckpoint:
    the config groups resolved by exact name, regex, then class "Linear"; each group's number format's `decode`,
    qtk.export.codecs.ct), then rounded once to the model dtype (qtk.model.simulate.engine_weight's weight, the one the
    engine computes with). Everything is checked from the headers before any work: each module's tensors against its
    group's format (`Format.check_stored`), quantized tensors no group targets or that the ignore list names, Linears a
    group targets stored in 16 bits."""

    method = "compressed-tensors"

    def __init__(self, qc: dict, arch, path):
        self.qc = qc
        self.arch = arch
        self.path = path
        self.reader = None  # the checkpoint reader, opened by `index` (it reads the directory itself)
        self.modules: dict[str, object] = {}  # quantized module -> its ModuleScheme
        self.hidden: dict[str, object] = {}
        self.derived: dict[str, Derived] = {}

    @classmethod
    def of(cls, qc: dict, config: dict, name: str, path) -> "CompressedTensors":
        """The config checked for what the reader cannot follow, before the weights are opened."""
        from qtk.model.arch import ARCHS
        from qtk.quant.formats import FORMATS

        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise UsageError(f"{name}'s compressed-tensors quantization_status is {str(status)[:30]}, not compressed "
                             "(its weights are not stored as the codes and scales of its format)", CT_FIX_CONFIG)
        for key, what in (("sparsity_config", "sparse weights"), ("transform_config", "online transforms")):
            v = qc.get(key)
            if v and not (key == "sparsity_config" and isinstance(v, dict) and v.get("format") == "dense"):
                raise UsageError(f"{name}'s compressed-tensors config has a {key} ({what}), which qtk does not read "
                                 "as a source: it dequantizes only quantized weights", CT_FIX_CONFIG)
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
            raise UsageError(f"{name}'s compressed-tensors config has no config_groups to read its weights by",
                             "restore the model's original config.json")
        known = sorted({f for fmt in FORMATS for f in fmt.ct_formats})
        top = qc.get("format")
        for gname, g in groups.items():
            fmt = g.get("format") or top
            if fmt not in known:
                raise UsageError(f"{name}'s compressed-tensors config group {str(gname)[:40]} is in format "
                                 f"{str(fmt)[:40]}, which qtk does not decode (it reads {', '.join(known)})", CT_FIX_CONFIG)
            if not isinstance(g.get("weights"), dict):
                raise UsageError(f"{name}'s compressed-tensors config group {str(gname)[:40]} quantizes no weights "
                                 "(activations only), which qtk does not read as a source", CT_FIX_CONFIG)
            if g.get("output_activations"):
                raise UsageError(f"{name}'s compressed-tensors config group {str(gname)[:40]} quantizes output "
                                 "activations, which qtk does not read as a source", CT_FIX_CONFIG)
        return cls(qc, ARCHS.get(config.get("model_type")), path)

    # ---- the headers ----

    def index(self, weight_map: dict, shape, dtype, where: str) -> dict:
        """weight_map with each quantized Linear's `.weight` (derived: decoded when read) in place of its stored
        tensors, which go to `hidden` with the input and KV scales."""
        from qtk.errors import QtkError
        from qtk.export.vllm import CompressedTensorsCheckpoint

        try:
            ck = self.reader = CompressedTensorsCheckpoint(self.path)
        except QtkError as e:  # a group's scheme no recipe could hold: refused as a source is (exit 2)
            raise UsageError(f"{where}: {e.problem}", CT_FIX_CONFIG) from None
        problems = [f"{where}: {p}" for p in ck.format_problems() if "kv_cache_scheme" not in p]
        if problems:
            raise UsageError(problems[0], CT_FIX_DAMAGED)
        quantized = sorted({n.rsplit(".", 1)[0] for n in weight_map
                            if n.endswith((".weight_scale", ".weight_packed"))})
        out = dict(weight_map)
        for m in quantized:
            group = ck._group_of(m)  # (ModuleScheme, format) by compressed-tensors' precedence, None when untargeted
            scheme = group[0] if group is not None else None
            if scheme is None:
                raise UsageError(f"{m} holds quantized tensors but no config group of {where} targets it",
                                 CT_FIX_DAMAGED)
            if self._ignored(m):
                raise UsageError(f"{m} holds quantized tensors but {where}'s config ignores it", CT_FIX_DAMAGED)
            keys = [k for k in CT_WEIGHT_KEYS if f"{m}.{k}" in weight_map]
            wshape = self._shape(m, keys, scheme, shape, dtype)
            bad = ck.check_module(m, tuple(wshape))
            if bad:
                raise UsageError(f"{where}: {bad[0]}", CT_FIX_DAMAGED)
            for k in (*keys, *CT_INPUT_KEYS):
                n = f"{m}.{k}"
                if n in weight_map and k != "weight":
                    self.hidden[n] = out.pop(n)
            w = f"{m}.weight"
            out.setdefault(w, self.hidden.get(f"{m}.weight_packed") or weight_map[f"{m}.weight_scale"])
            self.derived[w] = Derived(tuple(f"{m}.{k}" for k in keys), tuple(wshape), self._make(keys, scheme),
                                      partial=False)
            self.modules[m] = scheme
        for n in list(out):
            if n.endswith(CT_KV_SUFFIXES):
                self.hidden[n] = out.pop(n)
        self._check_unquantized(out, shape)
        return out

    def _shape(self, m: str, keys, scheme, shape, dtype) -> list[int]:
        """The [out, in] of module m's weight: its weight_shape where stored (read: two numbers), the unpacked
        weight's, else its packed codes' widened by the codes per stored element."""
        if "weight_shape" in keys:
            s = self.reader.tensor(f"{m}.weight_shape")
            return [int(x) for x in s.reshape(-1).tolist()]
        if "weight" in keys:
            return list(shape(f"{m}.weight"))
        if "weight_packed" in keys:
            p = list(shape(f"{m}.weight_packed"))
            dt = dtype(f"{m}.weight_packed")
            bits = torch.iinfo(dt).bits if not dt.is_floating_point else 8
            return [p[0], p[-1] * max(1, bits // scheme.weights.num_bits)] if len(p) == 2 else p
        return []

    def _ignored(self, m: str) -> bool:
        """compressed-tensors' ignore: an exact name or a 're:' pattern (matched as its reader matches, re.match)."""
        from qtk.bounds import match as bounded_match

        return any(p == m or (isinstance(p, str) and p.startswith("re:") and bounded_match(p[3:], m))
                   for p in self.reader.ignore_patterns())

    def _check_unquantized(self, out: dict, shape) -> None:
        """A decoder-layer Linear of the family's table (or one a group names) that a config group targets and the
        ignore list leaves, stored in 16 bits: the checkpoint is not what its config says."""
        import re

        if self.arch is None:
            return
        at = re.compile(rf"{re.escape(self.arch.layers)}\.(\d+)\.(.+)\.weight$")
        for n in out:
            k = at.match(n)
            if k is None or n in self.derived:
                continue
            m, rel = n[: -len(".weight")], k.group(2)
            if rel not in self.arch.at(int(k.group(1))).linears or self._ignored(m):
                continue
            if len(shape(n)) == 2 and self.reader._group_of(m) is not None:
                raise UsageError(f"{m} is stored unquantized but a config group of the compressed-tensors config "
                                 "targets it and the ignore list does not name it", CT_FIX_DAMAGED)

    # ---- the values ----

    @staticmethod
    def _make(keys, scheme):
        def make(dtype, *tensors):
            from qtk.export.codecs import ct

            qt = ct.decode(dict(zip(keys, tensors)), scheme.weights, dtype)
            # qtk.model.simulate.engine_weight rounded to `dtype` (the QTensor's own): the float32 decode rounded once,
            # without engine_weight's float32 copy of a weight that decodes in the model dtype
            return qt.dequantize().to(dtype)
        return make

    # ---- what it means for a recipe ----

    @staticmethod
    def _key(s) -> tuple:
        return (s.num_bits, s.type, s.symmetric, str(s.strategy), s.group_size,
                tuple(s.block_structure or ()), s.scale_dtype)

    def same_format(self, scheme) -> bool:
        """True when `scheme` (a weight QuantScheme) is one of the source's weight formats."""
        return scheme is not None and any(self._key(scheme) == self._key(s.weights) for s in self.modules.values())

    def same_format_problem(self, recipe_name: str) -> str:
        kinds = sorted({s.weights.describe() for s in self.modules.values()})
        return (f"is already {' and '.join(kinds)} (compressed-tensors), a weight format recipe {recipe_name} writes: "
                "converting it would only round its weights again")

    def record(self) -> dict:
        return {"quant_method": self.method, "format": self.qc.get("format"), "quantized_weights": len(self.modules),
                "read_as": "each Linear decoded by its config group's number format and rounded once to the model dtype "
                           "as it is read"}


def split_fused_experts(arch, weight_map: dict, shape, quant) -> tuple[dict, dict, dict]:
    """For a family whose checkpoint stores its experts fused (arch.moe.fused.stored_fused: gpt-oss), the per-expert
    Linears and biases the model reads, each a Derived slice (or MXFP4 decode) of a stored fused tensor. Returns
    (weight_map with the per-expert names in place of the fused ones, each at its fused tensor's file; derived;
    hidden: the fused tensors by file). A checkpoint already per expert (qtk's own output) is left as it is."""
    m = arch.moe
    if m is None or not m.fused.stored_fused:
        return weight_map, {}, {}
    f = m.fused
    packed = quant.packed if isinstance(quant, MXFP4Experts) else {}
    out, derived, hidden = dict(weight_map), {}, {}
    tail = f".{m.block}.experts."
    fused_names = (f.gate_up, f.down, f"{f.gate_up}_bias", f"{f.down}_bias")
    blocks = sorted({n.split(tail)[0] + tail[:-1] for n in [*weight_map, *packed]
                     if n.startswith(f"{arch.layers}.") and tail in n and n.split(tail)[1] in fused_names})
    E = arch.num_experts

    def fused_shape(name: str) -> list[int]:
        s = list(shape(name))
        if len(s) != 3 or s[0] != E:
            raise UsageError(f"tensor {name} has shape {s}, not the [{E}, ., .] of {E} fused experts",
                             "the weights do not belong to this config.json")
        return s

    def slice_of(name, e, rows, transpose):
        def make(dtype, t):
            x = t[e].T if transpose else t[e]
            return (x[rows] if rows is not None else x).contiguous()
        return make

    for b in blocks:  # "model.layers.0.mlp.experts"
        gu, dn = f"{b}.{f.gate_up}", f"{b}.{f.down}"
        for fused, parts in ((gu, ((m.gate, 0), (m.up, 1))), (dn, ((m.down, None),))):
            if fused in packed:  # MXFP4 blocks: [E, out, in/32, 16], already out-major
                bshape = list(shape(packed[fused][0]))
                if bshape[0] != E:
                    raise UsageError(f"tensor {packed[fused][0]} has shape {bshape}, not the [{E}, ...] of {E} experts",
                                     "the weights do not belong to this config.json")
                out_rows, inn = bshape[1], bshape[2] * MX_GROUP
                for which, half in parts:
                    rows = f.gate_up_rows(half, out_rows // 2) if half is not None else slice(None)
                    n_rows = out_rows // 2 if half is not None else out_rows
                    for e in range(E):
                        d = quant.expert(fused, e, rows)
                        derived[f"{b}.{e}.{which}.weight"] = Derived(d.inputs, (n_rows, inn), d.make)
                        out[f"{b}.{e}.{which}.weight"] = quant.hidden[packed[fused][0]]
            elif fused in weight_map:
                s = fused_shape(fused)
                out_rows, inn = (s[2], s[1]) if f.transposed else (s[1], s[2])
                for which, half in parts:
                    rows = f.gate_up_rows(half, out_rows // 2) if half is not None else None
                    n_rows = out_rows // 2 if half is not None else out_rows
                    for e in range(E):
                        derived[f"{b}.{e}.{which}.weight"] = Derived((fused,), (n_rows, inn),
                                                                      slice_of(fused, e, rows, f.transposed), True)
                        out[f"{b}.{e}.{which}.weight"] = weight_map[fused]
                hidden[fused] = out.pop(fused)
            bias = f"{fused}_bias"
            if m.bias and bias in weight_map:
                bs = list(shape(bias))
                if len(bs) != 2 or bs[0] != E:
                    raise UsageError(f"tensor {bias} has shape {bs}, not the [{E}, .] of {E} experts' biases",
                                     "the weights do not belong to this config.json")
                for which, half in parts:
                    rows = f.gate_up_rows(half, bs[1] // 2) if half is not None else slice(None)
                    n = bs[1] // 2 if half is not None else bs[1]
                    for e in range(E):
                        derived[f"{b}.{e}.{which}.bias"] = Derived((bias,), (n,), slice_of(bias, e, rows, False), True)
                        out[f"{b}.{e}.{which}.bias"] = weight_map[bias]
                hidden[bias] = out.pop(bias)
    stray = sorted(set(packed) - {f"{b}.{n}" for b in blocks for n in (f.gate_up, f.down)})
    if stray:  # MXFP4 tensors no expert reads would be dropped unseen
        raise UsageError(f"{len(stray)} MXFP4 tensor(s) belong to no expert of the {arch.name} model config.json "
                         f"describes ({', '.join(stray[:3])})", "check that config.json belongs to these weights")
    return out, derived, hidden
