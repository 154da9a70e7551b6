"""Typed records of what a layer's steps chose: small, searched or solved values (smoothing scales, AWQ ratios and
clips, GPTQ damping and losses, MoE expert token counts), never tensors. Each serializes to the JSON the manifest
holds under stats.algorithm.<layer>.<name> (and the resume state), and reads back from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


class StepRecord:
    """Base of every record: `name` is its key in a layer's records, to_json / from_json its manifest form."""

    name: str = ""

    def to_json(self) -> Any:
        raise NotImplementedError

    @classmethod
    def from_json(cls, data: Any) -> "StepRecord":
        raise NotImplementedError


RECORDS: dict[str, type[StepRecord]] = {}


def register_record(cls: type[StepRecord]) -> type[StepRecord]:
    RECORDS[cls.name] = cls
    return cls


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


def folded_scales(records: Mapping[str, StepRecord]) -> dict[str, list[float]]:
    """The smoothing scales folded into a layer, {prev module: s} (SmoothQuant's s, or AWQ's chosen s)."""
    out: dict[str, list[float]] = {}
    for r in records.values():
        folded = getattr(r, "folded", None)
        if folded is not None:
            out.update(folded())
    return out
