"""Sensitivity from one calibration pass: for every servable unit of every decoder layer and every candidate scheme, an
estimate of the damage quantizing that unit does, and (qtk.tune.search.unit_costs) its exact bytes.

Units are what an engine runs with one scheme: each fusion group (q/k/v, gate/up) and each Linear outside one (o,
down); the experts of an MoE layer are one unit (vLLM's FusedMoE takes one scheme for all experts, w13 and w2).

The estimate. For a Linear with input x, weights W and quantized weights Q(W) = W + ΔW, the output error on the
calibration tokens is

    damage = 1/n Σ_tokens ‖ΔW x‖²  =  tr(ΔW H ΔWᵀ) / 2,    H = 2/n Σ x xᵀ  (the GPTQ Hessian of the layer),

summed over the unit's Linears: the objective GPTQ minimises, evaluated for the weights the chosen solver (GPTQ or
round-to-nearest, as the tuned recipe will run it) produces under each candidate scheme. Inputs are taken with the
quantized upstream: the layers are streamed once, like `qtk convert`, and each layer's outputs come from the layer
quantized with the cheapest candidate (the scheme most of a tight budget ends up with), so a unit's Hessian sees the
error of the layers before it. An MoE expert's term is weighted by the share of the layer's tokens routed to it.

It is additive over units (what the frontier's knapsack needs) and in one unit for all of them: mean squared error
added to the residual stream's inputs of the next sub-block, per token. It ignores how later layers amplify an
error; tests/tune/test_sensitivity.py measures how well its ranking agrees with the KL divergence to the unquantized
model when only that unit is quantized.

An 8-bit KV cache is one more option: its damage is the same measure at the attention output projection,
1/n Σ ‖W_o (a_kv8 - a)‖², where a is the attention output (o_proj's input) and a_kv8 the same with K and V stored
as the engine stores them (per-tensor scale amax/448 for FP8, amax/127 for INT8).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from qtk.algorithms.gptq import gptq_quantize_shared
from qtk.model.simulate import engine_weight, kv_fake_quant, set_kv_hook, use_qtk_attention
from qtk.pipeline.capture import capture_layer_inputs
from qtk.pipeline.device import compute_dtype
from qtk.pipeline.targets import target_linears
from qtk.quant.scheme import FP8_MAX, Strategy
from qtk.recipe import ModuleScheme, Recipe
from qtk.steps.capture import capture_many, sequential_groups
from qtk.steps.context import LayerContext
from qtk.steps.gptq import group_hessians, hessian_passes
from qtk.steps.rtn import rtn_weights
from qtk.steps.stats import KVAmax
from qtk.steps.swap import swap_in


@dataclass(frozen=True)
class Candidate:
    """One scheme a unit may get: its name (the recipe it comes from, or 'bf16') and its ModuleScheme (None: the
    unit stays in 16 bits)."""

    name: str
    scheme: ModuleScheme | None

    @property
    def dense(self) -> bool:
        return self.scheme is None


@dataclass(frozen=True)
class Unit:
    """Linears of one decoder layer that an engine runs with one scheme (relative names, data-flow order), and the
    groups among them that share an input (one Hessian each)."""

    label: str  # e.g. "qkv", "o", "gate_up", "down", "experts"
    linears: tuple[str, ...]
    input_groups: tuple[tuple[str, ...], ...]


def units_of(arch, targets: list[str]) -> list[Unit]:
    """The servable units of a layer whose quantized Linears are `targets`: fusion groups, lone Linears, and all the
    experts of an MoE block as one."""
    groups = sequential_groups(arch, targets)
    experts: set[str] = set()
    if arch.moe is not None:
        m = arch.moe
        experts = {m.expert(e, w) for e in range(arch.num_experts) for w in (m.gate, m.up, m.down)}
    out, expert_groups = [], []
    for g in groups:
        if experts and g[0] in experts:
            expert_groups.append(g)
            continue
        out.append(Unit(_label(g), g, (g,)))
    if expert_groups:
        out.append(Unit("experts", tuple(t for g in expert_groups for t in g), tuple(expert_groups)))
    return out


def _label(group: tuple[str, ...]) -> str:
    names = [t.rsplit(".", 1)[-1].removesuffix("_proj") for t in group]
    return "".join(names) if all(len(n) == 1 for n in names) else "_".join(names)


@dataclass
class UnitSensitivity:
    layer: int
    label: str
    modules: tuple[str, ...]  # full names
    damage: dict[str, float]  # candidate name -> estimate (0 for a dense candidate)


@dataclass
class Sensitivity:
    """What the pass measured: per unit and candidate the damage; per KV option the damage summed over layers."""

    candidates: list[Candidate]
    units: list[UnitSensitivity]
    kv_damage: dict[str, float] = field(default_factory=dict)  # kv kind ("fp8" | "int8") -> damage over all layers
    kv_layers: dict[str, list[float]] = field(default_factory=dict)
    propagated_with: str = ""
    seconds: float = 0.0
    # (unit index, candidate name) -> {full name: engine-view weight}, only when asked (tests measure the KL of these)
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = field(default_factory=dict)


def _solve(weights: list[torch.Tensor], H: torch.Tensor | None, scheme, solver, dtype, arch, names):
    """QTensors of Linears sharing an input under `scheme`: GPTQ with the recipe's parameters, or round-to-nearest
    (also GPTQ's fallback when no token reached the Linears)."""
    if solver is not None and H is not None:
        return [qt for qt, _ in gptq_quantize_shared(weights, H, scheme, solver, dtype, names=names)]
    qts = rtn_weights(dict(zip(names, weights)), {n: scheme for n in names}, arch, dtype)
    return [qts[n] for n in names]


def measure(source, candidates: list[Candidate], calib_ids: torch.Tensor, *, solver=None, kv_kinds: tuple[str, ...] = (),
            ignore: tuple[str, ...] = ("lm_head",), batch_size: int = 8, keep_weights: bool = False,
            on_layer: Callable[[int, int], None] | None = None) -> Sensitivity:
    """Stream the layers of `source` once over `calib_ids` and estimate every unit's damage under every candidate.

    solver: GPTQParams to solve with (None: round to nearest); kv_kinds: the 8-bit KV formats to estimate ("fp8",
    "int8"); ignore: modules kept in 16 bits whatever the assignment (never units)."""
    t0 = time.perf_counter()
    quantized = [c for c in candidates if not c.dense]
    if not quantized:
        raise ValueError("no quantized candidate")
    prop = min(quantized, key=lambda c: _bits(c.scheme))
    probe = Recipe(name="tune-probe", weights=prop.scheme.weights, ignore=ignore)
    dtype = source.dtype
    skeleton = source.skeleton()
    use_qtk_attention(skeleton)
    batches, layer_kwargs = capture_layer_inputs(source, skeleton, calib_ids, batch_size)
    n_tokens = int(calib_ids.numel())
    out = Sensitivity(candidates=list(candidates), units=[], propagated_with=prop.name)
    out.kv_layers = {k: [] for k in kv_kinds}
    n = source.num_layers
    for i in range(n):
        prefix, arch = source.layer_prefix(i), source.arch.at(i)
        batches = [(h, kw) for (h, _), kw in zip(batches, layer_kwargs[i])]
        targets = target_linears(source, probe, i)
        layer = source.layer(skeleton, i, compute_dtype(source))
        ctx = LayerContext(i, prefix, layer, arch, probe, targets, batches, dtype)
        input_groups = sequential_groups(arch, targets)
        hessians = {}
        for chunk in hessian_passes(layer, input_groups):
            hessians.update(group_hessians(ctx, chunk))
        weights = {t: layer.get_submodule(t).weight.detach() for t in targets}
        prop_q = {}
        for unit in units_of(arch, targets):
            damage = {c.name: 0.0 for c in candidates}
            for c in quantized:
                kept = {}
                for g in unit.input_groups:
                    h = hessians[g]
                    H = h.H if h.tokens else None
                    qts = _solve([weights[t] for t in g], H, c.scheme.weights, solver, dtype, arch, list(g))
                    for t, qt in zip(g, qts):
                        w_hat = engine_weight(qt)
                        if H is not None:
                            dW = weights[t].float() - w_hat
                            damage[c.name] += float(((dW @ H) * dW).sum()) / 2 * h.tokens / n_tokens
                        if c is prop:
                            prop_q[t] = qt
                        if keep_weights:
                            kept[prefix + t] = w_hat.to(weights[t].dtype)
                if keep_weights:
                    out.weights[(len(out.units), c.name)] = kept
            out.units.append(UnitSensitivity(i, unit.label, tuple(prefix + t for t in unit.linears), damage))
        # the next layer's inputs come from this layer quantized with the propagation candidate
        for t, qt in prop_q.items():
            swap_in(layer, t, qt, None, {})
        batches = _propagate(layer, arch, batches, weights, kv_kinds, out.kv_layers, n_tokens)
        del layer, hessians, weights, prop_q
        if on_layer:
            on_layer(i + 1, n)
    out.kv_damage = {k: float(sum(v)) for k, v in out.kv_layers.items()}
    out.seconds = time.perf_counter() - t0
    return out


def _bits(scheme: ModuleScheme) -> float:
    """Stored bits per weight, for picking the cheapest candidate (scales add ~16/group)."""
    w = scheme.weights
    return w.num_bits + (16 / w.group_size if w.strategy == Strategy.GROUP else 0)


def _propagate(layer, arch, batches, weights, kv_kinds, kv_layers, n_tokens):
    """The layer's outputs for every batch (the next layer's inputs); with KV options, also each option's damage:
    the o_proj output error from storing K and V in 8 bits."""
    o_name = f"{arch.attn}.o_proj"
    attn = layer.get_submodule(arch.attn)
    kv = KVAmax() if kv_kinds else None
    ref: list[torch.Tensor] = []
    hooks = []
    if kv is not None:
        set_kv_hook(attn, kv)
        hooks.append(layer.get_submodule(o_name).register_forward_pre_hook(lambda m, a: ref.append(a[0].detach())))
    try:
        with torch.no_grad():
            nxt = [(layer(h, **kw), kw) for h, kw in batches]
    finally:
        for h in hooks:
            h.remove()
        set_kv_hook(attn, None)
    nxt = [((o[0] if isinstance(o, tuple) else o), kw) for o, kw in nxt]
    if kv is None:
        return nxt
    kv.reduce()
    Wo = weights[o_name].float() if o_name in weights else layer.get_submodule(o_name).weight.float()
    for kind in kv_kinds:
        top = FP8_MAX if kind == "fp8" else 127.0
        tiny = torch.finfo(torch.float32).tiny
        set_kv_hook(attn, kv_fake_quant(kind, max(kv.k.value / top, tiny), max(kv.v.value / top, tiny)))
        got: list[torch.Tensor] = []
        try:
            capture_many(layer, batches, {o_name: got.append}, stop_after=o_name)
        finally:
            set_kv_hook(attn, None)
        total = 0.0
        for a, b in zip(ref, got):
            d = (b.float() - a.float()).reshape(-1, a.shape[-1]) @ Wo.t()
            total += float(d.square().sum())
        kv_layers[kind].append(total / n_tokens)
    return nxt
