"""Sampling losslessness: a strategy's empirical output distribution against the exact one.

For each seed ``k``: a tiny random dLLM (:func:`dloom.check.tiny.tiny_dllm`, seed ``k``,
vocabulary 6), a random prompt, and one of :data:`SETTINGS` (lengths and steps: one block
and several blocks). The reference's exact output
distribution comes from enumerating its kernel (:func:`~dloom.check.enumerate.exact_distribution`);
the strategy decodes ``samples`` copies of the prompt in one batch (rows sample
independently). A pooled Pearson chi-square test compares the two
(:func:`~dloom.check.stats.pooled_chi_square`); when its asymptotic p-value falls below
``alpha``, the p-value is simulated under the exact distribution instead (the asymptotic one
is too small far in the tail when bins expect only tens of counts).

Verdict, with ``alpha`` the significance and ``K`` seeds:

* ``not lossless``: some seed has ``p < alpha / K`` (Bonferroni: a lossless strategy is
  wrongly refuted with probability at most ``alpha``), or produced an output the reference
  never produces;
* ``lossless``: every seed has ``p >= alpha`` and the test's power at level ``alpha`` against
  every alternative at total-variation distance ``>= epsilon`` is at least ``min_power``
  (:func:`~dloom.check.stats.power`);
* ``inconclusive``: otherwise (too little power: raise ``samples``; or a p-value between
  ``alpha / K`` and ``alpha``: rerun with more samples or seeds).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from dloom.check.enumerate import exact_distribution
from dloom.check.resolve import Resolved
from dloom.check.stats import pooled_chi_square, power
from dloom.check.tiny import tiny_dllm, tiny_prompts
from dloom.engine import DiffusionDecoder

SETTINGS = (
    {"gen_length": 3, "block_length": 3, "steps": 3},
    {"gen_length": 4, "block_length": 2, "steps": 4},
    {"gen_length": 4, "block_length": 4, "steps": 4},
)
"""Decoder settings, cycled over the seeds: one block of 3, two blocks of 2, one of 4 (a block
of one position would be wasted on commit rules: every rule commits it alone)."""
CHUNK = 20_000
"""Rows per ``generate`` call (each chunk has its own sampler seed)."""


def replicates(alpha: float, seeds: int) -> int:
    """Simulations of a small p-value: about 20 exceedances expected at ``alpha / seeds``."""
    return max(10_000, math.ceil(20 * seeds / alpha))


@dataclass(frozen=True)
class SeedResult:
    """One tiny model's chi-square test."""

    seed: int
    model: str
    prompt: list[int]
    settings: dict[str, int]
    samples: int
    outputs: int
    bins: int
    pooled_mass: float
    statistic: float
    df: int
    p_value: float
    p_value_asymptotic: float
    replicates: int
    power: float
    observed_tv: float
    impossible: list[list[int]]


@dataclass(frozen=True)
class SamplingTest:
    """The outcome of :func:`sampling_test`; ``reason`` says why in one sentence."""

    verdict: str
    reason: str
    temperature: float
    alpha: float
    epsilon: float
    min_power: float
    seeds: list[SeedResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sample(decoder: DiffusionDecoder, prompt: list[int], samples: int, seed: int) -> Counter:
    counts: Counter = Counter()
    for chunk, start in enumerate(range(0, samples, CHUNK)):
        decoder.seed = seed * 1_000_003 + chunk
        rows = min(CHUNK, samples - start)
        counts.update(tuple(t) for t in decoder.generate([prompt] * rows).token_lists)
    return counts


def sampling_test(
    strategy: Resolved,
    against: Resolved,
    *,
    temperature: float = 1.0,
    samples: int = 20_000,
    seeds: int = 3,
    alpha: float = 1e-3,
    epsilon: float = 0.05,
    min_power: float = 0.8,
) -> SamplingTest:
    """Test whether ``strategy`` samples ``against``'s exact output distribution."""
    results = []
    for seed in range(seeds):
        model = tiny_dllm(seed)
        prompt = tiny_prompts(1, seed=seed)[0]
        settings = SETTINGS[seed % len(SETTINGS)]
        common = dict(temperature=temperature, **settings)
        ref = DiffusionDecoder(model, against.spec, params=against.params, **common)
        exact = exact_distribution(ref, prompt)
        ours = DiffusionDecoder(model, strategy.spec, params=strategy.params, **common)
        counts = _sample(ours, prompt, samples, seed)
        test = pooled_chi_square(
            counts, exact, simulate_below=alpha, replicates=replicates(alpha, seeds), seed=seed
        )
        observed_tv = 0.5 * sum(
            abs(counts.get(k, 0) / samples - exact.get(k, 0.0)) for k in set(counts) | set(exact)
        )
        results.append(SeedResult(
            seed=seed, model=model.name, prompt=prompt, settings=dict(settings), samples=samples,
            outputs=len(exact), bins=test.bins, pooled_mass=test.pooled_mass,
            statistic=test.statistic, df=test.df, p_value=test.p_value,
            p_value_asymptotic=test.p_value_asymptotic, replicates=test.replicates,
            power=power(test.df, samples, alpha, epsilon), observed_tv=observed_tv,
            impossible=[list(k) for k in test.impossible],
        ))
    verdict, reason = _verdict(results, alpha, epsilon, min_power)
    return SamplingTest(verdict, reason, temperature, alpha, epsilon, min_power, results)


def _verdict(results: list[SeedResult], alpha: float, epsilon: float, min_power: float) -> tuple[str, str]:
    count = len(results)
    for r in results:
        if r.impossible:
            return "not lossless", (
                f"seed {r.seed}: the strategy produced {r.impossible[0]}, an output the "
                "reference never produces"
            )
    worst = min(results, key=lambda r: r.p_value)
    if worst.p_value < alpha / count:
        return "not lossless", (
            f"seed {worst.seed}: chi-square p = {worst.p_value:.3g} < alpha / seeds = "
            f"{alpha / count:.3g} (statistic {worst.statistic:.1f}, df {worst.df})"
        )
    if worst.p_value < alpha:
        return "inconclusive", (
            f"seed {worst.seed}: p = {worst.p_value:.3g} is below alpha = {alpha:g} but not "
            f"below alpha / seeds = {alpha / count:.3g}; rerun with more samples or seeds"
        )
    weakest = min(results, key=lambda r: r.power)
    if weakest.power < min_power:
        return "inconclusive", (
            f"no difference found, but the power against a total-variation distance of "
            f"{epsilon:g} is only {weakest.power:.2f} (seed {weakest.seed}) < {min_power:g}; "
            "raise the number of samples"
        )
    return "lossless", (
        f"every seed has p >= alpha = {alpha:g}, with power >= {weakest.power:.2f} against "
        f"any output distribution at total-variation distance >= {epsilon:g} (over the pooled bins)"
    )
