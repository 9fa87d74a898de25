"""One step of a running batch, plain or speculative, behind one interface.

A step's inputs are a :class:`StepInput` and its result a :class:`StepOutcome`; a
:class:`Stepper` turns one into the other. Two steppers exist: :class:`PlainStepper` (one
forward of every row, then the transition kernel) and :class:`SpeculativeStepper` (the
strategy's draft, prune, build_mask and verify around one verification forward). Their
callers, :class:`~dloom.decode.session.DecodeSession` over a running batch's blocks and
FailFast's drafter over each row's small block, call both the same way, each with its own
model runner (:class:`BlockForwards`: the session's :class:`~dloom.model.runner.BlockForward`,
the drafter's); a stepper reads nothing else of its caller and writes nothing of it: what a
step did (the drafts accepted, whether it verified, whether its layout was exact) comes back
in the outcome, for the caller to count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import pluggy
import torch

from dloom.decode.speculation import (
    evaluate_in_parts,
    layout_is_exact,
    static_call_rows,
)
from dloom.hooks import calls as hooks
from dloom.metrics import ForwardClock
from dloom.types import DecodeState, NodeLogits, VerificationLayout

if TYPE_CHECKING:
    from dloom.decode.transition import TransitionKernel
    from dloom.model.cache_policy import CachePolicy


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

    def run_next(
        self, tokens: torch.Tensor, n_full: int, first_window: int, last_window: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run` without a cache, also returning ``(B, K, V)`` logits of the ``K``
        columns after each row's block (:meth:`dloom.model.runner.BlockForward.run_next`)."""

    def evaluate(self, tokens: torch.Tensor, layout: VerificationLayout, first_window: int) -> torch.Tensor:
        """One verification forward over ``layout``'s rows: the nodes' logits."""

    def query_width(self, first_window: int) -> int:
        """Columns one layout row's forward computes in :meth:`evaluate`."""


class ForwardPlan(NamedTuple):
    """Which rows take a full forward and which columns' logits a step keeps
    (:meth:`dloom.model.runner.BlockForward.plan`)."""

    n_full: int
    first_window: int
    last_window: int


@dataclass(frozen=True)
class StepInput:
    """One step's inputs (``B`` rows, sequences of ``L`` columns, blocks of ``K``).

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
    :ivar next_block: the forward also reads each row's next block's logits, so that a row
        whose step settles its block unchanged moves on primed (:class:`PlainStepper`); set
        only on an uncached forward of dynamic shapes, on a step in which some row's block
        may hold no mask.
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    block: torch.Tensor
    decoding: torch.Tensor
    known: torch.Tensor
    previous: torch.Tensor | None
    forward: BlockForwards
    kernel: TransitionKernel
    plan: ForwardPlan
    next_block: bool = False


@dataclass(frozen=True)
class StepOutcome:
    """What a step did.

    :ivar block: ``(B, K)`` long, the new blocks.
    :ivar logits: ``(B, K, V)`` each row's last distribution.
    :ivar accepted: ``(B,)`` drafts each row accepted (``None`` when nothing was drafted).
    :ivar primed: ``(B,)`` bool, rows whose next block's first step can be taken from
        ``next_logits`` without a forward (``None`` when the step's forward carried no
        next-block logits: with a cache, or a step neither verifying drafts nor reading
        the next block, :attr:`StepInput.next_block`).
    :ivar next_logits: ``(B, K, V)`` those rows' next-block distributions, or ``None``.
    :ivar verified: the step's forward verified drafts (a verification forward).
    :ivar layout_exact: that verification's layout gave every draft its exact distribution
        (:func:`~dloom.decode.speculation.layout_is_exact`; ``True`` without a verification).
    """

    block: torch.Tensor
    logits: torch.Tensor
    accepted: torch.Tensor | None = None
    primed: torch.Tensor | None = None
    next_logits: torch.Tensor | None = None
    verified: bool = False
    layout_exact: bool = True


class Stepper(Protocol):
    """One step of every row of a :class:`StepInput`."""

    def __call__(self, step: StepInput) -> StepOutcome:
        """The step's :class:`StepOutcome`."""


class PlainStepper:
    """One forward of every row, then one kernel step of the decoding rows.

    With :attr:`StepInput.next_block` the forward also reads the next block's logits, and
    the rows whose step was a post step that left their block unchanged
    (:meth:`~dloom.decode.transition.TransitionKernel.unchanged_post_steps`) come back
    ``primed``: their tokens are those the forward read, so its logits at the next block's
    columns are the distribution the row's first step there would read from a forward of
    its own (the caller keeps those of the rows that move on).

    :param clock: times the forward (the decoder's :class:`~dloom.metrics.ForwardClock`).
    """

    def __init__(self, clock: ForwardClock) -> None:
        self.clock = clock

    def __call__(self, step: StepInput) -> StepOutcome:
        if not step.next_block:
            logits, _ = self.clock.timed(step.forward.run, step.tokens, *step.plan)
            return StepOutcome(step.kernel(step.block, logits, step.decoding), logits)
        logits, following = self.clock.timed(step.forward.run_next, step.tokens, *step.plan)
        block = step.kernel(step.block, logits, step.decoding)
        unchanged = step.kernel.unchanged_post_steps()
        assert unchanged is not None, "next-block logits asked of a kernel that takes no post step"
        return StepOutcome(block, logits, primed=unchanged & step.decoding, next_logits=following)


class SpeculativeStepper:
    """One step of a speculative composition: rows due a full forward (block start with a
    cache) take a plain step on it; the others are verified in one forward over their roots
    and drafts (rows without a known distribution evaluate their root only). Without a
    draft graph (the strategy drafted nothing) it is a plain step.

    :param pm: the decoder's plugin manager (its draft, prune, build_mask and verify hooks).
    :param clock: times the forwards.
    :param cache: the decoder's cache policy (:class:`~dloom.model.cache_policy.CachePolicy`).
    :param attention: the model's attention kind (whether a layout is exact depends on it).
    :param block_length: ``K``.
    :param mask_token_id: the mask id.
    :param draft_budget: the most drafts per row one verification may evaluate (``None``:
        the strategy's own budget).
    :param static_shapes: pad every model call of a verification to one shape
        (:func:`~dloom.decode.speculation.static_call_rows`).
    """

    def __init__(
        self, pm: pluggy.PluginManager, clock: ForwardClock, cache: CachePolicy, attention: str,
        block_length: int, mask_token_id: int, draft_budget: int | None, static_shapes: bool,
    ) -> None:
        self.pm, self.clock = pm, clock
        self.cache, self.attention = cache, attention
        self.block_length, self.mask_token_id = block_length, mask_token_id
        self.draft_budget, self.static_shapes = draft_budget, static_shapes

    def __call__(self, step: StepInput) -> StepOutcome:
        x, decoding, forward, kernel = step.tokens, step.decoding, step.forward, step.kernel
        n_full, first_window, last_window = step.plan
        full_logits, full_rows = None, torch.zeros_like(decoding)
        if self.cache.records and n_full:
            full_logits, full_rows = self.clock.timed(forward.run, x, n_full, first_window, last_window, False)
        state = DecodeState(
            tokens=x, attention_mask=step.attention_mask, block_start=forward.start,
            block_end=forward.start + self.block_length, mask_token_id=self.mask_token_id,
            active=decoding & ~full_rows, logits=step.previous, span_start=forward.window_start,
            known=step.known & ~full_rows, width=self.block_length, span_lead=forward.shift,
        )
        graph = hooks.draft(self.pm, state)
        if graph is None:
            rest, _ = self.clock.timed(forward.run, x, 0, first_window, last_window)
            logits = rest if full_logits is None else torch.where(full_rows[:, None, None], full_logits, rest)
            return StepOutcome(kernel(step.block, logits, decoding), logits)
        graph = hooks.prune(self.pm, graph, self.draft_budget)
        layout = hooks.build_mask(self.pm, state, graph)
        call_rows = max(x.shape[0], layout.call_tokens // forward.query_width(first_window))  # a rows layout has a row per draft
        run = evaluate_in_parts
        if self.static_shapes:  # every model call of the verification one shape
            run = functools.partial(evaluate_in_parts, static_rows=static_call_rows(layout, call_rows))
        outputs = self.clock.timed(run, forward.evaluate, x, layout, first_window, call_rows)
        verdict = hooks.verify(self.pm, state, graph, NodeLogits(outputs, layout, self.block_length), kernel)
        exact = layout_is_exact(layout, self.cache, self.attention)
        if full_logits is None:
            return StepOutcome(
                verdict.block, verdict.logits, verdict.accepted, verdict.primed,
                None if verdict.primed is None else verdict.next_logits, verified=True, layout_exact=exact,
            )
        stepped = kernel(step.block, full_logits, full_rows & decoding)
        # next-block logits come from a verification without a cache only
        return StepOutcome(
            torch.where(full_rows[:, None], stepped, verdict.block),
            torch.where(full_rows[:, None, None], full_logits, verdict.logits),
            verdict.accepted, verified=True, layout_exact=exact,
        )
