"""Checkpoint: a written quantized checkpoint read back in Hugging Face names, format-independent.

Readers subclass it. Tensors are read lazily from safetensors, so inspecting a large checkpoint does
not load it whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme


def config_quantization(path: Path) -> dict | None:
    """config.json's quantization_config in a checkpoint directory; None when absent or unreadable."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return qc if isinstance(qc, dict) else None


class Checkpoint:
    format: str = ""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}

    # ---- to be provided by each reader ----
    hf_config: dict  # config.json of the original model (without quantization_config)
    weights_scheme: QuantScheme
    activations: QuantScheme | None = None
    kv_cache: str | None = None  # "fp8" | "int8" | None: what the engine stores in its KV cache

    def modules(self) -> list[str]:
        """Full HF names of the quantized Linear modules."""
        raise NotImplementedError

    def qtensor(self, module: str) -> QTensor:
        raise NotImplementedError

    def ignore_patterns(self) -> list[str]:
        """Module names or 're:' patterns the checkpoint declares unquantized."""
        return []

    def input_scale(self, module: str) -> torch.Tensor | None:
        return None

    def kv_scales(self, layer: int) -> tuple[float, float] | None:
        return None

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor that is not a quantized weight, in HF names (norms, embeddings, biases, lm_head)."""
        raise NotImplementedError

    # ---- shared ----
    @property
    def manifest(self) -> dict | None:
        p = self.path / "qtk.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def _index(self, prefix: str = "model") -> dict[str, Path]:
        if not self._files:
            idx = self.path / f"{prefix}.safetensors.index.json"
            if idx.is_file():
                wm = json.loads(idx.read_text())["weight_map"]
                self._files = {k: self.path / v for k, v in wm.items()}
            else:
                for p in sorted(self.path.glob(f"{prefix}*.safetensors")) or sorted(self.path.glob("*.safetensors")):
                    self._files.update({k: p for k in self._open(p).keys()})
        return self._files

    def _open(self, p: Path):
        from qtk.export.safetensors_io import SafetensorsFile

        h = self._handles.get(p)
        if h is None:
            h = self._handles[p] = SafetensorsFile(p)
        return h

    def tensor_names(self) -> list[str]:
        return list(self._index())

    def tensor(self, name: str) -> torch.Tensor:
        return self._open(self._index()[name]).get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self._index()

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self._index().values()))
