"""Capture of the inputs of layer 0: one forward of the embeddings per calibration batch with every decoder layer
replaced by a catcher, which also records the keyword arguments (masks, rotary tables) each layer receives."""

from __future__ import annotations

import torch

from qtk.model.simulate import replace_module
from qtk.pipeline.device import compute_dtype


class _StopForward(Exception):
    """Raised by the layer-0 catcher: the rest of the model need not (and cannot, on meta) run."""


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer `index`: records the kwargs the model passes it (masks and rotary
    embeddings differ per layer type, e.g. sliding-window layers), and the hidden states at layer 0."""

    def __init__(self, store: list, index: int, last: bool, attention_type=None):
        super().__init__()
        self.store, self.index, self.last = store, index, last
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, hidden_states, *args, **kwargs):
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        kwargs["use_cache"] = False
        self.store.append((self.index, hidden_states, kwargs))
        if self.last:
            raise _StopForward
        return hidden_states


def capture_layer_inputs(source, skeleton, ids: torch.Tensor, batch_size: int, device=None, images=None):
    """Run embeddings (+ rotary, masks) once per batch with every layer replaced by a catcher; the embeddings and the
    token ids on `device` (default: the CPU). images: a qtk.calib_images.ImageInputs for image+text windows: the
    vision tower and projector are loaded for the capture and the model's own forward merges their features.

    Returns (batches, layer_kwargs): batches = [(hidden states into layer 0, its kwargs)] and
    layer_kwargs[i][b] = the kwargs layer i gets for batch b (shared tensors, so this costs no memory)."""
    arch = source.arch
    dtype = compute_dtype(source)
    loaded = (arch.embed,) + (tuple(images.modules) if images is not None else ())
    metas = {name: skeleton.get_submodule(name) for name in loaded}
    for name, meta in metas.items():
        replace_module(skeleton, name, source.load_module(meta, name + ".", dtype, device=device))
    if device is not None:
        ids = ids.to(device)
    layers = skeleton.get_submodule(arch.layers)
    originals = list(layers)
    store: list = []
    n = len(originals)
    for i, layer in enumerate(originals):
        layers[i] = _Catcher(store, i, i == n - 1, getattr(layer, "attention_type", None))
    try:
        with torch.no_grad():
            for start, batch in zip(range(0, ids.shape[0], batch_size), ids.split(batch_size)):
                extra = images.batch(batch, start, dtype) if images is not None else {}
                try:
                    skeleton(input_ids=batch, use_cache=False, **extra)
                except _StopForward:
                    pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        for name, meta in metas.items():
            replace_module(skeleton, name, meta)
    batches = [(h, kw) for i, h, kw in store if i == 0]
    layer_kwargs = [[kw for j, _, kw in store if j == i] for i in range(n)]
    return batches, layer_kwargs
