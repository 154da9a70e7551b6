"""TensorRT-LLM target: a `trtllm-build` checkpoint (config.json + rank{N}.safetensors, FORMATS.md §2), and its reader.

Each LayerResult is mapped to TensorRT-LLM names (q/k/v fused into attention.qkv, gate_proj -> mlp.fc,
up_proj -> mlp.gate), split for tensor parallelism and streamed into every rank file at once, so memory
stays O(one layer) for any --tp/--pp. Layouts follow what NVIDIA ModelOpt exports for the same scheme
(tests/trtllm pins them against a ModelOpt-written reference).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.export import register_reader, register_writer
from qtk.export.base import Writer
from qtk.export.checkpoint import Checkpoint
from qtk.model.arch import DOWN, GATE, K, O, Q, UP, V, arch_for
from qtk.quant.qtensor import QTensor
from qtk.recipe import FP8_MAX, QuantScheme

INT8_MAX = 127.0
# TensorRT-LLM's group-wise int4 GEMM (weight_only_groupwise_quant_matmul) is built for these group sizes
AWQ_GROUP_SIZES = (64, 128)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCH_TO_MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                      "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
QKV, COLUMN, ROW = "attention.qkv", "column", "row"
# per-head norms of Qwen3 (not Linears; replicated on every rank)
EXTRA_LAYER_NAMES = {"self_attn.q_norm": "attention.q_layernorm", "self_attn.k_norm": "attention.k_layernorm"}
# weight-only algorithms whose checkpoint holds plain weights: trtllm-build quantizes them per channel
PLAIN_ALGOS = {"W8A16": 8, "W4A16": 4}


# ---------------------------------------------------------------- quant_algo mapping

@dataclass(frozen=True)
class TRTQuant:
    """How a recipe is expressed in a TensorRT-LLM checkpoint."""

    quant_algo: str
    kv_cache_quant_algo: str | None
    group_size: int | None = None
    notes: tuple[str, ...] = ()

    def config(self, exclude: list[str]) -> dict:
        q = {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo}
        if self.quant_algo == "W4A16_AWQ":
            q.update(group_size=self.group_size, has_zero_point=False, pre_quant_scale=True)
        q["exclude_modules"] = exclude
        return q


def trtllm_quant(recipe) -> TRTQuant:
    """The quant_algo for a recipe, or a UsageError naming the fix when TensorRT-LLM cannot express it.

    | weights                 | activations          | quant_algo                           |
    | fp8 tensor              | fp8 tensor static    | FP8                                  |
    | fp8 channel             | fp8 token dynamic    | FP8_PER_CHANNEL_PER_TOKEN            |
    | int8 channel            | int8 tensor static   | W8A8_SQ_PER_CHANNEL                  |
    | int8 channel            | int8 token dynamic   | W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN |
    | int8 channel            | -                    | W8A16 (plain weights)                |
    | int4 channel, symmetric | -                    | W4A16 (plain weights)                |
    | int4 group 64/128, sym  | -                    | W4A16_AWQ (also for RTN and GPTQ)    |
    + kv_cache int8 -> kv_cache_quant_algo INT8, float -> FP8
    """
    w, a, steps = recipe.weights, recipe.activations, recipe.step_names
    where = f"recipe {recipe.name}"
    notes: list[str] = []
    if w.is_fp8:
        if a is None:
            raise UsageError(f"{where}: TensorRT-LLM has no FP8 weight-only checkpoint mode", "add fp8 activations (recipes fp8, fp8-dynamic)")
        if w.strategy == "tensor" and not a.dynamic:
            algo = "FP8"
        elif w.strategy == "channel" and a.dynamic and a.strategy == "token":
            algo = "FP8_PER_CHANNEL_PER_TOKEN"
        else:
            raise UsageError(f"{where}: TensorRT-LLM runs FP8 as per-tensor weights with static activations or per-channel "
                             f"weights with per-token dynamic activations, not {w.describe()} weights with {a.describe()} activations",
                             "use the fp8 or fp8-dynamic recipe")
    elif a is not None:
        if w.num_bits != 8 or w.strategy != "channel":
            raise UsageError(f"{where}: TensorRT-LLM's W8A8 checkpoints need int8 per-channel weights, not {w.describe()}",
                             "set weights: {num_bits: 8, strategy: channel}")
        if a.dynamic and a.strategy == "token":
            algo = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
        elif not a.dynamic:
            algo = "W8A8_SQ_PER_CHANNEL"
        else:
            raise UsageError(f"{where}: TensorRT-LLM quantizes int8 activations per token (dynamic) or per tensor (static), not {a.describe()}",
                             "set activations to {strategy: token, dynamic: true} or {strategy: tensor, dynamic: false}")
    elif w.num_bits == 8:
        if w.strategy != "channel":
            raise UsageError(f"{where}: TensorRT-LLM's int8 weight-only mode (W8A16) is per-channel, not {w.strategy}", "set weights.strategy: channel")
        algo = "W8A16"
    elif w.num_bits == 4:
        if not w.symmetric:
            raise UsageError(f"{where}: TensorRT-LLM's int4 checkpoints (W4A16, W4A16_AWQ) are symmetric; asymmetric int4 has no layout there",
                             "set weights.symmetric: true (or write the asymmetric model with --target vllm)")
        if w.strategy == "channel":
            algo = "W4A16"
        elif w.strategy == "group":
            if w.group_size not in AWQ_GROUP_SIZES:
                raise UsageError(f"{where}: TensorRT-LLM's group-wise int4 kernels take group_size 64 or 128, not {w.group_size}",
                                 "set weights.group_size: 128")
            if recipe.writes_g_idx:
                raise UsageError(f"{where}: TensorRT-LLM's group-wise int4 kernels have no g_idx for GPTQ actorder group",
                                 "set gptq actorder: static (no g_idx)")
            algo = "W4A16_AWQ"
            if "awq" not in steps:
                notes.append(f"TensorRT-LLM: wrote the {'/'.join(steps)} int4 group-{w.group_size} weights as W4A16_AWQ (identity "
                             "pre-quant scale): W4A16_GPTQ checkpoints need CUTLASS-interleaved weights that only TensorRT-LLM's "
                             "own converter produces; both run the same group-wise int4 kernel")
        else:
            raise UsageError(f"{where}: TensorRT-LLM's int4 modes are per-channel or group-wise, not per-tensor", "set weights.strategy: group")
    else:
        raise UsageError(f"{where}: TensorRT-LLM has no int{w.num_bits} weight mode", "use 4- or 8-bit weights")
    if algo in PLAIN_ALGOS:
        notes.append(f"TensorRT-LLM: {algo} checkpoints hold plain weights (the dequantized qtk weights) and trtllm-build "
                     f"re-quantizes them per channel (scale amax/{2 ** (w.num_bits - 1)})" + (
                         f"; GPTQ's rounding survives exactly only in rows that use the code {-(2 ** (w.num_bits - 1))}, "
                         "where that scale equals qtk's" if "gptq" in steps else ""))
    kv = recipe.kv_cache
    kv_algo = None if kv is None else ("FP8" if kv.is_fp8 else "INT8")
    return TRTQuant(algo, kv_algo, w.group_size if algo == "W4A16_AWQ" else None, tuple(notes))


def trtllm_build_weight_only(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype) -> QTensor:
    """What trtllm-build does to the plain weights of a W8A16 / W4A16 checkpoint (TensorRT-LLM's
    symmetric_quantize, cutlass_preprocessors.cpp): per output row, scale = amax / 2^(b-1) (amax/128, amax/8), kept in
    float32 to quantize, q = round-half-away-from-zero(w / scale) clamped to [-2^(b-1), 2^(b-1)-1], and the scale
    stored in the model dtype for the kernel, which computes q * scale. Not qtk's grid (amax/127.5, amax/7.5): the
    build re-quantizes whatever it is given, so this is the only faithful simulation of what the engine runs."""
    wf = w.float()  # [out, in]
    scale = wf.abs().amax(1, keepdim=True) / (1 << (scheme.num_bits - 1))  # [out, 1], float32
    x = torch.where(scale > 0, wf / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(wf))
    q = (x.sign() * (x.abs() + 0.5).floor()).clamp(scheme.qmin, scheme.qmax).to(torch.int8)
    return QTensor(q, scale.to(dtype).float(), scheme, None, None, dtype)


# ---------------------------------------------------------------- int4 packing

def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM / ModelOpt W4A16_AWQ weight: signed int4 q [out, in] -> int8 [out/2, in]; byte j of a column
    holds rows 2j (low nibble) and 2j+1 (high nibble), two's complement."""
    if q.shape[0] % 2:
        raise ValueError(f"pack_int4_pairs: {q.shape[0]} output rows do not pair up")
    q = q.to(torch.int16)
    lo, hi = q[0::2] & 0xF, q[1::2] & 0xF
    b = lo | (hi << 4)  # 0..255
    return torch.where(b >= 128, b - 256, b).to(torch.int8)


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_pairs: int8 or uint8 [out/2, in] -> signed int8 [out, in]."""
    b = packed.to(torch.int16) & 0xFF
    lo, hi = b & 0xF, b >> 4
    lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


# ---------------------------------------------------------------- geometry and sharding

@dataclass(frozen=True)
class Geometry:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, cfg) -> "Geometry":
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        heads = int(get("num_attention_heads"))
        return cls(int(get("num_hidden_layers")), int(get("hidden_size")), int(get("intermediate_size")), heads,
                   int(get("num_key_value_heads") or heads), int(get("head_dim") or get("hidden_size") // heads),
                   int(get("vocab_size")))

    def check(self, tp: int, pp: int, group_size: int | None) -> None:
        def refuse(what: str, n: int, flag: str, val: int):
            divisors = [d for d in (1, 2, 4, 8) if n % d == 0]
            raise UsageError(f"--{flag} {val} does not divide {what} ({n})", f"use --{flag} {' or '.join(map(str, divisors))}")

        if self.heads % tp:
            refuse("the attention heads", self.heads, "tp", tp)
        if (self.kv_heads % tp if self.kv_heads >= tp else tp % self.kv_heads):
            raise UsageError(f"--tp {tp} cannot share the {self.kv_heads} KV heads evenly (split them, or copy each to tp/kv ranks)",
                             f"use a --tp that divides {self.kv_heads} or is a multiple of it")
        if self.intermediate % tp:
            refuse("intermediate_size", self.intermediate, "tp", tp)
        if self.layers % pp:
            refuse("the decoder layers", self.layers, "pp", pp)
        if group_size:
            for what, n in (("hidden_size", self.hidden), ("the attention width per rank", self.heads * self.head_dim // tp),
                            ("intermediate_size per rank", self.intermediate // tp)):
                if n % group_size:
                    raise UsageError(f"{what} ({n}) is not a multiple of group_size {group_size} at --tp {tp}",
                                     "use a smaller --tp or group_size 64")

    def kv_per_rank(self, tp: int) -> int:
        return max(self.kv_heads // tp, 1)


@dataclass
class Part:
    """One logical tensor of a TensorRT-LLM module before sharding; out_axis / in_axis say how it splits
    for column- / row-parallel modules (None: the same on every rank). encode runs per rank (packing)."""

    tensor: torch.Tensor
    out_axis: int | None
    in_axis: int | None
    encode: object = None


@dataclass
class TRTModule:
    name: str  # TensorRT-LLM name relative to the layer, e.g. "attention.qkv"
    parallel: str  # column | row | replicated
    components: list[dict[str, Part]]  # q, k, v for the fused qkv; one otherwise
    kv_components: tuple[int, ...] = ()  # which components hold KV heads (copied when kv_heads < tp)


def _dup_heads(t: torch.Tensor, axis: int, heads: int, reps: int) -> torch.Tensor:
    """Copy each of `heads` heads `reps` times along `axis` (TensorRT-LLM's dup_kv_weight)."""
    return t.unflatten(axis, (heads, -1)).repeat_interleave(reps, dim=axis).flatten(axis, axis + 1)


def shard_module(mod: TRTModule, tp: int, rank: int, geo: Geometry) -> dict[str, torch.Tensor]:
    """The tensors of `mod` on tensor-parallel rank `rank`: column-parallel split on the output axis (q, k, v
    each, then concatenated), row-parallel on the input axis, everything else replicated."""
    out: dict[str, torch.Tensor] = {}
    reps = tp // geo.kv_heads if geo.kv_heads < tp else 1
    for key in mod.components[0]:
        parts = [c[key] for c in mod.components]
        cat_axis = parts[0].out_axis
        split_axis = {COLUMN: parts[0].out_axis, ROW: parts[0].in_axis}.get(mod.parallel)
        if len(parts) > 1 and cat_axis is None:  # shared by the fused components (per-tensor scales)
            if not all(torch.equal(p.tensor, parts[0].tensor) for p in parts):
                raise ValueError(f"{mod.name}.{key} differs between fused components")  # unified upstream
            parts = parts[:1]
        pieces = []
        for ci, p in enumerate(parts):
            t = p.tensor
            if split_axis is not None and tp > 1:
                if reps > 1 and ci in mod.kv_components:
                    t = _dup_heads(t, split_axis, geo.kv_heads, reps)
                t = t.tensor_split(tp, dim=split_axis)[rank]
            pieces.append(t)
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=cat_axis)
        out[key] = parts[0].encode(t) if parts[0].encode else t.contiguous()
    return out


def pad_vocab(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Zero rows up to a multiple of tp (TensorRT-LLM's pad_vocab_size); config vocab_size stays the real one."""
    pad = -t.shape[0] % tp
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


# ---------------------------------------------------------------- what one quantized Linear becomes

def _unify_tensor_scale(qts: list[QTensor]) -> list[QTensor]:
    """Per-tensor scales of modules TensorRT-LLM fuses must be one: requantize to the largest (never mutates)."""
    if len(qts) < 2 or all(torch.equal(q.scale, qts[0].scale) for q in qts):
        return qts
    from qtk.quant.qparams import quantize_weight

    s = torch.stack([q.scale.float().reshape(()) for q in qts]).max().reshape(1)
    return [QTensor(quantize_weight(q.dequantize(), s, None, q.scheme), s, q.scheme, None, None, q.dtype) for q in qts]


def linear_parts(algo: str, qt: QTensor, amax: float | None, dtype: torch.dtype, row: bool) -> dict[str, Part]:
    """The logical TensorRT-LLM tensors of one quantized Linear (before fusion and sharding)."""
    out_f, in_f = qt.shape
    f32 = torch.float32
    if algo in PLAIN_ALGOS:
        return {"weight": Part(qt.dequantize().to(dtype), 0, 1)}
    if algo == "FP8":
        return {"weight": Part(qt.values, 0, 1),
                "weights_scaling_factor": Part(qt.scale.to(f32).reshape(1), None, None),
                "activation_scaling_factor": Part(_act_scale(amax, FP8_MAX), None, None)}
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return {"weight": Part(qt.values, 0, 1), "per_channel_scale": Part(qt.scale.to(f32).reshape(out_f), 0, None)}
    if algo == "W8A8_SQ_PER_CHANNEL":  # ModelOpt layout: TensorRT-LLM's Int8SmoothQuantLinear
        return {"weight": Part(qt.values, 0, 1),
                "weights_scaling_factor": Part(qt.scale.to(f32).reshape(out_f), 0, None),
                "activation_scaling_factor": Part(_act_scale(amax, INT8_MAX), None, None),
                # SmoothQuant is folded into the weights and norms by qtk: the pre-quant multiplier is one
                "prequant_scaling_factor": Part(torch.ones(in_f, dtype=dtype), None, 0)}
    if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":  # SmoothQuantLinear / SmoothQuantRowLinear (plugin)
        parts = {"weight": Part(qt.values, 0, 1), "per_channel_scale": Part(qt.scale.to(f32).reshape(1, out_f), 1, None)}
        if row:
            parts["smoother"] = Part(torch.ones(1, in_f, dtype=f32), None, 1)
        return parts
    if algo == "W4A16_AWQ":
        return {"weight": Part(qt.values, 0, 1, pack_int4_pairs),
                "weights_scaling_factor": Part(qt.scale.to(f32), 0, 1),
                "prequant_scaling_factor": Part(torch.ones(in_f, dtype=dtype), None, 0)}
    raise AssertionError(f"no layout for {algo}")


def _act_scale(amax: float | None, qmax: float) -> torch.Tensor:
    if amax is None:
        raise ValueError("static activation quantization needs a calibrated input amax")  # pipeline guarantees it
    return torch.tensor([amax / qmax if amax > 0 else 1.0], dtype=torch.float32)


def kv_scaling_factors(k_amax: float, v_amax: float, kind: str) -> tuple[float, float]:
    """(k, v) dequant multipliers as ModelOpt exports them: INT8 amax/127; FP8 amax/448 clamped to >= 1.0."""
    if kind == "INT8":
        k, v = k_amax / INT8_MAX, v_amax / INT8_MAX
    else:
        k, v = max(k_amax / FP8_MAX, 1.0), max(v_amax / FP8_MAX, 1.0)
    tiny = torch.finfo(torch.float32).tiny
    return max(k, tiny), max(v, tiny)


# ---------------------------------------------------------------- writer

@register_writer
class TRTLLMWriter(Writer):
    target = "trtllm"
    description = "TensorRT-LLM checkpoint (config.json + rank{N}.safetensors)"
    loads_in = "TensorRT-LLM (`trtllm-build --checkpoint_dir DIR`)"
    serves_with = ("trtllm",)

    @classmethod
    def check(cls, source, recipe, options):
        model_type = source.config_dict.get("model_type")
        if model_type not in MODEL_TYPES or source.arch.trtllm_architecture is None:
            raise UsageError(f"qtk writes TensorRT-LLM checkpoints for {', '.join(MODEL_TYPES)}, not '{model_type}'",
                             "use --target vllm for this model")
        q = trtllm_quant(recipe)
        geo = Geometry.of(source.config)
        geo.check(options.tp, options.pp, q.group_size)
        notes = list(q.notes)
        if options.pp > 1 and _ignored_layer_linears(source, recipe):
            raise UsageError("--pp with per-layer ignore patterns: TensorRT-LLM names excluded modules per pipeline stage",
                             "drop --pp, or ignore only lm_head")
        sw = getattr(source.config, "sliding_window", None)
        if sw and getattr(source.config, "use_sliding_window", True) and sw < _max_positions(source.config):
            notes.append(f"TensorRT-LLM: the checkpoint has no sliding-window field; run it with max_attention_window_size {sw}")
        return notes

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
        from qtk.export.safetensors_io import ShardedWriter

        self.quant = trtllm_quant(recipe)
        self.arch = source.arch
        self.geo = Geometry.of(source.config)
        self.tp, self.pp = options.tp, options.pp
        self.layers_per_stage = self.geo.layers // self.pp
        per_rank = self.layers_per_stage * 48 + 16  # tensors per rank, generously: sizes the streamed header
        # one streaming file per rank, all open at once: each layer goes to every rank as it arrives
        self.ranks = [ShardedWriter(self.dir, 2**62, per_rank, prefix=f"rank{r}") for r in range(self.tp * self.pp)]
        self.tied = (bool(getattr(source.config, "tie_word_embeddings", False))
                     and f"{self.arch.lm_head}.weight" not in source.weight_map)
        self.excluded: list[str] = []
        self.unplaced: list[str] = []

    # ---- ranks
    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.tp, (stage + 1) * self.tp)

    def _add_vocab(self, name: str, t: torch.Tensor, stage: int) -> None:
        for rank, piece in zip(self.stage_ranks(stage), pad_vocab(t, self.tp).tensor_split(self.tp, dim=0)):
            self.ranks[rank].add(name, piece.contiguous())

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        a, last = self.arch, self.pp - 1
        if name == f"{a.embed}.weight":
            self._add_vocab("transformer.vocab_embedding.weight", tensor, 0)
            if self.tied:
                self._add_vocab("lm_head.weight", tensor, last)
        elif name == f"{a.lm_head}.weight":
            self._add_vocab("lm_head.weight", tensor, last)
        elif name == f"{a.final_norm}.weight":
            for rank in self.stage_ranks(last):
                self.ranks[rank].add("transformer.ln_f.weight", tensor)
        else:
            self.unplaced.append(name)

    def add_layer(self, r) -> None:
        stage, local = divmod(r.index, self.layers_per_stage)
        prefix = f"transformer.layers.{local}."
        modules, replicated = self.layer_modules(r)
        for tp_rank, rank in enumerate(self.stage_ranks(stage)):
            w = self.ranks[rank]
            for name, t in replicated.items():
                w.add(prefix + name, t)
            for mod in modules:
                for key, t in shard_module(mod, self.tp, tp_rank, self.geo).items():
                    w.add(f"{prefix}{mod.name}.{key}", t)

    def layer_modules(self, r) -> tuple[list[TRTModule], dict[str, torch.Tensor]]:
        """One layer as TensorRT-LLM modules (to shard) and replicated tensors (norms, KV scales)."""
        a, algo, dtype = self.arch, self.quant.quant_algo, self.source.dtype
        hf = self.source.layer_prefix(r.index)
        dense = dict(r.dense)
        replicated: dict[str, torch.Tensor] = {}
        for h in list(dense):
            base, _, leaf = h[len(hf):].rpartition(".")
            if base in ("input_layernorm", "post_attention_layernorm") or base in EXTRA_LAYER_NAMES:
                trt = a.trtllm_names.get(base) or EXTRA_LAYER_NAMES[base]
                replicated[f"{trt}.{leaf}"] = dense.pop(h)

        qts = {m[len(hf):]: qt for m, qt in r.qweights.items()}
        if algo == "FP8":
            for g in a.fusion_groups:
                if all(m in qts for m in g):
                    qts.update(zip(g, _unify_tensor_scale([qts[m] for m in g])))

        def parts(lin: str, row: bool) -> dict[str, Part]:
            full = hf + lin
            qt = qts.get(lin)
            if qt is not None:
                amax = r.input_amax.get(full)
                if amax is not None and algo in ("FP8", "W8A8_SQ_PER_CHANNEL"):  # a fused group sees one input: one scale
                    amax = max(r.input_amax.get(hf + m, 0.0) for m in a.fusion_group_of(lin))
                p = linear_parts(algo, qt, amax, dtype, row)
            else:
                p = {"weight": Part(dense.pop(f"{full}.weight"), 0, 1)}
            b = dense.pop(f"{full}.bias", None)
            if b is not None:
                p["bias"] = Part(b, None if row else 0, None)
            return p

        modules = [TRTModule(QKV, COLUMN, [parts(Q, False), parts(K, False), parts(V, False)], kv_components=(1, 2))]
        for lin, par in ((O, ROW), (GATE, COLUMN), (UP, COLUMN), (DOWN, ROW)):
            modules.append(TRTModule(a.trtllm_names[lin], par, [parts(lin, par == ROW)]))
        if dense:
            raise UsageError(f"layer {r.index} has tensors a TensorRT-LLM {a.trtllm_architecture} checkpoint has no place for: "
                             f"{', '.join(sorted(dense)[:4])}", "convert this model with --target vllm")
        for m in modules:  # the pipeline never quantizes part of a fused group
            if not any(hf + lin in r.qweights for lin in self._hf_of(m.name)):
                self.excluded.append(f"transformer.layers.{r.index}.{m.name}")
        if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":  # SmoothQuantRmsNorm's static scale, unused per token
            for norm in ("input_layernorm", "post_layernorm"):
                replicated[f"{norm}.scale_to_int"] = torch.ones(1, dtype=torch.float32)
        if r.k_amax is not None and self.quant.kv_cache_quant_algo:
            k, v = kv_scaling_factors(r.k_amax, r.v_amax, self.quant.kv_cache_quant_algo)
            # ModelOpt writes k, v and their max; TensorRT-LLM >= 0.18 merges k/v into kv itself
            replicated["attention.k_cache_scaling_factor"] = torch.tensor([k], dtype=torch.float32)
            replicated["attention.v_cache_scaling_factor"] = torch.tensor([v], dtype=torch.float32)
            replicated["attention.kv_cache_scaling_factor"] = torch.tensor([max(k, v)], dtype=torch.float32)
        return modules, replicated

    def _hf_of(self, trt_name: str) -> tuple[str, ...]:
        if trt_name == QKV:
            return (Q, K, V)
        return tuple(h for h, t in self.arch.trtllm_names.items() if t == trt_name)

    def exclude_modules(self) -> list[str]:
        out = ["lm_head"]
        for m in self.excluded:
            out.append(m)
            if self.quant.quant_algo in PLAIN_ALGOS:  # trtllm-build matches weight-only exclusions on tensor names
                out.append(f"{m}.*")
        return out

    def trt_config(self) -> dict:
        return trtllm_config(self.source, self.geo, self.quant, self.exclude_modules(), self.tp, self.pp, self.tied)

    def finish(self, manifest: dict) -> None:
        for rank, w in enumerate(self.ranks):
            wm = w.close()
            if set(wm.values()) != {f"rank{rank}.safetensors"}:
                raise AssertionError(f"rank {rank} spilled into several files: {sorted(set(wm.values()))}")
        (self.dir / "config.json").write_text(json.dumps(self.trt_config(), indent=4) + "\n")
        if self.unplaced:
            self.notes.append(f"TensorRT-LLM: not written (no place in the checkpoint): {', '.join(self.unplaced)}")
        self.copy_side_files()
        self.write_manifest(manifest)


def _ignored_layer_linears(source, recipe) -> list[str]:
    from qtk.pipeline import target_linears

    return [source.layer_prefix(i) + lin for i in range(source.num_layers)
            for lin in source.arch.linears if lin not in target_linears(source, recipe, i)]


def _max_positions(cfg) -> int:
    return int(getattr(cfg, "max_position_embeddings", 0) or 0)


def _rope(cfg) -> tuple[float, dict | None]:
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rp.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind == "default":
        return theta, None
    rp.pop("type", None)
    return theta, {"type": kind, **rp}  # TensorRT-LLM reads rotary_scaling["type"]; rope_type kept too


def trtllm_config(source, geo: Geometry, quant: TRTQuant, exclude: list[str], tp: int, pp: int, tied: bool) -> dict:
    """config.json of the checkpoint: TensorRT-LLM's PretrainedConfig fields (FORMATS.md §2)."""
    from qtk import __version__

    cfg, mt = source.config, source.config_dict.get("model_type")
    theta, scaling = _rope(cfg)
    dtype = str(source.dtype).replace("torch.", "")
    attn_bias = bool(getattr(cfg, "attention_bias", False)) or mt == "qwen2"
    out = {
        "producer": {"name": "qtk", "version": __version__},
        "architecture": source.arch.trtllm_architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": geo.vocab,
        "max_position_embeddings": _max_positions(cfg),
        "hidden_size": geo.hidden,
        "num_hidden_layers": geo.layers,
        "num_attention_heads": geo.heads,
        "num_key_value_heads": geo.kv_heads,
        "head_size": geo.head_dim,
        "intermediate_size": geo.intermediate,
        "hidden_act": getattr(cfg, "hidden_act", "silu"),
        "norm_epsilon": float(cfg.rms_norm_eps),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": theta,
        "rotary_scaling": scaling,
        "attn_bias": attn_bias,
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "residual_mlp": False,
        # generic PretrainedConfig fields ModelOpt writes for this family, kept for parity with it
        "bias": bool(getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)),
        "rotary_pct": 1.0,
        "rmsnorm": True,
        "lm_head_bias": False,
        "decoder": "qwen" if mt in ("qwen2", "qwen3") else "llama",
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": tied or bool(getattr(cfg, "tie_word_embeddings", False)),
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": quant.config(exclude),
    }
    if mt in ("qwen2", "qwen3"):
        out["qwen_type"] = mt
    return out


# ---------------------------------------------------------------- reader

def _scheme_of(algo: str | None, group_size: int | None) -> tuple[QuantScheme, QuantScheme | None]:
    table = {
        "FP8": (QuantScheme(8, "float", True, "tensor"), QuantScheme(8, "float", True, "tensor")),
        "FP8_PER_CHANNEL_PER_TOKEN": (QuantScheme(8, "float", True, "channel"), QuantScheme(8, "float", True, "token", dynamic=True)),
        "W8A8_SQ_PER_CHANNEL": (QuantScheme(8, "int", True, "channel"), QuantScheme(8, "int", True, "tensor")),
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": (QuantScheme(8, "int", True, "channel"), QuantScheme(8, "int", True, "token", dynamic=True)),
        "W8A16": (QuantScheme(8, "int", True, "channel"), None),
        "W4A16": (QuantScheme(4, "int", True, "channel"), None),
        "W4A16_AWQ": (QuantScheme(4, "int", True, "group", group_size or 128), None),
    }
    if algo not in table:
        raise UsageError(f"qtk cannot read TensorRT-LLM checkpoints with quant_algo {algo}", f"readable: {', '.join(table)}")
    return table[algo]


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
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError:
            return False
        return isinstance(cfg, dict) and "architecture" in cfg and "mapping" in cfg

    def __init__(self, path: Path):
        super().__init__(path)
        self.trt = json.loads((self.path / "config.json").read_text())
        arch_name = self.trt["architecture"]
        mt = self.trt.get("qwen_type") or ARCH_TO_MODEL_TYPE.get(arch_name)
        if mt not in MODEL_TYPES:
            raise UsageError(f"{path}: qtk reads TensorRT-LLM checkpoints of {', '.join(ARCH_TO_MODEL_TYPE)}, not {arch_name}",
                             "inspect it with TensorRT-LLM's own tools")
        self.arch = arch_for(mt)
        self.geo = Geometry.of(self.trt)
        m = self.trt.get("mapping") or {}
        self.tp, self.pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
        self.layers_per_stage = self.geo.layers // self.pp
        q = self.trt.get("quantization") or {}
        self.quant_algo = q.get("quant_algo")
        self.exclude = list(q.get("exclude_modules") or [])
        self.weights_scheme, self.activations = _scheme_of(self.quant_algo, q.get("group_size"))
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
        hf = {"model_type": mt, "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[mt]],
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
            from safetensors import safe_open

            h = self._rank_files[rank] = safe_open(str(self.path / f"rank{rank}.safetensors"), "pt")
        return h

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
    @staticmethod
    def _axes(key: str, shape: list[int]) -> tuple[int | None, int | None]:
        """(out_axis, in_axis) of a stored tensor (mirror of linear_parts, read from names and shapes)."""
        n = len(shape)
        if key in ("weight",):
            return 0, 1
        if key == "bias":
            return 0, None
        if key == "weights_scaling_factor":
            return (None, None) if n == 1 and shape[0] == 1 else ((0, None) if n == 1 else (0, 1))
        if key == "per_channel_scale":
            return (0, None) if n == 1 else (1, None)
        if key == "prequant_scaling_factor":
            return None, n - 1
        if key == "smoother":
            return None, 1
        return None, None

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
            pieces = [self._file(r).get_tensor(base + key) for r in ranks]
            out_axis, in_axis = self._axes(key, list(pieces[0].shape))
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

    def _is_quantized(self, layer: int, trt_name: str) -> bool:
        if self.quant_algo in PLAIN_ALGOS:
            return not self._excluded(layer, trt_name)
        ranks, prefix = self._stage(layer)
        names = self._names(ranks[0])
        return any(f"{prefix}{trt_name}.{k}" in names for k in ("weights_scaling_factor", "per_channel_scale"))

    # ---- Checkpoint API
    def ignore_patterns(self) -> list[str]:
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

    def qtensor(self, module: str) -> QTensor:
        layer, trt, ci = self._trt_of(module)
        t = self._module(layer, trt)[ci]
        algo, s = self.quant_algo, self.weights_scheme
        if algo in PLAIN_ALGOS:  # plain weights: what trtllm-build's own quantization makes of them
            return trtllm_build_weight_only(t["weight"].to(self.dtype), s, self.dtype)
        for k in ("prequant_scaling_factor", "smoother"):
            if k in t and not bool((t[k] == 1).all()):
                raise UsageError(f"{module}: {k} is not all ones (smoothing kept outside the weights)",
                                 "qtk simulates checkpoints whose smoothing is folded into the weights, as qtk writes them")
        if algo == "W4A16_AWQ":
            return QTensor(unpack_int4_pairs(t["weight"]), t["weights_scaling_factor"].float(), s, None, None, self.dtype)
        w = t["weight"]
        if algo == "FP8":
            scale = t["weights_scaling_factor"].float().reshape(1)
        elif "per_channel_scale" in t:
            scale = t["per_channel_scale"].float().reshape(-1, 1)
        else:
            scale = t["weights_scaling_factor"].float().reshape(-1, 1)
        return QTensor(w, scale, s, None, None, self.dtype)

    def input_scale(self, module: str) -> torch.Tensor | None:
        if self.activations is None or self.activations.dynamic:
            return None
        layer, trt, ci = self._trt_of(module)
        t = self._module(layer, trt)[ci].get("activation_scaling_factor")
        return None if t is None else t.float().reshape(1)

    def kv_scales(self, layer: int) -> tuple[float, float] | None:
        """TensorRT-LLM scales K and V with one factor (max of k and v): the cache holds round(x / s)."""
        ranks, prefix = self._stage(layer)
        f, names = self._file(ranks[0]), self._names(ranks[0])
        kv = f"{prefix}attention.kv_cache_scaling_factor"
        k, v = f"{prefix}attention.k_cache_scaling_factor", f"{prefix}attention.v_cache_scaling_factor"
        if k in names and v in names:  # TensorRT-LLM merges these into kv itself (max) when present
            s = max(float(f.get_tensor(k).reshape(-1)[0]), float(f.get_tensor(v).reshape(-1)[0]))
        elif kv in names:
            s = float(f.get_tensor(kv).reshape(-1)[0])
        else:
            return None
        return s, s

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        a, g = self.arch, self.geo
        first, last = 0, self.pp - 1
        out: dict[str, torch.Tensor] = {}

        def vocab(name: str, stage: int) -> torch.Tensor:
            ranks = range(stage * self.tp, (stage + 1) * self.tp)
            return torch.cat([self._file(r).get_tensor(name) for r in ranks], dim=0)[: g.vocab]

        out[f"{a.embed}.weight"] = vocab("transformer.vocab_embedding.weight", first)
        if not self._tied():
            out[f"{a.lm_head}.weight"] = vocab("lm_head.weight", last)
        out[f"{a.final_norm}.weight"] = self._file(last * self.tp).get_tensor("transformer.ln_f.weight")
        back = {v: k for k, v in a.trtllm_names.items() if k in ("input_layernorm", "post_attention_layernorm")}
        back.update({v: k for k, v in EXTRA_LAYER_NAMES.items()})
        for i in range(g.layers):
            ranks, prefix = self._stage(i)
            hf = f"{a.layers}.{i}."
            names = self._names(ranks[0])
            for trt, h in back.items():
                if f"{prefix}{trt}.weight" in names:
                    out[f"{hf}{h}.weight"] = self._file(ranks[0]).get_tensor(f"{prefix}{trt}.weight")
            for lin in a.linears:
                _, trt, ci = self._trt_of(hf + lin)
                quantized = self._is_quantized(i, trt)
                if quantized and f"{prefix}{trt}.bias" not in names:
                    continue
                t = self._module(i, trt)[ci]
                if "bias" in t:
                    out[f"{hf}{lin}.bias"] = t["bias"]
                if not quantized:
                    out[f"{hf}{lin}.weight"] = t["weight"]
        return out
