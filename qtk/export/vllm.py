"""vLLM target: a compressed-tensors checkpoint (FORMATS.md §1), and its reader.

int-quantized (W8A8 int8), float-quantized (FP8) or pack-quantized (weight-only int4/int8). The KV
cache is FP8 with k_scale = amax(K after RoPE)/448 and v_scale = amax(V)/448: vLLM has no INT8 KV cache
with checkpoint scales, so an 8-bit int KV recipe becomes FP8 KV here (and the output says so).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.base import Writer
from qtk.export.checkpoint import Checkpoint, config_quantization
from qtk.export.safetensors_io import ShardedWriter
from qtk.quant.pack import pack_ct, pack_ct_zero_point, unpack_ct, unpack_ct_zero_point
from qtk.quant.qtensor import QTensor
from qtk.recipe import FP8_MAX, QuantScheme

KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
             "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def ct_version() -> str:
    """The compressed-tensors version the config declares (read from metadata: importing it costs seconds)."""
    import importlib.metadata as md

    try:
        return md.version("compressed-tensors")
    except md.PackageNotFoundError:
        return "0.20.0"


def ct_format(recipe) -> str:
    if recipe.weights.is_fp8:
        return "float-quantized"
    if recipe.activations is not None:
        return "int-quantized"
    return "pack-quantized"


def kv_scale(amax: float) -> torch.Tensor:
    """FP8 KV scale: the cache holds fp8(x / scale), so scale = amax / 448 (never 0)."""
    return torch.tensor([max(amax / FP8_MAX, torch.finfo(torch.float32).tiny)], dtype=torch.float32)


@register_writer
class VLLMWriter(Writer):
    target = "vllm"
    description = "compressed-tensors checkpoint"
    loads_in = "vLLM (`vllm serve DIR`), transformers + compressed-tensors"

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.format = ct_format(recipe)
        n_expected = len(source.weight_map) * 4 + 2 * source.num_layers + 16
        self.shards = ShardedWriter(self.dir, options.max_shard_bytes, n_expected)
        self.ignored: list[str] = [source.arch.lm_head]  # also when tied: it is a Linear the config must exclude
        moe = source.arch.moe
        if moe is not None:  # routers stay dense; excluded by pattern, as llm-compressor writes it
            self.ignored.append(f"re:.*{moe.block}\\.{moe.router}$")

    @classmethod
    def check(cls, source, recipe, options):
        if recipe.writes_g_idx:  # compressed-tensors 0.20 rejects actorder "group" (and weight_g_idx) outright
            raise UsageError(f"recipe {recipe.name}: GPTQ actorder group needs a g_idx, which compressed-tensors "
                             "(and so --target vllm) no longer accepts",
                             "set gptq actorder: static (same ordering, static groups, no g_idx), or use --target gptq")
        notes = []
        if options.tp != 1 or options.pp != 1:
            notes.append(f"--tp {options.tp} --pp {options.pp} applies to the trtllm target; vLLM shards at load time "
                         f"(serve with --tensor-parallel-size {options.tp})")
        if source.arch.moe is not None and not recipe.weights.symmetric:
            notes.append("asymmetric MoE experts (zero points) load only in vLLM versions whose compressed-tensors MoE "
                         "path supports zero points (older ones accept symmetric experts only); for those use a "
                         "symmetric recipe such as w4a16-gptq")
        if recipe.kv_cache is not None and not recipe.kv_cache.is_fp8:
            notes.append("vLLM has no INT8 KV cache with checkpoint scales: wrote FP8 KV scales (amax/448); "
                         "serve with --kv-cache-dtype fp8")
        return notes

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.shards.add(name, tensor)

    def add_layer(self, r) -> None:
        dtype = self.source.dtype
        for mod, qt in r.qweights.items():
            for k, t in self.encode(qt, dtype).items():
                self.shards.add(f"{mod}.{k}", t)
            if mod in r.input_amax and self.recipe.static_activations:
                from qtk.quant.qparams import static_scale

                self.shards.add(f"{mod}.input_scale", static_scale(r.input_amax[mod], self.recipe.activations))
        for name, t in r.dense.items():
            self.shards.add(name, t)
        prefix = self.source.layer_prefix(r.index)
        self.ignored.extend(prefix + lin for lin in self.source.arch.linears
                            if prefix + lin not in r.qweights)
        if r.k_amax is not None:
            attn = f"{prefix}{self.source.arch.attn}"
            self.shards.add(f"{attn}.k_scale", kv_scale(r.k_amax))
            self.shards.add(f"{attn}.v_scale", kv_scale(r.v_amax))

    def encode(self, qt: QTensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        s = qt.scheme
        if self.format == "pack-quantized":
            out = {
                "weight_packed": pack_ct(qt.values, s.num_bits),
                "weight_scale": qt.scale.to(dtype),
                "weight_shape": torch.tensor(list(qt.shape), dtype=torch.int64),
            }
            if qt.zero_point is not None:
                out["weight_zero_point"] = pack_ct_zero_point(qt.zero_point.reshape(qt.scale.shape), s.num_bits)
            return out
        scale_dtype = torch.float32 if s.is_fp8 else dtype
        return {"weight": qt.values, "weight_scale": qt.scale.to(scale_dtype)}

    def quantization_config(self) -> dict:
        r = self.recipe
        # GPTQ's static act-order changes only how the values were chosen: "weight" records it, nothing to decode
        actorder = "weight" if r.gptq_actorder is not None else None
        group = {"targets": ["Linear"], "weights": r.weights.to_ct_args(actorder),
                 "input_activations": r.activations.to_ct_args() if r.activations else None,
                 "output_activations": None, "format": self.format}
        return {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "version": ct_version(),
            "config_groups": {"group_0": group},
            "ignore": sorted(set(self.ignored)),
            "kv_cache_scheme": dict(KV_SCHEME) if r.kv_cache is not None else None,
            "sparsity_config": {},
            "transform_config": {},
            "global_compression_ratio": None,
        }

    def finish(self, manifest: dict) -> None:
        self.shards.close()
        cfg = dict(self.source.config_dict)
        cfg["quantization_config"] = self.quantization_config()
        (self.dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        self.copy_side_files()
        self.write_manifest(manifest)


def _scheme(args: dict | None) -> QuantScheme | None:
    if not args:
        return None
    return QuantScheme(num_bits=args["num_bits"], type=args.get("type", "int"), symmetric=args.get("symmetric", True),
                       strategy=args.get("strategy") or "tensor", group_size=args.get("group_size"),
                       dynamic=bool(args.get("dynamic", False)))


@register_reader
class CompressedTensorsCheckpoint(Checkpoint):
    format = "vllm"

    @staticmethod
    def detect(path: Path) -> bool:
        return (config_quantization(path) or {}).get("quant_method") == "compressed-tensors"

    def __init__(self, path: Path):
        super().__init__(path)
        cfg = json.loads((self.path / "config.json").read_text())
        self.qconfig = cfg.pop("quantization_config")
        self.hf_config = cfg
        groups = list(self.qconfig["config_groups"].values())
        if len(groups) != 1:
            raise UsageError(f"{path}: {len(groups)} quantization config groups", "qtk reads single-group compressed-tensors checkpoints")
        self.ct_format = self.qconfig.get("format") or groups[0].get("format")
        self.weights_scheme = _scheme(groups[0]["weights"])
        self.activations = _scheme(groups[0].get("input_activations"))
        kv = self.qconfig.get("kv_cache_scheme")
        self.kv_cache = None if not kv else ("fp8" if kv.get("type") == "float" else "int8")
        dt = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        self.dtype = getattr(torch, dt)

    def ignore_patterns(self) -> list[str]:
        return list(self.qconfig.get("ignore") or [])

    def modules(self) -> list[str]:
        return sorted(n[: -len(".weight_scale")] for n in self.tensor_names() if n.endswith(".weight_scale"))

    def qtensor(self, module: str) -> QTensor:
        s = self.weights_scheme
        scale = self.tensor(f"{module}.weight_scale").float()
        zero = None
        if self.has(f"{module}.weight_packed"):
            out_f, in_f = self.tensor(f"{module}.weight_shape").tolist()
            values = unpack_ct(self.tensor(f"{module}.weight_packed"), s.num_bits, in_f)
            if self.has(f"{module}.weight_zero_point"):
                zero = unpack_ct_zero_point(self.tensor(f"{module}.weight_zero_point"), s.num_bits, out_f).float()
        else:
            values = self.tensor(f"{module}.weight")
        # older compressed-tensors checkpoints (actorder "group") carry a g_idx; decoding without it would be wrong
        g_idx = self.tensor(f"{module}.weight_g_idx").to(torch.int32) if self.has(f"{module}.weight_g_idx") else None
        return QTensor(values, scale, s, zero, g_idx, self.dtype)

    def input_scale(self, module: str) -> torch.Tensor | None:
        n = f"{module}.input_scale"
        return self.tensor(n).float() if self.has(n) else None

    def kv_scales(self, layer: int) -> tuple[float, float] | None:
        base = f"model.layers.{layer}.self_attn"
        if not self.has(f"{base}.k_scale"):
            return None
        return float(self.tensor(f"{base}.k_scale").reshape(-1)[0]), float(self.tensor(f"{base}.v_scale").reshape(-1)[0])

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        quant_suffixes = (".weight_scale", ".weight_packed", ".weight_shape", ".weight_zero_point", ".weight_g_idx",
                          ".input_scale", ".k_scale", ".v_scale")
        qmods = set(self.modules())
        out = {}
        for n in self.tensor_names():
            if n.endswith(quant_suffixes) or (n.endswith(".weight") and n[: -len(".weight")] in qmods):
                continue
            out[n] = self.tensor(n)
        return out
