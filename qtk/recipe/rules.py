"""Which scheme each module gets: ignore patterns, per-module override rules, and the default.

Targets follow compressed-tensors' vocabulary: a module's full name, a dotted suffix of it ('mlp.down_proj'), or
're:' and a regular expression that must match the whole name. `Recipe.scheme_for` resolves a module: a module
that matches `ignore` stays unquantized; otherwise the first override whose targets match gives its scheme;
otherwise the recipe's default `weights` / `activations`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from qtk.quant.scheme import QuantScheme


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Does a module name match any target: exact name, a dotted suffix, or 're:' regex (full match)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
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

    def describe(self) -> str:
        return f"W: {self.weights.describe()}, A: {self.activations.describe() if self.activations else '16-bit'}"


@dataclass(frozen=True)
class Override:
    """One rule of a recipe's `overrides`: modules matching `targets` get `scheme` instead of the default."""

    targets: tuple[str, ...]
    scheme: ModuleScheme
