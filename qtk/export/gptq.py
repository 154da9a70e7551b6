"""gptq target: the legacy GPTQ checkpoint (docs/formats.md, gptq) that vLLM (gptq, gptq_marlin), GPTQModel and
transformers load, and its reader.

Per quantized Linear X: X.qweight, X.qzeros, X.scales, X.g_idx (qtk.export.codecs.gptq); biases stay X.bias. Zero
points are written in the v1 layout (stored z − 1, checkpoint_format "gptq"), which every loader assumes; a zero
point v1 cannot hold (unsigned 0) switches the whole checkpoint to "gptq_v2" and rewrites the qzeros already on disk
in place, so the writer still streams. Shared by the awq target: the fp16 scale rounding and the common refusals.

Mixed precision: GPTQModel's `dynamic` overrides. The top-level bits / group_size / sym are the recipe's default
scheme; each other scheme is one "+:" rule whose regex names exactly its modules, with their bits, group_size and
sym; "-:" rules exclude modules. vLLM (gptq_utils.py get_dynamic_override) and GPTQModel apply the first rule whose
regex re.match-es the module name; vLLM names q/k/v and gate/up by their fused module (qkv_proj), which each rule's
regex names too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from qtk.bounds import match as bounded_match
from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.base import Writer, expert_overrides, override_patterns
from qtk.export.checkpoint import FLOATS, Checkpoint, config_scheme, expect_tensor, read_json
from qtk.export.codecs import gptq as codec
from qtk.io.safetensors import SafetensorsFile, ShardedWriter
from qtk.model.config_check import MAX_CONFIG_BYTES
from qtk.plan.serving import kernel_families
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme, Strategy
from qtk.recipe.rules import ModuleScheme

GPTQ_BITS = (4, 8)  # what vLLM's gptq_marlin runs; 2-bit has no fast kernel and packs differently in places
FP16_TINY = 2.0**-24  # smallest positive float16 (subnormal)


# ---- shared with the awq target ----

def refuse_common(target: str, recipe, options) -> None:
    """Refusals every legacy weight-only format shares: no tp/pp, no fp8, no quantized activations."""
    if options.tp != 1 or options.pp != 1:
        raise UsageError("--tp/--pp apply to the trtllm target only", f"engines shard {target} checkpoints at load time: drop --tp/--pp")
    new = kernel_families(recipe)
    if new:  # no fix of our own: the targets that accept the recipe are named by qtk.export.check_targets
        raise UsageError(f"the {target} target stores int4/int8 weight-only checkpoints, not {', '.join(new)} ({recipe.summary()})")
    if any(s.weights.type != "int" for s in recipe.schemes):
        raise UsageError(f"the {target} target stores integer weights, not fp8", "use --target vllm (or trtllm) for fp8 recipes")
    if any(s.activations is not None for s in recipe.schemes):
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


def check_divisible(module: str, n: int, per: int, what: str, target: str) -> None:
    if n % per:
        raise UsageError(f"{module}: {what} {n} is not a multiple of {per}, which the {target} layout packs per int32 word",
                         "ignore this module in the recipe, or use --target vllm")


# ---- writer ----

class LegacyWriter(Writer):
    """What the GPTQ and AWQ writers share: fp16 scales, streamed shards, and each layer's packed tensors
    (from `encode`) and dense ones; the quantized Linears (by scheme) and the ignored ones are recorded for the
    config."""

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.ignored: list[str] = []
        self.quantized: list[str] = []
        self.schemes: dict[QuantScheme, list[str]] = {}  # weight scheme -> the modules written with it
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
            self.schemes.setdefault(qt.scheme, []).append(mod)
        for name, t in r.dense.items():  # norms, biases (X.bias), ignored Linears
            self.shards.add(name, t)
        self.quantized.extend(r.qweights)
        self.ignored.extend(r.dense_linears)


@register_writer
class GPTQWriter(LegacyWriter):
    target = "gptq"
    description = "legacy GPTQ checkpoint (qweight/qzeros/scales/g_idx)"
    loads_in = "vLLM (gptq, gptq_marlin), GPTQModel, transformers (with optimum + gptqmodel)"

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.v1 = True  # until a zero point v1 cannot store turns up
        self.v1_qzeros: list[tuple[str, int]] = []  # (qzeros written in v1, bits): rewritten if the checkpoint turns v2
        self.desc_act = False

    @classmethod
    def check(cls, source, recipe, options):
        refuse_common(cls.target, recipe, options)
        for s in recipe.schemes:
            w = s.weights
            if w.num_bits not in GPTQ_BITS:
                raise UsageError(f"the gptq target stores int4 or int8 weights, not int{w.num_bits}",
                                 "use num_bits 4 or 8, or --target vllm")
        experts = expert_overrides(source, recipe)
        if experts:  # no fix of our own: the targets that accept the recipe are named by qtk.export.check_targets
            raise UsageError(f"recipe {recipe.name}: overrides give MoE experts their own scheme ({experts[0]}); qtk writes "
                             "GPTQ `dynamic` overrides for dense Linears only (the engines run a layer's experts as one "
                             "fused kernel with one bit width)")
        return common_notes(cls.target, source, recipe)

    def encode(self, mod: str, qt: QTensor) -> dict[str, torch.Tensor]:
        bits = qt.scheme.num_bits
        out_f, in_f = qt.shape
        per = 32 // bits
        check_divisible(mod, in_f, per, "in_features", self.target)
        check_divisible(mod, out_f, per, "out_features", self.target)
        if not codec.acts_in_order(qt):
            self.desc_act = True
        if self.v1 and codec.needs_v2(qt):
            self.v1 = False
            self.notes.append("a zero point of 0 (unsigned) cannot be stored in GPTQ v1 (it stores z - 1): wrote "
                              "checkpoint_format gptq_v2, which GPTQModel and vLLM with gptq_v2 support load; older "
                              "loaders misread it as v1")
        out = codec.encode(qt, self.v1, lambda scale: self.fp16(scale, mod))
        if self.v1:
            self.v1_qzeros.append((f"{mod}.qzeros", bits))
        return out

    def _rewrite_qzeros_v2(self, weight_map: dict[str, str]) -> None:
        """Re-encode the qzeros written before the switch (z - 1 -> z), in place: same bytes, same size."""
        for name, bits in self.v1_qzeros:
            path = self.dir / weight_map[name]
            f = SafetensorsFile(path)
            v2 = codec.rewrite_v1_qzeros(f.get_tensor(name), bits)
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

    def dynamic_rules(self) -> dict[str, dict]:
        """GPTQModel `dynamic` rules: "-:" excludes each ignored module; "+:" gives the modules of each scheme other
        than the default its bits, group_size and sym."""
        rules = {f"-:^{re.escape(m)}$": {} for m in sorted(set(self.ignored))}
        default = self.recipe.weights
        for scheme, modules in self.schemes.items():
            if scheme == default:
                continue
            names, regexes = override_patterns(modules, self.source.arch)
            alternatives = [f"^{re.escape(n)}$" for n in names] + regexes
            rules[f"+:(?:{'|'.join(alternatives)})"] = {
                "bits": scheme.num_bits, "group_size": scheme.group_size if scheme.strategy == Strategy.GROUP else -1,
                "sym": scheme.symmetric}
        return rules

    def quantization_config(self) -> dict:
        from qtk import __version__
        from qtk.recipe.params import GPTQParams

        r, w = self.recipe, self.recipe.weights
        step = r.step("gptq")
        params = step.params if step is not None else GPTQParams()
        cfg = {
            "quant_method": "gptq",
            "bits": w.num_bits,
            "group_size": w.group_size if w.strategy == Strategy.GROUP else -1,
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
        rules = self.dynamic_rules()
        if rules:
            # GPTQModel and vLLM: `dynamic` "-:" rules exclude modules, "+:" rules override bits / group_size / sym
            # (re.match on the module name, first rule wins)
            cfg["dynamic"] = rules
        if self.ignored:
            # optimum (transformers) and vLLM: the quantized modules, matched as name suffix / substring
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
        cfg = read_json(path / "config.json", MAX_CONFIG_BYTES)
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(qc, dict):
            return qc if str(qc.get("quant_method", "")).lower() == method else None
        for name in ("quantize_config.json", "quant_config.json"):
            p = path / name
            if p.is_file():
                qc = read_json(p, MAX_CONFIG_BYTES)
                if isinstance(qc, dict) and str(qc.get("quant_method", method)).lower() == method:
                    return qc
    except (OSError, ValueError):  # JSONDecodeError, too large, nested past the parser's stack
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
        try:
            cfg = read_json(self.path / "config.json", MAX_CONFIG_BYTES)
        except (OSError, ValueError) as e:
            raise self._broken(f"config.json cannot be read ({' '.join(str(e).split())[:160]})") from None
        cfg.pop("quantization_config", None)
        self.hf_config = cfg
        self.qconfig = _quant_config(self.path, self.METHOD) or {}
        self.dtype = _model_dtype(cfg)

    def modules(self) -> list[str]:
        return sorted(n[: -len(".qweight")] for n in self.tensor_names() if n.endswith(".qweight"))

    def dense_names(self) -> list[str]:
        qmods = set(self.modules())
        out = []
        for n in self.tensor_names():
            base, _, suffix = n.rpartition(".")
            if not (base in qmods and suffix in self.SUFFIXES):
                out.append(n)
        return out


def _gptq_scheme(bits: int, group_size: int, sym: bool) -> QuantScheme:
    s = QuantScheme(num_bits=bits, type="int", symmetric=sym, strategy="group" if group_size > 0 else "channel",
                    group_size=group_size if group_size > 0 else None)
    return config_scheme(s, where="GPTQ quantization config").weights


@register_reader
class GPTQCheckpoint(LegacyCheckpoint):
    """Returns QTensors in qtk's signed convention (qtk.export.codecs.gptq). Each module's scheme: the first
    `dynamic` "+:" rule whose regex re.match-es its name overrides the top-level bits / group_size / sym."""

    format = "gptq"
    METHOD = "gptq"
    SUFFIXES = codec.SUFFIXES

    def __init__(self, path: Path):
        super().__init__(path)
        fmt = str(self.qconfig.get("checkpoint_format") or self.qconfig.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UsageError(f"{path}: GPTQ checkpoint_format '{fmt}' is not one qtk reads",
                             "qtk reads checkpoint_format gptq (v1) and gptq_v2")
        self.v1 = fmt == "gptq"
        self.bits = int(self.qconfig["bits"])
        gs = int(self.qconfig.get("group_size", -1))
        self.weights_scheme = _gptq_scheme(self.bits, gs, bool(self.qconfig.get("sym", True)))
        self.overrides = [(p[2:] if p.startswith("+:") else p, rule) for p, rule in (self.qconfig.get("dynamic") or {}).items()
                          if not p.startswith("-:")]

    def ignore_patterns(self) -> list[str]:
        out = [] if self.qconfig.get("lm_head") else ["lm_head"]
        for pattern in self.qconfig.get("dynamic") or {}:
            if pattern.startswith("-:"):  # re.match semantics: anchored at the start only
                out.append(f"re:(?:{pattern[2:]}).*")
        return out

    def scheme_for(self, module: str) -> ModuleScheme | None:
        if module not in self._module_set:
            return None
        base = self.weights_scheme
        for pattern, rule in self.overrides:
            if bounded_match(pattern, module):  # a checkpoint's pattern: under a time budget
                gs = int(rule.get("group_size", base.group_size or -1))
                return ModuleScheme(_gptq_scheme(int(rule.get("bits", base.num_bits)), gs, bool(rule.get("sym", base.symmetric))))
        return ModuleScheme(base)

    def check_module(self, module: str, shape: tuple[int, int]) -> list[str]:
        out_f, in_f = shape
        s = self.scheme_for(module).weights
        per = 32 // s.num_bits if s.num_bits in (2, 4, 8) else 0
        groups = -(-in_f // s.group_size) if s.strategy == Strategy.GROUP else 1
        problems: list[str] = []
        expect_tensor(self, f"{module}.qweight", torch.int32, [in_f // per if per else -1, out_f], problems)
        expect_tensor(self, f"{module}.qzeros", torch.int32, [groups, out_f // per if per else -1], problems)
        expect_tensor(self, f"{module}.scales", FLOATS, [groups, out_f], problems, f" (group_size {s.group_size or -1})")
        if self.has(f"{module}.g_idx"):
            expect_tensor(self, f"{module}.g_idx", (torch.int32, torch.int64), [in_f], problems)
        return problems

    def qtensor(self, module: str) -> QTensor:
        return codec.decode(self.tensors(module), self.scheme_for(module).weights, self.v1, where=f"{self.path}: {module}")
