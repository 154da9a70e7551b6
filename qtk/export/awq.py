"""awq target: the legacy AWQ GEMM checkpoint (docs/formats.md, awq) that vLLM (awq, awq_marlin), GPTQModel and
transformers load, and its reader.

Per quantized Linear X: X.qweight, X.qzeros, X.scales (qtk.export.codecs.awq); biases stay X.bias. The format is
int4 group-wise with zero points only: every AWQ kernel subtracts the stored zero, so a symmetric recipe is written
with zero point 8 (unsigned), i.e. (q_u − 8)·s. One bit width and group size for the whole model: a mixed-precision
recipe is refused.
AWQ's activation-aware scales are already folded into the norms and Linears qtk writes, so nothing else is
AWQ-specific here; any int4 group-wise recipe (RTN, GPTQ without act-order) fits the layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.checkpoint import FLOATS, config_scheme, expect_tensor
from qtk.export.codecs import awq as codec
from qtk.export.codecs.gptq import acts_in_order
from qtk.export.gptq import LegacyCheckpoint, LegacyWriter, check_divisible, common_notes, refuse_common
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme, Strategy

BITS = codec.BITS


@register_writer
class AWQWriter(LegacyWriter):
    target = "awq"
    description = "legacy AWQ GEMM checkpoint (qweight/qzeros/scales)"
    loads_in = "vLLM (awq, awq_marlin), GPTQModel, transformers (with gptqmodel)"

    @classmethod
    def check(cls, source, recipe, options):
        refuse_common(cls.target, recipe, options)
        if recipe.mixed:  # no fix of our own: the targets that accept the recipe are named by qtk.export.check_targets
            raise UsageError(f"recipe {recipe.name}: the awq format holds one bit width and group size for the whole model "
                             "(its quant_config has no per-module overrides), but the recipe's overrides give modules "
                             f"{len(recipe.schemes)} schemes")
        w = recipe.weights
        if w.num_bits != BITS or w.strategy != Strategy.GROUP:
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
        check_divisible(mod, qt.shape[0], 32 // BITS, "out_features", self.target)
        if not acts_in_order(qt):
            raise UsageError(f"{mod}: act-order groups (g_idx) cannot be stored in the awq layout",
                             "use --target gptq or vllm for act-order GPTQ")
        return codec.encode(qt, lambda scale: self.fp16(scale, mod))

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
        self.write_config()
        self.copy_side_files()
        self.write_manifest(manifest)


@register_reader
class AWQCheckpoint(LegacyCheckpoint):
    """Returns QTensors in qtk's signed convention (q = q_u − 8, z = z_u − 8), scales exactly the fp16 on
    disk (as float32). The format always carries zero points, so the scheme reads as asymmetric; a
    symmetric recipe comes back with zero points of 0, which dequantize identically."""

    format = "awq"
    METHOD = "awq"
    SUFFIXES = codec.SUFFIXES

    def __init__(self, path: Path):
        super().__init__(path)
        version = str(self.qconfig.get("version") or self.qconfig.get("format") or "gemm").lower()
        bits = int(self.qconfig.get("bits") or self.qconfig.get("w_bit") or 0)
        gs = int(self.qconfig.get("group_size") or self.qconfig.get("q_group_size") or -1)
        if version != "gemm" or bits != BITS or gs <= 0:
            raise UsageError(f"{path}: AWQ version '{version}', {bits} bits, group_size {gs} is not a layout qtk reads",
                             "qtk reads AWQ GEMM checkpoints: 4-bit, group-wise")
        zero_point = bool(self.qconfig.get("zero_point", True))
        self.weights_scheme = config_scheme(QuantScheme(num_bits=BITS, type="int", symmetric=not zero_point, strategy="group",
                                                        group_size=gs), where=f"{path}: AWQ quantization config").weights

    def ignore_patterns(self) -> list[str]:
        # substring match, as vLLM and transformers apply modules_to_not_convert
        return [f"re:.*{re.escape(m)}.*" for m in self.qconfig.get("modules_to_not_convert") or []]

    def check_module(self, module: str, shape: tuple[int, int]) -> list[str]:
        out_f, in_f = shape
        groups = -(-in_f // self.weights_scheme.group_size)
        problems: list[str] = []
        expect_tensor(self, f"{module}.qweight", torch.int32, [in_f, out_f // 8], problems)
        expect_tensor(self, f"{module}.qzeros", torch.int32, [groups, out_f // 8], problems)
        expect_tensor(self, f"{module}.scales", FLOATS, [groups, out_f], problems,
                      f" (group_size {self.weights_scheme.group_size})")
        return problems

    def qtensor(self, module: str) -> QTensor:
        return codec.decode(self.tensors(module), self.weights_scheme, where=f"{self.path}: {module}")
