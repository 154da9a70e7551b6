"""Layer-level steps with phases (registry.py): TRANSFORM (smoothquant.py, awq.py, rotate.py: Hadamard rotations, rotate_online.py: R4 applied by the engine), OBSERVE (observe.py: static
input ranges), SOLVE (rtn.py, gptq.py, autoround.py: SignRound), each a function on one materialised layer (context.py: LayerContext);
statistics as accumulators with a reduce seam (stats.py); module-input capture (capture.py); the smoothing folds they
share (smoothing.py); swapping solved Linears for what the engine runs (swap.py); typed records (records.py).

Importing this package registers the built-in steps."""

from qtk.steps import autoround, awq, gptq, observe, rotate, rotate_online, rtn, smoothquant  # noqa: F401 (register the built-in steps)
from qtk.steps.context import LayerContext
from qtk.steps.records import StepRecord, in_frame, records_from_json, records_to_json
from qtk.steps.registry import (NO_PARAMS, STEPS, Phase, StepDef, needs_float_stream, plan_steps, register_step, source_view,
                                unregister_step)
from qtk.steps.stats import LOCAL, Reducer

__all__ = ["LayerContext", "StepRecord", "in_frame", "records_from_json", "records_to_json", "NO_PARAMS", "STEPS",
           "Phase", "StepDef", "needs_float_stream", "plan_steps", "register_step", "source_view", "unregister_step", "LOCAL",
           "Reducer"]
