"""Offline rotations as arithmetic on one layer's weights (the step is qtk.steps.rotate): which modules a rotation of
the residual stream (R1) and of each attention head's values (R2) touches, from the architecture's smoothing pairs,
and a weight or bias in the rotated frame. A norm's scale is folded into the Linears it feeds, whose inputs are then
rotated (W diag(g) R); the Linears writing into the residual stream have their outputs rotated (Rᵀ W, b R); R2 acts
on v_proj's rows and o_proj's columns one head at a time. Everything in float64."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtk.model.arch import TRAITS, Arch
from qtk.quant.hadamard import Rotation


@dataclass(frozen=True)
class RotationLayout:
    """Which modules of a layer a rotation touches, from the architecture's smoothing pairs: a norm's pair lists
    the Linears reading the residual stream through it; a Linear pair's next (o_proj after v_proj, down_proj after
    up_proj) writes into the residual stream; the attention pair is R2's (values, output)."""

    readers: dict  # norm -> the Linears (and dense readers) it feeds
    writers: tuple[str, ...]
    values: str
    output: str

    def norm_of(self, rel: str) -> str | None:
        return next((n for n, rs in self.readers.items() if rel in rs), None)


def layout_problem(arch: Arch, model_type: str | None) -> str | None:
    """Why rotations cannot be folded into this family's layers, None when they can."""
    traits = TRAITS.get(model_type or "")
    if arch.moe is not None:
        return "its MoE layers are not rotated yet (the router and every expert would have to follow)"
    if arch.norm_one_plus or (traits is not None and traits.sandwich_norms):
        return "its norms after the attention and MLP outputs sit on the residual stream, where no rotation commutes"
    pairs = [p for p in arch.smoothing if not p.prev_is_norm]
    if not any(p.prev_is_norm for p in arch.smoothing) or len(pairs) != 2:
        return "its fused q/k/v Linear holds the values R2 rotates"
    return None


def layout_of(arch: Arch) -> RotationLayout:
    readers = {p.prev: tuple(p.nexts) + tuple(p.dense) for p in arch.smoothing if p.prev_is_norm}
    pairs = [p for p in arch.smoothing if not p.prev_is_norm]
    attn = next(p for p in pairs if p.prev.startswith(arch.attn + "."))
    return RotationLayout(readers, tuple(n for p in pairs for n in p.nexts), attn.prev, attn.nexts[0])


# ---------------------------------------------------------------------------------------------- the arithmetic

def _rows(r: Rotation, W: torch.Tensor) -> torch.Tensor:
    """W R: each row (an input vector) rotated."""
    return r.apply(W)


def _outputs(r: Rotation, W: torch.Tensor) -> torch.Tensor:
    """Rᵀ W: the outputs of W rotated (y ↦ y R for y = x Wᵀ)."""
    return r.apply(W.T).T


def _head_rows(r: Rotation, W: torch.Tensor) -> torch.Tensor:
    """Each head's block of rows h: R₂ᵀ W_h (its outputs rotated)."""
    out, inp = W.shape
    return r.apply(W.reshape(out // r.size, r.size, inp).transpose(1, 2)).transpose(1, 2).reshape(out, inp)


def _head_columns(r: Rotation, W: torch.Tensor) -> torch.Tensor:
    """Each head's block of columns h: W[:, h] R₂ (its inputs rotated)."""
    out, inp = W.shape
    return r.apply(W.reshape(out, inp // r.size, r.size)).reshape(out, inp)


def rotated_weight(W: torch.Tensor, rel: str, arch: Arch, r1: Rotation, r2: Rotation | None,
                   norms: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [out, in] of Linear `rel` in the rotated frame, float32 (computed in float64): the norm it reads
    through folded in and its inputs rotated (readers), its outputs rotated (writers), R2 on the values and output.
    `norms`: each folded norm's scale (float64). Linears the rotation does not touch come back as they are."""
    lay = layout_of(arch)
    norm = lay.norm_of(rel)
    touched = norm is not None or rel in lay.writers or (r2 is not None and rel in (lay.values, lay.output))
    if not touched:
        return W.float()
    Y = W.to(torch.float64)
    if norm is not None:
        Y = _rows(r1, Y * norms[norm].to(Y.device))
    if rel in lay.writers:
        Y = _outputs(r1, Y)
    if r2 is not None and rel == lay.values:
        Y = _head_rows(r2, Y)
    if r2 is not None and rel == lay.output:
        Y = _head_columns(r2, Y)
    return Y.float()


def rotated_bias(b: torch.Tensor, rel: str, arch: Arch, r1: Rotation, r2: Rotation | None) -> torch.Tensor:
    """A Linear's bias in the rotated frame: a writer's outputs rotated by R1, the values' per head by R2."""
    lay = layout_of(arch)
    y = b.to(torch.float64)
    if rel in lay.writers:
        y = r1.apply(y)
    if r2 is not None and rel == lay.values:
        y = r2.apply(y.reshape(-1, r2.size)).reshape(-1)
    return y
