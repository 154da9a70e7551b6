"""Memory from config.json alone: the checkpoint's tensors and bytes for a recipe, the KV cache, the
serving budget on a GPU, and what `qtk convert` itself needs. Light on purpose: no torch import.

Sizes are exact byte counts of the compressed-tensors layout qtk writes (docs/formats.md, vllm), derived
from the Linear shapes the config implies; tests check them against meta-device models.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from qtk.errors import UsageError
from qtk.model.arch import ARCHS, TRAITS, Traits
from qtk.model.config_check import read_config_json
from qtk.quant.formats import format_for
from qtk.quant.formats.base import input_scale_key

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1, "uint8": 1, "int32": 4, "int64": 8}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

# vLLM V1's default chunked-prefill budget: the activation peak is profiled with this many tokens
DEFAULT_BATCHED_TOKENS = 8192
# CUDA context, cuBLAS/NCCL workspaces and CUDA graphs, outside the weights / KV / activations
DEFAULT_OVERHEAD_BYTES = int(1.5e9)
DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default


def read_config(path: str | Path) -> dict:
    """config.json as a dict, from a model directory or the file itself."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise UsageError(f"no config.json at {p}", "give a model directory or the path to its config.json")
    if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"):
        raise UsageError(f"{f} is a weights file, not a config.json", f"give the model directory ({f.parent}) or its config.json")
    return read_config_json(f)  # size, encoding, nesting, an object: the checks qtk convert makes


def normalize_dtype(name: str | None, default: str = "bfloat16") -> str:
    if name is None:
        return default
    d = DTYPE_ALIASES.get(str(name).lower(), str(name).lower()).replace("torch.", "")
    if d not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"unsupported model dtype '{name}'", "use bfloat16, float16 or float32 (--dtype)")
    return d


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory, read from config.json."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype: str
    max_position: int | None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    windows: tuple[int | None, ...] = ()  # per layer: sliding window in tokens, None = full attention
    # mixture of experts
    experts: int = 0
    expert_intermediate: int = 0
    top_k: int = 0
    moe_layers: tuple[bool, ...] = ()
    shared_intermediate: int = 0
    shared_style: str = ""  # "qwen" (shared_expert + sigmoid gate) | "deepseek" (shared_experts) | "llama4" (shared_expert)
    block: str = "mlp"  # the feed-forward block's name in a layer (Llama 4: feed_forward)
    dense_intermediate: int = 0  # a dense layer's MLP size in an MoE model where it is not `intermediate` (Llama 4)
    router_bias: bool = False
    router: str = "gate"  # the router's module name in the MoE block
    router_linear_bias: bool = False  # the router Linear has a bias (gpt-oss)
    expert_bias: bool = False  # every expert Linear has a bias (gpt-oss)
    sinks: bool = False  # a sink logit per attention head (gpt-oss), kept in 16 bits
    # multi-head latent attention (DeepSeek V2/V3): the cache holds one latent per token per layer
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    prefix: str = "model"
    lm_head: str = "lm_head"
    vision_params: int = 0  # estimated from vision_config; kept at source precision
    notes: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @classmethod
    def from_config(cls, cfg: Mapping) -> "ModelShape":
        """Parse a HF config.json dict (text_config of a multimodal config is used when present)."""
        from qtk.model.config_check import check_config_sizes

        check_config_sizes(cfg)  # before anything is sized by it: 10**7 layers would take minutes and gigabytes
        try:
            return cls._from_config(cfg)
        except (TypeError, ValueError) as e:  # a value of the wrong kind that no size check covers (e.g. a list of dicts)
            raise UsageError(f"config.json has a value qtk plan cannot use ({type(e).__name__}: {str(e)[:80]})",
                             "restore the model's original config.json") from None

    @classmethod
    def _from_config(cls, cfg: Mapping) -> "ModelShape":
        notes: list[str] = []
        text = dict(cfg)
        prefix = "model"
        vision = 0
        if isinstance(cfg.get("text_config"), Mapping):
            # multimodal: the language model's numbers live in text_config; top-level keys fill gaps
            text = {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **cfg["text_config"]}
            prefix = "model.language_model"
        if isinstance(cfg.get("vision_config"), Mapping):
            vision = estimate_vision_params(cfg["vision_config"], int(text.get("hidden_size") or 0))
            prefix = "model.language_model"
            notes.append(f"vision tower estimated at {vision / 1e9:.2f}B parameters, kept at source precision")
        lm_head = "lm_head"
        own = ARCHS.get(cfg.get("model_type"))
        if own is not None and own.multimodal:  # the family's own names (Llama 4: the whole LM under language_model)
            prefix, lm_head = own.layers.rpartition(".layers")[0], own.lm_head

        def need(*keys):
            for k in keys:
                v = text.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
            raise UsageError(f"config.json has no positive integer '{keys[0]}'",
                             "give the config.json of a decoder-only transformers model")

        model_type = str(text.get("model_type") or cfg.get("model_type") or "unknown")
        traits = TRAITS.get(model_type)
        if traits is None:
            traits = Traits()
            notes.append(f"model_type '{model_type}' is not in qtk's table: counted as a Llama-style decoder")
        hidden = need("hidden_size", "n_embd", "d_model")
        layers = need("num_hidden_layers", "n_layer", "num_layers")
        heads = need("num_attention_heads", "n_head")
        kv_heads = text.get("num_key_value_heads") or heads
        head_dim = text.get("head_dim") or hidden // heads
        vocab = need("vocab_size")
        intermediate = text.get("intermediate_size") or 4 * hidden
        tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
        tied = traits.tie_default if tie is None else bool(tie)
        dtype = normalize_dtype(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype"))
        attention_bias = bool(text.get("attention_bias", False))
        qkv_bias = traits.qkv_bias if traits.qkv_bias is not None else attention_bias
        o_bias = attention_bias if traits.qkv_bias is None else False

        experts = int(text.get("num_local_experts") or text.get("num_experts") or text.get("n_routed_experts") or 0)
        moe_layers: tuple[bool, ...] = ()
        expert_inter = shared_inter = top_k = 0
        shared_style = ""
        dense_inter = 0
        if experts and traits.block == "feed_forward":
            # Llama 4: routed and shared experts of intermediate_size; the layers outside moe_layers (every
            # interleave_moe_layer_step-th layer by default) dense, of intermediate_size_mlp (the class's defaults)
            expert_inter = shared_inter = int(intermediate)
            top_k = int(text.get("num_experts_per_tok") or 1)
            step = int(text.get("interleave_moe_layer_step") or 1)
            listed = text.get("moe_layers")
            sparse = set(listed) if isinstance(listed, list) else set(range(step - 1, layers, step))
            moe_layers = tuple(i in sparse for i in range(layers))
            dense_inter = int(text.get("intermediate_size_mlp") or 16384)
            shared_style = "llama4"
        elif experts:
            expert_inter = int(text.get("moe_intermediate_size") or intermediate)
            top_k = int(text.get("num_experts_per_tok") or 2)
            if "first_k_dense_replace" in text or "n_routed_experts" in text:
                first = int(text.get("first_k_dense_replace") or 0)
                freq = int(text.get("moe_layer_freq") or 1)
                moe_layers = tuple(i >= first and i % freq == 0 for i in range(layers))
                shared_inter = int(text.get("n_shared_experts") or 0) * expert_inter
                shared_style = "deepseek"
            else:
                step = int(text.get("decoder_sparse_step") or 1)
                only_mlp = set(text.get("mlp_only_layers") or [])
                moe_layers = tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(layers))
                shared_inter = int(text.get("shared_expert_intermediate_size") or 0)
                shared_style = "qwen" if shared_inter else ""

        kv_lora = int(text.get("kv_lora_rank") or 0)
        return cls(
            model_type=model_type, hidden=hidden, intermediate=int(intermediate), layers=layers, heads=heads,
            kv_heads=int(kv_heads), head_dim=int(head_dim), vocab=vocab, tied=tied, dtype=dtype,
            max_position=text.get("max_position_embeddings"), qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=bool(text.get("mlp_bias", False)), qk_norm=traits.qk_norm, sandwich_norms=traits.sandwich_norms,
            windows=_layer_windows(text, layers, traits), experts=experts, expert_intermediate=expert_inter,
            top_k=top_k, moe_layers=moe_layers, shared_intermediate=shared_inter, shared_style=shared_style,
            router_bias=traits.router_bias and experts > 0, router=traits.router,
            router_linear_bias=traits.router_linear_bias and experts > 0, expert_bias=traits.expert_bias and experts > 0,
            sinks=traits.sinks, kv_lora_rank=kv_lora,
            q_lora_rank=int(text.get("q_lora_rank") or 0) if kv_lora else 0,
            qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0) if kv_lora else 0,
            qk_nope_head_dim=int(text.get("qk_nope_head_dim") or 0) if kv_lora else 0,
            v_head_dim=int(text.get("v_head_dim") or 0) if kv_lora else 0,
            block=traits.block, dense_intermediate=dense_inter, prefix=prefix, lm_head=lm_head, vision_params=vision,
            notes=tuple(notes),
        )


def _layer_windows(text: Mapping, layers: int, traits: Traits) -> tuple[int | None, ...]:
    """Per-layer sliding window (None = full attention), as transformers builds layer_types."""
    window = text.get("sliding_window")
    types = text.get("layer_types")
    if traits.sliding == "chunked":
        # Llama 4: the RoPE layers (no_rope_layers[i] == 1) attend within chunks of attention_chunk_size tokens, which
        # is all their cache holds (vLLM's chunked local attention); the others attend to the whole context
        chunk = text.get("attention_chunk_size", 8192)  # the config class's default where config.json omits it
        if not chunk:
            return (None,) * layers
        if isinstance(types, list) and len(types) == layers:
            return tuple(chunk if t == "chunked_attention" else None for t in types)
        rope = text.get("no_rope_layers")
        interval = int(text.get("no_rope_layer_interval") or 4)
        rope = rope if isinstance(rope, list) and len(rope) == layers else [int((i + 1) % interval != 0) for i in range(layers)]
        return tuple(chunk if r else None for r in rope)
    if not window:
        return (None,) * layers
    if isinstance(types, list) and len(types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if traits.sliding == "all":
        return (window,) * layers
    if traits.sliding == "alternate":  # Gemma 2: even layers slide
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    if traits.sliding == "pattern":  # Gemma 3: every Nth layer is global
        n = int(text.get("sliding_window_pattern") or 6)
        return tuple(None if (i + 1) % n == 0 else window for i in range(layers))
    if traits.sliding == "qwen" and text.get("use_sliding_window"):
        first = int(text.get("max_window_layers") or 0)
        return tuple(window if i >= first else None for i in range(layers))
    return (None,) * layers


def estimate_vision_params(v: Mapping, text_hidden: int) -> int:
    """A ViT tower from its config: blocks (attention 4h², gated or plain MLP) + patch embedding +
    projector into the language model. An estimate: vision towers vary more than decoders."""
    h = int(v.get("hidden_size") or v.get("embed_dim") or 0)
    depth = int(v.get("depth") or v.get("num_hidden_layers") or 0)
    if not h or not depth:
        return 0
    inter = int(v.get("intermediate_size") or h * float(v.get("mlp_ratio") or 4))
    gated = str(v.get("hidden_act", "")).lower() in ("silu", "swiglu")
    block = 4 * h * h + 4 * h + (3 if gated else 2) * h * inter + (2 if gated else 1) * inter + h + 2 * h
    patch = int(v.get("patch_size") or 14)
    channels = int(v.get("in_channels") or v.get("num_channels") or 3)
    patch_embed = h * channels * patch * patch * int(v.get("temporal_patch_size") or 1)
    merge = int(v.get("spatial_merge_size") or 1)
    out = int(v.get("out_hidden_size") or text_hidden or h)
    m = h * merge * merge
    projector = h + m * m + m + m * out + out  # norm, Linear(m, m), Linear(m, out)
    return depth * block + patch_embed + projector


# ---------------------------------------------------------------------------------------------
# Tensors of the source model


@dataclass(frozen=True)
class TensorSpec:
    """One source tensor (or `count` identical ones, e.g. the experts of a layer).

    Linears are named by module and shaped [out, in]; other tensors by their full parameter name.
    """

    name: str
    shape: tuple[int, ...]
    role: str  # linear | embedding | norm | bias | router | vision
    count: int = 1
    layer: int | None = None
    input_group: str = ""  # Linears reading the same input share one GPTQ Hessian

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count


def model_tensors(s: ModelShape) -> list[TensorSpec]:
    """Every tensor the source checkpoint stores, by role, in transformers' naming."""
    p = s.prefix
    t: list[TensorSpec] = [TensorSpec(f"{p}.embed_tokens.weight", (s.vocab, s.hidden), "embedding")]

    def linear(name, out, inn, i, group, bias=False, count=1):
        t.append(TensorSpec(name, (out, inn), "linear", count, i, group))
        if bias:
            t.append(TensorSpec(f"{name}.bias", (out,), "bias", count, i))

    def norm(name, n, i):
        t.append(TensorSpec(f"{name}.weight", (n,), "norm", 1, i))

    def mlp(pre, inter, i, count=1, tag="mlp", bias=None):
        bias = s.mlp_bias if bias is None else bias
        linear(f"{pre}.gate_proj", inter, s.hidden, i, f"{tag}_in", bias, count)
        linear(f"{pre}.up_proj", inter, s.hidden, i, f"{tag}_in", bias, count)
        linear(f"{pre}.down_proj", s.hidden, inter, i, f"{tag}_down", bias, count)

    for i in range(s.layers):
        L = f"{p}.layers.{i}"
        a = f"{L}.self_attn"
        if s.is_mla:
            qk = s.qk_head_dim
            if s.q_lora_rank:
                linear(f"{a}.q_a_proj", s.q_lora_rank, s.hidden, i, "attn_in")
                norm(f"{a}.q_a_layernorm", s.q_lora_rank, i)
                linear(f"{a}.q_b_proj", s.heads * qk, s.q_lora_rank, i, "q_b")
            else:
                linear(f"{a}.q_proj", s.heads * qk, s.hidden, i, "attn_in")
            linear(f"{a}.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, s.hidden, i, "attn_in")
            norm(f"{a}.kv_a_layernorm", s.kv_lora_rank, i)
            linear(f"{a}.kv_b_proj", s.heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, i, "kv_b")
            linear(f"{a}.o_proj", s.hidden, s.heads * s.v_head_dim, i, "o_in")
        else:
            linear(f"{a}.q_proj", s.heads * s.head_dim, s.hidden, i, "attn_in", s.qkv_bias)
            linear(f"{a}.k_proj", s.kv_heads * s.head_dim, s.hidden, i, "attn_in", s.qkv_bias)
            linear(f"{a}.v_proj", s.kv_heads * s.head_dim, s.hidden, i, "attn_in", s.qkv_bias)
            linear(f"{a}.o_proj", s.hidden, s.heads * s.head_dim, i, "o_in", s.o_bias)
            if s.qk_norm:
                norm(f"{a}.q_norm", s.head_dim, i)
                norm(f"{a}.k_norm", s.head_dim, i)
            if s.sinks:
                t.append(TensorSpec(f"{a}.sinks", (s.heads,), "bias", 1, i))
        if s.is_moe and s.moe_layers[i]:
            m = f"{L}.{s.block}"
            t.append(TensorSpec(f"{m}.{s.router}.weight", (s.experts, s.hidden), "router", 1, i))
            if s.router_linear_bias:
                t.append(TensorSpec(f"{m}.{s.router}.bias", (s.experts,), "router", 1, i))
            if s.router_bias:
                t.append(TensorSpec(f"{m}.{s.router}.e_score_correction_bias", (s.experts,), "router", 1, i))
            # each expert sees its own tokens: its own Hessian (counted `experts` times)
            mlp(f"{m}.experts.*", s.expert_intermediate, i, s.experts, "expert", s.mlp_bias or s.expert_bias)
            if s.shared_style == "qwen":
                mlp(f"{m}.shared_expert", s.shared_intermediate, i, 1, "shared")
                t.append(TensorSpec(f"{m}.shared_expert_gate.weight", (1, s.hidden), "router", 1, i))
            elif s.shared_style == "deepseek" and s.shared_intermediate:
                mlp(f"{m}.shared_experts", s.shared_intermediate, i, 1, "shared")
            elif s.shared_style == "llama4":
                mlp(f"{m}.shared_expert", s.shared_intermediate, i, 1, "shared")
        else:
            mlp(f"{L}.{s.block}", s.dense_intermediate or s.intermediate, i)
        norm(f"{L}.input_layernorm", s.hidden, i)
        norm(f"{L}.post_attention_layernorm", s.hidden, i)
        if s.sandwich_norms:
            norm(f"{L}.pre_feedforward_layernorm", s.hidden, i)
            norm(f"{L}.post_feedforward_layernorm", s.hidden, i)
    t.append(TensorSpec(f"{p}.norm.weight", (s.hidden,), "norm"))
    if not s.tied:
        t.append(TensorSpec(s.lm_head, (s.vocab, s.hidden), "linear", input_group="lm_head"))
    if s.vision_params:
        t.append(TensorSpec("model.visual", (s.vision_params,), "vision"))
    return t


def scheme_of(recipe, name: str):
    """The scheme `recipe` gives a Linear of the plan (Recipe.scheme_for; None: kept in 16 bits). An expert template
    ('experts.*') is asked as expert 0: qtk's targets refuse to give experts of one layer different schemes."""
    return None if recipe is None else recipe.scheme_for(name.replace(".*.", ".0."))


# ---------------------------------------------------------------------------------------------
# The checkpoint a recipe produces


@dataclass(frozen=True)
class DiskTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    part: str  # quantized | scales | dense | kv_scales | vision
    count: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype] * self.count


def checkpoint_format(scheme) -> str | None:
    """compressed-tensors format of a Linear with this ModuleScheme (None: no scheme, dense): its weights' format's."""
    if scheme is None:
        return None
    return format_for(scheme.weights).ct_format(scheme)


def _quantized_linear(spec: TensorSpec, scheme, dtype: str) -> list[DiskTensor]:
    """The tensors one quantized Linear becomes on disk under its ModuleScheme (docs/formats.md, vllm): what its
    weights' format writes (Format.stored), and its static input scale, named by its activations' format."""
    n, c = spec.name, spec.count
    ts = [DiskTensor(f"{n}.{t.key}", t.shape, t.dtype, t.part, c)
          for t in format_for(scheme.weights).stored(scheme, spec.shape, dtype)]
    if scheme.static_activations:
        ts.append(DiskTensor(f"{n}.{input_scale_key(scheme)}", (1,), "float32", "scales", c))
    return ts


def _online_transform_tensors(s: ModelShape, recipe, dtype: str) -> list[DiskTensor]:
    """The matrix an online rotation (rotate_online) stores beside every quantized down_proj it applies to
    (qtk.export.codecs.ct_transform): [b, b] in the model dtype, b the rotation's block order."""
    if recipe is None or s.experts:
        return []
    step = recipe.step("rotate_online")
    if step is None:
        return []
    from qtk.export.codecs.ct_transform import group_for, tensor_name
    from qtk.quant.hadamard import largest_block

    b = step.params.block or largest_block(s.intermediate)
    mods = [t.name for t in model_tensors(s) if t.role == "linear" and scheme_of(recipe, t.name) is not None
            and (step.params.modules == "all" or t.name.endswith(".mlp.down_proj"))]
    group = group_for(mods)
    return [DiskTensor(tensor_name(m, group), (b, b), dtype, "dense") for m in mods]


def unties_embeddings(recipe) -> bool:
    """Whether a step of `recipe` writes a tied model's lm_head as a tensor of its own (the rotation does, unless the
    final norm is all ones, which config.json does not say: counted as untied)."""
    from qtk.recipe.params import STEP_PARAMS

    return recipe is not None and any(getattr(STEP_PARAMS[st.name], "unties_embeddings", False)
                                      for st in recipe.algorithm)


def checkpoint_tensors(s: ModelShape, recipe=None, dtype: str | None = None) -> list[DiskTensor]:
    """Every tensor of the checkpoint `qtk convert` writes for this recipe (None: the dense model)."""
    dtype = normalize_dtype(dtype, s.dtype)
    if s.tied and unties_embeddings(recipe):
        from dataclasses import replace

        s = replace(s, tied=False)
    out: list[DiskTensor] = []
    for spec in model_tensors(s):
        scheme = scheme_of(recipe, spec.name) if spec.role == "linear" else None
        if scheme is not None:
            out.extend(_quantized_linear(spec, scheme, dtype))
        elif spec.role == "linear":
            out.append(DiskTensor(f"{spec.name}.weight", spec.shape, dtype, "dense", spec.count))
        elif spec.role == "vision":
            out.append(DiskTensor(spec.name, spec.shape, dtype, "vision"))
        else:
            # routers stay dense: vLLM builds MoE gates without a quant method
            out.append(DiskTensor(spec.name, spec.shape, dtype, "dense", spec.count))
    out.extend(_online_transform_tensors(s, recipe, dtype))
    if recipe is not None and recipe.kv_cache is not None:
        for i in range(s.layers):
            for k in ("k_scale", "v_scale"):
                out.append(DiskTensor(f"{s.prefix}.layers.{i}.self_attn.{k}", (1,), "float32", "kv_scales"))
    return out


@dataclass(frozen=True)
class WeightBytes:
    """Checkpoint bytes by part; `total` is what a server loads (before tensor-parallel splitting)."""

    total: int
    quantized: int
    scales: int
    dense: int
    kv_scales: int
    vision: int
    params: int  # source parameters (text + vision estimate)
    quantized_params: int  # parameters stored in a quantized Linear
    experts: int  # bytes of routed experts (all parts): a decode step reads only the experts it routes to
    expert_params: int
    dtype: str

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def weight_bytes(s: ModelShape, recipe=None, dtype: str | None = None) -> WeightBytes:
    """Exact checkpoint bytes of the model under `recipe` (None: unquantized, in `dtype`)."""
    dtype = normalize_dtype(dtype, s.dtype)
    parts = {"quantized": 0, "scales": 0, "dense": 0, "kv_scales": 0, "vision": 0}
    experts = 0
    for t in checkpoint_tensors(s, recipe, dtype):
        parts[t.part] += t.nbytes
        if ".experts.*." in t.name:
            experts += t.nbytes
    specs = model_tensors(s)
    qparams = 0
    if recipe is not None:
        qparams = sum(x.numel for x in specs if x.role == "linear" and scheme_of(recipe, x.name) is not None)
    return WeightBytes(total=sum(parts.values()), params=sum(x.numel for x in specs), quantized_params=qparams,
                       experts=experts, expert_params=sum(x.numel for x in specs if ".experts.*." in x.name),
                       dtype=dtype, **parts)


# ---------------------------------------------------------------------------------------------
# KV cache


def kv_bytes_of(recipe, dtype: str) -> int:
    """Bytes per cached element: 1 when the recipe quantizes the KV cache, else the model dtype."""
    return 1 if recipe is not None and recipe.kv_cache is not None else DTYPE_BYTES[dtype]


def kv_elements_per_token(s: ModelShape, tp: int = 1) -> list[tuple[int, int | None]]:
    """Per layer: (cached elements per token on one GPU, sliding window or None).

    Standard attention caches K and V: 2 × kv_heads × head_dim; tensor parallelism splits KV heads
    and replicates them when there are fewer heads than GPUs. MLA caches one latent
    (kv_lora_rank + rope dims) that every GPU holds in full.
    """
    if s.is_mla:
        per = s.kv_lora_rank + s.qk_rope_head_dim
    else:
        per = 2 * -(-s.kv_heads // tp) * s.head_dim
    windows = s.windows or (None,) * s.layers
    return [(per, windows[i]) for i in range(s.layers)]


def kv_bytes_per_token(s: ModelShape, kv_bytes: int, tp: int = 1) -> int:
    """KV bytes one more token costs on one GPU, ignoring sliding-window caps."""
    return sum(e for e, _ in kv_elements_per_token(s, tp)) * kv_bytes


def kv_bytes_per_request(s: ModelShape, context: int, kv_bytes: int, tp: int = 1) -> int:
    """KV bytes of one request holding `context` tokens, sliding-window layers capped at their window."""
    return sum(e * (min(context, w) if w else context) for e, w in kv_elements_per_token(s, tp)) * kv_bytes


# ---------------------------------------------------------------------------------------------
# Serving memory on one GPU of a deployment


def activation_bytes(s: ModelShape, dtype_bytes: int, concurrency: int, tp: int = 1,
                     batched_tokens: int = DEFAULT_BATCHED_TOKENS) -> int:
    """Peak activation/workspace per GPU: one chunked-prefill step of `batched_tokens` through the widest
    layer (residual, q/k/v, MLP gate/up and product), plus fp32 logits and probabilities per sequence."""
    if s.is_moe:
        mlp = max(s.intermediate if not all(s.moe_layers) else 0,
                  s.top_k * s.expert_intermediate + s.shared_intermediate)
    else:
        mlp = s.intermediate
    attn = (s.heads * s.qk_head_dim + 2 * s.kv_heads * s.head_dim) // tp
    per_token = 4 * s.hidden + attn + 3 * mlp // tp
    logits = 2 * concurrency * s.vocab * 4  # logits are gathered in full on every rank
    return batched_tokens * per_token * dtype_bytes + logits


@dataclass(frozen=True)
class MemoryPlan:
    """Memory on one GPU: what the deployment needs against the budget (mem × utilisation). Every byte count is
    one GPU's; the KV fields say so in their names because a KV cache is usually quoted for the whole model."""

    budget: int
    weights: int
    kv_per_token_per_gpu: int  # one GPU's share under tensor parallelism (KV heads split or copied)
    kv_per_request_per_gpu: int
    kv_total_per_gpu: int
    activations: int
    overhead: int
    needed: int
    headroom: int
    fits: bool
    max_concurrency: int
    max_context: int
    max_context_limited_by: str  # memory | model (max_position_embeddings) | search (no model limit given)
    kv_bytes: int

    @property
    def headroom_fraction(self) -> float:
        return self.headroom / self.budget if self.budget else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["headroom_fraction"] = round(self.headroom_fraction, 4)
        return d


def plan_memory(s: ModelShape, weights: WeightBytes, *, mem_bytes: int, kv_bytes: int, context: int,
                concurrency: int, tp: int = 1, utilization: float = DEFAULT_UTILIZATION,
                overhead: int = DEFAULT_OVERHEAD_BYTES, batched_tokens: int = DEFAULT_BATCHED_TOKENS) -> MemoryPlan:
    """Fit `concurrency` requests of `context` tokens on each of `tp` GPUs of `mem_bytes`."""
    dbytes = DTYPE_BYTES[weights.dtype]
    budget = int(mem_bytes * utilization)
    # vLLM shards Linears and the vocabulary across ranks; norms are replicated but negligible
    w = -(-weights.total // tp)
    act0 = activation_bytes(s, dbytes, 0, tp, batched_tokens)
    logits_per_seq = activation_bytes(s, dbytes, 1, tp, batched_tokens) - act0
    per_req = kv_bytes_per_request(s, context, kv_bytes, tp)
    kv_total = per_req * concurrency
    act = act0 + logits_per_seq * concurrency
    needed = w + kv_total + act + overhead
    free = budget - w - act0 - overhead  # what KV and per-sequence buffers can use
    max_conc = max(0, free // (per_req + logits_per_seq)) if per_req + logits_per_seq else 0

    # longest context at this concurrency: KV grows monotonically with context, so bisect
    kv_room = free - logits_per_seq * concurrency
    model_max = s.max_position or 1 << 24
    if kv_room <= 0:
        max_ctx, limited = 0, "memory"
    elif kv_bytes_per_request(s, model_max, kv_bytes, tp) * concurrency <= kv_room:
        # without max_position_embeddings the search stops at 16M tokens: say so rather than call it a limit
        max_ctx, limited = model_max, "model" if s.max_position else "search"
    else:
        lo, hi = 0, model_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kv_bytes_per_request(s, mid, kv_bytes, tp) * concurrency <= kv_room:
                lo = mid
            else:
                hi = mid - 1
        max_ctx, limited = lo, "memory"
    return MemoryPlan(budget=budget, weights=w, kv_per_token_per_gpu=kv_bytes_per_token(s, kv_bytes, tp),
                      kv_per_request_per_gpu=per_req, kv_total_per_gpu=kv_total, activations=act, overhead=overhead,
                      needed=needed, headroom=budget - needed, fits=needed <= budget, max_concurrency=int(max_conc),
                      max_context=int(max_ctx), max_context_limited_by=limited, kv_bytes=kv_bytes)


# ---------------------------------------------------------------------------------------------
# What `qtk convert` needs


@dataclass(frozen=True)
class ConversionMemory:
    """Peak memory of `qtk convert`: one layer in fp32, embeddings, calibration activations, and what each step holds
    beside a layer (`steps`: its StepCost.memory_key -> (label, bytes); GPTQ's Hessians, AWQ's input cache)."""

    layer_fp32: int
    embeddings: int
    calibration: int
    steps: dict[str, tuple[str, int]]
    total: int
    notes: tuple[str, ...] = field(default=())

    def step_bytes(self, key: str) -> int:
        return self.steps.get(key, ("", 0))[1]

    @property
    def hessians(self) -> int:
        return self.step_bytes("hessians")

    @property
    def awq_cache(self) -> int:
        return self.step_bytes("awq_cache")

    @property
    def solver_state(self) -> int:
        """Bytes every step holds beside one layer."""
        return sum(b for _, b in self.steps.values())

    def as_dict(self) -> dict:
        return {"layer_fp32": self.layer_fp32, "embeddings": self.embeddings, "calibration": self.calibration,
                "hessians": self.hessians, "awq_cache": self.awq_cache,
                **{k: b for k, (_, b) in self.steps.items()}, "total": self.total, "notes": list(self.notes)}


def model_cost(s: ModelShape, recipe, num_samples: int | None = None, seq_len: int | None = None):
    """What a step's cost is computed from (qtk.recipe.params.ModelCost): the decoder layers' quantized Linears by
    input group, from config.json alone."""
    from qtk.recipe.params import InputGroup, ModelCost

    specs = model_tensors(s)
    lin = [x for x in specs if x.role == "linear" and x.layer is not None]
    groups: dict[tuple[int, str], InputGroup] = {}
    for x in lin:
        if scheme_of(recipe, x.name) is None:
            continue
        key = (x.layer, x.input_group)
        g = groups.get(key)
        groups[key] = (InputGroup(x.layer, x.shape[1], x.shape[0] * x.count, x.count) if g is None
                       else InputGroup(g.layer, g.width, g.rows + x.shape[0] * x.count, g.copies))
    n = num_samples or recipe.calibration.num_samples
    t = seq_len or recipe.calibration.seq_len
    return ModelCost(layers=max(s.layers, 1), layer_params=sum(x.numel for x in lin) / max(s.layers, 1), tokens=n * t,
                     groups=tuple(groups.values()), widest=max((x.shape[1] for x in lin), default=0), samples=n)


def step_costs(s: ModelShape, recipe, num_samples: int | None = None, seq_len: int | None = None) -> list:
    """Each listed step's StepCost (its parameters' cost(), qtk.recipe.params), in the recipe's order."""
    model = model_cost(s, recipe, num_samples, seq_len)
    return [step.params.cost(model) for step in recipe.algorithm]


def conversion_memory(s: ModelShape, recipe=None, *, num_samples: int | None = None,
                      seq_len: int | None = None) -> ConversionMemory:
    """What converting this model with `recipe` holds at once (docs/architecture.md: O(one layer))."""
    specs = model_tensors(s)
    per_layer: dict[int, int] = {}
    for x in specs:
        if x.layer is not None:
            per_layer[x.layer] = per_layer.get(x.layer, 0) + x.numel
    layer_fp32 = max(per_layer.values(), default=0) * 4
    embeddings = s.vocab * s.hidden * DTYPE_BYTES[s.dtype]
    notes = []
    calibration = 0
    steps: dict[str, tuple[str, int]] = {}
    if recipe is not None and recipe.needs_calibration:
        n = num_samples or recipe.calibration.num_samples
        t = seq_len or recipe.calibration.seq_len
        # the layer's inputs and outputs for every sample, fp32, swapped after each layer
        calibration = 2 * n * t * s.hidden * 4
        notes.append(f"calibration: {n} samples × {t} tokens × hidden {s.hidden} × 4 B × 2 copies")
        for c in step_costs(s, recipe, n, t):
            if c.memory_key:
                steps[c.memory_key] = (c.memory_label, c.memory)
            if c.memory_note:
                notes.append(c.memory_note)
    else:
        notes.append("no calibration: weights stream layer by layer")
    total = layer_fp32 + embeddings + calibration + sum(b for _, b in steps.values())
    return ConversionMemory(layer_fp32, embeddings, calibration, steps, total, tuple(notes))
