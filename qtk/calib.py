"""Calibration data: texts from the shipped corpus, a local file or dataset directory, or a Hugging Face
dataset id, cut into deterministic token windows [num_samples, seq_len]."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from qtk.errors import UsageError

# package data (qtk/data/calib), so a wheel install has it too
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "calib" / "default.jsonl"


def _field(rows, field: str, origin: str) -> list[str]:
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or field not in row:
            keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise UsageError(f"{origin}: row {i} has no '{field}' field (it has: {keys})", "pass --text-field NAME")
        v = row[field]
        if not isinstance(v, str):
            raise UsageError(f"{origin}: row {i} field '{field}' is {type(v).__name__}, not text", "pass --text-field naming a text column")
        if v.strip():
            out.append(v)
    return out


def load_texts(spec: str, text_field: str = "text", split: str = "train") -> list[str]:
    """Texts from: 'default' (qtk/data/calib/default.jsonl), *.jsonl, *.txt, *.parquet, a local dataset
    directory (datasets.save_to_disk or a folder of data files), or a Hugging Face dataset id ('id' or 'id:config')."""
    if spec in ("default", "", None):
        spec = str(DEFAULT_CORPUS)
    p = Path(spec)
    if p.suffix == ".jsonl":
        if not p.is_file():
            raise UsageError(f"calibration file {p} does not exist", "give an existing .jsonl/.txt/.parquet file or a dataset id")
        rows = []
        for n, line in enumerate(_read_text(p).splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise UsageError(f"{p.name}: line {n} is not valid JSON", "write one JSON object per line") from None
        texts = _field(rows, text_field, p.name)
    elif p.suffix == ".txt":
        if not p.is_file():
            raise UsageError(f"calibration file {p} does not exist", "give an existing .jsonl/.txt/.parquet file or a dataset id")
        texts = [t for t in _read_text(p).split("\n\n") if t.strip()]
    elif p.suffix == ".parquet":
        if not p.is_file():
            raise UsageError(f"calibration file {p} does not exist", "give an existing .jsonl/.txt/.parquet file or a dataset id")
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(p)
            if text_field not in schema.names:
                raise UsageError(f"{p.name} has no column '{text_field}' (it has: {', '.join(schema.names)})", "pass --text-field NAME")
            kind = schema.field(text_field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
                raise UsageError(f"{p.name}: column '{text_field}' holds {kind}, not text", "pass --text-field naming a text column")
            column = pq.read_table(p, columns=[text_field]).column(text_field)
        except (pa.ArrowException, OSError) as e:
            raise UsageError(f"{p.name} is not a readable parquet file ({' '.join(str(e).split())[:200]})",
                             "re-export it, or give a .jsonl file with a 'text' field") from None
        texts = [t for t in column.to_pylist() if isinstance(t, str) and t.strip()]
    else:
        texts = _load_dataset(spec, text_field, split)
    if not texts:
        raise UsageError(f"calibration data {spec} holds no text", "give a file or dataset with non-empty text")
    return texts


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{p.name} is not UTF-8 text (byte {e.start})", "re-save the file as UTF-8") from None


def _load_dataset(spec: str, text_field: str, split: str) -> list[str]:
    import datasets

    p = Path(spec)
    try:
        if p.is_dir():
            if (p / "dataset_info.json").is_file() or (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
                ds = datasets.load_from_disk(str(p))
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds[split] if split in ds else next(iter(ds.values()))
            else:
                ds = datasets.load_dataset(str(p), split=split)
        else:
            name, _, config = spec.partition(":")
            ds = datasets.load_dataset(name, config or None, split=split)
    except FileNotFoundError as e:
        raise UsageError(f"calibration dataset '{spec}' not found ({e})", "give a local file, a dataset directory, or a valid dataset id (needs network)") from None
    except Exception as e:  # datasets raises many types for unreachable hubs and bad ids
        raise UsageError(f"cannot load calibration dataset '{spec}' ({e.__class__.__name__}: {str(e).splitlines()[0][:200]})",
                         "check the id and network, or pass a local .jsonl/.parquet file") from None
    if text_field not in ds.column_names:
        raise UsageError(f"dataset '{spec}' has no column '{text_field}' (it has: {', '.join(ds.column_names)})", "pass --text-field NAME")
    return [t for t in ds[text_field] if isinstance(t, str) and t.strip()]


def calibration_ids(tokenizer, texts: list[str], num_samples: int, seq_len: int, seed: int):
    """[num_samples, seq_len] token windows drawn at seeded random offsets from the shuffled, joined corpus."""
    import torch

    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    need = num_samples * seq_len
    ids: list[int] = []
    sep = tokenizer.eos_token_id
    for i in order:
        ids.extend(tokenizer(texts[i], add_special_tokens=False)["input_ids"])
        if sep is not None:
            ids.append(sep)
        if len(ids) >= 2 * need:
            break
    if len(ids) < seq_len:
        raise UsageError(f"calibration data has {len(ids)} tokens, fewer than one window of --seq-len {seq_len}",
                         "give more text or lower --seq-len")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len + 1, (num_samples,), generator=g)
    t = torch.tensor(ids, dtype=torch.long)
    windows = torch.stack([t[s: s + seq_len] for s in starts.tolist()])
    bos = tokenizer.bos_token_id
    if bos is not None:  # the model always sees BOS first, as in inference
        windows[:, 0] = bos
    return windows


def ids_hash(ids) -> str:
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
