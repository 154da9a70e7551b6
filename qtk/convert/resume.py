"""Resumable conversion: per-layer state saved beside the output, so `qtk convert --resume` continues an
interrupted run from the last completed layer with a bit-identical result.

What is saved after each layer: that layer's LayerResult (QTensors, dense tensors, statistics) and the
calibration activations that feed the next layer. On resume, the writers start afresh and the saved
results of completed layers are replayed into them; no writer needs to know about resuming.

Crash consistency: each layer is written into a hidden directory, with a manifest (the sha256 of every file)
written last, fsync'd, and renamed into place in one step, so a layer directory is either complete or absent,
whatever instant a run dies at. The next layer's inputs live in the newest layer's directory; older copies are
deleted only after the newer layer is in place. On resume, hashes are checked as the files are read back.

Damage is not a crash: a state whose layer folders do not hold what a crash can leave (a file missing or of another
size, a manifest or record.json that is not what qtk writes, a link anywhere in it, the next layer's inputs gone)
is discarded with one warning, and the run starts over. A tensor file whose bytes differ from its manifest is found
only while it is replayed, when the writers hold earlier layers: that run stops (exit 2) and says to delete the
state.

    OUT/.qtk-resume/meta.json          the run's key (everything that shapes the result), written once
    OUT/.qtk-resume/layer-00003/       tensors.safetensors, record.json, [hidden.safetensors], manifest.json
    OUT/.qtk-resume/.tmp-layer-00004/  a layer being written; removed by the next run
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from qtk.errors import UsageError
from qtk.io import faults, outdir
from qtk.io.atomic import fsync_dir, sha256_file, write_text

if TYPE_CHECKING:
    import torch

STATE_DIR = ".qtk-resume"
FORMAT = 2  # layout version: state written by another layout is stale
log = logging.getLogger(__name__)
LAYER, TMP_LAYER = re.compile(r"^layer-(\d{5})$"), re.compile(r"^\.tmp-layer-\d{5}$")
FILES = ("tensors.safetensors", "record.json", "hidden.safetensors")  # what a layer folder holds, besides its manifest
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _layer_name(i: int) -> str:
    return f"layer-{i:05d}"


class _Damaged(Exception):
    """Why a state folder of this command cannot be resumed from (one line, for the warning)."""


def _record(s) -> dict:
    """A layer's record.json (`s`, parsed) checked for everything load_layer takes from it: module -> (scheme,
    dtype, extra tensor names). Raises TypeError, KeyError, ValueError or AttributeError where it is not what
    save_layer writes."""
    import torch

    from qtk.quant.scheme import QuantScheme

    if not isinstance(s, dict) or not isinstance(s["qweights"], dict):
        raise TypeError("not a record")
    out = {}
    for m, info in s["qweights"].items():
        dtype = getattr(torch, info["dtype"])
        extra = info.get("extra", [])
        if not isinstance(dtype, torch.dtype) or not isinstance(extra, list) or not all(isinstance(k, str) for k in extra):
            raise TypeError(f"bad dtype or extra of {m}")
        out[m] = (QuantScheme(**info["scheme"]), dtype, extra)
    for k in ("dense", "dense_linears"):
        if not isinstance(s[k], list) or not all(isinstance(n, str) for n in s[k]):
            raise TypeError(f"bad {k}")
    missing = [k for k in ("input_amax", "k_amax", "v_amax", "weight_error", "records") if k not in s]
    if missing:
        raise KeyError(missing[0])
    return out


def check_state_dir(out: Path) -> None:
    """Refuse, before any work, an OUT/.qtk-resume that is not a folder (a link is refused by the output check):
    not a state qtk wrote, so it neither uses nor removes it."""
    p = Path(out) / STATE_DIR
    if os.path.lexists(p) and (p.is_symlink() or not p.is_dir()):
        raise outdir.refusal(p)


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
        self.damaged: str | None = None  # why a state of this command was discarded
        try:
            st = os.lstat(self.dir)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):  # a link or a file: not a state qtk wrote
            raise outdir.refusal(self.dir)
        meta = self._read_json(self.dir / "meta.json") if st is not None else None
        if meta is not None and meta.get("key") == key and meta.get("format") == FORMAT:
            try:
                self.completed = self._scan()
                return
            except _Damaged as e:
                self.damaged = str(e)
                log.warning("damaged resume state discarded (%s): removed %s and started over", e, self.dir)
        if st is not None:  # another run's leftovers, a damaged state, or a state dir that died before its meta.json
            self.stale = meta is not None and self.damaged is None
            if self.stale:
                log.warning("stale resume state ignored (different command): removed %s and started over", self.dir)
            faults.fault_point("resume: remove stale state")
            shutil.rmtree(self.dir)  # a real folder (checked above); links inside are removed, never followed
        faults.fault_point("resume: create state directory")
        tmp = outdir.fresh_dir(self.dir.parent, f"{STATE_DIR}.tmp-{os.getpid()}")
        faults.fault_point("resume: write meta.json")
        write_text(tmp / "meta.json", json.dumps({"format": FORMAT, "key": key, "layers": num_layers}))
        fsync_dir(tmp)
        faults.fault_point("resume: rename state directory into place")
        os.replace(tmp, self.dir)
        fsync_dir(self.dir.parent)

    @staticmethod
    def _read_json(p: Path) -> dict | None:
        """The JSON object in the regular file p (not through a link), else None."""
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                return None
            m = json.loads(p.read_text())
        except (OSError, ValueError, RecursionError):  # RecursionError: nested past the JSON parser's stack
            return None
        return m if isinstance(m, dict) else None

    def _scan(self) -> int:
        """The number of layers saved from layer 0, after removing what a crash can leave (half-written layers, the
        inputs of layers that are no longer the newest); raises _Damaged where the folder holds what no crash
        leaves."""
        layers = []
        for entry in sorted(os.scandir(self.dir), key=lambda e: e.name):
            is_dir = entry.is_dir(follow_symlinks=False)
            if entry.name == "meta.json" and entry.is_file(follow_symlinks=False):
                continue
            if TMP_LAYER.match(entry.name) and is_dir:
                shutil.rmtree(entry.path)
            elif LAYER.match(entry.name) and is_dir:
                layers.append(int(LAYER.match(entry.name).group(1)))
            else:
                raise _Damaged(f"{entry.name} is " + ("a link" if entry.is_symlink() else "not part of a resume state"))
        k = len(layers)
        if layers != list(range(k)) or k > self.num_layers:
            raise _Damaged(f"the saved layers are {_layer_name(layers[0])}..{_layer_name(layers[-1])}, not {k} from layer 0")
        files = [self._check_layer(i) for i in range(k)]
        newest = self.dir / _layer_name(k - 1) / "hidden.safetensors"
        if 0 < k < self.num_layers and "hidden.safetensors" in files[-1] and not newest.is_file():
            raise _Damaged(f"{_layer_name(k - 1)}/hidden.safetensors, the next layer's inputs, is missing")
        for i in range(max(k - 1, 0)):
            (self.dir / _layer_name(i) / "hidden.safetensors").unlink(missing_ok=True)
        return k

    def _check_layer(self, i: int) -> dict:
        """Layer i's files as its manifest lists them (name -> [size, sha256]), after checking that its folder holds
        them (the inputs of a layer that is not the newest may be gone), at their sizes, nothing else, no link, and a
        record.json that load_layer can read; else _Damaged."""
        name = _layer_name(i)
        d = self.dir / name
        m = self._read_json(d / "manifest.json")
        files = m.get("files") if m is not None else None
        if (m is None or m.get("layer") != i or not isinstance(files, dict) or not set(files) <= set(FILES)
                or not {"tensors.safetensors", "record.json"} <= set(files)
                or not all(isinstance(v, list) and len(v) == 2 and type(v[0]) is int and v[0] >= 0
                           and isinstance(v[1], str) and SHA256.match(v[1]) for v in files.values())):
            raise _Damaged(f"{name}/manifest.json is missing or not what qtk writes")
        for entry in os.scandir(d):
            if not entry.is_file(follow_symlinks=False):
                raise _Damaged(f"{name}/{entry.name} is " + ("a link" if entry.is_symlink() else "not a file"))
            if entry.name != "manifest.json" and entry.name not in files:
                raise _Damaged(f"{name}/{entry.name} is not in its manifest")
        for f, (size, _) in files.items():
            try:
                got = os.lstat(d / f).st_size
            except FileNotFoundError:
                if f == "hidden.safetensors":
                    continue
                raise _Damaged(f"{name}/{f} is missing") from None
            if got != size:
                raise _Damaged(f"{name}/{f} is {got} bytes, its manifest says {size}")
        if sha256_file(d / "record.json") != files["record.json"][1]:
            raise _Damaged(f"{name}/record.json does not match its manifest")
        try:
            _record(json.loads((d / "record.json").read_text()))
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise _Damaged(f"{name}/record.json is not what qtk writes ({type(e).__name__}: {e})") from None
        return files

    def _manifest(self, i: int) -> dict | None:
        """Layer i's manifest (checked by _scan for the layers it found)."""
        return self._read_json(self.dir / _layer_name(i) / "manifest.json")

    def save_layer(self, result, next_hidden: list[torch.Tensor] | None,
                   next_float: list[torch.Tensor] | None = None) -> None:
        """Persist a finished layer: written in full under a temporary name, then renamed into place (the commit).
        next_hidden: the next layer's inputs; next_float: the float model's (a run that carries its stream), saved
        beside them."""
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
                hidden = {f"b{j}": h.contiguous() for j, h in enumerate(next_hidden)}
                hidden.update({f"f{j}": h.contiguous() for j, h in enumerate(next_float or ())})
                files["hidden.safetensors"] = save_file(hidden, tmp / "hidden.safetensors")
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
        if not entry or not p.is_file() or p.is_symlink() or sha256_file(p) != entry[1]:
            raise self._damaged_error(i, name)
        return p

    def _damaged_error(self, i: int, name: str) -> UsageError:
        return UsageError(f"the resume state in {self.dir} is damaged ({_layer_name(i)}/{name} does not match its manifest)",
                          f"delete {self.dir} and rerun (the conversion starts over)")

    def load_layer(self, i: int):
        from safetensors.torch import load_file

        from qtk.pipeline import LayerResult
        from qtk.quant.qtensor import QTensor

        t = load_file(str(self._verified(i, "tensors.safetensors")))
        s = json.loads(self._verified(i, "record.json").read_text())
        try:
            qweights = {m: QTensor(t[f"q/{m}/values"], t[f"q/{m}/scale"], scheme, t.get(f"q/{m}/zero_point"),
                                   t.get(f"q/{m}/g_idx"), dtype, {k: t[f"x/{m}/{k}"] for k in extra})
                        for m, (scheme, dtype, extra) in _record(s).items()}
            dense = {n: t[f"d/{n}"] for n in s["dense"]}
        except (TypeError, KeyError, ValueError, AttributeError):
            raise self._damaged_error(i, "tensors.safetensors") from None
        return LayerResult(index=i, qweights=qweights, dense=dense, input_amax=s["input_amax"], k_amax=s["k_amax"],
                           v_amax=s["v_amax"], weight_error=s["weight_error"], records=s["records"],
                           dense_linears=tuple(s["dense_linears"]))

    def load_hidden(self, floats: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The inputs of layer `completed`, saved with the layer before it, and with `floats` the float model's
        (None without)."""
        from safetensors.torch import load_file

        name = "hidden.safetensors"
        t = load_file(str(self._verified(self.completed - 1, name)))
        quantized = [t[f"b{j}"] for j in range(sum(k.startswith("b") for k in t))]
        float_keys = [f"f{j}" for j in range(sum(k.startswith("f") for k in t))]
        if len(quantized) + len(float_keys) != len(t) or not all(k in t for k in float_keys):
            raise self._damaged_error(self.completed - 1, name)
        if not floats:
            return quantized, None
        if len(float_keys) != len(quantized):  # a state saved without the float stream cannot go on with it
            raise self._damaged_error(self.completed - 1, name)
        return quantized, [t[k] for k in float_keys]

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
