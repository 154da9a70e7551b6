"""hf-fp8 target: Hugging Face's own fine-grained FP8 format (transformers FineGrainedFP8Config), as DeepSeek-V3 and
Qwen3 publish their FP8 models, and its reader. transformers and vLLM load it without compressed-tensors.

config.json `quantization_config`: {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size":
[bm, bn], "modules_to_not_convert": [...]}; per quantized Linear X: `X.weight` float8_e4m3fn [out, in] and
`X.weight_scale_inv` float32 [out/bm, in/bn], which despite its name is the dequantization multiplier amax/448
(w = q · weight_scale_inv per block). Activations are quantized dynamically per token per group of bn (the engines'
fixed choice: the format has no per-module activation scheme). Only the fp8-block recipes fit it; the FP8 blocks
must tile every quantized Linear (checked before any work), because transformers derives the block size from the
scale grid and would decode a ragged weight wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.base import Writer
from qtk.export.checkpoint import Checkpoint, config_scheme, expect_tensor
from qtk.io.safetensors import ShardedWriter
from qtk.plan.serving import kernel_family
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme

SUFFIXES = (".weight_scale_inv", ".activation_scale")


def hf_fp8_scheme(recipe) -> tuple[int, int]:
    """The block of an fp8-block recipe this format can hold, or a UsageError (no fix of its own: the targets that
    accept the recipe are named by qtk.export.check_targets)."""
    w, a = recipe.weights, recipe.activations
    where = f"recipe {recipe.name}"
    if recipe.mixed:
        raise UsageError(f"{where}: the hf-fp8 format holds one block size for the whole model (no per-module schemes)")
    # FP8 block weights pair only with dynamic per-token-group FP8 activations (qtk.recipe.schema)
    if not (kernel_family(recipe.default_scheme) == "FP8 block" and a is not None):
        raise UsageError(f"{where}: the hf-fp8 target (quant_method fp8) holds FP8 block weights with dynamic per-token-group "
                         f"activations only, not {recipe.summary()}")
    if recipe.kv_cache is not None:
        # no fix of its own: the fp8-block recipe (no KV cache) or a target that accepts this one, which
        # check_targets names from their own checks (vllm may refuse the model's block shapes)
        raise UsageError(f"{where}: the hf-fp8 format has no KV-cache scales (the fp8-block recipe keeps a 16-bit KV cache)")
    return w.block_structure


@register_writer
class HFFP8Writer(Writer):
    target = "hf-fp8"
    description = "Hugging Face fine-grained FP8 checkpoint (quant_method fp8, 128x128 blocks)"
    loads_in = "transformers (FineGrainedFP8Config; dequantized on CPU), vLLM (`vllm serve DIR`)"
    serves_with = ("vllm",)

    @classmethod
    def check(cls, source, recipe, options):
        if options.tp != 1 or options.pp != 1:
            raise UsageError("--tp/--pp shape the trtllm target only; the HF checkpoint is sharded by the engine at load time",
                             "drop --tp/--pp for --target hf-fp8")
        hf_fp8_scheme(recipe)
        from qtk.pipeline.targets import check_fp8_tiles

        check_fp8_tiles(source, recipe, "transformers' FP8 loader derives the block from the scale grid "
                        "(Fp8Dequantize: rows // scale_rows) and would decode a ragged weight wrong")
        return []

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.block = hf_fp8_scheme(recipe)
        self.shards = ShardedWriter(self.dir, options.max_shard_bytes, len(source.weight_map) * 2 + 16)
        self.exclude: list[str] = [source.arch.lm_head]

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.shards.add(name, tensor)

    def add_layer(self, r) -> None:
        for mod, qt in r.qweights.items():
            self.shards.add(f"{mod}.weight", qt.values)
            self.shards.add(f"{mod}.weight_scale_inv", qt.scale.to(torch.float32))  # model-dtype values, stored fp32
        for name, t in r.dense.items():
            self.shards.add(name, t)
        self.exclude.extend(r.dense_linears)

    def quantization_config(self) -> dict:
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(self.block),
                "modules_to_not_convert": sorted(set(self.exclude))}

    def finish(self, manifest: dict) -> None:
        self.shards.close()
        self.write_config()
        self.copy_side_files()
        self.write_manifest(manifest)


@register_reader
class HFFP8Checkpoint(Checkpoint):
    format = "hf-fp8"

    QUANT_METHOD = "fp8"

    def __init__(self, path: Path):
        super().__init__(path)
        cfg, qc = self._read_config()
        self.hf_config = cfg
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2):
            raise UsageError(f"{path}: quant_method fp8 without weight_block_size (per-tensor FP8) is not read by qtk",
                             "inspect it with transformers")
        if qc.get("activation_scheme", "dynamic") != "dynamic" or qc.get("scale_fmt", "float") != "float":
            raise UsageError(f"{path}: qtk reads dynamic-activation FP8 block checkpoints with float scales, not "
                             f"activation_scheme {qc.get('activation_scheme')!r} / scale_fmt {qc.get('scale_fmt')!r}",
                             "inspect it with transformers")
        self.block = (int(block[0]), int(block[1]))
        scheme = config_scheme(QuantScheme(8, "float", True, "block", block_structure=self.block),
                                QuantScheme(8, "float", True, "group", self.block[1], dynamic=True),
                                f"{path}: weight_block_size {list(self.block)}")
        self.weights_scheme, self.activations = scheme.weights, scheme.activations
        self.exclude = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
        self.dtype = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")

    def ignore_patterns(self) -> list[str]:
        return list(self.exclude)

    def modules(self) -> list[str]:
        return sorted(n[: -len(".weight_scale_inv")] for n in self.tensor_names() if n.endswith(".weight_scale_inv"))

    def qtensor(self, module: str) -> QTensor:
        t = self.tensors(module)
        # float32 scales: transformers and vLLM form q · scale in float32, not in the model dtype (the QTensor's dtype
        # is what the engine weight is rounded to)
        return QTensor(t["weight"], t["weight_scale_inv"].float(), self.weights_scheme, dtype=torch.float32)

    def check_module(self, module: str, shape: tuple[int, int]) -> list[str]:
        out_f, in_f = shape
        bm, bn = self.block
        problems: list[str] = []
        if out_f % bm or in_f % bn:
            problems.append(f"{module} [{out_f}, {in_f}] is not a multiple of the {bm}x{bn} blocks "
                            "(transformers derives the block from the scale grid and would decode it wrong)")
        expect_tensor(self, f"{module}.weight", (torch.float8_e4m3fn,), [out_f, in_f], problems)
        expect_tensor(self, f"{module}.weight_scale_inv", (torch.float32,), [-(-out_f // bm), -(-in_f // bn)], problems)
        return problems

    def dense_names(self) -> list[str]:
        qmods = set(self.modules())
        return [n for n in self.tensor_names()
                if not n.endswith(SUFFIXES) and not (n.endswith(".weight") and n[: -len(".weight")] in qmods)]
