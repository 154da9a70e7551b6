"""vLLM target: a compressed-tensors checkpoint (docs/formats.md, vllm), and its reader.

int-quantized (W8A8 int8, and W4A8-INT8: int4 codes in int8, as llm-compressor's W4A8 writes it and vLLM's
CompressedTensorsW4A8Int loads it), float-quantized (FP8) or pack-quantized (weight-only int4/int8, W4A8-FP8), per module (the layouts
are qtk.export.codecs.ct's). The KV cache is FP8 with k_scale = amax(K after RoPE)/448 and v_scale = amax(V)/448:
vLLM has no INT8 KV cache with checkpoint scales, so an 8-bit int KV recipe becomes FP8 KV here (and the output says
so).

Mixed precision: group_0 holds the recipe's default scheme with targets ["Linear"]; each other scheme gets a group
whose targets name exactly the modules it covers. Both clients resolve a module by exact name before regexes before
the class name "Linear" (compressed-tensors utils/match.py match_targets; vLLM compressed_tensors/utils.py
find_matched_target), so no precedence depends on the order of rules. vLLM loads q/k/v and gate/up as one fused
module, looked up by its own name (qkv_proj) before the class name: an override group names each such group with one
anchored regex that matches its members and the fused name. Each group carries its own `format`; the top-level
format is "mixed-precision" when the groups' formats differ (as compressed-tensors writes it).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qtk.bounds import match as bounded_match
from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.base import Writer, expert_overrides, override_patterns
from qtk.export.checkpoint import Checkpoint, config_scheme, expect_tensor
from qtk.export.codecs import ct, ct_transform
from qtk.io.safetensors import ShardedWriter
from qtk.plan.serving import kernel_family
from qtk.quant.formats import format_for
from qtk.quant.formats.base import StoredView, check_input_scale
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import FP8_MAX, LOCAL, QuantScheme, Strategy
from qtk.recipe.rules import ModuleScheme, matches

KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
             "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
MIXED = "mixed-precision"


def ct_version() -> str:
    """The compressed-tensors version the config declares (read from metadata: importing it costs seconds)."""
    import importlib.metadata as md

    try:
        return md.version("compressed-tensors")
    except md.PackageNotFoundError:
        return "0.20.0"


def ct_args(s: QuantScheme, actorder: str | None = None, fmt: str | None = None) -> dict:
    """compressed-tensors QuantizationArgs keys for a scheme (only those it accepts). actorder: "weight" for GPTQ's
    static activation ordering (the only one compressed-tensors 0.20 accepts), else None. fmt: the group's format,
    which decides a scale_dtype (NVFP4's fp8, MX's uint8 E8M0)."""
    out = {
        "num_bits": s.num_bits,
        "type": s.type,
        "symmetric": s.symmetric,
        "group_size": s.group_size,
        "strategy": s.strategy,
        "block_structure": list(s.block_structure) if s.block_structure else None,
        "dynamic": s.dynamic,
        "actorder": actorder,
        "observer": None if s.dynamic is True else ("mse" if s.observer == "mse" else "minmax"),
        "observer_kwargs": {},
    }
    scale_dtype = None if fmt is None else ct.scale_dtype(fmt)
    if scale_dtype is not None:
        out["scale_dtype"] = scale_dtype
    return out


def kv_scale(amax: float) -> torch.Tensor:
    """FP8 KV scale: the cache holds fp8(x / scale), so scale = amax / 448 (never 0)."""
    return torch.tensor([max(amax / FP8_MAX, torch.finfo(torch.float32).tiny)], dtype=torch.float32)


@register_writer
class VLLMWriter(Writer):
    target = "vllm"
    description = "compressed-tensors checkpoint"
    loads_in = "vLLM (`vllm serve DIR`), transformers + compressed-tensors"
    multimodal = True
    online_transforms = True  # compressed-tensors transform_config: vLLM applies input rotations at run time

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        self.format = ct.ct_format(recipe.default_scheme)
        n_expected = len(source.weight_map) * 4 + 2 * source.num_layers + 16
        self.shards = ShardedWriter(self.dir, options.max_shard_bytes, n_expected)
        self.ignored: list[str] = [source.arch.lm_head]  # also when tied: it is a Linear the config must exclude
        moe = source.arch.moe
        # routers stay dense; excluded by pattern, as llm-compressor writes it
        self.routers: list[str] = [] if moe is None else [f"re:.*{moe.block}\\.{moe.router}$"]
        # a vision-language model's vision tower and projector stay in 16 bits: excluded by pattern, as llm-compressor
        # writes it, which matches transformers' names and vLLM's alike
        self.routers += [f"re:.*{re.escape(m.rpartition('.')[2])}.*" for m in source.arch.multimodal]
        self.groups: dict[ModuleScheme, list[str]] = {}  # modules per scheme, as written
        self.online: list[str] = []  # modules whose input the engine rotates (qtk.steps.rotate_online)
        self.online_rotation: dict | None = None  # its RepeatedRotation JSON: one for the model, as vLLM keeps one
        self.online_full = True  # the matrix is each rotated module's whole input (no head_dim in the config)

    @classmethod
    def check(cls, source, recipe, options):
        if recipe.writes_g_idx:  # compressed-tensors 0.20 rejects actorder "group" (and weight_g_idx) outright
            raise UsageError(f"recipe {recipe.name}: GPTQ actorder group needs a g_idx, which compressed-tensors "
                             "(and so --target vllm) no longer accepts",
                             "set gptq actorder: static (same ordering, static groups, no g_idx), or use --target gptq")
        static_w4a8 = [s for s in recipe.schemes if kernel_family(s) == "W4A8-FP8" and not s.activations.dynamic]
        if static_w4a8:  # no fix of our own: the targets that accept the recipe are named by check_targets
            raise UsageError(f"recipe {recipe.name}: vLLM runs W4A8-FP8 (CompressedTensorsW4A8Fp8) with dynamic per-token "
                             "FP8 activations only, not static per-tensor ones")
        moe = source.arch.moe
        experts = expert_overrides(source, recipe)
        if experts:
            raise UsageError(f"recipe {recipe.name}: overrides give MoE experts their own scheme ({experts[0]}), but vLLM "
                             "runs each layer's experts as one fused kernel with one scheme, looked up by expert 0's "
                             "names only (compressed_tensors_moe.py get_moe_method)",
                             "keep experts at the default scheme: target attention Linears only in overrides")
        if any(s.weights.strategy == Strategy.BLOCK for s in recipe.schemes):
            from qtk.pipeline.targets import check_fp8_blocks

            check_fp8_blocks(source, recipe, options.tp)  # what vLLM runs at the tp it will be served with
        notes = []
        if options.tp != 1 or options.pp != 1:
            notes.append(f"--tp {options.tp} --pp {options.pp} applies to the trtllm target; vLLM shards at load time "
                         f"(serve with --tensor-parallel-size {options.tp})")
        if moe is not None and not moe.vllm_reads_per_expert:
            notes.append(f"vLLM's {source.arch.name} loader (0.32) reads quantized experts only in its own layouts (MXFP4, "
                         "quark's fused tensors, its per-expert w13/w2 names), not as the per-expert Linears written here "
                         "(llm-compressor's layout, which transformers + compressed-tensors decodes): vLLM refuses to load "
                         "this checkpoint (tests/engine/test_engine_moe_families.py)")
        if moe is not None and not all(s.weights.symmetric for s in recipe.schemes):
            notes.append("asymmetric MoE experts (zero points) load only in vLLM versions whose compressed-tensors MoE "
                         "path supports zero points (older ones accept symmetric experts only); for those use a "
                         "symmetric recipe such as w4a16-gptq")
        if recipe.mixed:
            notes.append("mixed precision: in transformers load it on the default path (from_pretrained without a "
                         "quantization_config): transformers' CompressedTensorsConfig(dequantize=True) decodes every "
                         "dense Linear with the first config group's scheme")
        if any(kernel_family(s) == "W4A8-INT8" for s in recipe.schemes):
            notes.append("W4A8-INT8 (int-quantized, vLLM's CompressedTensorsW4A8Int) runs with INT8 activations on CPUs "
                         "(Arm KleidiAI) and Intel XPUs; vLLM's NVIDIA kernels have no INT8-activation path for it "
                         "(serve w4a8-fp8 on Hopper, w4a16-gptq elsewhere)")
        if recipe.kv_cache is not None and recipe.kv_cache.type != "float":
            notes.append("vLLM has no INT8 KV cache with checkpoint scales: wrote FP8 KV scales (amax/448); "
                         "serve with --kv-cache-dtype fp8")
        return notes

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.shards.add(name, tensor)

    def add_layer(self, r) -> None:
        dtype = self.source.dtype
        for mod, qt in r.qweights.items():
            scheme = self.module_scheme(mod, qt)
            for k, t in ct.encode(qt, dtype, ct.ct_format(scheme)).items():
                self.shards.add(f"{mod}.{k}", t)
            if mod in r.input_amax and scheme.static_activations:
                from qtk.quant.qparams import static_scale

                self.shards.add(f"{mod}.{ct.input_scale_key(scheme)}", static_scale(r.input_amax[mod], scheme.activations))
            self.groups.setdefault(scheme, []).append(mod)
        for name, t in r.dense.items():
            self.shards.add(name, t)
        self._add_online(r)
        self.ignored.extend(m for m in r.dense_linears if not matches(m, self.routers))
        if r.k_amax is not None:
            attn = f"{self.source.layer_prefix(r.index)}{self.source.arch.attn}"
            self.shards.add(f"{attn}.k_scale", kv_scale(r.k_amax))
            self.shards.add(f"{attn}.v_scale", kv_scale(r.v_amax))

    def _add_online(self, r) -> None:
        """The online rotation's matrix beside each module it applies to (the same ±1 matrix in every layer: vLLM
        loads them into one shared tensor)."""
        rec = r.records.get("rotate_online")
        if rec is None or not rec.modules:
            return
        from qtk.quant.hadamard import RepeatedRotation

        if self.online_rotation not in (None, rec.rotation):  # every layer's step builds it from the same params
            raise AssertionError(f"layer {r.index}: online rotation {rec.rotation} differs from {self.online_rotation}")
        self.online_rotation = rec.rotation
        rot = RepeatedRotation.from_json(rec.rotation)
        stored = rot.unit().stored(self.source.dtype)
        group = ct_transform.group_for(rec.modules)
        for rel in rec.modules:
            mod = f"{self.source.layer_prefix(r.index)}{rel}"
            self.shards.add(ct_transform.tensor_name(mod, group), stored)
            self.online.append(mod)
            self.online_full = self.online_full and self.source.shape(f"{mod}.weight")[1] == rot.block

    def config_group(self, scheme: ModuleScheme, targets: list[str]) -> dict:
        # GPTQ's static act-order changes only how the values were chosen: "weight" records it, nothing to decode
        actorder = "weight" if self.recipe.gptq_actorder is not None else None
        fmt = ct.ct_format(scheme)
        return {"targets": targets, "weights": ct_args(scheme.weights, actorder, fmt),
                "input_activations": ct_args(scheme.activations, None, fmt) if scheme.activations else None,
                "output_activations": None, "format": fmt}

    def quantization_config(self) -> dict:
        r = self.recipe
        groups = {"group_0": self.config_group(r.default_scheme, ["Linear"])}
        for scheme, modules in self.groups.items():
            if scheme != r.default_scheme:
                names, regexes = override_patterns(modules, self.source.arch)
                groups[f"group_{len(groups)}"] = self.config_group(scheme, names + [f"re:{x}" for x in regexes])
        formats = {g["format"] for g in groups.values()}
        return {
            "quant_method": "compressed-tensors",
            "format": formats.pop() if len(formats) == 1 else MIXED,
            "quantization_status": "compressed",
            "version": ct_version(),
            "config_groups": groups,
            "ignore": sorted({*self.ignored, *self.routers}),
            "kv_cache_scheme": dict(KV_SCHEME) if r.kv_cache is not None else None,
            "sparsity_config": {},
            "transform_config": self._transform_config(),
            "global_compression_ratio": None,
        }

    def _transform_config(self) -> dict:
        if not self.online:
            return {}
        block = int(self.online_rotation["block"])
        # head_dim only where the matrix is smaller than some module's input (vLLM then repeats it over the blocks)
        return ct_transform.transform_config(self.online, block, block if self.online_full else 0)

    def finish(self, manifest: dict) -> None:
        self.shards.close()
        self.write_config()
        self.copy_side_files()
        self.write_manifest(manifest)


def _scheme(args: dict | None) -> QuantScheme | None:
    if not args:
        return None
    dynamic = args.get("dynamic", False)
    block = args.get("block_structure")
    return QuantScheme(num_bits=args["num_bits"], type=args.get("type", "int"), symmetric=args.get("symmetric", True),
                       strategy=args.get("strategy") or "tensor", group_size=args.get("group_size"),
                       dynamic=dynamic if dynamic == LOCAL else bool(dynamic),
                       block_structure=tuple(block) if block else None,
                       scale_dtype="e8m0" if args.get("scale_dtype") in ("torch.uint8", "uint8") else None)


QUANT_SUFFIXES = (".weight_scale", ".weight_packed", ".weight_shape", ".weight_zero_point", ".weight_g_idx",
                  ".weight_global_scale", ".input_scale", ".input_global_scale", ".input_zero_point",
                  ".k_scale", ".v_scale")


@register_reader
class CompressedTensorsCheckpoint(Checkpoint):
    """Each module's scheme resolved as compressed-tensors resolves it: the config groups' targets by exact name,
    then by regex (re.match), then by class name ("Linear": every quantized module here). A module that holds
    quantized tensors although `ignore` covers it is decoded all the same: the coverage check reports it."""

    format = "vllm"

    QUANT_METHOD = "compressed-tensors"

    def __init__(self, path: Path):
        super().__init__(path)
        cfg, self.qconfig = self._read_config()
        self.hf_config = cfg
        groups = self.qconfig["config_groups"]
        if not groups:
            raise UsageError(f"{path}: no quantization config groups", "the checkpoint is not quantized; nothing to read")
        top = self.qconfig.get("format")
        # (targets, ModuleScheme, format) per group, in the config's order; a top-level format other than
        # "mixed-precision" is every group's
        self.groups = [(list(g.get("targets") or []),
                        config_scheme(_scheme(g["weights"]), _scheme(g.get("input_activations")),
                                      f"{path}: config group {name}"),
                        top if top and top != MIXED else g.get("format")) for name, g in groups.items()]
        self.ct_format = top if top != MIXED else None  # the format of every group, when they share one
        self.weights_scheme, self.activations = self.groups[0][1].weights, self.groups[0][1].activations
        kv = self.qconfig.get("kv_cache_scheme")
        self.kv_cache = None if not kv else ("fp8" if kv.get("type") == "float" else "int8")
        dt = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        self.dtype = getattr(torch, dt)

    def ignore_patterns(self) -> list[str]:
        return list(self.qconfig.get("ignore") or [])

    def input_transforms(self) -> tuple[dict, list[str]]:
        """module -> its online input transform (qtk.export.codecs.ct_transform.InputTransform) from the config's
        transform_config, and the problems with that config."""
        if not hasattr(self, "_transforms"):
            self._transforms = ct_transform.input_transforms(self.qconfig.get("transform_config"), self.modules())
        return self._transforms

    def transform_tensor(self, module: str, width: int | None = None) -> str | None:
        """The stored matrix of `module`'s input transform (`width`: its input width, for a transform without a
        head_dim): its own tensor, else the one stored beside another module of its group in the same order. vLLM
        keeps one tensor per transform scheme and order for the whole model (SharedWeightParameter, keyed by both),
        loaded from whichever module's name holds it: llm-compressor stores it once. None when neither is stored."""
        t = self.input_transforms()[0].get(module)
        if t is None:
            return None
        if self.has(t.tensor):
            return t.tensor
        order, suffix = t.block or width, t.tensor[len(module):]
        if not hasattr(self, "_shared"):
            self._shared = {}
        if (suffix, order) not in self._shared:
            self._shared[(suffix, order)] = next(
                (n for n in self.tensor_names() if n.endswith(suffix) and (self.meta(n) or (None, []))[1] == [order, order]),
                None)
        return self._shared[(suffix, order)]

    def input_rotation(self, module: str, width: int | None = None):
        """The engine's rotation of `module`'s input (read from its stored matrix, transform_tensor), None without
        one. A declared transform whose matrix is stored nowhere is refused: simulated without it, the module would
        compute something the engine does not."""
        t = self.input_transforms()[0].get(module)
        if t is None:
            return None
        name = self.transform_tensor(module, width)
        if name is None:
            raise UsageError(f"{self.path}: the transform_config applies {t.group} to {module}, but no matrix of its "
                             f"order is stored ({t.tensor} or another module's of {t.group})",
                             "the checkpoint is incomplete: export it again, or check it with qtk inspect")
        return ct_transform.DenseRotation(self.tensor(name), t.inverse)

    def _group_of(self, module: str):
        """(ModuleScheme, format) of a module by compressed-tensors' precedence; None when no target matches."""
        exact = [g for g in self.groups if module in g[0]]
        # a checkpoint's patterns, matched under a time budget (qtk.bounds): its config is untrusted input
        regex = [g for g in self.groups if any(t.startswith("re:") and bounded_match(t[3:], module) for t in g[0])]
        by_class = [g for g in self.groups if "Linear" in g[0]]
        chosen = (exact or regex or by_class or [None])[0]
        return None if chosen is None else (chosen[1], chosen[2] or ct.ct_format(chosen[1]))

    def scheme_for(self, module: str) -> ModuleScheme | None:
        g = self._group_of(module) if module in self._module_set else None
        return None if g is None else g[0]

    def format_of(self, module: str) -> str:
        return self._group_of(module)[1]

    def modules(self) -> list[str]:
        return sorted(n[: -len(".weight_scale")] for n in self.tensor_names() if n.endswith(".weight_scale"))

    def qtensor(self, module: str) -> QTensor:
        scheme = self.scheme_for(module)
        if scheme is None:
            raise UsageError(f"{module} holds quantized tensors but no config group targets it",
                             "the checkpoint does not match its config")
        return ct.decode(self.tensors(module), scheme.weights, self.dtype)

    def check_module(self, module: str, shape: tuple[int, int]) -> list[str]:
        """The module's tensors as its weights' format writes them in the group's format (Format.check_stored), and
        its static input scale when its activations have one."""
        scheme = self.scheme_for(module)
        if scheme is None:
            return [f"{module} holds quantized tensors but no config group targets it"]
        fmt, problem = self.format_of(module), self._contradiction(scheme, self.format_of(module))
        if problem:
            return [f"{module}: {problem}"]
        problems = format_for(scheme.weights).check_stored(_View(self), module, scheme, fmt, shape)
        check_input_scale(_View(self), module, scheme, problems)
        return problems

    @staticmethod
    def _contradiction(scheme: ModuleScheme, fmt: str) -> str | None:
        """Why a config group's format cannot hold its weights scheme, None when it can."""
        s = scheme.weights
        try:
            ok = fmt in format_for(s).ct_formats
        except ValueError:  # a scheme no number format quantizes
            ok = False
        return None if ok else f"config format {fmt} contradicts its weights scheme ({s.describe()})"

    def format_problems(self) -> list[str]:
        out = []
        for _, scheme, fmt in self.groups:
            problem = self._contradiction(scheme, fmt or ct.ct_format(scheme))
            if problem:
                out.append(problem)
        if self.kv_cache is None:
            stray = [n for n in self.tensor_names() if n.endswith((".k_scale", ".v_scale"))]
            if stray:
                out.append(f"{stray[0]} is present but the config declares no kv_cache_scheme")
        return out

    def input_scale(self, module: str) -> torch.Tensor | None:
        scheme = self.scheme_for(module)
        n = f"{module}.{ct.input_scale_key(scheme) if scheme is not None else 'input_scale'}"
        return self.tensor(n).float() if self.has(n) else None

    def kv_tensor_names(self, layer: int) -> str:
        return f"{self.attention(layer)}.k_scale / v_scale"

    def kv_scales(self, layer: int) -> tuple[float, float] | None:
        base = self.attention(layer)
        if not (self.has(f"{base}.k_scale") and self.has(f"{base}.v_scale")):
            return None
        return float(self.tensor(f"{base}.k_scale").reshape(-1)[0]), float(self.tensor(f"{base}.v_scale").reshape(-1)[0])

    def dense_names(self) -> list[str]:
        qmods = set(self.modules())
        transforms = {t.tensor for t in self.input_transforms()[0].values()}
        return [n for n in self.tensor_names()
                if not n.endswith(QUANT_SUFFIXES) and not (n.endswith(".weight") and n[: -len(".weight")] in qmods)
                and n not in transforms]


class _View(StoredView):
    """A checkpoint's stored tensors as a number format checks them."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck

    def has(self, name: str) -> bool:
        return self.ck.has(name)

    def tensor(self, name: str):
        return self.ck.tensor(name)

    def expect(self, name, dtypes, shape, problems, what=""):
        return expect_tensor(self.ck, name, dtypes, shape, problems, what)
