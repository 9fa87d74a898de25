"""Hybrids of the diffusion decoder's speculation: single-hook replacements (who answers a
hook), the draft budget for a speculator without a prune, and the observer's step records.
The AR-target decoder's are in ``tests/ar/test_chain_speculation.py``."""

from __future__ import annotations

import pytest
import torch

import dloom
from dloom import DiffusionDecoder
from dloom.decode.speculation import follow_graph, layout_drafts
from dloom.errors import CompositionError, ConfigurationError, HookContractError
from dloom.hooks.composition import compose
from dloom.types import DraftGraph


class CountingPrune:
    """Keeps every draft and counts its calls (a user's pruning)."""

    def __init__(self) -> None:
        self.calls = 0

    @dloom.hookimpl
    def dloom_prune(self, graph, budget):
        self.calls += 1
        return graph


class OneDraft:
    """A speculator without a prune hook: one draft, the most confident masked position set."""

    @dloom.hookimpl
    def dloom_draft(self, state):
        if state.logits is None:
            return None
        block = state.block
        confidence, token = state.logits.softmax(-1).max(-1)
        masked = block == state.mask_token_id
        position = confidence.masked_fill(~masked, -1).argmax(-1, keepdim=True)
        draft = block.scatter(1, position, token.gather(1, position))
        return DraftGraph(
            tokens=torch.stack([block, draft], dim=1),
            parents=torch.tensor([[False, False], [True, False]]), depth=torch.tensor([0, 1]),
            score=torch.ones(block.shape[0], 2), valid=torch.stack([state.active, state.active & masked.any(-1)], 1),
        )

    @dloom.hookimpl
    def dloom_build_mask(self, state, graph):
        return layout_drafts(state, graph)

    @dloom.hookimpl
    def dloom_verify(self, state, graph, logits, kernel):
        return follow_graph(graph, logits, kernel)


# --- who answers a hook --------------------------------------------------------------------------


def test_two_answers_of_one_hook_are_refused_unless_one_is_an_explicit_replacement():
    with pytest.raises(CompositionError, match=r"both answer dloom_prune.*dloom.replace\('prune', plugin\)"):
        compose(["spiffy", CountingPrune(), "quota"])
    prune = CountingPrune()
    composition = compose(["spiffy", dloom.replace("prune", prune), "quota"])
    assert composition.provider("dloom_prune") == "CountingPrune"
    assert composition.provider("dloom_draft") == "spiffy"
    assert composition.hook_table()["dloom_prune"] == {"provider": "CountingPrune", "replaces": ["spiffy"]}
    assert composition.name == "spiffy+CountingPrune@prune+quota"


@pytest.mark.filterwarnings("ignore:no built-in draft graph fits")
def test_a_replaced_prune_is_the_only_one_called_and_spiffy_stays_lossless(tiny_adapter):
    prompts = [[5, 6, 7], [9, 3]]
    options = dict(gen_length=8, block_length=8)
    reference = DiffusionDecoder(tiny_adapter, "quota", **options).generate(prompts).token_lists
    prune = CountingPrune()
    decoder = DiffusionDecoder(tiny_adapter, ["spiffy", dloom.replace("prune", prune), "quota"], budget=10, **options)
    spiffy = next(c.plugin for c in decoder.composition.components if c.name == "spiffy")
    spiffy_prunes = []
    original = type(spiffy).dloom_prune
    type(spiffy).dloom_prune = lambda self, graph, budget: spiffy_prunes.append(1) or original(self, graph, budget)
    try:
        result = decoder.generate(prompts)
    finally:
        type(spiffy).dloom_prune = original
    assert result.token_lists == reference
    assert prune.calls == result.verification_forwards > 0 and spiffy_prunes == []


def test_a_spec_string_names_a_replacement_with_name_at_hook():
    composition = compose("spiffy+quota+threshold@select_commit")
    assert composition.provider("dloom_select_commit") == "threshold"
    assert composition.hook_table()["dloom_select_commit"]["replaces"] == ["quota"]


@pytest.mark.parametrize(
    "spec, message",
    [
        (["quota", dloom.replace("prune", CountingPrune()), dloom.replace("prune", CountingPrune())],
         "both replace dloom_prune"),
        (["spiffy", dloom.replace("verify", CountingPrune())], "replaces dloom_verify but does not implement it"),
        ("spiffy+quota+threshold@", "write NAME@HOOK"),
    ],
)
def test_bad_replacements_are_refused_when_composing(spec, message):
    with pytest.raises((CompositionError, ConfigurationError), match=message):
        compose(spec)


def test_replace_names_the_allowed_hooks():
    with pytest.raises(CompositionError, match="cannot replace 'register_strategies': allowed: select_commit, draft"):
        dloom.replace("register_strategies", CountingPrune())


# --- the draft budget binds every speculator ----------------------------------------------------


def test_a_speculator_without_prune_that_exceeds_the_budget_is_a_contract_error(tiny_adapter):
    options = dict(gen_length=8, block_length=8)
    DiffusionDecoder(tiny_adapter, [OneDraft(), "quota"], draft_budget=1, **options).generate([[5, 6, 7]])
    with pytest.raises(HookContractError, match="kept 1 drafts in a row for a budget of 0 .no plugin prunes"):
        DiffusionDecoder(tiny_adapter, [OneDraft(), "quota"], draft_budget=0, **options).generate([[5, 6, 7]])


# --- step records -------------------------------------------------------------------------------


def test_a_step_record_keeps_the_block_before_the_step(tiny_adapter):
    records = []
    DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=8).generate([[5, 6, 7]], observer=records.append)
    assert len(records) == 8
    for record in records:  # every plain step commits one position
        assert int((record.before != record.after).sum()) == 1
