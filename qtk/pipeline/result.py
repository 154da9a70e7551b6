"""What the layer loop hands on: a LayerResult per decoder layer for the sinks (writers, checks), a LayerDone per
layer for progress displays, and PipelineStats, the small per-layer records kept for the manifest."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qtk.quant.qtensor import QTensor
from qtk.steps.records import GPTQRecord, StepRecord, records_from_json, records_to_json


@dataclass
class LayerResult:
    """Everything a writer needs for one decoder layer. Writers read it and never modify it."""

    index: int
    qweights: dict[str, QTensor]  # full module name -> QTensor (its .scheme: that module's weight scheme)
    dense: dict[str, torch.Tensor]  # full tensor name -> tensor in the model dtype (norms, biases, ignored Linears)
    # full module name -> calibrated |x| max, for the modules whose scheme quantizes inputs with a static scale
    input_amax: dict[str, float] = field(default_factory=dict)
    k_amax: float | None = None  # K after RoPE, this layer
    v_amax: float | None = None
    weight_error: dict[str, float] = field(default_factory=dict)  # full module name -> ||W - Q(W)|| / ||W||
    # step name -> its typed record (smoothing scales, clips, GPTQ damping, expert token counts); records_json() is
    # the manifest's form, which also builds it back (a plain dict given here is read as that form)
    records: dict[str, StepRecord] = field(default_factory=dict)
    # full names of the layer's Linears left unquantized (ignored ones, MoE routers): computed once, here, for every
    # writer's list of excluded modules
    dense_linears: tuple[str, ...] = ()

    def __post_init__(self):
        if any(not isinstance(r, StepRecord) for r in self.records.values()):
            self.records = records_from_json(self.records)

    def records_json(self) -> dict:
        """The records as the manifest holds them under stats.algorithm.<layer> (and the resume state)."""
        return records_to_json(self.records)


@dataclass(frozen=True)
class LayerDone:
    """What on_layer receives after each decoder layer: its small statistics, for progress displays (no tensors)."""

    index: int
    weight_error: dict[str, float]  # full module name -> ||W - Q(W)|| / ||W||
    gptq_loss: dict[str, float]  # full module name -> GPTQ loss (mean output error), GPTQ recipes only
    replayed: bool = False  # restored from --resume state, not computed in this run

    @classmethod
    def of(cls, r: LayerResult, replayed: bool = False) -> "LayerDone":
        losses = {}
        gptq = r.records.get("gptq")
        for name, loss in (gptq.losses() if isinstance(gptq, GPTQRecord) else {}).items():  # layer-relative names
            # the full name is layer prefix + name: the shortest full name ending in it
            full = min((m for m in r.weight_error if m.endswith("." + name)), key=len, default=name)
            losses[full] = loss
        return cls(r.index, dict(r.weight_error), losses, replayed)


@dataclass
class PipelineStats:
    """Small per-layer records kept for the manifest (reports, plots), not the tensors."""

    timings: dict[str, float] = field(default_factory=dict)
    layers: int = 0
    weight_error: dict[str, float] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    kv_amax: dict[int, list[float]] = field(default_factory=dict)
    records: dict[int, dict] = field(default_factory=dict)  # layer -> records_json(): the manifest's stats.algorithm
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # MoE block -> calibration tokens per expert
    spilled_batches: int = 0  # calibration batches that waited in host memory (over the device budget), all layers
    measured: dict = field(default_factory=dict)  # module -> Measured (the data-free stream's, for its self-check)

    def record(self, r: LayerResult) -> None:
        self.layers += 1
        self.weight_error.update(r.weight_error)
        self.input_amax.update(r.input_amax)
        if r.k_amax is not None:
            self.kv_amax[r.index] = [r.k_amax, r.v_amax]
        records = r.records_json()
        if records:
            self.records[r.index] = records
            self.expert_tokens.update(records.get("expert_tokens", {}))


@dataclass(frozen=True)
class Measured:
    """What the data-free stream measured of one Linear while its source weight was in memory: the digest of the
    QTensor it handed the writers, that QTensor's error against the source, and the largest |weight| it decodes to.
    A Linear that decodes from disk to the same digest has exactly that error and that range (the self-check need
    not read the source or dequantize again); one that decodes to anything else is compared with the source in full
    (a target may store a QTensor otherwise and decode it to a different but equally good one: TensorRT-LLM's
    rescaled int8, GPTQ's fp16)."""

    digest: int
    error: float
    amax: float
