"""The speculative step as value objects: what a caller hands
:meth:`dloom.DiffusionDecoder.speculative_step` (:class:`SpeculativeStep`) and what comes back
(:class:`StepOutcome`), and the two interfaces the step calls through.

Two callers run that one step: :class:`~dloom.decode.session.DecodeSession` over a running
batch's blocks, and FailFast's drafter over each row's small block. Each brings its own
model runner (:class:`BlockForwards`: the session's :class:`~dloom.model.runner.BlockForward`,
the drafter's prefix forward) and its own counters (:class:`VerificationCounts`); the step
reads nothing else of its caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from dloom.decode.kernel import KernelStep
from dloom.types import VerificationLayout


class BlockForwards(Protocol):
    """A model runner over the rows' active blocks (``B`` rows, blocks of ``K`` columns)."""

    @property
    def start(self) -> torch.Tensor:
        """``(B,)`` long: each row's active block's first column."""

    @property
    def window_start(self) -> torch.Tensor:
        """``(B,)`` long: the first column whose logits the block's distributions come from
        (``start - shift``)."""

    @property
    def shift(self) -> int:
        """1 when the model's logits at column ``i`` predict column ``i + 1``, else 0."""

    def run(
        self, tokens: torch.Tensor, n_full: int, first_window: int, last_window: int, cached: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One plain forward of the rows: ``(B, K, V)`` logits of their blocks and ``(B,)``
        bool, the rows that took a full forward."""

    def evaluate(self, tokens: torch.Tensor, layout: VerificationLayout, first_window: int) -> torch.Tensor:
        """One verification forward over ``layout``'s rows: the nodes' logits."""

    def query_width(self, first_window: int) -> int:
        """Columns one layout row's forward computes in :meth:`evaluate`."""


class VerificationCounts(Protocol):
    """What the step counts for its caller."""

    verification_forwards: int

    def record_layout(self, exact: bool) -> None:
        """Note whether a verification's layout was exact (see :class:`~dloom.types.VerificationLayout`)."""


class ForwardPlan(NamedTuple):
    """Which rows take a full forward and which columns' logits a step keeps
    (:meth:`dloom.model.runner.BlockForward.plan`)."""

    n_full: int
    first_window: int
    last_window: int


@dataclass(frozen=True)
class SpeculativeStep:
    """One speculative step's inputs (``B`` rows, sequences of ``L`` columns, blocks of ``K``).

    :ivar tokens: ``(B, L)`` long, every row's current sequence.
    :ivar attention_mask: ``(B, L)`` the rows' attention mask (padding excluded).
    :ivar block: ``(B, K)`` long, the rows' active blocks.
    :ivar decoding: ``(B,)`` bool, the rows still decoding.
    :ivar known: ``(B,)`` bool, the rows whose last distribution ``previous`` is the one a
        forward on their current state gives (a draft may start from it).
    :ivar previous: ``(B, K, V)`` the rows' last distributions, or ``None``.
    :ivar forward: the caller's model runner.
    :ivar kernel: the transition kernel's step (commit rule and sampler).
    :ivar plan: this step's forward plan.
    :ivar counts: the caller's counters.
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    block: torch.Tensor
    decoding: torch.Tensor
    known: torch.Tensor
    previous: torch.Tensor | None
    forward: BlockForwards
    kernel: KernelStep
    plan: ForwardPlan
    counts: VerificationCounts


@dataclass(frozen=True)
class StepOutcome:
    """What a speculative step did.

    :ivar block: ``(B, K)`` long, the new blocks.
    :ivar logits: ``(B, K, V)`` each row's last distribution.
    :ivar accepted: ``(B,)`` drafts each row accepted (``None`` when nothing was drafted).
    :ivar primed: ``(B,)`` bool, rows whose next block's first step can be taken from
        ``next_logits`` without a forward (``None`` when the verification carried no
        next-block logits: with a cache, or without drafts).
    :ivar next_logits: ``(B, K, V)`` those rows' next-block distributions, or ``None``.
    """

    block: torch.Tensor
    logits: torch.Tensor
    accepted: torch.Tensor | None = None
    primed: torch.Tensor | None = None
    next_logits: torch.Tensor | None = None
