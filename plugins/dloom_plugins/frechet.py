"""Fréchet profile decoding (Fast-dLLM++): commit the longest certified prefix.

Sort the masked positions of the active block by confidence, ``c_(1) >= c_(2) >= ...``. For
the ``n`` most confident positions, with ``c`` the probability the model gives each greedy
token (see ``docs/strategies.md``, "frechet"):

* ``L_n = max(0, 1 - sum_{j<=n} (1 - c_(j)))``: the chance that all ``n`` greedy tokens are
  right together is at least one minus the chances that each is wrong (a union bound; it is
  the Fréchet–Hoeffding lower bound ``sum_j c_(j) - (n - 1)`` written as a deficit). It is
  sharp: some joint distribution with these marginals attains it.
* ``U_n = 1 - c_(n)``: a different tuple of tokens for those positions differs from the
  greedy one somewhere, so its probability is at most the chance that this position is
  wrong, hence at most ``1 - c_(n)`` (the least confident position is the likeliest to be wrong).
* ``G_n = L_n - U_n``: when ``G_n > 0`` the greedy tuple is more probable than every other
  tuple, i.e. it is the joint mode of those positions, whatever the (unknown) joint
  distribution behind the per-position marginals.

The rule commits the largest ``n`` with ``G_n > delta`` (at least one). ``G_n`` never grows
with ``n`` (adding a position lowers ``L`` and raises ``U``), so the passing prefixes are
exactly ``1..n``: one sort, one cumulative sum and one comparison per row, no loop.
When ``L_n > 0``, ``G_n = [(n + 1) c_(n) - n] + sum_{j<n} (c_(j) - c_(n))``: Fast-dLLM's
factor rule plus a non-negative bonus for uneven profiles; on a flat profile the rule is
exactly the factor rule with ``f = 1 - delta``.

The guarantee is about the model's own per-position distributions: it holds when the
confidence is the greedy token's probability (``temperature == 0``, ``low_confidence``
remasking). With other confidence kinds (Dream's margin or entropy) the rule still runs, but
the certificate is not a statement about probabilities. It is not lossless with respect to
one token per step: later forwards could change the later tokens' distributions.
"""

from __future__ import annotations

import torch

from dloom import BlockSchedule, Claim, Parameter, StrategyRegistration, hookimpl
from dloom.sdk import commit_top, offered_fills, sorted_profile, threshold_edits
from dloom_plugins.baselines import (
    EDITING_CLAIM,
    THRESHOLD_EDIT_PARAMETERS,
)


def frechet_bounds(
    sorted_confidence: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bounds ``L_n``, ``U_n`` and the gap ``G_n = L_n - U_n`` of every prefix.

    Column ``n - 1`` describes the ``n`` most confident positions. ``L`` is computed from
    the running deficit ``sum (1 - c)``: ``1 - c`` is exact for confidences near one, where
    it matters, and with a sequential cumulative sum (as on CPU) ``G`` is non-increasing in
    floating point too, not only on paper. The rule does not rely on it: it commits the
    largest passing prefix.

    :param sorted_confidence: ``(B, K)`` each row sorted descending, ``-inf`` past its
        selectable positions (as :func:`dloom.decode.commit.sorted_profile` returns it).
    :return: ``L``, ``U``, ``G``, each ``(B, K)`` float64. Past the selectable positions
        ``L = 0``, ``U = inf`` and ``G = -inf``, so those prefixes never pass.
    """
    wrong = 1.0 - sorted_confidence.to(torch.float64)
    lower = (1.0 - torch.cumsum(wrong, dim=-1)).clamp(min=0.0)
    return lower, wrong, lower - wrong


DEFAULT_DELTA = 0.5
"""The margin ``frechet`` uses when none is given, chosen on a dev split: on
``long-dllm-words``' 300 dev prompts (held-out prompts apart from those any report scores,
``benchmarks/operating_points.py``), the δ of the fewest forwards within one point of one
token per step's accuracy (96.3 % in 11.05 forwards against 97.0 %; the paper's default 0.25
fell 1.3 points short there). Scored on 300 other held-out prompts it reaches 93.3 % in
11.16 forwards against 95.7 % (``docs/benchmarks/operating-points.md``)."""


class FrechetCommit:
    """Commit the largest prefix ``n`` of the sorted profile with ``L_n - U_n > delta``.

    ``delta = 0`` commits exactly when the greedy tuple is certified as the joint mode; a
    positive ``delta`` demands that its probability beat every other tuple's by more than
    ``delta`` (the registered default is :data:`DEFAULT_DELTA`). The single position
    committed when no prefix passes is the most confident one, the mode of its own distribution.
    """

    def __init__(self, delta: float) -> None:
        self.delta = delta

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        values, ranks = sorted_profile(confidence, selectable)
        _, _, gap = frechet_bounds(values)
        sizes = torch.arange(1, gap.shape[-1] + 1, device=gap.device)
        largest = torch.where(gap > self.delta, sizes, 0).amax(-1)
        return commit_top(ranks, selectable, largest)


class FrechetEditCommit:
    """Certified fills, threshold edits: on the revisable kernel, fill the largest prefix of
    the masked positions' sorted profile with ``L_n - U_n > delta`` (as :class:`FrechetCommit`)
    and rewrite every filled position whose candidate differs from its token with confidence
    above ``edit_tau``, for up to ``max_post_steps`` post steps (LLaDA2.1's edits,
    :func:`dloom.sdk.threshold_edits`).

    The fills keep the Fréchet certificate of the step they are made in: each committed
    prefix is the joint mode of its positions under the model's marginals at that step. An
    edit may later replace a token with the model's new candidate, so the final tokens carry
    no certificate of their own: what the edits add is a repair of fills that later context
    contradicts. With ``edit_tau = 1`` (no edit can pass) it decodes exactly as ``frechet``.
    """

    def __init__(self, delta: float, edit_tau: float, max_post_steps: int) -> None:
        self.fill = FrechetCommit(delta)
        self.edit_tau, self.max_post_steps = edit_tau, max_post_steps

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        masked = offered_fills(selectable, schedule)
        fills = masked & self.fill.dloom_select_commit(confidence, masked, schedule)
        return fills | threshold_edits(confidence, selectable, schedule, self.edit_tau, self.max_post_steps)


@hookimpl
def dloom_register_strategies(register) -> None:
    register(
        StrategyRegistration(
            name="frechet",
            plugin_class=FrechetCommit,
            parameters=(
                Parameter(
                    "delta", DEFAULT_DELTA, float,
                    "commit the largest n with L_n - U_n > delta (0: certified joint mode; "
                    "the default kept one token per step's accuracy within a point on a dev split)",
                    low=0.0, high=1.0, high_open=True,
                ),
            ),
            guarantee=(
                "proven bound (greedy, probability confidences): every committed prefix of "
                "n >= 2 tokens has L_n - U_n > delta >= 0, so it is the joint mode of its "
                "positions (jointly right with probability >= L_n) under every joint "
                "distribution with the model's per-position marginals; not lossless with "
                "respect to one token per step"
            ),
            summary=(
                "Fast-dLLM++: largest prefix n of the sorted profile with "
                "max(0, sum c - (n - 1)) - (1 - c_(n)) > delta"
            ),
            claim=Claim(
                "bound", bound="frechet", bound_function=frechet_bounds,
                conditions=(
                    "joint-mode certificate: temperature 0, low_confidence remasking (the "
                    "confidence is the greedy token's probability)"
                ),
            ),
            kernels=("absorbing", "revisable"),  # a fill rule
        )
    )
    register(
        StrategyRegistration(
            name="frechet_edit",
            plugin_class=FrechetEditCommit,
            parameters=(
                Parameter(
                    "delta", DEFAULT_DELTA, float, "fill the largest n with L_n - U_n > delta (as frechet)",
                    low=0.0, high=1.0, high_open=True,
                ),
                *THRESHOLD_EDIT_PARAMETERS,
            ),
            guarantee=(
                "each step's fills are the joint mode of their positions (the frechet certificate, greedy, "
                "probability confidences); edits then rewrite fills that later context contradicts, so final "
                "tokens carry no certificate; edit_tau = 1 is exactly frechet"
            ),
            summary="Fréchet-certified fills with LLaDA2.1's threshold edits (revisable kernel)",
            claim=EDITING_CLAIM,
            kernels=("revisable",),
            edits=True,
            edit_budget="max_post_steps",
        )
    )
