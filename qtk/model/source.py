"""ModelSource: a local HF model directory read lazily (config, tokenizer, safetensors via mmap),
materialising one decoder layer at a time on a meta-device skeleton."""

from __future__ import annotations

import copy
import hashlib
import json
from functools import cached_property
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.model.arch import ARCHS, Arch, arch_for
from qtk.model.config_check import check_against_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def meta_skeleton(config, trust_remote_code: bool = False, dtype=torch.float32):
    """Build a causal LM whose parameters live on the meta device while its buffers are real CPU tensors.

    Parameters are created empty (no init) and moved to meta one at a time, so building costs neither
    memory nor initialisation time; buffers computed in __init__ keep their values."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    register = torch.nn.Module.register_parameter

    def to_meta(self, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        register(self, name, param)

    torch.nn.Module.register_parameter = to_meta
    try:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    finally:
        torch.nn.Module.register_parameter = register
    model.tie_weights()  # the patched registration loses from_config's tying: lm_head must stay the embedding
    arch = ARCHS.get(getattr(config, "model_type", None))
    if arch is not None and arch.moe is not None:  # per-expert Linears, as checkpoints name them
        from qtk.model.moe import unfuse_experts

        unfuse_experts(model, arch)
    return model.eval()


class ModelSource:
    """A Hugging Face causal-LM directory. Nothing heavy is read until asked for."""

    def __init__(self, path: str | Path, *, allow_pickle: bool = False, trust_remote_code: bool = False):
        self.path = Path(path)
        self.allow_pickle = allow_pickle
        self.trust_remote_code = trust_remote_code
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"model path {self.path} is a file, not a directory", "give the directory that holds config.json and the weights")
        if not self.path.is_dir():
            raise UsageError(f"model directory {self.path} does not exist", "give the path of a local Hugging Face model directory")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise UsageError(f"{self.path} has no config.json", "point at a Hugging Face model directory (it holds config.json and *.safetensors)")
        try:
            self.config_dict = json.loads(cfg.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{cfg} is not valid JSON ({e.__class__.__name__}: {e})", "restore the model's original config.json") from None
        if not isinstance(self.config_dict, dict):
            raise UsageError(f"{cfg} is not a JSON object", "restore the model's original config.json")
        if "auto_map" in self.config_dict and not trust_remote_code:
            raise UsageError(f"{self.path.name} needs custom code from the model repository (config.json has auto_map)",
                             "review that code, then pass --trust-remote-code")
        self._check_code_files()
        if "quantization_config" in self.config_dict:
            method = self.config_dict["quantization_config"]
            method = method.get("quant_method", "?") if isinstance(method, dict) else "?"
            raise UsageError(f"{self.path.name} is already quantized (config.json has a {method} quantization_config)",
                             "give the original unquantized (bf16/fp16) model")
        if "model_type" not in self.config_dict:
            raise UsageError(f"{cfg} has no model_type", "restore the model's original config.json (it names the architecture, e.g. 'llama')")
        self.arch: Arch = arch_for(self.config_dict.get("model_type"), self.config_dict)
        self._handles: dict[Path, object] = {}
        self._skeleton = None
        self._layout = None
        self.weight_map = self._index_weights()
        check_against_weights(self.config_dict, sum(p.stat().st_size for p in set(self.weight_map.values())),
                              len(self.weight_map), f"{cfg}")
        self.checked_side_files()

    # ---- files ----

    def _check_code_files(self) -> None:
        """With --trust-remote-code, the auto_map's modules must be in the directory (qtk never downloads code)."""
        refs = self.config_dict.get("auto_map") or {}
        refs = [r for v in (refs.values() if isinstance(refs, dict) else []) for r in (v if isinstance(v, list) else [v])]
        for ref in refs:
            if isinstance(ref, str) and "--" not in ref and "." in ref:  # 'repo--module.Class' lives in another repository
                module = ref.rpartition(".")[0].replace(".", "/") + ".py"
                if not (self.path / module).is_file():
                    raise UsageError(f"config.json's auto_map needs {module}, which is not in {self.path.name}",
                                     "copy the model repository's *.py files into the model directory")

    def _index_weights(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                wm = json.loads(index.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UsageError(f"{index} is not valid JSON ({e})", "restore the index file or re-download the model") from None
            wm = wm.get("weight_map") if isinstance(wm, dict) else None
            if not isinstance(wm, dict):
                raise UsageError(f"{index} is malformed (no weight_map)", "restore the index file or re-download the model")
            files = {}
            for name, fname in wm.items():
                if not isinstance(fname, str):
                    raise UsageError(f"{index} is malformed (weight_map[{name!r}] is not a file name)", "restore the index file or re-download the model")
                p = self._inside(fname, index)
                if not p.is_file():
                    raise UsageError(f"index names shard {fname} (for {name}) but it is missing", "re-download the missing shard")
                files[name] = p
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if single.is_file():
            shards = [single]
        if shards:
            out = {}
            for p in shards:
                for name in self._open(p).keys():
                    out[name] = p
            return out
        if any((self.path / f).exists() for f in PICKLE_WEIGHTS) or list(self.path.glob("*.bin")):
            if not self.allow_pickle:
                raise UsageError(f"{self.path.name} only has pickle weights (*.bin), which can run code when loaded",
                                 "convert them to safetensors, or pass --allow-pickle if you trust the source")
            return self._index_pickle()
        raise UsageError(f"{self.path} has no weights (*.safetensors)", "download the model's safetensors files into that directory")

    def _inside(self, fname: str, index: Path) -> Path:
        """The shard an index entry names, which must lie in the model directory: no absolute path, no '..',
        no directory link leading out (a shard that is itself a link, as in the Hugging Face cache, is fine)."""
        rel = Path(fname)
        root = self.path.resolve()
        outside = rel.is_absolute() or ".." in rel.parts
        if not outside:
            folder = (self.path / rel).parent.resolve()
            outside = folder != root and root not in folder.parents
        if outside:
            raise UsageError(f"{index.name} names a shard outside the model directory ({fname!r})",
                             "an index may only name files inside the model directory: restore the index file")
        return self.path / rel

    def checked_side_files(self) -> list[Path]:
        """The side files (tokenizer, chat template, generation config), which every output copies; refuses one
        whose real path is outside the model directory (a link to /etc/passwd would be published with the
        checkpoint). Links into the Hugging Face cache's blob store (snapshots/REV/f -> ../../blobs/HASH) are
        that cache's own layout and stay allowed."""
        root = self.path.resolve()
        roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
        files = self.side_files
        for p in [self.path / "config.json", *files]:  # config.json is rewritten into every output too
            if not any(r in p.resolve().parents for r in roots):
                raise UsageError(f"{p.name} in {self.path.name} is a link to a file outside the model directory",
                                 "replace the link with a copy of the file if it belongs to the model, or remove it")
        return files

    def _index_pickle(self) -> dict[str, Path]:
        out = {}
        for p in sorted(self.path.glob("*.bin")):
            try:
                sd = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # weights_only refuses any object that is not a tensor; never unpickled
                kind = "holds objects other than tensors (possibly code)" if "weights_only" in str(e).lower() else "is not a readable torch checkpoint"
                raise UsageError(f"{p.name} {kind}; it was not loaded",
                                 "get safetensors weights from the model's publisher (qtk never runs code from a checkpoint)") from None
            if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
                raise UsageError(f"{p.name} is not a state dict of named tensors", "get safetensors weights from the model's publisher")
            self._handles[p] = sd
            out.update({k: p for k in sd})
        return out

    def _open(self, p: Path):
        h = self._handles.get(p)
        if h is None:
            from qtk.io.safetensors import SafetensorsFile

            try:
                h = SafetensorsFile(p)
            except (ValueError, OSError) as e:
                raise UsageError(f"{p.name} is not a readable safetensors file ({e})", "re-download that shard") from None
            self._handles[p] = h
        return h

    def tensor(self, name: str, mapped: bool = False) -> torch.Tensor:
        """The tensor, read; mapped: mapped from its safetensors file instead where it can be
        (qtk.io.safetensors.SafetensorsFile.map_tensor: private, so writing to it leaves the file as it is)."""
        p = self.weight_map.get(name)
        if p is None:
            raise UsageError(f"tensor {name} is missing from {self.path.name}", "the checkpoint is incomplete: re-download it")
        h = self._open(p)
        try:
            if isinstance(h, dict):
                return h[name]
            return h.map_tensor(name) if mapped else h.get_tensor(name)
        except Exception as e:
            raise UsageError(f"cannot read tensor {name} from {p.name} ({e})", "the shard is truncated or corrupt: re-download it") from None

    def stored(self, name: str, check=None):
        """`name` unread, to copy or scan in bounded chunks (qtk.io.safetensors.StoredTensor; `check` sees each
        chunk); a pickle checkpoint's tensor (already in memory) is returned as it is, `check`ed whole."""
        p = self.weight_map.get(name)
        if p is None:
            raise UsageError(f"tensor {name} is missing from {self.path.name}", "the checkpoint is incomplete: re-download it")
        h = self._open(p)
        if isinstance(h, dict):
            t = self.tensor(name)
            if check is not None:
                check(t)
            return t
        return h.stored(name, check)

    @property
    def files(self) -> list[Path]:
        """Every file that defines the model: config, tokenizer, generation config, weights."""
        names = {"config.json", "generation_config.json", *TOKENIZER_FILES, "model.safetensors.index.json"}
        out = [self.path / n for n in sorted(names) if (self.path / n).is_file()]
        return out + sorted(set(self.weight_map.values()))

    def file_hashes(self) -> dict[str, str]:
        out = {}
        for p in self.files:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            out[p.name] = h.hexdigest()
        return out

    @property
    def tokenizer_files(self) -> list[Path]:
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

    @property
    def side_files(self) -> list[Path]:
        """What every output copies from the model directory besides the weights."""
        gen = self.path / "generation_config.json"
        return self.tokenizer_files + ([gen] if gen.is_file() else [])

    def tokenizer(self):
        if not any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for p in self.tokenizer_files):
            raise UsageError(f"{self.path.name} has no tokenizer (tokenizer.json / tokenizer.model)",
                             "copy the tokenizer files into the model directory, or use a recipe that needs no calibration")
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), trust_remote_code=self.trust_remote_code)
        except Exception as e:  # tokenizers/transformers raise many types for corrupt files
            raise UsageError(f"the tokenizer in {self.path.name} cannot be loaded ({_one_line(e)})",
                             "restore the model's original tokenizer files") from None

    # ---- config ----

    @cached_property
    def config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(str(self.path), trust_remote_code=self.trust_remote_code)
        except Exception as e:  # includes huggingface_hub's strict-dataclass validation errors
            raise UsageError(f"config.json cannot be read by transformers ({_one_line(e)})", "restore the model's original config.json") from None

    @property
    def dtype(self) -> torch.dtype:
        name = self.config_dict.get("dtype") or self.config_dict.get("torch_dtype")
        if name in DTYPES:
            return DTYPES[name]
        first = next(iter(self.weight_map))
        return self.tensor(first).dtype

    @property
    def num_layers(self) -> int:
        n = self.config_dict.get("num_hidden_layers")  # config.json's own number: no transformers import
        return n if isinstance(n, int) and not isinstance(n, bool) else int(self.config.num_hidden_layers)

    def layer_prefix(self, i: int) -> str:
        return f"{self.arch.layers}.{i}."

    def layer_tensor_names(self, i: int) -> list[str]:
        p = self.layer_prefix(i)
        return [n for n in self.weight_map if n.startswith(p)]

    def non_layer_tensor_names(self) -> list[str]:
        p = self.arch.layers + "."
        return [n for n in self.weight_map if not n.startswith(p)]

    # ---- modules ----

    def skeleton(self):
        """The whole model with parameters on the meta device (no memory) and buffers computed on the CPU
        (rotary frequencies, embedding scales: non-persistent buffers no checkpoint holds), fp32.
        Every parameter it expects is checked against the weight files' headers first, so a missing or
        misshapen tensor is refused before any work (not half-way, and not silently passed through)."""
        if self._skeleton is None:  # built once: `qtk convert` checks it before any work, then runs on it
            from qtk.model.layout import Layout

            model = meta_skeleton(self.config, trust_remote_code=self.trust_remote_code)
            self._layout = Layout.of_model(model, self.arch)
            self._check_tensors(self._layout)
            self._skeleton = model
        return self._skeleton

    def layout(self):
        """The parameters config.json implies (qtk.model.layout.Layout), checked against the weight files' headers
        as skeleton() checks them: from config.json alone where it says every size (no transformers import, no
        module), else from the skeleton."""
        if self._layout is None:
            from qtk.model.layout import layout_from_config

            layout = None if self.trust_remote_code else layout_from_config(self.config_dict, self.arch)
            if layout is None:
                self.skeleton()
            else:
                self._check_tensors(layout)
                self._layout = layout
        return self._layout

    def shape(self, name: str) -> list[int]:
        """A tensor's shape from the file header, without reading its data."""
        h = self._open(self.weight_map[name])
        return list(h[name].shape) if isinstance(h, dict) else h.shape(name)

    def tensor_dtype(self, name: str) -> torch.dtype:
        """A tensor's dtype from the file header, without reading its data."""
        h = self._open(self.weight_map[name])
        return h[name].dtype if isinstance(h, dict) else h.dtype(name)

    def _check_tensors(self, layout) -> None:
        self._check_unknown_tensors(layout)
        shapes = layout.shapes()
        for members in layout.groups():  # tied parameters are one tensor under several names
            present = [n for n in members if n in self.weight_map]
            if not present:
                raise UsageError(f"tensor {members[0]} is missing from {self.path.name}", "the checkpoint is incomplete: re-download it")
            for n in present:
                if self.shape(n) != list(shapes[n]):
                    raise UsageError(f"tensor {n} has shape {self.shape(n)} but config.json implies {list(shapes[n])}",
                                     "the weights do not belong to this config.json")
                dt = self.tensor_dtype(n)
                if not dt.is_floating_point:  # bool or int weights would be cast silently into nonsense
                    raise UsageError(f"tensor {n} is stored as {str(dt).replace('torch.', '')}, not as floating-point weights",
                                     "give the original (bf16/fp16/fp32) model; qtk does not re-quantize integer checkpoints")

    def _check_unknown_tensors(self, layout) -> None:
        """Every tensor in the weight files must belong to the model config.json describes (or be one that
        transformers itself skips, such as old checkpoints' rotary inv_freq): junk tensors would be copied
        into the output, and millions of them make an output no reader accepts."""
        import re

        known = {*layout.names(), *layout.buffers}
        skip_re = re.compile("|".join(f"({p})" for p in layout.skipped))
        unknown = [n for n in self.weight_map if n not in known and not skip_re.search(n)]
        if unknown:
            shown = ", ".join(unknown[:3]) + (", ..." if len(unknown) > 3 else "")
            raise UsageError(f"{len(unknown)} tensor(s) in {self.path.name} belong to no module of the "
                             f"{self.config_dict.get('model_type')} model config.json describes ({shown})",
                             "check that config.json belongs to these weights, or remove the stray tensors")

    def load_module(self, module: torch.nn.Module, prefix: str, dtype=torch.float32, check_finite: bool = False,
                    device=None) -> torch.nn.Module:
        """Materialise a (meta) module from the source tensors under `prefix`, in `dtype`, its tensors on `device`
        (default: the CPU). Returns a new module. check_finite refuses NaN/Inf, naming the tensor (a NaN weight can
        hide behind a finite scale)."""
        mod = copy.deepcopy(module)
        expected = {k: v for k, v in mod.state_dict().items() if v.is_meta}  # parameters (buffers are real)
        sd = {}
        for k, meta in expected.items():
            t = self.tensor(prefix + k)
            if tuple(t.shape) != tuple(meta.shape):
                raise UsageError(f"tensor {prefix + k} has shape {list(t.shape)} but config.json implies {list(meta.shape)}",
                                 "the weights do not belong to this config.json")
            t = t.to(dtype) if device is None else t.to(device=device, dtype=dtype)
            # a sum is non-finite whenever a NaN/Inf is present; the exact scan runs only then (~30x cheaper)
            if check_finite and t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
                raise UsageError(f"tensor {prefix + k} contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")
            sd[k] = t
        mod.load_state_dict(sd, strict=False, assign=True)
        if device is not None:
            mod.to(device)  # the buffers the skeleton computed (rotary tables) follow the parameters
        return mod.eval()

    def layer(self, skeleton, i: int, dtype=torch.float32, device=None) -> torch.nn.Module:
        """Decoder layer i materialised from disk in `dtype` on `device` (default: the CPU), NaN/Inf refused."""
        layers = skeleton.get_submodule(self.arch.layers)
        return self.load_module(layers[i], self.layer_prefix(i), dtype, check_finite=True, device=device)


def _one_line(e: BaseException) -> str:
    """The innermost cause of a library error, on one line: what a user can act on."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split())
    return f"{e.__class__.__name__}: {text[:200]}"
