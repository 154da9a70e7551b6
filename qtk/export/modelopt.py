"""hf-modelopt target: NVIDIA ModelOpt's unified Hugging Face checkpoint (docs/formats.md, hf-modelopt), and its reader.

Hugging Face tensor names plus hf_quant_config.json and a config.json quantization_config with
quant_method "modelopt", laid out as ModelOpt's export_hf_checkpoint writes them. TensorRT-LLM's LLM API
loads it (FP8, W4A16_AWQ, W4A8_AWQ, NVFP4), vLLM too (FP8, NVFP4). INT8 SmoothQuant has no such form: it needs --target trtllm.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.base import Writer
from qtk.export.checkpoint import FLOATS, SCALAR, Checkpoint, config_scheme, expect_tensor, read_json
from qtk.export.codecs import modelopt as codec
from qtk.export.codecs.trtllm import w4a8_range_problem, w4a8_weight_amax
from qtk.export.trtllm.algo import AWQ_GROUP_SIZES
from qtk.io.safetensors import ShardedWriter
from qtk.model.config_check import MAX_CONFIG_BYTES
from qtk.plan.serving import kernel_families
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import FP8_MAX, QuantScheme, Strategy

SCHEMES = {
    "FP8": (QuantScheme(8, "float", True, "tensor"), QuantScheme(8, "float", True, "tensor")),
    "W4A16_AWQ": (None, None),  # group size from the config
}


def modelopt_quant(recipe) -> tuple[str, str | None, int | None]:
    """(quant_algo, kv_cache_quant_algo, group_size) of the unified HF checkpoint, or a UsageError naming the fix."""
    w, a = recipe.weights, recipe.activations
    where = f"recipe {recipe.name}"
    if recipe.mixed:  # no fix of our own: the targets that accept the recipe are computed from their checks
        raise UsageError(f"{where}: qtk writes hf-modelopt checkpoints with one quant_algo; the recipe's overrides would "
                         "need ModelOpt's MIXED_PRECISION (per-layer quantized_layers), which qtk does not write")
    if w.is_nvfp4:  # NVFP4 (W4A4) and W4A16_NVFP4, as ModelOpt's NVFP4_DEFAULT_CFG / W4A16_NVFP4_CFG export them
        kv = recipe.kv_cache
        if kv is not None and not kv.is_fp8:
            raise UsageError(f"{where}: ModelOpt HF checkpoints carry FP8 KV-cache scales only", "set kv_cache type: float")
        return ("NVFP4" if a is not None else "W4A16_NVFP4"), None if kv is None else "FP8", w.group_size
    new = kernel_families(recipe)
    if new == ["W4A8-FP8"]:  # W4A8_AWQ, as ModelOpt's W4A8_AWQ_BETA_CFG exports it
        if a.dynamic:
            raise UsageError(f"{where}: ModelOpt's W4A8_AWQ quantizes activations to FP8 per tensor with a static "
                             f"(calibrated) scale, not {a.describe()}",
                             "use the w4a8-fp8-static recipe (activations {strategy: tensor, dynamic: false}) for "
                             "ModelOpt, or --target vllm for per-token W4A8-FP8")
        if recipe.writes_g_idx:
            raise UsageError(f"{where}: ModelOpt's W4A8_AWQ has no g_idx for GPTQ actorder group", "set gptq actorder: static (no g_idx)")
        kv = recipe.kv_cache
        if kv is not None and not kv.is_fp8:
            raise UsageError(f"{where}: ModelOpt HF checkpoints carry FP8 KV-cache scales only", "set kv_cache type: float")
        return "W4A8_AWQ", None if kv is None else "FP8", w.group_size
    if "W4A8-INT8" in new:  # no fix of our own: the targets that accept the recipe are computed from their checks
        raise UsageError(f"{where}: ModelOpt has no HF export of int4 weights with INT8 activations: its W4A8 "
                         "(W4A8_AWQ) takes static FP8 activations (the w4a8-fp8-static recipe)")
    if "FP8 block" in new:  # no fix of our own: the targets that accept the recipe are computed from their checks
        raise UsageError(f"{where}: ModelOpt's only FP8 block export (quant_algo fp8_pb_wo) is weight-only; FP8 block "
                         "with per-token-group FP8 activations has no ModelOpt HF form")
    if "MXFP8" in new:  # no fix of our own: the targets that accept the recipe are computed from their checks
        raise UsageError(f"{where}: qtk does not write MXFP8 as a ModelOpt HF checkpoint: ModelOpt's MXFP8 "
                         "(quant_algo MXFP8, MXFP8_DEFAULT_CFG) chooses each E8M0 scale as 2^ceil(log2(amax/448)), not "
                         "compressed-tensors' rule that qtk quantizes with")
    if new:  # no fix of our own: the targets that accept the recipe are computed from their checks
        raise UsageError(f"{where}: qtk does not write {', '.join(new)} as a ModelOpt HF checkpoint")
    if a is not None and not a.is_fp8:
        raise UsageError(f"{where}: INT8 SmoothQuant (W8A8) has no ModelOpt HF checkpoint form; TensorRT-LLM loads it only "
                         "from its own checkpoint", "use --target trtllm")
    if w.is_fp8 and w.strategy == Strategy.TENSOR and a is not None and not a.dynamic:
        algo, group = "FP8", None
    elif (not w.is_fp8 and a is None and w.num_bits == 4 and w.strategy == Strategy.GROUP and w.symmetric
          and w.group_size in AWQ_GROUP_SIZES):
        if recipe.writes_g_idx:
            raise UsageError(f"{where}: ModelOpt's W4A16_AWQ has no g_idx for GPTQ actorder group", "set gptq actorder: static (no g_idx)")
        algo, group = "W4A16_AWQ", w.group_size
    else:
        # no fix of our own: the targets that accept the recipe are computed from their checks (qtk.export.check_targets)
        raise UsageError(f"{where}: qtk writes hf-modelopt checkpoints for FP8 (per-tensor weights, static activations) and "
                         f"W4A16_AWQ (symmetric int4, group 64 or 128), not {recipe.summary()}")
    kv = recipe.kv_cache
    if kv is not None and not kv.is_fp8:
        raise UsageError(f"{where}: ModelOpt HF checkpoints carry FP8 KV-cache scales only", "set kv_cache type: float, or use --target trtllm for INT8 KV")
    return algo, None if kv is None else "FP8", group


@register_writer
class ModelOptHFWriter(Writer):
    target = "hf-modelopt"
    description = "NVIDIA ModelOpt unified Hugging Face checkpoint"
    loads_in = "TensorRT-LLM LLM API (`trtllm-serve DIR`), vLLM (FP8)"

    @classmethod
    def check(cls, source, recipe, options):
        if options.tp != 1 or options.pp != 1:
            raise UsageError("--tp/--pp shape the trtllm target only; the HF checkpoint is sharded by the engine at load time",
                             "drop --tp/--pp for --target hf-modelopt")
        modelopt_quant(recipe)
        return []

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.algo, self.kv_algo, self.group_size = modelopt_quant(recipe)
        self.shards = ShardedWriter(self.dir, options.max_shard_bytes, len(source.weight_map) * 4 + 2 * source.num_layers + 16)
        a = source.arch
        self.exclude: list[str] = [a.lm_head, a.embed]
        # Linears whose input is no norm output keep an explicit (identity) pre-quant scale, as ModelOpt writes them
        self.prequant = {n for k in (a.at(0), a) for p in k.smoothing if not p.prev_is_norm for n in p.nexts}

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.shards.add(name, tensor)

    def add_layer(self, r) -> None:
        a, dtype = self.source.arch, self.source.dtype
        prefix = self.source.layer_prefix(r.index)
        for mod, qt in r.qweights.items():
            amax = r.input_amax[mod] if self.algo in ("FP8", "NVFP4", "W4A8_AWQ") else None
            wamax = None
            if self.algo == "W4A8_AWQ":  # one input_scale and weight_scale_2 per fused group, as ModelOpt unifies them
                group = [prefix + m for m in a.fusion_group_of(mod[len(prefix):]) if prefix + m in r.qweights]
                amax = max(r.input_amax[m] for m in group)
                wamax = max(w4a8_weight_amax(r.qweights[m]) for m in group)
            for k, t in codec.encode(self.algo, qt, amax, mod[len(prefix):] in self.prequant, dtype, wamax).items():
                self.shards.add(f"{mod}.{k}", t)
        for name, t in r.dense.items():
            self.shards.add(name, t)
        self.exclude.extend(r.dense_linears)
        if r.k_amax is not None:
            # the attention's k/v scales live on k_proj / v_proj in ModelOpt's layout: amax / 448, not clamped
            tiny = torch.finfo(torch.float32).tiny
            self.shards.add(f"{prefix}{a.attn}.k_proj.k_scale", codec.scalar(max(r.k_amax / FP8_MAX, tiny)))
            self.shards.add(f"{prefix}{a.attn}.v_proj.v_scale", codec.scalar(max(r.v_amax / FP8_MAX, tiny)))

    def hf_quant_config(self) -> dict:
        from qtk import __version__

        q = {"quant_algo": self.algo, "kv_cache_quant_algo": self.kv_algo}
        if self.algo in ("W4A16_AWQ", "W4A8_AWQ"):
            q.update(group_size=self.group_size, has_zero_point=False, pre_quant_scale=True)
        elif self.algo in codec.NVFP4_ALGOS:
            q["group_size"] = self.group_size
        q["exclude_modules"] = self.exclude
        return {"producer": {"name": "qtk", "version": __version__}, "quantization": q}

    def quantization_config(self) -> dict:
        """config.json's quantization_config: ModelOpt's compressed-tensors-like form of hf_quant_config.json."""
        hq = self.hf_quant_config()
        q = hq["quantization"]
        out: dict = {}
        if self.algo == "FP8":
            fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
            out["config_groups"] = {"group_0": {"input_activations": dict(fp8), "weights": dict(fp8), "targets": ["Linear"]}}
        elif self.algo in codec.NVFP4_ALGOS:
            fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": self.group_size}
            g = {"input_activations": dict(fp4)} if self.algo == "NVFP4" else {}
            out["config_groups"] = {"group_0": {**g, "weights": dict(fp4), "targets": ["Linear"]}}
        out["ignore"] = q["exclude_modules"]
        out["quant_algo"] = self.algo
        if self.kv_algo:
            out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
        out["producer"] = hq["producer"]
        out["quant_method"] = "modelopt"
        return out

    def finish(self, manifest: dict) -> None:
        self.shards.close()
        self.write_config()
        (self.dir / "hf_quant_config.json").write_text(json.dumps(self.hf_quant_config(), indent=4) + "\n")
        self.copy_side_files()
        self.write_manifest(manifest)


@register_reader
class ModelOptHFCheckpoint(Checkpoint):
    format = "hf-modelopt"

    QUANT_METHOD = "modelopt"

    def __init__(self, path: Path):
        super().__init__(path)
        cfg, qc = self._read_config()
        self.hf_config = cfg
        hq_path = self.path / "hf_quant_config.json"
        try:
            hq = read_json(hq_path, MAX_CONFIG_BYTES) if hq_path.is_file() else {}
        except (OSError, ValueError) as e:
            raise self._broken(f"hf_quant_config.json cannot be read ({' '.join(str(e).split())[:160]})") from None
        q = (hq.get("quantization") if isinstance(hq, dict) else None) or {}
        self.quant_algo = q.get("quant_algo") or qc.get("quant_algo")
        self.exclude = list(q.get("exclude_modules") or qc.get("ignore") or [])
        if self.quant_algo == "FP8":
            w, a = SCHEMES["FP8"]
        elif self.quant_algo in ("W4A16_AWQ", "W4A8_AWQ"):
            w = QuantScheme(4, "int", True, "group", int(q.get("group_size") or 128))
            a = QuantScheme(8, "float", True, "tensor") if self.quant_algo == "W4A8_AWQ" else None
        elif self.quant_algo in codec.NVFP4_ALGOS:
            w = QuantScheme(4, "float", True, "tensor_group", 16)
            a = QuantScheme(4, "float", True, "tensor_group", 16, dynamic="local") if self.quant_algo == "NVFP4" else None
        else:
            raise UsageError(f"{path}: qtk reads ModelOpt HF checkpoints with quant_algo FP8, W4A16_AWQ, W4A8_AWQ, NVFP4 or "
                             f"W4A16_NVFP4, not {self.quant_algo}",
                             "inspect it with ModelOpt or TensorRT-LLM")
        scheme = config_scheme(w, a, f"{path}: quant_algo {self.quant_algo}")
        self.weights_scheme, self.activations = scheme.weights, scheme.activations
        kv = q.get("kv_cache_quant_algo") or ("FP8" if qc.get("kv_cache_scheme") else None)
        self.kv_cache = "fp8" if kv == "FP8" else None
        self.dtype = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")

    def ignore_patterns(self) -> list[str]:
        return list(self.exclude)

    def modules(self) -> list[str]:
        return sorted(n[: -len(".weight_scale")] for n in self.tensor_names() if n.endswith(".weight_scale"))

    def qtensor(self, module: str) -> QTensor:
        return codec.decode(self.quant_algo, self.tensors(module), self.weights_scheme, self.dtype, where=module)

    def input_scale(self, module: str) -> torch.Tensor | None:
        n = f"{module}.input_scale"
        if not self.has(n):
            return None
        s = self.tensor(n).float().reshape(1)
        # ModelOpt stores NVFP4's input scale as amax/2688, the inverse of the global scale the simulator multiplies by
        return 1.0 / s if self.quant_algo == "NVFP4" else s

    def kv_scales(self, layer: int) -> tuple[float, float] | None:
        base = self.attention(layer)
        k, v = f"{base}.k_proj.k_scale", f"{base}.v_proj.v_scale"
        if not (self.has(k) and self.has(v)):
            return None
        return float(self.tensor(k).reshape(-1)[0]), float(self.tensor(v).reshape(-1)[0])

    def kv_tensor_names(self, layer: int) -> str:
        return f"{self.attention(layer)}.k_proj.k_scale / v_proj.v_scale"

    def check_module(self, module: str, shape: tuple[int, int]) -> list[str]:
        out_f, in_f = shape
        problems: list[str] = []
        if self.quant_algo in codec.NVFP4_ALGOS:
            expect_tensor(self, f"{module}.weight", torch.uint8, [out_f, in_f // 2], problems, " (two FP4 codes a byte)")
            expect_tensor(self, f"{module}.weight_scale", torch.float8_e4m3fn, [out_f, in_f // 16], problems)
            expect_tensor(self, f"{module}.weight_scale_2", torch.float32, SCALAR, problems)
            if self.quant_algo == "NVFP4":
                expect_tensor(self, f"{module}.input_scale", torch.float32, SCALAR, problems, " (NVFP4 has a static input scale)")
        elif self.quant_algo == "FP8":
            expect_tensor(self, f"{module}.weight", torch.float8_e4m3fn, [out_f, in_f], problems)
            expect_tensor(self, f"{module}.weight_scale", torch.float32, SCALAR, problems)
            expect_tensor(self, f"{module}.input_scale", torch.float32, SCALAR, problems, " (FP8 has static activation scales)")
        else:
            g = self.weights_scheme.group_size
            expect_tensor(self, f"{module}.weight", (torch.uint8, torch.int8), [out_f // 2, in_f], problems)
            expect_tensor(self, f"{module}.weight_scale", FLOATS, [out_f, in_f // g], problems, f" (group_size {g})")
            if self.has(f"{module}.pre_quant_scale"):
                expect_tensor(self, f"{module}.pre_quant_scale", FLOATS, [in_f], problems)
            if self.quant_algo == "W4A8_AWQ":
                expect_tensor(self, f"{module}.weight_scale_2", torch.float32, SCALAR, problems)
                expect_tensor(self, f"{module}.input_scale", torch.float32, SCALAR, problems, " (W4A8_AWQ has a static input scale)")
                if not problems:
                    p = w4a8_range_problem(self.qtensor(module), self.tensor(f"{module}.weight_scale_2"), module)
                    problems += [p] if p else []
        return problems

    def dense_names(self) -> list[str]:
        qmods = set(self.modules())
        return [n for n in self.tensor_names()
                if not n.endswith(codec.SUFFIXES) and not (n.endswith(".weight") and n[: -len(".weight")] in qmods)]
