"""Whether drafting pays on this hardware: FailFast's ``drafting="auto"``.

Per row and round, drafting costs ``F`` drafter forwards of the row's canvas and one target
forward over the proposed chain (``L + 1`` tokens), and yields ``T`` tokens (the accepted
chain and the target's token after it). Plain target decoding yields one token per target
forward of one token. With ``c_t(n)`` the target's cost of an ``n``-token forward and
``c_d`` the drafter's of a canvas, drafting pays when

    ``T / (F c_d + c_t(L + 1)) > 1 / c_t(1)``,  i.e.  ``c_d / c_t(1) < r* = (T - c_t(L + 1) / c_t(1)) / F``

``r*`` is the *break-even* drafter/target cost ratio, ``c_d / c_t(1)`` the measured one
(:func:`dloom.model.cost.measure_cost_curve` on both models, uncached forwards: the
target's over ``n`` tokens, the drafter's over its canvas). ``T``, ``F`` and ``L`` are
this decoder's own, averaged over the rows of its first :data:`WARMUP_ROUNDS` drafted
rounds (kept on the device: one host read when the decision is taken). After that the
decoder drafts only if it pays; otherwise every later round proposes nothing and the target
decodes one token per forward, exactly its own decoding (the target decides every token
either way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dloom.sdk import ChainVerdict, CostCurve, DraftChains, measure_cost_curve

from .settings import FailFastSettings

WARMUP_ROUNDS = 4
"""Drafted rounds (batch rounds) a ``drafting="auto"`` decoder measures before deciding."""


def break_even_ratio(
    tokens: float, drafter_forwards: float, proposed: float, target_cost: CostCurve
) -> float | None:
    """``r*`` (module docstring) for ``tokens`` per row-round, ``drafter_forwards`` per
    row-round and ``proposed`` chain tokens per row-round; ``None`` without drafter forwards
    (drafting then costs the drafter nothing)."""
    if drafter_forwards <= 0:
        return None
    return (tokens - target_cost.relative(proposed + 1)) / drafter_forwards


@dataclass
class DraftingLedger:
    """Totals of the drafted rounds and the decision they lead to.

    :ivar target_cost: the target's seconds against the tokens of one forward.
    :ivar drafter_seconds: the drafter's seconds for one forward of one row's canvas.
    """

    target_cost: CostCurve
    drafter_seconds: float
    rounds: int = 0
    totals: torch.Tensor | None = None  # (4,) float64: row-rounds, tokens, drafter row-forwards, proposed
    drafting: bool = True
    report: dict[str, Any] | None = None

    @property
    def measured_ratio(self) -> float:
        """``c_d / c_t(1)``."""
        return self.drafter_seconds / self.target_cost(1)

    def record(self, chains: DraftChains, verdict: ChainVerdict, active: torch.Tensor) -> None:
        """Add one verified round (no host synchronisation)."""
        rows = active.to(torch.float64)
        forwards = chains.drafter_nfe if chains.drafter_nfe is not None else torch.zeros_like(chains.length)
        row = torch.stack([
            rows.sum(), ((verdict.accepted + 1) * rows).sum(), (forwards * rows).sum(), (chains.length * rows).sum(),
        ]).to(torch.float64)
        self.totals = row if self.totals is None else self.totals + row
        self.rounds += 1

    def decide(self) -> bool:
        """Whether the next round drafts: yes until :data:`WARMUP_ROUNDS` rounds are
        recorded, then (once, one host read) whether the measured ratio is below the
        break-even one."""
        if self.report is not None or self.rounds < WARMUP_ROUNDS or self.totals is None:
            return self.drafting
        row_rounds, tokens, forwards, proposed = self.totals.tolist()
        row_rounds = max(row_rounds, 1.0)
        per = {"tokens": tokens / row_rounds, "drafter_forwards": forwards / row_rounds,
               "proposed": proposed / row_rounds}
        break_even = break_even_ratio(per["tokens"], per["drafter_forwards"], per["proposed"], self.target_cost)
        self.drafting = break_even is None or self.measured_ratio < break_even
        self.report = {
            "rounds": self.rounds, "per_row_round": per, "measured_ratio": self.measured_ratio,
            "break_even_ratio": break_even, "drafting": self.drafting,
        }
        return self.drafting


PROMPT_TOKENS = 64
"""The prompt length the drafter's canvas is measured with (the decoder has no prompt yet)."""


def measured_ledger(config: Mapping[str, Any], settings: FailFastSettings) -> DraftingLedger:
    """A ledger with the target's and the drafter's forward costs measured on this machine
    (``config``: the ar-target decoder's, with ``target_model`` and ``drafter_model``)."""
    longest = min(settings.n_max, int(config["gen_length"])) + 1
    counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < longest} | {longest})
    target_cost = measure_cost_curve(config["target_model"], 1, counts, layout="packed", span=1)
    canvas = PROMPT_TOKENS + int(config["gen_length"])
    drafter = measure_cost_curve(config["drafter_model"], canvas, (1,))
    return DraftingLedger(target_cost, drafter(1))


def no_chains(state_tokens: torch.Tensor) -> DraftChains:
    """Chains that propose nothing for ``B`` rows: the target decodes one token per row."""
    rows = state_tokens.shape[0]
    device = state_tokens.device
    return DraftChains(
        tokens=torch.zeros(rows, 1, dtype=torch.long, device=device),
        length=torch.zeros(rows, dtype=torch.long, device=device),
        open=torch.zeros(rows, dtype=torch.bool, device=device),
    )
