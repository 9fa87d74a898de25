"""What a client sees of a decoded row: tokens cut at ``max_tokens``, text cut at a stop
sequence (and the tokens counted and described with it), and the text a stream may send
before the row is complete.

Every function here works on one request's tokens, on the host, after the engine has
decoded them; nothing runs per token inside the decoding loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT_CHARACTER = "\ufffd"


@dataclass(frozen=True)
class Visible:
    """A row's output as the response reports it.

    :ivar text: the decoded text, cut before the first stop sequence.
    :ivar tokens: generated tokens counted in ``usage`` and described by ``logprobs``: up to
        and including the first EOS, at most ``max_tokens``, and when a stop sequence cut
        the text, only those that make the text up to the cut (:func:`tokens_of_text`).
    :ivar finish_reason: ``"stop"`` (EOS or a stop sequence), ``"length"`` (``max_tokens``
        reached first) or ``None`` while the row is still decoding.
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the earliest occurrence of any stop sequence, and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` a stream must hold back: the longest suffix
    that begins a stop sequence (it may complete in the next block), plus a trailing
    replacement character (a multi-byte character split between blocks)."""
    hold = max(
        (k for s in stop for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
        default=0,
    )
    if text[: len(text) - hold].endswith(REPLACEMENT_CHARACTER):
        hold += 1
    return hold


def visible_output(
    generated: Sequence[int],
    eos_ids: Sequence[int],
    max_tokens: int,
    stop: Sequence[str],
    decode: Callable[[list[int]], str],
    complete: bool,
    stop_at_eos: bool = True,
) -> Visible:
    """The visible part of a row's generated tokens.

    :param generated: the row's generated tokens so far, in order (positions after its EOS
        may be anything: they are never read).
    :param complete: whether the row has finished decoding (else ``finish_reason`` stays
        ``None`` unless EOS, a stop sequence or ``max_tokens`` already ended it).
    :param stop_at_eos: ``False`` (``ignore_eos``): an EOS ends nothing; EOS tokens are
        counted and left out of the text.
    """
    eos = set(eos_ids)
    first_eos = next((i for i, t in enumerate(generated) if t in eos), None) if stop_at_eos else None
    end = len(generated) if first_eos is None else first_eos + 1
    tokens = tuple(generated[: min(end, max_tokens)])
    text, stopped = cut_at_stop(decode([t for t in tokens if t not in eos]), stop)
    if stopped:
        tokens = tokens[: tokens_of_text(tokens, len(text), eos, decode)]
    if stopped or (first_eos is not None and first_eos < max_tokens):
        reason: str | None = "stop"
    elif len(tokens) >= max_tokens:
        reason = "length"
    else:
        reason = "stop" if complete else None
    return Visible(text, tokens, reason)


def tokens_of_text(tokens: Sequence[int], chars: int, eos: set[int], decode: Callable[[list[int]], str]) -> int:
    """How many of ``tokens`` make the first ``chars`` characters of their text: the fewest
    whose decoded text (EOS left out) is that long (a token that straddles the end counts,
    those past it do not); 0 when ``chars`` is 0. Found by bisection, in ``log2 len(tokens)``
    decodes."""
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if len(decode([t for t in tokens[:middle] if t not in eos])) >= chars:
            high = middle
        else:
            low = middle + 1
    return low


class StreamText:
    """The text deltas of one streamed row, block by block.

    Each call to :meth:`advance` receives the row's visible output so far and returns the
    text to send now: what is new and can no longer change (text that might begin a stop
    sequence is held back until the next block decides it).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.sent = ""

    def advance(self, visible: Visible) -> str:
        text = visible.text
        if visible.finish_reason is None:
            text = text[: len(text) - held_back(text, self.stop)]
        if not text.startswith(self.sent):
            # a tokenizer whose decode of more tokens rewrites earlier text (space clean-up):
            # sent text cannot be recalled, so wait until the text extends it again
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
