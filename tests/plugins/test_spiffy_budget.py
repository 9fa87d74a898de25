"""Spiffy's ``budget=auto``: expected accepted drafts per nested budget, the chooser under
given cost curves, and the decoder running at the chosen ``D``."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from dloom import DiffusionDecoder
from dloom.errors import ConfigurationError
from dloom.hooks.composition import compose
from dloom.hooks.registry import get_registry
from dloom.model.cost import CostCurve
from dloom_plugins.spiffy import Spiffy
from dloom_plugins.spiffy.budget import (
    CACHED_MIN_GAIN,
    MIN_GAIN,
    accepted_on_paths,
    choose_budget,
    expected_accepted,
    selection_order,
    speedups,
    steps_per_block,
)
from dloom_plugins.spiffy.calibrate import calibrate
from dloom_plugins.spiffy.graph import CalibratedGraph, GraphNode, find_builtin

ACCEPTED = [0.0, 0.5, 0.8, 1.0, 1.1, 1.15]  # A(D), D = 0 .. 5: gains that saturate
STEPS = 5.0  # the base rule's steps per block


def test_on_a_flat_curve_the_chooser_takes_the_largest_budget():
    assert choose_budget(ACCEPTED, CostCurve.flat(0.02), STEPS) == 5


def test_on_a_steep_linear_curve_the_chooser_takes_the_base_rule_alone():
    # each draft row costs as much as the root: (1 + A) / (D + 1) < 1 for every D >= 1
    assert choose_budget(ACCEPTED, CostCurve.linear(base=1.0, per_node=1.0), STEPS) == 0


def test_on_a_shallow_linear_curve_the_chooser_stops_where_gains_saturate():
    curve = CostCurve.linear(base=1.0, per_node=0.1)
    gains = speedups(ACCEPTED, curve, STEPS)
    # a block: its first forward plain, then (s - 1) / (1 + A) verifications of D + 1 nodes
    assert gains[3] == pytest.approx(5.0 / (1 + 4.0 / 2.0 * 1.3))
    assert gains[0] == 1.0
    assert choose_budget(ACCEPTED, curve, STEPS) == gains.index(max(gains)) == 3


def test_a_verifications_own_work_counts_beside_its_forward():
    # a flat curve of 10 ms forwards: free rows, but each verification spends 10 ms more
    curve = CostCurve.flat(0.01)
    overhead = [0.0] + [0.01] * 5
    gains = speedups(ACCEPTED, curve, STEPS, overhead)
    assert gains[3] == pytest.approx(5.0 / (1 + 4.0 / 2.0 * 2.0))  # the forward and as much again
    assert speedups(ACCEPTED, curve, STEPS, [0.0] * 6) == speedups(ACCEPTED, curve, STEPS)
    assert choose_budget(ACCEPTED, curve, STEPS) == 5
    assert choose_budget(ACCEPTED, curve, STEPS, overhead) == 0  # drafting would cost wall time
    # on forwards of a second the same work is negligible: the largest budget again
    assert choose_budget(ACCEPTED, CostCurve.flat(1.0), STEPS, overhead) == 5
    with pytest.raises(ConfigurationError, match="overhead has 2 entries; expected one per budget, 6"):
        speedups(ACCEPTED, curve, STEPS, [0.0, 0.01])


def test_with_a_cache_the_bar_is_higher():
    # 1.2x expected: enough without a cache, not where the curve only approximates a cached row
    accepted = [0.0, 0.5]
    assert speedups(accepted, CostCurve.flat(), 2.0)[1] == pytest.approx(1.2)
    assert MIN_GAIN < 1.2 < CACHED_MIN_GAIN
    assert choose_budget(accepted, CostCurve.flat(), 2.0) == 1
    assert choose_budget(accepted, CostCurve.flat(), 2.0, min_gain=CACHED_MIN_GAIN) == 0


def test_a_gain_below_the_bar_keeps_the_base_rule():
    # a little over 1 (1.04 at D = 1) does not cover the hooks' own time
    accepted = [0.0, 0.1]
    assert 1.0 < speedups(accepted, CostCurve.flat(), 2.0)[1] < MIN_GAIN
    assert choose_budget(accepted, CostCurve.flat(), 2.0) == 0
    # an uncalibrated graph (A = 0) never drafts, even where rows are free
    assert choose_budget([0.0] * 6, CostCurve.flat(), STEPS) == 0


def test_accepted_drafts_follow_each_path_while_its_states_are_kept():
    paths = Counter({("a", "b", "c"): 2, ("x",): 1, ("a", "x"): 1, (): 1})
    # 5 roots; a path counts its leading states that are kept, times how often it was seen
    assert accepted_on_paths(paths, 5, ["a", "b", "x", "c"]) == pytest.approx(
        [3 / 5, 5 / 5, (2 * 2 + 1 + 2) / 5, (2 * 3 + 1 + 2) / 5]
    )
    with pytest.raises(ConfigurationError, match="roots is 0"):
        accepted_on_paths(paths, 0, ["a"])


def graph_with(nodes, calibration) -> CalibratedGraph:
    return CalibratedGraph(
        model="tiny", tokenizer_sha256=None, base={"strategy": "quota", "params": {}, "steps_per_block": 4},
        block_length=4, temperature=0.0, remasking="low_confidence", nodes=tuple(nodes), calibration=calibration,
    )


def test_expected_accepted_is_estimated_from_frequencies_in_selection_order():
    nodes = [
        GraphNode(((0, 0),), (0,), frequency=6, score=6.0),
        GraphNode(((0, 1),), (0,), frequency=2, score=2.0),
        GraphNode(((0, 0), (1, 0)), (1,), frequency=4, score=4.0),
    ]
    graph = graph_with(nodes, {"paths": 10})
    assert selection_order(graph.nodes) == [1, 3, 2]  # the child of 1 outscores node 2
    assert expected_accepted(graph) == pytest.approx([0.0, 0.6, 1.0, 1.2])
    recorded = graph_with(nodes, {"paths": 10, "accepted": [0.5, 0.7, 0.8]})
    assert expected_accepted(recorded) == [0.0, 0.5, 0.7, 0.8]
    with pytest.raises(ConfigurationError, match="expected 3 numbers, one per budget"):
        expected_accepted(graph_with(nodes, {"accepted": [0.5]}))


def test_calibration_records_roots_and_the_accepted_drafts_of_every_nested_budget(tiny_adapter):
    decoder = DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=4)
    prompts = [[t % 30 + 3, (t * 7) % 30 + 3] for t in range(6)]
    graph = calibrate(decoder, prompts, budget=4)
    info = graph.calibration
    assert info["roots"] >= info["paths"] > 0
    assert len(info["accepted"]) == graph.budget
    assert all(b >= a >= 0 for a, b in zip(info["accepted"], info["accepted"][1:]))
    # the exact in-sample figure never exceeds the frequency estimate (which counts every visit)
    estimate = expected_accepted(graph_with(graph.nodes, {"paths": info["roots"]}))
    assert all(a <= e + 1e-3 for a, e in zip(info["accepted"], estimate[1:]))


def test_the_built_in_graphs_give_increasing_estimates():
    graph = find_builtin({
        "model": "toy-dllm", "tokenizer_sha256": "923ec2d320348aa4c473f60334e31c4c6da5ba505cfd13cd700c2c3219227912",
        "block_length": 8, "commit_rule": "threshold", "commit_params": {"tau": 0.9}, "steps_per_block": 8,
    })
    assert graph is not None
    accepted = expected_accepted(graph)
    assert len(accepted) == graph.budget + 1 and accepted[0] == 0
    assert all(b >= a for a, b in zip(accepted, accepted[1:])) and accepted[-1] > 0.5
    steps = steps_per_block(graph)
    assert 1 < steps <= graph.base["steps_per_block"]
    assert choose_budget(accepted, CostCurve.flat(), steps) == graph.budget
    assert choose_budget(accepted, CostCurve.linear(1.0, 1.0), steps) == 0


def test_steps_per_block_counts_the_calibration_roots_per_block():
    nodes = [GraphNode(((0, 0),), (0,), frequency=3, score=3.0)]
    # 10 prompts of 2 blocks, 30 roots: 1.5 roots per block, one step more (the block's last)
    calibrated = graph_with(nodes, {"roots": 30, "paths": 25, "prompts": 10, "gen_length": 8})
    assert steps_per_block(calibrated) == pytest.approx(2.5)
    assert steps_per_block(graph_with(nodes, {"paths": 25, "prompts": 10, "gen_length": 8})) == pytest.approx(2.25)
    assert steps_per_block(graph_with(nodes, {"uncalibrated": True})) == 4.0  # the rule's step budget


def test_budget_accepts_auto_and_integers_and_names_the_allowed_values():
    assert compose("spiffy", {"budget": "auto"}).params()["spiffy"]["budget"] == "auto"
    assert compose("spiffy", {"budget": "3"}).params()["spiffy"]["budget"] == 3
    with pytest.raises(ConfigurationError, match=r"is -1; allowed: \[0, inf\) or 'auto'"):
        compose("spiffy", {"budget": -1})
    with pytest.raises(ConfigurationError, match=r"must be a int, got 'many'; allowed: \[0, inf\) or 'auto'"):
        compose("spiffy", {"budget": "many"})
    with pytest.raises(ConfigurationError, match="budget is 'some'; allowed: an int >= 0 or 'auto'"):
        Spiffy(budget="some")


def run(adapter, strategy, params, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the uncalibrated-graph note
        decoder = DiffusionDecoder(adapter, strategy, params=params, gen_length=16, block_length=8, **options)
    spiffy = next((p for p in decoder.pm.get_plugins() if isinstance(p, Spiffy)), None)
    return decoder.generate([[5, 6, 7], [8, 9, 10, 11], [14]]), spiffy


@pytest.fixture
def quota_graph(sharp_adapter, tmp_path) -> str:
    """A graph calibrated for quota on the sharp model (its own prompts)."""
    prompts = [[t % 30 + 3, (t * 7) % 30 + 3, (t * 13) % 30 + 3] for t in range(12)]
    graph = calibrate(DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=8), prompts, budget=6)
    path = tmp_path / "quota.json"
    graph.save(path)
    return str(path)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_auto_runs_at_the_chosen_budget_and_decodes_the_rules_tokens(sharp_adapter, quota_graph, tmp_path, cache):
    reference, _ = run(sharp_adapter, "quota", {}, cache=cache)
    flat, steep = tmp_path / "flat.json", tmp_path / "steep.json"
    CostCurve.flat().save(flat)
    CostCurve.linear(1.0, 1.0).save(steep)
    graph = {"graph": quota_graph, "budget": "auto"}
    drafted, plugin = run(sharp_adapter, "spiffy+quota", {**graph, "cost": str(flat)}, cache=cache)
    assert plugin.chosen_budget == plugin.graph.budget and plugin.choice["budget"] == plugin.chosen_budget
    assert drafted.token_lists == reference.token_lists
    assert drafted.accepted_drafts > 0 and drafted.nfe.sum() + drafted.accepted_drafts == reference.nfe.sum()
    plain, plugin = run(sharp_adapter, "spiffy+quota", {**graph, "cost": str(steep)}, cache=cache)
    assert plugin.chosen_budget == 0
    assert plain.token_lists == reference.token_lists
    assert plain.accepted_drafts == 0 and torch.equal(plain.nfe, reference.nfe)
    assert plain.speculation["verifications"] == 0 < drafted.speculation["verifications"]  # D = 0: plain steps


def test_at_no_drafts_the_decoder_takes_the_rules_plain_steps_and_never_calls_the_draft_hook(
    sharp_adapter, quota_graph, tmp_path, monkeypatch,
):
    """At ``D = 0`` Spiffy calls ``decline_drafting`` of its ``dloom_configure`` config."""
    steep = tmp_path / "steep.json"
    CostCurve.linear(1.0, 1.0).save(steep)
    from dloom.hooks import calls as hook_calls

    calls = []
    original = hook_calls.draft
    monkeypatch.setattr(hook_calls, "draft", lambda pm, state: calls.append(1) or original(pm, state))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        declined = DiffusionDecoder(sharp_adapter, "spiffy+quota", params={"graph": quota_graph, "cost": str(steep)},
                                    gen_length=16, block_length=8)
        drafting = DiffusionDecoder(sharp_adapter, "spiffy+quota", params={"graph": quota_graph, "budget": 2},
                                    gen_length=16, block_length=8)
    assert declined.speculative_step is None and drafting.speculative_step is not None
    declined.generate([[5, 6, 7], [8, 9, 10, 11]])
    assert calls == []
    drafting.generate([[5, 6, 7], [8, 9, 10, 11]])
    assert calls  # the same hook, called where the plugin drafts


def test_only_the_plugin_answering_the_draft_hook_can_decline_drafting(sharp_adapter, quota_graph):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder = DiffusionDecoder(sharp_adapter, "spiffy+quota", params={"graph": quota_graph, "budget": 2},
                                   gen_length=16, block_length=8)
    rule = next(p for p in decoder.pm.get_plugins() if p is not None and not isinstance(p, Spiffy))
    decoder.setup["decline_drafting"](rule)  # not the drafter: ignored
    assert decoder.speculative_step is not None
    decoder.setup["decline_drafting"](next(p for p in decoder.pm.get_plugins() if isinstance(p, Spiffy)))
    assert decoder.speculative_step is None


def test_an_explicit_budget_wins_and_the_decoders_draft_budget_caps_auto(sharp_adapter, quota_graph, tmp_path):
    flat = tmp_path / "flat.json"
    CostCurve.flat().save(flat)
    _, plugin = run(sharp_adapter, "spiffy+quota", {"budget": 2, "cost": str(flat)})
    assert plugin.chosen_budget == 2 and plugin.choice is None
    _, plugin = run(sharp_adapter, "spiffy+quota", {"graph": quota_graph, "budget": "auto", "cost": str(flat)},
                    draft_budget=3)
    assert plugin.chosen_budget == 3


def test_the_default_budget_is_auto_and_an_explicit_budget_overrides_it(sharp_adapter, quota_graph, tmp_path):
    assert Spiffy().budget == "auto" and compose("spiffy", {}).params()["spiffy"]["budget"] == "auto"
    parameter = next(p for p in get_registry().get("spiffy").parameters if p.name == "budget")
    assert parameter.default == "auto"
    flat = tmp_path / "flat.json"
    CostCurve.flat().save(flat)
    _, plugin = run(sharp_adapter, "spiffy+quota", {"graph": quota_graph, "cost": str(flat)})  # no budget
    assert plugin.budget == "auto" and plugin.choice is not None
    assert plugin.chosen_budget == choose_budget(expected_accepted(plugin.graph), CostCurve.flat(),
                                                 steps_per_block(plugin.graph)) == plugin.graph.budget
    _, plugin = run(sharp_adapter, "spiffy+quota", {"graph": quota_graph, "cost": str(flat), "budget": 3})
    assert plugin.chosen_budget == 3 and plugin.choice is None


def test_auto_without_a_cost_file_measures_the_model(sharp_adapter, quota_graph):
    result, plugin = run(sharp_adapter, "spiffy+quota", {"graph": quota_graph, "budget": "auto"})
    overhead = plugin.choice["overhead"]  # a verification's own work, timed per budget
    assert len(overhead) == plugin.graph.budget + 1 and overhead[0] == 0.0 and min(overhead[1:]) > 0
    assert plugin.choice["speedups"] == speedups(
        plugin.choice["accepted"], CostCurve.from_json(plugin.choice["curve"]), plugin.choice["steps_per_block"],
        overhead)
    curve = plugin.choice["curve"]
    assert curve["model"] == sharp_adapter.name and curve["points"][0]["nodes"] == 1
    assert curve["points"][-1]["nodes"] == plugin.graph.budget + 1
    assert 0 <= plugin.chosen_budget <= plugin.graph.budget
    reference, _ = run(sharp_adapter, "quota", {})
    assert result.token_lists == reference.token_lists



def test_the_timed_verification_walks_the_budgets_steps(sharp_adapter, quota_graph, tmp_path, monkeypatch):
    """The timed walk is the verifier's: ``min(longest path, D) + 1`` kernel steps."""
    from dloom_plugins.spiffy import overhead

    flat = tmp_path / "flat.json"
    CostCurve.flat().save(flat)
    plugin = run(sharp_adapter, "spiffy+quota", {"graph": quota_graph, "cost": str(flat)})[1]
    steps = Counter[int]()
    step = overhead.ProposalKernel.__call__

    def counted(kernel, block, logits, advance):
        steps[plugin.chosen_budget] += 1
        return step(kernel, block, logits, advance)

    monkeypatch.setattr(overhead.ProposalKernel, "__call__", counted)
    config = {"block_length": 8, "vocab_size": 40, "device": "cpu", "shift_logits": False}
    times = overhead.verification_overhead(plugin, config, [1, 3], repeats=2)
    assert len(times) == 2 and min(times) > 0
    assert plugin._longest >= 3  # the walk is bounded by the budget, not by the graph
    assert steps == {1: 3 * 2, 3: 3 * 4}  # an untimed and two timed walks per budget


def test_the_timed_verifications_draw_their_random_outputs_once(sharp_adapter, quota_graph, tmp_path, monkeypatch):
    """Outputs of the vocabulary's width are drawn once, at the largest budget's shape (on a
    126k vocabulary a draw per verification cost seconds of build time), and each budget's
    time is reported in the order asked."""
    from dloom_plugins.spiffy import overhead

    flat = tmp_path / "flat.json"
    CostCurve.flat().save(flat)
    plugin = run(sharp_adapter, "spiffy+quota", {"graph": quota_graph, "cost": str(flat)})[1]
    vocab, shapes = 40, []
    randn = torch.randn

    def recorded(*size, **kwargs):
        shapes.append(tuple(size))
        return randn(*size, **kwargs)

    monkeypatch.setattr(overhead.torch, "randn", recorded)
    config = {"block_length": 8, "vocab_size": vocab, "device": "cpu", "shift_logits": False}
    times = overhead.verification_overhead(plugin, config, [1, 2, 4], repeats=2)
    assert len(times) == 3 and min(times) > 0
    outputs = [shape for shape in shapes if len(shape) == 3 and shape[0] > 1]
    assert outputs == [(4 + 1, 2 * 8, vocab)]  # D = 4's rows layout, each row its block and the next: one draw
