"""Post-conversion checks, run on the stream of LayerResults at the end of every convert (no re-read):
every targeted Linear quantized, no collapsed (constant) quantized tensor, finite positive scales,
calibrated KV scales, no NaN/Inf, and each weight's quantization error within what its scheme allows."""

from __future__ import annotations

import math

import torch

from qtk.recipe import Recipe

# relative Frobenius error ||W - Q(W)|| / ||W|| that a sane quantizer stays far below (RTN on Gaussian
# weights gives ~0.01 at int8, ~0.17 at int4, ~0.04 at fp8); a broken one (wrong scale, collapsed
# packing, swapped layout) lands at or above 1.
MAX_REL_ERROR = {("int", 8): 0.1, ("int", 4): 0.7, ("int", 2): 1.5, ("float", 8): 0.2}


class PostChecks:
    """A sink beside the writers: sees exactly what they see, keeps only failures."""

    def __init__(self, source, recipe: Recipe):
        self.source = source
        self.recipe = recipe
        self.failures: list[str] = []
        self.kv: list[float] = []
        self.expected: list[str] = []
        self.quantized: set[str] = set()

    def add_dense(self, name: str, t: torch.Tensor) -> None:
        if t.is_floating_point() and not torch.isfinite(t).all():
            self.failures.append(f"{name} has NaN/Inf")

    def add_layer(self, r) -> None:
        from qtk.pipeline import target_linears

        prefix = self.source.layer_prefix(r.index)
        self.expected += [prefix + t for t in target_linears(self.source, self.recipe, r.index)]
        self.quantized.update(r.qweights)
        bound = MAX_REL_ERROR.get((self.recipe.weights.type, self.recipe.weights.num_bits), math.inf)
        for m, qt in r.qweights.items():
            if not (torch.isfinite(qt.scale).all() and (qt.scale > 0).all()):
                self.failures.append(f"{m}: non-finite or non-positive scale")
            v = qt.values.reshape(-1)
            if v.numel() > 1 and bool((v == v[0]).all()):
                self.failures.append(f"{m}: every quantized value is {v[0].item()} (collapsed)")
            err = r.weight_error.get(m)
            if err is not None and not err <= bound:
                self.failures.append(f"{m}: quantization error {err:.3f} exceeds {bound} for {self.recipe.weights.describe()}")
        for n, t in r.dense.items():
            self.add_dense(n, t)
        if self.recipe.kv_cache is not None:
            if r.k_amax is None:
                self.failures.append(f"layer {r.index}: no KV statistics")
            else:
                self.kv += [r.k_amax, r.v_amax]

    def finish(self) -> list[str]:
        missing = [m for m in self.expected if m not in self.quantized]
        if missing:
            self.failures.append(f"not quantized: {', '.join(missing[:5])}")
        if self.kv and not all(math.isfinite(a) and a > 0 for a in self.kv):
            self.failures.append("a K/V maximum is zero or non-finite: KV scales would be invalid")
        return self.failures
