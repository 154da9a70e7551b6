"""Resumable conversion: per-layer state saved beside the output, so `qtk convert --resume` continues an
interrupted run from the last completed layer with a bit-identical result.

What is saved after each layer: that layer's LayerResult (QTensors, dense tensors, statistics) and the
calibration activations that feed the next layer. On resume, the writers start afresh and the saved
results of completed layers are replayed into them; no writer needs to know about resuming.

Crash consistency: each layer is written into a hidden directory, with a manifest (the sha256 of every file)
written last, fsync'd, and renamed into place in one step, so a layer directory is either complete or absent,
whatever instant a run dies at. The next layer's inputs live in the newest layer's directory; older copies are
deleted only after the newer layer is in place. On resume, hashes are checked as the files are read back.

    OUT/.qtk-resume/meta.json          the run's key (everything that shapes the result), written once
    OUT/.qtk-resume/layer-00003/       tensors.safetensors, record.json, [hidden.safetensors], manifest.json
    OUT/.qtk-resume/.tmp-layer-00004/  a layer being written; removed by the next run
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from qtk.errors import UsageError
from qtk.io import faults
from qtk.io.atomic import fsync_dir, sha256_file, write_text

if TYPE_CHECKING:
    import torch

STATE_DIR = ".qtk-resume"
FORMAT = 2  # layout version: state written by another layout is stale
log = logging.getLogger(__name__)


def _layer_name(i: int) -> str:
    return f"layer-{i:05d}"


class ResumeState:
    """The state directory of one conversion, identified by a key over everything that shapes the result.

    completed: how many layers (from layer 0) are saved and can be replayed; stale: a different command's
    state was found here and removed."""

    def __init__(self, out: Path, key: str, num_layers: int):
        self.dir = Path(out) / STATE_DIR
        self.key = key
        self.num_layers = num_layers
        self.completed = 0
        self.stale = False
        meta = self._read_json(self.dir / "meta.json")
        if meta is not None and meta.get("key") == key and meta.get("format") == FORMAT:
            self.completed = self._scan()
            return
        if self.dir.exists():  # another run's leftovers (or a state dir that died before its meta.json)
            self.stale = meta is not None
            if self.stale:
                log.warning("stale resume state ignored (different command): removed %s and started over", self.dir)
            faults.fault_point("resume: remove stale state")
            shutil.rmtree(self.dir)
        faults.fault_point("resume: create state directory")
        tmp = self.dir.with_name(f"{STATE_DIR}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        faults.fault_point("resume: write meta.json")
        write_text(tmp / "meta.json", json.dumps({"format": FORMAT, "key": key, "layers": num_layers}))
        fsync_dir(tmp)
        faults.fault_point("resume: rename state directory into place")
        os.replace(tmp, self.dir)
        fsync_dir(self.dir.parent)

    @staticmethod
    def _read_json(p: Path) -> dict | None:
        try:
            m = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return m if isinstance(m, dict) else None

    def _scan(self) -> int:
        """The number of complete layer directories from layer 0, after removing what a crash can leave:
        half-written layers, layers past a gap, inputs of layers that are no longer the newest."""
        for p in self.dir.glob(".tmp-layer-*"):
            shutil.rmtree(p, ignore_errors=True)
        k = 0
        while k < self.num_layers and self._manifest(k) is not None:
            k += 1
        for p in self.dir.glob("layer-*"):
            if p.name >= _layer_name(k):  # at or past the first incomplete layer: not replayable
                shutil.rmtree(p, ignore_errors=True)
        for i in range(max(k - 1, 0)):
            (self.dir / _layer_name(i) / "hidden.safetensors").unlink(missing_ok=True)
        if 0 < k < self.num_layers:
            files = self._manifest(k - 1)["files"]
            if "hidden.safetensors" in files and not (self.dir / _layer_name(k - 1) / "hidden.safetensors").is_file():
                return 0  # the next layer's inputs are gone: nothing can continue from here
        return k

    def _manifest(self, i: int) -> dict | None:
        """Layer i's manifest when its directory is complete (every file it names present, at its size)."""
        d = self.dir / _layer_name(i)
        m = self._read_json(d / "manifest.json")
        if m is None or m.get("layer") != i or not isinstance(m.get("files"), dict):
            return None
        for name, (size, _) in m["files"].items():
            p = d / name
            if name != "hidden.safetensors" and not (p.is_file() and p.stat().st_size == size):
                return None
        return m

    def save_layer(self, result, next_hidden: list[torch.Tensor] | None) -> None:
        """Persist a finished layer: written in full under a temporary name, then renamed into place (the commit)."""
        from qtk.io.safetensors import save_file

        i = result.index
        tmp, final = self.dir / f".tmp-{_layer_name(i)}", self.dir / _layer_name(i)
        tensors, record = {}, {"qweights": {}, "input_amax": result.input_amax, "k_amax": result.k_amax,
                               "v_amax": result.v_amax, "weight_error": result.weight_error, "records": result.records_json(),
                               "dense_linears": list(result.dense_linears),
                               "dense": list(result.dense)}
        for m, qt in result.qweights.items():
            tensors[f"q/{m}/values"] = qt.values
            tensors[f"q/{m}/scale"] = qt.scale
            if qt.zero_point is not None:
                tensors[f"q/{m}/zero_point"] = qt.zero_point
            if qt.g_idx is not None:
                tensors[f"q/{m}/g_idx"] = qt.g_idx
            for k, v in qt.extra.items():  # what a format needs beyond scale and zero point (a global scale)
                tensors[f"x/{m}/{k}"] = v
            record["qweights"][m] = {"scheme": asdict(qt.scheme), "dtype": str(qt.dtype).replace("torch.", ""),
                                     "extra": sorted(qt.extra)}
        for n, t in result.dense.items():
            tensors[f"d/{n}"] = t
        try:
            faults.fault_point("resume: create layer directory")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            files = {}
            faults.fault_point("resume: write layer tensors")
            files["tensors.safetensors"] = save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "tensors.safetensors")
            faults.fault_point("resume: write layer record")
            files["record.json"] = write_text(tmp / "record.json", json.dumps(record))
            if next_hidden is not None and i + 1 < self.num_layers:  # the last layer's outputs feed nothing
                faults.fault_point("resume: write the next layer's inputs")
                files["hidden.safetensors"] = save_file({f"b{j}": h.contiguous() for j, h in enumerate(next_hidden)},
                                                        tmp / "hidden.safetensors")
            manifest = {"layer": i, "files": {n: [(tmp / n).stat().st_size, sha] for n, sha in files.items()}}
            faults.fault_point("resume: write layer manifest")
            write_text(tmp / "manifest.json", json.dumps(manifest))
            fsync_dir(tmp)
        except OSError:  # a full disk: free what the half-written layer holds; the saved layers stay
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        faults.fault_point("resume: rename layer directory into place")
        os.replace(tmp, final)
        fsync_dir(self.dir)
        if i > 0:
            faults.fault_point("resume: remove the previous layer's inputs")
            (self.dir / _layer_name(i - 1) / "hidden.safetensors").unlink(missing_ok=True)
        self.completed = i + 1

    def _verified(self, i: int, name: str) -> Path:
        """Path of a file of layer i after checking it against the layer's manifest."""
        p = self.dir / _layer_name(i) / name
        m = self._manifest(i)
        entry = m and m["files"].get(name)
        if not entry or not p.is_file() or sha256_file(p) != entry[1]:
            raise UsageError(f"the resume state in {self.dir} is damaged ({_layer_name(i)}/{name} does not match its manifest)",
                             f"delete {self.dir} and rerun (the conversion starts over)")
        return p

    def load_layer(self, i: int):
        import torch
        from safetensors.torch import load_file

        from qtk.pipeline import LayerResult
        from qtk.quant.qtensor import QTensor
        from qtk.quant.scheme import QuantScheme

        t = load_file(str(self._verified(i, "tensors.safetensors")))
        s = json.loads(self._verified(i, "record.json").read_text())
        qweights = {}
        for m, info in s["qweights"].items():
            qweights[m] = QTensor(t[f"q/{m}/values"], t[f"q/{m}/scale"], QuantScheme(**info["scheme"]),
                                  t.get(f"q/{m}/zero_point"), t.get(f"q/{m}/g_idx"), getattr(torch, info["dtype"]),
                                  {k: t[f"x/{m}/{k}"] for k in info.get("extra", ())})
        dense = {n: t[f"d/{n}"] for n in s["dense"]}
        return LayerResult(index=i, qweights=qweights, dense=dense, input_amax=s["input_amax"], k_amax=s["k_amax"],
                           v_amax=s["v_amax"], weight_error=s["weight_error"], records=s["records"],
                           dense_linears=tuple(s["dense_linears"]))

    def load_hidden(self) -> list[torch.Tensor]:
        """The inputs of layer `completed`, saved with the layer before it."""
        from safetensors.torch import load_file

        t = load_file(str(self._verified(self.completed - 1, "hidden.safetensors")))
        return [t[f"b{j}"] for j in range(len(t))]

    def discard(self) -> None:
        faults.fault_point("resume: remove state")
        shutil.rmtree(self.dir, ignore_errors=True)


def run_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def resume_state(source, recipe, out: Path, calib_info: dict, targets, options, batch_size: int, stage, messages: list[str],
                 world_size: int = 1):
    """The resume state of this exact command in OUT (a different command's is removed, and that is logged).
    world_size: the processes of the run; the state of a run with another number is another command's (the hidden
    states are saved per process share)."""
    from qtk import __version__

    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in source.files}
    parts = {"world_size": world_size} if world_size > 1 else {}  # one process: the key earlier releases wrote
    key = run_key(recipe=recipe.text, source=str(source.path.resolve()), files=files, calibration=calib_info,
                  targets=targets, options=options, batch_size=batch_size, version=__version__, **parts)
    state = ResumeState(out, key, source.num_layers)  # logs "stale resume state ignored" when it removes one
    if state.completed:
        stage(f"resuming after layer {state.completed}")
        messages.append(f"resumed at layer {state.completed} of {source.num_layers}")
    return state
