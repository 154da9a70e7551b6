"""Swapping a solved Linear for the QLinear the engine runs (dequantized weight, inputs quantized as the module's
activation scheme says, with its static scale), so the layer's outputs — the next layer's inputs — are what the
engine computes."""

from __future__ import annotations

import torch

from qtk.model.simulate import QLinear, engine_weight, replace_module
from qtk.quant.formats import static_scale
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme


def swap_in(layer, name: str, qt: QTensor, act: QuantScheme | None, amax: dict[str, float]) -> torch.Tensor:
    """Replace Linear `name` by its simulated quantized version (act: its activation scheme, amax: static input
    ranges); returns the engine-view weight."""
    lin = layer.get_submodule(name)
    w_hat = engine_weight(qt).to(lin.weight.dtype)  # int: exact (dequantized in the model dtype), as the engine
    in_scale = static_scale(amax[name], act) if (act is not None and act.has_static_scale) else None
    rotation = getattr(lin, "_qtk_input_rotation", None)  # an online rotation (qtk.steps.rotate_online) stays on
    replace_module(layer, name, QLinear(w_hat, None if lin.bias is None else lin.bias.detach(), act, in_scale,
                                        input_rotation=rotation))
    return w_hat


def swap_in_all(ctx, names) -> None:
    """swap_in each of `names` (relative) with its QTensor and its module's activation scheme."""
    for t in names:
        swap_in(ctx.layer, t, ctx.qweights[t], ctx.scheme(t).engine_activations, ctx.amax)
