"""Baseline cache: a baseline's results per task, keyed by model hash + task hash + engine settings, so a second
gate run against the same baseline evaluates only the candidate.

Layout: <root>/baseline/<key>/result.json (+ reference.safetensors, the top-k log-probs behind the agreement
metrics), written to a temporary directory and renamed, so a reader never sees half an entry. File content
hashes are memoised by (path, size, mtime) in <root>/file-hashes.json, so a large baseline is hashed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    env = os.environ.get("QTK_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "qtk" / "eval"


def _file_sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def model_files(path: Path) -> list[Path]:
    """What defines a baseline model: its config and weights (the tokenizer is covered by the task hash,
    which hashes the token ids)."""
    files = [path / "config.json"] + sorted(path.glob("*.safetensors"))
    return [f for f in files if f.is_file()]


def file_digests(path: str | Path, root: Path | None = None) -> dict[str, str]:
    """{file name: sha256} of config.json and the safetensors files, memoised by (path, size, mtime) under root."""
    path = Path(path).resolve()
    memo_file = root / "file-hashes.json" if root else None
    memo: dict = {}
    if memo_file and memo_file.is_file():
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, json.JSONDecodeError):
            memo = {}
    out, changed = {}, False
    for f in model_files(path):
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        entry = memo.get(str(f))
        if entry and entry[:2] == stamp:
            out[f.name] = entry[2]
        else:
            out[f.name] = _file_sha256(f)
            memo[str(f)] = [*stamp, out[f.name]]
            changed = True
    if memo_file and changed:
        try:
            _atomic_write(memo_file, json.dumps(memo))
        except OSError:
            pass  # the memo is an optimisation only
    return out


def model_hash(digests: dict[str, str]) -> str:
    """sha256 over the names and content hashes of a model's config.json and safetensors files."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name].encode() + b"\n")
    return h.hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def entry_key(model: str, task: dict, requests_digest: str, settings: dict) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "model": model, "task": task, "requests": requests_digest, "engine": settings},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class BaselineCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root else default_cache_dir()

    def _dir(self, key: str) -> Path:
        return self.root / "baseline" / key

    def load(self, key: str) -> tuple[dict, dict] | None:
        """(result json, reference tensors) or None on a miss or an unreadable entry."""
        d = self._dir(key)
        try:
            result = json.loads((d / "result.json").read_text())
            ref = {}
            if (d / "reference.safetensors").is_file():
                from safetensors.torch import load_file

                ref = load_file(str(d / "reference.safetensors"))
        except (OSError, json.JSONDecodeError, ValueError, RuntimeError):
            return None
        return result, ref

    def store(self, key: str, result: dict, tensors: dict | None = None) -> None:
        final = self._dir(key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{key}."))
            (tmp / "result.json").write_text(json.dumps(result))
            if tensors:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "reference.safetensors"))
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError:  # an unwritable cache makes the next run slower, not wrong
            if "tmp" in locals():
                shutil.rmtree(tmp, ignore_errors=True)
