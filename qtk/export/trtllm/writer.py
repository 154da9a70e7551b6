"""The TensorRT-LLM writer: each LayerResult mapped to TensorRT-LLM names (q/k/v fused into attention.qkv, gate_proj ->
mlp.fc, up_proj -> mlp.gate, per the architecture table), each Linear encoded for its algorithm
(qtk.export.codecs.trtllm), split for tensor parallelism (sharding.py) and streamed into every rank file at once, so
memory stays O(one layer) for any --tp/--pp. config.json holds TensorRT-LLM's PretrainedConfig fields; a
MIXED_PRECISION checkpoint also holds quant_cfg.json with each quantized module's algorithm (algo.py)."""

from __future__ import annotations

import json

import torch

from qtk.errors import UsageError
from qtk.export import register_writer
from qtk.export.base import Writer
from qtk.export.codecs.trtllm import INT8_MAX, PLAIN_ALGOS, Part, encode, w4a8_weight_amax
from qtk.export.trtllm.algo import TRTQuant, trtllm_quant
from qtk.export.trtllm.sharding import COLUMN, QKV, ROW, TRTModule, check_geometry, pad_vocab, shard_module
from qtk.io.safetensors import ShardedWriter, as_tensor
from qtk.model.arch import DOWN, FAMILIES, GATE, K, O, Q, TRTLLM_MODEL_TYPES, UP, V, Geometry
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import FP8_MAX

# per-head norms of Qwen3 (not Linears; replicated on every rank)
EXTRA_LAYER_NAMES = {"self_attn.q_norm": "attention.q_layernorm", "self_attn.k_norm": "attention.k_layernorm"}


def unify_tensor_scale(qts: list[QTensor]) -> list[QTensor]:
    """Per-tensor scales of modules TensorRT-LLM fuses must be one: requantize to the largest (never mutates)."""
    if len(qts) < 2 or all(torch.equal(q.scale, qts[0].scale) for q in qts):
        return qts
    from qtk.quant.qparams import quantize_weight

    s = torch.stack([q.scale.float().reshape(()) for q in qts]).max().reshape(1)
    return [QTensor(quantize_weight(q.dequantize(), s, None, q.scheme), s, q.scheme, None, None, q.dtype) for q in qts]


def kv_scaling_factors(k_amax: float, v_amax: float, kind: str) -> tuple[float, float]:
    """(k, v) dequant multipliers as ModelOpt exports them: INT8 amax/127; FP8 amax/448 clamped to >= 1.0."""
    if kind == "INT8":
        k, v = k_amax / INT8_MAX, v_amax / INT8_MAX
    else:
        k, v = max(k_amax / FP8_MAX, 1.0), max(v_amax / FP8_MAX, 1.0)
    tiny = torch.finfo(torch.float32).tiny
    return max(k, tiny), max(v, tiny)


@register_writer
class TRTLLMWriter(Writer):
    target = "trtllm"
    description = "TensorRT-LLM checkpoint (config.json + rank{N}.safetensors)"
    loads_in = "TensorRT-LLM (`trtllm-build --checkpoint_dir DIR`)"
    serves_with = ("trtllm",)

    @classmethod
    def check(cls, source, recipe, options):
        model_type = source.config_dict.get("model_type")
        if model_type not in TRTLLM_MODEL_TYPES or source.arch.trtllm_architecture is None:
            raise UsageError(f"qtk writes TensorRT-LLM checkpoints for {', '.join(TRTLLM_MODEL_TYPES)}, not '{model_type}'",
                             "use --target vllm for this model")
        q = trtllm_quant(recipe)
        check_geometry(Geometry.of(source.config), options.tp, options.pp, q.group_sizes)
        notes = list(q.notes)
        if options.pp > 1 and _ignored_layer_linears(source, recipe):
            raise UsageError("--pp with per-layer ignore patterns: TensorRT-LLM names excluded modules per pipeline stage",
                             "drop --pp, or ignore only lm_head")
        if options.pp > 1 and q.mixed:
            raise UsageError("--pp with a mixed-precision recipe: TensorRT-LLM names quant_cfg.json's modules per pipeline "
                             "stage", "drop --pp")
        sw = getattr(source.config, "sliding_window", None)
        if sw and getattr(source.config, "use_sliding_window", True) and sw < _max_positions(source.config):
            notes.append(f"TensorRT-LLM: the checkpoint has no sliding-window field; run it with max_attention_window_size {sw}")
        return notes

    def __init__(self, directory, source, recipe, options):
        super().__init__(directory, source, recipe, options)
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
        self.quantized_layers: dict = {}  # TensorRT-LLM module name -> LayerAlgo (quant_cfg.json, MIXED_PRECISION)
        self.unplaced: list[str] = []

    # ---- ranks
    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.tp, (stage + 1) * self.tp)

    def _add_vocab(self, name: str, t: torch.Tensor, stage: int) -> None:
        for rank, piece in zip(self.stage_ranks(stage), pad_vocab(t, self.tp).tensor_split(self.tp, dim=0)):
            self.ranks[rank].add(name, piece.contiguous())

    def open_files(self) -> list:
        return [f for w in self.ranks for f in w.open_files()]

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        a, last = self.arch, self.pp - 1
        if name in (f"{a.embed}.weight", f"{a.lm_head}.weight"):  # padded and split across ranks: read whole
            tensor = as_tensor(tensor)
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
        a, q, dtype = self.arch, self.quant, self.source.dtype
        hf = self.source.layer_prefix(r.index)
        dense = dict(r.dense)
        replicated: dict[str, torch.Tensor] = {}
        for h in list(dense):
            base, _, leaf = h[len(hf):].rpartition(".")
            if base in ("input_layernorm", "post_attention_layernorm") or base in EXTRA_LAYER_NAMES:
                trt = a.trtllm_names.get(base) or EXTRA_LAYER_NAMES[base]
                replicated[f"{trt}.{leaf}"] = dense.pop(h)

        qts = {m[len(hf):]: qt for m, qt in r.qweights.items()}
        algos = {lin: q.algo_for(self.module_scheme(hf + lin, qt)).algo for lin, qt in qts.items()}
        if q.quant_algo == "FP8":
            for g in a.fusion_groups:
                if all(m in qts for m in g):
                    qts.update(zip(g, unify_tensor_scale([qts[m] for m in g])))

        def parts(lin: str, row: bool) -> dict[str, Part]:
            full = hf + lin
            qt = qts.get(lin)
            if qt is not None:
                algo = algos[lin]
                amax = r.input_amax.get(full)
                if amax is not None and algo in ("FP8", "W8A8_SQ_PER_CHANNEL", "NVFP4", "W4A8_AWQ"):  # a fused group sees one input: one scale
                    amax = max(r.input_amax.get(hf + m, 0.0) for m in a.fusion_group_of(lin))
                # W4A8_AWQ: one weights_scaling_factor_2 per fused module (TensorRT-LLM loads one per module)
                wamax = (max(w4a8_weight_amax(qts[m]) for m in a.fusion_group_of(lin) if m in qts)
                         if algo == "W4A8_AWQ" else None)
                p = encode(algo, qt, amax, dtype, row, wamax)
            else:
                p = {"weight": Part.of("weight", dense.pop(f"{full}.weight"))}
            b = dense.pop(f"{full}.bias", None)
            if b is not None:
                p["bias"] = Part.of("bias", b)
            return p

        modules = [TRTModule(QKV, COLUMN, [parts(Q, False), parts(K, False), parts(V, False)], kv_components=(1, 2))]
        for lin, par in ((O, ROW), (GATE, COLUMN), (UP, COLUMN), (DOWN, ROW)):
            modules.append(TRTModule(a.trtllm_names[lin], par, [parts(lin, par == ROW)]))
        if dense:
            raise UsageError(f"layer {r.index} has tensors a TensorRT-LLM {a.trtllm_architecture} checkpoint has no place for: "
                             f"{', '.join(sorted(dense)[:4])}", "convert this model with --target vllm")
        for m in modules:  # the pipeline never quantizes part of a fused group
            name = f"transformer.layers.{r.index}.{m.name}"
            members = self._hf_of(m.name)
            if all(hf + lin in r.dense_linears for lin in members):
                self.excluded.append(name)
            elif q.mixed:
                self.quantized_layers[name] = q.algo_for(self.module_scheme(hf + members[0], r.qweights[hf + members[0]]))
        if q.quant_algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":  # SmoothQuantRmsNorm's static scale, unused per token
            for norm in ("input_layernorm", "post_layernorm"):
                replicated[f"{norm}.scale_to_int"] = torch.ones(1, dtype=torch.float32)
        if r.k_amax is not None and q.kv_cache_quant_algo:
            k, v = kv_scaling_factors(r.k_amax, r.v_amax, q.kv_cache_quant_algo)
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
        if self.quant.mixed:
            (self.dir / "quant_cfg.json").write_text(json.dumps(self.quant.layer_config(self.quantized_layers), indent=4) + "\n")
        if self.unplaced:
            self.notes.append(f"TensorRT-LLM: not written (no place in the checkpoint): {', '.join(self.unplaced)}")
        self.copy_side_files()
        self.write_manifest(manifest)


def _ignored_layer_linears(source, recipe) -> list[str]:
    return [source.layer_prefix(i) + lin for i in range(source.num_layers)
            for lin in source.arch.linears if recipe.scheme_for(source.layer_prefix(i) + lin) is None]


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
    """config.json of the checkpoint: TensorRT-LLM's PretrainedConfig fields (docs/formats.md, trtllm)."""
    from qtk import __version__

    cfg, mt = source.config, source.config_dict.get("model_type")
    arch, traits = source.arch, FAMILIES[mt].traits
    theta, scaling = _rope(cfg)
    dtype = str(source.dtype).replace("torch.", "")
    # a family whose q/k/v always carry biases (Qwen2) has them whatever the config's attention_bias says
    attn_bias = bool(getattr(cfg, "attention_bias", False)) or bool(traits.qkv_bias)
    out = {
        "producer": {"name": "qtk", "version": __version__},
        "architecture": arch.trtllm_architecture,
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
        "decoder": arch.trtllm_decoder,
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": tied or bool(getattr(cfg, "tie_word_embeddings", False)),
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": quant.config(exclude),
    }
    if arch.trtllm_decoder == "qwen":
        out["qwen_type"] = mt
    return out
