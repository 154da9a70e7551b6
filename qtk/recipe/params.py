"""The algorithm steps a recipe may list: each step's parameters as a frozen dataclass, declared with what the recipe
parser needs to validate a step list (light: no torch import) — its phase, whether it is the recipe's solver, what
it conflicts with, whether it needs data — and what the rest of qtk asks of a step without naming it: what it costs
a conversion (`cost`, for qtk plan) and whether it changes the frame the weights are quantized in
(`changes_frame`: the loop and the checks then rebuild the reference weight through the step's record).

The recipe loader validates a step's YAML mapping against the dataclass registered here; the step's implementation
(qtk.steps, registered under the same name) reads its parameters from the same dataclass.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from enum import IntEnum
from typing import Any, Mapping

from qtk.errors import UsageError
from qtk.registry import Registry


class Phase(IntEnum):
    """When a step runs in a layer: transforms first (smoothing, rotations: they change the weights and their
    inputs), then statistics are observed on the transformed layer, then the weights are solved."""

    TRANSFORM = 1
    OBSERVE = 2
    SOLVE = 3


STEP_PARAMS = Registry("recipe step")  # name -> its parameters dataclass


@dataclass(frozen=True)
class InputGroup:
    """The quantized Linears of one decoder layer that read one input (q/k/v, gate/up), as the planner counts them
    from config.json: their input width, their output rows together (experts counted), and how many copies of the
    group a layer holds (MoE experts: each expert sees its own tokens)."""

    layer: int
    width: int
    rows: int
    copies: int = 1


@dataclass(frozen=True)
class ModelCost:
    """What the planner knows of a conversion when it asks a step for its cost: the decoder layers, the parameters of
    one layer's Linears, the calibration tokens, the quantized Linears' input groups, the widest Linear input."""

    layers: int
    layer_params: float
    tokens: int
    groups: tuple[InputGroup, ...]
    widest: int
    samples: int = 1  # calibration windows the tokens are in


@dataclass(frozen=True)
class StepCost:
    """What one step adds to a conversion (qtk.plan.convert_cost, qtk.plan.memory): forward passes of each layer over
    the calibration tokens, further forward FLOPs, solver FLOPs, bytes reduced between processes, and the state it
    holds beside one layer (`memory` bytes under `memory_key`, which the plan shows as `memory_label`)."""

    input_passes: int = 0
    forward_flops: float = 0.0
    solve_flops: float = 0.0
    reduce_bytes: float = 0.0
    memory: int = 0
    memory_key: str = ""
    memory_label: str = ""
    memory_note: str = ""


class StepParams:
    """What every step's parameters declare beyond their fields: whether the step looks at calibration data, whether
    it changes the frame the weights are quantized in (a smoothing or a rotation: the reference of the weight error
    is then the source weight put through the step's record, qtk.steps.records), and its cost."""

    needs_data = False
    changes_frame = False
    # part of the step is applied by the engine at run time (an online transform): only targets that can accept it
    online = False
    # the step repeats forward and backward passes of every layer (AutoRound): `qtk plan --recommend` ranks its recipe
    # after a one-pass solver's of the same class, whose conversion costs a fraction of it
    iterative = False
    # the step reads the float model's own hidden states at each layer (LayerContext.float_outputs): the loop then
    # carries them as a second stream beside the quantized one, through resume and every process
    float_stream = False

    def cost(self, model: ModelCost) -> StepCost:
        """A step that looks at data observes each layer's inputs once; override what it adds beyond that."""
        return StepCost(input_passes=1 if self.needs_data else 0)


def declare_step(name: str, *, phase: Phase, solver: bool = False, conflicts: Mapping[str, str] | None = None,
                  title: str | None = None):
    """Declare a recipe step on its parameters dataclass (which also says `needs_data`); its implementation registers
    under the same name with qtk.steps.registry.register_step.

    solver: the step decides how the weights are rounded, and a recipe lists exactly one solver, last (rtn, gptq;
    awq, a transform whose weights round-to-nearest then rounds, or the solver listed after it). conflicts: {other
    step: why}, a pair a recipe may not list together. title: how messages name it."""

    def deco(cls):
        for attr in ("needs_data", "changes_frame", "iterative", "float_stream", "cost"):  # what a class that is no StepParams leaves out
            if not hasattr(cls, attr):
                setattr(cls, attr, getattr(StepParams, attr))
        cls.step_name = name
        cls.phase = phase
        cls.solver = solver
        cls.conflicts = dict(conflicts or {})
        cls.title = title or name
        return STEP_PARAMS.add(name, cls)

    return deco


def check_steps(names: list[str], origin: str) -> None:
    """Refuse a recipe's step list (known names) that is not one solver, last, after steps in phase order, without
    conflicting pairs; every message names the problem and a fix."""
    if len(set(names)) != len(names):
        raise UsageError(f"{origin}: algorithm lists a step twice ({names})", "list each step once")
    solvers = [n for n in names if STEP_PARAMS[n].solver]
    # a transform that solves when it is last (awq: its weights then round to nearest) may come before the solver
    # that rounds its weights instead ([awq, gptq], [awq, autoround])
    early = [n for n in solvers[:-1] if STEP_PARAMS[n].phase is not Phase.TRANSFORM]
    if not solvers or names[-1] != solvers[-1] or early:
        every = [n for n, c in STEP_PARAMS.items() if c.solver]
        raise UsageError(f"{origin}: algorithm must end with exactly one of {', '.join(every)} (got {names})",
                         "e.g. [smoothquant, gptq], [awq] or [awq, gptq]")
    for a, b in zip(names, names[1:]):
        pa, pb = STEP_PARAMS[a].phase, STEP_PARAMS[b].phase
        if pb < pa:
            raise UsageError(f"{origin}: algorithm lists {b} ({pb.name.lower()}) after {a} ({pa.name.lower()}), but every "
                             "layer is transformed, then observed, then solved",
                             f"list {b} before {a}")
    for a in names:
        for b, why in STEP_PARAMS[a].conflicts.items():
            if b in names:
                raise UsageError(f"{origin}: {a} and {b} {why}", "use one of them")


@declare_step("rtn", phase=Phase.SOLVE, solver=True, title="RTN")
@dataclass(frozen=True)
class RTNParams(StepParams):
    """Round-to-nearest with the scheme's observer (min-max or MSE grid)."""

    needs_data = False

    def validate(self, where: str) -> None:
        pass


# llm-compressor's / compressed-tensors' spellings of GPTQ activation ordering -> qtk's two orderings
ACTORDER = {"static": "static", "weight": "static", "group": "group", "dynamic": "group", "false": None, "none": None}


@declare_step("gptq", phase=Phase.SOLVE, solver=True, title="GPTQ")
@dataclass(frozen=True)
class GPTQParams(StepParams):
    """GPTQ (Frantar et al., 2022): second-order error compensation per Linear.

    actorder (activation ordering; columns visited by descending diag H, the most active inputs first):
      static | weight  group scales fixed up front from the original columns: no g_idx, so every target and
                       kernel (vLLM Marlin, TensorRT-LLM) serves it; compressed-tensors actorder "weight".
                       llm-compressor's default, and qtk's.
      group | dynamic  groups formed in the permuted order, a g_idx maps each column to its group: only the
                       legacy gptq target stores it (compressed-tensors 0.20 rejects it).
      false | null     columns in order.
    static_groups: with actorder false, take the group scales up front from the original columns too (actorder
      static implies it; actorder group contradicts it).
    full_range: symmetric int groups (or channels) scaled by amax / -qmin (amax / 8 for int4), signed so that each
      group's larger-magnitude extreme is exactly the most negative code (the autoround step's full-range grid,
      IntFormat.full_range_scale), instead of compressed-tensors' amax / ((qmax - qmin) / 2); the checkpoint then
      stores negative scales, which decode as q · s (vLLM runs them: tests/engine). Off: llm-compressor's grid.
      The same as the weights' `observer: full_range` (which round-to-nearest and AutoRound take too).
    """

    block_size: int = 128
    damp_percent: float = 0.01
    actorder: Any = "static"  # canonical after __post_init__: "static" | "group" | None
    static_groups: bool = False
    max_damp_retries: int = 5
    # Hessians of later sub-blocks (o, gate/up, down) taken on the outputs of the already-quantized earlier
    # ones: one partial forward per sub-block instead of one for all. Off, as in llm-compressor (no accuracy
    # difference on the tests' models: benchmarks/vs_llmcompressor.py)
    true_sequential: bool = False
    full_range: bool = False

    needs_data = True

    def cost(self, model: ModelCost) -> StepCost:
        """One in x in float32 Hessian per distinct Linear input of a layer (per expert), held for the layer with the
        inverse being factorised; solving a group costs in³ (the Cholesky) + rows·in² (the column loop), and the
        Hessians are summed over processes."""
        per_layer: dict[int, int] = {}
        for g in model.groups:
            per_layer[g.layer] = per_layer.get(g.layer, 0) + g.width ** 2 * 4 * g.copies
        largest = max((g.width ** 2 * 4 for g in model.groups), default=0)
        return StepCost(input_passes=1,
                        solve_flops=sum(g.width ** 3 + g.rows * g.width ** 2 for g in model.groups),
                        reduce_bytes=sum(4 * g.width * g.width for g in model.groups),
                        memory=max(per_layer.values(), default=0) + largest, memory_key="hessians",
                        memory_label="GPTQ Hessians",
                        memory_note="GPTQ: one in×in fp32 Hessian per distinct Linear input in a layer (per expert for MoE)")

    def validate(self, where: str) -> None:
        if self.block_size <= 0:
            raise UsageError(f"{where}.block_size: must be positive, got {self.block_size}", "use e.g. 128")
        if not 0 < self.damp_percent < 1:
            raise UsageError(f"{where}.damp_percent: must be in (0, 1), got {self.damp_percent}", "use e.g. 0.01")
        if self.max_damp_retries < 0:
            raise UsageError(f"{where}.max_damp_retries: must be >= 0", "use e.g. 5")

    def __post_init__(self):  # the Python API gets the same spellings and refusals as a recipe
        object.__setattr__(self, "actorder", gptq_actorder(self.actorder, self.static_groups, "gptq"))

    def check_recipe(self, recipe, origin: str) -> None:
        """full_range: every scheme's weights symmetric int per channel or group (the grid it changes)."""
        if not self.full_range:
            return
        for m in recipe.schemes:
            w = m.weights
            if not w.has_full_range_grid:
                raise UsageError(f"{origin}: gptq full_range is a grid of symmetric int weights per channel or group, "
                                 f"not {w.describe()}", "remove full_range, or use symmetric int weights")

    @staticmethod
    def prepare(raw: dict, where: str) -> dict:
        """A recipe's gptq mapping with actorder in its canonical spelling (errors name the recipe key)."""
        if "actorder" in raw:
            raw = {**raw, "actorder": gptq_actorder(raw["actorder"], bool(raw.get("static_groups", False)), where)}
        return raw

    @property
    def reorders(self) -> bool:
        """Columns are visited by descending diag H."""
        return self.actorder is not None


def gptq_actorder(value, static_groups: bool, where: str) -> str | None:
    """llm-compressor's spellings of actorder -> "static" | "group" | None; refuses what is ambiguous or contradictory."""
    if value is True:
        # compressed-tensors 0.20 rejects actorder=True too: it used to mean "group", whose g_idx few targets can
        # hold, and qtk's old `actorder: true, static_groups: true` meant "static"; the name says which one
        raise UsageError(f"{where}.actorder: true is ambiguous (it meant 'group', or 'static' with static_groups)",
                         "write actorder: static (no g_idx, every target) or actorder: group (g_idx, --target gptq only)")
    if value is False or value is None:
        a = None
    elif isinstance(value, str) and value.lower() in ACTORDER:
        a = ACTORDER[value.lower()]
    else:
        raise UsageError(f"{where}.actorder: unknown ordering {value!r}", "use static (or weight), group (or dynamic), or false")
    if a == "group" and static_groups:
        raise UsageError(f"{where}: actorder group forms the groups in permuted order, static_groups fixes them up front",
                         "write actorder: static (permuted columns, static groups) and drop static_groups")
    return a


@declare_step("awq", phase=Phase.TRANSFORM, solver=True, title="AWQ",
               conflicts={"smoothquant": "both rescale the same channels"})
@dataclass(frozen=True)
class AWQParams(StepParams):
    """AWQ (Lin et al., 2023): activation-aware per-channel scales, then a clip search."""

    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    n_sample_tokens: int = 512

    needs_data = True
    changes_frame = True

    def cost(self, model: ModelCost) -> StepCost:
        """The scale grid runs each layer's Linears over a token sample once per ratio (20, on at most 4096 tokens),
        and the inputs of the widest Linear group are cached for it."""
        return StepCost(input_passes=1, forward_flops=20 * 2 * model.layer_params * min(model.tokens, 4096) * model.layers,
                        memory=model.tokens * model.widest * 4, memory_key="awq_cache", memory_label="AWQ input cache",
                        memory_note="AWQ: the inputs of the widest Linear group cached for the scale search")

    def validate(self, where: str) -> None:
        if self.grid < 1 or self.clip_grid < 1:
            raise UsageError(f"{where}.grid: must be >= 1", "use e.g. 20")
        if not 0 <= self.max_shrink < 1:
            raise UsageError(f"{where}.max_shrink: must be in [0, 1), got {self.max_shrink}", "use e.g. 0.5")
        if self.n_sample_tokens <= 0:
            raise UsageError(f"{where}.n_sample_tokens: must be positive", "use e.g. 512")


@declare_step("smoothquant", phase=Phase.TRANSFORM, title="SmoothQuant")
@dataclass(frozen=True)
class SmoothQuantParams(StepParams):
    """SmoothQuant (Xiao et al., 2022): migrate activation outliers into weights with strength alpha."""

    alpha: float = 0.5

    needs_data = True
    changes_frame = True

    def validate(self, where: str) -> None:
        if not 0 <= self.alpha <= 1:
            raise UsageError(f"{where}.alpha: must be in [0, 1], got {self.alpha}", "use e.g. 0.5 (0.8 for Llama-family)")


@declare_step("rotate", phase=Phase.TRANSFORM, title="rotation")
@dataclass(frozen=True)
class RotateParams(StepParams):
    """Offline Hadamard rotations (QuaRot, Ashkboos et al. 2024; SpinQuant's R1/R2, Liu et al. 2024), folded into
    the weights, so the checkpoint is an ordinary one of a rotated model that computes what the source computes:

      R1  the residual stream: every RMSNorm's scale folded into the Linears it feeds (the norm then scales by 1),
          those Linears' inputs and o_proj / down_proj's outputs rotated, the embeddings and lm_head too (the
          final norm folded into lm_head: a tied embedding is untied where that norm is not all ones)
      R2  per attention head: v_proj's outputs and o_proj's inputs, one head_dim rotation for every head

    A rotation spreads an outlier channel over all of them, so groups and per-token scales see flatter values.
    seed: the random ±1 signs of the randomised Hadamard (recorded with the sizes in qtk.json); r2: also R2."""

    seed: int = 0
    r2: bool = True

    needs_data = False
    changes_frame = True
    # a tied lm_head is written as a tensor of its own (qtk.plan.memory counts it)
    unties_embeddings = True

    def cost(self, model: ModelCost) -> StepCost:
        """No data: each weight multiplied by the Hadamard factors of its widths, 2·(sum of the factors' orders)
        FLOPs per element (576 = 36 ⊗ 16: 104; 4096 = 1024 ⊗ 4: 2056), counted as 2·1024."""
        return StepCost(solve_flops=2.0 * 1024 * model.layer_params * model.layers)

    def validate(self, where: str) -> None:
        if not 0 <= self.seed < 2**63:
            raise UsageError(f"{where}.seed: must be in [0, 2^63), got {self.seed}", "use e.g. 0")


_FRAME = "both change down_proj's input frame (scales searched on one side of the rotation would fold into the other)"


@declare_step("rotate_online", phase=Phase.TRANSFORM, title="online rotation",
              conflicts={"awq": _FRAME, "smoothquant": _FRAME})
@dataclass(frozen=True)
class OnlineRotateParams(StepParams):
    """An online Hadamard rotation (QuaRot / SpinQuant's R4) of down_proj's input: its weight is stored rotated
    (W R), and the engine rotates the activation (x R) before the quantized GEMM, so x R (W R)ᵀ = x Wᵀ. The
    activation entering down_proj (the MLP's gated product) has the widest outliers of a layer; rotated, each
    group and each per-token scale sees flat values. Written as a compressed-tensors transform (`transform_config`,
    type random-hadamard: the matrix itself is stored beside each down_proj, which vLLM loads and applies as a dense
    GEMM); only targets whose engine applies it at run time accept it (vllm).

    seed: the random ±1 signs of R (recorded in qtk.json); block: 0 for one Hadamard of the whole width (a
    block-diagonal one where no construction reaches it), else the order of the blocks of a block-diagonal R (a
    power of two such as 128 keeps the stored matrix and the run-time GEMM small). modules: "down_proj" (R4), or
    "all": every quantized Linear's input rotated within blocks of `block` channels (the FP4 recipes' within-group
    Hadamard of MR-GPTQ / FP-Quant with block = the group size; needs a block)."""

    seed: int = 0
    block: int = 0
    modules: str = "down_proj"

    needs_data = False
    changes_frame = True
    # the engine applies part of this step at run time: only writers that declare online_transforms accept it
    online = True

    def cost(self, model: ModelCost) -> StepCost:
        """No data: down_proj's weight multiplied by R, counted as a dense GEMM of its width per row (an upper bound)."""
        return StepCost(solve_flops=2.0 * model.widest * model.layer_params / 3 * model.layers)

    def validate(self, where: str) -> None:
        if not 0 <= self.seed < 2**63:
            raise UsageError(f"{where}.seed: must be in [0, 2^63), got {self.seed}", "use e.g. 0")
        if self.block < 0 or (self.block and self.block % 4 and self.block not in (1, 2)):
            raise UsageError(f"{where}.block: must be 0 (the whole width) or a Hadamard order (1, 2 or a multiple of 4), "
                             f"got {self.block}", "use 0, or a power of two such as 128")
        if self.modules not in ("down_proj", "all"):
            raise UsageError(f"{where}.modules: must be down_proj or all, got {self.modules!r}", "use modules: down_proj")
        if self.modules == "all" and not self.block:
            raise UsageError(f"{where}.modules: all rotates inputs of several widths, within blocks of one order",
                             "set block, e.g. the weights' group size (16 for NVFP4)")


@declare_step("autoround", phase=Phase.SOLVE, solver=True, title="AutoRound",
              conflicts={"gptq": "both solve the rounding of the same weights"})
@dataclass(frozen=True)
class AutoRoundParams(StepParams):
    """AutoRound / SignRound (Cheng et al., 2023; intel/auto-round): per decoder layer, a rounding offset V in
    [-0.5, 0.5] for every weight element and a factor in [0.5, 1] on each group's max and min (the clipping), learned
    by signed gradient descent (each step moves every parameter by lr · sign(gradient), lr decaying linearly to 0)
    to minimise the MSE between the layer's outputs with the quantized weights and with the float ones, on the
    calibration inputs; the lowest loss seen is kept. One calibration batch (convert --batch-size windows, 8 by
    default as auto-round's batch_size) per step, drawn in a seeded random order.

    iters: signed-gradient steps per layer (auto-round's default 200). lr: the rounding offsets' step (0: 1/iters,
    auto-round's default); minmax_lr: the clipping factors' (0: lr). minmax: learn the clipping factors too
    (auto-round's enable_minmax_tuning). seed: the order the batches are drawn in. target: what the layer's quantized
    outputs (on the quantized model's inputs) are pulled toward: `model`, the float model's own hidden states after
    this layer, carried through the loop as a second stream, so each layer also corrects the error of the layers
    before it (auto-round's); `layer`, this layer's float outputs on the same quantized inputs (its own error only).
    full_range: a symmetric int grid's scales start at amax / -qmin (amax / 8 for int4), signed so that each group's
    larger-magnitude extreme is exactly the most negative code (auto-round's int_sym, llama.cpp's), instead of
    compressed-tensors' amax / ((qmax - qmin) / 2); the checkpoint then stores negative scales, which decode as q · s
    (vLLM runs them: tests/engine). The weights' `observer: full_range` turns it on too.
    smooth: also learn, with the rounding, a per-channel smoothing scale s for each of the layer's smoothing pairs
    (the ones AWQ and SmoothQuant fold: a norm or a Linear's output rows divided by s, the Linears reading it
    multiplied by s column-wise, so the float model is unchanged): the learned equivalent transformation of
    OmniQuant (Shao et al., 2023), which moves what W4A4 activations cannot hold into the weights, where the learned
    rounding takes it; the activations' rounding error is then differentiated through their group maxima. s starts at
    1 (on top of what a transform before it folded) and moves in log space; smooth_lr is its step (0: lr). The scales
    are folded in and recorded (the frame the weights were quantized in), the static input ranges re-observed.
    keep: which parameters are kept: `batch`, those of the lowest loss seen, each step's loss being on its own batch
    (auto-round's); `all`, of those and the last step's, the ones with the lower loss over every calibration batch
    (two more forward passes over them per layer): a batch-to-batch spread of the loss (NVFP4 W4A4 with a layer whose
    rare tokens carry large errors) makes the lowest single-batch loss partly luck.
    Int weights per channel or group (W4A16, W8A16, W4A8; symmetric or not) and FP4 groups (NVFP4, MXFP4; W4A16 or
    W4A4); quantized activations are fake-quantized as the engine does while the rounding is learned."""

    iters: int = 200
    lr: float = 0.0
    minmax_lr: float = 0.0
    minmax: bool = True
    seed: int = 0
    target: str = "model"
    full_range: bool = True
    smooth: bool = False
    smooth_lr: float = 0.0
    keep: str = "batch"

    needs_data = True
    iterative = True
    # with `smooth` it folds scales into the layer; its record then holds them (without, it reframes nothing)
    changes_frame = True

    @property
    def float_stream(self) -> bool:
        return self.target == "model"

    @property
    def step_lr(self) -> float:
        return self.lr if self.lr > 0 else 1.0 / self.iters

    @property
    def clip_lr(self) -> float:
        return self.minmax_lr if self.minmax_lr > 0 else self.step_lr

    @property
    def scale_lr(self) -> float:
        return self.smooth_lr if self.smooth_lr > 0 else self.step_lr

    def cost(self, model: ModelCost) -> StepCost:
        """One forward of each layer for its float outputs (the loss's target), kept beside its inputs; then iters
        forward and backward passes (about 3 forwards' FLOPs) over one calibration batch (convert's default
        --batch-size, 8 windows); with keep: all, two forwards over every window."""
        batch_tokens = model.tokens * min(8, model.samples) // max(model.samples, 1)
        flops = self.iters * 3 * 2 * model.layer_params * batch_tokens * model.layers
        if self.keep == "all":  # two candidates' forwards over every calibration window
            flops += 2 * 2 * model.layer_params * model.tokens * model.layers
        outputs = model.tokens * model.widest * 4
        if not self.float_stream:
            return StepCost(input_passes=1, forward_flops=flops, memory=outputs, memory_key="autoround_outputs",
                            memory_label="AutoRound float outputs",
                            memory_note="AutoRound: the layer's float outputs on every calibration window, the loss's target")
        # the float model's stream: its inputs to the layer beside the quantized ones, and its outputs (the target)
        return StepCost(input_passes=1, forward_flops=flops, memory=2 * outputs, memory_key="autoround_outputs",
                        memory_label="AutoRound float stream",
                        memory_note="AutoRound: the float model's hidden states entering and leaving the layer on every "
                                    "calibration window (the loss's target)")

    def validate(self, where: str) -> None:
        if not 0 < self.iters <= 100_000:
            raise UsageError(f"{where}.iters: must be in 1..100000, got {self.iters}", "use e.g. 200 (auto-round's default)")
        if not 0 <= self.lr <= 1:
            raise UsageError(f"{where}.lr: must be in [0, 1] (0: 1/iters), got {self.lr}", "use e.g. 0.005 or 0 for 1/iters")
        if not 0 <= self.minmax_lr <= 1:
            raise UsageError(f"{where}.minmax_lr: must be in [0, 1] (0: lr), got {self.minmax_lr}", "use e.g. 0.005 or 0 for lr")
        if not 0 <= self.smooth_lr <= 1:
            raise UsageError(f"{where}.smooth_lr: must be in [0, 1] (0: lr), got {self.smooth_lr}", "use e.g. 0.01 or 0 for lr")
        if not 0 <= self.seed < 2**63:
            raise UsageError(f"{where}.seed: must be in [0, 2^63), got {self.seed}", "use e.g. 0")
        if self.target not in ("model", "layer"):
            raise UsageError(f"{where}.target: must be model or layer, got {self.target!r}",
                             "use target: model (the float model's hidden states, auto-round's)")
        if self.keep not in ("batch", "all"):
            raise UsageError(f"{where}.keep: must be batch or all, got {self.keep!r}",
                             "use keep: all (the lower loss over every calibration batch) or batch (auto-round's)")

    def check_recipe(self, recipe, origin: str) -> None:
        """Weights on a grid it learns on in every scheme of the recipe (Format.learned_grid: int per channel or group,
        NVFP4, MXFP4); activations, if quantized, are quantized as the engine will while it learns."""
        from qtk.quant.formats import format_for

        for m in recipe.schemes:
            w = m.weights
            if format_for(w).learned_grid(w) is None:
                raise UsageError(f"{origin}: autoround learns int weights per channel or group and FP4 groups (NVFP4, "
                                 f"MXFP4), not {w.describe()}",
                                 "use w4a16-autoround or nvfp4-autoround as a template, or gptq / rtn for these weights")


def parse_step_params(name: str, raw: Any, where: str):
    cls = STEP_PARAMS[name]
    if not isinstance(raw, Mapping):
        raise UsageError(f"{where}: parameters must be a mapping, got {type(raw).__name__}", f"e.g. '- {name}: {{}}'")
    valid = {f.name: f for f in fields(cls)}
    kwargs = {}
    for k, v in raw.items():
        if k not in valid:
            import difflib

            close = difflib.get_close_matches(str(k), list(valid), n=1)
            hint = f"did you mean '{close[0]}'?" if close else (f"valid keys: {', '.join(valid)}" if valid else f"{name} takes no parameters")
            raise UsageError(f"{where}: unknown key {k!r}", hint)
        default = valid[k].default
        if valid[k].type == "Any":  # several spellings: the class's prepare() checks them
            kwargs[k] = v
            continue
        want = type(default) if default is not MISSING else type(v)
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise UsageError(f"{where}.{k}: expected {want.__name__}, got {v!r}", f"set {k} to a {want.__name__}")
        kwargs[k] = v
    if hasattr(cls, "prepare"):
        kwargs = cls.prepare(kwargs, where)
    params = cls(**kwargs)
    params.validate(where)
    return params
