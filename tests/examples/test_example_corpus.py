"""examples/corpus.py: deterministic, correct answers, and the seed properties other code relies on."""

from example_helpers import expected  # first: it also puts examples/ on sys.path

import corpus
import pytest


def test_same_seed_same_corpus_and_seeds_differ():
    assert corpus.training_lines(7, 3000) == corpus.training_lines(7, 3000)
    assert corpus.calibration_texts(7, 5, 300) == corpus.calibration_texts(7, 5, 300)
    a, b = set(corpus.training_lines(0, 3000)), set(corpus.training_lines(1, 3000))
    # Different seeds: independent streams, so only the odd short collision.
    assert len(a & b) < 30
    assert len({corpus.TRAIN_SEED, corpus.CALIB_SEED, corpus.EVAL_SEED}) == 3


def test_known_first_lines_are_stable():
    # Pins the generator: if this changes, the shipped model, tasks and calibration set no longer
    # match their documented provenance and must be regenerated.
    assert corpus.task_examples("add", 0, 2) == [("Q: 597+974=", " 1571"), ("Q: 50+325=", " 375")]
    assert corpus.training_lines(0, 3) == ["Q: 597+974= 1571", "Q: 50+325= 375", "reverse: tupnbehjbx -> xbjhebnput"]


@pytest.mark.parametrize("family", list(corpus.TASKS))
def test_references_are_correct_and_in_range(family):
    for prompt, reference in corpus.task_examples(family, 3, 500):
        assert reference == expected(family, prompt)
        assert not prompt.endswith(" ") and reference.startswith(" ")
    words = [p.split()[1] for p, _ in corpus.task_examples("reverse", 3, 500)]
    assert {len(w) for w in words} == set(range(corpus.REVERSE_LEN[0], corpus.REVERSE_LEN[1] + 1))


def test_mixed_stream_interleaves_the_family_streams():
    # make_tasks.py relies on this to rebuild the training prefix family by family.
    mixed = corpus.mixed_stream(5)
    by_family: dict[str, list[str]] = {f: [] for f in corpus.FAMILIES}
    for _ in range(2000):
        family, line = next(mixed)
        by_family[family].append(line)
    for family, lines in by_family.items():
        stream = corpus.family_stream(family, 5)
        assert lines == [corpus.as_line(next(stream)) for _ in lines]
    assert all(len(v) > 50 for v in by_family.values())


def test_prose_and_calibration_texts_fit():
    assert max(len(t) for t in corpus.prose_examples(4, 3000)) <= corpus.MAX_PROSE_CHARS
    texts = corpus.calibration_texts(4, 20, 300)
    assert all(len(t) >= 300 for t in texts)
    # Calibration texts are the mixed stream cut at line boundaries, nothing else.
    lines = "\n".join(texts).split("\n")
    assert lines == corpus.training_lines(4, len(lines))
