"""Shared paths and checks for the tests of the shipped example model and data.

A plain module with a unique name rather than a conftest.py: test modules import from it, and
`from conftest import ...` would be ambiguous next to tests/conftest.py.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODEL_DIR = EXAMPLES / "tiny-llama"
TASKS_DIR = EXAMPLES / "tasks"
CALIB_FILE = ROOT / "qtk" / "data" / "calib" / "default.jsonl"

# examples/ is a folder of scripts, not a package: make corpus.py etc. importable.
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


FORMATS = {
    "add": re.compile(r"Q: (\d+)\+(\d+)="),
    "reverse": re.compile(r"reverse: ([a-z]+) ->"),
    "sort": re.compile(r"sort: (\d(?: \d)*) ->"),
    "recall": re.compile(r"([a-z]=\d\d(?: [a-z]=\d\d)*) get ([a-z]) ->"),
}


def expected(family: str, prompt: str) -> str:
    """The reference for a prompt, recomputed independently of examples/corpus.py."""
    m = FORMATS[family].fullmatch(prompt)
    assert m, (family, prompt)
    if family == "add":
        return f" {int(m[1]) + int(m[2])}"
    if family == "reverse":
        return " " + m[1][::-1]
    if family == "sort":
        return " " + " ".join(sorted(m[1].split()))
    table = dict(pair.split("=") for pair in m[1].split())
    return " " + table[m[2]]
