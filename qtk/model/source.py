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
from qtk.model.arch import Arch, arch_for

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelSource:
    """A Hugging Face causal-LM directory. Nothing heavy is read until asked for."""

    def __init__(self, path: str | Path, *, allow_pickle: bool = False, trust_remote_code: bool = False):
        self.path = Path(path)
        self.allow_pickle = allow_pickle
        self.trust_remote_code = trust_remote_code
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
        self.arch: Arch = arch_for(self.config_dict.get("model_type"))
        self._handles: dict[Path, object] = {}
        self.weight_map = self._index_weights()

    # ---- files ----

    def _index_weights(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError(f"{index} is malformed (no weight_map)", "restore the index file or re-download the model") from None
            files = {}
            for name, fname in wm.items():
                p = self.path / fname
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

    def _index_pickle(self) -> dict[str, Path]:
        out = {}
        for p in sorted(self.path.glob("*.bin")):
            sd = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
            self._handles[p] = sd
            out.update({k: p for k in sd})
        return out

    def _open(self, p: Path):
        h = self._handles.get(p)
        if h is None:
            from qtk.export.safetensors_io import SafetensorsFile

            try:
                h = SafetensorsFile(p)
            except (ValueError, OSError) as e:
                raise UsageError(f"{p.name} is not a readable safetensors file ({e})", "re-download that shard") from None
            self._handles[p] = h
        return h

    def tensor(self, name: str) -> torch.Tensor:
        p = self.weight_map.get(name)
        if p is None:
            raise UsageError(f"tensor {name} is missing from {self.path.name}", "the checkpoint is incomplete: re-download it")
        h = self._open(p)
        try:
            return h[name] if isinstance(h, dict) else h.get_tensor(name)
        except Exception as e:
            raise UsageError(f"cannot read tensor {name} from {p.name} ({e})", "the shard is truncated or corrupt: re-download it") from None

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

    def tokenizer(self):
        if not any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for p in self.tokenizer_files):
            raise UsageError(f"{self.path.name} has no tokenizer (tokenizer.json / tokenizer.model)",
                             "copy the tokenizer files into the model directory, or use a recipe that needs no calibration")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path), trust_remote_code=self.trust_remote_code)

    # ---- config ----

    @cached_property
    def config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(str(self.path), trust_remote_code=self.trust_remote_code)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise UsageError(f"config.json cannot be read by transformers ({e})", "restore the model's original config.json") from None

    @property
    def dtype(self) -> torch.dtype:
        name = self.config_dict.get("dtype") or self.config_dict.get("torch_dtype")
        if name in DTYPES:
            return DTYPES[name]
        first = next(iter(self.weight_map))
        return self.tensor(first).dtype

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

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
        """The whole model on the meta device, fp32: costs no memory, gives module structure and forward code."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32,
                                                     trust_remote_code=self.trust_remote_code)
        model.eval()
        return model

    def load_module(self, module: torch.nn.Module, prefix: str, dtype=torch.float32, check_finite: bool = False) -> torch.nn.Module:
        """Materialise a (meta) module from the source tensors under `prefix`, in `dtype`. Returns a new module.
        check_finite scans every tensor; the pipeline instead checks quantization scales and dense tensors."""
        mod = copy.deepcopy(module)
        expected = mod.state_dict()
        sd = {}
        for k, meta in expected.items():
            t = self.tensor(prefix + k)
            if tuple(t.shape) != tuple(meta.shape):
                raise UsageError(f"tensor {prefix + k} has shape {list(t.shape)} but config.json implies {list(meta.shape)}",
                                 "the weights do not belong to this config.json")
            t = t.to(dtype)
            if check_finite and not torch.isfinite(t).all():
                raise UsageError(f"tensor {prefix + k} contains NaN or Inf values", "the source checkpoint is corrupt; fix or re-download it")
            sd[k] = t
        mod.to_empty(device="cpu")
        mod.load_state_dict(sd, strict=True, assign=True)
        # non-persistent buffers (none in supported decoder layers) would be left uninitialised by to_empty
        return mod.eval()

    def layer(self, skeleton, i: int, dtype=torch.float32) -> torch.nn.Module:
        layers = skeleton.get_submodule(self.arch.layers)
        return self.load_module(layers[i], self.layer_prefix(i), dtype)
