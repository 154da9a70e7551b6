"""Calibration data: texts from the shipped corpus, a local file or dataset directory, or a Hugging Face
dataset id, cut into deterministic token windows [num_samples, seq_len]."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Callable

from qtk.errors import UsageError

log = logging.getLogger(__name__)

# chat=: renders one conversation (a list of {"role", "content"} turns) as text; `where` names it in errors
ChatRenderer = Callable[[list, str], str]

# package data (qtk/data/calib), so a wheel install has it too
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "calib" / "default.jsonl"


def _field(rows, field: str, origin: str, chat: ChatRenderer | None = None) -> list[str]:
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or field not in row:
            keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise UsageError(f"{origin}: row {i} has no '{field}' field (it has: {keys})", "pass --text-field NAME")
        v = row[field]
        if isinstance(v, list) and chat is not None:
            v = chat(v, f"{origin}: row {i} field '{field}'")
        if not isinstance(v, str):
            raise UsageError(f"{origin}: row {i} field '{field}' is {type(v).__name__}, not text", "pass --text-field naming a text column")
        if v.strip():
            out.append(v)
    return out


def load_texts(spec: str, text_field: str = "text", split: str | None = None, chat: ChatRenderer | None = None) -> list[str]:
    """Texts from: 'default' (qtk/data/calib/default.jsonl), *.jsonl, *.txt, *.parquet, a local dataset
    directory (datasets.save_to_disk or a folder of data files), or a Hugging Face dataset id ('id' or 'id:config').

    split: of a dataset directory or id (default: 'train', or its only split). chat: renders a field that holds
    a conversation (a list of chat turns, e.g. 'messages') as text; without it such a field is refused."""
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
        texts = _field(rows, text_field, p.name, chat)
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
            turns = chat is not None and (pa.types.is_list(kind) or pa.types.is_large_list(kind))
            if not (turns or pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
                raise UsageError(f"{p.name}: column '{text_field}' holds {kind}, not text", "pass --text-field naming a text column")
            column = pq.read_table(p, columns=[text_field]).column(text_field)
        except (pa.ArrowException, OSError) as e:
            raise UsageError(f"{p.name} is not a readable parquet file ({' '.join(str(e).split())[:200]})",
                             "re-export it, or give a .jsonl file with a 'text' field") from None
        values = column.to_pylist()
        if turns:
            values = [chat(v, f"{p.name}: row {i} column '{text_field}'") if isinstance(v, list) else v for i, v in enumerate(values)]
        texts = [t for t in values if isinstance(t, str) and t.strip()]
    else:
        texts = _load_dataset(spec, text_field, split, chat)
    if not texts:
        raise UsageError(f"calibration data {spec} holds no text", "give a file or dataset with non-empty text")
    return texts


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{p.name} is not UTF-8 text (byte {e.start})", "re-save the file as UTF-8") from None


def _load_dataset(spec: str, text_field: str, split: str | None, chat: ChatRenderer | None = None) -> list[str]:
    import datasets

    p = Path(spec)
    try:
        if p.is_dir() and any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[pick_split(spec, list(ds), split)]
            elif split is not None:
                raise UsageError(f"calibration dataset '{spec}' was saved as a single split, not a set of splits",
                                 "drop --split for it")
        else:
            # a folder of data files (splits from the file names) and a hub id load the same way
            name, config = (str(p), None) if p.is_dir() else (spec.partition(":")[0], spec.partition(":")[2] or None)
            chosen = pick_split(spec, datasets.get_dataset_split_names(name, config), split)
            ds = datasets.load_dataset(name, config, split=chosen)
    except UsageError:
        raise
    except FileNotFoundError as e:
        raise UsageError(f"calibration dataset '{spec}' not found ({e})", "give a local file, a dataset directory, or a valid dataset id (needs network)") from None
    except Exception as e:  # datasets raises many types for unreachable hubs and bad ids
        raise UsageError(f"cannot load calibration dataset '{spec}' ({e.__class__.__name__}: {str(e).splitlines()[0][:200]})",
                         "check the id and network, or pass a local .jsonl/.parquet file") from None
    if text_field not in ds.column_names:
        raise UsageError(f"dataset '{spec}' has no column '{text_field}' (it has: {', '.join(ds.column_names)})", "pass --text-field NAME")
    values = ds[text_field]
    if chat is not None:
        values = [chat(v, f"dataset '{spec}': row {i} column '{text_field}'") if isinstance(v, list) else v for i, v in enumerate(values)]
    return [t for t in values if isinstance(t, str) and t.strip()]


def pick_split(spec: str, names: list[str], split: str | None) -> str:
    """The split to calibrate on: the one asked for, else 'train', else the only one; never a silent guess."""
    if split is not None:
        if split not in names:
            raise UsageError(f"calibration dataset '{spec}' has no split '{split}' (it has: {', '.join(names)})",
                             "pass --split with one of those")
        return split
    if "train" in names:
        return "train"
    if len(names) == 1:
        return names[0]
    raise UsageError(f"calibration dataset '{spec}' has splits {', '.join(names)} and none is called 'train'",
                     "choose one with --split NAME")


class ChatTemplate:
    """Renders a conversation with the model's own chat template, the text the model sees when served for chat.
    The tokenizer is loaded on first use; `conversations` counts what was rendered (for the manifest)."""

    def __init__(self, load_tokenizer: Callable):
        self._load = load_tokenizer
        self._tokenizer = None
        self.conversations = 0
        self.template_sha256: str | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return self._tokenizer

    def __call__(self, turns: list, where: str) -> str:
        if not turns or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in turns):
            raise UsageError(f"{where} is a list but not a conversation (a list of {{'role': ..., 'content': ...}} turns)",
                             "pass --text-field naming a text field or a list of chat turns")
        tok = self.tokenizer
        template = getattr(tok, "chat_template", None)
        if not template:
            raise UsageError(f"{where} holds chat turns, but the model's tokenizer has no chat template to render them",
                             "calibrate on a plain text field (--text-field NAME), or add the model's chat template to its directory")
        try:
            text = tok.apply_chat_template(turns, tokenize=False)
        except Exception as e:  # jinja2 TemplateError and friends: the template's own checks (e.g. alternating roles)
            raise UsageError(f"{where}: the model's chat template rejects this conversation ({' '.join(str(e).split())[:200]})",
                             "fix the conversation, or calibrate on a plain text field") from None
        self.conversations += 1
        self.template_sha256 = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
        return text


def turns_text(turns: list, where: str = "") -> str:
    """A conversation's contents, one turn per line: its words without a chat template (for overlap checks)."""
    return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in turns)


def _token_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one text. verbose=False silences transformers' "Token indices sequence length is longer than
    the specified maximum sequence length" warning, which is harmless here: texts are joined and cut into windows of
    seq_len tokens, and seq_len is checked against max_position_embeddings."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


OVERLAP_WARN = 2.0  # requested tokens / tokens in the text at which the windows are said to overlap heavily


def warn_if_windows_overlap(available: int, num_samples: int, seq_len: int) -> float:
    """Warn when the windows ask for far more tokens than the text holds: drawn at random offsets, they then
    repeat the same tokens, and the statistics rest on less data than the numbers suggest. Returns the ratio."""
    need = num_samples * seq_len
    ratio = need / max(available, 1)
    if ratio >= OVERLAP_WARN:
        log.warning("calibration windows overlap heavily: %d × %d = %s tokens are drawn from %s tokens of text, so each "
                    "token lands in about %.0f windows; give more text (--calib) or lower --num-samples/--seq-len",
                    num_samples, seq_len, f"{need:,}", f"{available:,}", ratio)
    return ratio


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
        ids.extend(_token_ids(tokenizer, texts[i]))
        if sep is not None:
            ids.append(sep)
        if len(ids) >= 2 * need:
            break
    if len(ids) < seq_len:
        raise UsageError(f"calibration data has {len(ids)} tokens, fewer than one window of --seq-len {seq_len}",
                         "give more text or lower --seq-len")
    warn_if_windows_overlap(len(ids), num_samples, seq_len)
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
