"""The TensorRT-LLM reader: a checkpoint read back in Hugging Face names — ranks merged (each tensor along the axes
qtk.export.codecs.trtllm gives its key), qkv split into q, k, v, TensorRT-LLM names mapped back through the
architecture table — and each Linear decoded as the engine decodes its algorithm (for MIXED_PRECISION, the algorithm
quant_cfg.json gives its module)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader
from qtk.export.checkpoint import Checkpoint, read_json
from qtk.export.codecs.trtllm import PLAIN_ALGOS, axes, decode, layout, w4a8_range_problem
from qtk.export.trtllm.algo import MIXED, LayerAlgo, algo_scheme
from qtk.export.trtllm.sharding import COLUMN, QKV, ROW
from qtk.export.trtllm.writer import EXTRA_LAYER_NAMES
from qtk.model.arch import DOWN, FAMILIES, HF_CLASS_TO_MODEL_TYPE, K, O, Q, TRTLLM_MODEL_TYPES, V, Geometry, arch_for
from qtk.model.config_check import MAX_CONFIG_BYTES
from qtk.quant.formats import format_for
from qtk.quant.qtensor import QTensor
from qtk.recipe.rules import ModuleScheme


@register_reader
class TRTLLMCheckpoint(Checkpoint):
    """A TensorRT-LLM checkpoint read back in Hugging Face names: ranks merged, qkv split, TRT names mapped back."""

    format = "trtllm"

    @staticmethod
    def detect(path: Path) -> bool:
        p = path / "config.json"
        if not (p.is_file() and (path / "rank0.safetensors").is_file()):
            return False
        try:
            cfg = read_json(p, MAX_CONFIG_BYTES)
        except (OSError, ValueError):  # not JSON, too large, nested past the parser's stack
            return False
        return isinstance(cfg, dict) and "architecture" in cfg and "mapping" in cfg

    def __init__(self, path: Path):
        super().__init__(path)
        try:
            self.trt = read_json(self.path / "config.json", MAX_CONFIG_BYTES)
        except (OSError, ValueError) as e:
            raise self._broken(f"config.json cannot be read ({' '.join(str(e).split())[:160]})") from None
        arch_name = self.trt["architecture"]
        mt = self.trt.get("qwen_type") or HF_CLASS_TO_MODEL_TYPE.get(arch_name)
        if mt not in TRTLLM_MODEL_TYPES:
            raise UsageError(f"{path}: qtk reads TensorRT-LLM checkpoints of {', '.join(HF_CLASS_TO_MODEL_TYPE)}, not {arch_name}",
                             "inspect it with TensorRT-LLM's own tools")
        self.arch = arch_for(mt)
        self.geo = Geometry.of(self.trt)
        m = self.trt.get("mapping") or {}
        self.tp, self.pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
        self.layers_per_stage = self.geo.layers // self.pp
        q = self.trt.get("quantization") or {}
        self.quant_algo = q.get("quant_algo")
        self.exclude = list(q.get("exclude_modules") or [])
        # MIXED_PRECISION: each module's algorithm from quant_cfg.json (first fnmatch-ing pattern, as TensorRT-LLM)
        self.layer_algos: dict[str, LayerAlgo] = {}
        if self.quant_algo == MIXED:
            try:
                layers = read_json(self.path / "quant_cfg.json", MAX_CONFIG_BYTES)["quantized_layers"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise self._broken(f"quant_cfg.json cannot be read ({e.__class__.__name__})") from None
            self.layer_algos = {name: LayerAlgo(c["quant_algo"], c.get("group_size")) for name, c in layers.items()}
            first = next(iter(self.layer_algos.values()), LayerAlgo("W8A16"))
            default = algo_scheme(first.algo, first.group_size)
            for a in self.layer_algos.values():
                algo_scheme(a.algo, a.group_size)  # every algorithm one qtk reads
        else:
            default = algo_scheme(self.quant_algo, q.get("group_size"))
        self.weights_scheme, self.activations = default.weights, default.activations
        self.kv_cache = {"INT8": "int8", "FP8": "fp8"}.get(q.get("kv_cache_quant_algo"))
        self.kv_scale_floor = 1.0 if self.kv_cache == "fp8" else None  # FP8 KV factors are clamped to >= 1.0
        self.dtype = getattr(torch, self.trt.get("dtype", "bfloat16"))
        self._rank_files: dict[int, object] = {}
        self._keys: dict[int, set[str]] = {}
        self._merged: dict = {}
        missing = [r for r in range(self.tp * self.pp) if not (self.path / f"rank{r}.safetensors").is_file()]
        if missing:
            raise UsageError(f"{path}: mapping says {self.tp * self.pp} ranks but rank files {missing} are missing", "re-run qtk convert")
        self.hf_config = self._hf_config(mt)

    def _hf_config(self, mt: str) -> dict:
        t, g = self.trt, self.geo
        rope = {"rope_type": "default", "rope_theta": float(t.get("rotary_base", 10000.0))}
        scaling = t.get("rotary_scaling")
        if scaling:
            rope.update({k: v for k, v in scaling.items() if k != "type"})
            rope["rope_type"] = scaling.get("rope_type") or scaling.get("type")
        hf = {"model_type": mt, "architectures": [FAMILIES[mt].hf_class],
              "vocab_size": g.vocab, "hidden_size": g.hidden, "intermediate_size": g.intermediate,
              "num_hidden_layers": g.layers, "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads,
              "head_dim": g.head_dim, "hidden_act": t.get("hidden_act", "silu"),
              "max_position_embeddings": t.get("max_position_embeddings") or 2048,
              "rms_norm_eps": t.get("norm_epsilon", 1e-6), "rope_parameters": rope,
              "tie_word_embeddings": self._tied(), "dtype": t.get("dtype", "bfloat16")}
        if mt in ("llama", "mistral"):
            hf["attention_bias"] = bool(t.get("attn_bias", False))
            hf["mlp_bias"] = bool(t.get("mlp_bias", False))
        return hf

    # ---- raw access
    def _file(self, rank: int):
        h = self._rank_files.get(rank)
        if h is None:
            h = self._rank_files[rank] = self._open(self.path / f"rank{rank}.safetensors")
        return h

    def _get(self, rank: int, name: str) -> torch.Tensor:
        if name not in self._names(rank):
            raise self._broken(f"tensor {name} is missing from rank{rank}.safetensors")
        try:
            return self._file(rank).get_tensor(name)
        except (ValueError, OSError) as e:
            raise self._broken(f"tensor {name} cannot be read from rank{rank}.safetensors ({e})") from None

    def _names(self, rank: int) -> set[str]:
        if rank not in self._keys:
            self._keys[rank] = set(self._file(rank).keys())
        return self._keys[rank]

    def _has(self, rank: int, name: str) -> bool:
        return name in self._names(rank)

    def _stage(self, layer: int) -> tuple[list[int], str]:
        stage, local = divmod(layer, self.layers_per_stage)
        return list(range(stage * self.tp, (stage + 1) * self.tp)), f"transformer.layers.{local}."

    def size_bytes(self) -> int:
        return sum((self.path / f"rank{r}.safetensors").stat().st_size for r in range(self.tp * self.pp))

    def _tied(self) -> bool:
        return not self._has((self.pp - 1) * self.tp, "lm_head.weight")

    # ---- merging ranks
    def _module(self, layer: int, trt_name: str) -> list[dict[str, torch.Tensor]]:
        """A TensorRT-LLM module of `layer` merged over its tensor-parallel ranks; qkv returned as [q, k, v]."""
        key_ = (layer, trt_name)
        if key_ in self._merged:
            return self._merged[key_]
        ranks, prefix = self._stage(layer)
        base = f"{prefix}{trt_name}."
        keys = [k[len(base):] for k in sorted(self._names(ranks[0])) if k.startswith(base)]
        g, tp = self.geo, self.tp
        parallel = ROW if trt_name in (self.arch.trtllm_names[O], self.arch.trtllm_names[DOWN]) else COLUMN
        n_comp = 3 if trt_name == QKV else 1
        comps: list[dict[str, torch.Tensor]] = [{} for _ in range(n_comp)]
        for key in keys:
            pieces = [self._get(r, base + key) for r in ranks]
            out_axis, in_axis = axes(key, list(pieces[0].shape))
            axis = out_axis if parallel == COLUMN else in_axis
            if n_comp == 1 or out_axis is None:
                t = pieces[0] if axis is None else torch.cat(pieces, dim=axis)
                for c in comps:
                    c[key] = t
                continue
            # each rank holds [q_r, k_r, v_r] along out_axis, in proportion heads_r : kv_r : kv_r
            h_r, kv_r = g.heads // tp, g.kv_per_rank(tp)
            size = pieces[0].shape[out_axis]
            unit = size // (h_r + 2 * kv_r)
            split = [p.split([h_r * unit, kv_r * unit, kv_r * unit], dim=out_axis) for p in pieces]
            reps = tp // g.kv_heads if g.kv_heads < tp else 1
            for ci in range(3):
                chosen = [s[ci] for s in split] if ci == 0 else [s[ci] for s in split[::reps]]
                comps[ci][key] = torch.cat(chosen, dim=out_axis)
        if len(self._merged) >= 4:  # a layer's q, k, v are asked for close together: keep a few modules
            self._merged.pop(next(iter(self._merged)))
        self._merged[key_] = comps
        return comps

    def _trt_of(self, module: str) -> tuple[int, str, int]:
        """HF module name -> (layer, TRT module, component index)."""
        rest = module[len(self.arch.layers) + 1:]
        i, _, lin = rest.partition(".")
        if lin in (Q, K, V):
            return int(i), QKV, (Q, K, V).index(lin)
        return int(i), self.arch.trtllm_names[lin], 0

    def _excluded(self, layer: int, trt_name: str) -> bool:
        name = f"transformer.layers.{layer}.{trt_name}"
        return any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def _algo(self, layer: int, trt_name: str) -> LayerAlgo | None:
        """The algorithm of a TensorRT-LLM module (None: quant_cfg.json names it not, so it is not quantized)."""
        if self.quant_algo != MIXED:
            return LayerAlgo(self.quant_algo, self.weights_scheme.group_size)
        name = f"transformer.layers.{layer}.{trt_name}"
        return next((a for p, a in self.layer_algos.items() if fnmatch.fnmatch(name, p)), None)

    def _is_quantized(self, layer: int, trt_name: str) -> bool:
        a = self._algo(layer, trt_name)
        if a is None:
            return False
        if a.algo in PLAIN_ALGOS:
            return not self._excluded(layer, trt_name)
        ranks, prefix = self._stage(layer)
        names = self._names(ranks[0])
        return any(f"{prefix}{trt_name}.{k}" in names for k in ("weights_scaling_factor", "per_channel_scale"))

    def scheme_for(self, module: str) -> ModuleScheme | None:
        if module not in self._module_set:
            return None
        layer, trt, _ = self._trt_of(module)
        a = self._algo(layer, trt)
        return algo_scheme(a.algo, a.group_size)

    # ---- Checkpoint API
    def ignore_patterns(self) -> list[str]:
        if self.quant_algo == MIXED:  # a module quant_cfg.json does not name is not quantized
            return ["lm_head"] + [f"{self.arch.layers}.{i}.{lin}" for i in range(self.geo.layers) for lin in self.arch.linears
                                  if self._algo(i, self._trt_of(f"{self.arch.layers}.{i}.{lin}")[1]) is None]
        out = []
        for p in self.exclude:
            m = re.fullmatch(r"transformer\.layers\.(\d+)\.(.+)", p)
            if p == "lm_head":
                out.append(p)
            elif m:
                hf = (Q, K, V) if m.group(2) == QKV else [h for h, t in self.arch.trtllm_names.items() if t == m.group(2)]
                out += [f"{self.arch.layers}.{m.group(1)}.{h}" for h in hf]
        return out

    def modules(self) -> list[str]:
        out = []
        for i in range(self.geo.layers):
            for lin in self.arch.linears:
                trt = QKV if lin in (Q, K, V) else self.arch.trtllm_names[lin]
                if self._is_quantized(i, trt):
                    out.append(f"{self.arch.layers}.{i}.{lin}")
        return sorted(out)

    def check_module(self, module: str, shape: tuple[int, int]) -> list[str]:
        """The merged tensors of `module` against what its quant_algo stores (docs/formats.md, TensorRT-LLM)."""
        layer, trt, ci = self._trt_of(module)
        t = self._module(layer, trt)[ci]
        out_f, in_f = shape
        a = self._algo(layer, trt)
        algo, problems = a.algo, []
        want = layout(algo, out_f, in_f, self.scheme_for(module).weights.group_size, self.dtype)
        name = f"transformer.layers.{layer}.{trt}"
        for key, (dtypes, sh) in want.items():
            x = t.get(key)
            if x is None:
                problems.append(f"{name}.{key} is missing ({algo})")
            elif x.dtype not in dtypes:
                problems.append(f"{name}.{key} is stored as {str(x.dtype).replace('torch.', '')}, {algo} needs "
                                f"{' or '.join(str(d).replace('torch.', '') for d in dtypes)}")
            elif list(x.shape) != sh and not (key.endswith("scaling_factor") and sh == [1] and x.numel() == 1):
                problems.append(f"{name}.{key} (merged over ranks) has shape {list(x.shape)}, expected {sh} for {module}")
        if algo == "W4A8_AWQ" and not problems:
            p = w4a8_range_problem(self.qtensor(module), t["weights_scaling_factor_2"], f"{name} ({module})")
            problems += [p] if p else []
        return problems

    def written_weight(self, module: str, qt: QTensor | None = None) -> torch.Tensor:
        layer, trt, ci = self._trt_of(module)
        if self._algo(layer, trt).algo in PLAIN_ALGOS:  # the plain weights as stored; the engine re-quantizes them (qtensor)
            return self._module(layer, trt)[ci]["weight"].float()
        return super().written_weight(module, qt)

    def kv_tensor_names(self, layer: int) -> str:
        ranks, prefix = self._stage(layer)
        return f"rank{ranks[0]}: {prefix}attention.kv_cache_scaling_factor"

    def qtensor(self, module: str) -> QTensor:
        layer, trt, ci = self._trt_of(module)
        return decode(self._algo(layer, trt).algo, self._module(layer, trt)[ci], self.scheme_for(module).weights,
                      self.dtype, where=module)

    def input_scale(self, module: str) -> torch.Tensor | None:
        scheme = self.scheme_for(module)
        if scheme is None or not scheme.static_activations:
            return None
        layer, trt, ci = self._trt_of(module)
        t = self._module(layer, trt)[ci].get("activation_scaling_factor")
        if t is None:
            return None
        # a scale that multiplies (NVFP4's global scale) is stored as its inverse (amax/2688), as ModelOpt writes it
        return 1.0 / t.float().reshape(1) if format_for(scheme.activations).input_scale_multiplies else t.float().reshape(1)

    def kv_scales(self, layer: int) -> tuple[float, float] | None:
        """TensorRT-LLM scales K and V with one factor (max of k and v): the cache holds round(x / s)."""
        ranks, prefix = self._stage(layer)
        f, names = self._file(ranks[0]), self._names(ranks[0])
        kv = f"{prefix}attention.kv_cache_scaling_factor"
        k, v = f"{prefix}attention.k_cache_scaling_factor", f"{prefix}attention.v_cache_scaling_factor"
        if k in names and v in names:  # TensorRT-LLM merges these into kv itself (max) when present
            s = max(float(self._get(ranks[0], k).reshape(-1)[0]), float(self._get(ranks[0], v).reshape(-1)[0]))
        elif kv in names:
            s = float(self._get(ranks[0], kv).reshape(-1)[0])
        else:
            return None
        return s, s

    def iter_dense(self):
        a, g = self.arch, self.geo
        first, last = 0, self.pp - 1

        def vocab(name: str, stage: int) -> torch.Tensor:
            ranks = range(stage * self.tp, (stage + 1) * self.tp)
            return torch.cat([self._get(r, name) for r in ranks], dim=0)[: g.vocab]

        yield f"{a.embed}.weight", vocab("transformer.vocab_embedding.weight", first)
        if not self._tied():
            yield f"{a.lm_head}.weight", vocab("lm_head.weight", last)
        yield f"{a.final_norm}.weight", self._get(last * self.tp, "transformer.ln_f.weight")
        back = {v: k for k, v in a.trtllm_names.items() if k in ("input_layernorm", "post_attention_layernorm")}
        back.update({v: k for k, v in EXTRA_LAYER_NAMES.items()})
        for i in range(g.layers):
            ranks, prefix = self._stage(i)
            hf = f"{a.layers}.{i}."
            names = self._names(ranks[0])
            for trt, h in back.items():
                if f"{prefix}{trt}.weight" in names:
                    yield f"{hf}{h}.weight", self._get(ranks[0], f"{prefix}{trt}.weight")
            for lin in a.linears:
                _, trt, ci = self._trt_of(hf + lin)
                quantized = self._is_quantized(i, trt)
                if quantized and f"{prefix}{trt}.bias" not in names:
                    continue
                t = self._module(i, trt)[ci]
                if "bias" in t:
                    yield f"{hf}{lin}.bias", t["bias"]
                if not quantized:
                    yield f"{hf}{lin}.weight", t["weight"]
