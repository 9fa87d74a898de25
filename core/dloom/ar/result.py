"""What :class:`~dloom.ar.decoder.ARTargetDecoder` returns: a result with the drafter's counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from dloom.metrics import GenerationResult


@dataclass
class ARTargetResult(GenerationResult):
    """A :class:`~dloom.GenerationResult` of speculative decoding against an AR target.

    ``nfe`` counts the *target's* forwards per row (prefill included), ``forwards`` the
    target's batch forwards; the drafter's are separate. ``hook_seconds`` holds
    ``target_forward`` (the target model), the decoding hooks' own times (``draft``, its
    drafter's forwards included, ``prune``, ``build_mask``, ``verify``) and the parts a
    drafter reports (:attr:`dloom.types.DraftChains.seconds`, e.g. ``drafter_forward`` and
    ``select_commit``).

    :ivar drafter_nfe: ``(B,)`` long, drafter forwards in which each row was drafting.
    :ivar drafter_forwards: drafter batch forwards.
    :ivar accepted: per row, the draft tokens accepted in each of its rounds.
    :ivar proposed: per row, the draft tokens proposed in each of its rounds.
    :ivar drafting: how the batch was decoded: ``path`` ``"drafted"`` (every token verified
        in a drafting round) or ``"target alone"`` (the strategy stopped drafting: the tokens
        after ``drafted_rounds`` rounds came from the target's plain autoregressive loop), and
        the strategy's last reported decision (:attr:`dloom.types.DraftChains.decision`,
        e.g. ``break_even_ratio`` and ``measured_ratio``).
    """

    drafter_nfe: torch.Tensor | None = None
    drafter_forwards: int = 0
    accepted: list[list[int]] = field(default_factory=list)
    proposed: list[list[int]] = field(default_factory=list)
    drafting: dict[str, Any] = field(default_factory=lambda: {"path": "drafted"})

    @property
    def acceptance_histogram(self) -> dict[int, int]:
        """Rounds by number of accepted draft tokens, ``{accepted: rounds}``."""
        counts = Counter(a for row in self.accepted for a in row)
        return dict(sorted(counts.items()))

    @property
    def accepted_per_round(self) -> float:
        """Mean accepted draft tokens per verification (the acceptance: accepted draft tokens over verification rounds)."""
        rounds = [a for row in self.accepted for a in row]
        return sum(rounds) / len(rounds) if rounds else 0.0

    @property
    def proposed_per_round(self) -> float:
        rounds = [k for row in self.proposed for k in row]
        return sum(rounds) / len(rounds) if rounds else 0.0

    def summary(self) -> dict[str, Any]:
        data = super().summary()
        data.update(
            target_forwards=self.forwards,
            target_nfe_mean=data["nfe_mean"],
            drafter_forwards=self.drafter_forwards,
            drafter_nfe_mean=float(self.drafter_nfe.double().mean()) if self.drafter_nfe is not None else 0.0,
            rounds=sum(len(row) for row in self.accepted),
            accepted_per_round=self.accepted_per_round,
            proposed_per_round=self.proposed_per_round,
            accepted_histogram={str(k): v for k, v in self.acceptance_histogram.items()},
            drafting=dict(self.drafting),
        )
        return data

    @property
    def speculation(self) -> dict[str, Any] | None:
        """The acceptance figures (:attr:`dloom.GenerationResult.speculation`) with
        :attr:`drafting`."""
        figures = super().speculation
        return None if figures is None else {**figures, "drafting": dict(self.drafting)}
