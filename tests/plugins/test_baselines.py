"""Baseline commit rules on hand-worked confidence profiles."""

from __future__ import annotations

import torch

from dloom import BlockSchedule
from dloom_plugins.baselines import FactorCommit, QuotaCommit, ThresholdCommit


def schedule(step=0, steps_per_block=4, masked=(4,)):
    masked = torch.tensor(masked)
    return BlockSchedule(torch.full_like(masked, step), steps_per_block, masked)


def commit(rule, confidence, selectable, sched=None):
    c = torch.tensor(confidence, dtype=torch.float64)
    s = torch.tensor(selectable, dtype=torch.bool)
    return rule.dloom_select_commit(confidence=c, selectable=s, schedule=sched or schedule(masked=[len(confidence[0])] * len(confidence))).tolist()


def test_threshold_commits_all_above_tau():
    assert commit(ThresholdCommit(0.8), [[0.9, 0.5, 0.85, 0.8]], [[1, 1, 1, 1]]) == [[True, False, True, False]]


def test_threshold_commits_top_one_when_none_passes():
    assert commit(ThresholdCommit(0.95), [[0.3, 0.6, 0.5, 0.1]], [[1, 1, 1, 1]]) == [[False, True, False, False]]


def test_threshold_ignores_unselectable_positions():
    # Position 0 is the most confident but already unmasked or outside the block.
    assert commit(ThresholdCommit(0.5), [[0.99, 0.6, 0.4, 0.7]], [[0, 1, 1, 0]]) == [[False, True, False, False]]
    assert commit(ThresholdCommit(0.95), [[0.99, 0.6, 0.4, 0.7]], [[0, 0, 1, 0]]) == [[False, False, True, False]]


def test_threshold_ties_take_the_first_position_when_none_passes():
    assert commit(ThresholdCommit(0.9), [[0.4, 0.6, 0.6, 0.1]], [[1, 1, 1, 1]]) == [[False, True, False, False]]


def test_threshold_rows_are_independent_and_empty_rows_commit_nothing():
    out = commit(ThresholdCommit(0.5), [[0.9, 0.2], [0.1, 0.3], [0.9, 0.9]], [[1, 1], [1, 1], [0, 0]])
    assert out == [[True, False], [False, True], [False, False]]


def test_factor_follows_the_formula():
    # sorted: 0.95, 0.9, 0.8, 0.3 -> (n+1)(1-c_n): 0.1, 0.3, 0.8, 3.5
    conf = [[0.3, 0.95, 0.8, 0.9]]
    assert commit(FactorCommit(1.0), conf, [[1, 1, 1, 1]]) == [[False, True, True, True]]
    assert commit(FactorCommit(0.79), conf, [[1, 1, 1, 1]]) == [[False, True, False, True]]  # 0.8 < 0.79 fails
    assert commit(FactorCommit(0.31), conf, [[1, 1, 1, 1]]) == [[False, True, False, True]]
    assert commit(FactorCommit(0.29), conf, [[1, 1, 1, 1]]) == [[False, True, False, False]]


def test_factor_has_no_reference_off_by_one():
    # Only the last-ranked token fails: the formula commits 3, not 4.
    conf = [[0.99, 0.98, 0.97, 0.5]]  # 0.02, 0.06, 0.12, 2.5
    assert commit(FactorCommit(1.0), conf, [[1, 1, 1, 1]]) == [[True, True, True, False]]


def test_factor_commits_at_least_one():
    assert commit(FactorCommit(0.1), [[0.2, 0.4]], [[1, 1]]) == [[False, True]]


def test_factor_skips_unselectable():
    assert commit(FactorCommit(1.0), [[0.99, 0.97, 0.2]], [[0, 1, 1]]) == [[False, True, False]]


def test_quota_spreads_remainder_over_first_steps():
    rule = QuotaCommit()
    conf = [[0.1, 0.9, 0.5, 0.7, 0.3]]
    sel = [[1, 1, 1, 1, 1]]
    # 5 masked over 2 steps: 3 then 2.
    first = commit(rule, conf, sel, schedule(0, 2, [5]))
    second = commit(rule, conf, sel, schedule(1, 2, [5]))
    assert first == [[False, True, True, True, False]]
    assert sum(second[0]) == 2


def test_quota_per_row_counts():
    rule = QuotaCommit()
    conf = [[0.1, 0.9, 0.5, 0.7], [0.6, 0.2, 0.3, 0.4]]
    out = commit(rule, conf, [[1, 1, 1, 1], [1, 1, 1, 1]], schedule(0, 2, [4, 2]))
    assert out == [[False, True, False, True], [True, False, False, False]]
