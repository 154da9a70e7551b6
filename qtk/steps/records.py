"""Typed records of what a layer's steps chose: small, searched or solved values (smoothing scales, AWQ ratios and
clips, GPTQ damping and losses, MoE expert token counts), never tensors. Each serializes to the JSON the manifest
holds under stats.algorithm.<layer>.<name> (and the resume state), and reads back from it.

A step that changes the frame the weights are quantized in (its parameters say changes_frame: a smoothing, a
rotation) records what it did, and its record puts a source weight into that frame (`reframe`): the loop measures
each weight's error against it and `qtk inspect` rebuilds it from the manifest, neither knowing the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from qtk.registry import Registry


class StepRecord:
    """Base of every record: `name` is its key in a layer's records, to_json / from_json its manifest form."""

    name: str = ""

    def to_json(self) -> Any:
        raise NotImplementedError

    @classmethod
    def from_json(cls, data: Any) -> "StepRecord":
        raise NotImplementedError

    def reframe(self, W, rel: str, arch):
        """The source weight W [out, in] of Linear `rel` (relative to its layer) in the frame this step left it in,
        float32: W itself for a step that does not change the frame."""
        return W

    def frame_known(self) -> bool:
        """Whether this record holds what reframe needs (a record written before it did cannot rebuild its frame)."""
        return True


RECORDS = Registry("step record")  # name -> its StepRecord class
register_record = RECORDS.decorator(lambda cls: cls.name)


@register_record
@dataclass
class SmoothQuantRecord(StepRecord):
    """SmoothQuant's scale s per smoothing pair, keyed by the module s was folded out of (a norm or a Linear); None
    where no calibration token reached the pair (an MoE expert): nothing was migrated."""

    name = "smoothquant"
    scales: dict[str, list[float] | None] = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.scales)

    @classmethod
    def from_json(cls, data: Mapping) -> "SmoothQuantRecord":
        return cls(dict(data))

    def folded(self) -> dict[str, list[float]]:
        return {k: v for k, v in self.scales.items() if v}

    def reframe(self, W, rel, arch):
        return _smoothed(W, rel, arch, self.folded())


@register_record
@dataclass
class AWQRecord(StepRecord):
    """AWQ's choices per smoothing pair and Linear: the grid ratio of each pair's scales (None: s = 1 won, or no token
    reached it), the scales themselves where one was folded in, and the mean clip value of each clipped Linear."""

    name = "awq"
    ratios: dict[str, float | None] = field(default_factory=dict)  # JSON "scales"
    clip: dict[str, float] = field(default_factory=dict)
    scales: dict[str, list[float]] = field(default_factory=dict)  # JSON "s", present only when some s was folded

    def to_json(self) -> dict:
        out: dict = {"scales": dict(self.ratios), "clip": dict(self.clip)}
        if self.scales:
            out["s"] = dict(self.scales)
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> "AWQRecord":
        return cls(dict(data.get("scales") or {}), dict(data.get("clip") or {}), dict(data.get("s") or {}))

    def folded(self) -> dict[str, list[float]]:
        return {k: v for k, v in self.scales.items() if v}

    def reframe(self, W, rel, arch):
        return _smoothed(W, rel, arch, self.folded())

    def frame_known(self) -> bool:
        """A manifest from before qtk recorded AWQ's scales holds only the chosen ratios: the scales folded into the
        weights cannot be rebuilt from the source."""
        return not (any(r is not None for r in self.ratios.values()) and not self.scales)


@register_record
@dataclass
class RotateRecord(StepRecord):
    """The rotations folded into a layer (qtk.steps.rotate): R1 on the residual stream and R2 per attention head
    (None when off), each as qtk.quant.hadamard.Rotation's JSON (size, seed, block) with its kind and construction,
    and the scale of every norm folded into the Linears it feeds (the source's, float32)."""

    name = "rotate"
    r1: dict = field(default_factory=dict)
    r2: dict | None = None
    norms: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        from qtk.quant.hadamard import Rotation

        def one(r):
            return None if r is None else {"kind": "hadamard", **r, "construction": Rotation.from_json(r).describe()}

        return {"r1": one(self.r1), "r2": one(self.r2), "norms": dict(self.norms)}

    @classmethod
    def from_json(cls, data: Mapping) -> "RotateRecord":
        def one(r):
            return None if r is None else {k: r.get(k) for k in ("size", "seed", "block")}

        return cls(one(data["r1"]), one(data.get("r2")), dict(data.get("norms") or {}))

    def reframe(self, W, rel, arch):
        import torch

        from qtk.quant.hadamard import Rotation
        from qtk.algorithms.rotate import rotated_weight

        norms = {n: torch.tensor(g, dtype=torch.float64) for n, g in self.norms.items()}
        return rotated_weight(W, rel, arch, Rotation.from_json(self.r1),
                              None if self.r2 is None else Rotation.from_json(self.r2), norms)


@register_record
@dataclass
class OnlineRotateRecord(StepRecord):
    """The online rotation of a layer (qtk.steps.rotate_online): the Linears whose inputs the engine rotates at run
    time (relative names) and the rotation (qtk.quant.hadamard.RepeatedRotation's JSON: width, block, seed; the
    width is the block when the modules' inputs differ), folded into their weights as W R: the block's matrix
    repeated over each module's input."""

    name = "rotate_online"
    modules: list[str] = field(default_factory=list)
    rotation: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        if not self.modules:
            return {}
        from qtk.quant.hadamard import RepeatedRotation

        r = RepeatedRotation.from_json(self.rotation)
        return {"modules": list(self.modules), "rotation": {"kind": "hadamard", **r.to_json(),
                                                            "construction": r.describe()}}

    @classmethod
    def from_json(cls, data: Mapping) -> "OnlineRotateRecord":
        r = data.get("rotation") or {}
        return cls(list(data.get("modules") or []), {k: r.get(k) for k in ("size", "block", "seed")})

    def reframe(self, W, rel, arch):
        if rel not in self.modules:
            return W
        from qtk.quant.hadamard import RepeatedRotation

        return RepeatedRotation.from_json(self.rotation).tiling(W.shape[1]).apply(W).float()


def _smoothed(W, rel: str, arch, scales: dict[str, list[float]]):
    """W in the frame of the smoothing scales folded into its layer ({prev: s}), as the fold applied them."""
    if not scales:
        return W
    from qtk.steps.smoothing import smoothed_weight

    return smoothed_weight(W, rel, arch, scales)


@dataclass
class GPTQSolve:
    """One Linear's GPTQ solve: the relative damping that made H positive definite, the retries it took, the inputs
    that were always zero, and the loss (mean output error, 1/n Σ‖(W − Q)x‖²)."""

    damp_percent: float
    retries: int
    dead_columns: int
    loss: float | None

    def to_json(self) -> dict:
        return {"damp_percent": self.damp_percent, "retries": self.retries, "dead_columns": self.dead_columns, "loss": self.loss}


@dataclass
class RTNFallback:
    """A Linear GPTQ could not solve (no calibration token reached it) and rounded to nearest instead."""

    reason: str

    def to_json(self) -> dict:
        return {"fallback": "rtn", "reason": self.reason}


@register_record
@dataclass
class GPTQRecord(StepRecord):
    """Per Linear (relative name), its GPTQ solve or its fallback to round-to-nearest."""

    name = "gptq"
    modules: dict[str, GPTQSolve | RTNFallback] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {m: r.to_json() for m, r in self.modules.items()}

    @classmethod
    def from_json(cls, data: Mapping) -> "GPTQRecord":
        out: dict = {}
        for m, r in data.items():
            if r.get("fallback") == "rtn":
                out[m] = RTNFallback(r["reason"])
            else:
                out[m] = GPTQSolve(r["damp_percent"], r["retries"], r["dead_columns"], r["loss"])
        return cls(out)

    def losses(self) -> dict[str, float]:
        """Relative module name -> GPTQ loss, for the Linears GPTQ solved."""
        return {m: float(r.loss) for m, r in self.modules.items() if isinstance(r, GPTQSolve) and r.loss is not None}


@register_record
@dataclass
class ExpertTokensRecord(StepRecord):
    """Calibration tokens each expert received (with the quantized layer upstream): MoE block (full name) -> counts."""

    name = "expert_tokens"
    counts: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.counts)

    @classmethod
    def from_json(cls, data: Mapping) -> "ExpertTokensRecord":
        return cls(dict(data))


def records_to_json(records: Mapping[str, StepRecord]) -> dict:
    """A layer's records as the manifest holds them; records with nothing in them are left out."""
    out = {}
    for k, r in records.items():
        j = r.to_json()
        if j:
            out[k] = j
    return out


def records_from_json(data: Mapping[str, Any] | None) -> dict[str, StepRecord]:
    """Typed records from their manifest form (as the resume state stores them)."""
    out = {}
    for k, v in (data or {}).items():
        if k not in RECORDS:
            raise ValueError(f"unknown step record {k!r} (known: {', '.join(RECORDS)})")
        out[k] = RECORDS[k].from_json(v)
    return out


def in_frame(W, rel: str, arch, records: Mapping[str, StepRecord]):
    """The source weight W of Linear `rel` (relative to its layer) in the frame the layer's steps quantized it in:
    each record's reframe, in the order the steps ran."""
    for r in records.values():
        W = r.reframe(W, rel, arch)
    return W
