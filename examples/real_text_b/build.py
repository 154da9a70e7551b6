"""Rebuild calib.jsonl and heldout.jsonl of this folder from two Debian packages (see README.md):

    apt-get download debian-handbook python3.11-doc
    dpkg-deb -x debian-handbook_*.deb root && dpkg-deb -x python3.11-doc_*.deb root
    python examples/real_text_b/build.py root

Only the prose is kept: the text of each page's paragraphs (<p>, the handbook's <div class="para">) (code listings, tables, navigation and headings are
dropped), whitespace runs cut to one space, one JSON line per page, pages in file-name order, up to a character budget."""

from __future__ import annotations

import json
import sys
from html.parser import HTMLParser
from pathlib import Path

HERE = Path(__file__).resolve().parent
HANDBOOK = "usr/share/doc/debian-handbook/html/en-US"
TUTORIAL = "usr/share/doc/python3.11/html/tutorial"
CALIB_CHARS = 400_000
HELDOUT_CHARS = 150_000


class Paragraphs(HTMLParser):
    """The text of every paragraph (<p>, or the handbook's <div class="para">) outside <pre> and titles, each on its
    own."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []  # the paragraph's tag and the tags opened inside it, while inside one
        self.pre, self.buf, self.out = 0, [], []

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        if tag == "pre":
            self.pre += 1
        elif self.open:
            if tag in ("div", "p"):
                self.open.append(tag)
        elif not self.pre and ((tag == "p" and "title" not in cls) or (tag == "div" and cls == "para")):
            self.open.append(tag)

    def handle_endtag(self, tag):
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        elif self.open and tag == self.open[-1]:
            self.open.pop()
            if not self.open:
                text = " ".join("".join(self.buf).split())
                if len(text) >= 40:  # captions and one-word notes carry no prose
                    self.out.append(text)
                self.buf = []

    def handle_data(self, data):
        if self.open and not self.pre:
            self.buf.append(data)


def pages(folder: Path, title: str, budget: int) -> list[dict]:
    rows, used = [], 0
    for page in sorted(folder.glob("*.html")):
        p = Paragraphs()
        p.feed(page.read_text(encoding="utf-8"))
        text = "\n\n".join(p.out)
        if not text:
            continue
        rows.append({"source": f"{title}, {page.stem}", "text": text})
        used += len(text)
        if used >= budget:
            break
    return rows


def write(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    root = Path(sys.argv[1])
    write(pages(root / HANDBOOK, "The Debian Administrator's Handbook (bookworm package debian-handbook 11.20220922)",
                CALIB_CHARS), HERE / "calib.jsonl")
    write(pages(root / TUTORIAL, "The Python Tutorial (Python 3.11.2, Debian package python3.11-doc)", HELDOUT_CHARS),
          HERE / "heldout.jsonl")
