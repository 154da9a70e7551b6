"""QuantScheme: how one kind of tensor (weights, activations, the KV cache) is quantized.

The vocabulary shared by the quantizers, the simulator, the writers and the recipe; it mirrors
compressed-tensors' QuantizationArgs on purpose. Parsing and validating a scheme from a recipe is the recipe's
job (qtk.recipe); this module only describes one.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("tensor", "channel", "group", "token")
TYPES = ("int", "float")
OBSERVERS = ("minmax", "mse")
INT_BITS = (2, 4, 8)  # packable into int32 words without straddling; engines run 4 and 8
FP8_MAX = 448.0  # float8_e4m3fn


@dataclass(frozen=True)
class QuantScheme:
    """How one kind of tensor is quantized. Mirrors compressed-tensors' QuantizationArgs on purpose."""

    num_bits: int
    type: str = "int"
    symmetric: bool = True
    strategy: str = "channel"
    group_size: int | None = None
    dynamic: bool = False
    observer: str = "minmax"

    @property
    def is_fp8(self) -> bool:
        return self.type == "float"

    @property
    def qmin(self) -> int:
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.num_bits - 1) - 1

    @property
    def is_static_per_tensor(self) -> bool:
        return self.strategy == "tensor" and not self.dynamic

    def describe(self) -> str:
        t = f"fp{self.num_bits}" if self.is_fp8 else f"int{self.num_bits}"
        s = f"group{self.group_size}" if self.strategy == "group" else self.strategy
        parts = [t, s, "sym" if self.symmetric else "asym"]
        if self.dynamic:
            parts.append("dynamic")
        return " ".join(parts)
