"""LayerContext: one materialised decoder layer while its steps run — what they read (inputs, schemes, device,
reducer) and what each phase leaves for the next (fp32 master weights, input ranges, QTensors, records)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from qtk.model.arch import Arch
from qtk.quant.qtensor import QTensor
from qtk.recipe import ModuleScheme, Recipe
from qtk.steps.records import StepRecord
from qtk.steps.stats import LOCAL, Reducer


@dataclass
class LayerContext:
    """What a step works on; steps mutate the layer, master, amax, qweights and records, the loop the rest."""

    index: int
    prefix: str  # full-name prefix of the layer's modules, e.g. "model.layers.3."
    layer: torch.nn.Module  # materialised in the compute dtype; steps fold into it and swap QLinears in
    arch: Arch
    recipe: Recipe
    targets: list[str]  # the Linears (relative names) the recipe quantizes, in data-flow order
    batches: list | None  # [(hidden states, kwargs)] entering the layer; None without calibration data
    dtype: torch.dtype  # the model dtype: int scales and stored tensors
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    reducer: Reducer = LOCAL
    # fp32 copies of the weights to quantize while transforms fold scales into them (the layer keeps rounded ones);
    # empty when no transform runs: the layer's weights are then the ones quantized
    master: dict[str, torch.Tensor] = field(default_factory=dict)
    amax: dict[str, float] = field(default_factory=dict)  # relative name -> static input |x| max (OBSERVE)
    qweights: dict[str, QTensor] = field(default_factory=dict)  # relative name -> QTensor (SOLVE)
    records: dict[str, StepRecord] = field(default_factory=dict)  # step name -> what it chose
    # the float model's own hidden states leaving this layer on every calibration batch (kept where each batch is),
    # when a step asks for the float stream (its params' float_stream): the layer's float weights, after the
    # transforms, run on the float model's inputs to it; the loop hands them to the next layer as its float inputs
    float_outputs: list[torch.Tensor] | None = None
    _schemes: dict[str, ModuleScheme | None] = field(default_factory=dict, repr=False)

    def scheme(self, t: str) -> ModuleScheme:
        """The scheme of target `t` (relative name), from recipe.scheme_for on its full name."""
        if t not in self._schemes:
            self._schemes[t] = self.recipe.scheme_for(self.prefix + t)
        s = self._schemes[t]
        assert s is not None, f"{self.prefix + t} is not quantized"  # targets exclude ignored modules
        return s

    def group_scheme(self, group: tuple[str, ...]) -> ModuleScheme:
        """The scheme of Linears that share an input and are solved together (a fusion group resolves to one scheme:
        qtk.pipeline.target_linears refuses recipes that split one)."""
        s = self.scheme(group[0])
        assert all(self.scheme(t) == s for t in group), f"{group} in {self.prefix} have different schemes"
        return s

    def weight(self, t: str) -> torch.Tensor:
        """The weight to quantize: the fp32 master when transforms run, else the layer's own."""
        return self.master[t] if t in self.master else self.layer.get_submodule(t).weight.detach()

    def float_layer_outputs(self, batches) -> list[torch.Tensor]:
        """The layer with its float weights (the transformed ones when transforms ran, in the layer's dtype, as the
        solvers' float reference) on `batches`, each output kept where its batch is (Activations.keep): on the float
        model's inputs, the float model's hidden states after the layer (the loop's float stream); on the quantized
        model's, this layer's own float outputs there."""
        float_w = {t + ".weight": self.weight(t).to(self.layer.get_submodule(t).weight.dtype) for t in self.targets}
        keep = getattr(batches, "keep", lambda j, y: y)
        out = []
        with torch.no_grad():
            for j, (h, kw) in enumerate(batches):
                y = functional_call(self.layer, float_w, (h,), kw)
                out.append(keep(j, y[0] if isinstance(y, tuple) else y))
        return out

