"""Checkpoint: a written quantized checkpoint read back in Hugging Face names, format-independent.

Readers subclass it. Tensors are read lazily from safetensors, so inspecting a large checkpoint does
not load it whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qtk.errors import CheckFailed
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme


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
    dtype: torch.dtype = torch.bfloat16

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

    def kv_tensor_names(self, layer: int) -> str:
        """The tensors holding layer `layer`'s K/V scales, for messages."""
        return f"layer {layer}'s K/V scales"

    def dense_names(self) -> list[str]:
        """Every tensor that is not part of a quantized weight, in HF names (norms, embeddings, biases, lm_head)."""
        raise NotImplementedError

    def dense_tensor(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def iter_dense(self):
        """(name, tensor) of every dense tensor, one at a time: checking a checkpoint holds one tensor, not all."""
        for n in self.dense_names():
            yield n, self.dense_tensor(n)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.iter_dense())

    def written_weight(self, module: str, qt: QTensor | None = None) -> torch.Tensor:
        """float32 [out, in]: the weight the bytes on disk make the engine compute with."""
        from qtk.model.simulate import engine_weight

        return engine_weight(self.qtensor(module) if qt is None else qt)

    def check_module(self, module: str, shape: tuple[int, int]) -> list[str]:
        """Problems with the dtypes and shapes of `module`'s tensors against the scheme the config declares, for a
        [out, in] weight (read from the headers, no data); one string per problem, naming the tensor."""
        return []

    def format_problems(self) -> list[str]:
        """The config against the tensors, beyond single modules (e.g. KV scales without a KV scheme)."""
        return []

    # ---- shared ----
    @property
    def manifest(self) -> dict | None:
        """qtk.json, or None when absent; an unreadable one is None too, with manifest_error saying why."""
        p = self.path / "qtk.json"
        self.manifest_error = None
        if not p.is_file():
            return None
        try:
            m = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            self.manifest_error = f"qtk.json is not valid JSON ({e.__class__.__name__})"
            return None
        if not isinstance(m, dict):
            self.manifest_error = "qtk.json is not a JSON object"
            return None
        return m

    manifest_error: str | None = None

    def _broken(self, problem: str) -> CheckFailed:
        return CheckFailed(f"{self.path}: {problem}", "the checkpoint is damaged or was edited: re-run qtk convert")

    def _index(self, prefix: str = "model") -> dict[str, Path]:
        if not self._files:
            idx = self.path / f"{prefix}.safetensors.index.json"
            if idx.is_file():
                try:
                    wm = json.loads(idx.read_text()).get("weight_map")
                except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                    raise self._broken(f"{idx.name} is not valid JSON with a weight_map") from None
                if not isinstance(wm, dict):
                    raise self._broken(f"{idx.name} has no weight_map")
                root = self.path.resolve()
                files = {}
                for k, v in wm.items():
                    f = self.path / v if isinstance(v, str) else None
                    if f is None or root not in f.resolve().parents or not f.is_file():
                        raise self._broken(f"{idx.name} maps {k} to {v!r}, which is not a shard in the directory")
                    files[k] = f
                self._files = files
                # every shard's header must list what the index says it holds
                for f in set(files.values()):
                    keys = set(self._open(f).keys())
                    missing = [k for k, v in files.items() if v == f and k not in keys]
                    if missing:
                        raise self._broken(f"{idx.name} puts {missing[0]} in {f.name}, which does not hold it")
            else:
                for p in sorted(self.path.glob(f"{prefix}*.safetensors")) or sorted(self.path.glob("*.safetensors")):
                    self._files.update({k: p for k in self._open(p).keys()})
        return self._files

    def _open(self, p: Path):
        from qtk.export.safetensors_io import SafetensorsFile

        h = self._handles.get(p)
        if h is None:
            try:
                h = self._handles[p] = SafetensorsFile(p)
            except (ValueError, OSError) as e:
                raise self._broken(f"{p.name} is not a readable safetensors file ({e})") from None
        return h

    def tensor_names(self) -> list[str]:
        return list(self._index())

    def tensor(self, name: str) -> torch.Tensor:
        f = self._index().get(name)
        if f is None:
            raise self._broken(f"tensor {name} is missing")
        try:
            return self._open(f).get_tensor(name)
        except (ValueError, OSError) as e:
            raise self._broken(f"tensor {name} cannot be read from {f.name} ({e})") from None

    def meta(self, name: str) -> tuple[torch.dtype, list[int]] | None:
        """(dtype, shape) of a stored tensor from its file's header, without reading it; None when absent."""
        f = self._index().get(name)
        if f is None:
            return None
        h = self._open(f)
        return h.dtype(name), h.shape(name)

    def has(self, name: str) -> bool:
        return name in self._index()

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self._index().values()))


FLOATS = (torch.float32, torch.float16, torch.bfloat16)


SCALAR = ([], [1], [1, 1])  # shapes a per-tensor scale is stored with


def expect_tensor(ck: Checkpoint, name: str, dtypes, shape, problems: list[str], what: str = "") -> bool:
    """Append a problem naming `name` unless it is stored with one of `dtypes` and the shape `shape` (a list, or a
    tuple of acceptable lists); True when it is fine."""
    m = ck.meta(name)
    if m is None:
        problems.append(f"{name} is missing{what}")
        return False
    dt, sh = m
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if dt not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        problems.append(f"{name} is stored as {str(dt).replace('torch.', '')}, but the config's scheme needs {want}{what}")
        return False
    shapes = shape if isinstance(shape, tuple) else (shape,)
    if list(sh) not in [list(x) for x in shapes]:
        problems.append(f"{name} has shape {list(sh)}, expected {' or '.join(str(list(x)) for x in shapes)}{what}")
        return False
    return True


def scale_shape(scheme: QuantScheme, out_f: int, in_f: int) -> list[int]:
    """The shape of a weight scale (and zero point) of a [out, in] weight under `scheme`, qtk's layout [out, groups]."""
    if scheme.strategy == "tensor":
        return [1]
    if scheme.strategy == "channel":
        return [out_f, 1]
    return [out_f, in_f // scheme.group_size if scheme.group_size else 0]
