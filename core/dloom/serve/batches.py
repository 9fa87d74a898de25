"""A lane's running batch, whatever its decoder: the scheduler steps one of these.

* A :class:`~dloom.DiffusionDecoder` steps through a :class:`~dloom.decode.session.
  DecodeSession`: rows join at block boundaries, leave the step they finish, and stream
  block by block (continuous batching).
* Any other :class:`~dloom.decode.decoders.Decoder` (an ``"ar-target"`` one) decodes whole prompts in one :meth:`~dloom.decode.decoders.Decoder.generate`
  call: a :class:`GenerateBatch` step decodes every row that joined since the last step
  and finishes them all, each with its own random stream (its index in its request), so a
  row's output is the offline decode of its prompt. Its rows stream nothing before they
  finish, report no log-probabilities and stop at their EOS (:func:`check_batchable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from dloom.decode.decoder import BlockRecord, DiffusionDecoder
from dloom.decode.decoders import Decoder
from dloom.decode.session import DecodeSession, FinishedRows
from dloom.errors import ConfigurationError


class RunningBatch(Protocol):
    """What the scheduler uses of a running batch (:class:`~dloom.decode.session.DecodeSession`'s
    interface)."""

    on_block: Callable[[BlockRecord], None] | None

    @property
    def size(self) -> int:
        """Rows in the batch."""

    @property
    def forwards(self) -> int:
        """The batch's forwards so far."""

    @property
    def speculation(self) -> dict[str, Any] | None:
        """The batch's speculation figures so far (``None`` without speculation)."""

    def admit(self, prompts: Sequence[Sequence[int]], *, row_offset: Sequence[int]) -> Sequence[int]:
        """Rows join; their ids."""

    def cancel(self, rows: Sequence[int]) -> None:
        """Rows leave before the next step."""

    def step(self) -> FinishedRows | None:
        """One step; the rows that finished in it."""


def check_batchable(decoder: Decoder, logprobs: int | None, ignore_eos: bool) -> None:
    """Refuse what a :class:`GenerateBatch` cannot do, before a row is queued.

    :raises ConfigurationError: for ``logprobs`` or ``ignore_eos`` with a decoder that does
        not step (an ``"ar-target"`` one).
    """
    if isinstance(decoder, DiffusionDecoder):
        return
    for name, asked in (("logprobs", logprobs is not None), ("ignore_eos", ignore_eos)):
        if asked:
            raise ConfigurationError(
                f"{name} is not supported with strategy {decoder.name!r}, whose decoder is not a "
                "diffusion decoder; allowed: a diffusion strategy (quota, threshold, ...)"
            )


def open_batch(decoder: Decoder, logprobs: int | None, ignore_eos: bool) -> RunningBatch:
    """An empty running batch of ``decoder`` (see the module docstring)."""
    if isinstance(decoder, DiffusionDecoder):
        return DecodeSession(decoder, logprobs=logprobs, ignore_eos=ignore_eos)
    check_batchable(decoder, logprobs, ignore_eos)
    return GenerateBatch(decoder)


class GenerateBatch:
    """The running batch of a decoder that decodes whole prompts (:meth:`step`: one
    ``generate`` call over the rows waiting in it, which all finish)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.on_block: Callable[[BlockRecord], None] | None = None  # never called: no blocks
        self._rows: dict[int, tuple[list[int], int]] = {}  # id -> (prompt ids, random stream)
        self._next_id = 0
        self._forwards = 0
        self._speculation: dict[str, Any] | None = None

    @property
    def size(self) -> int:
        return len(self._rows)

    @property
    def forwards(self) -> int:
        return self._forwards

    @property
    def speculation(self) -> dict[str, Any] | None:
        return self._speculation

    def admit(self, prompts: Sequence[Sequence[int]], *, row_offset: Sequence[int]) -> list[int]:
        ids = list(range(self._next_id, self._next_id + len(prompts)))
        self._next_id += len(prompts)
        for row, prompt, stream in zip(ids, prompts, row_offset):
            self._rows[row] = (list(prompt), stream)
        return ids

    def cancel(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)

    def step(self) -> FinishedRows | None:
        """Decode every row in the batch; all of them finish."""
        if not self._rows:
            return None
        ids = list(self._rows)
        prompts, streams = zip(*self._rows.values())
        self._rows.clear()
        result = self.decoder.generate(list(prompts), row_offset=list(streams))
        self._forwards += result.forwards
        self._speculation = result.speculation
        generated = result.generated.shape[1]
        return FinishedRows(
            rows=torch.tensor(ids, dtype=torch.long), sequences=result.sequences,
            prompt_width=result.sequences.shape[1] - generated, lengths=result.generated_lengths,
            nfe=result.nfe,
        )
