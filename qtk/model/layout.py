"""The parameters a model's config.json implies, by name, shape and order, without transformers: what the meta
skeleton (qtk.model.source.meta_skeleton) holds, for the families qtk converts. The data-free stream
(qtk.pipeline.stream) reads and checks a checkpoint by it, so a conversion that calibrates nothing never imports
transformers or builds a module (issue 13: data-free recipes at disk speed build no skeleton).

A Layout is exact or absent: where config.json leaves a size to the transformers config class's defaults (no
num_key_value_heads, no tie_word_embeddings, a head_dim the class defaults to something other than hidden / heads),
`layout_from_config` returns None and the caller takes the skeleton's (Layout.of_model). tests/test_layout.py holds
the two equal, names, shapes and order, for every family and bias variant."""

from __future__ import annotations

import math

from dataclasses import dataclass

from qtk.model.arch import DOWN, GATE, GATE_UP, K, O, Q, QKV, UP, V, Arch

Shape = tuple[int, ...]


@dataclass(frozen=True)
class _Rules:
    """How one family's modelling code builds a decoder layer from its config (transformers 5)."""

    attn_bias: str = "config"  # "config": attention_bias on q, k, v and o; "qkv": q, k, v always; "none"
    mlp_bias: bool = False  # the config's mlp_bias decides gate/up/down's bias (Llama)
    head_dim_default: bool = True  # head_dim = hidden / heads when config.json gives none
    qk_norm: bool = False  # per-head RMSNorms q_norm, k_norm after o_proj
    sandwich: bool = False  # pre/post feed-forward norms after the two usual ones (Gemma 2/3)
    prefused: bool = False  # Phi-3: o_proj, then qkv_proj; gate_up_proj, down_proj
    expert_size: str = "intermediate_size"  # the config key of an expert's intermediate size (MoE)


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
}
# tensors a checkpoint may hold that no model has as parameters (transformers skips them on load too)
SKIPPED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


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
        per_layer = tuple(tuple((k, tuple(v.shape)) for k, v in layer.state_dict(keep_vars=True).items() if v.is_meta)
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
                   tuple(k for k, v in sd.items() if not v.is_meta), tuple(skip))


def _int(c: dict, key: str) -> int | None:
    v = c.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def layout_from_config(config: dict, arch: Arch) -> Layout | None:
    """The Layout config.json implies for `arch` (qtk.model.arch.arch_for of the same config), or None where it
    leaves a size to transformers' config defaults. Sizes are checked by qtk.model.config_check first."""
    mt = config.get("model_type")
    rules = RULES.get(mt)
    tie = config.get("tie_word_embeddings")
    need = {k: _int(config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "num_hidden_layers", "vocab_size")}
    if rules is None or not isinstance(tie, bool) or None in need.values() or "text_config" in config:
        return None
    hidden, inter, heads, kv, n, vocab = need.values()
    head_dim = _int(config, "head_dim")
    if head_dim is None:
        if not rules.head_dim_default or config.get("head_dim") is not None or hidden % heads:
            return None
        head_dim = hidden // heads
    attn_bias = bool(config.get("attention_bias", False))
    mlp_bias = rules.mlp_bias and bool(config.get("mlp_bias", False))
    bias = {Q: rules.attn_bias == "qkv" or (rules.attn_bias == "config" and attn_bias),
            O: rules.attn_bias == "config" and attn_bias}
    bias[K] = bias[V] = bias[Q]
    q_out, kv_out = heads * head_dim, kv * head_dim

    layer: list[tuple[str, Shape]] = []

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
    if rules.qk_norm:
        layer += [(f"{arch.attn}.q_norm.weight", (head_dim,)), (f"{arch.attn}.k_norm.weight", (head_dim,))]
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
        linear(m.router_name, arch.num_experts, hidden)
        for e in range(arch.num_experts):
            for which, out, inn in ((m.gate, size, hidden), (m.up, size, hidden), (m.down, hidden, size)):
                linear(m.expert(e, which), out, inn)
    embed, lm_head = f"{arch.embed}.weight", f"{arch.lm_head}.weight"
    outer = ((embed, (vocab, hidden)), (f"{arch.final_norm}.weight", (hidden,)), (lm_head, (vocab, hidden)))
    return Layout(arch.layers, (tuple(layer),) * n, outer, ((embed, lm_head),) if tie else ())
