"""ModelSource: a local HF model directory read lazily (config, tokenizer, safetensors via mmap),
materialising one decoder layer at a time on a meta-device skeleton."""

from __future__ import annotations

import copy
import hashlib
from functools import cached_property
from pathlib import Path

import torch

from qtk.errors import UsageError
from qtk.model.arch import ARCHS, Arch, arch_for, config_model_type
from qtk.model.config_check import check_against_weights, read_config_json, text_config
from qtk.model.prequantized import split_fused_experts, source_quantization

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# chat templates transformers reads besides chat_template.jinja and tokenizer_config.json's chat_template: the
# processor's legacy file and the named templates of additional_chat_templates/ (every *.jinja there)
TEMPLATE_FILE = "chat_template.json"
TEMPLATE_DIR = "additional_chat_templates"
# a tokenizer file, template or generation config larger than this is no model's (Gemma 3's tokenizer.json, among
# the largest vocabularies, is 33 MB); the tokenizer parses them whole, at several times their size
MAX_SIDE_FILE_BYTES = 64 * 2**20
# a vision-language model's processor: image (and video) preprocessing, which every output copies with the tokenizer
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def config_from_dict(config: dict):
    """The transformers config a config.json's dict describes, read by the class of the family's architecture
    (`config_model_type`: Kimi-K2 by DeepSeek-V3's), never by code its auto_map names; the quantization_config is
    left out (the model read is the dequantized one)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "auto_map", "quantization_config")}
    return AutoConfig.for_model(config_model_type(config.get("model_type")), **fields)


def meta_skeleton(config, trust_remote_code: bool = False, dtype=torch.float32):
    """Build a causal LM whose parameters live on the meta device while its buffers are real CPU tensors.

    Parameters are created empty (no init) and moved to meta one at a time, so building costs neither
    memory nor initialisation time; buffers computed in __init__ keep their values."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    register = torch.nn.Module.register_parameter

    def to_meta(self, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        register(self, name, param)

    arch = ARCHS.get(getattr(config, "model_type", None))
    auto = AutoModelForImageTextToText if arch is not None and arch.multimodal else AutoModelForCausalLM
    torch.nn.Module.register_parameter = to_meta
    try:
        with no_init_weights():
            model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    finally:
        torch.nn.Module.register_parameter = register
    model.tie_weights()  # the patched registration loses from_config's tying: lm_head must stay the embedding
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
        self.config_dict = read_config_json(cfg)
        mt = self.config_dict.get("model_type")
        # a family qtk reads with the transformers class of the architecture it is (Kimi-K2 as DeepSeek-V3) needs none
        # of the code its auto_map names
        if "auto_map" in self.config_dict and not trust_remote_code and config_model_type(mt) == mt:
            raise UsageError(f"{self.path.name} needs custom code from the model repository (config.json has auto_map)",
                             "review that code, then pass --trust-remote-code")
        self._check_code_files()
        # an FP8-block source, gpt-oss's MXFP4 experts or a compressed-tensors checkpoint is read as the 16-bit model it
        # stands for (qtk.model.prequantized): config_dict is that model's config, without the quantization_config, which is kept
        # in `quant`; other quantized sources refused
        self.quant = source_quantization(self.config_dict, self.path.name, self.path)
        if self.quant is not None:
            self.config_dict = {k: v for k, v in self.config_dict.items() if k != "quantization_config"}
        if "model_type" not in self.config_dict:
            raise UsageError(f"{cfg} has no model_type", "restore the model's original config.json (it names the architecture, e.g. 'llama')")
        if not isinstance(self.config_dict["model_type"], str):
            raise UsageError(f"{cfg}: model_type is {str(self.config_dict['model_type'])[:40]}, not a name",
                             "restore the model's original config.json (it names the architecture, e.g. 'llama')")
        self.arch: Arch = arch_for(self.config_dict.get("model_type"), self.config_dict)
        self._handles: dict[Path, object] = {}
        self._skeleton = None
        self._layout = None
        self.weight_map = self._index_weights()
        self._disk: dict[str, str] = {}  # name -> its name in the weight files, where they differ
        if self.arch.multimodal:
            self.weight_map = self._model_names(self.weight_map)
        # tensors the model reads that are stored otherwise (qtk.model.prequantized): name -> how it is made, and the
        # stored tensors they come from, which leave the weight map (name -> file)
        self.derived: dict = {}
        self.hidden: dict[str, Path] = {}
        if self.quant is not None:  # the scales leave the weight map: the model read is the dequantized one
            self.weight_map = self.quant.index(self.weight_map, self.shape, self._stored_dtype, f"{self.path.name}")
            self.derived.update(self.quant.derived)
            self.hidden.update(self.quant.hidden)
        self.weight_map, derived, hidden = split_fused_experts(self.arch, self.weight_map, self.shape, self.quant)
        self.derived.update(derived)
        self.hidden.update(hidden)
        check_against_weights(self.config_dict, sum(p.stat().st_size for p in set(self.weight_map.values())),
                              len(self.weight_map), f"{cfg}")
        self.checked_side_files()

    # ---- files ----

    def _check_code_files(self) -> None:
        """The auto_map's modules (config.json's, and tokenizer_config.json's for the tokenizer) must be in the
        directory: qtk never downloads code, and transformers fetches an 'org/repo--module.Class' reference from that
        other repository even for a local model, so one is refused before transformers sees it."""
        maps = [("config.json", self.config_dict.get("auto_map"))]
        tok_cfg = self.path / "tokenizer_config.json"
        if tok_cfg.is_file():
            try:
                from qtk.bounds import parse_json

                check_size(tok_cfg, MAX_SIDE_FILE_BYTES)
                doc = parse_json(tok_cfg.read_bytes())
            except ValueError:
                doc = None  # unreadable: the tokenizer's own load reports it, if it is ever loaded
            if isinstance(doc, dict):
                maps.append(("tokenizer_config.json", doc.get("auto_map")))
        for origin, refs in maps:
            refs = [r for v in (refs.values() if isinstance(refs, dict) else []) for r in (v if isinstance(v, list) else [v])]
            for ref in refs:
                if isinstance(ref, str) and "--" in ref:  # 'org/repo--module.Class' lives in another repository
                    raise UsageError(f"{origin}'s auto_map takes code from another repository ({ref[:120]!r}), which "
                                     "qtk does not download", "copy that repository's *.py files into the model "
                                     "directory and name them in auto_map as module.Class")
                if origin == "config.json" and self.trust_remote_code and isinstance(ref, str) and "." in ref:
                    module = ref.rpartition(".")[0].replace(".", "/") + ".py"
                    if not (self.path / module).is_file():
                        raise UsageError(f"config.json's auto_map needs {module}, which is not in {self.path.name}",
                                         "copy the model repository's *.py files into the model directory")

    def _index_weights(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            from qtk.bounds import parse_json

            check_size(index, MAX_SIDE_FILE_BYTES)  # a name per tensor: a few MB for the largest models
            try:
                wm = parse_json(index.read_bytes())
            except ValueError as e:  # JSONDecodeError, not UTF-8, nested past the parser's stack
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

    def _model_names(self, weight_map: dict[str, Path]) -> dict[str, Path]:
        """A vision-language checkpoint's tensors under the names of transformers' multimodal class, which the family
        table uses: checkpoints of earlier vintages name them otherwise (language_model.model.layers,
        vision_tower.vision_model, visual), and transformers renames them on loading by its own conversion table, asked
        here on the meta skeleton. The output is written under these names, which transformers and vLLM both load."""
        import transformers

        model = self.skeleton_model()
        try:  # transformers' loading internals, as of the version qtk is tested with (5.25)
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

            transforms = get_model_conversion_mapping(model)
            renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
            converters = [t for t in transforms if isinstance(t, WeightConverter)]
            meta = model.state_dict()
            rename = lambda disk: rename_source_key(disk, renamings, converters, model.base_model_prefix, meta)[0]  # noqa: E731
            rename(next(iter(weight_map)))
        except (ImportError, AttributeError, TypeError) as e:
            raise UsageError(f"transformers {transformers.__version__} does not expose the checkpoint renaming qtk reads "
                             f"{self.arch.name} checkpoints with ({_one_line(e)})",
                             "install the transformers version qtk is tested with: pip install 'transformers>=5.25,<6'") from None
        out = {}
        for disk, f in weight_map.items():
            name = rename(disk)
            if name in out:
                raise UsageError(f"{self.path.name} holds two tensors for {name} ({self._disk.get(name, name)} and {disk})",
                                 "the checkpoint mixes two naming schemes: re-download it")
            out[name] = f
            if name != disk:
                self._disk[name] = disk
        return out

    def skeleton_model(self):
        """The meta skeleton (qtk.model.source.meta_skeleton), built once: unchecked here, checked by skeleton()."""
        if getattr(self, "_meta", None) is None:
            self._meta = meta_skeleton(self.config, trust_remote_code=self.trust_remote_code)
        return self._meta

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
        checkpoint, or read and applied as a chat template), and one larger than MAX_SIDE_FILE_BYTES (the tokenizer
        parses it whole). Every chat template transformers may read is checked so, copied or not
        (chat_template.json, additional_chat_templates/). Links into the Hugging Face cache's blob store
        (snapshots/REV/f -> ../../blobs/HASH) are that cache's own layout and stay allowed."""
        root = self.path.resolve()
        roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
        files = self.side_files

        def outside(p: Path) -> bool:
            real = p.resolve()
            return not any(r == real or r in real.parents for r in roots)

        templates = self.path / TEMPLATE_DIR
        read = [*files, *self.template_files]
        if templates.exists() and outside(templates):
            read.append(templates)
        for p in [self.path / "config.json", *read]:  # config.json is rewritten into every output too
            if outside(p):
                where = p.name if p.parent == self.path else f"{p.parent.name}/{p.name}"
                raise UsageError(f"{where} in {self.path.name} is a link to a file outside the model directory",
                                 "replace the link with a copy of the file if it belongs to the model, or remove it")
        for p in read:
            if p.is_file():
                check_size(p, MAX_SIDE_FILE_BYTES)
        return files

    @property
    def template_files(self) -> list[Path]:
        """The chat templates transformers may read besides the tokenizer files: chat_template.json and every file in
        additional_chat_templates/ (copied into no output)."""
        out = [self.path / TEMPLATE_FILE] if (self.path / TEMPLATE_FILE).is_file() else []
        d = self.path / TEMPLATE_DIR
        if d.is_dir():
            out += sorted(p for p in d.iterdir())
        return out

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
        d = self.derived.get(name)
        if d is not None:  # a dequantized weight or one expert's slice of fused experts, made as it is read
            return d.make(self.dtype, *(self._read(i, mapped or d.partial) for i in d.inputs))
        return self._read(name, mapped)

    def _file(self, name: str) -> Path | None:
        """The weight file that holds `name` (the stored tensors derived ones come from included), None when none
        does."""
        return self.hidden.get(name) or self.weight_map.get(name)

    def _read(self, name: str, mapped: bool = False) -> torch.Tensor:
        """The tensor as it is stored."""
        p = self._file(name)
        if p is None:
            raise UsageError(f"tensor {name} is missing from {self.path.name}", "the checkpoint is incomplete: re-download it")
        h = self._open(p)
        disk = self._disk.get(name, name)
        try:
            if isinstance(h, dict):
                return h[disk]
            return h.map_tensor(disk) if mapped else h.get_tensor(disk)
        except Exception as e:
            raise UsageError(f"cannot read tensor {name} from {p.name} ({e})", "the shard is truncated or corrupt: re-download it") from None

    def stored(self, name: str, check=None):
        """`name` unread, to copy or scan in bounded chunks (qtk.io.safetensors.StoredTensor; `check` sees each
        chunk); a pickle checkpoint's tensor (already in memory) is returned as it is, `check`ed whole."""
        p = self.weight_map.get(name)
        if p is None:
            raise UsageError(f"tensor {name} is missing from {self.path.name}", "the checkpoint is incomplete: re-download it")
        h = self._open(p)
        if isinstance(h, dict) or name in self.derived:  # in memory, or made from what is stored
            t = self.tensor(name)
            if check is not None:
                check(t)
            return t
        return h.stored(self._disk.get(name, name), check)

    @property
    def files(self) -> list[Path]:
        """Every file that defines the model: config, tokenizer, generation config, weights."""
        names = {"config.json", "generation_config.json", *TOKENIZER_FILES, *PROCESSOR_FILES, "model.safetensors.index.json"}
        out = [self.path / n for n in sorted(names) if (self.path / n).is_file()]
        return out + sorted({*self.weight_map.values(), *self.hidden.values()})

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
        processor = [self.path / n for n in PROCESSOR_FILES if (self.path / n).is_file()]
        return self.tokenizer_files + ([gen] if gen.is_file() else []) + processor

    def tokenizer(self):
        if not any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for p in self.tokenizer_files):
            raise UsageError(f"{self.path.name} has no tokenizer (tokenizer.json / tokenizer.model)",
                             "copy the tokenizer files into the model directory, or use a recipe that needs no calibration")
        from transformers import AutoTokenizer

        try:  # local_files_only: a model directory is all qtk reads, whatever its files name
            return AutoTokenizer.from_pretrained(str(self.path), trust_remote_code=self.trust_remote_code,
                                                 local_files_only=True)
        except Exception as e:  # tokenizers/transformers raise many types for corrupt files
            raise UsageError(f"the tokenizer in {self.path.name} cannot be loaded ({_one_line(e)})",
                             "restore the model's original tokenizer files") from None

    # ---- config ----

    @cached_property
    def config(self):
        from transformers import AutoConfig

        model_type = self.config_dict.get("model_type")
        try:
            if config_model_type(model_type) != model_type and not self.trust_remote_code:
                # a family transformers has no class for, read by the class of the architecture it is (Kimi-K2 as
                # DeepSeek-V3), never by the code its auto_map names
                cfg = config_from_dict(self.config_dict)
            else:
                cfg = AutoConfig.from_pretrained(str(self.path), trust_remote_code=self.trust_remote_code,
                                                 local_files_only=True)
        except Exception as e:  # includes huggingface_hub's strict-dataclass validation errors
            raise UsageError(f"config.json cannot be read by transformers ({_one_line(e)})", "restore the model's original config.json") from None
        if self.quant is not None and hasattr(cfg, "quantization_config"):  # the model read is the dequantized one
            del cfg.quantization_config
        return cfg

    @property
    def dtype(self) -> torch.dtype:
        name = self.config_dict.get("dtype") or self.config_dict.get("torch_dtype")
        if isinstance(name, str) and name in DTYPES:
            return DTYPES[name]
        stored = [n for n in self.weight_map if n not in self.derived]
        return self._stored_dtype(stored[0] if stored else next(iter(self.weight_map)))

    @property
    def num_layers(self) -> int:
        n = text_config(self.config_dict).get("num_hidden_layers")  # config.json's own number: no transformers import
        return n if isinstance(n, int) and not isinstance(n, bool) else int(self.config.get_text_config().num_hidden_layers)

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

            model = self.skeleton_model()
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
        d = self.derived.get(name)
        if d is not None and d.inputs[0] != name:  # made from other tensors: its own shape
            return list(d.shape)
        h = self._open(self._file(name) or self.weight_map[name])  # KeyError when no file holds it
        disk = self._disk.get(name, name)
        return list(h[disk].shape) if isinstance(h, dict) else h.shape(disk)

    def tensor_dtype(self, name: str) -> torch.dtype:
        """A tensor's dtype as `tensor` returns it (a dequantized weight: the model dtype; a slice: its source's), from
        the file header."""
        d = self.derived.get(name)
        if d is not None:
            return self._stored_dtype(d.inputs[0]) if d.stored_dtype else self.dtype
        return self._stored_dtype(name)

    def _stored_dtype(self, name: str) -> torch.dtype:
        """A tensor's dtype on disk, from the file header, without reading its data."""
        h = self._open(self._file(name) or self.weight_map[name])  # KeyError when no file holds it
        disk = self._disk.get(name, name)
        return h[disk].dtype if isinstance(h, dict) else h.dtype(disk)

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
        # persistent buffers the checkpoint holds (DeepSeek's router e_score_correction_bias) are the model's values,
        # not the skeleton's initial ones: loaded in their stored dtype (a routing bias is kept in float32)
        for k, b in mod.state_dict().items():
            if k not in expected and prefix + k in self.weight_map:
                t = self.tensor(prefix + k)
                if tuple(t.shape) != tuple(b.shape):
                    raise UsageError(f"tensor {prefix + k} has shape {list(t.shape)} but config.json implies {list(b.shape)}",
                                     "the weights do not belong to this config.json")
                sd[k] = t if device is None else t.to(device)
        mod.load_state_dict(sd, strict=False, assign=True)
        if device is not None:
            mod.to(device)  # the buffers the skeleton computed (rotary tables) follow the parameters
        return mod.eval()

    def layer(self, skeleton, i: int, dtype=torch.float32, device=None) -> torch.nn.Module:
        """Decoder layer i materialised from disk in `dtype` on `device` (default: the CPU), NaN/Inf refused."""
        layers = skeleton.get_submodule(self.arch.layers)
        return self.load_module(layers[i], self.layer_prefix(i), dtype, check_finite=True, device=device)


def check_size(p: Path, limit: int) -> None:
    """Refuse a side file larger than any model's (the tokenizer would parse it whole, and the output copy it)."""
    from qtk.bounds import check_size as bounded

    where = p.name if p.parent.name != TEMPLATE_DIR else f"{TEMPLATE_DIR}/{p.name}"
    bounded(p, limit, where, "restore the model's original file (a tokenizer or template file is at most tens of MB)")


def _one_line(e: BaseException) -> str:
    """The innermost cause of a library error, on one line: what a user can act on."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split())
    return f"{e.__class__.__name__}: {text[:200]}"
