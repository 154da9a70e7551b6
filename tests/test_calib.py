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
    assert DEFAULT_CORPUS.is_file(), "qtk/data/calib/default.jsonl is shipped"
    texts = load_texts("default")
    assert len(texts) >= 100 and all(isinstance(t, str) and t for t in texts)
    readme = (DEFAULT_CORPUS.parent / "README.md").read_text().lower()
    assert "licen" in readme and "seed" in readme


# ---- long texts, overlapping windows, chat turns, splits ----

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
CHATS = [[{"role": "user", "content": f"what is {i} + {i}?"}, {"role": "assistant", "content": f"{i} + {i} = {2 * i}. " * 4}]
         for i in range(30)]


@pytest.fixture
def chat_tok(tiny_llama):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_llama))
    t.chat_template = CHAT_TEMPLATE
    return t


def test_long_texts_do_not_warn_about_the_model_length(tok, monkeypatch):
    """transformers warns "Token indices sequence length is longer than ..." for a text longer than the model's
    context; calibration cuts texts into windows, so the warning is noise there."""
    import logging

    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(tok, "model_max_length", 16)
    tok.deprecation_warnings.pop("sequence-length-is-longer-than-the-specified-maximum", None)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = hf_logging.get_logger("transformers.tokenization_utils_base")
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        calibration_ids(tok, TEXTS, 4, 12, seed=0)
    finally:
        logger.removeHandler(handler)
        hf_logging.set_verbosity(before)
    assert not [r for r in records if "sequence length is longer" in r.getMessage()]


def test_heavily_overlapping_windows_warn(tok, caplog):
    texts = [f"row {i}: a few words" for i in range(40)]  # about 800 tokens
    with caplog.at_level("WARNING", logger="qtk.calib"):
        calibration_ids(tok, texts, 200, 64, seed=0)
    (rec,) = [r for r in caplog.records if "overlap heavily" in r.getMessage()]
    assert "200 × 64 = 12,800 tokens are drawn from" in rec.getMessage() and "--num-samples" in rec.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="qtk.calib"):
        calibration_ids(tok, texts, 4, 64, seed=0)
    assert not caplog.records


def test_chat_turns_get_the_models_chat_template(tmp_path, chat_tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from models import write_jsonl
    from qtk.calib import ChatTemplate

    write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"messages": CHATS}).save_to_disk(str(tmp_path / "ds"))
    want = [chat_tok.apply_chat_template(m, tokenize=False) for m in CHATS]
    assert want[0].startswith("<user> what is 0 + 0?\n<assistant> 0 + 0 = 0.")
    for src in ("c.jsonl", "c.parquet", "ds"):
        chat = ChatTemplate(lambda: chat_tok)
        assert load_texts(str(tmp_path / src), "messages", chat=chat) == want, src
        assert chat.conversations == len(CHATS) and chat.template_sha256
    with pytest.raises(UsageError, match="field 'messages' is list, not text"):
        load_texts(str(tmp_path / "c.jsonl"), "messages")  # no renderer: refused, never stringified


def test_chat_turns_refused_without_a_template_or_when_malformed(tmp_path, tok, chat_tok):
    from models import write_jsonl
    from qtk.calib import ChatTemplate

    write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    with pytest.raises(UsageError, match="has no chat template") as e:
        load_texts(str(tmp_path / "c.jsonl"), "messages", chat=ChatTemplate(lambda: tok))
    assert "--text-field" in e.value.fix
    write_jsonl(tmp_path / "bad.jsonl", [{"messages": ["hello", "there"]}])
    with pytest.raises(UsageError, match=r"row 0 field 'messages' is a list but not a conversation"):
        load_texts(str(tmp_path / "bad.jsonl"), "messages", chat=ChatTemplate(lambda: chat_tok))


def test_split_of_a_saved_dataset_dict(tmp_path):
    import datasets

    d = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:10]}),
                              "test": datasets.Dataset.from_dict({"text": TEXTS[10:15]})})
    d.save_to_disk(str(tmp_path / "dd"))
    assert load_texts(str(tmp_path / "dd")) == TEXTS[:10]  # train by default
    assert load_texts(str(tmp_path / "dd"), split="test") == TEXTS[10:15]
    with pytest.raises(UsageError, match=r"has no split 'dev' \(it has: train, test\)"):
        load_texts(str(tmp_path / "dd"), split="dev")
    datasets.DatasetDict({"a": d["train"], "b": d["test"]}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(UsageError, match="has splits a, b and none is called 'train'") as e:
        load_texts(str(tmp_path / "ab"))
    assert "--split" in e.value.fix


def test_split_of_a_folder_of_data_files(tmp_path):
    """The code path hub ids take too (split names, then load_dataset(name, config, split=...)), run on local files."""
    from models import write_jsonl

    d = tmp_path / "files"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"text": t} for t in TEXTS[:10]])
    write_jsonl(d / "validation.jsonl", [{"text": t} for t in TEXTS[10:13]])
    assert load_texts(str(d)) == TEXTS[:10]
    assert load_texts(str(d), split="validation") == TEXTS[10:13]
    with pytest.raises(UsageError, match="has no split 'test'"):
        load_texts(str(d), split="test")


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
