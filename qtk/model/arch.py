"""Architecture knowledge as data, keyed by the HF `model_type`: module names, sub-block order,
fusion groups, smoothing pairs and TensorRT-LLM names. No isinstance or substring chains elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field

from qtk.errors import UsageError

Q, K, V, O = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
GATE, UP, DOWN = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"


@dataclass(frozen=True)
class SmoothPair:
    """A scale s on `prev`'s output channels folds into the input columns of `nexts` (AWQ, SmoothQuant)."""

    prev: str  # a norm (weight /= s) or a Linear (rows /= s)
    nexts: tuple[str, ...]
    prev_is_norm: bool


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
    trtllm_names: dict[str, str] = field(default_factory=lambda: {
        "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_layernorm",
        O: "attention.dense", GATE: "mlp.fc", UP: "mlp.gate", DOWN: "mlp.proj",
    })

    def fusion_group_of(self, linear: str) -> tuple[str, ...]:
        return next((g for g in self.fusion_groups if linear in g), (linear,))


LLAMA = Arch("llama", ("llama", "mistral"))
QWEN2 = Arch("qwen2", ("qwen2",), trtllm_architecture="Qwen2ForCausalLM")
QWEN3 = Arch("qwen3", ("qwen3",), trtllm_architecture="Qwen3ForCausalLM")
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
)

ARCHS: dict[str, Arch] = {mt: a for a in (LLAMA, QWEN2, QWEN3, GEMMA, PHI3) for mt in a.model_types}


def arch_for(model_type: str | None) -> Arch:
    if model_type not in ARCHS:
        raise UsageError(f"model_type '{model_type}' is not supported",
                         f"supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[model_type]
