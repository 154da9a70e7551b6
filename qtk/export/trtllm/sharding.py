"""Tensor and pipeline parallelism of a TensorRT-LLM checkpoint: which --tp/--pp a model's sizes allow, and how each
module's logical tensors (qtk.export.codecs.trtllm.Part) are split over tensor-parallel ranks — column-parallel on the
output axis (q, k, v each, then concatenated; KV heads copied when there are fewer than ranks), row-parallel on the
input axis, everything else replicated; the vocabulary padded to a multiple of tp."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtk.errors import UsageError
from qtk.export.codecs.trtllm import Part
from qtk.model.arch import Geometry
from qtk.model.config_check import check_tensor_parallel, tp_divisors

QKV, COLUMN, ROW = "attention.qkv", "column", "row"


def check_geometry(geo: Geometry, tp: int, pp: int, group_sizes=()) -> None:
    """Refuse a --tp / --pp the model's sizes do not split into (and group sizes that do not divide a rank's share)."""
    check_tensor_parallel(tp, geo.heads, geo.kv_heads, geo.intermediate)  # the rule `qtk plan` applies too
    if geo.layers % pp:
        raise UsageError(f"--pp {pp} does not divide the decoder layers ({geo.layers})",
                         f"use --pp {' or '.join(map(str, tp_divisors(geo.layers)))}")
    for group_size in group_sizes:
        for what, n in (("hidden_size", geo.hidden), ("the attention width per rank", geo.heads * geo.head_dim // tp),
                        ("intermediate_size per rank", geo.intermediate // tp)):
            if n % group_size:
                raise UsageError(f"{what} ({n}) is not a multiple of group_size {group_size} at --tp {tp}",
                                 "use a smaller --tp or group_size 64")


@dataclass
class TRTModule:
    name: str  # TensorRT-LLM name relative to the layer, e.g. "attention.qkv"
    parallel: str  # column | row | replicated
    components: list[dict[str, Part]]  # q, k, v for the fused qkv; one otherwise
    kv_components: tuple[int, ...] = ()  # which components hold KV heads (copied when kv_heads < tp)


def _dup_heads(t: torch.Tensor, axis: int, heads: int, reps: int) -> torch.Tensor:
    """Copy each of `heads` heads `reps` times along `axis` (TensorRT-LLM's dup_kv_weight)."""
    return t.unflatten(axis, (heads, -1)).repeat_interleave(reps, dim=axis).flatten(axis, axis + 1)


def shard_module(mod: TRTModule, tp: int, rank: int, geo: Geometry) -> dict[str, torch.Tensor]:
    """The tensors of `mod` on tensor-parallel rank `rank`: column-parallel split on the output axis (q, k, v
    each, then concatenated), row-parallel on the input axis, everything else replicated."""
    out: dict[str, torch.Tensor] = {}
    reps = tp // geo.kv_heads if geo.kv_heads < tp else 1
    for key in mod.components[0]:
        parts = [c[key] for c in mod.components]
        cat_axis = parts[0].out_axis
        split_axis = {COLUMN: parts[0].out_axis, ROW: parts[0].in_axis}.get(mod.parallel)
        if len(parts) > 1 and cat_axis is None:  # shared by the fused components (per-tensor scales)
            if not all(torch.equal(p.tensor, parts[0].tensor) for p in parts):
                raise ValueError(f"{mod.name}.{key} differs between fused components")  # unified upstream
            parts = parts[:1]
        pieces = []
        for ci, p in enumerate(parts):
            t = p.tensor
            if split_axis is not None and tp > 1:
                if reps > 1 and ci in mod.kv_components:
                    t = _dup_heads(t, split_axis, geo.kv_heads, reps)
                t = t.tensor_split(tp, dim=split_axis)[rank]
            pieces.append(t)
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=cat_axis)
        out[key] = parts[0].pack(t) if parts[0].pack else t.contiguous()
    return out


def pad_vocab(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Zero rows up to a multiple of tp (TensorRT-LLM's pad_vocab_size); config vocab_size stays the real one."""
    pad = -t.shape[0] % tp
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t
