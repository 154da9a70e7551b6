"""Calibration data: texts from the shipped corpus, a local file or dataset directory, or a Hugging Face
dataset id, cut into deterministic token windows [num_samples, seq_len].

.jsonl and .txt files are indexed, not loaded: a text is read from disk when the sampler reaches it, and a long
one is tokenized piece by piece only as far as the windows need, so a file of any size (one 100 MB line
included) costs memory for what is sampled, not for what is there.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import random
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Iterator

from qtk.bounds import BudgetExceeded, ChatTemplateRenderer, bounded_lines, parse_json
from qtk.errors import UsageError

log = logging.getLogger(__name__)

# chat=: a ChatTemplate, which renders one conversation (a list of {"role", "content"} turns) as text and checks
# one without rendering it (.check); `where` names it in errors
ChatRenderer = Callable[[list, str], str]

# package data (qtk/data/calib), so a wheel install has it too
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "calib" / "default.jsonl"
MAX_ROW_BYTES = 16 * 2**20  # a .jsonl row is parsed whole; no calibration needs a single row larger than this
PIECE_CHARS = 100_000  # texts longer than this are tokenized in pieces (a tokenizer holds ~400 bytes per token)
_BLOCK = 1 << 20  # characters per read while indexing a .txt file


def _row_text(row, i: int, field: str, origin: str, chat: ChatRenderer | None = None, render: bool = True) -> str:
    """The text of row i; a field holding chat turns is rendered by `chat` (a ChatTemplate). render=False (while
    indexing): the conversation is only checked; it is rendered when the sampler reads the row."""
    if not isinstance(row, dict) or field not in row:
        keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
        raise UsageError(f"{origin}: row {i} has no '{field}' field (it has: {keys})", "pass --text-field NAME")
    v = row[field]
    if isinstance(v, list) and chat is not None:
        if not render:  # indexing: refuse what cannot be rendered now; render when the sampler reads the row
            chat.check(v, f"{origin}: row {i} field '{field}'")
            return "turns"
        v = chat(v, f"{origin}: row {i} field '{field}'")
    if not isinstance(v, str):
        raise UsageError(f"{origin}: row {i} field '{field}' is {type(v).__name__}, not text", "pass --text-field naming a text column")
    return v


def _not_utf8(p: Path, at: int) -> UsageError:
    return UsageError(f"{p.name} is not UTF-8 text (byte {at})", "re-save the file as UTF-8")


class TextFile(Sequence):
    """The non-blank texts of a .jsonl file (one JSON object per line, `field` holding the text) or a .txt file
    (texts separated by blank lines), indexed by position once and read back from disk on demand."""

    def __init__(self, path: Path, field: str = "text", chat: ChatRenderer | None = None):
        self.path, self.field, self.chat = Path(path), field, chat
        self._starts, self._ends = array("q"), array("q")  # bytes (.jsonl) or characters (.txt) of each text
        self._blocks, self._cookies = array("q"), []  # .txt: character offset and seek cookie of each read block
        if self.path.suffix == ".jsonl":
            self._index_jsonl()
        else:
            self._index_txt()

    def _index_jsonl(self) -> None:
        rows = 0
        def too_long(n):
            return UsageError(f"{self.path.name}: line {n} is longer than {MAX_ROW_BYTES // 2**20} MiB",
                              "split long texts into several rows")

        with open(self.path, "rb") as f:
            for offset, n, line in bounded_lines(f, MAX_ROW_BYTES, too_long):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _not_utf8(self.path, offset + e.start) from None
                if text.strip():
                    try:
                        row = parse_json(text)
                    except ValueError as e:  # a JSONDecodeError, nesting past the parser's stack, a 5000-digit number
                        why = "" if isinstance(e, json.JSONDecodeError) else f" ({e})"
                        raise UsageError(f"{self.path.name}: line {n} is not valid JSON{why}", "write one JSON object per line") from None
                    if _row_text(row, rows, self.field, self.path.name, self.chat, render=False).strip():
                        self._starts.append(offset)
                        self._ends.append(offset + len(line))
                    rows += 1

    def _index_txt(self) -> None:
        """Texts are what str.split("\n\n") gives on the file read with universal newlines; found block by block."""
        sep = "\n\n"
        try:
            with open(self.path, encoding="utf-8") as f:
                base, buf, start, blank = 0, "", 0, True  # base: character offset of buf[0]
                while True:
                    self._blocks.append(base + len(buf))
                    self._cookies.append(f.tell())
                    block = f.read(_BLOCK)
                    if not block:
                        break
                    buf += block
                    i = 0
                    while (k := buf.find(sep, i)) != -1:
                        self._add(start, base + k, blank and not buf[i:k].strip())
                        start, blank, i = base + k + len(sep), True, k + len(sep)
                    keep = max(i, len(buf) - len(sep) + 1)  # a separator may straddle two blocks
                    blank = blank and not buf[i:keep].strip()
                    base, buf = base + keep, buf[keep:]
                self._add(start, base + len(buf), blank and not buf.strip())
        except UnicodeDecodeError:
            raise _not_utf8(self.path, _first_bad_byte(self.path)) from None

    def _add(self, start: int, end: int, blank: bool) -> None:
        if not blank:
            self._starts.append(start)
            self._ends.append(end)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return "".join(self.pieces(i, _BLOCK))

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, TextFile)) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def pieces(self, i: int, size: int) -> Iterator[str]:
        """Text i in consecutive pieces of at most `size` characters, read from disk as they are asked for."""
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        start, end = self._starts[i], self._ends[i]
        if self.path.suffix == ".jsonl":
            with open(self.path, "rb") as f:
                f.seek(start)
                text = _row_text(parse_json(f.read(end - start)), i, self.field, self.path.name, self.chat)
            for k in range(0, len(text), size):
                yield text[k: k + size]
            return
        b = bisect.bisect_right(self._blocks, start) - 1
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._cookies[b])
            skip = start - self._blocks[b]
            while skip > 0:
                skip -= len(f.read(min(skip, _BLOCK)))
            left = end - start
            while left > 0 and (piece := f.read(min(left, size))):
                left -= len(piece)
                yield piece


def _first_bad_byte(p: Path) -> int:
    import codecs

    dec, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(p, "rb") as f:
        while block := f.read(_BLOCK):
            pending = len(dec.getstate()[0])
            try:
                dec.decode(block)
            except UnicodeDecodeError as e:
                return offset - pending + e.start
            offset += len(block)
    return offset


def load_texts(spec: str, text_field: str = "text", split: str | None = None, chat: ChatRenderer | None = None) -> list[str]:
    """Texts from: 'default' (qtk/data/calib/default.jsonl), *.jsonl, *.txt, *.parquet, a local dataset
    directory (datasets.save_to_disk or a folder of data files), or a Hugging Face dataset id ('id' or 'id:config').

    split: of a dataset directory or id (default: 'train', or its only split). chat: renders a field that holds
    a conversation (a list of chat turns, e.g. 'messages') as text; without it such a field is refused."""
    if spec in ("default", "", None):
        spec = str(DEFAULT_CORPUS)
    p = Path(spec)
    if p.suffix in (".jsonl", ".txt"):
        if not p.is_file():
            raise UsageError(f"calibration file {p} does not exist", "give an existing .jsonl/.txt/.parquet file or a dataset id")
        texts = TextFile(p, text_field, chat)
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
    """Renders a conversation with the model's own chat template, the text the model sees when served for chat
    (transformers' apply_chat_template, reproduced by qtk.bounds.ChatTemplateRenderer in the same sandbox under a
    budget of steps and characters: a template is code from the model's publisher). The tokenizer is loaded on first
    use; `conversations` counts what was rendered (for the manifest)."""

    def __init__(self, load_tokenizer: Callable):
        self._load = load_tokenizer
        self._tokenizer = None
        self._renderers: dict[str, ChatTemplateRenderer] = {}
        self.conversations = 0
        self.template_sha256: str | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return self._tokenizer

    def check(self, turns: list, where: str) -> str:
        """Refuse what cannot be rendered (not a conversation, no chat template); returns the template."""
        if not turns or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in turns):
            raise UsageError(f"{where} is a list but not a conversation (a list of {{'role': ..., 'content': ...}} turns)",
                             "pass --text-field naming a text field or a list of chat turns")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise UsageError(f"{where} holds chat turns, but the model's tokenizer has no chat template to render them",
                             "calibrate on a plain text field (--text-field NAME), or add the model's chat template to its directory")
        return template

    def __call__(self, turns: list, where: str) -> str:
        template = self.check(turns, where)
        tok = self.tokenizer
        try:
            source = tok.get_chat_template()  # the one apply_chat_template would use (of several: 'default')
            renderer = self._renderers.get(source)
            if renderer is None:
                renderer = self._renderers[source] = ChatTemplateRenderer(source)
            text = renderer.render(turns, dict(tok.special_tokens_map))
        except BudgetExceeded as e:
            raise UsageError(f"{where}: the model's chat template is refused: {e}",
                             "fix the chat template (the loops, repetitions and sizes it builds), or calibrate on a "
                             "plain text field") from None
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


def _pieces(texts, i: int, size: int) -> Iterator[str]:
    """Text i in pieces of at most `size` characters, cut after a space or newline where one is near the end
    (a cut inside a word would tokenize differently); a text of at most `size` characters is one piece."""
    raw = texts.pieces(i, size) if isinstance(texts, TextFile) else (texts[i][k: k + size] for k in range(0, len(texts[i]), size))
    buf = ""
    for piece in raw:
        buf += piece
        while len(buf) > size:
            cut = max(buf.rfind(" ", size // 2, size), buf.rfind("\n", size // 2, size)) + 1 or size
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def calibration_ids(tokenizer, texts: Sequence[str], num_samples: int, seq_len: int, seed: int):
    """[num_samples, seq_len] token windows drawn at seeded random offsets from the shuffled, joined corpus.
    Texts are tokenized in the shuffled order until there are twice the tokens the windows need; a long text only
    as far as that (in pieces of PIECE_CHARS)."""
    import torch

    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    need = num_samples * seq_len
    ids: list[int] = []
    sep = tokenizer.eos_token_id
    for i in order:
        for piece in _pieces(texts, i, PIECE_CHARS):
            ids.extend(_token_ids(tokenizer, piece))
            if len(ids) >= 2 * need:
                break
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
