"""Spiffy's pieces: the graph file, calibration, drafting, pruning, layouts and errors.

Losslessness itself is proved in ``proofs_tests/test_spiffy_lossless.py``.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from dloom import DiffusionDecoder
from dloom import hookimpl as dloom_hookimpl
from dloom.cli.commands import app
from dloom.errors import ConfigurationError
from dloom.hooks.composition import compose
from dloom.types import DecodeState
from dloom.zoo import model_path
from dloom_plugins.spiffy import CalibratedGraph, Spiffy
from dloom_plugins.spiffy.calibrate import ROOT, calibrate, select_nodes
from dloom_plugins.spiffy.frame import rank_frame
from dloom_plugins.spiffy.graph import GraphNode, default_graph
from dloom_plugins.spiffy.plugin import longest_path, rule_prior

MASK = 9


def config(**overrides):
    values = dict(
        model="tiny", tokenizer_sha256=None, commit_rule="quota", commit_params={},
        steps_per_block=4, block_length=4, temperature=0.0, remasking="low_confidence",
        takes_attention_mask=True,
    )
    values.update(overrides)
    return values


def chain_graph(**overrides) -> CalibratedGraph:
    """Root -> {(0,0)} -> {(0,0),(1,0)}, and {(0,1)} -> its child {(0,1),(1,0)}."""
    nodes = (
        GraphNode(((0, 0),), (0,)),
        GraphNode(((0, 1),), (0,)),
        GraphNode(((0, 0), (1, 0)), (1,)),
        GraphNode(((0, 1), (1, 0)), (2,)),
    )
    values = dict(
        model="tiny", tokenizer_sha256=None, base={"strategy": "quota", "params": {}, "steps_per_block": 4},
        block_length=4, temperature=0.0, remasking="low_confidence", nodes=nodes,
    )
    values.update(overrides)
    return CalibratedGraph(**values)


def configured(graph: CalibratedGraph, tmp_path, **options) -> Spiffy:
    path = tmp_path / "graph.json"
    graph.save(path)
    plugin = Spiffy(graph=str(path), **{"budget": 10, **options})  # a config without a cost curve
    plugin.dloom_configure(config())
    return plugin


# --- the file format ---------------------------------------------------------------------


def test_graph_file_round_trips(tmp_path):
    graph = chain_graph(calibration={"prompts": 3})
    graph.save(tmp_path / "g.json")
    assert CalibratedGraph.load(tmp_path / "g.json") == graph
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["format"] == "dloom-draft-graph" and data["version"] == 1 and data["budget"] == 4


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="other"), "'format' is 'other'"),
    (lambda d: d.update(version=7), "this dloom reads version 1"),
    (lambda d: d.pop("block_length"), "missing 'block_length'"),
    (lambda d: d["nodes"][0].update(id=5), "node 1 has id 5"),
    (lambda d: d["nodes"][2].update(parents=[3]), "must be an earlier node id"),
    (lambda d: d["nodes"][2].update(parents=[2]), "do not strictly contain those of its parent 2"),
    (lambda d: d["nodes"][1].update(pairs=[[0, 1], [0, 2]]), "fills one position rank twice"),
    (lambda d: d["nodes"][1].update(pairs=[[4, 0]]), "position rank >= block_length 4"),
    (lambda d: d["nodes"][1].update(pairs="x"), "needs 'id', 'pairs'"),
    (lambda d: d.update(budget=9), "'budget' is 9 but the file has 4 nodes"),
    (lambda d: d.update(nodes=[]), "'nodes' must be a non-empty list"),
])
def test_malformed_graph_files_are_refused_with_the_reason(tmp_path, mutate, message):
    data = chain_graph().to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigurationError, match="malformed draft graph") as raised:
        CalibratedGraph.load(path)
    assert message in str(raised.value)


def test_unreadable_and_missing_files_are_refused(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ConfigurationError, match="malformed draft graph"):
        CalibratedGraph.load(tmp_path / "x.json")
    with pytest.raises(ConfigurationError, match="does not exist"):
        CalibratedGraph.load(tmp_path / "none.json")


@pytest.mark.parametrize("setting, message", [
    (dict(model="other"), "model 'tiny' (decoder: 'other')"),
    (dict(tokenizer_sha256="abc"), "tokenizer sha256 None (decoder: 'abc')"),
    (dict(block_length=8), "block_length 4 (decoder: 8)"),
    (dict(commit_rule="threshold", commit_params={"tau": 0.9}), "base rule"),
    (dict(steps_per_block=2), "base rule"),
])
def test_a_graph_calibrated_for_something_else_is_refused(tmp_path, setting, message):
    chain_graph().save(tmp_path / "g.json")
    with pytest.raises(ConfigurationError, match="does not fit this decoder") as raised:
        Spiffy(graph=str(tmp_path / "g.json")).dloom_configure(config(**setting))
    assert message in str(raised.value)


def test_without_a_fitting_built_in_graph_the_default_graph_is_used_with_a_warning():
    plugin = Spiffy()
    with pytest.warns(UserWarning, match="uncalibrated default graph") as caught:
        plugin.dloom_configure(config(block_length=4))
    assert caught[0].filename == __file__  # attributed to the caller, not to dloom or pluggy
    assert plugin.graph.calibration == {"uncalibrated": True}
    assert plugin.graph.nodes[0].pairs == ((0, 0),)
    # budget=auto (the default): no estimate of accepted drafts, so no drafts, nothing measured
    assert plugin.budget == "auto" and plugin.chosen_budget == 0 and plugin.choice["curve"] is None


@pytest.mark.parametrize("width", [1, 2, 3, 8, 32])
def test_default_graphs_are_valid_for_every_block_length(width):
    graph = default_graph(config(block_length=width))
    assert CalibratedGraph.from_json(graph.to_json()) == graph
    assert all(i < width for node in graph.nodes for i, _ in node.pairs)


def test_packed_layout_is_refused_for_a_model_that_takes_no_attention_mask():
    with pytest.raises(ConfigurationError, match="use layout 'rows'"):
        Spiffy(layout="packed").dloom_configure(config(takes_attention_mask=False))


def test_bad_layout_and_budget_name_the_allowed_values(tiny_adapter):
    with pytest.raises(ConfigurationError, match="allowed: one of 'rows', 'packed'"):
        compose("spiffy", {"layout": "diagonal"})
    with pytest.raises(ConfigurationError, match=r"'budget' of strategy 'spiffy' is -1; allowed: \[0, inf\)"):
        compose("spiffy", {"budget": -1})
    with pytest.raises(ConfigurationError, match=r"'call_tokens' of strategy 'spiffy' is -2; allowed: \[0, inf\)"):
        compose("spiffy", {"call_tokens": -2})
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigurationError, match=rf"call_tokens is {bad!r}; allowed: an int >= 0"):
            Spiffy(call_tokens=bad)


# --- composition -------------------------------------------------------------------------


def test_spiffy_alone_runs_over_quota_and_over_any_named_rule():
    assert compose("spiffy").name == "spiffy+quota"
    assert compose("spiffy+threshold").name == "spiffy+threshold"
    assert compose("frechet+spiffy").provider("dloom_select_commit") == "frechet"


def test_a_run_that_never_needs_to_verify_still_reports_a_lossless_speculation(tiny_adapter):
    # tau = 0.01 is below every position's confidence (the vocabulary has under 100 tokens),
    # so each block is committed whole by its first forward: there is nothing to verify
    # (an explicit budget: at "auto" the uncalibrated graph would choose no drafts at all)
    options = dict(tau=0.01, gen_length=8, block_length=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no built-in graph fits the tiny model
        result = DiffusionDecoder(tiny_adapter, "spiffy+threshold", budget=2, **options).generate([[5, 6, 7]])
    plain = DiffusionDecoder(tiny_adapter, "threshold", **options).generate([[5, 6, 7]])
    assert result.token_lists == plain.token_lists and result.forwards == plain.forwards == 2
    assert result.speculation == {
        "verifications": 0, "accepted_drafts": 0, "accepted_per_verification": 0.0, "guarantee": "lossless",
    }
    assert plain.speculation is None


# --- the frame and drafting --------------------------------------------------------------


def test_frame_ranks_masked_positions_by_confidence_and_tokens_by_probability():
    block = torch.tensor([[MASK, 3, MASK, MASK]])
    probs = torch.full((1, 4, 10), 0.01)
    probs[0, 0, 4], probs[0, 0, 5] = 0.5, 0.3  # confidence 0.5
    probs[0, 2, 6], probs[0, 2, 7] = 0.8, 0.1  # confidence 0.8 (rank 0)
    probs[0, 3, 7], probs[0, 3, 8] = 0.3, 0.2  # confidence 0.3
    probs[0, 1, 3] = 0.99  # not masked: never ranked among the masked
    probs[..., MASK] = 0.9  # the mask token is never a candidate
    frame = rank_frame(probs.log(), block, MASK, token_ranks=2)
    assert frame.position_by_rank[0, :3].tolist() == [2, 0, 3]
    assert frame.masked.tolist() == [3]
    assert frame.tokens[0, 2].tolist() == [6, 7] and frame.tokens[0, 0].tolist() == [4, 5]


def drafting_state(block, logits, active=None):
    tokens = torch.cat([torch.tensor([[5, 6]] * block.shape[0]), block], dim=1)
    return DecodeState(
        tokens=tokens, attention_mask=torch.ones_like(tokens), block_start=2, block_end=6,
        mask_token_id=MASK, active=torch.ones(block.shape[0], dtype=torch.bool) if active is None else active,
        logits=logits, span_start=2,
    )


def test_draft_fills_the_formulas_per_row(tmp_path):
    plugin = configured(chain_graph(), tmp_path)
    block = torch.tensor([[MASK, MASK, MASK, MASK], [MASK, 4, 4, 4], [1, 1, 1, 1]])
    logits = torch.zeros(3, 4, 10)
    logits[:, :, 3] = torch.tensor([1.0, 4.0, 2.0, 0.0])  # token 3: best at position 1, then 2
    logits[:, :, 8] = 0.5  # second-best token everywhere
    graph = plugin.dloom_draft(drafting_state(block, logits))
    assert graph.tokens.shape == (3, 5, 4) and graph.num_nodes == 4
    assert torch.equal(graph.tokens[:, 0], block)
    assert graph.tokens[0, 1].tolist() == [MASK, 3, MASK, MASK]  # {(0,0)}
    assert graph.tokens[0, 2].tolist() == [MASK, 8, MASK, MASK]  # {(0,1)}
    assert graph.tokens[0, 3].tolist() == [MASK, 3, 3, MASK]  # {(0,0),(1,0)}
    assert graph.tokens[1, 1].tolist() == [3, 4, 4, 4]  # one masked position
    # row 1 has one masked position: drafts needing two are invalid; row 2 has none
    assert graph.valid.tolist() == [[True] * 5, [True, True, True, False, False], [True] + [False] * 4]
    assert graph.depth.tolist() == [0, 1, 1, 2, 2]
    assert torch.all((graph.score > 0) & (graph.score <= 1))


def test_draft_declines_without_a_distribution(tmp_path):
    plugin = configured(chain_graph(), tmp_path)
    assert plugin.dloom_draft(drafting_state(torch.full((1, 4), MASK), None)) is None


def test_prune_keeps_the_best_reachable_drafts_per_row(tmp_path):
    plugin = configured(chain_graph(), tmp_path, budget=2)
    block = torch.full((2, 4), MASK)
    logits = torch.zeros(2, 4, 10)
    logits[0, :, 3] = 5.0  # row 0: top tokens sure -> the (0,0) chain scores best
    logits[1, :, 3], logits[1, :, 8] = 1.0, 1.0  # row 1: a tie between ranks 0 and 1
    graph = plugin.dloom_draft(drafting_state(block, logits))
    pruned = plugin.dloom_prune(graph, None)
    assert pruned.valid.sum(-1).tolist() == [3, 3]  # root + 2 per row
    assert pruned.valid[0].tolist() == [True, True, False, True, False]
    for row in range(2):  # every kept draft has a kept parent
        kept = pruned.valid[row]
        assert all((pruned.parents[n] & kept).any() for n in range(1, 5) if kept[n])
    assert plugin.dloom_prune(graph, 1).valid.sum(-1).tolist() == [2, 2]  # the decoder's cap wins
    assert plugin.dloom_prune(graph, 0).valid.sum(-1).tolist() == [1, 1]


def test_rule_pruning_ranks_drafts_by_the_rules_calibrated_reach_times_the_rows_tokens(tmp_path):
    """Row: {(0,0)}'s token is likelier than {(0,1)}'s, but calibration saw the rule take
    {(0,1)} 9 times in 10 and {(0,0)} once: "rule" keeps {(0,1)}, "confidence" {(0,0)}."""
    nodes = (GraphNode(((0, 0),), (0,), frequency=1), GraphNode(((0, 1),), (0,), frequency=9))
    graph = chain_graph(nodes=nodes, calibration={"paths": 10})
    block = torch.full((1, 4), MASK)
    logits = torch.zeros(1, 4, 10)
    logits[0, :, 3], logits[0, :, 8] = 2.0, 1.0  # rank 0 token 3 (p ~ 0.49), rank 1 token 8 (p ~ 0.18)
    kept = {}
    for prune in ("rule", "confidence"):
        plugin = configured(graph, tmp_path, budget=1, prune=prune)
        drafts = plugin.dloom_draft(drafting_state(block, logits))
        kept[prune] = plugin.dloom_prune(drafts, None).valid[0].tolist()
    assert kept == {"rule": [True, False, True], "confidence": [True, True, False]}
    prior = rule_prior(graph, torch.device("cpu"))
    assert prior.tolist() == pytest.approx([math.log(0.1), math.log(0.9)])
    assert rule_prior(default_graph(config()), torch.device("cpu")).tolist() == [0.0] * len(default_graph(config()).nodes)


def test_bad_first_forward_and_prune_name_the_allowed_values():
    with pytest.raises(ConfigurationError, match="first_forward is 'yes'; allowed: True or False"):
        Spiffy(first_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="prune is 'depth'; allowed: rule, confidence"):
        Spiffy(prune="depth")
    with pytest.raises(ConfigurationError, match="allowed: one of 'rule', 'confidence'"):
        compose("spiffy", {"prune": "depth"})


@pytest.mark.parametrize("cache, layout, first_forward, asks", [
    ("none", "rows", True, True), ("none", "rows", False, False), ("prefix", "rows", True, False),
    ("dual", "rows", True, False), ("none", "packed", True, False),
])
def test_a_layout_asks_for_next_block_logits_only_where_the_forward_sees_the_next_block(
    tmp_path, cache, layout, first_forward, asks
):
    path = tmp_path / "graph.json"
    chain_graph().save(path)
    plugin = Spiffy(graph=str(path), layout=layout, first_forward=first_forward, budget=10)
    plugin.dloom_configure(config(cache=cache))
    block = torch.full((1, 4), MASK)
    state = drafting_state(block, torch.zeros(1, 4, 10))
    layout_ = plugin.dloom_build_mask(state, plugin.dloom_prune(plugin.dloom_draft(state), None))
    assert layout_.next_block is asks


def test_the_verifier_walks_the_graphs_longest_path_not_its_depth():
    """Node 3 has the root as a parent (depth 1) and is also three steps down the chain: a
    walk bounded by the depth would stop on the graph, one step short."""
    nodes = (
        GraphNode(((0, 0),), (0,)), GraphNode(((0, 0), (1, 0)), (1,)),
        GraphNode(((0, 0), (1, 0), (2, 0)), (0, 2)),
    )
    graph = chain_graph(nodes=nodes)
    assert int(graph.template().depth.max()) == 2
    assert longest_path(graph.template().parents) == 3


@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_layouts_place_every_evaluated_node(tmp_path, layout):
    plugin = configured(chain_graph(), tmp_path, layout=layout)
    block = torch.tensor([[MASK, MASK, MASK, MASK], [MASK, 4, 4, 4]])
    state = drafting_state(block, torch.zeros(2, 4, 10))
    graph = plugin.dloom_draft(state)
    result = plugin.dloom_build_mask(state, graph)
    assert result.packed == (layout == "packed")
    evaluated = graph.valid
    assert torch.equal(result.node_rows >= 0, evaluated)
    for row, node in evaluated.nonzero().tolist():
        r, offset = result.node_rows[row, node], result.node_offsets[row, node]
        assert result.source[r] == row
        assert torch.equal(result.input_ids[r, offset : offset + 4], graph.tokens[row, node])
        assert (result.segment[r, offset : offset + 4] == node).all()
        assert result.span_position[r, offset : offset + 4].tolist() == [0, 1, 2, 3]
    if layout == "rows":
        assert result.input_ids.shape == (int(evaluated.sum()), 4)
    else:
        assert result.input_ids.shape == (2, 5 * 4) and (result.segment[1, 12:] == -1).all()


# --- calibration -------------------------------------------------------------------------


def test_selection_is_connected_ordered_and_scores_own_plus_parents():
    a, b = frozenset({(0, 0)}), frozenset({(0, 1)})
    ab = frozenset({(0, 0), (1, 0)})
    rare = frozenset({(0, 0), (2, 3)})
    orphan = frozenset({(0, 0), (1, 0), (2, 0)})
    frequency = Counter({a: 10, b: 4, ab: 6, rare: 1, orphan: 50})
    parents = {a: {ROOT}, b: {ROOT}, ab: {a, b}, rare: {a}, orphan: {ab}}
    nodes = select_nodes(frequency, parents, budget=3, score_kind="own+parents")
    # a (10), then ab (6 + 10 + 4 = 20), then orphan (50 + 6), not b (4) or rare (1 + 10)
    assert [n.pairs for n in nodes] == [((0, 0),), ((0, 0), (1, 0)), ((0, 0), (1, 0), (2, 0))]
    assert [n.parents for n in nodes] == [(0,), (1,), (2,)]  # b was not kept: not a parent
    assert [n.score for n in nodes] == [10.0, 20.0, 56.0]
    assert select_nodes(frequency, parents, budget=0) == []
    # by own frequency: a (10), then ab (6, reachable once a is kept, beats b's 4), then
    # orphan (50, reachable once ab is kept)
    own = select_nodes(frequency, parents, budget=3)
    assert [n.pairs for n in own] == [((0, 0),), ((0, 0), (1, 0)), ((0, 0), (1, 0), (2, 0))]
    assert [n.score for n in own] == [10.0, 6.0, 50.0]
    rare_first = select_nodes(Counter({**frequency, b: 7}), parents, budget=2)
    assert [n.pairs for n in rare_first] == [((0, 0),), ((0, 1),)]  # b (7) before ab (6)
    with pytest.raises(ConfigurationError, match=r"allowed: own, own\+parents"):
        select_nodes(frequency, parents, budget=2, score_kind="best")


def test_calibration_records_the_reference_process_and_its_graph_loads(sharp_adapter, tmp_path):
    decoder = DiffusionDecoder(sharp_adapter, "quota", gen_length=8, block_length=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    graph = calibrate(decoder, prompts, budget=5, description={"note": "test"})
    assert 1 <= graph.budget <= 5
    assert graph.base == {"strategy": "quota", "params": {}, "steps_per_block": 4}
    # one token per step: depth-d formulas have d pairs, every path starts with one pair
    assert all(len(node.pairs) == 1 for node in graph.nodes if node.parents == (0,))
    assert graph.calibration["paths"] > 0 and graph.calibration["note"] == "test"
    graph.save(tmp_path / "g.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spiffy = DiffusionDecoder(
            sharp_adapter, "spiffy", gen_length=8, block_length=4, graph=str(tmp_path / "g.json")
        )
    assert spiffy.generate(prompts).token_lists == decoder.generate(prompts).token_lists


def test_calibration_refuses_a_speculative_base_and_bad_budgets(tiny_adapter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spiffy = DiffusionDecoder(tiny_adapter, "spiffy", gen_length=4, block_length=4)
    with pytest.raises(ConfigurationError, match="calibrate the base strategy alone"):
        calibrate(spiffy, [[5]], budget=3)
    quota = DiffusionDecoder(tiny_adapter, "quota", gen_length=4, block_length=4)
    with pytest.raises(ConfigurationError, match="allowed: an integer >= 1"):
        calibrate(quota, [[5]], budget=0)
    with pytest.raises(ConfigurationError, match="no calibration prompts"):
        calibrate(quota, [], budget=2)


def test_cli_calibrate_then_generate_with_the_graph(tmp_path):
    runner = CliRunner()
    out = tmp_path / "graph.json"
    result = runner.invoke(app, [
        "calibrate", "--strategy", "quota", "-n", "6", "--budget", "4", "--block-length", "8",
        "--tasks", "copy,add", "-o", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output.replace("\n", "")
    graph = CalibratedGraph.load(out)
    assert graph.model == "toy-dllm" and graph.block_length == 8 and graph.budget <= 4
    assert graph.calibration["split"] == "train" and graph.calibration["tasks"] == "copy,add"
    result = runner.invoke(app, [
        "generate", "copy: abcd", "--strategy", "spiffy", "--block-length", "8",
        "--param", f"graph={out}", "--json",
    ])
    assert result.exit_code == 0, result.output
    bad = runner.invoke(app, [
        "generate", "copy: abcd", "--strategy", "spiffy", "--block-length", "16",
        "--param", f"graph={out}",
    ])
    assert bad.exit_code == 2 and "block_length 8 (decoder: 16)" in bad.output.replace("\n", " ")


def test_the_speculator_example_in_the_plugin_docs_is_lossless(sharp_adapter):
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "plugins.md").read_text()
    source = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "guess_top_token" in b)
    namespace: dict = {}
    exec(compile(source, "guess_top_token.py", "exec"), namespace)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    options = dict(gen_length=16, block_length=8)
    reference = DiffusionDecoder(sharp_adapter, "quota", **options).generate(prompts)
    result = DiffusionDecoder(sharp_adapter, [namespace["GuessTopToken"](), "quota"], **options).generate(prompts)
    assert result.token_lists == reference.token_lists
    assert result.accepted_drafts > 0 and result.forwards < reference.forwards


def test_the_decoders_draft_budget_caps_the_drafts_per_forward(sharp_adapter):
    prompts = [[5, 6, 7], [8, 9]]
    options = dict(gen_length=16, block_length=8)
    seen = []

    class Recording(Spiffy):
        def dloom_prune(self, graph, budget):
            pruned = super().dloom_prune(graph, budget)
            seen.append(int(pruned.valid[:, 1:].sum(-1).max()))
            return pruned

    Recording.dloom_prune = dloom_hookimpl(Recording.dloom_prune)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = DiffusionDecoder(sharp_adapter, "quota", **options).generate(prompts)
        capped = DiffusionDecoder(sharp_adapter, [Recording(budget=8), "quota"], draft_budget=1, **options)
    assert capped.generate(prompts).token_lists == reference.token_lists
    assert seen and max(seen) == 1
    with pytest.raises(ConfigurationError, match="draft_budget is -1; allowed: >= 0 or None"):
        DiffusionDecoder(sharp_adapter, "quota", draft_budget=-1, **options)


def test_cli_graph_budget_and_layout_options_reach_spiffy(tmp_path):
    runner = CliRunner()
    graph = chain_graph(model="toy-dllm", block_length=8, base={"strategy": "quota", "params": {}, "steps_per_block": 8})
    path = tmp_path / "g.json"
    graph.save(path)
    result = runner.invoke(app, [
        "generate", "copy: abcd", "--strategy", "spiffy", "--block-length", "8", "--graph", str(path),
        "--budget", "2", "--layout", "packed", "--cache", "dual", "--json",
    ], catch_exceptions=False)
    assert result.exit_code == 2, result.output  # the toy tokenizer's hash is not the file's None
    assert "tokenizer sha256 None" in result.output.replace("\n", " ")
    ok = runner.invoke(app, [
        "eval", "--strategy", "spiffy", "--budget", "2", "--layout", "packed", "--cache", "dual",
        "-n", "7", "--block-length", "8", "--json",
    ])
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.stdout.splitlines()[-1])  # the summary line
    assert report["config"]["params"]["spiffy"] == {"graph": "", "budget": 2, "layout": "packed", "call_tokens": 2048,
                                                  "first_forward": True, "prune": "rule", "cost": ""}
    assert report["speculation"]["guarantee"] == "lossless"
    wrong = runner.invoke(app, ["generate", "copy: ab", "--strategy", "threshold", "--budget", "2"])
    assert wrong.exit_code == 2 and "names strategy 'spiffy', which is not part of" in wrong.output.replace("\n", " ")


def test_the_fallback_warning_points_at_the_line_that_built_the_decoder(tiny_adapter):
    """The warning is raised inside a hook called by pluggy; it names the user's line."""
    with pytest.warns(UserWarning, match="uncalibrated default graph") as caught:
        DiffusionDecoder(tiny_adapter, "spiffy+quota", gen_length=8, block_length=4)
    assert caught[0].filename == __file__


def test_the_frame_ranks_saturated_positions_as_the_kernel_commits_them():
    """Float32 logits give two near-certain positions the same kernel confidence, which the
    commit rules order by position; the frame must rank them the same way (a float64
    ranking would put position 2 first and every deeper quota draft would miss)."""
    logits = torch.full((1, 3, 5), -30.0)
    logits[0, 0, 1], logits[0, 2, 1] = 0.0, 1.0  # p = 1 - 4e-13 and 1 - 1.5e-13 in float64
    logits[0, 1, 2] = -27.0  # a clearly less confident position
    block = torch.full((1, 3), 4)  # all masked (mask id 4)
    frame = rank_frame(logits, block, mask_token_id=4, token_ranks=2)
    assert frame.position_by_rank[0].tolist() == [0, 2, 1]
    assert frame.probs[0, 2, 0] > frame.probs[0, 0, 0]  # float64 would have ranked 2 first


def test_spiffy_over_quota_accepts_several_drafts_per_verification():
    """Exact counts on four held-out prompts: the engine's step from a draft follows the
    draft's ranking (the regression this pins accepted 0.54 drafts per verification)."""
    from dloom import load_model
    from dloom.evaluation import select_examples

    prompts = [e.prompt for e in select_examples("all", 4, seed=0)]
    result = DiffusionDecoder(load_model("toy-dllm"), "spiffy+quota", budget=10).generate(prompts)
    assert result.accepted_drafts >= 2 * result.verifications


# --- lazily read node logits ---------------------------------------------------------------


def test_node_logits_of_a_node_are_its_spans_outputs(tmp_path):
    """``NodeLogits.of`` reads, for each row, its node's span out of the forward's outputs
    (the materialised ``(B, N + 1, K, V)`` gather it replaces, entry by entry)."""
    from dloom.decode.speculation import NodeLogits

    for layout in ("rows", "packed"):
        plugin = configured(chain_graph(), tmp_path, layout=layout)
        block = torch.tensor([[MASK, MASK, MASK, MASK], [MASK, 4, 4, 4]])
        state = drafting_state(block, torch.zeros(2, 4, 10))
        graph = plugin.dloom_draft(state)
        result = plugin.dloom_build_mask(state, graph)
        outputs = torch.randn(*result.input_ids.shape, 10, dtype=torch.float64)
        logits = NodeLogits(outputs, result, 4)
        assert logits.shape == (2, graph.num_nodes + 1, 4, 10)
        for row, node in graph.valid.nonzero().tolist():
            nodes = torch.full((2,), node)
            r, offset = result.node_rows[row, node], result.node_offsets[row, node]
            assert torch.equal(logits.of(nodes)[row], outputs[r, offset : offset + 4])


class _LargestTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.shapes.append(tuple(tensor.shape))
        return out


class MaterialisesEveryNode(Spiffy):
    """Negative control: a verifier that builds every node's logits before following the
    graph (what the decoder did before ``NodeLogits``)."""

    @dloom_hookimpl
    def dloom_verify(self, state, graph, logits, kernel):
        nodes = logits.shape[1]
        every = torch.stack(
            [logits.of(torch.full_like(graph.tokens[:, 0, 0], n)) for n in range(nodes)], dim=1
        )
        assert every.shape == logits.shape
        return super().dloom_verify(state, graph, logits, kernel)


@pytest.mark.parametrize("strategy", [Spiffy, MaterialisesEveryNode], ids=["spiffy", "control"])
def test_verification_never_builds_every_nodes_logits(tiny_adapter, strategy):
    """No ``(B, N + 1, K, V)`` array exists in a Spiffy decode: node logits are read for the
    node each row is on (the control that builds them is caught)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder = DiffusionDecoder(
            tiny_adapter, [strategy(budget=4), "quota"], gen_length=16, block_length=8, cache="dual"
        )
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    with _LargestTensors() as seen:
        result = decoder.generate(prompts)
    assert result.verification_forwards > 0
    spiffy = next(p for p in decoder.pm.get_plugins() if isinstance(p, Spiffy))
    every_node = (len(prompts), len(spiffy.graph.nodes) + 1, 8, tiny_adapter.model.config.vocab_size)
    assert (every_node in seen.shapes) == (strategy is MaterialisesEveryNode)


# --- verification in model calls of at most the batch's rows --------------------------------


def test_a_layout_evaluated_in_parts_puts_every_rows_outputs_in_its_place():
    """Parts of ``max_rows`` rows, the last one shorter: row ``r`` of the result is what the
    forward gives layout row ``r`` (a forward that writes each row's own ids and source)."""
    from dloom.decode.speculation import evaluate_in_parts, rows_layout

    spans = torch.arange(3 * 4 * 2).reshape(3, 4, 2)
    evaluated = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    layout = rows_layout(spans, evaluated)  # 8 rows
    calls = []

    def forward(tokens, part, first_window):
        calls.append(part.input_ids.shape[0])
        return torch.stack([part.input_ids, part.source[:, None].expand_as(part.input_ids)], dim=-1)

    whole = forward(None, layout, 0)
    calls.clear()
    out = evaluate_in_parts(forward, None, layout, 0, max_rows=3)
    assert calls == [3, 3, 2]
    assert torch.equal(out, whole)
    assert torch.equal(evaluate_in_parts(forward, None, layout, 0, max_rows=8), whole) and calls[-1] == 8


def _one_call(evaluate, tokens, layout, first_window, max_rows):
    """Negative control: the whole layout in one model call, whatever its row count."""
    return evaluate(tokens, layout, first_window)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("in_parts", [True, False], ids=["in-parts", "control"])
def test_a_verification_forward_runs_no_more_rows_at_once_than_the_batch(sharp_adapter, monkeypatch, cache, in_parts):
    """Rows-layout verification: no model call holds more rows than the batch, while the
    layouts hold more (the control, one call per layout, exceeds it), and the tokens, NFE
    and verification outputs are those of one call over the whole layout, bit for bit."""
    import dloom.decode.step
    from dloom.decode.speculation import evaluate_in_parts

    compared, counting = [], [True]

    def checked(evaluate, tokens, layout, first_window, max_rows):
        out = evaluate_in_parts(evaluate, tokens, layout, first_window, max_rows)
        counting[0] = False  # the comparison's one call is not the decoder's
        compared.append(torch.equal(out, evaluate(tokens, layout, first_window)))
        counting[0] = True
        return out

    prompts = [[5, 6, 7], [8, 9, 10, 11]]

    def decode(verifier):
        monkeypatch.setattr(dloom.decode.step, "evaluate_in_parts", verifier)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decoder = DiffusionDecoder(
                sharp_adapter, [Spiffy(budget=4, call_tokens=0), "quota"], gen_length=16, block_length=8, cache=cache
            )
        rows: list[int] = []

        def record(_, args, kwargs):
            if counting[0]:
                rows.append(kwargs["input_ids"].shape[0])

        hook = sharp_adapter.model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            return decoder.generate(prompts), rows
        finally:
            hook.remove()

    reference, one_call_rows = decode(_one_call)
    result, rows = decode(checked if in_parts else _one_call)
    assert result.verification_forwards > 0 and max(one_call_rows) > len(prompts)
    assert (max(rows) <= len(prompts)) == in_parts
    assert torch.equal(result.sequences, reference.sequences) and torch.equal(result.nfe, reference.nfe)
    assert result.forwards == reference.forwards
    assert all(compared) and (len(compared) > 0) == in_parts


def test_call_tokens_sets_the_rows_per_call_with_the_same_outputs(sharp_adapter):
    """``call_tokens=0``: the batch's 2 rows per model call; ``call_tokens=4 L`` (without a
    cache a row's query is the whole 20-position sequence): up to 4 rows per call; the default 2048 tokens: every layout of this tiny decode (up to 2 x (4 + 1) rows)
    in one call. Fewer calls, the same tokens and NFE."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]

    def decode(**options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decoder = DiffusionDecoder(sharp_adapter, [Spiffy(budget=4, **options), "quota"], gen_length=16, block_length=8)
        rows: list[int] = []
        hook = sharp_adapter.model.register_forward_pre_hook(
            lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            return decoder.generate(prompts), rows
        finally:
            hook.remove()

    narrow, narrow_rows = decode(call_tokens=0)
    wide, wide_rows = decode(call_tokens=4 * 20)
    whole, whole_rows = decode()
    assert max(narrow_rows) <= len(prompts) < max(wide_rows) <= 4 < max(whole_rows) == 10
    assert whole.model_calls < wide.model_calls < narrow.model_calls
    for result in (wide, whole):
        assert torch.equal(result.sequences, narrow.sequences) and torch.equal(result.nfe, narrow.nfe)


@pytest.mark.skipif(not (model_path("toy-dllm") / "model.safetensors").exists(), reason="toy-dllm not installed")
def test_dynamic_pruning_by_the_rules_reach_beats_confidence_pruning_on_the_toy_dllm(tmp_path):
    """A graph of D = 30 pruned to D* = 5 per row: ranking by the probability that quota takes
    the path accepts more drafts (fewer forwards) than the tokens' geometric mean (the audit's
    D 100 -> 10 regression), same tokens."""
    from dloom import load_model
    from dloom.evaluation import select_examples

    model = load_model("toy-dllm", dtype="float64")
    calibration = [e.prompt for e in select_examples("all", 20, split="train")]
    prompts = [e.prompt for e in select_examples("all", 10)]
    calibrate(DiffusionDecoder(model, "quota", block_length=8), calibration, 30).save(tmp_path / "g.json")
    reference = DiffusionDecoder(model, "quota", block_length=8).generate(prompts)
    nfe = {}
    for prune in ("rule", "confidence"):
        result = DiffusionDecoder(model, "spiffy+quota", params={
            "graph": str(tmp_path / "g.json"), "budget": 5, "prune": prune, "first_forward": False,
        }, block_length=8).generate(prompts)
        assert result.token_lists == reference.token_lists
        nfe[prune] = int(result.nfe.sum())
    assert nfe["rule"] < nfe["confidence"], nfe
