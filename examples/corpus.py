"""Deterministic generator of the tiny-llama corpus: task families with checkable answers + prose.

Everything the example model is trained, calibrated and evaluated on comes from here, so the
text is ours (Apache-2.0, like the project) and can be regenerated bit for bit from a seed.

Each task family is a function ``gen_<family>(rng) -> (prompt, reference)``; a training line is
``prompt + reference`` and the model is asked to continue ``prompt`` with ``reference`` (the
reference starts with a space, so the prompt never ends in whitespace and the first generated
character already carries information).  Prose has no prompt: ``gen_prose(rng) -> text``.

Seeding: every family draws from its own ``random.Random(f"{family}:{seed}")`` (string seeds
are hashed with SHA-512 by ``random``, so streams are stable across runs, platforms and
PYTHONHASHSEED).  The mixed stream picks families with a separate ``random.Random(f"mix:{seed}")``,
so the k-th "add" line of ``mixed_stream(seed)`` is exactly ``family_stream("add", seed)``'s k-th
example.  That is what lets make_tasks.py check held-out data against the training prefix by
regenerating it, and it is also why training, calibration and evaluation must use *different*
seeds (see TRAIN_SEED / CALIB_SEED / EVAL_SEED).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterable, Iterator

# Seeds of the three uses of the corpus.  They must differ pairwise: the same seed gives the same
# examples (see module docstring).  make_tasks.py / make_calib.py refuse to reuse TRAIN_SEED.
TRAIN_SEED = 0
CALIB_SEED = 1
EVAL_SEED = 2

# Shape of the shipped calibration set (qtk/data/calib/default.jsonl, written by make_calib.py):
# CALIB_N texts of whole lines joined by newlines, each at least CALIB_MIN_CHARS characters, so
# every text is >= 256 tokens with the character tokenizer.  make_tasks.py regenerates exactly
# this set to keep evaluation examples out of it.
CALIB_N = 512
CALIB_MIN_CHARS = 300

# Difficulty knobs.  Chosen so that a ~1M-parameter character model trained for ~20 minutes on two
# CPU cores gets clearly non-trivial but imperfect accuracy: a quantized copy then has room to lose
# accuracy measurably.  Changing them changes the corpus, so retrain and regenerate data after.
# (Tried and rejected: reversing 4-8 letters, sorting 3-7 digits -- learned perfectly; reversing
# 6-16 letters -- not learned at all in budget.  Results: examples/tiny-llama/README.md.)
ADD_DIGITS = (2, 3)          # each operand has 2 or 3 digits; the sum is written most significant first
REVERSE_LEN = (5, 12)        # letters in the word to reverse
SORT_LEN = (5, 13)           # single digits to sort, repeats allowed
RECALL_PAIRS = (3, 9)        # key=value pairs before the query

LETTERS = string.ascii_lowercase


def gen_add(rng: random.Random) -> tuple[str, str]:
    """``Q: 347+58=`` -> `` 405``."""

    def operand() -> int:
        digits = rng.randint(*ADD_DIGITS)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    a, b = operand(), operand()
    return f"Q: {a}+{b}=", f" {a + b}"


def gen_reverse(rng: random.Random) -> tuple[str, str]:
    """``reverse: abcde ->`` -> `` edcba``."""
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(*REVERSE_LEN)))
    return f"reverse: {word} ->", f" {word[::-1]}"


def gen_sort(rng: random.Random) -> tuple[str, str]:
    """``sort: 5 2 9 1 ->`` -> `` 1 2 5 9`` (ascending, duplicates kept)."""
    digits = [rng.randint(0, 9) for _ in range(rng.randint(*SORT_LEN))]
    return (
        "sort: " + " ".join(map(str, digits)) + " ->",
        " " + " ".join(map(str, sorted(digits))),
    )


def gen_recall(rng: random.Random) -> tuple[str, str]:
    """``a=41 b=07 c=93 d=12 get c ->`` -> `` 93``: look a key up in the line's own table.

    Keys are consecutive letters from ``a``, so the key says where its value is (like reversal,
    a positional lookup), which a model this small partly learns in its budget.  Random keys
    (``x=07 c=41 get x ->`` with 2-8 pairs, and an induction-style ``x: 07, c: 41. x:`` variant)
    need content matching that it did not learn at all: it copied some value of the table and
    scored at chance.
    """
    n = rng.randint(*RECALL_PAIRS)
    keys = LETTERS[:n]
    # Two-digit values (leading zero kept) so every answer has the same shape and a copy of the
    # wrong value is as long as the right one.
    values = [f"{rng.randint(0, 99):02d}" for _ in keys]
    query = rng.randrange(n)
    table = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    return f"{table} get {keys[query]} ->", f" {values[query]}"


# --- prose ---------------------------------------------------------------------------------------
# Small templated stories.  They have structure a small model can learn (a name introduced in the
# first sentence comes back, a given object changes owner, weather implies an action), so held-out
# perplexity is a meaningful, non-trivial number rather than the entropy of random words.

NAMES = [
    "Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena",
    "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tess", "Uma", "Vic", "Wren", "Yara",
]
OBJECTS = {  # singular -> plural
    "cup": "cups", "book": "books", "kite": "kites", "lamp": "lamps", "map": "maps",
    "ball": "balls", "box": "boxes", "key": "keys", "hat": "hats", "coin": "coins",
    "bell": "bells", "drum": "drums", "brush": "brushes", "shell": "shells",
}
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "gray", "orange", "pink"]
PLACES = [
    "park", "market", "river", "library", "garden", "station", "school", "harbor", "farm",
    "bakery", "museum", "beach",
]
TIMES = ["in the morning", "at noon", "in the evening", "at night", "after lunch", "before dinner"]
ANIMALS = ["cat", "dog", "fox", "owl", "goat", "duck", "horse", "mouse", "frog", "crow"]
ANIMAL_ACTIONS = ["sleeps", "runs", "sings", "waits", "hides", "plays", "eats", "jumps"]
WEATHER = {  # weather -> what the protagonist does about it
    "sunny": "wears a hat",
    "rainy": "takes an umbrella",
    "windy": "holds on to the door",
    "cold": "puts on a warm coat",
    "warm": "drinks a glass of water",
    "foggy": "walks very slowly",
}
NUMBER_WORDS = ["two", "three", "four", "five", "six", "seven", "eight", "nine"]


MAX_PROSE_CHARS = 240  # so a story plus BOS and newline always fits a 256-token training row


def gen_prose(rng: random.Random) -> str:
    """A 1-6 sentence story on one line, at most MAX_PROSE_CHARS characters."""
    a, b = rng.sample(NAMES, 2)
    obj = rng.choice(list(OBJECTS))
    color = rng.choice(COLORS)
    place = rng.choice(PLACES)
    article = "an" if color[0] in "aeiou" else "a"
    out = [f"{a} has {article} {color} {obj}."]

    def add(*sentences: str) -> bool:
        # Optional sentences are dropped (all of a group, never half of it) rather than letting
        # a story outgrow the limit; the random draws are the same either way.
        if len(" ".join(out + list(sentences))) > MAX_PROSE_CHARS:
            return False
        out.extend(sentences)
        return True

    if rng.random() < 0.4:
        weather = rng.choice(list(WEATHER))
        add(f"It is {weather} today, so {a} {WEATHER[weather]}.")
    went = rng.random() < 0.7 and add(f"{a} goes to the {place} {rng.choice(TIMES)}.")
    if went and rng.random() < 0.6 and add(f"At the {place}, {a} meets {b}."):
        if rng.random() < 0.6:
            add(f"{a} gives the {color} {obj} to {b}.", f"Now {b} has the {obj}, and {b} says thank you.")
    if rng.random() < 0.5:
        where = f"near the {place}" if went else "under the table"
        add(f"The {rng.choice(ANIMALS)} {rng.choice(ANIMAL_ACTIONS)} {where}.")
    if rng.random() < 0.3:
        add(f"There are {rng.choice(NUMBER_WORDS)} {OBJECTS[obj]} on the shelf.")
    return " ".join(out)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": gen_add,
    "reverse": gen_reverse,
    "sort": gen_sort,
    "recall": gen_recall,
}
FAMILIES = [*TASKS, "prose"]

# Share of *lines* in the mixed stream.  Prose lines are ~5x longer than task lines, so prose is
# still about a quarter of the tokens.  Arithmetic gets the most lines: with a third of them it
# was learned in one training run and not at all in another; sort is learned easily.
MIX_WEIGHTS = {"add": 0.40, "reverse": 0.16, "sort": 0.12, "recall": 0.22, "prose": 0.10}


def _rng(family: str, seed: int) -> random.Random:
    return random.Random(f"{family}:{seed}")


def family_stream(family: str, seed: int) -> Iterator[str | tuple[str, str]]:
    """Infinite stream of one family: (prompt, reference) pairs, or text for prose."""
    rng = _rng(family, seed)
    if family == "prose":
        while True:
            yield gen_prose(rng)
    gen = TASKS[family]
    while True:
        yield gen(rng)


def task_examples(family: str, seed: int, n: int) -> list[tuple[str, str]]:
    """The first ``n`` (prompt, reference) pairs of a task family for ``seed``."""
    if family not in TASKS:
        raise ValueError(f"unknown task family {family!r}; choose from {sorted(TASKS)}")
    stream = family_stream(family, seed)
    return [next(stream) for _ in range(n)]  # type: ignore[misc]


def prose_examples(seed: int, n: int) -> list[str]:
    stream = family_stream("prose", seed)
    return [next(stream) for _ in range(n)]  # type: ignore[misc]


def as_line(item: str | tuple[str, str]) -> str:
    """The training text of one example: prompt and reference joined, or the prose itself."""
    return item if isinstance(item, str) else item[0] + item[1]


def mixed_stream(seed: int, weights: dict[str, float] | None = None) -> Iterator[tuple[str, str]]:
    """Infinite stream of ``(family, line)`` mixing all families by ``weights``."""
    weights = weights or MIX_WEIGHTS
    families = list(weights)
    cum, total = [], 0.0
    for f in families:
        total += weights[f]
        cum.append(total)
    picker = _rng("mix", seed)
    streams = {f: family_stream(f, seed) for f in families}
    while True:
        family = picker.choices(families, cum_weights=cum)[0]
        yield family, as_line(next(streams[family]))


def training_lines(seed: int, n: int) -> list[str]:
    """The first ``n`` lines of the mixed stream: what train_tiny_llama.py trains on."""
    stream = mixed_stream(seed)
    return [next(stream)[1] for _ in range(n)]


def lines_by_family(seed: int, n: int) -> dict[str, set[str]]:
    """The first ``n`` mixed-stream lines of ``seed``, grouped by family (for overlap checks)."""
    out: dict[str, set[str]] = {f: set() for f in FAMILIES}
    stream = mixed_stream(seed)
    for _ in range(n):
        family, line = next(stream)
        out[family].add(line)
    return out


def calibration_texts(seed: int, n: int, min_chars: int) -> list[str]:
    """``n`` texts, each whole mixed-stream lines joined by newlines until ``min_chars`` is reached.

    One character is one token (plus BOS), so ``min_chars`` is a lower bound on tokens per text.
    """
    stream = mixed_stream(seed)
    texts = []
    for _ in range(n):
        parts = [next(stream)[1]]
        length = len(parts[0])
        while length < min_chars:
            parts.append(next(stream)[1])
            length += 1 + len(parts[-1])  # the joining newline and the line
        texts.append("\n".join(parts))
    return texts


def split_lines(texts: Iterable[str]) -> set[str]:
    """All individual example lines inside newline-joined texts (e.g. calibration texts)."""
    return {line for text in texts for line in text.split("\n") if line}
