"""Shipped data: held-out tasks (examples/tasks) and calibration text (qtk/data/calib/default.jsonl).

The evaluation sets must be disjoint from what the example model was trained on and from the
calibration set, and their references must be right; the calibration set must be exactly what
examples/make_calib.py generates.
"""

import json

from example_helpers import CALIB_FILE, MODEL_DIR, TASKS_DIR, expected, read_jsonl  # first: sets sys.path

import corpus
import pytest

GENERATE_FILES = list(corpus.TASKS)  # add, reverse, sort, recall


@pytest.fixture(scope="module")
def training_lines() -> set[str]:
    n = json.loads((MODEL_DIR / "training.json").read_text())["train_lines"]
    return set(corpus.training_lines(corpus.TRAIN_SEED, n))


@pytest.fixture(scope="module")
def calib_texts() -> list[str]:
    return [row["text"] for row in read_jsonl(CALIB_FILE)]


def held_out_lines() -> dict[str, list[str]]:
    out = {}
    for name in GENERATE_FILES:
        out[name] = [r["prompt"] + r["reference"] for r in read_jsonl(TASKS_DIR / f"{name}.jsonl")]
    out["add_choice"] = [r["context"] + r["choices"][r["answer"]]
                         for r in read_jsonl(TASKS_DIR / "add_choice.jsonl")]
    out["prose"] = [r["text"] for r in read_jsonl(TASKS_DIR / "prose.jsonl")]
    return out


def test_task_files_have_the_documented_shape():
    assert {p.stem for p in TASKS_DIR.glob("*.jsonl")} == {*GENERATE_FILES, "add_choice", "prose"}
    for name in GENERATE_FILES:
        rows = read_jsonl(TASKS_DIR / f"{name}.jsonl")
        assert len(rows) == 200
        for r in rows:
            assert set(r) == {"prompt", "reference"}
            assert r["reference"] == expected(name, r["prompt"])
    for r in read_jsonl(TASKS_DIR / "add_choice.jsonl"):
        assert set(r) == {"context", "choices", "answer"} and len(r["choices"]) == 4
        assert len(set(r["choices"])) == 4
        assert r["choices"][r["answer"]] == expected("add", r["context"])
    assert len(read_jsonl(TASKS_DIR / "prose.jsonl")) == 200


def test_held_out_sets_are_disjoint_from_training_and_calibration(training_lines, calib_texts):
    calib_lines = corpus.split_lines(calib_texts)
    everything: list[str] = []
    for name, lines in held_out_lines().items():
        assert len(set(lines)) == len(lines), f"{name}: duplicates"
        assert not set(lines) & training_lines, f"{name}: overlaps the training data"
        assert not set(lines) & calib_lines, f"{name}: overlaps the calibration set"
        everything += lines
    assert len(set(everything)) == len(everything), "files share examples"


def test_qtk_contamination_check_finds_no_overlap(calib_texts):
    """What `qtk eval` would warn about for a checkpoint calibrated on the default set: nothing."""
    from qtk.eval.contamination import CalibrationIndex

    index = CalibrationIndex(calib_texts)
    flagged = {name: [i for i, line in enumerate(lines) if index.overlap(line)] for name, lines in held_out_lines().items()}
    assert flagged == {name: [] for name in flagged}
    assert index.overlap(calib_texts[7][5:])  # the check itself finds a shifted copy


def test_held_out_sets_come_from_the_eval_seed():
    # The first examples of each file are the first examples of the eval seed's stream (minus
    # any dropped overlap), which documents the provenance stated in examples/tasks/README.md.
    for name in GENERATE_FILES:
        rows = read_jsonl(TASKS_DIR / f"{name}.jsonl")
        stream = [p + r for p, r in corpus.task_examples(name, corpus.EVAL_SEED, 400)]
        positions = [stream.index(r["prompt"] + r["reference"]) for r in rows[:50]]
        assert positions == sorted(positions)


def test_calibration_set_is_the_documented_generation(calib_texts):
    assert calib_texts == corpus.calibration_texts(corpus.CALIB_SEED, corpus.CALIB_N, corpus.CALIB_MIN_CHARS)
    assert len(calib_texts) == 512
    # >= 256 tokens each with the character tokenizer (one token per character, plus BOS).
    assert min(len(t) for t in calib_texts) >= 255
