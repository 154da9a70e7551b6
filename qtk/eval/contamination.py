"""Contamination check: evaluation examples must not appear in the data the checkpoint was calibrated on.

Texts are normalised to lower-case word tokens (punctuation and spacing ignored), so "Q: 347+58= 405" and
"q 347 58 405" are the same example. An example overlaps when
  - it has fewer than N tokens and occurs whole, as a contiguous token run, inside one calibration text, or
  - it has N tokens or more and at least `threshold` of its N-grams are among the calibration texts' N-grams
    (hashed), which catches copies with a changed prefix or suffix without flagging shared phrases.
The calibration texts are read as the conversion read them: the manifest's calibration.dataset, through
qtk.calib.load_texts ('default' is qtk/data/calib/default.jsonl).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qtk.errors import UsageError

NGRAM = 13
THRESHOLD = 0.5
_WORD = re.compile(r"\w+")


def normalise(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _h(tokens) -> bytes:
    return hashlib.blake2b(" ".join(tokens).encode(), digest_size=8).digest()


class CalibrationIndex:
    """N-gram hashes and a searchable normalised copy of the calibration texts."""

    def __init__(self, texts: list[str], n: int = NGRAM):
        self.n = n
        self.ngrams: set[bytes] = set()
        streams = []
        for t in texts:
            toks = normalise(t)
            streams.append(" ".join(toks))
            for i in range(len(toks) - n + 1):
                self.ngrams.add(_h(toks[i: i + n]))
        # texts separated by a newline, which no normalised token contains: matches never span two texts
        self.corpus = " " + " \n ".join(streams) + " "

    def overlap(self, text: str, threshold: float = THRESHOLD) -> bool:
        toks = normalise(text)
        if not toks:
            return False
        if len(toks) < self.n:
            return f" {' '.join(toks)} " in self.corpus
        grams = [_h(toks[i: i + self.n]) for i in range(len(toks) - self.n + 1)]
        return sum(g in self.ngrams for g in grams) / len(grams) >= threshold


@dataclass
class ContaminationResult:
    status: str  # clean | overlap | skipped (no calibration data) | unchecked (calibration data unreadable)
    dataset: str | None = None
    calibration_texts: int = 0
    tasks: dict = field(default_factory=dict)  # task -> {examples, overlapping, first: [indices]}
    message: str = ""

    @property
    def overlapping(self) -> int:
        return sum(t["overlapping"] for t in self.tasks.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "overlapping": self.overlapping}


def _cache_key(spec: str, text_field: str, prepared: list, n: int, threshold: float) -> str | None:
    """A key for a local calibration file's result (its content hash and the examples), else None: remote datasets
    are not cached, since their content can change under the same id."""
    from qtk.calib import DEFAULT_CORPUS

    path = DEFAULT_CORPUS if spec in ("default", "") else Path(spec)
    if not path.is_file():
        return None
    examples = [[t.spec.name, [t.full_text(ex) for ex in t.examples]] for t in prepared]
    blob = json.dumps([1, hashlib.sha256(path.read_bytes()).hexdigest(), text_field, n, threshold, examples])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def check(manifest: dict | None, prepared: list, *, n: int = NGRAM, threshold: float = THRESHOLD,
          text_field: str = "text", cache_dir: Path | None = None) -> ContaminationResult:
    """Compare the checkpoint's calibration texts with every evaluated example (few-shot prefixes excluded).
    With cache_dir, the result for a local calibration file is kept under cache_dir/contamination/."""
    from qtk.calib import load_texts, turns_text

    calib = (manifest or {}).get("calibration") or {}
    if manifest is None:
        return ContaminationResult("unchecked", message="the checkpoint has no qtk.json manifest: its calibration data is unknown")
    if not calib.get("used"):
        return ContaminationResult("skipped", message="the checkpoint was converted without calibration data")
    spec = calib.get("dataset") or "default"
    field_ = calib.get("text_field") or text_field
    key = _cache_key(spec, field_, prepared, n, threshold) if cache_dir else None
    entry = Path(cache_dir) / "contamination" / f"{key}.json" if key else None
    if entry is not None and entry.is_file():
        try:
            return ContaminationResult(**json.loads(entry.read_text()))
        except (OSError, ValueError, TypeError):
            pass
    # the split it was converted from; a conversation's words without the model's chat template
    read = functools.partial(load_texts, split=calib.get("split"), chat=turns_text)
    result = _check(spec, field_, prepared, n, threshold, read)
    if entry is not None and result.status in ("clean", "overlap"):
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(result)))
            os.replace(tmp, entry)
        except OSError:
            pass  # a cache that cannot be written only costs time
    return result


def _check(spec: str, text_field: str, prepared: list, n: int, threshold: float, load_texts) -> ContaminationResult:
    try:
        texts = load_texts(spec, text_field)
    except UsageError as e:
        return ContaminationResult("unchecked", spec, message=f"cannot read the calibration data to compare: {e.problem}")
    index = CalibrationIndex(texts, n)
    per_task = {}
    for t in prepared:
        hits = [i for i, ex in enumerate(t.examples) if index.overlap(t.full_text(ex), threshold)]
        per_task[t.spec.name] = {"examples": len(t.examples), "overlapping": len(hits), "first": hits[:10]}
    total = sum(v["overlapping"] for v in per_task.values())
    if total:
        worst = ", ".join(f"{k}: {v['overlapping']}/{v['examples']}" for k, v in per_task.items() if v["overlapping"])
        return ContaminationResult("overlap", spec, len(texts), per_task,
                                   f"{total} evaluation example(s) also occur in the calibration data ({worst})")
    return ContaminationResult("clean", spec, len(texts), per_task, "no evaluation example occurs in the calibration data")
