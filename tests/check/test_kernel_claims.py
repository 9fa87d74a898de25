"""``dloom check`` tests the claims the revisable kernel brings on every strategy that runs
on it, and catches editing rules broken on purpose, one per claim the hook can break, and
kernels broken on purpose for the claims no rule can break."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import dloom
from dloom import Claim, Parameter, StrategyRegistration
from dloom.check import check_strategy, tiny
from dloom.check.kernel_claims import KERNEL_CLAIMS, check_kernel_claims
from dloom.check.resolve import resolve
from dloom.cli import commands as cli
from dloom.cli.commands import app
from dloom.decode import revisable
from dloom.decode.commit import commit_top, sorted_profile
from dloom.decode.revisable import RevisableKernel
from dloom.hooks.registry import Strategy, get_registry

CLAIMS = KERNEL_CLAIMS["revisable"]


@pytest.fixture(autouse=True)
def tiny_greedy_model(monkeypatch):
    """The greedy checks run on tiny random models even once the toy zoo is trained."""
    monkeypatch.setattr(tiny, "zoo_installed", lambda *names: False)


def _fills(confidence, selectable, schedule):
    """The most confident masked position (offered ones when the schedule tells none apart)."""
    masked = selectable if schedule.masked is None else selectable & schedule.masked
    _, ranks = sorted_profile(confidence, masked)
    return masked & (ranks == 0), selectable & ~masked


class EditsPastBudget:
    """Fills one position per step and rewrites every offered filled position at every step,
    ignoring the post-step budget it declares."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        fills, edits = _fills(confidence, selectable, schedule)
        return fills | edits


class EditsInsteadOfFilling:
    """Rewrites offered filled positions and, only when there is none to rewrite, fills:
    a step with an edit to make fills nothing."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        fills, edits = _fills(confidence, selectable, schedule)
        return torch.where(edits.any(-1, keepdim=True), edits, fills)


class UnseededJitter:
    """Fills the most confident position and every one whose confidence, jittered by the
    global torch random stream (never seeded by the decoder), exceeds 0.9."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        fills, _ = _fills(confidence, selectable, schedule)
        jittered = confidence + 0.5 * torch.rand(confidence.shape, dtype=confidence.dtype)
        return fills | (selectable & (jittered > 0.9))


ROUNDS = (Parameter("rounds", 2, int, "post steps a block may take", low=0),)
BROKEN = {
    "edit_budget": StrategyRegistration(
        "edits-past-budget", EditsPastBudget, parameters=ROUNDS, claim=Claim("approximate"),
        kernels=("revisable",), edits=True, edit_budget="rounds",
    ),
    "fills": StrategyRegistration(
        "edits-instead-of-filling", EditsInsteadOfFilling, parameters=ROUNDS, claim=Claim("approximate"),
        kernels=("revisable",), edits=True, edit_budget="rounds",
    ),
    "deterministic": StrategyRegistration(
        "unseeded-jitter", UnseededJitter, claim=Claim("approximate"), kernels=("absorbing", "revisable"),
    ),
}


def register(registration: StrategyRegistration) -> None:
    get_registry().strategies[registration.name] = Strategy(registration.name, "tests", registration)


def test_the_joint_threshold_keeps_every_claim_of_the_revisable_kernel():
    report = check_strategy("joint_threshold", temperature=0, prompt_count=4)
    assert (report.verdict, report.exit_code, report.failed_claims) == ("approximate", 0, [])
    kernel = report.evidence["kernel_claims"]["revisable"]
    assert list(report.evidence["kernel_claims"]) == ["revisable"]
    assert kernel["kernel"] == "revisable" and list(kernel["claims"]) == list(CLAIMS)
    assert all(outcome["verdict"] == "holds" for outcome in kernel["claims"].values()), report.render()
    assert "revisable kernel claims on tiny-revisable-dllm" in report.render()
    # not vacuous: the first blocks hold prompt positions, the rule edits, blocks take post steps
    watched = check_kernel_claims(resolve("joint_threshold", {"max_post_steps": 2}))
    assert not watched.failed
    assert watched.claims["prompt_kept"]["detail"].startswith("8 prompt positions")
    budget = watched.claims["edit_budget"]["detail"]
    assert "budget of 2 post step(s)" in budget and "at most 3 post steps in a block" in budget
    assert " 0 edits" not in budget


def test_fill_rules_are_checked_on_the_revisable_kernel_and_absorbing_only_strategies_are_not():
    assert resolve("threshold").kernels == ("absorbing", "revisable")
    report = check_strategy("threshold", temperature=0, prompt_count=2)
    claims = report.evidence["kernel_claims"]["revisable"]["claims"]
    assert all(outcome["verdict"] == "holds" for outcome in claims.values())
    assert "budget of 0 post step(s)" in claims["edit_budget"]["detail"]
    assert resolve("spiffy+threshold").kernels == ("absorbing",)


@pytest.mark.parametrize("claim", list(BROKEN))
def test_check_catches_an_editing_rule_broken_on_purpose(claim):
    register(BROKEN[claim])
    result = CliRunner().invoke(app, ["check", "--strategy", BROKEN[claim].name, "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["verdict"], report["exit_code"], report["failed_claims"]) == ("kernel claim broken", 1, [claim])
    assert f"broke its claim(s) {claim}:" in report["reason"]
    outcomes = report["evidence"]["kernel_claims"]["revisable"]["claims"]
    assert outcomes[claim]["verdict"] == "broken"
    if claim == "fills":  # the decoder stopped at the step that filled nothing
        assert "filled none" in outcomes[claim]["detail"]
        assert {outcomes[c]["verdict"] for c in CLAIMS if c != claim} == {"untested"}
    else:
        assert {outcomes[c]["verdict"] for c in CLAIMS if c != claim} == {"holds"}


def test_a_rule_that_keeps_its_budget_passes_where_the_broken_one_fails():
    """The positive control of the budget: the same rule, editing only in its budget."""

    class EditsWithinBudget(EditsPastBudget):
        @dloom.hookimpl
        def dloom_select_commit(self, confidence, selectable, schedule):
            fills, edits = _fills(confidence, selectable, schedule)
            if schedule.post_steps is None:  # the contract probe: no edits offered
                return fills
            return fills | (edits & (schedule.post_steps <= self.rounds).unsqueeze(1))

    import dataclasses

    register(dataclasses.replace(BROKEN["edit_budget"], name="edits-within-budget", plugin_class=EditsWithinBudget))
    report = check_strategy("edits-within-budget", temperature=0, prompt_count=2)
    assert report.verdict == "approximate" and report.failed_claims == [], report.render()


def test_a_kernel_that_edits_the_prompt_is_caught(monkeypatch):
    """No rule can edit a prompt position through the hook (the kernel never offers one), so
    the claim is shown to bite on a kernel broken on purpose: it forgets the prompt."""
    monkeypatch.setattr(RevisableKernel, "restrict", lambda self, generated: None)
    report = check_strategy("joint_threshold", params={"edit_tau": 0.0}, temperature=0, prompt_count=2)
    assert (report.verdict, report.exit_code) == ("kernel claim broken", 1)
    assert report.failed_claims[0] == "prompt_kept"
    assert "prompt position(s) [0] of the block were edited" in report.evidence["kernel_claims"]["revisable"]["claims"]["prompt_kept"]["detail"]


def test_a_rule_that_commits_nothing_names_the_fills_claim(monkeypatch):
    class Nothing:
        @dloom.hookimpl
        def dloom_select_commit(self, confidence, selectable, schedule):
            return torch.zeros_like(selectable)

    report = check_strategy(StrategyRegistration("nothing", Nothing, claim=Claim("approximate")))
    assert (report.verdict, report.failed_claims) == ("contract broken", ["fills"])
    assert report.to_json()["failed_claims"] == ["fills"]


def test_the_text_report_lists_the_kernel_claims(monkeypatch):
    monkeypatch.setattr(cli, "console", Console(width=400))
    register(BROKEN["edit_budget"])
    result = CliRunner().invoke(app, ["check", "--strategy", "edits-past-budget"])
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("edits-past-budget: kernel claim broken")
    assert "edit_budget: broken: prompt" in result.stdout and "past its edit budget of 2" in result.stdout


def test_the_kernel_checks_decode_without_warning_the_user():
    """frechet's bound is not certified at the kernel checks' temperature 1: that is no news
    to someone checking the bound, so the check says nothing of it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = check_strategy("frechet", random_joints=20, adversarial_joints=20)
    assert report.verdict == "sound" and "kernel_claims" in report.evidence


class RemasksEverything:
    """Fills the two most confident masked positions and asks to remask every filled one,
    at every step: the kernel keeps one remask (two fills, one net), never more."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        masked = selectable if schedule.masked is None else selectable & schedule.masked
        _, ranks = sorted_profile(confidence, masked)
        fills = commit_top(ranks, masked, torch.full_like(ranks[:, 0], 2))
        if schedule.masked is None:
            return fills
        none = torch.zeros_like(selectable)
        return dloom.Edits(fills, none, none, remask=~schedule.masked)


def test_a_kernel_that_keeps_every_remask_is_caught_by_progress(monkeypatch):
    """No rule can stall a block through the hook (the kernel keeps at most one remask fewer
    than a step's fills), so the claim is shown to bite on a kernel broken on purpose: it
    keeps every remask asked for, and the rule above would then never finish a block."""
    register(StrategyRegistration(
        "remasks-everything", RemasksEverything, parameters=ROUNDS, claim=Claim("approximate"),
        kernels=("revisable",), edits=True, edit_budget="rounds",
    ))
    held = check_strategy("remasks-everything", temperature=0, prompt_count=2)
    assert (held.verdict, held.failed_claims) == ("approximate", []), held.render()
    progress = held.evidence["kernel_claims"]["revisable"]["claims"]["progress"]
    assert progress["verdict"] == "holds" and "(0 remask" not in progress["detail"]  # remasks were kept

    monkeypatch.setattr(revisable, "kept_remasks", lambda remask, probability, filled: remask)
    report = check_strategy("remasks-everything", temperature=0, prompt_count=2)
    assert (report.verdict, report.exit_code, report.failed_claims) == ("kernel claim broken", 1, ["progress"])
    outcomes = report.evidence["kernel_claims"]["revisable"]["claims"]
    assert "block 0: a fill step began with 1 masked position(s) and ended with 2" in outcomes["progress"]["detail"]
    assert {outcomes[c]["verdict"] for c in CLAIMS if c != "progress"} == {"untested"}
    assert "left its block no fewer masks" in outcomes["fills"]["detail"]
