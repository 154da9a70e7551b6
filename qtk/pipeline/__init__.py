"""The layer loop (loop.py: run, process_layer), what it hands on (result.py: LayerResult, LayerDone,
PipelineStats), the capture of layer inputs (capture.py), the recipe checked against the model before any work
(targets.py), where and in what dtype it computes (device.py) and its memory helpers (memory.py)."""

from qtk.pipeline.capture import capture_layer_inputs
from qtk.pipeline.device import compute_dtype, resolve_device
from qtk.pipeline.loop import process_layer, run
from qtk.pipeline.result import LayerDone, LayerResult, PipelineStats
from qtk.pipeline.targets import GROUP_SIZES, check_group_size, check_ignore, check_source_format, target_linears
from qtk.recipe import matches  # noqa: F401 (re-exported, as before)

__all__ = ["capture_layer_inputs", "compute_dtype", "resolve_device", "process_layer", "run",
           "LayerDone", "LayerResult", "PipelineStats", "GROUP_SIZES", "check_group_size", "check_ignore", "check_source_format",
           "target_linears"]
