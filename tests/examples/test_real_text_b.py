"""examples/real_text_b: the second, independent text set. Its calibration and held-out files share no passage with
each other nor with the first set (examples/real_text), and each holds what its README says."""

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def rows(folder, name):
    return [json.loads(x) for x in (EXAMPLES / folder / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]


def runs(texts, n=8):
    out = set()
    for t in texts:
        w = t.split()
        out.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
    return out


def test_files_hold_the_documented_pages():
    cal, held = rows("real_text_b", "calib"), rows("real_text_b", "heldout")
    assert len(cal) == 46 and all(r["source"].startswith("The Debian Administrator's Handbook") for r in cal)
    assert len(held) == 15 and all(r["source"].startswith("The Python Tutorial") for r in held)
    assert sum(len(r["text"]) for r in cal) >= 400_000 and all(r["text"].strip() for r in cal + held)
    readme = (EXAMPLES / "real_text_b" / "README.md").read_text()
    assert "PSF License" in readme and "GPL-2.0+ or CC-BY-SA-3.0" in readme
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in (EXAMPLES / "real_text_b" / "LICENSE-PSF.txt").read_text()


@pytest.mark.parametrize("a,b", [(("real_text_b", "calib"), ("real_text_b", "heldout")),
                                 (("real_text_b", "calib"), ("real_text", "heldout")),
                                 (("real_text", "calib"), ("real_text_b", "heldout"))])
def test_no_shared_passages(a, b):
    """No run of 8 words of one file occurs in the other: the held-out text of each set is unseen by either set's
    calibration."""
    shared = runs(r["text"] for r in rows(*a)) & runs(r["text"] for r in rows(*b))
    assert not shared, sorted(shared)[:3]
