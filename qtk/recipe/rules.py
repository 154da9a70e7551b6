"""Which scheme each module gets: ignore patterns, per-module override rules, and the default.

Targets follow compressed-tensors' vocabulary: a module's full name, a dotted suffix of it ('mlp.down_proj'), or
're:' and a regular expression that must match the whole name. `Recipe.scheme_for` resolves a module: a module
that matches `ignore` stays unquantized; otherwise the first override whose targets match gives its scheme;
otherwise the recipe's default `weights` / `activations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from qtk.bounds import fullmatch
from qtk.quant.scheme import QuantScheme


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Does a module name match any target: exact name, a dotted suffix, or 're:' regex (full match, under
    qtk.bounds' time budget: a pattern from a checkpoint's config reaches here unchecked)."""
    for p in patterns:
        if p.startswith("re:"):
            if fullmatch(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


@dataclass(frozen=True)
class ModuleScheme:
    """What one Linear is quantized to: its weights and (for W8A8-style schemes) its input activations."""

    weights: QuantScheme
    activations: QuantScheme | None = None

    @property
    def static_activations(self) -> bool:
        return self.activations is not None and self.activations.has_static_scale

    @property
    def engine_activations(self) -> QuantScheme | None:
        """The activation quantization the engine runs for this module, which the simulation reproduces. The
        config's own scheme, except W4A8-INT8: vLLM's CompressedTensorsW4A8Int runs on torch's dynamic 4-bit matmul
        (Dynamic4bitLinearKernel -> aten._dyn_quant_matmul_4bit, KleidiAI's qai8dx on Arm), which quantizes each token
        to int8 asymmetrically (min/max with a zero point) whatever `symmetric` the config states (llm-compressor's
        W4A8 writes true); tests/export/test_w4a8_int8.py holds the simulation to that kernel."""
        w, a = self.weights, self.activations
        if (a is not None and w.type == "int" and w.num_bits == 4 and a.type == "int" and a.num_bits == 8
                and a.strategy == "token" and a.dynamic is True and a.symmetric):
            from dataclasses import replace

            return replace(a, symmetric=False)
        return a

    def describe(self) -> str:
        return f"W: {self.weights.describe()}, A: {self.activations.describe() if self.activations else '16-bit'}"


@dataclass(frozen=True)
class Override:
    """One rule of a recipe's `overrides`: modules matching `targets` get `scheme` instead of the default."""

    targets: tuple[str, ...]
    scheme: ModuleScheme
