"""Negative controls of ``dloom check``: strategies broken on purpose are caught.

* a rule that commits two tokens per step while claiming to be lossless against quota: the
  greedy check finds it and names the first differing prompt and position;
* a rule that is greedy-identical to quota but biased under sampling (it also commits, in
  the same step, every sampled token less likely than 0.06, which never happens at ``T == 0``
  on a vocabulary of at most 16): only the exact-distribution chi-square test can see it, and
  it says ``not lossless``;
* a stale-draft verify: a Spiffy verifier that continues from a draft whose tokens differ
  from the sampled state (``ReusesAMismatchedDraft`` of ``test_spiffy_lossless.py``),
  declared lossless against its kernel: ``not lossless``, from the greedy check, and from the
  sampling test on a prompt where its greedy output happens to be right;
* a biased ratio test: FailFast's ``min(1, p/q)`` rejection sampling that, after a
  rejection, draws the target's ``p`` instead of the residual ``max(0, p - q)``: greedy it
  is exact, sampled it is ``not lossless`` against the AR target;
* bounds that are wrong on purpose (the negative controls of ``test_frechet_bound.py``,
  reused through an import path, as a third-party plugin would name its bound), and a rule
  that commits more than its sound bound certifies: ``unsound``, with a counterexample that
  really is one.

Positive controls (the same checks pass a correct strategy) are in ``tests/check/test_check.py``.
Everything is seeded: the verdicts are deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_frechet_bound import (
    assuming_independence,
    rival_bound_from_the_most_confident,
    without_the_n_minus_one_term,
)
from test_spiffy_lossless import ReusesAMismatchedDraft

import dloom
from dloom import Claim, Parameter, StrategyRegistration
from dloom.ar.chains import GUMBEL_TAG
from dloom.check import check_lossless, check_strategy, tiny
from dloom.check import joints as J
from dloom.decode.commit import commit_top, sorted_profile
from dloom.decode.kernel import gumbel_argmax
from dloom_plugins.failfast import plugin as failfast_plugin
from dloom_plugins.failfast.verification import verify_ratio
from dloom_plugins.frechet import FrechetCommit, frechet_bounds


@pytest.fixture(autouse=True)
def tiny_greedy_model(monkeypatch):
    """The greedy checks run on tiny random models even once the toy zoo is trained."""
    monkeypatch.setattr(tiny, "zoo_installed", lambda *names: False)


class TopTwo:
    """Two tokens per step."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        _, ranks = sorted_profile(confidence, selectable)
        return commit_top(ranks, selectable, torch.full_like(ranks[:, 0], 2))


class EagerOutliers:
    """Quota's choice, plus every sampled token less likely than ``floor`` in the same step.

    Under ``T == 0`` a candidate is the argmax, whose probability is at least ``1 / V'`` over
    ``V'`` candidate tokens: above ``floor = 0.06`` for ``V' <= 16``, so greedily this is
    quota exactly. Under sampling it commits unlikely draws without a fresh forward.
    """

    def __init__(self, floor: float) -> None:
        self.floor = floor

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        _, ranks = sorted_profile(confidence, selectable)
        return selectable & ((ranks == 0) | (confidence < self.floor))


class FrechetWithBound:
    """The Fréchet rule over another bound: commit the largest prefix with ``G_n > 0``."""

    bound = staticmethod(frechet_bounds)

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        values, ranks = sorted_profile(confidence, selectable)
        _, _, gap = self.bound(values)
        sizes = torch.arange(1, gap.shape[-1] + 1)
        return commit_top(ranks, selectable, torch.where(gap > 0, sizes, 0).amax(-1))


class FrechetWithoutTheNMinusOneTerm(FrechetWithBound):
    bound = staticmethod(without_the_n_minus_one_term)


LOSSLESS = Claim("lossless", against="quota")


def test_two_tokens_per_step_is_caught_by_the_greedy_check():
    report = check_strategy(StrategyRegistration("top-two", TopTwo, claim=LOSSLESS))
    assert report.verdict == "not lossless" and report.exit_code == 1, report.render()
    greedy = report.evidence["greedy"]
    first = greedy["first_difference"]
    assert greedy["identical"] < greedy["prompts"] == 32
    position = first["position"]
    assert first["strategy_tokens"][:position] == first["against_tokens"][:position]
    assert first["strategy_tokens"][position] != first["against_tokens"][position]
    assert f"first at prompt {first['prompt']}, position {position}" in report.reason
    assert "sampling" not in report.evidence


def test_a_rule_biased_only_under_sampling_is_caught_by_the_sampling_test():
    eager = StrategyRegistration(
        "eager", EagerOutliers, parameters=(Parameter("floor", 0.06, float),), claim=LOSSLESS
    )
    greedy_only = check_strategy(eager, temperature=0)
    assert greedy_only.verdict == "lossless"  # greedily it is quota: the greedy check is blind
    report = check_strategy(eager, samples=10_000)
    assert report.verdict == "not lossless", report.render()
    assert report.evidence["greedy"]["identical"] == 32
    seeds = report.evidence["sampling"]["seeds"]
    assert min(s["p_value"] for s in seeds) < 1e-3 / len(seeds)
    assert "chi-square p = " in report.reason


def test_the_same_rule_passes_when_it_cannot_misbehave():
    """With ``floor = 0`` the control is quota itself: the test says lossless (so the
    refutation above is the rule's fault, not the test's)."""
    report = check_lossless(EagerOutliers(0.0), "quota", samples=10_000)
    assert min(s["p_value"] for s in report.evidence["sampling"]["seeds"]) > 1e-3
    assert report.verdict == "lossless", report.render()


class StaleDraftAtAFixedBudget(ReusesAMismatchedDraft):
    """At budget 10: ``budget=auto`` takes no drafts from a tiny model's uncalibrated graph."""

    def __init__(self) -> None:
        super().__init__(budget=10)


STALE = StrategyRegistration(
    "stale-draft", StaleDraftAtAFixedBudget, claim=Claim("lossless", against="kernel"),
    default_commit_rule="quota",
)


@pytest.mark.filterwarnings("ignore:no built-in draft graph fits")
def test_a_stale_draft_verify_is_caught_by_the_greedy_check():
    report = check_strategy(STALE, prompt_count=4)
    assert report.verdict == "not lossless" and report.exit_code == 1, report.render()
    assert report.claimed_by == "stale-draft"
    assert "greedy outputs differ from kernel(quota)'s on 1 of 4 prompts" in report.reason


@pytest.mark.filterwarnings("ignore:no built-in draft graph fits")
def test_a_stale_draft_verify_is_caught_by_the_sampling_test_where_greedy_is_blind():
    """On the first prompt alone its greedy output is right: the sampling test refutes it."""
    report = check_strategy(STALE, samples=4_000, seeds=2, prompt_count=1)
    assert report.verdict == "not lossless", report.render()
    assert report.evidence["greedy"]["identical"] == 1
    assert "chi-square p = " in report.reason


def resampling_the_target_after_a_rejection(draft, draft_len, logits, draft_probs, temperature, generator):
    """The ratio test with a classic slip: after rejecting ``x_i`` it draws from ``p_i``, not
    from the residual ``max(0, p_i - q_i)`` (the bonus draw from ``p_k`` stays right)."""
    accepted, _ = verify_ratio(draft, draft_len, logits, draft_probs, temperature, generator)
    p_at = logits[torch.arange(len(accepted)), accepted].to(torch.float64)
    return accepted, gumbel_argmax(p_at / temperature, generator, GUMBEL_TAG)


RATIO = dict(verification="ratio", small_block=1, initial_length=1, n=1, n_max=3)
"""Ratio verification of strictly left-to-right drafts: exact when the ratio test is."""


def test_a_biased_ratio_test_is_caught_against_the_ar_target(monkeypatch):
    monkeypatch.setattr(failfast_plugin, "verify_ratio", resampling_the_target_after_a_rejection)
    report = check_strategy("failfast", params=RATIO, samples=4_000, seeds=2, prompt_count=8)
    assert report.verdict == "not lossless" and report.exit_code == 1, report.render()
    assert report.evidence["greedy"]["identical"] == 8  # greedy never runs the ratio test
    assert "chi-square p = " in report.reason


def test_the_same_budget_does_not_refute_the_correct_ratio_test():
    report = check_strategy("failfast", params=RATIO, samples=4_000, seeds=2, prompt_count=8)
    assert report.verdict != "not lossless", report.render()
    assert min(s["p_value"] for s in report.evidence["sampling"]["seeds"]) > 1e-3


def assert_real_counterexample(counterexample, bounds) -> None:
    joint = np.array(counterexample["probabilities"])
    assert joint.shape == tuple(counterexample["shape"])
    if counterexample["problem"].startswith("bound"):
        assert J.prefix_bound_violations(joint, bounds)
        assert J.prefix_bound_violations(joint, frechet_bounds) == []
    else:
        positions = counterexample["committed"]
        tokens = np.array(counterexample["greedy_tokens"])[positions]
        right, rival = J.tuple_and_best_rival(J.marginalise(joint, positions), tokens)
        assert right <= rival
        assert (right, rival) == (counterexample["p_committed_tuple"], counterexample["p_best_rival"])


@pytest.mark.parametrize(
    "broken", [without_the_n_minus_one_term, assuming_independence, rival_bound_from_the_most_confident]
)
def test_a_wrong_bound_declared_for_the_frechet_rule_is_unsound(broken):
    claim = Claim("bound", bound=f"test_frechet_bound:{broken.__name__}")
    delta = Parameter("delta", 0.0, float)
    report = check_strategy(StrategyRegistration("wrong", FrechetCommit, (delta,), claim=claim))
    assert report.verdict == "unsound" and report.exit_code == 1, report.render()
    counterexample = report.evidence["bound"]["counterexample"]
    assert counterexample["problem"].startswith(f"bound {claim.bound!r}: n=")
    assert report.evidence["bound"]["counterexamples"] >= 1
    assert_real_counterexample(counterexample, broken)


def test_a_rule_that_commits_on_an_unsound_bound_is_unsound():
    """Fréchet without the ``-(n - 1)`` term, declared as its bound: the bound fails, and
    the rule built on it commits tuples that are not the joint mode."""
    claim = Claim("bound", bound="test_frechet_bound:without_the_n_minus_one_term")
    report = check_strategy(StrategyRegistration("no-n-1", FrechetWithoutTheNMinusOneTerm, claim=claim))
    assert report.verdict == "unsound", report.render()
    assert_real_counterexample(report.evidence["bound"]["counterexample"], without_the_n_minus_one_term)
    rule_only = check_strategy(
        StrategyRegistration("no-n-1", FrechetWithoutTheNMinusOneTerm, claim=Claim("bound", bound="frechet"))
    )
    counterexample = rule_only.evidence["bound"]["counterexample"]
    assert rule_only.verdict == "unsound"
    assert counterexample["problem"].startswith("the committed tokens are not the joint mode")
    assert_real_counterexample(counterexample, frechet_bounds)


def test_a_rule_committing_more_than_its_sound_bound_certifies_is_unsound():
    report = check_strategy(StrategyRegistration("top-two", TopTwo, claim=Claim("bound", bound="frechet")))
    assert report.verdict == "unsound", report.render()
    counterexample = report.evidence["bound"]["counterexample"]
    assert counterexample["committed"] and len(counterexample["committed"]) == 2
    assert_real_counterexample(counterexample, frechet_bounds)
