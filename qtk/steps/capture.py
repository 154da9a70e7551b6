"""Inputs of a layer's Linears, fed to statistics by forward pre-hooks: one forward per calibration batch that stops
as soon as the inputs of interest were seen, so statistics of early sub-blocks cost a fraction of a forward."""

from __future__ import annotations

import torch


class _Captured(Exception):
    """Stops a layer's forward once the input of interest has been seen."""


def capture_inputs(layer: torch.nn.Module, batches, module: str, fn, stop: bool = True) -> None:
    """Run every batch through the layer and call fn(x) with the input of `module`; the rest of the
    layer is skipped (stop=True)."""
    capture_many(layer, batches, {module: fn}, stop_after=module if stop else None)


def capture_many(layer: torch.nn.Module, batches, fns: dict, stop_after: str | None = None,
                 stop_when_all: bool = False) -> None:
    """One forward per batch calling fns[m](x) with the input of each module m (a hook that never fires, e.g.
    an MoE expert no token reached, is not called); the forward stops once `stop_after`'s input was seen, or
    with stop_when_all once every module's input was seen in this batch (so the last module, often down_proj,
    and whatever follows it are skipped, whatever the architecture's order)."""
    fired: set = set()

    def hook(mod, args, name):
        fns[name](args[0].detach())
        fired.add(name)
        if name == stop_after or (stop_when_all and len(fired) == len(fns)):
            raise _Captured

    hs_ = [layer.get_submodule(m).register_forward_pre_hook(lambda mod, args, m=m: hook(mod, args, m)) for m in fns]
    try:
        with torch.no_grad():
            for hs, kw in batches:
                fired.clear()
                try:
                    layer(hs, **kw)
                except _Captured:
                    pass
    finally:
        for h in hs_:
            h.remove()


def sequential_groups(arch, targets: list[str]) -> list[tuple[str, ...]]:
    """Targets grouped by shared input, in data-flow order: (q, k, v), (o,), (gate, up), (down,)."""
    out, seen = [], set()
    for lin in arch.linears:
        if lin in targets and lin not in seen:
            g = tuple(m for m in arch.fusion_group_of(lin) if m in targets)
            out.append(g)
            seen.update(g)
    return out
