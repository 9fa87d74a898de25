"""Baseline commit rules: LLaDA's quota, Dream's schedule, Fast-dLLM's threshold and
factor rules, LLaDA2.1's joint threshold (fills and edits), WINO (draft low, remask
suspicious tokens) and the entropy bound (EB-sampler; DiffusionGemma's acceptance).

Each is a ``dloom_select_commit`` implementation, vectorised over the batch (see
``docs/strategies.md``). Every rule commits at least one masked position per row that has
one. The fill rules run on the absorbing and the revisable kernel (where, without edits,
they decode exactly as on the absorbing one); the joint threshold and WINO edit, so they
need the revisable kernel.
"""

from __future__ import annotations

import torch

from dloom import (
    BlockSchedule,
    Claim,
    Edits,
    Parameter,
    StrategyRegistration,
    hookimpl,
    reads_signals,
)
from dloom.sdk import (
    ConfigurationError,
    commit_top,
    offered_fills,
    sorted_profile,
    threshold_edits,
)


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


def dream_counts(masked: int, steps: int, eps: float) -> list[int]:
    """Positions Dream's ``diffusion_generate`` commits at each of ``steps`` steps, starting
    from ``masked``: ``int(n * (1 - t[i + 1] / t[i]))`` of the ``n`` still masked, with
    ``t = linspace(1, eps, steps + 1)`` in float32 as Dream computes it, and all that remain
    at the last step."""
    times = torch.linspace(1, eps, steps + 1)
    counts = []
    for i in range(steps):
        count = masked if i == steps - 1 else int(masked * (1 - times[i + 1] / times[i]))
        counts.append(count)
        masked -= count
    return counts


class DreamCommit:
    """Dream's schedule: the highest-confidence positions, as many per step as Dream's
    ``diffusion_generate`` unmasks (:func:`dream_counts` over the block's step budget).

    Where Dream's count is 0 its step changes nothing (the next forward sees the same state),
    so this rule skips such steps: it commits Dream's tokens in fewer forwards. Dream's
    ``maskgit_plus`` ranks by probability (``remasking="low_confidence"``), its ``entropy``
    by negative entropy (``remasking="entropy"``).

    :param eps: the last timestep of Dream's schedule (its ``eps``, 1e-3 by default).
    """

    def __init__(self, eps: float) -> None:
        self.eps = eps
        self._tables: dict[tuple[int, int, str], torch.Tensor] = {}

    def _table(self, width: int, steps: int, device: torch.device) -> torch.Tensor:
        """``(width + 1, steps)`` long: row ``m`` holds the nonzero counts of Dream's
        schedule from ``m`` masked positions, in order, then zeros."""
        key = (width, steps, str(device))
        if key not in self._tables:
            table = torch.zeros(width + 1, steps, dtype=torch.long)
            for masked in range(width + 1):
                counts = [c for c in dream_counts(masked, steps, self.eps) if c]
                table[masked, : len(counts)] = torch.tensor(counts, dtype=torch.long)
            self._tables[key] = table.to(device)
        return self._tables[key]

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        table = self._table(selectable.shape[-1], schedule.steps_per_block, selectable.device)
        step = schedule.step_in_block.clamp(max=schedule.steps_per_block - 1)
        quota = table[schedule.masked_at_block_start.clamp(max=table.shape[0] - 1), step]
        _, ranks = sorted_profile(confidence, selectable)
        return commit_top(ranks, selectable, quota.clamp(min=1))


FILL_KERNELS = ("absorbing", "revisable")
"""The kernels a fill rule runs on (:data:`dloom.decode.transition.KERNELS`)."""

DEFAULT_TAU = 0.7
"""The threshold ``threshold`` uses when none is given, chosen on a dev split: on
``long-dllm-words``' 300 dev prompts (``benchmarks/operating_points.py``), the τ of the
fewest forwards within one point of one token per step's accuracy (96.0 % in 10.31 forwards
against 97.0 %). On 300 other held-out prompts it scores 93.0 % in 10.41 forwards against
95.7 % in 46.65, where Fast-dLLM's 0.9 (its paper's choice for LLaDA-8B) scores 95.0 % in
12.18: pass ``tau=0.9`` where those 2 points matter."""


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


class JointThresholdCommit:
    """LLaDA2.1's joint threshold: fill masked positions above ``tau`` (mask to token) and
    rewrite filled ones whose candidate differs from their token above ``edit_tau`` (token
    to token), on the revisable kernel.

    Fills: every masked position with confidence above ``tau`` when there are at least
    ``num_to_transfer`` of them, else the ``num_to_transfer`` most confident. Edits: every
    offered filled position (the kernel offers those whose candidate differs from the
    current token) with confidence above ``edit_tau``, in any step of the block up to its
    ``max_post_steps``-th post step (a step begun with no mask in the block), after which the
    kernel settles the block (the registration's ``edit_budget``).
    """

    def __init__(self, tau: float, edit_tau: float, max_post_steps: int, num_to_transfer: int) -> None:
        self.tau, self.edit_tau = tau, edit_tau
        self.max_post_steps, self.num_to_transfer = max_post_steps, num_to_transfer

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        masked = offered_fills(selectable, schedule)
        above = masked & (confidence > self.tau)
        enough = above.sum(-1, keepdim=True) >= self.num_to_transfer
        _, ranks = sorted_profile(confidence, masked)
        fills = torch.where(enough, above, masked & (ranks < self.num_to_transfer))
        return fills | threshold_edits(confidence, selectable, schedule, self.edit_tau, self.max_post_steps)


THRESHOLD_EDIT_PARAMETERS = (
    Parameter(
        "edit_tau", 0.5, float,
        "rewrite a filled position whose candidate differs and whose confidence exceeds edit_tau (T2T; 1: no edits)",
        low=0.0, high=1.0,
    ),
    Parameter("max_post_steps", 16, int, "edit steps allowed once the block holds no mask", low=0),
)
"""The parameters of LLaDA2.1's threshold edits (:func:`dloom.sdk.threshold_edits`), for every
rule that edits with them."""
EDITING_CLAIM = Claim(
    "approximate", against="quota", conditions="an editing rule: tokens are final only when their block settles",
)


WINO_TAU = 0.6
"""WINO's wide-in threshold (Hong et al. 2025, "Wide-In, Narrow-Out"; its reference code's
``threshold`` for LLaDA): draft every masked position above it."""
WINO_REMASK_TAU = 0.9
"""WINO's narrow-out threshold (its reference code's ``threshold_back``): remask a drafted
token whose probability falls below it."""


class WinoCommit:
    """WINO (Hong et al. 2025, "Wide-In, Narrow-Out"): draft wide at a low threshold,
    then remask the drafts the model no longer believes, on the revisable kernel.

    In a fill step (the block still holds a mask):

    * wide in: fill every masked position whose confidence exceeds ``tau``, and at least the
      most confident one;
    * narrow out: remask every filled position whose current token's probability under this
      step's distribution (the ``token_probability`` signal) is below ``remask_tau``
      (:attr:`dloom.types.Edits.remask`). The kernel keeps at most ``n - 1`` remasks for
      ``n`` fills, the least probable first, and never remasks a prompt position or one
      filled in this step, so each fill step leaves fewer masks (WINO's own cap).

    Once the block holds no mask a remask is no longer possible: in each of up to
    ``max_post_steps`` post steps the rule rewrites every offered filled position (its
    candidate differs from its token) whose token's probability is below ``remask_tau``
    with the candidate. ``max_post_steps = 0`` (WINO's own decoding) leaves a block final
    once full.
    """

    def __init__(self, tau: float, remask_tau: float, max_post_steps: int) -> None:
        if not tau < remask_tau:
            raise ConfigurationError(
                f"strategy 'wino': tau is {tau} and remask_tau is {remask_tau}; allowed: tau < remask_tau "
                "(a draft goes in above tau and stays only above remask_tau)"
            )
        self.tau, self.remask_tau, self.max_post_steps = tau, remask_tau, max_post_steps

    @hookimpl
    @reads_signals("token_probability")
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule,
        signals: dict[str, torch.Tensor],
    ) -> torch.Tensor | Edits:
        masked = offered_fills(selectable, schedule)
        _, ranks = sorted_profile(confidence, masked)
        fills = masked & ((confidence > self.tau) | (ranks == 0))
        if schedule.masked is None or schedule.post_steps is None:  # the absorbing kernel: no edits offered
            return fills
        suspicious = ~schedule.masked & (signals["token_probability"] < self.remask_tau)
        fill_step = schedule.masked.any(-1, keepdim=True)
        in_budget = (schedule.post_steps <= self.max_post_steps).unsqueeze(1)
        rewrites = selectable & suspicious & ~fill_step & in_budget
        none = torch.zeros_like(selectable)
        return Edits(fills | rewrites, none, none, remask=suspicious & fill_step)


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


class EntropyBoundCommit:
    """The EB-sampler's entropy bound (Ben-Hamu et al. 2025, DiffusionGemma's
    ``EntropyBoundSampler``): commit the selectable positions in ascending order of entropy
    while the entropies committed before the last one sum to at most ``gamma``, that is the
    largest ``k`` with ``H_(1) + ... + H_(k) - H_(k) <= gamma``; the lowest-entropy position
    always passes, so every step commits at least one. On the uniform kernel the committed
    positions keep their sampled tokens and the others are renoised.
    """

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    @hookimpl
    @reads_signals("entropy")
    def dloom_select_commit(self, selectable: torch.Tensor, signals: dict[str, torch.Tensor]) -> torch.Tensor:
        entropy = signals["entropy"]
        ranked = torch.where(selectable, entropy, torch.inf)
        values, order = torch.sort(ranked, dim=-1)
        offered = torch.isfinite(values)
        before = torch.cumsum(torch.where(offered, values, 0), dim=-1) - torch.where(offered, values, 0)
        passes = offered & (before <= self.gamma)
        return torch.zeros_like(selectable).scatter(-1, order, passes)


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
            kernels=FILL_KERNELS,
        )
    )
    register(
        StrategyRegistration(
            name="dream",
            plugin_class=DreamCommit,
            parameters=(
                Parameter(
                    "eps", 1e-3, float, "the last timestep of Dream's schedule",
                    low=0.0, high=1.0, low_open=True, high_open=True,
                ),
            ),
            guarantee="reference kernel (Dream): Dream's own number of tokens per step",
            summary="Dream's schedule: int(n (1 - t_{i+1} / t_i)) tokens per step, steps that commit none skipped",
            claim=Claim(
                "approximate", against="quota",
                conditions="Dream's schedule, not LLaDA's: the same kernel with another number of tokens per step",
            ),
            kernels=FILL_KERNELS,
        )
    )
    register(
        StrategyRegistration(
            name="threshold",
            plugin_class=ThresholdCommit,
            parameters=(
                Parameter(
                    "tau", DEFAULT_TAU, float, "commit positions whose confidence exceeds tau",
                    low=0.0, high=1.0, low_open=True, high_open=True,
                ),
            ),
            guarantee="approximate: commits several tokens per forward; lossless only with respect to itself",
            summary="Fast-dLLM: commit every position with confidence > tau (at least one)",
            claim=Claim(
                "approximate", against="quota",
                conditions="several tokens per forward; agrees with quota only where the model is confident",
            ),
            kernels=FILL_KERNELS,
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
            kernels=FILL_KERNELS,
        )
    )
    register(
        StrategyRegistration(
            name="joint_threshold",
            plugin_class=JointThresholdCommit,
            parameters=(
                Parameter(
                    "tau", 0.7, float, "fill masked positions whose confidence exceeds tau (M2T)",
                    low=0.0, high=1.0, low_open=True, high_open=True,
                ),
                *THRESHOLD_EDIT_PARAMETERS,
                Parameter(
                    "num_to_transfer", 1, int, "fill at least this many positions per step", low=1,
                ),
            ),
            guarantee="approximate: fills several tokens per forward and may rewrite them later in the block",
            summary="LLaDA2.1: fill above tau, rewrite filled tokens above edit_tau (revisable kernel)",
            claim=EDITING_CLAIM,
            kernels=("revisable",),
            edits=True,
            edit_budget="max_post_steps",
        )
    )
    register(
        StrategyRegistration(
            name="wino",
            plugin_class=WinoCommit,
            parameters=(
                Parameter(
                    "tau", WINO_TAU, float, "draft masked positions whose confidence exceeds tau (wide in)",
                    low=0.0, high=1.0, low_open=True, high_open=True,
                ),
                Parameter(
                    "remask_tau", WINO_REMASK_TAU, float,
                    "remask a filled token whose probability is below remask_tau (narrow out; above tau)",
                    low=0.0, high=1.0, low_open=True,
                ),
                Parameter(
                    "max_post_steps", 0, int,
                    "post steps once the block holds no mask, rewriting tokens below remask_tau (0: none, as WINO)",
                    low=0,
                ),
            ),
            guarantee=(
                "approximate: drafts every masked position above tau and remasks filled tokens whose probability "
                "fell below remask_tau; each fill step leaves fewer masks, so a block ends within K fill steps "
                "plus max_post_steps"
            ),
            summary="WINO: draft above tau, remask filled tokens below remask_tau (revisable kernel)",
            claim=EDITING_CLAIM,
            kernels=("revisable",),
            edits=True,
            edit_budget="max_post_steps",
        )
    )
    register(
        StrategyRegistration(
            name="entropy_bound",
            plugin_class=EntropyBoundCommit,
            parameters=(
                Parameter(
                    "gamma", 0.1, float,
                    "commit in ascending entropy while the entropies before the last sum to at most gamma",
                    low=0.0, low_open=True, generation_key="sampler_config.entropy_bound",
                ),
            ),
            guarantee="approximate: commits as many tokens per forward as the entropy bound allows",
            summary="EB-sampler: lowest-entropy positions while their entropy sum (less the last) <= gamma",
            claim=Claim(
                "approximate", against="quota",
                conditions="several tokens per forward; the mutual information of a step's tokens is bounded by gamma",
            ),
            kernels=(*FILL_KERNELS, "uniform"),
        )
    )
