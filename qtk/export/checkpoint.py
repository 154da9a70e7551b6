"""Checkpoint: a written quantized checkpoint read back in Hugging Face names, format-independent.

Readers subclass it. Tensors are read lazily from safetensors, so inspecting a large checkpoint does
not load it whole. Every reader answers `scheme_for(module)` from the checkpoint's own config, so mixed-precision
checkpoints read like any other; layer and attention names come from the architecture table (qtk.model.arch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path

import torch

from qtk.errors import CheckFailed
from qtk.model.arch import ARCHS, Arch, arch_for, naming
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme, Strategy
from qtk.recipe.rules import ModuleScheme


# qtk.json holds per-Linear figures and per-layer algorithm records (AWQ's channel scales): tens of MB for the
# largest models, never this
MAX_MANIFEST_BYTES = 256 * 2**20


def read_json(p: Path, limit: int):
    """A JSON file of a checkpoint, at most `limit` bytes (ValueError beyond, or when it is not JSON: nesting past the
    parser's stack included)."""
    from qtk.bounds import parse_json

    size = p.stat().st_size
    if size > limit:
        raise ValueError(f"{p.name} is {size:,} bytes, more than the {limit // 2**20} MiB qtk reads for it")
    return parse_json(p.read_bytes())


def config_quantization(path: Path) -> dict | None:
    """config.json's quantization_config in a checkpoint directory; None when absent or unreadable."""
    from qtk.model.config_check import MAX_CONFIG_BYTES

    try:
        cfg = read_json(Path(path) / "config.json", MAX_CONFIG_BYTES)
    except (OSError, ValueError):
        return None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return qc if isinstance(qc, dict) else None


class ModuleTensors(Mapping):
    """The stored tensors of one module by the key after its name (`weight_scale` for `X.weight_scale`), read
    lazily: what the format codecs decode from (qtk.export.codecs). A missing key reads as the reader's own error."""

    def __init__(self, ck: "Checkpoint", module: str):
        self.ck, self.module = ck, module

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.ck.tensor(f"{self.module}.{key}")

    def __contains__(self, key) -> bool:
        return self.ck.has(f"{self.module}.{key}")

    def __iter__(self):
        p = self.module + "."
        return (n[len(p):] for n in self.ck.tensor_names() if n.startswith(p) and "." not in n[len(p):])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Checkpoint:
    format: str = ""
    QUANT_METHOD: str = ""  # config.json's quantization_config.quant_method, for readers detected by it

    @classmethod
    def detect(cls, path: Path) -> bool:
        return bool(cls.QUANT_METHOD) and (config_quantization(path) or {}).get("quant_method") == cls.QUANT_METHOD

    def _read_config(self) -> tuple[dict, dict]:
        """config.json without its quantization_config, and that section."""
        from qtk.model.config_check import MAX_CONFIG_BYTES

        try:
            cfg = read_json(self.path / "config.json", MAX_CONFIG_BYTES)
        except (OSError, ValueError) as e:
            raise self._broken(f"config.json cannot be read ({' '.join(str(e).split())[:160]})") from None
        return cfg, cfg.pop("quantization_config")

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

    def scheme_for(self, module: str) -> ModuleScheme | None:
        """The scheme the checkpoint's config gives the stored tensors of `module` (None: it holds none). A
        single-scheme format answers its one scheme for every quantized module; readers of mixed-precision configs
        resolve it per module. Whether the config's exclusions contradict what is stored is the checks' to judge."""
        if module not in self._module_set:
            return None
        return ModuleScheme(self.weights_scheme, self.activations)

    @cached_property
    def _module_set(self) -> frozenset[str]:
        return frozenset(self.modules())

    def schemes(self) -> dict[ModuleScheme, list[str]]:
        """Every scheme in the checkpoint with the modules it covers, the most common first. A module that holds
        quantized tensors but that no part of the config describes is left out (the checks report it)."""
        out: dict[ModuleScheme, list[str]] = {}
        for m in self.modules():
            s = self.scheme_for(m)
            if s is not None:
                out.setdefault(s, []).append(m)
        return dict(sorted(out.items(), key=lambda kv: -len(kv[1])))

    def describe_weights(self) -> str:
        """The weight scheme(s), as `qtk inspect` and reports show them: one scheme, or each with its module count."""
        groups = self.schemes()
        if len(groups) <= 1:
            return self.weights_scheme.describe()
        return "; ".join(f"{s.weights.describe()} ({len(ms)} modules)" for s, ms in groups.items())

    def describe_activations(self) -> str | None:
        """The activation scheme(s) (None: 16-bit everywhere)."""
        acts = list(dict.fromkeys(s.activations for s in self.schemes())) or [self.activations]
        if acts == [None]:
            return None
        return "; ".join(a.describe() if a else "16-bit" for a in acts)

    def tensors(self, module: str) -> ModuleTensors:
        """The stored tensors of `module`, for a codec to decode."""
        return ModuleTensors(self, module)

    # ---- names from the architecture table
    @cached_property
    def arch(self) -> Arch | None:
        """The architecture of the checkpoint's model_type; None for a family outside qtk's table."""
        mt = self.hf_config.get("model_type")
        return arch_for(mt, self.hf_config) if mt in ARCHS else None

    @property
    def names(self) -> Arch:
        """Module names to read by: the architecture's, or Llama's for a family outside the table."""
        return self.arch or naming(self.hf_config.get("model_type"))

    def attention(self, layer: int) -> str:
        """The attention module of decoder layer `layer` (where KV scales live)."""
        return f"{self.names.layers}.{layer}.{self.names.attn}"

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

    def input_transforms(self) -> tuple[dict, list[str]]:
        """module -> its online input transform the engine applies, and the problems with their config: none in a
        format that has no such transforms."""
        return {}, []

    def transform_tensor(self, module: str, width: int | None = None) -> str | None:
        """The stored matrix of `module`'s input transform (`width`: its input width), None without one."""
        return None

    def input_rotation(self, module: str, width: int | None = None):
        """The engine's run-time rotation of `module`'s input (an object with apply(x)), None without one."""
        return None

    def dense_tensor(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def iter_dense(self):
        """(name, tensor) of every dense tensor, one at a time: checking a checkpoint holds one tensor, not all."""
        for n in self.dense_names():
            yield n, self.dense_tensor(n)

    def iter_dense_stored(self):
        """iter_dense, where each tensor stored as it is in one file comes unread (a qtk.io.safetensors.StoredTensor,
        to scan in bounded chunks): checking an embedding never holds it whole. A reader that assembles dense tensors
        (its own iter_dense or dense_tensor) yields them read."""
        if type(self).iter_dense is not Checkpoint.iter_dense or type(self).dense_tensor is not Checkpoint.dense_tensor:
            yield from self.iter_dense()
            return
        for n in self.dense_names():
            f = self._index().get(n)
            if f is None:
                raise self._broken(f"tensor {n} is missing")
            yield n, self._open(f).stored(n)

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
            m = read_json(p, MAX_MANIFEST_BYTES)
        except OSError as e:
            self.manifest_error = f"qtk.json cannot be read ({e.__class__.__name__})"
            return None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too large, nested past the parser's stack
            why = e.__class__.__name__ if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else str(e)
            self.manifest_error = f"qtk.json is not valid JSON ({why})"
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
                    wm = read_json(idx, MAX_MANIFEST_BYTES).get("weight_map")
                except (OSError, ValueError, AttributeError):
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
        from qtk.io.safetensors import SafetensorsFile

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


def config_scheme(weights: QuantScheme, activations: QuantScheme | None = None, where: str = "") -> ModuleScheme:
    """The ModuleScheme a checkpoint's config declares, each scheme refused as a recipe's would be for its role
    (qtk.recipe.schema.checked_scheme); one a recipe could not hold is a damaged or edited checkpoint (exit 1). The
    pair is not judged here: whether its tensors match the config is the checks' to say, module by module."""
    from qtk.errors import QtkError
    from qtk.recipe.schema import checked_scheme

    try:
        return checked_scheme(weights, activations, where, together=False)
    except QtkError as e:
        raise CheckFailed(f"its config declares a scheme qtk cannot read: {e.problem}",
                          "the checkpoint is damaged or was edited: re-run qtk convert") from None


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
    if scheme.strategy == Strategy.TENSOR:
        return [1]
    if scheme.strategy == Strategy.CHANNEL:
        return [out_f, 1]
    if scheme.strategy == Strategy.BLOCK:
        bm, bn = scheme.block_structure
        return [-(-out_f // bm), -(-in_f // bn)]
    return [out_f, in_f // scheme.group_size if scheme.group_size else 0]
