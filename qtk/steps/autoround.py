"""The AutoRound step (SOLVE): SignRound (Cheng et al., 2023; intel/auto-round) on one decoder layer at a time.

Every quantized Linear of the layer gets a rounding offset V [out, in] in [-0.5, 0.5] (the code is round(w / s + V)
instead of round(w / s)) and, per scale group, factors in [0.5, 1] on the group's max and min (its clipping; FP4
groups have one, on their max |w|). They start at V = 0 and factors 1 (round to nearest) and are learned together,
for the whole layer, by signed gradient descent: each step moves every parameter by lr · sign(gradient), lr
decaying linearly to 0 over the iterations, rounding passed through by the straight-through estimator. The loss is
the MSE between the layer's outputs with the fake-quantized weights (and, for W4A8 / W4A4, its Linears' inputs
fake-quantized as the engine does) and the target, on the calibration batches (one batch a step, in a seeded random
order); the parameters of the lowest loss seen are kept (auto-round's best-loss tracking), or with keep: all, of
those and the last step's, the ones with the lower loss over every batch.

The target (params.target) is by default the float model's own hidden states after this layer, which the loop
carries beside the quantized stream (LayerContext.float_outputs): the quantized layer on the quantized model's inputs
(auto-round's enable_quanted_input) is pulled toward what the float model computes there, so it also corrects what
the layers before it got wrong, as auto-round's blocks do; `target: layer` pulls it toward its own float outputs on
the same inputs instead.

The grid is the format's (Format.learned_grid): int, with compressed-tensors' scales or, by default for symmetric
schemes, the full-range ones (IntFormat.full_range_scale: amax / -qmin, signed so each group's larger extreme is
exactly qmin, as auto-round's int_sym), or FP4 (NVFP4, MXFP4: Format.group_scales_from_amax). The codes and scales are
then written through the format: the scales of the clipped ranges as the format computes and stores them, the codes
its rounding of w + V·s. The checkpoint is an ordinary one of that format: nothing of AutoRound is needed to decode
it; the loop swaps the solved Linears in, so the next layer sees what the engine computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from qtk.quant.formats import fake_quant_activation, format_for, static_scale
from qtk.quant.formats.grouped import grouped, ungroup
from qtk.quant.fp4 import FP4_MAX, fp4_decode, fp4_encode
from qtk.algorithms.smooth import fold_into_linear_rows, fold_into_norm, scale_linear_columns
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import Strategy
from qtk.recipe.params import AutoRoundParams
from qtk.steps.context import LayerContext
from qtk.steps.observe import observe_static_ranges
from qtk.steps.records import StepRecord, register_record
from qtk.steps.registry import register_step
from qtk.steps.smoothing import fold, smoothed_weight, smoothing_pairs

V_BOUND = 0.5  # |V|: an offset of more than half a step would skip a grid point
CLIP_BOUNDS = (0.5, 1.0)  # the factors on a group's min and max: clip at most half the range, never widen it
_TINY = 2.0 ** -126


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return x + (x.round() - x).detach()


class _Learned:
    """What every learner holds: the rounding offsets V and the clipping factors (`factors`), the parameters signed
    descent moves, and the snapshot of them the lowest loss keeps."""

    v: torch.Tensor
    factors: tuple[torch.Tensor, ...]

    def round_params(self) -> list[torch.Tensor]:
        return [self.v]

    def clip_params(self) -> list[torch.Tensor]:
        return [f for f in self.factors if f.requires_grad]

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.detach().clone() for p in (self.v, *self.factors))

    def restore(self, state: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            for p, x in zip((self.v, *self.factors), state):
                p.copy_(x)


class Learner(_Learned):
    """One Linear's learned rounding on an integer grid: V, the clipping factors on each group's max (alpha) and
    min (beta), and the fake-quantized weight they give, differentiable in all three."""

    def __init__(self, w: torch.Tensor, scheme, minmax: bool, scale_dtype: torch.dtype | None = None,
                 quotient_dtype: torch.dtype | None = None, full_range: bool = False):
        self.scheme, self.shape, self.scale_dtype, self.half = scheme, w.shape, scale_dtype, quotient_dtype
        self.fmt = format_for(scheme)
        # the full-range symmetric grid (IntFormat.full_range_scale): signed scales, a group's larger extreme on qmin
        # (the autoround parameter, or the weights' own observer: full_range)
        self.full = (full_range or scheme.observer == "full_range") and scheme.symmetric and self.fmt.signed_scales(scheme)
        self.rebase(w.detach())
        self.v = torch.zeros_like(self.wg, requires_grad=True)
        self.alpha = torch.ones_like(self.xmax, requires_grad=minmax)
        self.beta = torch.ones_like(self.xmin, requires_grad=minmax)
        self.factors = (self.alpha, self.beta)

    def rebase(self, w: torch.Tensor, extra=None) -> None:
        """Learn on weight w [out, in] from now on (a smoothed one; differentiable in what made it): its groups and
        their min and max, which the clipping factors multiply. `extra` is for FP4 grids only."""
        self.wg = grouped(w.float(), self.scheme)  # [out, groups, group]
        self.xmin = self.wg.amin(-1, keepdim=True).clamp_max(0)
        self.xmax = self.wg.amax(-1, keepdim=True).clamp_min(0)

    def qdq(self) -> torch.Tensor:
        """The dequantized weight [out, in] under the current V and factors, as the format's integer grid computes
        it (symmetric: scale = amax / ((qmax - qmin) / 2); asymmetric: (max - min) / (qmax - qmin) with the zero
        point round(qmin - min / scale)), the scale rounded to its storage dtype as the checkpoint holds it (the
        rounding passed through to the gradient), in float32: the codes near a rounding threshold, where signed
        descent leaves many of them, are then decided by the scale the engine decodes with."""
        s = self.scheme
        hi, lo = self.xmax * self.alpha, self.xmin * self.beta
        if self.full:  # the format's signed, rounded scale, differentiable as its magnitude amax / -qmin
            exact = self.fmt.full_range_scale(lo.detach(), hi.detach(), s, self.scale_dtype)
            raw = torch.maximum(hi, -lo) / -s.qmin * exact.sign()
            scale = raw + (exact - raw).detach()
        elif s.symmetric:
            scale = torch.maximum(hi, -lo) / ((s.qmax - s.qmin) / 2)
        else:
            scale = (hi - lo) / (s.qmax - s.qmin)
        if not self.full:
            scale = scale.clamp_min(_TINY)
            if self.scale_dtype is not None:
                scale = scale + (scale.to(self.scale_dtype).float() - scale).detach()
        q = self._rounded(self.wg / scale + self.v)
        if s.symmetric:
            q = round_ste(q).clamp(s.qmin, s.qmax)
        else:
            zero = round_ste(s.qmin - lo / scale).clamp(s.qmin, s.qmax)
            q = round_ste(self._rounded(q + zero)).clamp(s.qmin, s.qmax) - zero
        return (q * scale).reshape(self.shape)

    def _rounded(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to the format's quotient dtype (a bf16 model's int quotients are bf16, as compressed-tensors
        computes them: qtk.quant.formats.integer), passed through to the gradient; x itself for float32."""
        return x if self.half is None else x + (x.to(self.half).float() - x).detach()

    def qtensor(self, dtype: torch.dtype) -> QTensor:
        """The QTensor through the format: scale and zero point of the clipped min / max (rounded to the scale's
        storage dtype as the format does), codes the format's rounding of w + V·scale (its quotient in the model's
        dtype, as qdq trained it)."""
        s = self.scheme
        fmt = self.fmt
        with torch.no_grad():
            if self.full:
                scale, zero = fmt.full_range_scale(self.xmin * self.beta, self.xmax * self.alpha, s,
                                                   fmt.scale_dtype(s, dtype)), None
            else:
                scale, zero = fmt.scale_zero(self.xmin * self.beta, self.xmax * self.alpha, s, fmt.scale_dtype(s, dtype))
            q = fmt.quantize_grouped(self.wg + self.v * scale, scale, zero, s, self.half)
            values = q.reshape(self.shape).to(fmt.storage_dtype(s))
        return QTensor(values, ungroup(scale, s), s, None if zero is None else ungroup(zero, s), None, dtype)


class FP4Learner(_Learned):
    """One Linear's learned rounding on the e2m1 grid of NVFP4 / MXFP4 (symmetric: no zero point, no min factor):
    V and one clipping factor per group on its max |w|, from which the format makes the group's stored scale
    (Format.group_scales_from_amax: NVFP4's fp8 scale under the tensor-wide global scale `extra`, MXFP4's power of
    two). The stored scale's rounding and the e2m1 rounding are passed through to the gradient."""

    def __init__(self, w: torch.Tensor, scheme, minmax: bool, model_dtype: torch.dtype, extra=None):
        self.scheme, self.shape, self.dtype = scheme, w.shape, model_dtype
        self.fmt = format_for(scheme)
        self.rebase(w.detach(), extra)
        self.v = torch.zeros_like(self.wg, requires_grad=True)
        self.alpha = torch.ones_like(self.amax, requires_grad=minmax)
        self.factors = (self.alpha,)

    def rebase(self, w: torch.Tensor, extra=None) -> None:
        """Learn on weight w [out, in] from now on, under the tensor-wide part of the scales `extra` (NVFP4's
        global scale, of the weights as they are now)."""
        out, inp = w.shape
        self.wg = w.float().reshape(out, inp // self.scheme.group_size, self.scheme.group_size)
        self.amax = self.wg.abs().amax(-1)  # [out, G]
        self.extra = extra

    def _scales(self):
        """The stored QParams of the clipped groups and their decode multiplier [out, G, 1], the latter equal in value
        to the format's and differentiable in alpha as amax·alpha / 6 (the stored scale's rounding passed through)."""
        clipped = self.amax * self.alpha
        qp, eff = self.fmt.group_scales_from_amax(clipped.detach(), self.scheme, self.dtype, self.extra)
        raw = clipped / FP4_MAX
        return qp, (raw + (eff - raw).detach()).unsqueeze(-1)

    def qdq(self) -> torch.Tensor:
        _, eff = self._scales()
        y = (self.wg / eff + self.v).clamp(-FP4_MAX, FP4_MAX)
        q = y + (fp4_decode(fp4_encode(y.detach())) - y).detach()
        return (q * eff).reshape(self.shape)

    def qtensor(self, dtype: torch.dtype) -> QTensor:
        """The QTensor through the format: the clipped groups' stored scales, codes the format's rounding of
        w + V·(decoded scale), i.e. of w / scale + V."""
        with torch.no_grad():
            qp, eff = self._scales()
            values = self.fmt.quantize((self.wg + self.v * eff).reshape(self.shape), qp, self.scheme)
        return QTensor.of(values, qp, self.scheme, dtype)


def tensor_wide_extras(ctx: LayerContext, weights: dict[str, torch.Tensor]) -> dict[str, dict | None]:
    """The tensor-wide part of each weight's scales (NVFP4's global scale; None for formats without one): weights
    the engines fuse (q/k/v, gate/up) share it, from their joint max, as round-to-nearest's and GPTQ's do."""
    extras: dict[str, dict | None] = {}
    for g in ctx.arch.fusion_groups:
        members = [m for m in g if m in weights]
        if members:
            s = ctx.scheme(members[0]).weights
            fmt = format_for(s)
            if fmt.tensor_wide(s):
                extra = fmt.shared_extra([weights[m].detach() for m in members], s, ctx.dtype)
                extras.update({m: extra for m in members})
    for t, w in weights.items():
        s = ctx.scheme(t).weights
        fmt = format_for(s)
        if t not in extras:
            extras[t] = fmt.shared_extra([w.detach()], s, ctx.dtype) if fmt.tensor_wide(s) else None
    return extras


def learners_for(ctx: LayerContext, names: list[str], minmax: bool, full_range: bool = False) -> dict:
    """A learner for each of `names` on its format's grid (Format.learned_grid; the recipe check refused the
    others), FP4 ones under tensor_wide_extras."""
    weights = {t: ctx.weight(t).to(ctx.device) for t in names}
    extras = tensor_wide_extras(ctx, weights)
    out = {}
    for t in names:
        s = ctx.scheme(t).weights
        fmt = format_for(s)
        w = weights[t]
        if fmt.learned_grid(s) == "fp4":
            out[t] = FP4Learner(w, s, minmax, ctx.dtype, extras[t])
        else:
            out[t] = Learner(w, s, minmax, fmt.scale_dtype(s, ctx.dtype), fmt.quotient_dtype(ctx.dtype), full_range)
    return out


class LearnedSmoothing:
    """Per-channel smoothing scales s = exp(theta) for the layer's smoothing pairs (qtk.steps.smoothing), learned with
    the rounding: `apply` folds them into the weights as qtk.steps.smoothing.fold does (the same functions, in the
    same order), differentiably, so the learners round the smoothed weights and the layer runs on the smoothed norms
    and biases."""

    def __init__(self, ctx: LayerContext, pairs, names: list[str]):
        self.ctx, self.pairs = ctx, pairs
        self.base = {t: ctx.weight(t).to(ctx.device).float() for t in names}  # the quantized Linears, unsmoothed
        self.theta = {p.prev: torch.zeros(ctx.layer.get_submodule(p.nexts[0]).weight.shape[1], device=ctx.device,
                                          requires_grad=True) for p in pairs}

    def params(self) -> list[torch.Tensor]:
        return list(self.theta.values())

    def scales(self) -> dict[str, torch.Tensor]:
        return {k: th.detach().exp() for k, th in self.theta.items()}

    def apply(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the quantized Linears' weights, fp32, smoothed by the current scales; the other parameters the scales
        change, {parameter name: tensor} in their own dtype, for functional_call)."""
        layer, arch = self.ctx.layer, self.ctx.arch
        cur: dict[str, torch.Tensor] = {t + ".weight": w for t, w in self.base.items()}

        def get(name):
            return cur[name] if name in cur else layer.get_parameter(name).detach().float()

        for pair in self.pairs:
            s = self.theta[pair.prev].exp()
            if pair.prev_is_norm:
                cur[pair.prev + ".weight"] = fold_into_norm(get(pair.prev + ".weight"), s, arch.norm_one_plus)
            else:
                has_bias = layer.get_submodule(pair.prev).bias is not None
                w, b = fold_into_linear_rows(get(pair.prev + ".weight"), get(pair.prev + ".bias") if has_bias else None, s)
                cur[pair.prev + ".weight"] = w
                if b is not None:
                    cur[pair.prev + ".bias"] = b
            for n in pair.nexts + pair.dense:
                cur[n + ".weight"] = scale_linear_columns(get(n + ".weight"), s)
        weights = {t: cur.pop(t + ".weight") for t in self.base}
        return weights, {k: v.to(layer.get_parameter(k).dtype) for k, v in cur.items()}

    def rebase(self, learners: dict) -> dict[str, torch.Tensor]:
        """Put every learner on the weights the current scales smooth (NVFP4's global scale retaken from them);
        returns the other parameters the scales change (apply's)."""
        weights, others = self.apply()
        extras = tensor_wide_extras(self.ctx, weights)
        for t, lr in learners.items():
            lr.rebase(weights[t], extras[t])
        return others


def _scale_aware(x: torch.Tensor, xq: torch.Tensor, act) -> torch.Tensor:
    """xq (x quantized as the engine does) in value; in the gradient, x's identity (the straight-through estimator)
    plus the dependence of the rounding error on the scale: the engine's dynamic scales are each group's (or token's)
    max |x| over the grid's max, so the error is (error / max) · max with the max differentiable, as a learned weight
    scale is. A static per-tensor scale depends on no x: the identity alone."""
    err = (xq - x).detach()
    group = act.column_group or (x.shape[-1] if act.strategy == Strategy.TOKEN else None)
    if group is None:
        if act.has_static_scale:
            return x + err
        m = x.abs().amax()  # a dynamic per-tensor scale
        return x + err + err * ((m - m.detach()) / m.detach().clamp_min(_TINY))
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    m = g.abs().amax(-1, keepdim=True)
    rel = err.reshape(g.shape) / m.detach().clamp_min(_TINY)
    return x + err + (rel * (m - m.detach())).reshape(x.shape)


def quantize_inputs(ctx: LayerContext, names: list[str], scale_aware: bool = False) -> list:
    """Forward pre-hooks that quantize each quantized Linear's input as the engine will (its activation scheme, with
    the static scale OBSERVE measured where the scheme has one), passed through to the gradient: the rounding is
    learned for the inputs the engine computes with (W4A8, NVFP4 W4A4). scale_aware: the gradient also sees the
    rounding error grow with the dynamic scales (_scale_aware), for what changes the inputs' ranges (the learned
    smoothing). Returns the hooks' handles."""
    handles = []
    for t in names:
        act = ctx.scheme(t).engine_activations
        if act is None:
            continue
        scale = static_scale(ctx.amax[t], act) if act.has_static_scale else None

        def hook(module, args, _act=act, _scale=scale):
            x = args[0]
            xq = fake_quant_activation(x.detach(), _act, _scale)
            if scale_aware:
                return (_scale_aware(x, xq, _act), *args[1:])
            return (x + (xq - x).detach(), *args[1:])

        handles.append(ctx.layer.get_submodule(t).register_forward_pre_hook(hook))
    return handles


@register_record
@dataclass
class AutoRoundRecord(StepRecord):
    """One layer's optimisation: iterations run, the one whose parameters were kept (lowest loss; `iters` where
    keep: all kept the last step's), the loss at the first (round to nearest, min-max scales), the lowest one's, and
    the last one's (mean squared error of the layer's outputs, each on its step's batch); with keep: all, the kept
    parameters' loss over every batch; with `smooth`, the learned smoothing scales folded in ({prev: s}, as AWQ
    records its own), the frame the weights were quantized in."""

    name = "autoround"
    iters: int = 0
    best_iter: int = 0
    initial_loss: float = 0.0
    best_loss: float = 0.0
    last_loss: float = 0.0
    scales: dict[str, list[float]] = field(default_factory=dict)
    kept_loss: float = 0.0  # with keep: all, the kept parameters' loss over every calibration batch (0: not measured)

    def to_json(self) -> dict:
        out = {"iters": self.iters, "best_iter": self.best_iter, "initial_loss": self.initial_loss,
               "best_loss": self.best_loss, "last_loss": self.last_loss}
        if self.scales:
            out["s"] = dict(self.scales)
        if self.kept_loss:
            out["kept_loss"] = self.kept_loss
        return out

    @classmethod
    def from_json(cls, data) -> "AutoRoundRecord":
        return cls(int(data["iters"]), int(data["best_iter"]), float(data["initial_loss"]), float(data["best_loss"]),
                   float(data["last_loss"]), dict(data.get("s") or {}), float(data.get("kept_loss") or 0.0))

    def reframe(self, W, rel, arch):
        return smoothed_weight(W, rel, arch, self.scales) if self.scales else W


def _output(y):
    return y[0] if isinstance(y, tuple) else y


def batch_order(n: int, iters: int, seed: int) -> list[int]:
    """The batch each step uses: every batch once per pass over them, each pass in a new seeded random order."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < iters:
        out.extend(torch.randperm(n, generator=g).tolist())
    return out[:iters]


@register_step("autoround")
def run(ctx: LayerContext, params: AutoRoundParams) -> AutoRoundRecord:
    layer, batches = ctx.layer, ctx.batches
    names = list(ctx.targets)
    dtypes = {t: layer.get_submodule(t).weight.dtype for t in names}
    learners = learners_for(ctx, names, params.minmax, params.full_range)
    smoothing = LearnedSmoothing(ctx, smoothing_pairs(layer, ctx.arch, names), names) if params.smooth else None
    frozen = [p for p in layer.parameters() if p.requires_grad]
    for p in frozen:  # only V and the factors are learned; the layer's own parameters take no gradient
        p.requires_grad_(False)
    try:
        if params.float_stream:  # the float model's own hidden states after this layer, which the loop carries
            targets = ctx.float_outputs
            assert targets is not None and len(targets) == len(batches), "the loop carries no float stream"
        else:  # this layer's outputs with its float weights on the same (quantized) inputs
            targets = ctx.float_layer_outputs(batches)
        # the target stays float: only the learning sees quantized inputs
        hooks = quantize_inputs(ctx, names, scale_aware=smoothing is not None)
        try:
            record = _learn(ctx, params, learners, dtypes, targets, smoothing)
        finally:
            for h in hooks:
                h.remove()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    if smoothing is not None:
        _fold_learned(ctx, smoothing, learners, record)
    for t, lr in learners.items():
        ctx.qweights[t] = lr.qtensor(ctx.dtype)
    return record


def _fold_learned(ctx: LayerContext, smoothing: LearnedSmoothing, learners: dict, record: AutoRoundRecord) -> None:
    """Fold the kept smoothing scales into the layer (and the fp32 master weights) as AWQ folds its own, leave the
    learners on the weights they smoothed, record the scales, and re-observe the static input ranges they changed."""
    with torch.no_grad():
        smoothing.rebase(learners)  # on the fp32 smoothed weights they learned on, not the layer's rounded copies
        scales = smoothing.scales()
        for pair in smoothing.pairs:
            fold(ctx.layer, ctx.arch, pair, scales[pair.prev], ctx.master)
            record.scales[pair.prev] = scales[pair.prev].float().tolist()
    if ctx.amax:  # OBSERVE measured the inputs before the scales divided them
        observe_static_ranges(ctx)


def _learn(ctx: LayerContext, params: AutoRoundParams, learners: dict[str, Learner], dtypes, targets,
           smoothing: LearnedSmoothing | None = None) -> AutoRoundRecord:
    """Signed gradient descent on every learner of the layer at once (and the smoothing scales, given them); the
    parameters of the lowest loss are left in the learners (and the scales)."""
    batches, reducer = ctx.batches, ctx.reducer
    round_p = [p for lr in learners.values() for p in lr.round_params()]
    clip_p = [p for lr in learners.values() for p in lr.clip_params()]
    smooth_p = smoothing.params() if smoothing is not None else []
    order = batch_order(len(batches), params.iters, params.seed + ctx.index)
    best, best_iter, best_state = math.inf, 0, None
    initial = last = math.nan
    for it, j in enumerate(order):
        with torch.enable_grad():
            loss = _batch_loss(ctx.layer, _quantized(learners, dtypes, smoothing), batches[j], targets[j])
            loss.backward()
        value = loss.detach().reshape(1)
        for p in round_p + clip_p + smooth_p:  # a Linear no token reached (an MoE expert) has no gradient: it stays put
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if reducer.world_size > 1:  # every process steps on the gradient summed over all their batches
            value = reducer.sum_(value) / reducer.world_size
            for p in round_p + clip_p + smooth_p:
                reducer.sum_(p.grad)
        last = float(value)
        if it == 0:
            initial = last
        if last < best:  # the parameters that gave this loss, before this step moves them
            best, best_iter = last, it
            best_state = {t: lr.snapshot() for t, lr in learners.items()}
            best_scales = [p.detach().clone() for p in smooth_p]
        decay = 1.0 - it / params.iters  # linear to 0, as auto-round's LinearLR(start 1, end 0)
        with torch.no_grad():
            for p in round_p:
                p.add_(p.grad.sign(), alpha=-params.step_lr * decay).clamp_(-V_BOUND, V_BOUND)
                p.grad = None
            for p in clip_p:
                p.add_(p.grad.sign(), alpha=-params.clip_lr * decay).clamp_(*CLIP_BOUNDS)
                p.grad = None
            for p in smooth_p:
                p.add_(p.grad.sign(), alpha=-params.scale_lr * decay)
                p.grad = None
    kept_loss = 0.0
    if best_state is not None:
        keep_all = params.keep == "all"  # a single batch's lowest loss can be luck: ask every batch
        if keep_all:  # the learners hold the last step's parameters
            last_state = ({t: lr.snapshot() for t, lr in learners.items()}, [p.detach().clone() for p in smooth_p])
            last_loss = _loss_on_all(ctx, learners, dtypes, targets, smoothing)
        _restore(learners, smooth_p, (best_state, best_scales))
        if keep_all:
            kept_loss = _loss_on_all(ctx, learners, dtypes, targets, smoothing)
            if last_loss < kept_loss:
                _restore(learners, smooth_p, last_state)
                kept_loss, best_iter = last_loss, params.iters
    return AutoRoundRecord(params.iters, best_iter, initial, best, last, kept_loss=kept_loss)


def _restore(learners: dict, smooth_p: list[torch.Tensor], state) -> None:
    learned, scales = state
    for t, lr in learners.items():
        lr.restore(learned[t])
    with torch.no_grad():
        for p, x in zip(smooth_p, scales):
            p.copy_(x)


def _quantized(learners: dict, dtypes, smoothing: LearnedSmoothing | None) -> dict[str, torch.Tensor]:
    """The layer's parameters under the learners' current rounding (and smoothing scales: the learners re-based on
    the weights they smooth), for functional_call."""
    qw = smoothing.rebase(learners) if smoothing is not None else {}
    qw.update({t + ".weight": lr.qdq().to(dtypes[t]) for t, lr in learners.items()})
    return qw


def _batch_loss(layer, qw: dict[str, torch.Tensor], batch, target: torch.Tensor) -> torch.Tensor:
    h, kw = batch
    y = _output(functional_call(layer, qw, (h,), kw))
    return torch.nn.functional.mse_loss(y.float(), target.to(y.device).float())


def _loss_on_all(ctx: LayerContext, learners: dict, dtypes, targets, smoothing) -> float:
    """The loss of the learners' current parameters over every calibration batch of every process."""
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        qw = _quantized(learners, dtypes, smoothing)
        for batch, target in zip(ctx.batches, targets):
            total[0] += float(_batch_loss(ctx.layer, qw, batch, target))
            total[1] += 1
    if ctx.reducer.world_size > 1:
        total = ctx.reducer.sum_(total)
    return float(total[0] / total[1].clamp_min(1))

