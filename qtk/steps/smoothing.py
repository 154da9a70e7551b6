"""What SmoothQuant and AWQ share: the architecture's smoothing pairs a layer can smooth, folding a scale s into the
layer (and into the fp32 master weights being quantized), and the frame a smoothed weight was quantized in."""

from __future__ import annotations

import torch

from qtk.algorithms.smooth import fold_into_linear_rows, fold_into_norm, scale_linear_columns


def smoothing_pairs(layer, arch, targets: list[str]):
    """The architecture's smoothing pairs whose next Linears are all quantized and whose shapes chain
    (v_proj -> o_proj only without GQA)."""
    pairs = []
    for p in arch.smoothing:
        if not all(n in targets for n in p.nexts):
            continue
        if not p.prev_is_norm:
            width = layer.get_submodule(p.prev).weight.shape[0]
            if any(layer.get_submodule(n).weight.shape[1] != width for n in p.nexts):
                continue
        pairs.append(p)
    return pairs


def fold(layer, arch, pair, s: torch.Tensor, master: dict[str, torch.Tensor]) -> None:
    """Fold s into the layer; weights in `master` (fp32 copies of the quantized Linears) are folded there and
    copied, rounded, into the layer, so repeated folds do not accumulate the model dtype's rounding."""
    def weight(name):
        return master[name] if name in master else layer.get_submodule(name).weight.detach().float()

    def store(name, w):
        if name in master:
            master[name] = w
        layer.get_submodule(name).weight.copy_(w)

    prev = layer.get_submodule(pair.prev)
    with torch.no_grad():
        if pair.prev_is_norm:
            prev.weight.copy_(fold_into_norm(prev.weight.float(), s, arch.norm_one_plus))
        else:
            w, b = fold_into_linear_rows(weight(pair.prev), None if prev.bias is None else prev.bias.float(), s)
            store(pair.prev, w)
            if b is not None:
                prev.bias.copy_(b)
        for n in pair.nexts + pair.dense:  # dense readers (an MoE router) too: their output stays the same
            store(n, scale_linear_columns(weight(n), s))


def smoothed_weight(W: torch.Tensor, rel: str, arch, scales: dict[str, list[float]]) -> torch.Tensor:
    """The source weight of Linear `rel` (relative to its layer) in the frame it was quantized in: the folded
    smoothing scales ({prev: s}, qtk.steps.records.folded_scales) applied as `fold` applies them (same functions,
    same order), float32. AWQ's clipping is not undone: an error against this reference counts clipping as part of
    the quantization error."""
    W = W.float()
    for pair in arch.smoothing:
        s = scales.get(pair.prev)
        if not s:
            continue
        if not pair.prev_is_norm and rel == pair.prev:
            W = fold_into_linear_rows(W, None, torch.tensor(s, dtype=torch.float32, device=W.device))[0]
        if rel in pair.nexts:
            W = scale_linear_columns(W, torch.tensor(s, dtype=torch.float32, device=W.device))
    return W
