"""Architecture knowledge as data, keyed by the HF `model_type`: the one table of families (FAMILIES). For each
family qtk converts, an `Arch` (module names, sub-block order, fusion groups, smoothing pairs, MoE layout,
TensorRT-LLM names); for each family `qtk plan` knows, the planning `Traits` (what config.json leaves unsaid);
the transformers class. `Geometry` reads a decoder's sizes from a config (the TensorRT-LLM writer and reader shard
by it). ARCHS and TRAITS are views of FAMILIES. No isinstance or substring chains elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qtk.errors import UsageError

Q, K, V, O = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
GATE, UP, DOWN = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"


@dataclass(frozen=True)
class SmoothPair:
    """A scale s on `prev`'s output channels folds into the input columns of `nexts` (AWQ, SmoothQuant)."""

    prev: str  # a norm (weight /= s) or a Linear (rows /= s)
    nexts: tuple[str, ...]
    prev_is_norm: bool
    # modules that read the same input but stay unquantized (an MoE router): s is folded into them too, so
    # their float output does not change; they do not enter the choice of s
    dense: tuple[str, ...] = ()
    # the module whose input is the pair's input for every token (default nexts[0]; an MoE expert sees only
    # the tokens routed to it, the router sees all of them)
    observe: str | None = None

    @property
    def observed(self) -> str:
        return self.observe or self.nexts[0]


@dataclass(frozen=True)
class MoE:
    """A sparse MoE block as checkpoints (and vLLM) hold it: one gate/up/down Linear per expert under
    `{block}.experts.{e}.`, and a router Linear `{block}.{router}` that stays dense. transformers 5 fuses
    the experts into 3-D parameters on load; qtk.model.moe splits them back into Linears."""

    block: str  # "block_sparse_moe" (Mixtral) | "mlp" (Qwen3-MoE)
    gate: str  # per-expert Linear names: the activated branch, the multiplied branch, the output
    up: str
    down: str
    router: str = "gate"

    def expert(self, e: int, which: str) -> str:
        return f"{self.block}.experts.{e}.{which}"

    @property
    def router_name(self) -> str:
        return f"{self.block}.{self.router}"


@dataclass(frozen=True)
class Arch:
    name: str
    model_types: tuple[str, ...]
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    attn: str = "self_attn"
    # Linears of one decoder layer, in the order data flows through them ("true sequential" order)
    linears: tuple[str, ...] = (Q, K, V, O, GATE, UP, DOWN)
    # Linears that read the same input: one Hessian / activation statistic, one per-tensor scale
    fusion_groups: tuple[tuple[str, ...], ...] = ((Q, K, V), (GATE, UP))
    smoothing: tuple[SmoothPair, ...] = (
        SmoothPair("input_layernorm", (Q, K, V), True),
        SmoothPair(V, (O,), False),
        SmoothPair("post_attention_layernorm", (GATE, UP), True),
        SmoothPair(UP, (DOWN,), False),
    )
    norm_one_plus: bool = False  # Gemma: effective norm weight is 1 + w
    clip_skip: tuple[str, ...] = (Q, K)  # AWQ clip search skips q/k: their error is amplified by softmax
    # TensorRT-LLM checkpoint names of the layer's modules (gate_proj is TRT's `fc`, up_proj its `gate`)
    trtllm_architecture: str | None = "LlamaForCausalLM"
    trtllm_decoder: str = "llama"  # the PretrainedConfig `decoder` field ModelOpt writes for the family
    trtllm_names: dict[str, str] = field(default_factory=lambda: {
        "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_layernorm",
        O: "attention.dense", GATE: "mlp.fc", UP: "mlp.gate", DOWN: "mlp.proj",
    })
    # fusion groups vLLM loads as one module, and that module's name (its packed_modules_mapping): a per-module scheme
    # for such a group must also name the fused module, which vLLM looks up by its own name
    vllm_fused: tuple[tuple[tuple[str, ...], str], ...] = (((Q, K, V), "self_attn.qkv_proj"), ((GATE, UP), "mlp.gate_up_proj"))
    moe: MoE | None = None  # set for sparse-MoE families; arch_for then lists every expert's Linears
    num_experts: int = 0
    # Linears whose static input scale the engine takes as one (vLLM's fused MoE uses the max over experts
    # of w13's and of w2's input scales): calibrated separately, written as the group's max
    shared_input_scale: tuple[tuple[str, ...], ...] = ()

    def fusion_group_of(self, linear: str) -> tuple[str, ...]:
        return next((g for g in self.fusion_groups if linear in g), (linear,))

    @property
    def dense_linears(self) -> tuple[str, ...]:
        """Linears of a layer that always stay unquantized (MoE routers); writers list them as excluded."""
        return () if self.moe is None else (self.moe.router_name,)


LLAMA = Arch("llama", ("llama", "mistral"))
QWEN2 = Arch("qwen2", ("qwen2",), trtllm_architecture="Qwen2ForCausalLM", trtllm_decoder="qwen")
QWEN3 = Arch("qwen3", ("qwen3",), trtllm_architecture="Qwen3ForCausalLM", trtllm_decoder="qwen")
# Gemma 2/3: RMSNorm scales by (1 + w); the MLP's input norm is pre_feedforward_layernorm
# (post_attention_layernorm normalises the attention output before the residual add)
GEMMA = Arch(
    "gemma", ("gemma2", "gemma3_text"),
    smoothing=(
        SmoothPair("input_layernorm", (Q, K, V), True),
        SmoothPair(V, (O,), False),
        SmoothPair("pre_feedforward_layernorm", (GATE, UP), True),
        SmoothPair(UP, (DOWN,), False),
    ),
    norm_one_plus=True,
    trtllm_architecture=None,
)
# Phi-3 stores q/k/v and gate/up already fused: each fused Linear is quantized as one (as vLLM loads it)
QKV, GATE_UP = "self_attn.qkv_proj", "mlp.gate_up_proj"
PHI3 = Arch(
    "phi3", ("phi3",),
    linears=(QKV, O, GATE_UP, DOWN),
    fusion_groups=(),
    smoothing=(
        SmoothPair("input_layernorm", (QKV,), True),
        SmoothPair("post_attention_layernorm", (GATE_UP,), True),
    ),
    clip_skip=(QKV,),
    trtllm_architecture=None,
    vllm_fused=(),
)

# Sparse MoE: attention as Llama's; the MLP is a router plus E experts. The expert Linears are filled in
# per config by arch_for (with_experts). TensorRT-LLM is refused: qtk writes no MoE TensorRT-LLM checkpoint.
MIXTRAL = Arch("mixtral", ("mixtral",), linears=(Q, K, V, O), fusion_groups=((Q, K, V),), smoothing=(),
               trtllm_architecture=None, vllm_fused=(((Q, K, V), "self_attn.qkv_proj"),),
               moe=MoE("block_sparse_moe", "w1", "w3", "w2"))
QWEN3_MOE = Arch("qwen3_moe", ("qwen3_moe",), linears=(Q, K, V, O), fusion_groups=((Q, K, V),), smoothing=(),
                 trtllm_architecture=None, vllm_fused=(((Q, K, V), "self_attn.qkv_proj"),),
                 moe=MoE("mlp", "gate_proj", "up_proj", "down_proj"))



@dataclass(frozen=True)
class Traits:
    """What config.json does not say explicitly about a family, for `qtk plan` (which counts bytes from the config
    alone, also for families qtk cannot convert)."""

    qkv_bias: bool | None = None  # None: the config's attention_bias decides (and covers o_proj)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # extra pre/post feed-forward norms (Gemma 2/3)
    tie_default: bool = False  # tie_word_embeddings when config.json omits it (the HF class default)
    sliding: str = "layer_types"  # how sliding-window layers are chosen when layer_types is absent
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias next to the router


@dataclass(frozen=True)
class Family:
    """One HF model_type. arch: how qtk converts it (None: planned only); traits: how `qtk plan` counts it (None: as
    a Llama-style decoder, with a note); hf_class: the transformers causal-LM class (a TensorRT-LLM checkpoint read
    back names it)."""

    arch: Arch | None
    traits: Traits | None = Traits()
    hf_class: str | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family(LLAMA, Traits(), "LlamaForCausalLM"),
    "mistral": Family(LLAMA, Traits(sliding="all"), "MistralForCausalLM"),
    "mixtral": Family(MIXTRAL, Traits(sliding="all"), "MixtralForCausalLM"),
    "qwen2": Family(QWEN2, Traits(qkv_bias=True, sliding="qwen"), "Qwen2ForCausalLM"),
    "qwen2_moe": Family(None, Traits(qkv_bias=True, sliding="qwen")),
    "qwen2_vl": Family(None, Traits(qkv_bias=True)),
    "qwen2_vl_text": Family(None, Traits(qkv_bias=True)),
    "qwen2_5_vl": Family(None, Traits(qkv_bias=True)),
    "qwen2_5_vl_text": Family(None, Traits(qkv_bias=True)),
    "qwen3": Family(QWEN3, Traits(qk_norm=True, sliding="qwen"), "Qwen3ForCausalLM"),
    "qwen3_moe": Family(QWEN3_MOE, Traits(qk_norm=True, sliding="qwen"), "Qwen3MoeForCausalLM"),
    "gemma": Family(None, Traits(tie_default=True)),
    "gemma2": Family(GEMMA, Traits(sandwich_norms=True, tie_default=True, sliding="alternate"), "Gemma2ForCausalLM"),
    "gemma3_text": Family(GEMMA, Traits(qk_norm=True, sandwich_norms=True, tie_default=True, sliding="pattern"),
                          "Gemma3ForCausalLM"),
    "phi3": Family(PHI3, None, "Phi3ForCausalLM"),
    "deepseek_v2": Family(None, Traits()),
    "deepseek_v3": Family(None, Traits(router_bias=True)),
    "kimi_k2": Family(None, Traits(router_bias=True)),
}
ARCHS: dict[str, Arch] = {mt: f.arch for mt, f in FAMILIES.items() if f.arch is not None}  # what qtk converts
TRAITS: dict[str, Traits] = {mt: f.traits for mt, f in FAMILIES.items() if f.traits is not None}  # what qtk plan knows
# model types qtk writes TensorRT-LLM checkpoints for, and the class names those checkpoints are read back by
TRTLLM_MODEL_TYPES: tuple[str, ...] = tuple(mt for mt, a in ARCHS.items() if a.trtllm_architecture is not None)
HF_CLASS_TO_MODEL_TYPE: dict[str, str] = {FAMILIES[mt].hf_class: mt for mt in TRTLLM_MODEL_TYPES}


@dataclass(frozen=True)
class Geometry:
    """The sizes of a decoder, from an HF config (dict or object) or a TensorRT-LLM config.json (same keys, with
    head_size as an alias of head_dim)."""

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
                   int(get("num_key_value_heads") or heads),
                   int(get("head_dim") or get("head_size") or get("hidden_size") // heads),
                   int(get("vocab_size")))

    def kv_per_rank(self, tp: int) -> int:
        return max(self.kv_heads // tp, 1)


def num_experts(config: dict) -> int:
    n = config.get("num_local_experts", config.get("num_experts"))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"config.json of this {config.get('model_type')} model gives no expert count "
                         "(num_local_experts / num_experts)", "restore the model's original config.json")
    return n


def with_experts(arch: Arch, config: dict) -> Arch:
    """The MoE architecture for one config: every expert's Linears in data-flow order (all gate/up, then all
    down: an expert's input never depends on another expert), gate/up fused per expert (vLLM's w13), the
    post-attention norm smoothed into every expert's gate/up and folded into the router, up -> down per expert."""
    m = arch.moe
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1) or 1) != 1:
        raise UsageError(f"this {config.get('model_type')} config mixes dense and MoE layers (mlp_only_layers / "
                         "decoder_sparse_step)", "qtk converts MoE models whose every layer is sparse; use another tool for this one")
    if config.get("shared_expert_intermediate_size"):
        raise UsageError("this MoE config has a shared expert, which qtk does not handle yet",
                         "use a model without shared experts (Mixtral, Qwen3-MoE)")
    E = num_experts(config)
    gates = [m.expert(e, m.gate) for e in range(E)]
    ups = [m.expert(e, m.up) for e in range(E)]
    downs = [m.expert(e, m.down) for e in range(E)]
    gate_up = tuple(x for e in range(E) for x in (gates[e], ups[e]))
    return replace(
        arch,
        num_experts=E,
        linears=arch.linears + gate_up + tuple(downs),
        fusion_groups=arch.fusion_groups + tuple((gates[e], ups[e]) for e in range(E)),
        smoothing=(
            SmoothPair("input_layernorm", (Q, K, V), True),
            SmoothPair(V, (O,), False),
            SmoothPair("post_attention_layernorm", gate_up, True, dense=(m.router_name,), observe=m.router_name),
            *(SmoothPair(ups[e], (downs[e],), False) for e in range(E)),
        ),
        shared_input_scale=(gate_up, tuple(downs)),
    )


def arch_for(model_type: str | None, config: dict | None = None) -> Arch:
    """The architecture of a model_type; MoE families need the config (their Linears depend on the expert count)."""
    if model_type not in ARCHS:
        raise UsageError(f"model_type '{model_type}' is not supported",
                         f"supported: {', '.join(sorted(ARCHS))}")
    arch = ARCHS[model_type]
    if arch.moe is not None:
        if config is None:
            raise ValueError(f"arch_for({model_type!r}) needs the config: an MoE architecture depends on its expert count")
        arch = with_experts(arch, config)
    return arch


def naming(model_type: str | None) -> Arch:
    """The module names of a family (layers, embeddings, attention): its Arch, or Llama's (model.layers.N.self_attn)
    for a family outside the table, which most decoder-only checkpoints follow."""
    return ARCHS.get(model_type, LLAMA)
