"""Regenerate the shipped calibration set, qtk/data/calib/default.jsonl, from examples/corpus.py.

    .venv/bin/python examples/make_calib.py

Each line is {"text": ...}: whole examples of every task family and prose, in the training
formats, joined by newlines until the text has at least CALIB_MIN_CHARS characters (so at least
256 tokens with the character tokenizer).  The seed (CALIB_SEED) differs from the training and
evaluation seeds, and make_tasks.py drops any evaluation example that appears here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE.parent / "qtk" / "data" / "calib" / "default.jsonl")
    p.add_argument("--seed", type=int, default=corpus.CALIB_SEED)
    p.add_argument("--n", type=int, default=corpus.CALIB_N)
    p.add_argument("--min-chars", type=int, default=corpus.CALIB_MIN_CHARS)
    args = p.parse_args(argv)
    if args.seed in (corpus.TRAIN_SEED, corpus.EVAL_SEED):
        raise SystemExit(f"--seed {args.seed} is the training or evaluation seed; calibration "
                         "text must come from a seed of its own")
    if (args.seed, args.n, args.min_chars) != (corpus.CALIB_SEED, corpus.CALIB_N, corpus.CALIB_MIN_CHARS):
        # make_tasks.py keeps evaluation data out of the *default* calibration set only.
        print("note: non-default calibration set; make_tasks.py does not check overlap with it",
              file=sys.stderr)
    texts = corpus.calibration_texts(args.seed, args.n, args.min_chars)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    chars = [len(t) for t in texts]
    print(f"wrote {len(texts)} texts to {args.out} (seed {args.seed}; "
          f"{min(chars)}-{max(chars)} characters, {sum(chars)} in all)")


if __name__ == "__main__":
    main()
