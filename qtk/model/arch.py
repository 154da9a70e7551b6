"""Architecture knowledge as data, keyed by the HF `model_type`: the one table of families (FAMILIES). For each
family qtk converts, an `Arch` (module names, sub-block order, fusion groups, smoothing pairs, MoE layout,
TensorRT-LLM names); for each family `qtk plan` knows, the planning `Traits` (what config.json leaves unsaid);
the transformers class. `Geometry` reads a decoder's sizes from a config (the TensorRT-LLM writer and reader shard
by it). ARCHS and TRAITS are views of FAMILIES. No isinstance or substring chains elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

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
class FusedExperts:
    """transformers 5's fused expert parameters: gate_up [E, 2I, H] and down [E, H, I] ([out, in] per expert, gate
    rows then up rows) for Qwen3-MoE / Mixtral; gpt-oss holds them transposed ([E, in, out]: gate_up [E, H, 2I],
    down [E, I, H]) with gate and up interleaved along the 2I axis (gate = [..., ::2], up = [..., 1::2]) and a
    `{name}_bias` beside each. `stored_fused`: the checkpoint stores them so too (gpt-oss), instead of per-expert
    Linears that transformers fuses on load."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    transposed: bool = False
    interleaved: bool = False
    stored_fused: bool = False

    def gate_up_rows(self, which: int, inter: int) -> slice:
        """The rows of the [2I, H] (out-major) gate_up matrix that are gate's (which 0) or up's (which 1)."""
        return slice(which, None, 2) if self.interleaved else slice(which * inter, (which + 1) * inter)


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
    # an expert every token goes through, next to the routed ones (its gate/up/down named as the routed experts'):
    # Qwen2-MoE's "shared_expert", scaled by the sigmoid of a dense Linear(hidden, 1) `shared_gate`
    shared: str | None = None
    shared_gate: str | None = None
    # the expert Linears carry biases (gpt-oss: gate_up_proj_bias, down_proj_bias); the router's own bias is a
    # parameter of the router module, kept with its weight
    bias: bool = False
    # how transformers 5 holds the experts fused (and, for `stored_fused`, how the checkpoint stores them)
    fused: FusedExperts = FusedExperts()
    # the block's attribute name in transformers' decoder layer (the layer's forward reads it), where the checkpoint's
    # name `block` differs from it (Mixtral: transformers' `mlp`, the checkpoint's `block_sparse_moe`)
    module: str = "mlp"
    # Llama 4: the router's score scales each routed expert's INPUT (x * sigmoid(logit), an expert computing on the
    # scaled token), not its output; transformers' block passes the experts every token scaled by its score for each
    # expert (0 where not routed), and vLLM's fused MoE applies the weight on the input too
    input_scaled: bool = False
    # the expert's activation: "silu" (down(silu(gate) * up)) or "clamped_swiglu" (gpt-oss: gate clamped above and
    # up on both sides at swiglu_limit, down((up + 1) * gate * sigmoid(swiglu_alpha * gate))); the clamp is not
    # linear in up, so smoothing up -> down would change the function: no such pair for it
    activation: str = "silu"
    # vLLM's loader for the family reads quantized experts as per-expert Linears (compressed-tensors' layout); gpt-oss's
    # (vLLM 0.32 gpt_oss.py) reads them only as MXFP4, quark's fused tensors or its own per-expert w13_* / w2_* names
    vllm_reads_per_expert: bool = True
    # the config lists the sparse layers (Llama 4's moe_layers, or every interleave_moe_layer_step-th layer): the others
    # hold an ordinary MLP of the block's name (Arch.dense_layers)
    interleaved: bool = False

    @property
    def up_smoothable(self) -> bool:
        """Whether a scale on up's outputs folds exactly into down's inputs (the activation is linear in up)."""
        return self.activation == "silu"

    def expert(self, e: int, which: str) -> str:
        return f"{self.block}.experts.{e}.{which}"

    def shared_linear(self, which: str) -> str:
        return f"{self.block}.{self.shared}.{which}"

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
    # a family whose MoE models hold dense layers too (DeepSeek's first first_k_dense_replace layers, Llama 4's layers
    # outside moe_layers): the indices of those layers, from the config, and their own Arch; the model's Arch (this
    # one) is its sparse layers', and `at(i)` gives each layer's
    dense_layers: frozenset[int] = frozenset()
    dense_layer: "Arch | None" = None
    # why the family's KV cache cannot be quantized as qtk calibrates it (None: per-layer K and V scales apply)
    kv_cache_refusal: str | None = None
    # the family's modules depend on its config beyond the expert count (DeepSeek's q_lora_rank): arch_for applies it
    for_config: "Callable[[Arch, dict], Arch] | None" = None

    def at(self, i: int) -> "Arch":
        """The Arch of decoder layer i (its Linears, groups and smoothing pairs)."""
        return self.dense_layer if self.dense_layer is not None and i in self.dense_layers else self
    # a learned sink logit per attention head (gpt-oss's self_attn.sinks): its attention runs the model's eager code,
    # the only one that has it; the sinks stay in 16 bits
    attn_sinks: bool = False
    # vision-language models: the modules outside the language model (vision tower, projector), by transformers' names;
    # they stay in 16 bits, their tensors copied as stored, and the skeleton is the image-text-to-text class
    multimodal: tuple[str, ...] = ()

    def fusion_group_of(self, linear: str) -> tuple[str, ...]:
        return next((g for g in self.fusion_groups if linear in g), (linear,))

    def is_expert(self, linear: str) -> bool:
        """Whether a layer's Linear (relative name) belongs to a routed expert, which sees only the tokens routed to
        it (a shared expert sees every token)."""
        return self.moe is not None and linear.startswith(f"{self.moe.block}.experts.")

    @property
    def dense_linears(self) -> tuple[str, ...]:
        """Linears of a layer that always stay unquantized (MoE routers); writers list them as excluded."""
        if self.moe is None:
            return ()
        m = self.moe
        return (m.router_name,) + ((f"{m.block}.{m.shared_gate}",) if m.shared_gate else ())


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

# Qwen2-MoE: Qwen2's attention (q/k/v biases); every token also goes through a shared expert, scaled by a sigmoid
# gate (Linear(hidden, 1)) that vLLM runs as a plain torch Linear, so it stays 16-bit with the router
QWEN2_MOE = Arch("qwen2_moe", ("qwen2_moe",), linears=(Q, K, V, O), fusion_groups=((Q, K, V),), smoothing=(),
                 trtllm_architecture=None, vllm_fused=(((Q, K, V), "self_attn.qkv_proj"),),
                 moe=MoE("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_expert",
                         shared_gate="shared_expert_gate"))

# GLM-4.5 / 4.6: Llama-style attention (q/k/v biases, optional q/k norms), DeepSeek-style MoE: dense first layers, a
# router with e_score_correction_bias (vLLM's GateLinear, no quant_config), shared experts quantized
GLM4_MOE = Arch("glm4_moe", ("glm4_moe",), linears=(Q, K, V, O), fusion_groups=((Q, K, V),), smoothing=(),
                trtllm_architecture=None, vllm_fused=(((Q, K, V), "self_attn.qkv_proj"),),
                moe=MoE("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts"))

# gpt-oss: Llama-style attention with biases on q/k/v/o and a learned sink logit per head (`self_attn.sinks`, kept in
# 16 bits), sliding and full attention alternating (layer_types); every layer an MoE block whose router is a Linear with
# a bias (`mlp.router`, kept in 16 bits) and whose experts carry biases and a clamped SwiGLU. The checkpoint stores the
# experts fused as transformers holds them (or as MXFP4 blocks, qtk.model.prequantized); qtk reads them as per-expert
# Linears `mlp.experts.{e}.gate_proj/up_proj/down_proj` (with their biases) and writes them so
GPT_OSS = Arch("gpt_oss", ("gpt_oss",), linears=(Q, K, V, O), fusion_groups=((Q, K, V),), smoothing=(),
               trtllm_architecture=None, vllm_fused=(((Q, K, V), "self_attn.qkv_proj"),), attn_sinks=True,
               moe=MoE("mlp", "gate_proj", "up_proj", "down_proj", router="router", bias=True,
                       fused=FusedExperts(transposed=True, interleaved=True, stored_fused=True),
                       activation="clamped_swiglu", vllm_reads_per_expert=False))

# DeepSeek-V3 / R1 and Kimi-K2 (the same architecture under its own model_type, which transformers has no class for:
# qtk reads its config.json with DeepseekV3Config, as vLLM does): multi-head latent attention. The query goes
# through a low-rank pair q_a_proj -> q_a_layernorm -> q_b_proj (q_proj where q_lora_rank is null); K and V come from
# one compressed latent, kv_a_proj_with_mqa (kv_lora_rank + the shared RoPE key) -> kv_a_layernorm -> kv_b_proj.
# vLLM (deepseek_v2.py) runs every one of them with the checkpoint's quant_config: q_a_proj and kv_a_proj_with_mqa
# as one fused_qkv_a_proj, q_b_proj / q_proj / kv_b_proj column-parallel (MLA dequantizes kv_b_proj to absorb it),
# o_proj row-parallel; the router (GateLinear) has no quant_config and its e_score_correction_bias is float32. So all
# attention Linears, the shared experts and the dense layers' MLPs are quantized; the router stays 16-bit.
QA, QB, KVA, KVB = "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"


def mla(arch: Arch, config: dict) -> Arch:
    """DeepSeek's attention for one config: without q_lora_rank the query is one q_proj, which vLLM runs apart from
    kv_a_proj_with_mqa (no fused_qkv_a_proj)."""
    if config.get("q_lora_rank"):
        return arch
    return replace(arch, linears=(Q, KVA, KVB, O), fusion_groups=(), vllm_fused=(),
                   smoothing=(SmoothPair("input_layernorm", (Q, KVA), True),
                              SmoothPair("self_attn.kv_a_layernorm", (KVB,), True)))


DEEPSEEK_V3 = Arch("deepseek_v3", ("deepseek_v3",), linears=(QA, KVA, QB, KVB, O), fusion_groups=((QA, KVA),),
                   smoothing=(SmoothPair("input_layernorm", (QA, KVA), True),
                              SmoothPair("self_attn.q_a_layernorm", (QB,), True),
                              SmoothPair("self_attn.kv_a_layernorm", (KVB,), True)),
                   clip_skip=(Q, QA, QB, KVA, KVB), trtllm_architecture=None,
                   vllm_fused=(((QA, KVA), "self_attn.fused_qkv_a_proj"),),
                   moe=MoE("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts"),
                   kv_cache_refusal="vLLM caches MLA's compressed latent (kv_lora_rank + qk_rope_head_dim per token), "
                                    "not per-head K and V, so qtk's K/V scales do not apply",
                   for_config=mla)
# Llama 4 (Scout, Maverick): Llama-style attention whose RoPE layers attend within chunks of attention_chunk_size and
# whose every 4th layer (no_rope_layers) has no RoPE and a temperature-tuned query; a weightless q/k L2 norm. Nothing
# there is quantized otherwise: the simulation runs the model's own attention module. The feed-forward block
# (`feed_forward`) is an MoE block in the layers moe_layers lists (Maverick interleaves them with dense MLPs of
# intermediate_size_mlp) with a sigmoid top-k router (`router`, kept in 16 bits, as vLLM runs it without quant_config),
# a shared expert every token goes through, and routed experts whose INPUT the router's score scales. The checkpoint
# stores the experts fused as transformers holds them (gate_up_proj [E, H, 2I], gate then up; down_proj [E, I, H]);
# qtk reads and writes them as per-expert Linears `feed_forward.experts.{e}.gate_proj/up_proj/down_proj`, the names
# vLLM's llama4.py loads quantized experts by
LLAMA4_TEXT = Arch("llama4_text", ("llama4_text",), linears=(Q, K, V, O), fusion_groups=((Q, K, V),), smoothing=(),
                   trtllm_architecture=None, vllm_fused=(((Q, K, V), "self_attn.qkv_proj"),),
                   moe=MoE("feed_forward", "gate_proj", "up_proj", "down_proj", router="router", shared="shared_expert",
                           module="feed_forward", input_scaled=True, interleaved=True,
                           fused=FusedExperts(transposed=True, stored_fused=True)))
# Vision-language models: the language model as its text family's, under transformers' names for the multimodal class
# (checkpoints of other vintages are renamed on reading, as transformers renames them on loading)
_VL_TEXT = dict(layers="model.language_model.layers", embed="model.language_model.embed_tokens",
                final_norm="model.language_model.norm", trtllm_architecture=None)
GEMMA3_VL = replace(GEMMA, name="gemma3", model_types=("gemma3",), multimodal=("model.vision_tower", "model.multi_modal_projector"),
                    **_VL_TEXT)
QWEN2_5_VL = replace(QWEN2, name="qwen2_5_vl", model_types=("qwen2_5_vl",), multimodal=("model.visual",), **_VL_TEXT)
QWEN3_VL = replace(QWEN3, name="qwen3_vl", model_types=("qwen3_vl",), multimodal=("model.visual",), **_VL_TEXT)
# Llama 4's multimodal class holds the whole causal LM under `language_model` (its lm_head too), beside vision_model and
# multi_modal_projector, the names its checkpoints store
LLAMA4_VL = replace(LLAMA4_TEXT, name="llama4", model_types=("llama4",), multimodal=("vision_model", "multi_modal_projector"),
                    layers="language_model.model.layers", embed="language_model.model.embed_tokens",
                    final_norm="language_model.model.norm", lm_head="language_model.lm_head")



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
    router: str = "gate"  # the router's module name in the MoE block
    router_linear_bias: bool = False  # the router Linear has a bias (gpt-oss)
    expert_bias: bool = False  # every expert Linear has a bias (gpt-oss)
    sinks: bool = False  # a learned attention-sink logit per head, self_attn.sinks [heads] (gpt-oss)
    block: str = "mlp"  # the feed-forward block's name in a decoder layer (Llama 4: feed_forward)


@dataclass(frozen=True)
class Family:
    """One HF model_type. arch: how qtk converts it (None: planned only); traits: how `qtk plan` counts it (None: as
    a Llama-style decoder, with a note); hf_class: the transformers causal-LM class (a TensorRT-LLM checkpoint read
    back names it)."""

    arch: Arch | None
    traits: Traits | None = Traits()
    hf_class: str | None = None
    # the model_type whose transformers config class reads this family's config.json, where transformers has none of
    # its own: Kimi-K2 is DeepSeek-V3's architecture under another name (vLLM reads it with DeepseekV3Config too)
    config_as: str | None = None


# Llama 4's block is `feed_forward` with a `router` and a `shared_expert` of intermediate_size; dense layers' MLPs are
# intermediate_size_mlp wide; RoPE layers attend within attention_chunk_size tokens
LLAMA4_TRAITS = Traits(router="router", block="feed_forward", sliding="chunked")

FAMILIES: dict[str, Family] = {
    "llama": Family(LLAMA, Traits(), "LlamaForCausalLM"),
    "mistral": Family(LLAMA, Traits(sliding="all"), "MistralForCausalLM"),
    "mixtral": Family(MIXTRAL, Traits(sliding="all"), "MixtralForCausalLM"),
    "qwen2": Family(QWEN2, Traits(qkv_bias=True, sliding="qwen"), "Qwen2ForCausalLM"),
    "qwen2_vl": Family(None, Traits(qkv_bias=True)),
    "qwen2_vl_text": Family(None, Traits(qkv_bias=True)),
    "qwen2_5_vl_text": Family(None, Traits(qkv_bias=True)),
    "qwen3": Family(QWEN3, Traits(qk_norm=True, sliding="qwen"), "Qwen3ForCausalLM"),
    "qwen3_moe": Family(QWEN3_MOE, Traits(qk_norm=True, sliding="qwen"), "Qwen3MoeForCausalLM"),
    "gemma": Family(None, Traits(tie_default=True)),
    "gemma2": Family(GEMMA, Traits(sandwich_norms=True, tie_default=True, sliding="alternate"), "Gemma2ForCausalLM"),
    "gemma3_text": Family(GEMMA, Traits(qk_norm=True, sandwich_norms=True, tie_default=True, sliding="pattern"),
                          "Gemma3ForCausalLM"),
    "phi3": Family(PHI3, None, "Phi3ForCausalLM"),
    "deepseek_v2": Family(None, Traits()),
    "kimi_k2": Family(DEEPSEEK_V3, Traits(router_bias=True), "DeepseekV3ForCausalLM", config_as="deepseek_v3"),
    "qwen2_moe": Family(QWEN2_MOE, Traits(qkv_bias=True, sliding="qwen"), "Qwen2MoeForCausalLM"),
    "deepseek_v3": Family(DEEPSEEK_V3, Traits(router_bias=True), "DeepseekV3ForCausalLM"),
    "glm4_moe": Family(GLM4_MOE, Traits(router_bias=True), "Glm4MoeForCausalLM"),
    "gpt_oss": Family(GPT_OSS, Traits(router="router", router_linear_bias=True, expert_bias=True, sinks=True),
                      "GptOssForCausalLM"),
    # vision-language models (the language model converted, the vision tower and projector kept in 16 bits)
    "gemma3": Family(GEMMA3_VL, Traits(qk_norm=True, sandwich_norms=True, tie_default=True, sliding="pattern"),
                     "Gemma3ForConditionalGeneration"),
    "qwen2_5_vl": Family(QWEN2_5_VL, Traits(qkv_bias=True), "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": Family(QWEN3_VL, Traits(qk_norm=True), "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_text": Family(None, Traits(qk_norm=True)),  # its text_config's model_type, which qtk plan reads
    "llama4_text": Family(LLAMA4_TEXT, LLAMA4_TRAITS, "Llama4ForCausalLM"),
    "llama4": Family(LLAMA4_VL, LLAMA4_TRAITS, "Llama4ForConditionalGeneration"),
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
    n = config.get("num_local_experts", config.get("num_experts", config.get("n_routed_experts")))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"config.json of this {config.get('model_type')} model gives no expert count "
                         "(num_local_experts / num_experts / n_routed_experts)", "restore the model's original config.json")
    return n


def with_experts(arch: Arch, config: dict) -> Arch:
    """The MoE architecture for one config: every expert's Linears in data-flow order (all gate/up, then all
    down: an expert's input never depends on another expert), gate/up fused per expert (vLLM's w13), the
    post-attention norm smoothed into every expert's gate/up and folded into the router, up -> down per expert."""
    m = arch.moe
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1) or 1) != 1 \
            or int(config.get("moe_layer_freq", 1) or 1) != 1:
        raise UsageError(f"this {config.get('model_type')} config mixes dense and MoE layers (mlp_only_layers / "
                         "decoder_sparse_step / moe_layer_freq)", "qtk converts MoE models whose layers are all sparse, dense first (first_k_dense_replace) or "
                         "listed in Llama 4's moe_layers; use another tool for this one")
    if config.get("shared_expert_intermediate_size") and m.shared is None:
        raise UsageError(f"this {config.get('model_type')} config has a shared expert, which its family does not have",
                         "restore the model's original config.json")
    E = num_experts(config)
    gates = [m.expert(e, m.gate) for e in range(E)]
    ups = [m.expert(e, m.up) for e in range(E)]
    downs = [m.expert(e, m.down) for e in range(E)]
    gate_up = tuple(x for e in range(E) for x in (gates[e], ups[e]))
    # the shared expert reads the block input as the routed ones do (its gate/up first: it sees every token) and
    # runs in vLLM as an ordinary MLP (its own merged gate_up_proj), not in the fused-MoE kernel
    sg, su, sd = ((m.shared_linear(w) for w in (m.gate, m.up, m.down)) if m.shared else ((), (), ()))
    shared_in, shared_down = ((sg, su), (sd,)) if m.shared else ((), ())
    # the attention's own pairs (DeepSeek's MLA norms), else Llama-style attention's
    attn_smoothing = arch.smoothing or (SmoothPair("input_layernorm", (Q, K, V), True), SmoothPair(V, (O,), False))
    sparse = replace(
        arch,
        num_experts=E,
        linears=arch.linears + shared_in + gate_up + shared_down + tuple(downs),
        fusion_groups=arch.fusion_groups + ((shared_in,) if m.shared else ()) + tuple((gates[e], ups[e]) for e in range(E)),
        smoothing=(
            *attn_smoothing,
            SmoothPair("post_attention_layernorm", shared_in + gate_up, True,
                       dense=arch.dense_linears, observe=m.router_name),
            *((SmoothPair(su, (sd,), False),) if m.shared else ()),
            *(SmoothPair(ups[e], (downs[e],), False) for e in range(E) if m.up_smoothable),
        ),
        vllm_fused=arch.vllm_fused + (((shared_in, f"{m.block}.{m.shared}.gate_up_proj"),) if m.shared else ()),
        shared_input_scale=(gate_up, tuple(downs)),
    )
    dense_at = dense_layer_indices(arch, config)
    if not dense_at:
        return sparse
    # the dense layers (DeepSeek's first ones, Llama 4's between the sparse ones): attention and an ordinary MLP under
    # the layer's own attribute for its feed-forward block (mlp, feed_forward; vLLM's merged gate_up_proj); its groups
    # and fused name are also the model's, so checks that match names across layers know them
    dg, du, dd = (f"{m.module}.{w}" for w in (m.gate, m.up, m.down))
    dense = replace(arch, moe=None, linears=arch.linears + (dg, du, dd), fusion_groups=arch.fusion_groups + ((dg, du),),
                    smoothing=(*attn_smoothing, SmoothPair("post_attention_layernorm", (dg, du), True),
                               SmoothPair(du, (dd,), False)),
                    vllm_fused=arch.vllm_fused + (((dg, du), f"{m.module}.gate_up_proj"),))
    return replace(sparse, dense_layers=dense_at, dense_layer=dense, fusion_groups=sparse.fusion_groups + ((dg, du),),
                   vllm_fused=dense.vllm_fused + sparse.vllm_fused[len(arch.vllm_fused):])


def dense_layer_indices(arch: Arch, config: dict) -> frozenset[int]:
    """The layers of an MoE model that hold an ordinary MLP, as transformers' config classes derive them: DeepSeek's
    first first_k_dense_replace layers; for a family whose sparse layers the config lists (Llama 4), those outside
    moe_layers, which defaults to every interleave_moe_layer_step-th layer (layers step-1, 2*step-1, ...)."""
    n = int(config.get("num_hidden_layers") or 0)
    first = int(config.get("first_k_dense_replace") or 0)
    dense = set(range(min(first, n)))
    if arch.moe.interleaved:
        step = config.get("interleave_moe_layer_step", 1)
        listed = config.get("moe_layers")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise UsageError(f"config.json's interleave_moe_layer_step is {str(step)[:40]}, not a positive integer",
                             "restore the model's original config.json")
        if listed is None:
            listed = list(range(step - 1, n, step))
        if not isinstance(listed, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n
                                               for i in listed):
            raise UsageError(f"config.json's moe_layers is not a list of layer indices below num_hidden_layers ({n})",
                             "restore the model's original config.json")
        dense |= set(range(n)) - set(listed)
    return frozenset(dense)


def arch_for(model_type: str | None, config: dict | None = None) -> Arch:
    """The architecture of a model_type; MoE families need the config (their Linears depend on the expert count)."""
    if model_type not in ARCHS:
        raise UsageError(f"model_type '{model_type}' is not supported",
                         f"supported: {', '.join(sorted(ARCHS))}")
    arch = ARCHS[model_type]
    if arch.for_config is not None and config is not None:
        arch = arch.for_config(arch, config)
    if arch.moe is not None:
        if config is None:
            raise ValueError(f"arch_for({model_type!r}) needs the config: an MoE architecture depends on its expert count")
        if arch.multimodal:  # a vision-language MoE (Llama 4): the experts are its language model's, in text_config
            from qtk.model.config_check import text_config

            config = text_config(config)
        arch = with_experts(arch, config)
    return arch


def config_model_type(model_type: str | None) -> str | None:
    """The model_type transformers reads a family's config.json as (its own, or the family's config_as)."""
    f = FAMILIES.get(model_type)
    return f.config_as if f is not None and f.config_as else model_type


def naming(model_type: str | None) -> Arch:
    """The module names of a family (layers, embeddings, attention): its Arch, or Llama's (model.layers.N.self_attn)
    for a family outside the table, which most decoder-only checkpoints follow."""
    return ARCHS.get(model_type, LLAMA)
