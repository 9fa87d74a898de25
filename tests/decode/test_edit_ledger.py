"""Edit accounting on the revisable kernel (:mod:`dloom.decode.edit_ledger`): edits counted by
hand on a scripted sequence of steps, the same counts and drafts as a count written here from
every step an observer sees, and none at all for a fill rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dloom
from conftest import revisable
from dloom.decode.edit_ledger import EditLedger

M = 99  # the mask id of the hand-worked steps
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


def test_edits_and_drafts_by_hand():
    """One row: prompt ``1``, a block of four generated positions at columns 1..4."""
    ledger = EditLedger(torch.tensor([[1, M, M, M, M]]), M)
    columns = torch.tensor([[1, 2, 3, 4]])
    steps = [
        ([M, M, M, M], [10, 11, M, M]),  # fills only: no edit
        ([10, 11, M, M], [20, 11, 12, M]),  # 10 -> 20 rewritten (one edit), 12 filled
        ([20, 11, 12, M], [20, M, 12, 13]),  # 11 remasked (one edit), 13 filled
        ([20, M, 12, 13], [20, 21, 12, 13]),  # the remasked position refilled: no edit
        ([20, 21, 12, 13], [20, 21, 13, M]),  # a delete moves 13 left (one edit) and leaves a mask (one more)
    ]
    counts = []
    for before, after in steps:
        ledger.record(columns, torch.tensor([before]), torch.tensor([after]), None)
        counts.append(int(ledger.edits[0]))
    assert counts == [0, 1, 2, 2, 4]
    assert ledger.drafts.tolist() == [[1, 10, 11, 12, 13]]  # each position's first filled token


def test_positions_outside_the_generated_ones_are_not_counted_and_rows_follow_the_batch():
    ledger = EditLedger(torch.tensor([[1, M, M], [2, M, M]]), M)
    columns = torch.tensor([[0, 1, 2], [0, 1, 2]])
    generated = torch.tensor([[False, True, True], [False, True, True]])
    ledger.record(columns, torch.tensor([[1, M, M], [2, M, M]]), torch.tensor([[3, 4, M], [2, 5, 6]]), generated)
    ledger.record(columns, torch.tensor([[3, 4, M], [2, 5, 6]]), torch.tensor([[3, 7, 8], [2, 9, 6]]), generated)
    assert ledger.edits.tolist() == [1, 1]  # row 0's prompt column changed, but it is not generated
    ledger.keep(torch.tensor([1]))
    ledger.join(1, torch.tensor([[0, 3, M, M]]), 0)
    assert ledger.drafts.tolist() == [[0, 2, 5, 6], [0, 3, M, M]] and ledger.edits.tolist() == [1, 0]


def reference_edits(adapter, strategy, prompts, settings):
    """Each row's edits and drafts counted here, in Python, from every step an observer sees
    (blocks after the prompt, which the layout left-pads to the longest)."""
    records = []
    decoder = dloom.DiffusionDecoder(adapter, strategy, **settings)
    result = decoder.generate(prompts, observer=records.append)
    gen, width, mask = settings["gen_length"], settings["block_length"], adapter.mask_token_id
    edits = [0] * len(prompts)
    drafts = [[mask] * gen for _ in prompts]
    for record in records:
        for block, row, before, after in zip(record.block.tolist(), record.rows.tolist(), record.before.tolist(),
                                              record.after.tolist()):
            for offset, (old, new) in enumerate(zip(before, after)):
                edits[row] += old != mask and new != old
                column = block * width + offset
                if drafts[row][column] == mask:
                    drafts[row][column] = new
    return result, edits, drafts


@pytest.mark.parametrize("strategy, params", [
    ("joint_threshold", {"tau": 0.3, "edit_tau": 0.0, "max_post_steps": 4}),
    ("frechet_edit", {"delta": 0.5, "edit_tau": 0.0, "max_post_steps": 4}),
])
def test_the_result_s_edits_and_drafts_are_every_step_s(sharp_adapter, strategy, params):
    settings = dict(gen_length=16, block_length=4, **params)
    result, edits, drafts = reference_edits(revisable(sharp_adapter), strategy, PROMPTS, settings)
    assert result.edits is not None and result.drafts is not None and result.draft_texts is None  # no tokenizer
    assert result.edits.tolist() == edits
    assert sum(edits) > 0, "no edit happened: the test is vacuous"
    assert result.drafts.tolist() == drafts
    assert result.drafts.tolist() != result.generated.tolist(), "every draft survived: the test is vacuous"
    row = result.row(0)
    assert row["edits"] == edits[0] and "draft_text" in row


@pytest.mark.parametrize("kernel", ["absorbing", "revisable"])
def test_a_fill_rule_reports_no_edits(sharp_adapter, kernel):
    adapter = dataclasses.replace(sharp_adapter, kernel=kernel)
    result = dloom.DiffusionDecoder(adapter, "threshold", gen_length=16, block_length=4, tau=0.3).generate(PROMPTS)
    assert result.edits is None and result.drafts is None and result.draft_texts is None
    assert "edits" not in result.row(0)


def test_without_edits_an_editing_rule_counts_none_and_its_drafts_are_its_answer(sharp_adapter):
    settings = dict(gen_length=16, block_length=4, tau=0.3, edit_tau=1.0, max_post_steps=0)
    result = dloom.DiffusionDecoder(revisable(sharp_adapter), "joint_threshold", **settings).generate(PROMPTS)
    assert result.edits is not None and result.edits.tolist() == [0] * len(PROMPTS)
    assert result.drafts is not None and torch.equal(result.drafts, result.generated)
