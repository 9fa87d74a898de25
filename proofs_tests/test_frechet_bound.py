"""Property tests of the Fréchet commit rule's claims (``docs/strategies.md``, "frechet").

* Soundness: for every joint distribution tried, ``L_n`` bounds from below the probability
  that the ``n`` most confident greedy tokens are right together, ``U_n`` bounds from above
  every other tuple of those positions, and whatever the rule commits is the joint mode of
  the committed positions, by a margin of more than ``delta``.
* Sharpness: ``L_n`` is attained, by an explicit joint and by a linear programme's minimum.
* Shape of the rule: ``G_n`` is non-increasing; ``G_n`` = factor core + a non-negative
  heterogeneity bonus; on flat profiles the rule is the factor rule with ``f = 1 - delta``
  (and it never commits less than that factor rule on any profile); it equals an exact
  rational re-implementation of the formula; it commits at least one position and only
  selectable ones; rows are independent.
* Negative controls: bounds that are wrong on purpose are caught by the soundness check.

Hypothesis runs derandomised and without a database: every run tries the same examples.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import assume, example, find, given, settings
from hypothesis import strategies as st
from joints import (
    frechet_extremal_joint,
    greedy,
    joints,
    marginal_lists,
    marginalise,
    marginals,
    min_all_right,
    prefix_bound_violations,
    tuple_and_best_rival,
)

from dloom import BlockSchedule
from dloom.decode.commit import sorted_profile
from dloom_plugins.baselines import FactorCommit
from dloom_plugins.frechet import FrechetCommit, frechet_bounds


def proof(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None)


def commit(rule, confidence: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    schedule = BlockSchedule(torch.zeros_like(selectable.sum(-1)), 1, selectable.sum(-1))
    return rule.dloom_select_commit(confidence=confidence, selectable=selectable, schedule=schedule)


# --- profiles ----------------------------------------------------------------------------

NEAR_ONE = np.array([1.0, 1.0 - 2**-53, 1.0 - 2**-52, 1.0 - 1e-12, 0.999, 0.75, 0.5, 0.25, 0.0])
JUNK = np.array([math.nan, math.inf, -math.inf, 2.0, 1.0])
DELTAS = st.one_of(st.sampled_from([0.0, 0.25, 0.5]), st.floats(0.0, 1.0, exclude_max=True))


@st.composite
def profiles(draw, rows=(1, 4), width=(1, 8), flat=False):
    """``(confidence, selectable)``: ``(B, K)`` float64 and bool.

    Hypothesis draws the shape and the mix; a seeded generator fills the cells (one draw per
    example, not per cell, keeps hundreds of examples cheap): uniform values, values piled
    up near one, exact specials (``1``, ``1 - 2**-53``, ``0.75``, ``0``, ...) and repeats of
    earlier values (ties). Non-selectable positions hold junk (``nan``, ``inf``, values above
    one) that the rule must ignore. With ``flat`` every row holds a single value.
    """
    b, k = draw(st.integers(*rows)), draw(st.integers(*width))
    share_special, share_peaked, share_selectable = (
        draw(st.sampled_from([0.0, 0.3, 1.0])),
        draw(st.sampled_from([0.0, 0.5, 1.0])),
        draw(st.sampled_from([1.0, 0.7, 0.3])),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    uniform = rng.uniform(size=(b, k))
    peaked = 1.0 - 0.5 * rng.uniform(size=(b, k)) ** 4
    special = rng.choice(NEAR_ONE, size=(b, k))
    conf = np.where(rng.uniform(size=(b, k)) < share_peaked, peaked, uniform)
    conf = np.where(rng.uniform(size=(b, k)) < share_special, special, conf)
    repeat = rng.uniform(size=(b, k)) < 0.2
    conf = np.where(repeat, conf[:, rng.integers(k, size=k)], conf)
    if flat:
        conf = np.repeat(conf[:, :1], k, axis=1)
    sel = rng.uniform(size=(b, k)) < share_selectable
    conf = np.where(sel, conf, rng.choice(JUNK, size=(b, k)))
    return torch.tensor(conf, dtype=torch.float64), torch.tensor(sel)


def bounds_of(confidence, selectable):
    values, _ = sorted_profile(confidence, selectable)
    return values, *frechet_bounds(values)


# --- soundness ---------------------------------------------------------------------------


@proof(250)
@given(joints())
def test_lower_and_upper_bounds_hold_for_every_joint(joint):
    assert prefix_bound_violations(joint, frechet_bounds) == []


@proof(250)
@given(joints(), DELTAS)
def test_what_the_rule_commits_is_the_joint_mode_by_more_than_delta(joint, delta):
    tokens, confidence = greedy(joint)
    n = len(tokens)
    chosen = commit(FrechetCommit(delta), torch.tensor(confidence)[None], torch.ones(1, n, dtype=torch.bool))
    positions = np.flatnonzero(chosen[0].numpy())
    right, rival = tuple_and_best_rival(marginalise(joint, positions), tokens[positions])
    if len(positions) == 1:
        assert right >= rival  # the forced commit: the mode of its own marginal
    else:
        assert right - rival > delta - 1e-12
        assert right > rival


def test_certified_commits_occur_on_these_joints():
    """The mode property above is not vacuous: the generator reaches joints on which the
    rule commits three or more tokens, and Fréchet-extremal joints among them."""
    def commits(joint, delta=0.0):
        _, confidence = greedy(joint)
        ones = torch.ones(1, joint.ndim, dtype=torch.bool)
        return int(commit(FrechetCommit(delta), torch.tensor(confidence)[None], ones).sum())

    find(joints(), lambda j: commits(j) >= 3, settings=proof(300))
    find(joints(kinds=("frechet_extremal",)), lambda j: commits(j, 0.5) >= 2, settings=proof(300))


# --- sharpness ---------------------------------------------------------------------------

SUB_ONE = [np.array([0.9, 0.1]), np.array([0.05, 0.8, 0.15]), np.array([0.2, 0.7, 0.1])]
OVER_ONE = [np.array([0.6, 0.4]), np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.2, 0.7])]


@proof(150)
@given(marginal_lists())
@example(SUB_ONE)
@example(OVER_ONE)
def test_an_explicit_joint_attains_the_lower_bound(margs):
    joint = frechet_extremal_joint(margs)
    for built, given_marginal in zip(marginals(joint), margs):
        np.testing.assert_allclose(built, given_marginal, rtol=0, atol=1e-12)
    tokens = [int(np.argmax(m)) for m in margs]
    confidence = np.array([m[t] for m, t in zip(margs, tokens)])
    all_right = joint[tuple(tokens)]
    lower = frechet_bounds(torch.tensor(np.sort(confidence)[::-1].copy())[None])[0][0, -1].item()
    assert abs(all_right - lower) <= 1e-12
    assert abs(lower - max(0.0, 1.0 - float(np.sum(1.0 - confidence)))) <= 1e-12


def test_the_explicit_joint_covers_both_cases():
    assert frechet_extremal_joint(SUB_ONE)[0, 1, 1] == pytest.approx(1 - 0.1 - 0.2 - 0.3, abs=1e-15)
    assert frechet_extremal_joint(OVER_ONE)[0, 0, 2] == 0.0  # wrongs sum to 1.2: never all right


@proof(80)
@given(marginal_lists(positions=(2, 4), vocab=(2, 4)))
@example(SUB_ONE)
@example(OVER_ONE)
def test_the_least_probability_over_all_joints_is_the_lower_bound(margs):
    tokens = [int(np.argmax(m)) for m in margs]
    confidence = np.array([m[t] for m, t in zip(margs, tokens)])
    lower = frechet_bounds(torch.tensor(np.sort(confidence)[::-1].copy())[None])[0][0, -1].item()
    assert abs(min_all_right(margs, tokens) - lower) <= 1e-9


# --- the shape of the rule ---------------------------------------------------------------


@proof(200)
@given(profiles())
def test_gap_is_non_increasing_and_the_tail_never_passes(profile):
    values, lower, upper, gap = bounds_of(*profile)
    assert bool((gap[:, 1:] <= gap[:, :-1]).all())  # exactly, in floating point
    tail = torch.isinf(values)
    assert bool((lower[tail] == 0).all() and (upper[tail] == math.inf).all())
    assert bool((gap[tail] == -math.inf).all())
    live = ~tail
    assert bool(((lower >= 0) & (lower <= 1))[live].all() and (upper[live] >= 0).all())
    assert bool((lower <= values.clamp(min=0) + 1e-15)[live].all())  # never above c_(n)


@proof(200)
@given(profiles())
def test_gap_is_factor_core_plus_heterogeneity_bonus(profile):
    values, lower, _, gap = bounds_of(*profile)
    k = values.shape[-1]
    n = torch.arange(1, k + 1, dtype=torch.float64)
    live = torch.isfinite(values)
    c = torch.where(live, values, 0.0)
    core = (n + 1) * c - n
    bonus = torch.cumsum(c, -1) - n * c  # sum_{j<n} (c_(j) - c_(n))
    positive = live & (lower > 0)
    assert bool((bonus[live] >= -1e-12).all())
    assert torch.allclose(gap[positive], (core + bonus)[positive], rtol=0, atol=1e-12)
    flat_part = live & (lower == 0)
    assert torch.allclose(gap[flat_part], (c - 1)[flat_part], rtol=0, atol=0)


def near_factor_boundary(confidence, selectable, f: float) -> bool:
    """Whether some prefix sits within 1e-9 of the factor rule's threshold."""
    values, _ = sorted_profile(confidence, selectable)
    n = torch.arange(1, values.shape[-1] + 1, dtype=torch.float64)
    score = (n + 1) * (1 - values)
    return bool(((score - f).abs() < 1e-9)[torch.isfinite(values)].any())


@proof(200)
@given(profiles(flat=True), DELTAS)
def test_on_flat_profiles_the_rule_is_the_factor_rule(profile, delta):
    confidence, selectable = profile
    assume(not near_factor_boundary(confidence, selectable, 1 - delta))
    ours = commit(FrechetCommit(delta), confidence, selectable)
    assert torch.equal(ours, commit(FactorCommit(1 - delta), confidence, selectable))


@proof(200)
@given(profiles(), DELTAS)
def test_never_commits_less_than_the_factor_rule(profile, delta):
    confidence, selectable = profile
    assume(not near_factor_boundary(confidence, selectable, 1 - delta))
    ours = commit(FrechetCommit(delta), confidence, selectable)
    factor = commit(FactorCommit(1 - delta), confidence, selectable)
    assert bool((ours | ~factor).all())  # factor's commits are a subset of ours


def reference_commit(confidence: list[float], selectable: list[bool], delta: float) -> tuple[set[int], bool]:
    """The formula in exact rational arithmetic, one row; also whether any prefix's gap is
    within 1e-12 of ``delta`` (where float64 rounding may legitimately decide)."""
    chosen = [i for i, s in enumerate(selectable) if s]
    if not chosen:
        return set(), False
    order = sorted(chosen, key=lambda i: (-confidence[i], i))
    c = [Fraction(confidence[i]) for i in order]
    largest, close, wrong = 1, False, Fraction(0)
    for n in range(1, len(c) + 1):
        wrong += 1 - c[n - 1]
        gap = max(Fraction(0), 1 - wrong) - (1 - c[n - 1])
        close |= abs(gap - Fraction(delta)) < Fraction(1, 10**12)
        if gap > Fraction(delta):
            largest = n
    return set(order[:largest]), close


@proof(200)
@given(profiles(), DELTAS)
def test_equals_the_formula_in_exact_arithmetic(profile, delta):
    confidence, selectable = profile
    ours = commit(FrechetCommit(delta), confidence, selectable)
    for row in range(confidence.shape[0]):
        expected, close = reference_commit(confidence[row].tolist(), selectable[row].tolist(), delta)
        if not close:
            assert set(torch.nonzero(ours[row]).flatten().tolist()) == expected


@proof(200)
@given(profiles(), DELTAS)
def test_commits_at_least_one_and_only_selectable_positions_rows_independent(profile, delta):
    confidence, selectable = profile
    rule = FrechetCommit(delta)
    ours = commit(rule, confidence, selectable)
    assert ours.dtype == torch.bool and ours.shape == selectable.shape
    assert not bool((ours & ~selectable).any())
    assert torch.equal(ours.any(-1), selectable.any(-1))
    for row in range(confidence.shape[0]):
        alone = commit(rule, confidence[row : row + 1], selectable[row : row + 1])
        assert torch.equal(alone[0], ours[row])


# --- negative controls -------------------------------------------------------------------


def without_the_n_minus_one_term(sorted_confidence):
    """Broken: ``L_n = min(1, sum c)`` (drops ``-(n - 1)``)."""
    _, upper, _ = frechet_bounds(sorted_confidence)
    broken = torch.cumsum(sorted_confidence, -1).clamp(0, 1)
    return broken, upper, broken - upper


def assuming_independence(sorted_confidence):
    """Broken: ``L_n = prod c`` (true only for independent positions)."""
    _, upper, _ = frechet_bounds(sorted_confidence)
    broken = torch.cumprod(sorted_confidence, -1)
    return broken, upper, broken - upper


def rival_bound_from_the_most_confident(sorted_confidence):
    """Broken: ``U_n = 1 - c_(1)`` (the least confident position is the likeliest wrong)."""
    lower, _, _ = frechet_bounds(sorted_confidence)
    broken = (1 - sorted_confidence[..., :1]).expand_as(sorted_confidence)
    return lower, broken, lower - broken


@pytest.mark.parametrize(
    "broken", [without_the_n_minus_one_term, assuming_independence, rival_bound_from_the_most_confident]
)
def test_soundness_check_catches_a_wrong_bound(broken):
    counterexample = find(joints(), lambda j: bool(prefix_bound_violations(j, broken)), settings=proof(1000))
    assert prefix_bound_violations(counterexample, broken)
    assert prefix_bound_violations(counterexample, frechet_bounds) == []
