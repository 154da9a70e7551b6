"""examples/real_text: real English for the real-model test and benchmark. Calibration and held-out text must not
overlap, and each file must hold what its README says (the licence texts verbatim, the two state documents)."""

import json
from pathlib import Path

import pytest

TEXT = Path(__file__).resolve().parents[2] / "examples" / "real_text"


def rows(name):
    return [json.loads(x) for x in (TEXT / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]


def test_files_hold_the_documented_documents():
    cal, held = rows("calib"), rows("heldout")
    assert [r["source"].split()[0].rsplit("/", 1)[-1] for r in cal] == ["GPL-3", "GPL-2", "GPL-1", "LGPL-2.1", "LGPL-3",
                                                                        "GFDL-1.3", "CC0-1.0"]
    assert held[0]["text"].startswith("The Constitution of the United States of America")
    assert held[1]["text"].startswith("The Declaration of Independence")
    assert all(r["text"].strip() for r in cal + held)
    readme = (TEXT / "README.md").read_text()
    assert "public domain" in readme and "verbatim" in readme


@pytest.mark.parametrize("n", [8])
def test_calibration_and_heldout_share_no_text(n):
    """No held-out run of n words occurs in the calibration text (n = 8: long enough to be a shared passage,
    not a common phrase such as 'of the United States')."""
    def runs(texts):
        out = set()
        for t in texts:
            w = t.split()
            out.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
        return out

    shared = runs(r["text"] for r in rows("calib")) & runs(r["text"] for r in rows("heldout"))
    assert not shared, sorted(shared)[:3]


def test_licence_texts_are_verbatim_where_the_machine_has_them():
    """The GNU licences say they may be copied verbatim only: compare with Debian's copies when present."""
    checked = 0
    for r in rows("calib"):
        p = Path(r["source"].split()[0])
        if p.is_file():
            assert p.read_text(encoding="utf-8") == r["text"], p
            checked += 1
    if not checked:
        pytest.skip("no /usr/share/common-licenses on this machine to compare with")


def passages(doc: dict, min_chars: int = 1200) -> list[dict]:
    """The rule the README states for heldout_passages.jsonl."""
    out, cur = [], ""
    for para in (x.strip() for x in doc["text"].split("\n\n")):
        if not para:
            continue
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= min_chars:
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return [{"source": f"{doc['source']}, passage {i}", "text": t} for i, t in enumerate(out, 1)]


def test_heldout_passages_are_the_heldout_text_cut_as_documented():
    assert rows("heldout_passages") == [p for d in rows("heldout") for p in passages(d)]
    assert len(rows("heldout_passages")) == 39
