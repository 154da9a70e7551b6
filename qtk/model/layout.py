"""The parameters a model's config.json implies, by name, shape and order, without transformers: what the meta
skeleton (qtk.model.source.meta_skeleton) holds, for the families qtk converts. The data-free stream
(qtk.pipeline.stream) reads and checks a checkpoint by it, so a conversion that calibrates nothing never imports
transformers or builds a module (a data-free recipe runs at disk speed).

A Layout is exact or absent: where config.json leaves a size to the transformers config class's defaults (no
num_key_value_heads, no tie_word_embeddings, a head_dim the class defaults to something other than hidden / heads),
`layout_from_config` returns None and the caller takes the skeleton's (Layout.of_model). tests/test_layout.py holds
the two equal, names, shapes and order, for every family and bias variant."""

from __future__ import annotations

import math

from dataclasses import dataclass

from qtk.model.arch import DOWN, GATE, GATE_UP, K, O, Q, QKV, UP, V, Arch, config_model_type

Shape = tuple[int, ...]


@dataclass(frozen=True)
class _Rules:
    """How one family's modelling code builds a decoder layer from its config (transformers 5)."""

    attn_bias: str = "config"  # "config": attention_bias on q, k, v and o; "qkv": q, k, v always; "qkv_config": q, k,
    # v when attention_bias (o never); "none"
    mlp_bias: bool = False  # the config's mlp_bias decides gate/up/down's bias (Llama)
    head_dim_default: bool = True  # head_dim = hidden / heads when config.json gives none
    qk_norm: bool = False  # per-head RMSNorms q_norm, k_norm after o_proj
    sandwich: bool = False  # pre/post feed-forward norms after the two usual ones (Gemma 2/3)
    prefused: bool = False  # Phi-3: o_proj, then qkv_proj; gate_up_proj, down_proj
    expert_size: str = "intermediate_size"  # the config key of an expert's intermediate size (MoE)
    mla: bool = False  # DeepSeek: multi-head latent attention, first_k_dense_replace dense layers, shared experts
    qk_norm_key: str | None = None  # the config key that switches q/k norms on (GLM-4.5: use_qk_norm)
    router_bias: bool = False  # the router holds e_score_correction_bias (DeepSeek-style routing)
    sinks: bool = False  # the attention holds a sink logit per head, `sinks` [heads], before its Linears (gpt-oss)
    router_linear_bias: bool = False  # the router Linear has a bias (gpt-oss)
    # config keys whose absence leaves a size or a tensor to the config class's default where that is not the
    # layout's own default (gpt-oss: head_dim 64, attention_bias True): without them the skeleton decides
    needs: tuple[str, ...] = ()
    dense_size: str = "intermediate_size"  # the config key of a dense layer's MLP size in an MoE model (Llama 4's
    # intermediate_size_mlp)
    shared_size: str | None = None  # the config key of the shared expert's size where it is one MLP of its own
    # (Llama 4: intermediate_size); None: Qwen2-MoE's shared_expert_intermediate_size or DeepSeek's n_shared_experts


RULES: dict[str, _Rules] = {
    "llama": _Rules(mlp_bias=True),
    "mistral": _Rules(attn_bias="none"),
    "qwen2": _Rules(attn_bias="qkv"),
    "qwen3": _Rules(head_dim_default=False, qk_norm=True),
    "gemma2": _Rules(head_dim_default=False, sandwich=True),
    "gemma3_text": _Rules(head_dim_default=False, qk_norm=True, sandwich=True),
    "phi3": _Rules(attn_bias="none", prefused=True),
    "mixtral": _Rules(attn_bias="none"),
    "qwen3_moe": _Rules(head_dim_default=False, qk_norm=True, expert_size="moe_intermediate_size"),
    "qwen2_moe": _Rules(attn_bias="qkv", expert_size="moe_intermediate_size"),
    "deepseek_v3": _Rules(expert_size="moe_intermediate_size", mla=True),
    "glm4_moe": _Rules(attn_bias="qkv_config", head_dim_default=False, qk_norm_key="use_qk_norm",
                       expert_size="moe_intermediate_size", router_bias=True),
    "gpt_oss": _Rules(head_dim_default=False, sinks=True, router_linear_bias=True, needs=("attention_bias", "head_dim")),
    # Llama 4's q/k norm has no weight: no tensor; head_dim defaults to 128 in its config class
    "llama4_text": _Rules(head_dim_default=False, dense_size="intermediate_size_mlp", shared_size="intermediate_size"),
}
# tensors a checkpoint may hold that no model has as parameters (transformers skips them on load too)
SKIPPED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")
# persistent buffers a layer's checkpoint holds beside its parameters (DeepSeek's routing bias, float32 in bf16
# checkpoints): read and written in their stored dtype, never the model's, as the layer loop loads them
ROUTER_BIAS = "e_score_correction_bias"


def is_stored_dtype(name: str) -> bool:
    """Whether a layer tensor keeps the dtype it is stored in (a persistent buffer) instead of the model's."""
    return name.rsplit(".", 1)[-1] == ROUTER_BIAS



@dataclass(frozen=True)
class Layout:
    """The parameters of a causal LM. layers[i]: layer i's (name relative to its prefix, shape), in the layer
    module's state_dict order; outer: the others (full names) in the model's order, the layers coming after the
    first `layers_at` of them (the embedding; then the final norm, lm_head); tied: names that are one parameter
    (the embedding and lm_head when tied); buffers: persistent buffers a checkpoint may hold (full names);
    skipped: patterns of checkpoint tensors that belong to no module but are expected (old rotary tables)."""

    layer_prefix: str  # "model.layers"
    layers: tuple[tuple[tuple[str, Shape], ...], ...]
    outer: tuple[tuple[str, Shape], ...]
    tied: tuple[tuple[str, ...], ...] = ()
    layers_at: int = 1
    buffers: tuple[str, ...] = ()
    skipped: tuple[str, ...] = SKIPPED

    def names(self) -> list[str]:
        """Every parameter's name(s), in the model's order."""
        inner = [f"{self.layer_prefix}.{i}.{n}" for i, layer in enumerate(self.layers) for n, _ in layer]
        outer = [n for n, _ in self.outer]
        return outer[:self.layers_at] + inner + outer[self.layers_at:]

    def shapes(self) -> dict[str, Shape]:
        out = dict(self.outer)
        for i, layer in enumerate(self.layers):
            out.update({f"{self.layer_prefix}.{i}.{n}": s for n, s in layer})
        return out

    def largest_layer_numel(self) -> int:
        """Elements of the largest decoder layer's parameters (0 without layers)."""
        return max((sum(math.prod(shape) for _, shape in layer) for layer in self.layers), default=0)

    def groups(self) -> list[list[str]]:
        """The parameters, each as the names it goes by (several when tied)."""
        tied = {n: g for g in self.tied for n in g}
        seen, out = set(), []
        for n in self.names():
            if n not in seen:
                g = list(tied.get(n, (n,)))
                seen.update(g)
                out.append(g)
        return out

    @classmethod
    def of_model(cls, model, arch: Arch) -> "Layout":
        """A (meta) model's parameters: the reference the config's layout is tested against, and the layout of a
        config this module cannot decide alone."""
        layers = model.get_submodule(arch.layers)
        # a layer's persistent buffers (DeepSeek's router e_score_correction_bias) are checkpoint tensors like its
        # parameters: listed with them, read and written with them (the skeleton's own values are placeholders)
        per_layer = tuple(tuple((k, tuple(v.shape)) for k, v in layer.state_dict(keep_vars=True).items())
                          for layer in layers)
        prefix = arch.layers + "."
        sd = model.state_dict(keep_vars=True)
        outer = tuple((k, tuple(v.shape)) for k, v in sd.items() if not k.startswith(prefix) and v.is_meta)
        first_layer = next((j for j, k in enumerate(sd) if k.startswith(prefix)), len(sd))
        at = sum(1 for k in list(sd)[:first_layer] if sd[k].is_meta)
        groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        skip = (*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()), *SKIPPED)
        return cls(arch.layers, per_layer, outer, tuple(tuple(g) for g in groups.values() if len(g) > 1), at,
                   tuple(k for k, v in sd.items() if not v.is_meta and not k.startswith(prefix)), tuple(skip))


def _int(c: dict, key: str) -> int | None:
    v = c.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def layout_from_config(config: dict, arch: Arch) -> Layout | None:
    """The Layout config.json implies for `arch` (qtk.model.arch.arch_for of the same config), or None where it
    leaves a size to transformers' config defaults. Sizes are checked by qtk.model.config_check first."""
    mt = config.get("model_type")
    rules = RULES.get(config_model_type(mt))  # Kimi-K2 by DeepSeek-V3's rules
    tie = config.get("tie_word_embeddings")
    need = {k: _int(config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "num_hidden_layers", "vocab_size")}
    if rules is None or not isinstance(tie, bool) or None in need.values() or "text_config" in config \
            or any(k not in config for k in rules.needs):
        return None
    hidden, inter, heads, kv, n, vocab = need.values()
    if rules.mla:
        return _mla_layout(config, arch, rules, hidden, inter, heads, n, vocab, tie)
    head_dim = _int(config, "head_dim")
    if head_dim is None:
        if not rules.head_dim_default or config.get("head_dim") is not None or hidden % heads:
            return None
        head_dim = hidden // heads
    attn_bias = bool(config.get("attention_bias", False))
    mlp_bias = rules.mlp_bias and bool(config.get("mlp_bias", False))
    bias = {Q: rules.attn_bias == "qkv" or (rules.attn_bias in ("config", "qkv_config") and attn_bias),
            O: rules.attn_bias == "config" and attn_bias}
    bias[K] = bias[V] = bias[Q]
    q_out, kv_out = heads * head_dim, kv * head_dim

    layer: list[tuple[str, Shape]] = [(f"{arch.attn}.sinks", (heads,))] if rules.sinks else []

    def linear(name: str, out: int, inn: int, with_bias: bool = False) -> None:
        layer.append((f"{name}.weight", (out, inn)))
        if with_bias:
            layer.append((f"{name}.bias", (out,)))

    if rules.prefused:
        linear(O, hidden, q_out)
        linear(QKV, q_out + 2 * kv_out, hidden)
    else:
        for m, out in ((Q, q_out), (K, kv_out), (V, kv_out)):
            linear(m, out, hidden, bias[m])
        linear(O, hidden, q_out, bias[O])
    if rules.qk_norm if rules.qk_norm_key is None else config.get(rules.qk_norm_key) is True:
        layer += [(f"{arch.attn}.q_norm.weight", (head_dim,)), (f"{arch.attn}.k_norm.weight", (head_dim,))]
    attention = list(layer)
    if arch.moe is None:
        mlp = ((GATE_UP, 2 * inter, hidden),) if rules.prefused else ((GATE, inter, hidden), (UP, inter, hidden))
        for m, out, inn in (*mlp, (DOWN, hidden, inter)):
            linear(m, out, inn, mlp_bias)
    layer += [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    if rules.sandwich:
        layer += [("pre_feedforward_layernorm.weight", (hidden,)), ("post_feedforward_layernorm.weight", (hidden,))]
    if arch.moe is not None:
        m = arch.moe
        size = _int(config, rules.expert_size)
        if size is None:
            return None
        linear(m.router_name, arch.num_experts, hidden, rules.router_linear_bias)
        if rules.router_bias:
            layer.append((f"{m.router_name}.{ROUTER_BIAS}", (arch.num_experts,)))
        for e in range(arch.num_experts):
            for which, out, inn in ((m.gate, size, hidden), (m.up, size, hidden), (m.down, hidden, size)):
                linear(m.expert(e, which), out, inn, m.bias)
        if m.shared:
            # Qwen2-MoE: one shared expert of its own size behind a gate; DeepSeek-style: n_shared_experts of the
            # experts' size, as one MLP
            shared = _int(config, rules.shared_size) if rules.shared_size else \
                _int(config, "shared_expert_intermediate_size") if m.shared_gate else \
                (lambda k: None if k is None else size * k)(_int(config, "n_shared_experts"))
            if shared is None:
                return None
            for which, out, inn in ((m.gate, shared, hidden), (m.up, shared, hidden), (m.down, hidden, shared)):
                linear(m.shared_linear(which), out, inn)
            if m.shared_gate:
                linear(f"{m.block}.{m.shared_gate}", 1, hidden)
    layers = (tuple(layer),) * n
    if arch.dense_layer is not None:  # the dense layers hold an MLP where the others hold the MoE block
        dense_inter = _int(config, rules.dense_size)
        if dense_inter is None:
            return None
        layer = attention
        b, m = arch.moe.module, arch.moe
        for w, out, inn in ((m.gate, dense_inter, hidden), (m.up, dense_inter, hidden), (m.down, hidden, dense_inter)):
            linear(f"{b}.{w}", out, inn)
        layer += [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
        layers = tuple(tuple(layer) if i in arch.dense_layers else layers[i] for i in range(n))
    embed, lm_head = f"{arch.embed}.weight", f"{arch.lm_head}.weight"
    outer = ((embed, (vocab, hidden)), (f"{arch.final_norm}.weight", (hidden,)), (lm_head, (vocab, hidden)))
    return Layout(arch.layers, layers, outer, ((embed, lm_head),) if tie else ())


def _mla_layout(config: dict, arch: Arch, rules: _Rules, hidden: int, inter: int, heads: int, n: int, vocab: int,
                tie: bool) -> Layout | None:
    """DeepSeek-V3 (transformers' DeepseekV3DecoderLayer): MLA attention; layers before first_k_dense_replace hold an
    MLP, the others the MoE block (router with its e_score_correction_bias, experts, shared experts), which qtk
    registers after the norms (qtk.model.moe.unfuse_experts)."""
    dims = {k: _int(config, k) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                         rules.expert_size, "n_shared_experts")}
    q_lora = config.get("q_lora_rank")
    if None in dims.values() or (q_lora is not None and _int(config, "q_lora_rank") is None):
        return None
    kv_lora, rope, nope, v_dim, expert, shared = dims.values()
    bias = bool(config.get("attention_bias", False))
    a = arch.attn

    def attention(out: list) -> None:
        def linear(name, o, i, b=False):
            out.append((f"{a}.{name}.weight", (o, i)))
            if b:
                out.append((f"{a}.{name}.bias", (o,)))
        if q_lora is None:
            linear("q_proj", heads * (nope + rope), hidden)
        else:
            linear("q_a_proj", q_lora, hidden, bias)
            out.append((f"{a}.q_a_layernorm.weight", (q_lora,)))
            linear("q_b_proj", heads * (nope + rope), q_lora)
        linear("kv_a_proj_with_mqa", kv_lora + rope, hidden, bias)
        out.append((f"{a}.kv_a_layernorm.weight", (kv_lora,)))
        linear("kv_b_proj", heads * (nope + v_dim), kv_lora)
        linear("o_proj", hidden, heads * v_dim, bias)

    def mlp(out: list, pre: str, size: int) -> None:
        out += [(f"{pre}.gate_proj.weight", (size, hidden)), (f"{pre}.up_proj.weight", (size, hidden)),
                (f"{pre}.down_proj.weight", (hidden, size))]

    norms = [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    first = int(config.get("first_k_dense_replace") or 0)
    layers = []
    for i in range(n):
        layer: list[tuple[str, Shape]] = []
        attention(layer)
        if i < first:
            mlp(layer, "mlp", inter)
            layer += norms
        else:
            m = arch.moe
            layer += norms
            layer += [(f"{m.router_name}.weight", (arch.num_experts, hidden)),
                      (f"{m.router_name}.{ROUTER_BIAS}", (arch.num_experts,))]
            for e in range(arch.num_experts):
                mlp(layer, f"{m.block}.experts.{e}", expert)
            mlp(layer, f"{m.block}.{m.shared}", expert * shared)
        layers.append(tuple(layer))
    embed, lm_head = f"{arch.embed}.weight", f"{arch.lm_head}.weight"
    outer = ((embed, (vocab, hidden)), (f"{arch.final_norm}.weight", (hidden,)), (lm_head, (vocab, hidden)))
    return Layout(arch.layers, tuple(layers), outer, ((embed, lm_head),) if tie else ())
