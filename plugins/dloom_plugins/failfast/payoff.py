"""Whether drafting pays on this hardware: FailFast's ``drafting="auto"``.

Per row and round, drafting costs ``F`` drafter forwards of the row's canvas and one target
forward over the proposed chain (``L + 1`` tokens), and yields ``T`` tokens (the accepted
chain and the target's token after it). Plain target decoding yields one token per target
forward of one token. With ``c_t(n)`` the target's cost of an ``n``-token forward and
``c_d`` the drafter's of a canvas, drafting pays, by a margin ``g`` (:data:`MIN_GAIN`), when

    ``T / (F c_d + c_t(L + 1)) > g / c_t(1)``,  i.e.  ``c_d / c_t(1) < r* = (T / g - c_t(L + 1) / c_t(1)) / F``

``r*`` is the *break-even* drafter/target cost ratio, ``c_d / c_t(1)`` the measured one
(:func:`dloom.model.cost.measure_cost_curve` on both models: the target's forwards of ``n``
new tokens continuing its KV cache, as its decoding steps and verifications run, the
drafter's uncached forward over its canvas). ``T``, ``F`` and ``L`` are
this decoder's own, averaged over the rows of its first :data:`WARMUP_ROUNDS` drafted
rounds (kept on the device: one host read when the decision is taken). After that the
decoder drafts only if it pays; otherwise it hands the rest of the batch, and every later
batch, to the target alone: the ar-target decoder's plain autoregressive loop, one cached
forward per token with no drafting round around it, exactly the target's own decoding (the
target decides every token either way). The decision (:attr:`DraftingLedger.report`) is
reported in every later result's ``drafting``.
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

MIN_GAIN = 1.1
"""The expected speed-up over the target alone that drafting must reach: a drafting round's
own work (the drafter's commit rule, the chain layout, the verification, the cache crop) is
not in the forward costs."""


def break_even_ratio(
    tokens: float, drafter_forwards: float, proposed: float, target_cost: CostCurve
) -> float | None:
    """``r*`` (module docstring) for ``tokens`` per row-round, ``drafter_forwards`` per
    row-round and ``proposed`` chain tokens per row-round; ``None`` without drafter forwards
    (drafting then costs the drafter nothing)."""
    if drafter_forwards <= 0:
        return None
    return (tokens / MIN_GAIN - target_cost.relative(proposed + 1)) / drafter_forwards


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


COST_REPEATS, COST_WARMUP = 9, 5
"""Timed forwards per measured point (their median is kept) and untimed ones before, for
each model: the ratio decides the path of every later batch, so it is worth a few forwards."""

PROMPT_TOKENS = 64
"""The prompt length the drafter's canvas and the target's cache are measured with (the
decoder has no prompt yet)."""


def measured_ledger(config: Mapping[str, Any], settings: FailFastSettings) -> DraftingLedger:
    """A ledger with the target's and the drafter's forward costs measured on this machine
    (``config``: the ar-target decoder's, with ``target_model`` and ``drafter_model``)."""
    longest = min(settings.n_max, int(config["gen_length"])) + 1
    counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < longest} | {longest})
    target_cost = measure_cost_curve(
        config["target_model"], PROMPT_TOKENS, counts, layout="cached", repeats=COST_REPEATS, warmup=COST_WARMUP
    )
    canvas = PROMPT_TOKENS + int(config["gen_length"])
    drafter = measure_cost_curve(config["drafter_model"], canvas, (1,), repeats=COST_REPEATS, warmup=COST_WARMUP)
    return DraftingLedger(target_cost, drafter(1))


def target_alone(state_tokens: torch.Tensor, decision: Mapping[str, Any] | None) -> DraftChains:
    """Chains that propose nothing for ``B`` rows, now or later: the decoder decodes the rest
    of the batch with the target alone (its plain autoregressive loop), reporting ``decision``."""
    rows = state_tokens.shape[0]
    device = state_tokens.device
    return DraftChains(
        tokens=torch.zeros(rows, 1, dtype=torch.long, device=device),
        length=torch.zeros(rows, dtype=torch.long, device=device),
        open=torch.zeros(rows, dtype=torch.bool, device=device),
        target_alone=True, decision=decision,
    )
