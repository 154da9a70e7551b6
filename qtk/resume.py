"""Resumable conversion: per-layer state saved beside the output, so `qtk convert --resume` continues an
interrupted run from the last completed layer with a bit-identical result.

What is saved after each layer: that layer's LayerResult (QTensors, dense tensors, statistics) and the
calibration activations that feed the next layer. On resume, the writers start afresh and the saved
results of completed layers are replayed into them; no writer needs to know about resuming.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme

STATE_DIR = ".qtk-resume"


def _atomic_write_text(p: Path, text: str) -> None:
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, p)


def _save_tensors(p: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = p.with_name(p.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, p)


def _load_tensors(p: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(p))


class ResumeState:
    """The state directory of one conversion, identified by a key over everything that shapes the result."""

    def __init__(self, out: Path, key: str):
        self.dir = Path(out) / STATE_DIR
        self.key = key
        self.completed = 0
        meta = self.dir / "meta.json"
        if meta.is_file():
            try:
                m = json.loads(meta.read_text())
            except json.JSONDecodeError:
                m = {}
            if m.get("key") == key:
                self.completed = int(m.get("completed", 0))
            else:  # a different run's leftovers: start over
                shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not meta.is_file():
            self._write_meta()

    def _write_meta(self) -> None:
        _atomic_write_text(self.dir / "meta.json", json.dumps({"key": self.key, "completed": self.completed}))

    def save_layer(self, result, next_hidden: list[torch.Tensor] | None) -> None:
        """Persist a finished layer, then advance the completed count (the commit point)."""
        i = result.index
        tensors, scalars = {}, {"qweights": {}, "input_amax": result.input_amax, "k_amax": result.k_amax,
                                 "v_amax": result.v_amax, "weight_error": result.weight_error, "records": result.records,
                                 "dense": list(result.dense)}
        for m, qt in result.qweights.items():
            tensors[f"q/{m}/values"] = qt.values
            tensors[f"q/{m}/scale"] = qt.scale
            if qt.zero_point is not None:
                tensors[f"q/{m}/zero_point"] = qt.zero_point
            if qt.g_idx is not None:
                tensors[f"q/{m}/g_idx"] = qt.g_idx
            scalars["qweights"][m] = {"scheme": asdict(qt.scheme), "dtype": str(qt.dtype).replace("torch.", "")}
        for n, t in result.dense.items():
            tensors[f"d/{n}"] = t
        _save_tensors(self.dir / f"layer_{i:05d}.safetensors", tensors)
        _atomic_write_text(self.dir / f"layer_{i:05d}.json", json.dumps(scalars))
        if next_hidden is not None:
            _save_tensors(self.dir / "hidden.safetensors", {f"b{j}": h for j, h in enumerate(next_hidden)})
        self.completed = i + 1
        self._write_meta()

    def load_layer(self, i: int):
        from qtk.pipeline import LayerResult

        t = _load_tensors(self.dir / f"layer_{i:05d}.safetensors")
        s = json.loads((self.dir / f"layer_{i:05d}.json").read_text())
        qweights = {}
        for m, info in s["qweights"].items():
            qweights[m] = QTensor(t[f"q/{m}/values"], t[f"q/{m}/scale"], QuantScheme(**info["scheme"]),
                                  t.get(f"q/{m}/zero_point"), t.get(f"q/{m}/g_idx"), getattr(torch, info["dtype"]))
        dense = {n: t[f"d/{n}"] for n in s["dense"]}
        return LayerResult(index=i, qweights=qweights, dense=dense, input_amax=s["input_amax"], k_amax=s["k_amax"],
                           v_amax=s["v_amax"], weight_error=s["weight_error"], records=s["records"])

    def load_hidden(self) -> list[torch.Tensor]:
        t = _load_tensors(self.dir / "hidden.safetensors")
        return [t[f"b{j}"] for j in range(len(t))]

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def run_key(**parts) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
