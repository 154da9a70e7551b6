"""gptq target: the legacy GPTQ checkpoint (FORMATS.md §4) that vLLM (gptq, gptq_marlin), GPTQModel and
transformers load, and its reader.

Per quantized Linear X: X.qweight int32 [in·bits/32, out], X.qzeros int32 [groups, out·bits/32],
X.scales fp16 [groups, out], X.g_idx int32 [in]; biases stay X.bias. Zero points are written in the v1
layout (stored z − 1, checkpoint_format "gptq"), which every loader assumes; a zero point v1 cannot hold
(unsigned 0) switches the whole checkpoint to "gptq_v2" and rewrites the qzeros already on disk in place,
so the writer still streams. Shared by the awq target: the fp16 scale rounding and the common refusals.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.base import Writer
from qtk.export.checkpoint import Checkpoint
from qtk.export.safetensors_io import SafetensorsFile, ShardedWriter
from qtk.quant.pack import offset, pack_gptq_qweight, pack_gptq_qzeros, unpack_gptq_qweight, unpack_gptq_qzeros
from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme

GPTQ_BITS = (4, 8)  # what vLLM's gptq_marlin runs; 2-bit has no fast kernel and packs differently in places
FP16_TINY = 2.0**-24  # smallest positive float16 (subnormal)


# ---- shared with the awq target ----

def refuse_common(target: str, recipe, options) -> None:
    """Refusals every legacy weight-only format shares: no tp/pp, no fp8, no quantized activations."""
    if options.tp != 1 or options.pp != 1:
        raise UsageError("--tp/--pp apply to the trtllm target only", f"engines shard {target} checkpoints at load time: drop --tp/--pp")
    if recipe.weights.is_fp8:
        raise UsageError(f"the {target} target stores integer weights, not fp8", "use --target vllm (or trtllm) for fp8 recipes")
    if recipe.activations is not None:
        raise UsageError(f"the {target} target is weight-only and cannot store quantized activations "
                         f"({recipe.summary()})", "use --target vllm (or trtllm) for W8A8 recipes")


def common_notes(target: str, source, recipe) -> list[str]:
    notes = []
    if source.dtype == torch.bfloat16:
        notes.append(f"the {target} format's non-Marlin kernels run fp16 only: serve this bfloat16 model with "
                     "--dtype float16 if the engine refuses bfloat16")
    if recipe.kv_cache is not None:
        notes.append(f"the {target} format has no KV-cache scales: none written (use --target vllm for FP8 KV)")
    return notes


class FP16Scales:
    """float32 scales -> the float16 the legacy formats store, counting what rounding changed. bf16 scales
    convert exactly while they are fp16 normals (>= 2^-14); smaller ones lose bits, fp32 ones round. A scale
    beyond fp16's range is refused; a positive one below fp16's smallest becomes that (0 would erase its group)."""

    def __init__(self, target: str):
        self.target = target
        self.total = 0
        self.changed = 0
        self.max_rel = 0.0

    def __call__(self, scale: torch.Tensor, module: str) -> torch.Tensor:
        s = scale.to(torch.float16)
        if not torch.isfinite(s).all():
            raise UsageError(f"{module}: a weight scale exceeds float16's range (65504), which the {self.target} format stores",
                             "use --target vllm, which stores scales in the model dtype")
        s = torch.where((s == 0) & (scale > 0), torch.full_like(s, FP16_TINY), s)
        diff = s.float() != scale
        self.total += scale.numel()
        if diff.any():
            self.changed += int(diff.sum())
            self.max_rel = max(self.max_rel, float(((s.float() - scale).abs() / scale.abs())[diff].max()))
        return s

    def note(self, dtype: torch.dtype) -> str | None:
        if dtype == torch.float16:
            return None
        name = str(dtype).replace("torch.", "")
        if not self.changed:
            return f"scales stored as fp16 (the {self.target} format's dtype): all {self.total} {name} scales converted exactly"
        return (f"scales stored as fp16 (the {self.target} format's dtype): {self.changed} of {self.total} {name} scales "
                f"changed in rounding (max relative change {self.max_rel:.1e}); qtk's reader returns the fp16 values")


def ignored_layer_linears(source, r) -> list[str]:
    """Full names of the decoder layer's Linears left unquantized (written dense): those the recipe ignores, and
    the MoE routers."""
    prefix = source.layer_prefix(r.index)
    return ([prefix + lin for lin in source.arch.linears if prefix + lin not in r.qweights]
            + [prefix + lin for lin in source.arch.dense_linears])


def check_divisible(module: str, n: int, per: int, what: str, target: str) -> None:
    if n % per:
        raise UsageError(f"{module}: {what} {n} is not a multiple of {per}, which the {target} layout packs per int32 word",
                         "ignore this module in the recipe, or use --target vllm")


def trivial_g_idx(in_features: int, group_size: int | None) -> torch.Tensor:
    """The group of each input column without act-order: column // group_size (all 0 per-channel)."""
    cols = torch.arange(in_features, dtype=torch.int32)
    return cols // group_size if group_size else torch.zeros_like(cols)


def _per_group(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """A QTensor scale / zero point ([1], [out, 1] or [out, groups]) as [out, groups]."""
    return t.reshape(-1, 1).expand(out_features, 1) if t.numel() == 1 else t.reshape(out_features, -1)


# ---- writer ----

class LegacyWriter(Writer):
    """What the GPTQ and AWQ writers share: fp16 scales, streamed shards, and each layer's packed tensors
    (from `encode`) and dense ones; the quantized and the ignored Linears are recorded for the config."""

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.ignored: list[str] = []
        self.quantized: list[str] = []
        self.fp16 = FP16Scales(self.target)
        n_expected = len(source.weight_map) * 4 + 16
        self.shards = ShardedWriter(self.dir, options.max_shard_bytes, n_expected)

    def encode(self, mod: str, qt: QTensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.shards.add(name, tensor)

    def add_layer(self, r) -> None:
        for mod, qt in r.qweights.items():
            for k, t in self.encode(mod, qt).items():
                self.shards.add(f"{mod}.{k}", t)
        for name, t in r.dense.items():  # norms, biases (X.bias), ignored Linears
            self.shards.add(name, t)
        self.quantized.extend(r.qweights)
        self.ignored.extend(ignored_layer_linears(self.source, r))


@register_writer
class GPTQWriter(LegacyWriter):
    target = "gptq"
    description = "legacy GPTQ checkpoint (qweight/qzeros/scales/g_idx)"
    loads_in = "vLLM (gptq, gptq_marlin), GPTQModel, transformers (with optimum + gptqmodel)"

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.bits = recipe.weights.num_bits
        self.v1 = True  # until a zero point v1 cannot store turns up
        self.v1_qzeros: list[str] = []  # qzeros already written in v1: rewritten if the checkpoint turns v2
        self.desc_act = False

    @classmethod
    def check(cls, source, recipe, options):
        refuse_common(cls.target, recipe, options)
        w = recipe.weights
        if w.num_bits not in GPTQ_BITS:
            raise UsageError(f"the gptq target stores int4 or int8 weights, not int{w.num_bits}",
                             "use num_bits 4 or 8, or --target vllm")
        return common_notes(cls.target, source, recipe)

    def encode(self, mod: str, qt: QTensor) -> dict[str, torch.Tensor]:
        bits, s = self.bits, qt.scheme
        out_f, in_f = qt.shape
        per = 32 // bits
        check_divisible(mod, in_f, per, "in_features", self.target)
        check_divisible(mod, out_f, per, "out_features", self.target)
        group = s.group_size if s.strategy == "group" else None
        trivial = trivial_g_idx(in_f, group)
        g_idx = trivial if qt.g_idx is None else qt.g_idx.to(torch.int32)
        if not torch.equal(g_idx, trivial):
            self.desc_act = True
        zero = None if qt.zero_point is None else _per_group(qt.zero_point, out_f)
        if zero is not None and self.v1 and bool((zero.to(torch.int64) + offset(bits) == 0).any()):
            self.v1 = False
            self.notes.append("a zero point of 0 (unsigned) cannot be stored in GPTQ v1 (it stores z - 1): wrote "
                              "checkpoint_format gptq_v2, which GPTQModel and vLLM with gptq_v2 support load; older "
                              "loaders misread it as v1")
        scale = _per_group(qt.scale, out_f)  # [out, groups]
        qzeros = pack_gptq_qzeros(zero, bits, v1=self.v1, shape=tuple(scale.shape))
        if self.v1:
            self.v1_qzeros.append(f"{mod}.qzeros")
        return {
            "qweight": pack_gptq_qweight(qt.values, bits),  # [in*bits/32, out]
            "qzeros": qzeros,  # [groups, out*bits/32]
            "scales": self.fp16(scale, mod).t().contiguous(),  # [groups, out]
            "g_idx": g_idx,  # [in]
        }

    def _rewrite_qzeros_v2(self, weight_map: dict[str, str]) -> None:
        """Re-encode the qzeros written before the switch (z - 1 -> z), in place: same bytes, same size."""
        for name in self.v1_qzeros:
            path = self.dir / weight_map[name]
            f = SafetensorsFile(path)
            v2 = pack_gptq_qzeros(unpack_gptq_qzeros(f.get_tensor(name), self.bits, v1=True), self.bits, v1=False)
            start = f.data_start + f.entries[name]["data_offsets"][0]
            del f
            fd = os.open(path, os.O_WRONLY)
            try:
                data = v2.contiguous().view(torch.uint8).numpy().tobytes()
                if os.pwrite(fd, data, start) != len(data):
                    raise OSError(f"short write rewriting {name}")
                os.fsync(fd)
            finally:
                os.close(fd)
        self.v1_qzeros = []

    def quantization_config(self) -> dict:
        from qtk import __version__
        from qtk.algorithms.params import GPTQParams

        r, w = self.recipe, self.recipe.weights
        step = r.step("gptq")
        params = step.params if step is not None else GPTQParams()
        cfg = {
            "quant_method": "gptq",
            "bits": w.num_bits,
            "group_size": w.group_size if w.strategy == "group" else -1,
            "desc_act": self.desc_act,
            "sym": w.symmetric,
            # the recipe's gptq.true_sequential: each sub-block's Hessian taken on inputs through the quantized earlier
            # ones (true), or every Hessian from one forward of the unquantized layer (false, the default)
            "true_sequential": bool(step is not None and params.true_sequential),
            "damp_percent": params.damp_percent,
            "static_groups": bool(step is not None and (params.static_groups or params.actorder == "static")),
            "checkpoint_format": "gptq" if self.v1 else "gptq_v2",
            "lm_head": False,
            "pack_dtype": "int32",
            "meta": {"quantizer": [f"qtk:{__version__}"], "qtk_recipe": r.name, "qtk_algorithm": list(r.step_names)},
        }
        if self.ignored:
            # GPTQModel and vLLM: `dynamic` "-:" rules exclude modules (re.match on the module name);
            # optimum (transformers) and vLLM: the quantized modules, matched as name suffix / substring
            cfg["dynamic"] = {f"-:^{re.escape(m)}$": {} for m in sorted(set(self.ignored))}
            cfg["modules_in_block_to_quantize"] = [sorted(self.quantized)]
        return cfg

    def finish(self, manifest: dict) -> None:
        weight_map = self.shards.close()
        if (n := self.fp16.note(self.source.dtype)) is not None:
            self.notes.append(n)
        if not self.v1:
            self._rewrite_qzeros_v2(weight_map)
        qc = self.quantization_config()
        cfg = dict(self.source.config_dict)
        cfg["quantization_config"] = qc
        (self.dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        # AutoGPTQ and GPTQModel read quantize_config.json first; vLLM falls back to it
        (self.dir / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
        self.copy_side_files()
        self.write_manifest(manifest)


# ---- reader ----

def _quant_config(path: Path, method: str) -> dict | None:
    """The checkpoint's quantization config if its quant_method is `method`: config.json's
    quantization_config, else quantize_config.json / quant_config.json (older AutoGPTQ/AutoAWQ outputs)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(qc, dict):
            return qc if str(qc.get("quant_method", "")).lower() == method else None
        for name in ("quantize_config.json", "quant_config.json"):
            p = path / name
            if p.is_file():
                qc = json.loads(p.read_text())
                if isinstance(qc, dict) and str(qc.get("quant_method", method)).lower() == method:
                    return qc
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return None


def _model_dtype(cfg: dict) -> torch.dtype:
    dt = cfg.get("dtype") or cfg.get("torch_dtype") or "float16"
    return getattr(torch, dt) if isinstance(getattr(torch, dt, None), torch.dtype) else torch.float16


class LegacyCheckpoint(Checkpoint):
    """What the GPTQ and AWQ readers share: detection by quant_method, the config without its quantization
    section, modules named by their `.qweight`, and every other tensor as the dense state."""

    METHOD = ""
    SUFFIXES: tuple[str, ...] = ()

    @classmethod
    def detect(cls, path: Path) -> bool:
        return (path / "config.json").is_file() and _quant_config(path, cls.METHOD) is not None

    def __init__(self, path: Path):
        super().__init__(path)
        cfg = json.loads((self.path / "config.json").read_text())
        cfg.pop("quantization_config", None)
        self.hf_config = cfg
        self.qconfig = _quant_config(self.path, self.METHOD) or {}
        self.dtype = _model_dtype(cfg)

    def modules(self) -> list[str]:
        return sorted(n[: -len(".qweight")] for n in self.tensor_names() if n.endswith(".qweight"))

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        qmods = set(self.modules())
        out = {}
        for n in self.tensor_names():
            base, _, suffix = n.rpartition(".")
            if base in qmods and "." + suffix in self.SUFFIXES:
                continue
            out[n] = self.tensor(n)
        return out


@register_reader
class GPTQCheckpoint(LegacyCheckpoint):
    """Returns QTensors in qtk's signed convention: values q = q_u − 2^(bits−1), zero points likewise
    (v1's stored z − 1 undone), scales exactly the fp16 on disk (as float32), g_idx only when act-order."""

    format = "gptq"
    METHOD = "gptq"
    SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")

    def __init__(self, path: Path):
        super().__init__(path)
        fmt = str(self.qconfig.get("checkpoint_format") or self.qconfig.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UsageError(f"{path}: GPTQ checkpoint_format '{fmt}' is not one qtk reads",
                             "qtk reads checkpoint_format gptq (v1) and gptq_v2")
        self.v1 = fmt == "gptq"
        self.bits = int(self.qconfig["bits"])
        gs = int(self.qconfig.get("group_size", -1))
        self.weights_scheme = QuantScheme(num_bits=self.bits, type="int", symmetric=bool(self.qconfig.get("sym", True)),
                                          strategy="group" if gs > 0 else "channel", group_size=gs if gs > 0 else None)

    def ignore_patterns(self) -> list[str]:
        out = [] if self.qconfig.get("lm_head") else ["lm_head"]
        for pattern in self.qconfig.get("dynamic") or {}:
            if pattern.startswith("-:"):  # re.match semantics: anchored at the start only
                out.append(f"re:(?:{pattern[2:]}).*")
        return out

    def qtensor(self, module: str) -> QTensor:
        s = self.weights_scheme
        values = unpack_gptq_qweight(self.tensor(f"{module}.qweight"), self.bits)  # [out, in]
        out_f, in_f = values.shape
        scale = self.tensor(f"{module}.scales").float().t().contiguous()  # [groups, out] -> [out, groups]
        zero = unpack_gptq_qzeros(self.tensor(f"{module}.qzeros"), self.bits, v1=self.v1)[:out_f].float()  # [out, groups]
        if s.symmetric and not zero.any():
            zero = None
        g_idx = self.tensor(f"{module}.g_idx").to(torch.int32) if self.has(f"{module}.g_idx") else None
        if g_idx is not None and torch.equal(g_idx, trivial_g_idx(in_f, s.group_size)):
            g_idx = None
        if g_idx is None and s.strategy == "group" and scale.shape[1] * s.group_size != in_f:
            raise UsageError(f"{self.path}: {module} has {scale.shape[1]} scale groups for {in_f} inputs",
                             f"the checkpoint does not match its group_size {s.group_size}")
        return QTensor(values, scale, s, zero, g_idx, torch.float16)  # the kernels dequantize in the scales' fp16
