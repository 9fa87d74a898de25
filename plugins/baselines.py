"""Baseline commit rules: LLaDA's quota and Fast-dLLM's threshold and factor rules.

Each is a ``dloom_select_commit`` implementation, vectorised over the batch (see
``docs/strategies.md``). Every rule commits at least one selectable position per row.
"""

from __future__ import annotations

import torch

from dloom import BlockSchedule, Claim, Parameter, StrategyRegistration, hookimpl
from dloom.commit import commit_top, sorted_profile


class QuotaCommit:
    """LLaDA's fixed schedule: each step unmasks a quota of the highest-confidence positions.

    A block's masked positions are spread over ``steps_per_block`` steps: every step takes
    ``masked // steps_per_block`` and the first ``masked % steps_per_block`` steps take one
    more. With ``steps == gen_length`` this is one token per step.
    """

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        masked = schedule.masked_at_block_start
        quota = masked // schedule.steps_per_block + (
            schedule.step_in_block < masked % schedule.steps_per_block
        ).long()
        _, ranks = sorted_profile(confidence, selectable)
        return commit_top(ranks, selectable, quota)


class ThresholdCommit:
    """Fast-dLLM's threshold rule: commit every position with confidence above ``tau``."""

    def __init__(self, tau: float) -> None:
        self.tau = tau

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        _, ranks = sorted_profile(confidence, selectable)
        return selectable & ((confidence > self.tau) | (ranks == 0))


class FactorCommit:
    """Fast-dLLM's factor rule: the largest prefix ``n`` of the sorted profile with
    ``(n + 1) * (1 - c_(n)) < f`` (the formula, without the reference code's off-by-one)."""

    def __init__(self, f: float) -> None:
        self.f = f

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        values, ranks = sorted_profile(confidence, selectable)
        n = torch.arange(1, values.shape[-1] + 1, device=values.device, dtype=torch.float64)
        passes = (n + 1) * (1 - values) < self.f
        return commit_top(ranks, selectable, passes.sum(-1))


@hookimpl
def dloom_register_strategies(register) -> None:
    register(
        StrategyRegistration(
            name="quota",
            plugin_class=QuotaCommit,
            guarantee="reference kernel (LLaDA): the process every lossless claim is measured against",
            summary="LLaDA's fixed number of tokens per step (steps / blocks steps per block)",
            claim=Claim(
                "reference",
                conditions="the transition kernel K itself, at every temperature and remasking",
            ),
        )
    )
    register(
        StrategyRegistration(
            name="threshold",
            plugin_class=ThresholdCommit,
            parameters=(
                Parameter(
                    "tau", 0.9, float, "commit positions whose confidence exceeds tau",
                    low=0.0, high=1.0, low_open=True, high_open=True,
                ),
            ),
            guarantee="approximate: commits several tokens per forward; lossless only with respect to itself",
            summary="Fast-dLLM: commit every position with confidence > tau (at least one)",
            claim=Claim(
                "approximate", against="quota",
                conditions="several tokens per forward; agrees with quota only where the model is confident",
            ),
        )
    )
    register(
        StrategyRegistration(
            name="factor",
            plugin_class=FactorCommit,
            parameters=(
                Parameter(
                    "f", 1.0, float, "commit the largest n with (n + 1)(1 - c_(n)) < f",
                    low=0.0, low_open=True,
                ),
            ),
            guarantee="approximate: commits several tokens per forward; lossless only with respect to itself",
            summary="Fast-dLLM: largest prefix n of the sorted profile with (n + 1)(1 - c_(n)) < f",
            claim=Claim(
                "approximate", against="quota",
                conditions="several tokens per forward; agrees with quota only where the model is confident",
            ),
        )
    )
