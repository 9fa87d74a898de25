"""FailFast's ``drafting="auto"``: the break-even drafter/target cost ratio, the decision after
the warm-up rounds, and the target's own tokens whether it drafts or not."""

from __future__ import annotations

import pytest
import torch

from dloom.check.target import target_greedy
from dloom.check.tiny import tiny_ar, tiny_dllm
from dloom.errors import ConfigurationError
from dloom.model.cost import CostCurve
from dloom.types import ChainVerdict, DraftChains
from dloom_plugins.failfast import FailFast, FailFastDecoder, FailFastSettings, payoff
from dloom_plugins.failfast.payoff import (
    MIN_GAIN,
    WARMUP_ROUNDS,
    DraftingLedger,
    break_even_ratio,
)

PAIR = dict(vocab=16, hidden=32, layers=2, init=0.8, context=128)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def test_break_even_ratio_weighs_tokens_against_drafter_forwards_and_the_verification():
    # 5.5 tokens per round (5 after the 1.1 margin) for 4 drafter forwards; a flat target
    # verifies 8 tokens at the price of 1
    assert MIN_GAIN == 1.1
    assert break_even_ratio(5.5, 4.0, 7.0, CostCurve.flat()) == pytest.approx(1.0)
    # a linear target pays for the 8-token verification: 8 forwards' worth, more than 5 tokens
    assert break_even_ratio(5.5, 4.0, 7.0, CostCurve.linear(1.0, 1.0)) == pytest.approx(-0.75)
    assert break_even_ratio(5.0, 0.0, 7.0, CostCurve.flat()) is None


def round_of(accepted: list[int], forwards: list[int], length: list[int]):
    chains = DraftChains(
        tokens=torch.zeros(len(length), 1, dtype=torch.long), length=torch.tensor(length),
        open=torch.zeros(len(length), dtype=torch.bool), drafter_nfe=torch.tensor(forwards),
    )
    return chains, ChainVerdict(accepted=torch.tensor(accepted), token=torch.zeros(len(length), dtype=torch.long))


@pytest.mark.parametrize("drafter_seconds, drafting", [(0.5, True), (2.0, False)])
def test_the_ledger_drafts_through_the_warm_up_then_only_if_it_pays(drafter_seconds, drafting):
    ledger = DraftingLedger(CostCurve.flat(1.0), drafter_seconds)
    active = torch.tensor([True, False])  # the second row is finished: not counted
    for _ in range(WARMUP_ROUNDS):
        assert ledger.decide() and ledger.report is None
        ledger.record(*round_of([3, 9], [2, 9], [5, 9]), active)
    # per row-round: 4 tokens, 2 drafter forwards, 5 proposed: r* = (4 / 1.1 - 1) / 2
    assert ledger.decide() is drafting
    assert ledger.report["break_even_ratio"] == pytest.approx((4 / 1.1 - 1) / 2)
    assert ledger.report["measured_ratio"] == pytest.approx(drafter_seconds)
    assert ledger.report["per_row_round"] == {"tokens": 4.0, "drafter_forwards": 2.0, "proposed": 5.0}
    ledger.record(*round_of([0, 0], [50, 50], [5, 5]), active)  # decided once: later rounds change nothing
    assert ledger.decide() is drafting


def test_drafting_takes_always_or_auto():
    assert FailFastSettings(drafting="auto").drafting == "auto"
    with pytest.raises(ConfigurationError, match="failfast drafting is 'often'; allowed: always, auto"):
        FailFastSettings(drafting="often")


def decode(drafter_seconds: float | None, monkeypatch) -> tuple[object, FailFast]:
    target, drafter = tiny_ar(0, **PAIR), tiny_dllm(0, **PAIR)
    if drafter_seconds is not None:  # given costs: a flat target, a drafter at this ratio
        def measured(model, seq_len, nodes, layout="rows", span=32, **_):
            return CostCurve.flat(1.0 if model is target else drafter_seconds)

        monkeypatch.setattr(payoff, "measure_cost_curve", measured)
    decoder = FailFastDecoder(target, drafter, params={"drafting": "auto"}, max_new_tokens=60)
    plugin = next(p for p in decoder.pm.get_plugins() if isinstance(p, FailFast))
    results = [decoder.generate(PROMPTS) for _ in range(3)]
    expected = target_greedy(target, PROMPTS, 60)
    assert all(r.token_lists == expected for r in results)  # the target's tokens, drafting or not
    return results, plugin


def test_a_drafter_too_dear_to_pay_leaves_the_target_decoding_alone(monkeypatch):
    results, plugin = decode(50.0, monkeypatch)
    report = plugin.ledger.report
    assert report["drafting"] is False and plugin.ledger.rounds == WARMUP_ROUNDS
    # decided mid-batch: the rest of it, and every later batch, in the target's plain loop
    assert results[0].drafting == {"path": "target alone", "drafted_rounds": WARMUP_ROUNDS, **report}
    assert results[-1].drafting == {"path": "target alone", "drafted_rounds": 0, **report}
    assert results[-1].drafter_forwards == 0 and results[-1].verifications == 0
    assert results[-1].forwards == 1 + max(map(len, results[-1].token_lists))  # prefill, then one per token
    assert report["measured_ratio"] == 50.0 and report["break_even_ratio"] < 50.0


def test_a_cheap_drafter_keeps_drafting(monkeypatch):
    results, plugin = decode(0.001, monkeypatch)
    assert plugin.ledger.report["drafting"] is True
    assert plugin.ledger.report["break_even_ratio"] > plugin.ledger.report["measured_ratio"]
    assert results[-1].drafter_forwards > 0
    assert results[-1].drafting == {"path": "drafted", **plugin.ledger.report}


def test_auto_measures_both_models_when_no_costs_are_given(monkeypatch):
    _, plugin = decode(None, monkeypatch)
    ledger = plugin.ledger
    assert ledger.target_cost.description["layout"] == "cached" and ledger.drafter_seconds > 0
    assert ledger.report is not None and ledger.report["measured_ratio"] == pytest.approx(ledger.measured_ratio)
