"""Tiny random models built inside the tests (no hub access): a char-level tokenizer and a config."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama"
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")


def save_char_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))


VOCAB = len(CHARS) + 3


def make_tiny_model(path: Path, *, model_type: str = "llama", layers: int = 2, hidden: int = 64, intermediate: int = 128,
                    heads: int = 4, kv_heads: int = 2, dtype=torch.bfloat16, seed: int = 0, tie: bool = False,
                    tokenizer: bool = True, shard_bytes: int | None = None, **extra) -> Path:
    """A randomly initialised causal LM saved as a HF directory (safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                               **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger, more varied weights than the default init, so quantization error is visible
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.6, 1.4)
    model = model.to(dtype)
    kw = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(str(path), **kw)
    if tokenizer:
        save_char_tokenizer(path)
    return path


PROGRESS_LINE = re.compile(r"\[qtk (convert|eval) \d+(:\d\d){1,2}\] ")


def bf16_runtime_logits(d: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 logits on fixed ids of the checkpoint d run in bf16 three ways: transformers + compressed-tensors'
    run-time path (activations quantized as it quantizes them), qtk's simulation with activations quantized, and the
    simulation with weights alone (to show the activations are quantized in the first two)."""
    from transformers import AutoModelForCausalLM

    from qtk.export import open_checkpoint
    from qtk.model.simulate import build_simulated_model

    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).eval()
    sim, plain = (build_simulated_model(open_checkpoint(d), simulate_activations=act, simulate_kv=False,
                                        dtype=torch.bfloat16) for act in (True, False))
    with torch.no_grad():
        return tuple(m(ids).logits.float() for m in (ref, sim, plain))


def message_lines(output: str) -> list[str]:
    """What a command said, less its progress lines (one per stage and layer when stderr is not a terminal)."""
    return [line for line in output.strip().splitlines() if line.strip() and not PROGRESS_LINE.match(line)]


def write_calib(path: Path, n: int = 40, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "12+7=19", "reverse", "sort", "key", "value", "the", "model"]
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(60))}) + "\n")
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Peak RSS of a command, measured in a grandchild started by a bare interpreter. On exec the kernel
# folds the old address space's high-water mark into the process's maxrss; a child forked or vforked
# from a big process (a test holding models) would report that process's peak as its own.
_LAUNCH = """import json, os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], dict(os.environ))
_, status, ru = os.wait4(pid, 0)
json.dump({"wall_s": time.perf_counter() - t0, "maxrss_kb": ru.ru_maxrss, "exit": os.waitstatus_to_exitcode(status)},
          open(sys.argv[1], "w"))
"""


def run_measured(args: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `args` (args[0] an executable path); raises with its stderr on failure."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as td:
        res = Path(td) / "rusage.json"
        err = Path(td) / "stderr"
        with open(err, "w") as e:
            subprocess.run([sys.executable, "-S", "-c", _LAUNCH, str(res), *args], stdout=subprocess.DEVNULL, stderr=e, check=True)
        r = json.loads(res.read_text())
        if r["exit"] != 0:
            raise RuntimeError(f"{args[0]} exited {r['exit']}: {err.read_text()[-2000:]}")
    return r["wall_s"], r["maxrss_kb"] * 1024


def _ct_version() -> tuple[int, ...]:
    import importlib.metadata as md

    try:
        return tuple(int(x) for x in md.version("compressed-tensors").split(".")[:2])
    except (md.PackageNotFoundError, ValueError):
        return (0,)


# Tests that hold a transformers + compressed-tensors reload to qtk's float32 decode within 1e-4 need
# compressed-tensors 0.20: the versions vLLM 0.32 pins (transformers 5.19, compressed-tensors 0.17; the engine
# environment, make engine-env) decompress into the checkpoint's bf16. The main environment runs them; the engine
# environment is judged by vLLM itself (tests/engine).
needs_ct_float32_decode = pytest.mark.skipif(
    _ct_version() < (0, 20), reason="compressed-tensors < 0.20 (vLLM 0.32's pin) decompresses into bf16; "
                                    "this 1e-4 comparison runs in the main environment")


def apply_ct_transforms(model, d: Path):
    """A model transformers loaded from checkpoint `d`, with compressed-tensors' own transform code
    (apply_transform_config) hooked on as the config's transform_config says and the stored transform matrices
    loaded into its transform modules: the online rotations decoded by compressed-tensors, not by qtk. The model
    unchanged when the config declares none."""
    import json

    from safetensors import safe_open

    tc = (json.loads((Path(d) / "config.json").read_text()).get("quantization_config") or {}).get("transform_config")
    if not tc:
        return model
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    # the offline locations (weight_input, weight_output) were folded into the stored weights before they were
    # written: as vLLM does, only the online ones are applied to a loaded checkpoint
    groups = {name: {**g, "apply": [a for a in g["apply"] if not a["location"].startswith("weight_")]}
              for name, g in tc["config_groups"].items()}
    apply_transform_config(model, TransformConfig.model_validate({**tc, "config_groups": groups}))
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    if k in names and "_input.weight" in k:
                        model.get_parameter(k).copy_(h.get_tensor(k).to(model.get_parameter(k).dtype))
    return model


def fewer_iterations(recipe: str, tmp_path):
    """The built-in recipe, or for an iterative solver (AutoRound) the same recipe file with 5 iterations a layer:
    every family's path through the step is the same at 5 as at 200 (tests/steps/test_autoround.py holds what the
    iterations learn), at a fortieth of the time."""
    import yaml

    from qtk.recipe import builtin_recipes, load_recipe

    if not any(s.name == "autoround" for s in load_recipe(recipe).algorithm):
        return recipe
    doc = yaml.safe_load(builtin_recipes()[recipe].read_text())
    doc["algorithm"] = [{"autoround": {**(s["autoround"] or {}), "iters": 5}} if isinstance(s, dict) and "autoround" in s
                        else ({"autoround": {"iters": 5}} if s == "autoround" else s) for s in doc["algorithm"]]
    path = tmp_path / f"{recipe}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class ResumeSink:
    """A sink that also speaks the resume protocol (save_layer), so the layer loop hands it what it would save: every
    LayerResult, and after each layer the next layer's inputs, quantized (`hidden`) and, for a step that reads the
    float model's stream, float (`floats`, else None)."""

    completed = 0

    def __init__(self):
        self.results, self.hidden, self.floats = [], [], []

    def add_dense(self, name, t):
        pass

    def add_layer(self, r):
        self.results.append(r)

    def save_layer(self, r, hidden, floats=None):
        self.hidden.append(hidden)
        self.floats.append(floats)

