"""QuantScheme: how one kind of tensor (weights, activations, the KV cache) is quantized.

The vocabulary shared by the quantizers, the simulator, the writers and the recipe; it mirrors
compressed-tensors' QuantizationArgs on purpose. Parsing and validating a scheme from a recipe is the recipe's
job (qtk.recipe); this module only describes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Strategy(str, Enum):
    """Which values share one scale, as compressed-tensors' QuantizationStrategy names them. A str, so a scheme reads
    and writes (JSON, YAML through str()) the same words as before."""

    TENSOR = "tensor"
    CHANNEL = "channel"  # one per output channel (row) of a weight
    GROUP = "group"  # one per group_size input columns of a row (per token per group for activations)
    TOKEN = "token"  # activations: one per token, at run time
    TENSOR_GROUP = "tensor_group"  # NVFP4's groups of 16 under one per-tensor global scale
    BLOCK = "block"  # 2-D weight blocks (FP8 block)

    def __str__(self) -> str:
        return self.value


STRATEGIES = tuple(s.value for s in Strategy)
TYPES = ("int", "float")
# full_range: symmetric int weights per channel or group on llama.cpp's / auto-round's grid (IntFormat.full_range_scale)
OBSERVERS = ("minmax", "mse", "full_range")
INT_BITS = (2, 4, 8)  # packable into int32 words without straddling; engines run 4 and 8
FP8_MAX = 448.0  # float8_e4m3fn
FLOAT_BITS = (4, 8)  # fp4 e2m1 (NVFP4, MXFP4), fp8 e4m3
SCALE_DTYPES = ("e8m0",)  # MX block scales: power-of-two exponents (compressed-tensors scale_dtype torch.uint8)
LOCAL = "local"  # dynamic: "local": group scales at run time under a static global scale (NVFP4 activations)


@dataclass(frozen=True)
class QuantScheme:
    """How one kind of tensor is quantized. Mirrors compressed-tensors' QuantizationArgs on purpose."""

    num_bits: int
    type: str = "int"
    symmetric: bool = True
    strategy: Strategy = Strategy.CHANNEL  # a known word becomes its Strategy; the recipe parser refuses the others
    group_size: int | None = None
    dynamic: bool | str = False  # True, False or LOCAL
    observer: str = "minmax"
    block_structure: tuple[int, int] | None = None  # strategy block: [rows, cols] of a weight block
    scale_dtype: str | None = None  # None: the format's own (model dtype, float32, fp8 for NVFP4); "e8m0" for MX

    def __post_init__(self):
        if self.strategy in STRATEGIES and not isinstance(self.strategy, Strategy):
            object.__setattr__(self, "strategy", Strategy(self.strategy))

    @property
    def is_fp8(self) -> bool:
        return self.type == "float" and self.num_bits == 8

    @property
    def is_fp4(self) -> bool:
        return self.type == "float" and self.num_bits == 4

    @property
    def is_nvfp4(self) -> bool:
        return self.is_fp4 and self.strategy == Strategy.TENSOR_GROUP

    @property
    def is_mx(self) -> bool:
        return self.type == "float" and self.scale_dtype == "e8m0"

    @property
    def has_static_scale(self) -> bool:
        """Whether quantizing this tensor at run time needs a calibrated scale: static schemes, and NVFP4's
        dynamic "local" group scales under a static global scale."""
        return self.dynamic is False or self.dynamic == LOCAL

    @property
    def has_full_range_grid(self) -> bool:
        """Whether the full-range grid (observer full_range, gptq / autoround full_range) exists for these values:
        symmetric int per output channel or group."""
        return self.type == "int" and self.symmetric and self.strategy in (Strategy.CHANNEL, Strategy.GROUP)

    @property
    def column_group(self) -> int | None:
        """How many consecutive input columns share one scale (None: all of them, per tensor or channel)."""
        if self.strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            return self.group_size
        if self.strategy == Strategy.BLOCK:
            return self.block_structure[1]
        return None

    @property
    def qmin(self) -> int:
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.num_bits - 1) - 1

    def describe(self) -> str:
        if self.is_nvfp4:
            return "nvfp4 group16" + (" dynamic-local" if self.dynamic == LOCAL else "")
        if self.is_mx:
            return f"mxfp{self.num_bits} group{self.group_size}" + (" dynamic" if self.dynamic else "")
        t = f"fp{self.num_bits}" if self.type == "float" else f"int{self.num_bits}"
        if self.strategy == Strategy.GROUP:
            s = f"group{self.group_size}"
        elif self.strategy == Strategy.BLOCK:
            s = "block{}x{}".format(*self.block_structure)
        else:
            s = self.strategy
        parts = [t, s, "sym" if self.symmetric else "asym"]
        if self.dynamic:
            parts.append("dynamic")
        return " ".join(parts)
