"""awq target: the legacy AWQ GEMM checkpoint (FORMATS.md §5) that vLLM (awq, awq_marlin), GPTQModel and
transformers load, and its reader.

Per quantized Linear X: X.qweight int32 [in, out/8] and X.qzeros int32 [in/group, out/8], both packed along
the output dim in AWQ's order [0,2,4,6,1,3,5,7] and stored unsigned (zeros raw, no −1); X.scales fp16
[in/group, out]; biases stay X.bias. The format is int4 group-wise with zero points only: every AWQ kernel
subtracts the stored zero, so a symmetric recipe is written with zero point 8 (unsigned), i.e. (q_u − 8)·s.
AWQ's activation-aware scales are already folded into the norms and Linears qtk writes, so nothing else is
AWQ-specific here; any int4 group-wise recipe (RTN, GPTQ without act-order) fits the layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.gptq import (
    LegacyCheckpoint,
    LegacyWriter,
    check_divisible,
    common_notes,
    refuse_common,
    trivial_g_idx,
)
from qtk.quant.pack import offset, pack_awq, unpack_awq
from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme

BITS = 4


@register_writer
class AWQWriter(LegacyWriter):
    target = "awq"
    description = "legacy AWQ GEMM checkpoint (qweight/qzeros/scales)"
    loads_in = "vLLM (awq, awq_marlin), GPTQModel, transformers (with gptqmodel)"

    @classmethod
    def check(cls, source, recipe, options):
        refuse_common(cls.target, recipe, options)
        w = recipe.weights
        if w.num_bits != BITS or w.strategy != "group":
            raise UsageError(f"the awq target is int4 group-wise only, not {w.describe()}",
                             "use weights {num_bits: 4, strategy: group, group_size: 128}, or --target gptq / vllm")
        if recipe.writes_g_idx:
            raise UsageError("the awq layout has no g_idx, so it cannot hold GPTQ actorder group",
                             "set gptq actorder: static (no g_idx), or use --target gptq")
        notes = common_notes(cls.target, source, recipe)
        if w.symmetric:
            notes.append("AWQ kernels always subtract a zero point: the symmetric scheme is written with zero point 8 "
                         "(unsigned), which dequantizes identically")
        return notes

    def encode(self, mod: str, qt: QTensor) -> dict[str, torch.Tensor]:
        s = qt.scheme
        out_f, in_f = qt.shape
        check_divisible(mod, out_f, 32 // BITS, "out_features", self.target)
        if qt.g_idx is not None and not torch.equal(qt.g_idx.to(torch.int32), trivial_g_idx(in_f, s.group_size)):
            raise UsageError(f"{mod}: act-order groups (g_idx) cannot be stored in the awq layout",
                             "use --target gptq or vllm for act-order GPTQ")
        q_u = qt.values.to(torch.int64) + offset(BITS)  # [out, in], 0..15
        z_u = (torch.full(qt.scale.shape, offset(BITS), dtype=torch.int64) if qt.zero_point is None
               else qt.zero_point.to(torch.int64) + offset(BITS))  # [out, groups]
        return {
            "qweight": pack_awq(q_u.t(), BITS),  # [in, out/8]
            "qzeros": pack_awq(z_u.t(), BITS),  # [groups, out/8]
            "scales": self.fp16(qt.scale, mod).t().contiguous(),  # [groups, out]
        }

    def quantization_config(self) -> dict:
        w = self.recipe.weights
        return {
            "quant_method": "awq",
            "bits": BITS,
            "group_size": w.group_size,
            "zero_point": True,
            "version": "gemm",
            # vLLM and transformers skip a module whose name contains one of these
            "modules_to_not_convert": [self.source.arch.lm_head] + sorted(set(self.ignored)),
        }

    def finish(self, manifest: dict) -> None:
        self.shards.close()
        if (n := self.fp16.note(self.source.dtype)) is not None:
            self.notes.append(n)
        cfg = dict(self.source.config_dict)
        cfg["quantization_config"] = self.quantization_config()
        (self.dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        self.copy_side_files()
        self.write_manifest(manifest)


@register_reader
class AWQCheckpoint(LegacyCheckpoint):
    """Returns QTensors in qtk's signed convention (q = q_u − 8, z = z_u − 8), scales exactly the fp16 on
    disk (as float32). The format always carries zero points, so the scheme reads as asymmetric; a
    symmetric recipe comes back with zero points of 0, which dequantize identically."""

    format = "awq"
    METHOD = "awq"
    SUFFIXES = (".qweight", ".qzeros", ".scales")

    def __init__(self, path: Path):
        super().__init__(path)
        version = str(self.qconfig.get("version") or self.qconfig.get("format") or "gemm").lower()
        bits = int(self.qconfig.get("bits") or self.qconfig.get("w_bit") or 0)
        gs = int(self.qconfig.get("group_size") or self.qconfig.get("q_group_size") or -1)
        if version != "gemm" or bits != BITS or gs <= 0:
            raise UsageError(f"{path}: AWQ version '{version}', {bits} bits, group_size {gs} is not a layout qtk reads",
                             "qtk reads AWQ GEMM checkpoints: 4-bit, group-wise")
        zero_point = bool(self.qconfig.get("zero_point", True))
        self.weights_scheme = QuantScheme(num_bits=BITS, type="int", symmetric=not zero_point, strategy="group", group_size=gs)

    def ignore_patterns(self) -> list[str]:
        # substring match, as vLLM and transformers apply modules_to_not_convert
        return [f"re:.*{re.escape(m)}.*" for m in self.qconfig.get("modules_to_not_convert") or []]

    def qtensor(self, module: str) -> QTensor:
        s = self.weights_scheme
        values = (unpack_awq(self.tensor(f"{module}.qweight"), BITS) - offset(BITS)).t().contiguous().to(torch.int8)  # [out, in]
        out_f, in_f = values.shape
        scale = self.tensor(f"{module}.scales").float().t().contiguous()  # [groups, out] -> [out, groups]
        if scale.shape != (out_f, in_f // s.group_size) or in_f % s.group_size:
            raise UsageError(f"{self.path}: {module} scales {list(scale.shape)} do not fit a [{out_f}, {in_f}] weight "
                             f"with group_size {s.group_size}", "the checkpoint does not match its config")
        zero = None
        if self.has(f"{module}.qzeros"):  # the kernels subtract it whatever zero_point says
            zero = (unpack_awq(self.tensor(f"{module}.qzeros"), BITS) - offset(BITS)).t().contiguous().float()  # [out, groups]
            if s.symmetric and not zero.any():
                zero = None
        return QTensor(values, scale, s, zero, None, torch.float16)  # the kernels dequantize in the scales' fp16
