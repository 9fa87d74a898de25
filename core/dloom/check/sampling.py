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

:class:`SamplingOptions` declares the test's settings; :func:`seed_result` (one seed's test)
and :func:`conclude` (the verdict) serve the AR-target test of :mod:`dloom.check.target` too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dloom.check.enumerate import Output, exact_distribution
from dloom.check.progress import stage
from dloom.check.resolve import Resolved
from dloom.check.stats import pooled_chi_square, power
from dloom.check.tiny import tiny_dllm, tiny_prompts
from dloom.decode.decoder import DiffusionDecoder
from dloom.errors import ConfigurationError

SETTINGS = (
    {"gen_length": 3, "block_length": 3, "steps": 3},
    {"gen_length": 4, "block_length": 2, "steps": 4},
    {"gen_length": 4, "block_length": 4, "steps": 4},
)
"""Decoder settings, cycled over the seeds: one block of 3, two blocks of 2, one of 4 (a block
of one position would be wasted on commit rules: every rule commits it alone)."""
CHUNK = 20_000
"""Rows per ``generate`` call (each chunk has its own sampler seed)."""


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling test's settings, for every lossless check (against a strategy, the
    kernel or an AR target).

    :ivar temperature: the sampling temperature (``0``: the checks run greedy identity only).
    :ivar samples: samples per seed; :ivar seeds: tiny models (``K``).
    :ivar alpha: the significance; :ivar epsilon: the total-variation distance the power is
        stated for; :ivar min_power: the power a ``lossless`` verdict needs.
    :raises ConfigurationError: a value outside its range.
    """

    temperature: float = 1.0
    samples: int = 20_000
    seeds: int = 3
    alpha: float = 1e-3
    epsilon: float = 0.05
    min_power: float = 0.8

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1 or not 0 < self.epsilon <= 1 or self.temperature < 0:
            raise ConfigurationError(
                f"alpha {self.alpha}, epsilon {self.epsilon}, temperature {self.temperature}; "
                "allowed: 0 < alpha < 1, 0 < epsilon <= 1, temperature >= 0"
            )
        if self.samples < 1 or self.seeds < 1:
            raise ConfigurationError(f"samples {self.samples}, seeds {self.seeds}; allowed: at least 1 each")

    @property
    def replicates(self) -> int:
        """Simulations of a small p-value: about 20 exceedances expected at ``alpha / seeds``."""
        return max(10_000, math.ceil(20 * self.seeds / self.alpha))


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
    """The outcome of a sampling test; ``reason`` says why in one sentence."""

    verdict: str
    reason: str
    temperature: float
    alpha: float
    epsilon: float
    min_power: float
    seeds: list[SeedResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def seed_result(
    seed: int, model: str, prompt: Sequence[int], settings: Mapping[str, int],
    counts: Mapping[Output, int], exact: Mapping[Output, float], options: SamplingOptions,
) -> SeedResult:
    """One seed's pooled chi-square test of the sampled ``counts`` (``options.samples`` in
    all) against the ``exact`` distribution, with the test's power and the observed
    total-variation distance."""
    test = pooled_chi_square(
        counts, exact, simulate_below=options.alpha, replicates=options.replicates, seed=seed
    )
    observed_tv = 0.5 * sum(
        abs(counts.get(k, 0) / options.samples - exact.get(k, 0.0)) for k in set(counts) | set(exact)
    )
    return SeedResult(
        seed=seed, model=model, prompt=list(prompt), settings=dict(settings), samples=options.samples,
        outputs=len(exact), bins=test.bins, pooled_mass=test.pooled_mass,
        statistic=test.statistic, df=test.df, p_value=test.p_value,
        p_value_asymptotic=test.p_value_asymptotic, replicates=test.replicates,
        power=power(test.df, options.samples, options.alpha, options.epsilon),
        observed_tv=observed_tv, impossible=[list(k) for k in test.impossible],
    )


def conclude(results: list[SeedResult], options: SamplingOptions) -> SamplingTest:
    """The verdict on the seeds' results (rules in the module docstring)."""
    verdict, reason = _verdict(results, options.alpha, options.epsilon, options.min_power)
    return SamplingTest(
        verdict, reason, options.temperature, options.alpha, options.epsilon, options.min_power, results
    )


def _sample(decoder: DiffusionDecoder, prompt: list[int], samples: int, seed: int) -> Counter:
    counts: Counter = Counter()
    for chunk, start in enumerate(range(0, samples, CHUNK)):
        decoder.seed = seed * 1_000_003 + chunk
        rows = min(CHUNK, samples - start)
        counts.update(tuple(t) for t in decoder.generate([prompt] * rows).token_lists)
    return counts


def sampling_test(
    strategy: Resolved, against: Resolved, options: SamplingOptions = SamplingOptions()
) -> SamplingTest:
    """Test whether ``strategy`` samples ``against``'s exact output distribution."""
    results = []
    for seed in range(options.seeds):
        stage(f"sampling test: seed {seed + 1} of {options.seeds}, {options.samples} samples")
        model = tiny_dllm(seed)
        prompt = tiny_prompts(1, seed=seed)[0]
        settings = SETTINGS[seed % len(SETTINGS)]
        common: dict[str, Any] = dict(temperature=options.temperature, **settings)
        ref = DiffusionDecoder(model, against.spec, params=against.params, **common)
        exact = exact_distribution(ref, prompt)
        ours = DiffusionDecoder(model, strategy.spec, params=strategy.params, **common)
        counts = _sample(ours, prompt, options.samples, seed)
        results.append(seed_result(seed, model.name, prompt, settings, counts, exact, options))
    return conclude(results, options)


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
