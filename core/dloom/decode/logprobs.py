"""Log-probabilities of committed tokens, recorded as a running batch commits them.

A diffusion decoder commits each generated position once, in some step, from that step's
logits. :class:`CommitLogprobs` keeps, for every position of a running batch, the
log-probability of the token committed there under the distribution it was committed from:
``log_softmax`` of that forward's logits at the position, the mask token excluded (the
kernel never proposes it, :func:`dloom.decode.kernel.propose`), at temperature 1 (the model's own
distribution, whatever temperature sampled the token). Optionally it keeps the ``top``
most likely tokens of that distribution with theirs.

It only reads the logits and the blocks before and after a step, so the decode's tokens
and NFE are those of a decode without it. Everything stays on the logits' device: one
``log_softmax`` and a scatter per step, no host read; the caller reads the finished rows'
values once (:meth:`take`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # alternatives per position, at most (OpenAI's limit for top_logprobs)


@dataclass(frozen=True)
class RowLogprobs:
    """Recorded values of some rows (``R`` rows, ``L`` columns, ``k = top``).

    :ivar token: ``(R, L)`` float32, the committed token's log-probability (NaN where
        nothing was committed: prompt, padding, positions never decoded).
    :ivar top_ids: ``(R, L, k)`` long, the ``k`` most likely tokens, most likely first.
    :ivar top_values: ``(R, L, k)`` float32, their log-probabilities.
    """

    token: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor


class CommitLogprobs:
    """The commit-time log-probabilities of a running batch's rows (``B`` rows, ``L``
    columns, aligned with the batch's token tensor).

    :param top: alternatives kept per position (``0 .. MAX_TOP``).
    :param mask_token_id: the mask token (excluded from every distribution).
    """

    def __init__(self, top: int, mask_token_id: int) -> None:
        if not 0 <= top <= MAX_TOP:
            raise ValueError(f"top is {top}; allowed: 0..{MAX_TOP}")
        self.top = top
        self.mask_token_id = mask_token_id
        self.values: RowLogprobs | None = None

    def _blank(self, rows: int, width: int, device: torch.device) -> RowLogprobs:
        return RowLogprobs(
            torch.full((rows, width), torch.nan, device=device),
            torch.zeros((rows, width, self.top), dtype=torch.long, device=device),
            torch.full((rows, width, self.top), torch.nan, device=device),
        )

    def start(self, tokens: torch.Tensor) -> None:
        """A new batch whose tokens are ``tokens`` ``(B, L)``: nothing recorded yet."""
        self.values = self._blank(tokens.shape[0], tokens.shape[1], tokens.device)

    def join(self, widened: int, tokens: torch.Tensor) -> None:
        """``widened`` columns added on the left of every row, then rows ``tokens``
        ``(J, L)`` appended (:meth:`dloom.decode.session.DecodeSession.admit`)."""
        v = self._current()
        if widened:
            lead = self._blank(v.token.shape[0], widened, v.token.device)
            v = RowLogprobs(*(torch.cat([a, b], dim=1) for a, b in zip(_fields(lead), _fields(v))))
        new = self._blank(tokens.shape[0], tokens.shape[1], tokens.device)
        self.values = RowLogprobs(*(torch.cat([a, b]) for a, b in zip(_fields(v), _fields(new))))

    def keep(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order."""
        self.values = RowLogprobs(*(a[index] for a in _fields(self._current())))

    def take(self, index: torch.Tensor) -> RowLogprobs:
        """The rows ``index``' values (``(R,)`` long; copies)."""
        return RowLogprobs(*(a[index] for a in _fields(self._current())))

    def record(self, columns: torch.Tensor, before: torch.Tensor, logits: torch.Tensor, after: torch.Tensor) -> None:
        """Record a plain step: positions masked in ``before`` and not in ``after`` were
        committed from ``logits``.

        :param columns: ``(B, K)`` long, the block's columns in the batch.
        :param before: / :param after: ``(B, K)`` long, the block before and after the step.
        :param logits: ``(B, K, V)``, the step's logits at the block's positions.
        """
        v = self._current()
        work = logits.float()
        if work is logits:
            work = work.clone()
        work[..., self.mask_token_id] = -torch.inf
        log_probs = torch.log_softmax(work, dim=-1)
        committed = (before == self.mask_token_id) & (after != self.mask_token_id)
        chosen = torch.gather(log_probs, -1, after.unsqueeze(-1)).squeeze(-1)
        old = torch.gather(v.token, 1, columns)
        v.token.scatter_(1, columns, torch.where(committed, chosen, old))
        if self.top:
            top_values, top_ids = torch.topk(log_probs, self.top, dim=-1)
            wide = columns.unsqueeze(-1).expand(-1, -1, self.top)
            keep = committed.unsqueeze(-1)
            v.top_ids.scatter_(1, wide, torch.where(keep, top_ids, torch.gather(v.top_ids, 1, wide)))
            v.top_values.scatter_(1, wide, torch.where(keep, top_values, torch.gather(v.top_values, 1, wide)))

    def _current(self) -> RowLogprobs:
        assert self.values is not None, "no running batch"
        return self.values


def _fields(values: RowLogprobs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return values.token, values.top_ids, values.top_values
