"""The step registry: each step's implementation under its name, with its phase, data need, parameters and
conflicts, and the plan of steps a recipe runs in every layer.

A step a recipe lists is declared with its parameters in qtk.recipe.params (phase, solver, conflicts, needs_data),
where the recipe parser validates step lists without importing torch; its implementation registers here under the
same name and takes those declarations. A step no recipe lists (the static input-amax observation) is implied by the
recipe and declares everything here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from qtk.recipe import Recipe
from qtk.recipe.params import STEP_PARAMS, Phase
from qtk.registry import Registry

__all__ = ["Phase", "StepDef", "STEPS", "NO_PARAMS", "register_step", "unregister_step", "plan_steps", "source_view",
           "needs_float_stream"]


@dataclass(frozen=True)
class NoParams:
    """The parameters of a step that has none."""


NO_PARAMS = NoParams()


@dataclass(frozen=True)
class StepDef:
    """A registered step. run(ctx, params) works on one layer (a qtk.steps.context.LayerContext) and returns its
    record (a qtk.steps.records.StepRecord) or None. implied(recipe): for a step the recipe need not list, the
    parameters to run it with when the recipe calls for it, else None. changes_frame: the step changes the frame the
    weights are quantized in, and its record's reframe rebuilds it (the loop then measures errors against the source
    put through the records). source_view(source, params): for a step that also changes tensors outside the decoder
    layers (a rotation of the residual stream: embeddings, lm_head), the source the conversion reads through."""

    name: str
    phase: Phase
    needs_data: bool
    run: Callable[[Any, Any], Any]
    params: type | None = None
    conflicts: Mapping[str, str] = field(default_factory=dict)
    title: str = ""
    implied: Callable[[Recipe], Any] | None = None
    changes_frame: bool = False
    source_view: Callable[[Any, Any], Any] | None = None


STEPS = Registry("step")  # name -> StepDef


def register_step(name: str, *, phase: Phase | None = None, needs_data: bool | None = None,
                  implied: Callable[[Recipe], Any] | None = None, title: str | None = None,
                  source_view: Callable[[Any, Any], Any] | None = None):
    """Decorator registering run(ctx, params) as the step `name`. A recipe step (declared in qtk.recipe.params) takes
    its phase, data need, parameters and conflicts from that declaration; an implied-only step gives phase and
    needs_data here. source_view: see StepDef."""

    def deco(run):
        decl = STEP_PARAMS.get(name)
        if decl is not None:
            if phase is not None and phase != decl.phase:
                raise ValueError(f"step {name!r}: phase {phase.name} here, {decl.phase.name} in qtk.recipe.params")
            d = StepDef(name, decl.phase, decl.needs_data, run, decl, decl.conflicts, decl.title, implied,
                        decl.changes_frame, source_view)
        else:
            if phase is None or needs_data is None or implied is None:
                raise ValueError(f"step {name!r} is not a recipe step (qtk.recipe.params): give its phase, needs_data "
                                 "and when the recipe implies it")
            d = StepDef(name, phase, needs_data, run, None, {}, title or name, implied, source_view=source_view)
        STEPS.add(name, d)
        return run

    return deco


def unregister_step(name: str) -> None:
    """Remove a step (for tests that register one of their own)."""
    STEPS.remove(name)


def plan_steps(recipe: Recipe) -> list[tuple[StepDef, Any]]:
    """The steps every layer runs for `recipe`, as (step, params), in phase order: the recipe's steps in the order it
    lists them (validated against the phases when it was parsed) and the steps it implies (observing static input
    ranges; round-to-nearest when no listed step solves the weights)."""
    missing = [s.name for s in recipe.algorithm if s.name not in STEPS]
    if missing:
        raise ValueError(f"no implementation registered for step(s) {', '.join(missing)} (registered: {', '.join(STEPS)})")
    steps = [(STEPS[s.name], s.params) for s in recipe.algorithm]
    listed = {d.name for d, _ in steps}
    for d in STEPS.values():
        if d.implied is not None and d.name not in listed:
            params = d.implied(recipe)
            if params is not None:
                steps.append((d, params))
    return sorted(steps, key=lambda sp: sp[0].phase)  # stable: the listed order within a phase


def source_view(source, recipe: Recipe):
    """The source a conversion with `recipe` reads through: each planned step's source_view applied in plan order
    (the source itself when no step has one). Applying it to its own result returns that result."""
    for step, params in plan_steps(recipe):
        if step.source_view is not None:
            source = step.source_view(source, params)
    return source


def needs_float_stream(recipe: Recipe) -> bool:
    """Whether a planned step reads the float model's own hidden states at each layer (its params' float_stream), so
    the loop carries them beside the quantized model's."""
    return any(getattr(params, "float_stream", False) for _, params in plan_steps(recipe))
