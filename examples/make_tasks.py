"""Regenerate the held-out evaluation sets in examples/tasks/ from examples/corpus.py.

    .venv/bin/python examples/make_tasks.py            # writes examples/tasks/*.jsonl

Held-out means two things here:
  1. a seed (EVAL_SEED) different from the training and calibration seeds, and
  2. no example whose exact text appears in the training data or the calibration set: the script
     regenerates the training prefix the shipped model consumed (its length is read from
     examples/tiny-llama/training.json) and qtk/data/calib/default.jsonl's generator, and drops every
     overlap, and any duplicate inside a file, before taking the first --n survivors;
  3. no example that `qtk eval`'s contamination check flags against qtk/data/calib/default.jsonl (a
     near-duplicate: half of its 13-word n-grams in the calibration texts, or a short example found
     whole inside one), so the shipped suite gates without a contamination warning.

Files written (one per task family plus two of other kinds):
  add.jsonl reverse.jsonl sort.jsonl recall.jsonl   {"prompt": ..., "reference": ...}
  add_choice.jsonl                                  {"context": ..., "choices": [...], "answer": i}
  prose.jsonl                                       {"text": ...}   (held-out perplexity)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus  # noqa: E402

N_CHOICES = 4


def default_train_lines() -> int:
    record = HERE / "tiny-llama" / "training.json"
    if not record.exists():
        raise SystemExit(f"{record} not found: train the model first or pass --train-lines")
    return int(json.loads(record.read_text())["train_lines"])


def excluded_lines(train_seed: int, train_lines: int, calib_seed: int) -> dict[str, set[str]]:
    """Every line of the training prefix and of the calibration set, by family."""
    seen = corpus.lines_by_family(train_seed, train_lines)
    calib = corpus.split_lines(corpus.calibration_texts(calib_seed, corpus.CALIB_N, corpus.CALIB_MIN_CHARS))
    # Calibration lines are not labelled with their family; adding each to every family's set is
    # harmless because families have disjoint formats.
    for family in seen:
        seen[family] |= calib
    return seen


def calibration_index():
    """qtk eval's own contamination index over the shipped calibration texts."""
    from qtk.eval.contamination import CalibrationIndex

    calib = HERE.parent / "qtk" / "data" / "calib" / "default.jsonl"
    return CalibrationIndex([json.loads(line)["text"] for line in calib.read_text().splitlines() if line.strip()])


def fresh(items, exclude: set[str], n: int, stats: dict[str, int], line=corpus.as_line, index=None) -> list:
    """The first ``n`` items whose ``line(item)`` is neither excluded, nor flagged by ``index`` (a
    qtk.eval.contamination.CalibrationIndex), nor already taken."""
    taken: list = []
    lines: set[str] = set()
    for item in items:
        text = line(item)
        if text in exclude:
            stats["overlap"] += 1
        elif index is not None and index.overlap(text):
            stats["near_duplicate"] += 1
        elif text in lines:
            stats["duplicate"] += 1
        else:
            taken.append(item)
            lines.add(text)
            if len(taken) == n:
                return taken
    raise AssertionError("family streams are infinite")


def addition_distractors(rng: random.Random, a: int, b: int) -> list[int]:
    """Wrong sums a model that is almost right would produce: off by one in a digit position
    (dropped or extra carry) or a digit-wise sum without carries."""
    s = a + b
    no_carry = int("".join(str((int(x) + int(y)) % 10) for x, y in
                           zip(str(a).zfill(4), str(b).zfill(4))))
    candidates = [s + d for d in (1, -1, 10, -10, 100, -100)] + [no_carry]
    candidates = sorted({c for c in candidates if c > 0 and c != s})
    rng.shuffle(candidates)
    return candidates[: N_CHOICES - 1]


def choice_items(seed: int):
    """Infinite stream of (context, choices, answer) built on fresh additions."""
    rng = random.Random(f"add_choice:{seed}")
    while True:
        prompt, reference = corpus.gen_add(rng)
        a, b = map(int, prompt[3:-1].split("+"))
        choices = [f" {c}" for c in addition_distractors(rng, a, b)] + [reference]
        rng.shuffle(choices)
        yield prompt, reference, choices, choices.index(reference)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE / "tasks")
    p.add_argument("--seed", type=int, default=corpus.EVAL_SEED)
    p.add_argument("--n", type=int, default=200, help="examples per file")
    p.add_argument("--train-seed", type=int, default=corpus.TRAIN_SEED)
    p.add_argument("--train-lines", type=int, default=None,
                   help="training prefix to exclude (default: from examples/tiny-llama/training.json)")
    p.add_argument("--calib-seed", type=int, default=corpus.CALIB_SEED)
    args = p.parse_args(argv)
    if args.seed in (args.train_seed, args.calib_seed):
        raise SystemExit(f"--seed {args.seed} must differ from the training and calibration seeds")
    train_lines = args.train_lines if args.train_lines is not None else default_train_lines()

    exclude = excluded_lines(args.train_seed, train_lines, args.calib_seed)
    index = calibration_index()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {}

    def write(name: str, rows: list[dict], stats: dict[str, int]) -> None:
        with open(args.out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        report[name] = stats

    held_out: dict[str, list] = {}
    for family in corpus.TASKS:
        stats = {"overlap": 0, "near_duplicate": 0, "duplicate": 0}
        held_out[family] = fresh(corpus.family_stream(family, args.seed), exclude[family], args.n, stats, index=index)
        write(family, [{"prompt": pr, "reference": ref} for pr, ref in held_out[family]], stats)

    # Multiple choice must also stay clear of the generate-style addition set, so the two files
    # measure different examples.
    stats = {"overlap": 0, "near_duplicate": 0, "duplicate": 0}
    add_taken = {corpus.as_line(item) for item in held_out["add"]}
    items = fresh(choice_items(args.seed), exclude["add"] | add_taken, args.n, stats,
                  line=lambda item: item[0] + item[1], index=index)
    rows = [{"context": c, "choices": ch, "answer": ans} for c, _, ch, ans in items]
    write("add_choice", rows, stats)

    stats = {"overlap": 0, "near_duplicate": 0, "duplicate": 0}
    texts = fresh(corpus.family_stream("prose", args.seed), exclude["prose"], args.n, stats, index=index)
    write("prose", [{"text": t} for t in texts], stats)

    print(f"seed {args.seed}; excluded training prefix of {train_lines} lines (seed "
          f"{args.train_seed}) and calibration seed {args.calib_seed}")
    for name, stats in report.items():
        print(f"  {name:<11} {args.n} examples; dropped {stats['overlap']} overlapping, "
              f"{stats['near_duplicate']} near-duplicate of calibration, {stats['duplicate']} duplicate")


if __name__ == "__main__":
    main()
