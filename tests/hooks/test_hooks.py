"""The typed hook wrappers in :mod:`dloom.hooks.calls`, the timing wrapper, and the hook docs."""

from __future__ import annotations

import inspect
import re
import time
from dataclasses import fields

import pytest
import torch

import dloom
from dloom.errors import HookContractError
from dloom.hooks import calls as hooks
from dloom.hooks import specs as hookspecs
from dloom.hooks.composition import build_plugin_manager, compose
from dloom.hooks.registry import DECODING_HOOKS, hooks_implemented_by
from dloom.hooks.timing import HookTimer
from dloom.types import (
    BlockSchedule,
    ChainState,
    DecodeState,
    DraftGraph,
    Verdict,
    VerificationLayout,
)

B, K, V, L = 2, 4, 7, 6
MASK = 6


# --- small values of every argument type ---------------------------------------------------


def make_graph(drafts: int) -> DraftGraph:
    """The root and ``drafts`` children of it."""
    nodes = drafts + 1
    parents = torch.zeros(nodes, nodes, dtype=torch.bool)
    parents[1:, 0] = True
    return DraftGraph(
        tokens=torch.zeros(B, nodes, K, dtype=torch.long),
        parents=parents,
        depth=torch.cat([torch.zeros(1, dtype=torch.long), torch.ones(drafts, dtype=torch.long)]),
        score=torch.zeros(B, nodes),
        valid=torch.ones(B, nodes, dtype=torch.bool),
    )


def make_state() -> DecodeState:
    tokens = torch.tensor([[1, 2, MASK, MASK, MASK, MASK], [3, 4, 5, MASK, MASK, MASK]])
    return DecodeState(
        tokens=tokens,
        attention_mask=torch.ones_like(tokens),
        block_start=2,
        block_end=6,
        mask_token_id=MASK,
        active=torch.ones(B, dtype=torch.bool),
    )


def make_layout(graph: DraftGraph) -> VerificationLayout:
    """Every node of every row packed into that row."""
    nodes = graph.num_nodes + 1
    return VerificationLayout(
        input_ids=torch.zeros(B, nodes * K, dtype=torch.long),
        source=torch.arange(B),
        segment=torch.arange(nodes).repeat_interleave(K).expand(B, -1),
        span_position=torch.arange(K).repeat(nodes).expand(B, -1),
        node_rows=torch.arange(B).unsqueeze(1).expand(B, nodes),
        node_offsets=(torch.arange(nodes) * K).expand(B, nodes),
        packed=True,
    )


def schedule() -> BlockSchedule:
    return BlockSchedule(torch.zeros(2, dtype=torch.long), 4, torch.tensor([4, 3]))


SELECTABLE = torch.tensor([[True, True, True, False], [False, True, True, True]])
CONFIDENCE = torch.tensor([[0.1, 0.9, 0.5, 0.99], [0.99, 0.2, 0.3, 0.4]], dtype=torch.float64)


# --- dummy plugins -----------------------------------------------------------------------


class Returns:
    """A commit rule returning a fixed value, recording what it was called with."""

    def __init__(self, value) -> None:
        self.value = value
        self.calls: list[dict] = []

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        self.calls.append(dict(confidence=confidence, selectable=selectable, schedule=schedule))
        return self.value


class Speculator:
    """Drafts ``graph``, lays out ``layout`` and returns ``verdict`` (``None`` declines)."""

    def __init__(self, graph, layout, verdict) -> None:
        self.graph, self.layout, self.verdict = graph, layout, verdict
        self.seen: dict[str, dict] = {}

    @dloom.hookimpl
    def dloom_draft(self, state):
        self.seen["draft"] = dict(state=state)
        return self.graph

    @dloom.hookimpl
    def dloom_build_mask(self, state, graph):
        self.seen["build_mask"] = dict(state=state, graph=graph)
        return self.layout

    @dloom.hookimpl
    def dloom_verify(self, state, graph, logits, kernel):
        self.seen["verify"] = dict(state=state, graph=graph, logits=logits, kernel=kernel)
        return self.verdict


class Pruner:
    def __init__(self, result) -> None:
        self.result = result

    @dloom.hookimpl
    def dloom_prune(self, graph, budget):
        return self.result(graph, budget) if callable(self.result) else self.result


def manager(*plugins, extra=()):
    return build_plugin_manager(compose(list(plugins)), *extra)


def keep_first(graph: DraftGraph, budget: int) -> DraftGraph:
    """Keep the root and the first ``budget`` drafts of every row."""
    valid = graph.valid.clone()
    valid[:, budget + 1 :] = False
    return DraftGraph(graph.tokens, graph.parents, graph.depth, graph.score, valid)


def keep_row_counts(*counts: int):
    """A pruner keeping ``counts[b]`` drafts in row ``b``, whatever the budget."""

    def prune(graph: DraftGraph, budget: int) -> DraftGraph:
        valid = graph.valid.clone()
        for row, count in enumerate(counts):
            valid[row, count + 1 :] = False
        return DraftGraph(graph.tokens, graph.parents, graph.depth, graph.score, valid)

    return prune


# --- select_commit -----------------------------------------------------------------------


def test_select_commit_passes_arguments_and_restricts_to_selectable():
    rule = Returns(torch.ones(B, K, dtype=torch.bool))
    sched = schedule()
    commit = hooks.select_commit(manager(rule), CONFIDENCE, SELECTABLE, sched)
    assert torch.equal(commit, SELECTABLE)
    (call,) = rule.calls
    assert call["confidence"] is CONFIDENCE
    assert call["selectable"] is SELECTABLE
    assert call["schedule"] is sched


def test_select_commit_by_a_named_strategy():
    commit = hooks.select_commit(manager("threshold"), CONFIDENCE, SELECTABLE, schedule())
    # tau 0.9: nothing selectable exceeds it, so each row commits its most confident
    # selectable position (row 0: 0.9 at 1, since 0.99 is not selectable; row 1: 0.4 at 3)
    assert commit.tolist() == [[False, True, False, False], [False, False, False, True]]


@pytest.mark.parametrize(
    "value, got",
    [
        (torch.ones(B, K), "torch.float32 (2, 4)"),
        (torch.ones(B, K, dtype=torch.long), "torch.int64 (2, 4)"),
        (torch.ones(B, K - 1, dtype=torch.bool), "torch.bool (2, 3)"),
        (torch.ones(K, dtype=torch.bool), "torch.bool (4,)"),
    ],
)
def test_select_commit_must_return_a_bool_tensor_of_the_block_shape(value, got):
    with pytest.raises(HookContractError) as raised:
        hooks.select_commit(manager(Returns(value)), CONFIDENCE, SELECTABLE, schedule())
    assert str(raised.value) == (
        f"plugin 'Returns': dloom_select_commit must return a bool tensor of shape (2, 4), got {got}"
    )


def test_select_commit_without_an_answer_is_a_contract_error():
    with pytest.raises(HookContractError, match="no plugin answered dloom_select_commit"):
        hooks.select_commit(manager(Returns(None)), CONFIDENCE, SELECTABLE, schedule())


# --- draft -------------------------------------------------------------------------------


def test_draft_is_none_when_nobody_speculates():
    assert hooks.draft(manager("quota"), make_state()) is None


def test_draft_returns_the_speculators_graph():
    graph = make_graph(3)
    state = make_state()
    spec = Speculator(graph, make_layout(graph), None)
    assert hooks.draft(manager("quota", spec), state) is graph
    assert spec.seen["draft"]["state"] is state


# --- prune -------------------------------------------------------------------------------


def test_prune_default_keeps_the_graph():
    graph = make_graph(5)
    pm = manager("quota")
    assert hooks.prune(pm, graph, budget=8) is graph
    # CoreDefaults keeps the whole graph, but the budget binds every speculator
    with pytest.raises(HookContractError, match="kept 5 drafts in a row for a budget of 2 .no plugin prunes"):
        hooks.prune(pm, graph, budget=2)


def test_prune_by_a_plugin_within_budget():
    pruned = hooks.prune(manager("quota", Pruner(keep_first)), make_graph(5), budget=2)
    assert pruned.valid.sum(-1).tolist() == [3, 3]  # the root and two drafts per row


def test_prune_without_a_budget_passes_none():
    seen = []
    pm = manager("quota", Pruner(lambda graph, budget: seen.append(budget) or graph))
    hooks.prune(pm, make_graph(2), budget=None)
    assert seen == [None]


def test_prune_declining_falls_back_to_the_default():
    graph = make_graph(3)
    assert hooks.prune(manager("quota", Pruner(None)), graph, budget=3) is graph


@pytest.mark.parametrize("budget, counts, kept", [(2, (1, 3), 3), (0, (0, 1), 1), (-1, (1, 0), 1)])
def test_prune_keeping_more_drafts_in_a_row_than_budget_is_a_contract_error(budget, counts, kept):
    pm = manager("quota", Pruner(keep_row_counts(*counts)))
    with pytest.raises(HookContractError) as raised:
        hooks.prune(pm, make_graph(5), budget=budget)
    assert str(raised.value) == f"dloom_prune kept {kept} drafts in a row for a budget of {budget}"


def test_draft_with_inconsistent_shapes_is_a_contract_error():
    graph = make_graph(2)
    broken = DraftGraph(graph.tokens[:, 1:], graph.parents, graph.depth, graph.score, graph.valid)
    pm = manager("quota", Speculator(broken, None, None))
    with pytest.raises(HookContractError, match="node 0 is the root"):
        hooks.draft(pm, make_state())


# --- build_mask and verify ---------------------------------------------------------------


def test_build_mask_and_verify_pass_their_results_through():
    graph, state = make_graph(2), make_state()
    layout = make_layout(graph)
    verdict = Verdict(block=state.block.clone(), logits=torch.zeros(B, K, V), accepted=torch.tensor([1, 0]))
    spec = Speculator(graph, layout, verdict)
    pm = manager("quota", spec)
    assert hooks.build_mask(pm, state, graph) is layout
    assert spec.seen["build_mask"] == dict(state=state, graph=graph)
    logits = torch.zeros(B, graph.num_nodes + 1, K, V)

    def kernel(block, logits, advance):
        return block

    assert hooks.verify(pm, state, graph, logits, kernel) is verdict
    assert spec.seen["verify"] == dict(state=state, graph=graph, logits=logits, kernel=kernel)


def test_verify_returning_a_block_of_the_wrong_shape_is_a_contract_error():
    graph, state = make_graph(1), make_state()
    verdict = Verdict(block=state.tokens, logits=torch.zeros(B, K, V), accepted=torch.zeros(B))
    pm = manager("quota", Speculator(graph, make_layout(graph), verdict))
    with pytest.raises(HookContractError, match=r"block of shape \(2, 6\); expected \(2, 4\)"):
        hooks.verify(pm, state, graph, torch.zeros(B, 2, K, V), lambda b, logits, a: b)


def test_build_mask_with_node_rows_of_the_wrong_shape_is_a_contract_error():
    graph = make_graph(2)
    layout = make_layout(make_graph(1))
    pm = manager("quota", Speculator(graph, layout, None))
    with pytest.raises(HookContractError, match=r"expected \(2, 3\)"):
        hooks.build_mask(pm, make_state(), graph)


def test_verify_returning_none_is_a_contract_error():
    graph = make_graph(2)
    pm = manager("quota", Speculator(graph, make_layout(graph), None))
    with pytest.raises(HookContractError, match="no plugin answered dloom_verify"):
        hooks.verify(pm, make_state(), graph, torch.zeros(B, 3, K, V), lambda b, logits, a: b)


def test_build_mask_returning_none_is_a_contract_error():
    graph = make_graph(2)
    pm = manager("quota", Speculator(graph, None, None))
    with pytest.raises(HookContractError, match="no plugin answered dloom_build_mask"):
        hooks.build_mask(pm, make_state(), graph)


# --- the timing wrapper ------------------------------------------------------------------


class SlowCommit(Returns):
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        time.sleep(0.01)
        return self.value


def run_all_hooks(pm) -> None:
    graph, state = make_graph(2), make_state()
    hooks.select_commit(pm, CONFIDENCE, SELECTABLE, schedule())
    hooks.draft(pm, state)
    hooks.prune(pm, graph, 2)
    hooks.build_mask(pm, state, graph)
    hooks.verify(pm, state, graph, torch.zeros(B, 3, K, V), lambda b, logits, a: b)


def test_hook_timer_wraps_every_decoding_hook():
    assert hooks_implemented_by(HookTimer) == tuple(sorted(DECODING_HOOKS))


def test_hook_timer_records_each_hook_called():
    graph = make_graph(2)
    verdict = Verdict(block=make_state().block, logits=torch.zeros(B, K, V), accepted=torch.zeros(B))
    syncs: list[int] = []
    timer = HookTimer(synchronize=lambda: syncs.append(1))
    pm = manager(
        SlowCommit(torch.ones(B, K, dtype=torch.bool)),
        Speculator(graph, make_layout(graph), verdict),
        extra=[timer],
    )
    run_all_hooks(pm)
    assert set(timer.seconds) == {"select_commit", "draft", "prune", "build_mask", "verify"}
    assert all(seconds >= 0 for seconds in timer.seconds.values())
    assert timer.seconds["select_commit"] >= 0.01
    assert len(syncs) == 2 * 5  # before and after every hook call
    before = timer.seconds["select_commit"]
    hooks.select_commit(pm, CONFIDENCE, SELECTABLE, schedule())
    assert timer.seconds["select_commit"] >= before + 0.01  # accumulates


def test_hook_timer_times_hooks_without_an_implementation():
    timer = HookTimer()
    pm = manager("quota", extra=[timer])
    assert hooks.draft(pm, make_state()) is None
    assert set(timer.seconds) == {"draft"}


def test_hook_timer_records_time_of_a_failing_hook():
    class Boom:
        @dloom.hookimpl
        def dloom_select_commit(self, confidence, selectable, schedule):
            raise RuntimeError("boom")

    timer = HookTimer()
    with pytest.raises(HookContractError, match="plugin 'Boom' raised RuntimeError in dloom_select_commit: boom"):
        hooks.select_commit(manager(Boom(), extra=[timer]), CONFIDENCE, SELECTABLE, schedule())
    assert "select_commit" in timer.seconds


def test_decoder_reports_hook_times(tiny_adapter):
    decoder = dloom.DiffusionDecoder(tiny_adapter, "quota", gen_length=4, block_length=4)
    result = decoder.generate([[5, 6]])
    assert set(result.hook_seconds) == {"forward", "select_commit"}
    assert result.hook_seconds is not decoder.timer.seconds


# --- docs kept honest --------------------------------------------------------------------


def hookspec_functions() -> dict[str, object]:
    return {
        name: obj
        for name, obj in vars(hookspecs).items()
        if name.startswith("dloom_") and hasattr(obj, "dloom_spec")
    }


def test_every_hook_is_specified():
    assert hookspecs.HOOKS == tuple(hookspec_functions())
    assert set(hookspec_functions()) == {
        "dloom_register_strategies", "dloom_register_families", "dloom_register_commands",
        "dloom_register_cache_policies", "dloom_configure",
        "dloom_select_commit", "dloom_draft", "dloom_prune", "dloom_build_mask", "dloom_verify",
    }
    assert DECODING_HOOKS == ("dloom_select_commit", "dloom_draft", "dloom_prune", "dloom_build_mask", "dloom_verify")
    assert hookspecs.SPECULATION_HOOKS == DECODING_HOOKS[1:]


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_hookspec_docstring_documents_every_argument_and_the_return(name):
    spec = hookspec_functions()[name]
    doc = inspect.getdoc(spec)
    assert doc, f"{name} has no docstring"
    summary = doc.splitlines()[0]
    assert summary.endswith("."), f"{name}: one summary line ending with '.'"
    signature = inspect.signature(spec)
    for param in signature.parameters:
        assert re.search(rf"^:param {param}:", doc, re.M), f"{name} does not document {param!r}"
    documented = re.findall(r"^:param (\w+):", doc, re.M)
    assert documented == list(signature.parameters), f"{name} documents {documented}"
    returns_none = signature.return_annotation in (None, "None", inspect.Signature.empty)
    assert bool(re.search(r"^:return:", doc, re.M)) is not returns_none, name


@pytest.mark.parametrize("name", DECODING_HOOKS)
def test_decoding_hooks_are_firstresult_and_say_so(name):
    spec = hookspec_functions()[name]
    assert spec.dloom_spec["firstresult"] is True
    assert "Stops at the first non-``None`` result" in inspect.getdoc(spec)
    assert inspect.signature(spec).return_annotation.endswith("| None")


@pytest.mark.parametrize("name", DECODING_HOOKS)
def test_every_decoding_hook_has_a_typed_wrapper_with_its_arguments(name):
    wrapper = getattr(hooks, name.removeprefix("dloom_"))
    spec = hookspec_functions()[name]
    assert list(inspect.signature(wrapper).parameters) == ["pm", *inspect.signature(spec).parameters]
    assert wrapper.__doc__


def test_state_attributes_named_in_hook_docs_exist():
    known = {f.name for f in fields(DecodeState)} | {f.name for f in fields(ChainState)}
    for name, spec in hookspec_functions().items():
        for attribute in re.findall(r"state\.(\w+)", inspect.getdoc(spec)):
            assert attribute in known, f"{name} documents state.{attribute}"
