"""The commit rule's hook contract, probed directly (every ``dloom check`` runs it first).

``dloom_select_commit`` must return a ``(B, K)`` bool tensor that is a subset of
``selectable`` and holds at least one position in every row that has a selectable one
(:func:`dloom.hooks.specs.dloom_select_commit`). The decoder restricts a rule's answer to
``selectable`` (a commit to an already-decoded position is dropped), so a rule that breaks
the subset rule can decode without an error, and its bug shows only when a row comes out
empty. The probe calls the rule as the kernel does, on seeded random blocks from fully
masked to complete (with the signals the rule declared, and, for a rule that runs only on
the revisable kernel, the schedule that kernel gives: ``masked`` and ``post_steps``), and
reports the first break it sees.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dloom.check.resolve import Resolved
from dloom.decode.kernel import commit_signals, propose
from dloom.decode.transition import ABSORBING, common_kernel, editing_rule
from dloom.hooks import calls as hooks
from dloom.hooks.composition import build_plugin_manager, compose
from dloom.types import BlockSchedule, Edits

VOCAB = 6
MASK_ID = VOCAB  # one past the vocabulary: never a candidate
WIDTHS = (1, 2, 3, 4, 8)
ROWS = 4


@dataclass(frozen=True)
class ContractBreak:
    """A commit rule's answer that breaks the hook contract.

    :ivar problem: what was wrong, in one sentence.
    :ivar block_length: ``K`` of the probe block.
    :ivar steps_per_block: the schedule's step budget.
    :ivar step: the step in the block at which it happened.
    :ivar row: the row (of ``ROWS``; the last one never has a selectable position).
    :ivar selectable: the row's selectable positions.
    :ivar committed: the row's answer as the rule gave it.
    :ivar empty: the row committed no position although it had selectable ones (a step
        that fills nothing), rather than a position that was not selectable.
    """

    problem: str
    block_length: int
    steps_per_block: int
    step: int
    row: int
    selectable: list[bool]
    committed: list[bool]
    empty: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def probe_commit_rule(strategy: Resolved, seed: int = 0) -> ContractBreak | None:
    """Run ``strategy``'s commit rule through whole blocks of every width in :data:`WIDTHS`
    and step budgets 1, 2 and ``K``: ``ROWS - 1`` rows decode from random logits (vocabulary
    :data:`VOCAB`, greedy ``low_confidence`` candidates), the last row has nothing
    selectable (a finished row).

    :return: the first :class:`ContractBreak`, or ``None`` when the rule kept the contract
        (also when the strategy has no commit rule).
    :raises HookContractError: when the rule raises or returns something that is not a
        ``(B, K)`` bool tensor (the same error the decoder raises).
    """
    composition = compose(strategy.spec, strategy.params)
    if composition.provider("dloom_select_commit") is None:
        return None
    pm = build_plugin_manager(composition)
    revisable = common_kernel(composition) != ABSORBING
    edits = editing_rule(composition) is not None
    generator = torch.Generator().manual_seed(seed)
    for width in WIDTHS:
        for steps_per_block in sorted({1, 2, width}):
            found = _probe_block(pm, width, steps_per_block, generator, revisable, edits)
            if found is not None:
                return found
    return None


def _probe_block(
    pm, width: int, steps_per_block: int, generator: torch.Generator, revisable: bool, edits: bool,
) -> ContractBreak | None:
    """Decode one block of ``width`` positions for ``ROWS`` rows with the rule; ``revisable``:
    with the revisable kernel's schedule (the masked positions, no post step yet); ``edits``:
    an editing rule, whose answer may be an :class:`~dloom.types.Edits` (its commits are probed)."""
    block = torch.full((ROWS, width), MASK_ID, dtype=torch.long)
    block[-1] = 0  # a finished row: nothing selectable
    masked_at_start = (block == MASK_ID).sum(-1)
    for step in range(width):
        selectable = block == MASK_ID
        if not bool(selectable.any()):
            return None
        logits = torch.randn(ROWS, width, VOCAB + 1, generator=generator, dtype=torch.float64) * 3
        candidates, confidence = propose(logits, 0.0, "low_confidence", None, MASK_ID)
        schedule = BlockSchedule(
            torch.full((ROWS,), min(step, steps_per_block - 1), dtype=torch.long), steps_per_block,
            masked_at_start, masked=selectable.clone() if revisable else None,
            post_steps=torch.zeros(ROWS, dtype=torch.long) if revisable else None,
        )
        names = hooks.declared_signals(pm)
        signals = commit_signals(logits, candidates, block, names, MASK_ID) if names else None
        ask = hooks.proposed_edits if edits else hooks.proposed_commit
        reply = ask(pm, confidence, selectable.clone(), schedule, signals)
        answer = reply.commit if isinstance(reply, Edits) else reply
        stray = answer & ~selectable
        empty = selectable.any(-1) & ~(answer & selectable).any(-1)
        for row in range(ROWS):
            problem = None
            if bool(stray[row].any()):
                positions = torch.nonzero(stray[row]).flatten().tolist()
                what = "already decoded" + ("" if bool(selectable[row].any()) else ", in a row with nothing selectable")
                problem = (
                    f"committed position(s) {positions} that were not selectable ({what}); "
                    "the decoder drops such commits: commit a subset of selectable"
                )
            elif bool(empty[row]):
                problem = "committed no position in a row that had masked positions; every step must commit at least one"
            if problem is not None:
                return ContractBreak(
                    problem, width, steps_per_block, step, row, selectable[row].tolist(),
                    answer[row].tolist(), empty=not bool(stray[row].any()),
                )
        block = torch.where(answer & selectable, candidates, block)
    return None

