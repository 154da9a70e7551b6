"""Calibration sources: the shipped corpus, .jsonl/.txt/.parquet files and a local dataset directory all
give deterministic token windows; the same text through different containers gives the same windows."""

import pytest

from qtk.calib import DEFAULT_CORPUS, calibration_ids, load_texts
from qtk.errors import UsageError

TEXTS = [f"sample {i}: " + "the quick brown fox jumps over the lazy dog " * 3 for i in range(30)]


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def test_containers_give_the_same_windows(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from models import write_jsonl

    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    (tmp_path / "c.txt").write_text("\n\n".join(TEXTS))
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    sources = [tmp_path / "c.jsonl", tmp_path / "c.txt", tmp_path / "c.parquet", tmp_path / "ds"]
    windows = [calibration_ids(tok, load_texts(str(s)), 6, 32, seed=3) for s in sources]
    assert [load_texts(str(s)) for s in sources] == [TEXTS] * 4
    for w in windows[1:]:
        assert (w == windows[0]).all()
    assert windows[0].shape == (6, 32) and (windows[0][:, 0] == tok.bos_token_id).all()
    other = calibration_ids(tok, TEXTS, 6, 32, seed=4)
    assert not (other == windows[0]).all()  # the seed matters


def test_text_field_selects_the_column(tmp_path):
    from models import write_jsonl

    write_jsonl(tmp_path / "c.jsonl", [{"body": t, "id": i} for i, t in enumerate(TEXTS)])
    assert load_texts(str(tmp_path / "c.jsonl"), text_field="body") == TEXTS
    with pytest.raises(UsageError, match="--text-field"):
        load_texts(str(tmp_path / "c.jsonl"))


def test_default_corpus_is_shipped_with_provenance():
    assert DEFAULT_CORPUS.is_file(), "calib_data/default.jsonl is shipped"
    texts = load_texts("default")
    assert len(texts) >= 100 and all(isinstance(t, str) and t for t in texts)
    readme = (DEFAULT_CORPUS.parent / "README.md").read_text().lower()
    assert "licen" in readme and "seed" in readme


def test_indexed_files_read_like_whole_files(tmp_path, monkeypatch):
    """.txt and .jsonl files are indexed block by block and read back on demand; whatever the block boundaries,
    the texts are exactly those of reading the whole file (str.split on blank lines after universal newlines;
    one JSON row per line), and long texts come back in pieces that join to the text."""
    import json
    import random

    import qtk.calib as calib

    rng = random.Random(0)
    alphabet = ["a", "b", " ", "\n", "\r", "\r\n", "é", "\u3000", "\t", "\u2028"]
    for trial in range(400):
        monkeypatch.setattr(calib, "_BLOCK", rng.choice([1, 2, 3, 5, 64]))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        p = tmp_path / "c.txt"
        p.write_bytes(text.encode())
        want = [t for t in p.read_text(encoding="utf-8").split("\n\n") if t.strip()]
        got = calib.TextFile(p)
        assert got == want and len(got) == len(want), repr(text)
        assert all("".join(calib._pieces(got, i, 4)) == want[i] for i in range(len(want)))
        assert [list(calib._pieces(got, i, 4)) for i in range(len(got))] == [list(calib._pieces(want, i, 4)) for i in range(len(want))]
        rows = [{"text": t} for t in want] + [{"text": " "}]
        q = tmp_path / "c.jsonl"
        q.write_text("".join(json.dumps(r, ensure_ascii=rng.random() < 0.5) + rng.choice(["\n", "\r\n", "\n\n"]) for r in rows))
        assert calib.TextFile(q) == want
