"""``dloom check`` tests the claims the uniform-noise kernel (DiffusionGemma) brings on every
strategy that runs on it, and catches acceptance rules broken on purpose, one per claim a rule
can break through the hook, and a kernel or session broken on purpose for the others."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import dloom
from dloom import Claim, StrategyRegistration
from dloom.check import check_strategy, tiny
from dloom.check.kernel_claims import KERNEL_CLAIMS
from dloom.check.report import KERNEL_CHECKS
from dloom.check.resolve import resolve
from dloom.check.uniform_claims import check_uniform_claims
from dloom.cli.commands import app
from dloom.decode.kernel import Settlement
from dloom.decode.session import DecodeSession
from dloom.decode.uniform import UniformKernel
from dloom.hooks.registry import Strategy, get_registry

CLAIMS = KERNEL_CLAIMS["uniform"]


@pytest.fixture(autouse=True)
def tiny_greedy_model(monkeypatch):
    """The greedy checks run on tiny random models even once the toy zoo is trained."""
    monkeypatch.setattr(tiny, "zoo_installed", lambda *names: False)


def _most_confident(confidence, selectable):
    """The most confident selectable position of each row (``(B, K)`` bool)."""
    ranked = torch.where(selectable, confidence, -torch.inf)
    return selectable & (ranked == ranked.amax(-1, keepdim=True))


class UnseededAcceptance:
    """Accepts the most confident position and every one whose confidence, jittered by the
    global torch random stream (never seeded by the decoder), exceeds 0.5."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable):
        jittered = confidence + 0.5 * torch.rand(confidence.shape, dtype=confidence.dtype)
        return _most_confident(confidence, selectable) | (selectable & (jittered > 0.5))


class StallsOnWholeCanvases:
    """Accepts the most confident position, but nothing once a block has taken a step and
    still offers every position: what only the uniform kernel does (it offers the whole
    canvas at every step), so the hook contract probe, which decodes absorbing blocks, never
    sees it."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        stalls = (schedule.step_in_block > 0) & selectable.all(-1)
        return _most_confident(confidence, selectable) & ~stalls.unsqueeze(1)


class AcceptsNothing:
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable):
        return torch.zeros_like(selectable)


BROKEN = {
    "deterministic": StrategyRegistration(
        "unseeded-acceptance", UnseededAcceptance, claim=Claim("approximate"), kernels=("uniform",),
    ),
    "accepts": StrategyRegistration(
        "stalls-on-whole-canvases", StallsOnWholeCanvases, claim=Claim("approximate"), kernels=("uniform",),
    ),
}


@pytest.fixture
def register(monkeypatch):
    """Registers a strategy for the test alone."""

    def add(registration: StrategyRegistration) -> None:
        strategy = Strategy(registration.name, "tests", registration)
        monkeypatch.setitem(get_registry().strategies, registration.name, strategy)

    return add


def test_the_entropy_bound_keeps_every_claim_of_the_uniform_kernel():
    report = check_strategy("entropy_bound", temperature=0, prompt_count=4)
    assert (report.verdict, report.exit_code, report.failed_claims) == ("approximate", 0, [])
    assert list(report.evidence["kernel_claims"]) == ["revisable", "uniform"]  # every kernel it runs on
    kernel = report.evidence["kernel_claims"]["uniform"]
    assert kernel["model"].startswith("tiny-uniform-dllm") and list(kernel["claims"]) == list(CLAIMS)
    assert all(outcome["verdict"] == "holds" for outcome in kernel["claims"].values()), report.render()
    assert "uniform kernel claims on tiny-uniform-dllm" in report.render()
    # not vacuous: canvases spend their budget, steps accept several positions, rows end at an EOS
    details = {name: outcome["detail"] for name, outcome in kernel["claims"].items()}
    assert "budget of 4 steps (at most 4)" in details["step_budget"]
    steps, accepted = (int(word) for word in details["accepts"].replace("(", "").split() if word.isdigit())
    assert accepted > steps
    assert steps < 8 * 2 * 4  # some row ended at an EOS before its last canvas


def test_dloom_check_passes_the_entropy_bound():
    result = CliRunner().invoke(app, ["check", "--strategy", "entropy_bound", "-n", "4", "--temperature", "0", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["verdict"], report["failed_claims"]) == ("approximate", [])
    assert {c["verdict"] for c in report["evidence"]["kernel_claims"]["uniform"]["claims"].values()} == {"holds"}


def test_only_the_entropy_bound_runs_on_the_uniform_kernel():
    registry = get_registry().strategies
    uniform = [name for name, s in registry.items() if s.plugin != "tests" and "uniform" in resolve(name).kernels]
    assert uniform == ["entropy_bound"]
    assert list(KERNEL_CHECKS) == list(KERNEL_CLAIMS)  # every kernel with claims has its test


@pytest.mark.parametrize("claim", list(BROKEN))
def test_check_catches_an_acceptance_rule_broken_on_purpose(claim, register):
    register(BROKEN[claim])
    result = CliRunner().invoke(app, ["check", "--strategy", BROKEN[claim].name, "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["verdict"], report["exit_code"], report["failed_claims"]) == ("kernel claim broken", 1, [claim])
    assert f"decodes on the uniform kernel broke its claim(s) {claim}:" in report["reason"]
    outcomes = report["evidence"]["kernel_claims"]["uniform"]["claims"]
    assert outcomes[claim]["verdict"] == "broken"
    if claim == "accepts":  # the decoder stopped at the step that accepted nothing
        assert "step 2 accepted no position" in outcomes[claim]["detail"]
        assert {outcomes[c]["verdict"] for c in CLAIMS if c != claim} == {"untested"}
    else:
        assert "two decodes with seed 0 differ" in outcomes[claim]["detail"]
        assert {outcomes[c]["verdict"] for c in CLAIMS if c != claim} == {"holds"}


def test_a_rule_that_accepts_nothing_names_the_accepts_claim(register):
    """Caught before any decode, by the hook contract probe."""
    register(StrategyRegistration("accepts-nothing", AcceptsNothing, claim=Claim("approximate"), kernels=("uniform",)))
    result = CliRunner().invoke(app, ["check", "--strategy", "accepts-nothing", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["verdict"], report["failed_claims"]) == ("contract broken", ["accepts"])


def test_a_kernel_that_runs_a_canvas_past_its_budget_is_caught(monkeypatch):
    """No rule can keep a canvas going through the hook (the kernel ends it when its budget
    is spent), so the claim is shown to bite on a kernel broken on purpose: it settles a
    canvas one step late."""
    settle = UniformKernel.settle

    def late(self, block):
        settled = settle(self, block)
        on_time = self.steps > self.steps_per_block
        return Settlement(settled.ended & on_time, settled.complete & (on_time | self.stopped))

    monkeypatch.setattr(UniformKernel, "settle", late)
    report = check_uniform_claims(resolve("entropy_bound"))
    assert report.failed == ["step_budget"]
    assert "the canvas took step 5, past its budget of 4 steps" in report.claims["step_budget"]["detail"]


def test_a_session_that_overwrites_the_prompt_is_caught(monkeypatch):
    """The prompt is the encoder's prefix, which no kernel step touches: the claim is shown
    to bite on a session broken on purpose, which overwrites a prompt token after a step."""
    step = DecodeSession.step

    def overwrites(self):
        done = step(self)
        if self.size:
            self.x[0, 0] = 4 if int(self.x[0, 0]) == 3 else 3  # another plain token
        return done

    monkeypatch.setattr(DecodeSession, "step", overwrites)
    report = check_uniform_claims(resolve("entropy_bound"))
    assert report.failed[0] == "prompt_kept"
    assert "prompt 0: its prompt tokens changed" in report.claims["prompt_kept"]["detail"]
