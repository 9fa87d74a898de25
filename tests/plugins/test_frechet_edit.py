"""``frechet_edit``: Fréchet-certified fills with LLaDA2.1's threshold edits, on hand-worked
profiles and in a decoder on the revisable kernel."""

from __future__ import annotations

import pytest
import torch

import dloom
from conftest import edit_schedule, revisable
from dloom.errors import ConfigurationError
from dloom_plugins.frechet import FrechetCommit, FrechetEditCommit

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


def test_fills_are_the_frechet_prefix_of_the_masked_positions_and_edits_pass_edit_tau():
    # positions 0-3 masked (profile 0.3, 0.95, 0.8, 0.9: frechet at delta 0.5 takes 1 and 3);
    # positions 4-5 filled and offered for an edit, at 0.6 and 0.4.
    confidence = torch.tensor([[0.3, 0.95, 0.8, 0.9, 0.6, 0.4]], dtype=torch.float64)
    selectable = torch.ones(1, 6, dtype=torch.bool)
    plan = edit_schedule([[1, 1, 1, 1, 0, 0]], [0])
    got = FrechetEditCommit(0.5, edit_tau=0.5, max_post_steps=4).dloom_select_commit(confidence, selectable, plan)
    assert got.tolist() == [[False, True, False, True, True, False]]
    # the filled positions do not count in the fills' profile: frechet on the masked ones alone
    fills = FrechetCommit(0.5).dloom_select_commit(confidence[:, :4], selectable[:, :4], plan)
    assert got[:, :4].tolist() == fills.tolist()


def test_no_edit_past_the_post_step_budget_and_none_at_edit_tau_one():
    confidence = torch.tensor([[0.99, 0.9], [0.99, 0.9]], dtype=torch.float64)
    selectable = torch.ones(2, 2, dtype=torch.bool)
    plan = edit_schedule([[0, 0], [0, 0]], [2, 3])  # no mask left; row 1 has spent its 2 post steps
    rule = FrechetEditCommit(0.5, edit_tau=0.5, max_post_steps=2)
    assert rule.dloom_select_commit(confidence, selectable, plan).tolist() == [[True, True], [False, False]]
    never = FrechetEditCommit(0.5, edit_tau=1.0, max_post_steps=2)
    assert not never.dloom_select_commit(confidence, selectable, plan).any()


def test_at_edit_tau_one_it_decodes_exactly_as_frechet(sharp_adapter):
    settings = dict(gen_length=16, block_length=4, delta=0.2)
    frechet = dloom.DiffusionDecoder(sharp_adapter, "frechet", **settings).generate(PROMPTS)
    hybrid = dloom.DiffusionDecoder(
        revisable(sharp_adapter), "frechet_edit", edit_tau=1.0, max_post_steps=0, **settings,
    ).generate(PROMPTS)
    assert hybrid.token_lists == frechet.token_lists and torch.equal(hybrid.nfe, frechet.nfe)


def test_edits_change_the_output_and_a_batch_decodes_as_its_rows_alone(sharp_adapter):
    settings = dict(gen_length=16, block_length=4, delta=0.0, edit_tau=0.0, max_post_steps=3)
    decoder = dloom.DiffusionDecoder(revisable(sharp_adapter), "frechet_edit", **settings)
    batch = decoder.generate(PROMPTS)
    fills_only = dloom.DiffusionDecoder(
        revisable(sharp_adapter), "frechet_edit", **{**settings, "edit_tau": 1.0, "max_post_steps": 0},
    ).generate(PROMPTS)
    assert batch.token_lists != fills_only.token_lists, "no edit changed any output: the test is vacuous"
    for row, prompt in enumerate(PROMPTS):
        alone = decoder.generate([prompt])
        assert alone.token_lists[0] == batch.token_lists[row] and int(alone.nfe[0]) == int(batch.nfe[row])


def test_refused_on_the_absorbing_kernel(sharp_adapter):
    with pytest.raises(ConfigurationError, match="'frechet_edit' supports the 'revisable' kernel"):
        dloom.DiffusionDecoder(sharp_adapter, "frechet_edit", gen_length=8, block_length=4)
