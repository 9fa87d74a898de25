"""The chi-square test and its power, in float64 torch (no scipy needed at run time).

* :func:`chi2_sf`: ``P(X > x)`` for ``X ~ chi2(df)``, the regularised upper incomplete gamma
  function ``Q(df / 2, x / 2)``.
* :func:`chi2_isf`: the critical value ``x`` with ``chi2_sf(x, df) = alpha`` (bisection).
* :func:`ncx2_sf`: ``P(X > x)`` for a noncentral ``X ~ chi2(df, nc)``, a Poisson(``nc / 2``)
  mixture of central chi-squares with ``df + 2j`` degrees of freedom.
* :func:`pooled_chi_square`: Pearson's statistic of observed counts against exact
  probabilities, bins with an expected count below 5 pooled; when the asymptotic p-value is
  small, an exact one by simulation (the chi-square approximation is anti-conservative far
  in the tail when some bins expect only tens of counts: a Poisson count's right tail is
  heavier than a normal one's).
* :func:`power`: the noncentral chi-square approximation of the test's power against every
  alternative at total-variation distance ``epsilon`` or more.

dloom's tests compare these with ``scipy.stats``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MIN_EXPECTED = 5.0
SIMULATION_CHUNK = 10_000


def chi2_sf(x: float, df: int) -> float:
    """``P(chi2(df) > x)``."""
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, df: int) -> float:
    """The ``x`` with ``P(chi2(df) > x) = alpha`` (to ~1e-12 relative)."""
    low, high = 0.0, max(1.0, float(df))
    while chi2_sf(high, df) > alpha:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if chi2_sf(middle, df) > alpha:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def ncx2_sf(x: float, df: int, nc: float) -> float:
    """``P(chi2(df, nc) > x)``: ``sum_j Poisson(j; nc / 2) * P(chi2(df + 2j) > x)``."""
    if nc <= 0:
        return chi2_sf(x, df)
    half = nc / 2
    terms = int(half + 12 * math.sqrt(half) + 30)
    j = torch.arange(terms, dtype=torch.float64)
    log_weights = -half + j * math.log(half) - torch.lgamma(j + 1)
    tails = torch.special.gammaincc((df + 2 * j) / 2, torch.full_like(j, x / 2))
    return float(torch.clamp((log_weights.exp() * tails).sum(), 0.0, 1.0))


@dataclass(frozen=True)
class ChiSquare:
    """A pooled Pearson chi-square test of observed outputs against exact probabilities.

    :ivar statistic: Pearson's ``sum (O - E)^2 / E`` over the pooled bins.
    :ivar df: degrees of freedom, ``bins - 1``.
    :ivar p_value: the test's p-value: simulated when ``replicates > 0``, else asymptotic;
        ``0`` when an output of probability ``0`` was observed (exact rejection), ``1`` when
        there is one bin and nothing outside it.
    :ivar p_value_asymptotic: ``P(chi2(df) > statistic)``.
    :ivar replicates: samples of the statistic simulated under the null (0: none).
    :ivar bins: bins after pooling.
    :ivar pooled_mass: the exact probability of the outputs pooled into one bin.
    :ivar impossible: outputs observed although their exact probability is ``0``.
    :ivar samples: total observations.
    """

    statistic: float
    df: int
    p_value: float
    p_value_asymptotic: float
    replicates: int
    bins: int
    pooled_mass: float
    impossible: tuple[Any, ...]
    samples: int


def simulated_p_value(
    statistic: float, probabilities: np.ndarray, samples: int, replicates: int, seed: int = 0
) -> float:
    """``(1 + #{T* >= statistic}) / (1 + replicates)``, with ``T*`` Pearson's statistic of
    ``samples`` multinomial draws from ``probabilities`` (the exact null distribution)."""
    rng = np.random.default_rng(seed)
    p = np.asarray(probabilities, dtype=np.float64) / np.sum(probabilities)
    expected = samples * p
    exceed, done = 0, 0
    while done < replicates:
        size = min(SIMULATION_CHUNK, replicates - done)
        counts = rng.multinomial(samples, p, size=size)
        simulated = ((counts - expected) ** 2 / expected).sum(axis=1)
        exceed += int((simulated >= statistic * (1 - 1e-12)).sum())
        done += size
    return (exceed + 1) / (replicates + 1)


def pooled_chi_square(
    counts: Mapping[Any, int],
    probabilities: Mapping[Any, float],
    *,
    simulate_below: float = 0.0,
    replicates: int = 0,
    seed: int = 0,
) -> ChiSquare:
    """Test ``counts`` against ``probabilities``, pooling the least likely outputs.

    Outputs are sorted by probability; those whose expected count is below 5 go into one
    pooled bin, and if that bin still expects fewer than 5, the next least likely output joins
    it, until every bin expects at least 5 (or one bin is left). When the asymptotic p-value
    is below ``simulate_below``, the p-value is simulated with ``replicates`` draws
    (:func:`simulated_p_value`, seeded with ``seed``).
    """
    samples = int(sum(counts.values()))
    impossible = tuple(k for k, c in counts.items() if c and probabilities.get(k, 0.0) <= 0.0)
    support = sorted((k for k, p in probabilities.items() if p > 0), key=lambda k: probabilities[k])
    pooled_keys: list[Hashable] = []
    pooled_p = 0.0
    rest = list(support)
    while rest and (
        probabilities[rest[0]] * samples < MIN_EXPECTED
        or (pooled_keys and pooled_p * samples < MIN_EXPECTED)
    ):
        key = rest.pop(0)
        pooled_keys.append(key)
        pooled_p += probabilities[key]
    bins_p = [probabilities[k] for k in rest]
    bins_o = [counts.get(k, 0) for k in rest]
    if pooled_keys:
        bins_p.append(pooled_p)
        bins_o.append(sum(counts.get(k, 0) for k in pooled_keys))
    p = np.array(bins_p) / sum(bins_p)
    observed = np.array(bins_o, dtype=np.float64)
    statistic = float(((observed - samples * p) ** 2 / (samples * p)).sum())
    df = len(bins_p) - 1
    asymptotic = 1.0 if df == 0 else chi2_sf(statistic, df)
    p_value, used = asymptotic, 0
    if impossible:
        p_value = 0.0
    elif df > 0 and asymptotic < simulate_below and replicates > 0:
        p_value, used = simulated_p_value(statistic, p, samples, replicates, seed), replicates
    return ChiSquare(
        statistic, df, p_value, asymptotic, used, len(bins_p), pooled_p, impossible, samples
    )


def power(df: int, samples: int, alpha: float, epsilon: float) -> float:
    """The power of the level-``alpha`` test against any alternative at total-variation
    distance ``epsilon`` or more from the null (over the tested bins).

    An alternative ``q`` moves the statistic to about ``chi2(df, nc)`` with
    ``nc = samples * sum (q - p)^2 / p``; over all ``q`` with ``TV(p, q) >= epsilon`` the
    chi-square divergence is at least ``4 epsilon^2`` (since ``TV <= sqrt(chi2) / 2``), so the
    power is at least ``P(chi2(df, 4 N epsilon^2) > critical value)``. With one bin, an
    alternative puts at most ``1 - epsilon`` on it, and the test (reject on any observation
    outside it) has power ``1 - (1 - epsilon)^N``.
    """
    if df == 0:
        return 1.0 - (1.0 - epsilon) ** samples
    return ncx2_sf(chi2_isf(alpha, df), df, 4.0 * samples * epsilon**2)
