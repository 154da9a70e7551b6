"""The algorithm steps a recipe may list: each step's parameters as a frozen dataclass, declared with what the recipe
parser needs to validate a step list (light: no torch import) — its phase, whether it is the recipe's solver, what
it conflicts with, whether it needs data.

The recipe loader validates a step's YAML mapping against the dataclass registered here; the step's implementation
(qtk.steps, registered under the same name) reads its parameters from the same dataclass.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from enum import IntEnum
from typing import Any, Mapping

from qtk.errors import UsageError


class Phase(IntEnum):
    """When a step runs in a layer: transforms first (smoothing, rotations: they change the weights and their
    inputs), then statistics are observed on the transformed layer, then the weights are solved."""

    TRANSFORM = 1
    OBSERVE = 2
    SOLVE = 3


STEP_PARAMS: dict[str, type] = {}


def register_step(name: str, *, phase: Phase, solver: bool = False, conflicts: Mapping[str, str] | None = None,
                  title: str | None = None):
    """Declare a recipe step on its parameters dataclass (which also says `needs_data`).

    solver: the step decides how the weights are rounded, and a recipe lists exactly one solver, last (rtn, gptq;
    awq, a transform whose weights round-to-nearest then rounds). conflicts: {other step: why}, a pair a recipe may
    not list together. title: how messages name it."""

    def deco(cls):
        cls.step_name = name
        cls.phase = phase
        cls.solver = solver
        cls.conflicts = dict(conflicts or {})
        cls.title = title or name
        STEP_PARAMS[name] = cls
        return cls

    return deco


def check_steps(names: list[str], origin: str) -> None:
    """Refuse a recipe's step list (known names) that is not one solver, last, after steps in phase order, without
    conflicting pairs; every message names the problem and a fix."""
    if len(set(names)) != len(names):
        raise UsageError(f"{origin}: algorithm lists a step twice ({names})", "list each step once")
    solvers = [n for n in names if STEP_PARAMS[n].solver]
    if len(solvers) != 1 or names[-1] != solvers[0]:
        every = [n for n, c in STEP_PARAMS.items() if c.solver]
        raise UsageError(f"{origin}: algorithm must end with exactly one of {', '.join(every)} (got {names})",
                         "e.g. [smoothquant, gptq] or [awq]")
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


@register_step("rtn", phase=Phase.SOLVE, solver=True, title="RTN")
@dataclass(frozen=True)
class RTNParams:
    """Round-to-nearest with the scheme's observer (min-max or MSE grid)."""

    needs_data = False

    def validate(self, where: str) -> None:
        pass


# llm-compressor's / compressed-tensors' spellings of GPTQ activation ordering -> qtk's two orderings
ACTORDER = {"static": "static", "weight": "static", "group": "group", "dynamic": "group", "false": None, "none": None}


@register_step("gptq", phase=Phase.SOLVE, solver=True, title="GPTQ")
@dataclass(frozen=True)
class GPTQParams:
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
    """

    block_size: int = 128
    damp_percent: float = 0.01
    actorder: Any = "static"  # canonical after __post_init__: "static" | "group" | None
    static_groups: bool = False
    max_damp_retries: int = 5
    # Hessians of later sub-blocks (o, gate/up, down) taken on the outputs of the already-quantized earlier
    # ones: one partial forward per sub-block instead of one for all. Off, as in llm-compressor (measured on
    # the tests' models and benchmarks/vs_llmcompressor.py: no accuracy difference).
    true_sequential: bool = False

    needs_data = True

    def validate(self, where: str) -> None:
        if self.block_size <= 0:
            raise UsageError(f"{where}.block_size: must be positive, got {self.block_size}", "use e.g. 128")
        if not 0 < self.damp_percent < 1:
            raise UsageError(f"{where}.damp_percent: must be in (0, 1), got {self.damp_percent}", "use e.g. 0.01")
        if self.max_damp_retries < 0:
            raise UsageError(f"{where}.max_damp_retries: must be >= 0", "use e.g. 5")

    def __post_init__(self):  # the Python API gets the same spellings and refusals as a recipe
        object.__setattr__(self, "actorder", gptq_actorder(self.actorder, self.static_groups, "gptq"))

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

    @property
    def group_order(self) -> bool:
        """Groups follow the permuted column order (a g_idx when the weights are group-wise)."""
        return self.actorder == "group"


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


@register_step("awq", phase=Phase.TRANSFORM, solver=True, title="AWQ",
               conflicts={"smoothquant": "both rescale the same channels"})
@dataclass(frozen=True)
class AWQParams:
    """AWQ (Lin et al., 2023): activation-aware per-channel scales, then a clip search."""

    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    n_sample_tokens: int = 512

    needs_data = True

    def validate(self, where: str) -> None:
        if self.grid < 1 or self.clip_grid < 1:
            raise UsageError(f"{where}.grid: must be >= 1", "use e.g. 20")
        if not 0 <= self.max_shrink < 1:
            raise UsageError(f"{where}.max_shrink: must be in [0, 1), got {self.max_shrink}", "use e.g. 0.5")
        if self.n_sample_tokens <= 0:
            raise UsageError(f"{where}.n_sample_tokens: must be positive", "use e.g. 512")


@register_step("smoothquant", phase=Phase.TRANSFORM, title="SmoothQuant")
@dataclass(frozen=True)
class SmoothQuantParams:
    """SmoothQuant (Xiao et al., 2022): migrate activation outliers into weights with strength alpha."""

    alpha: float = 0.5

    needs_data = True

    def validate(self, where: str) -> None:
        if not 0 <= self.alpha <= 1:
            raise UsageError(f"{where}.alpha: must be in [0, 1], got {self.alpha}", "use e.g. 0.5 (0.8 for Llama-family)")


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
