"""FailFast with a speculating drafter (``spiffy+threshold``, ``spiffy+quota``, ...): the
drafting round runs the engine's speculative step over each row's small block.

* The output is the target's greedy decoding, alone and in batches of mixed prompt lengths,
  in both drafter cache modes (the target verifies every token).
* Spiffy inside the drafter is lossless against its base rule: every round's proposed
  chains are token for token those of the base rule's drafter, in no more drafter forwards
  (strictly fewer where the base commits one position per step).
* A broken Spiffy verifier (it accepts a draft the kernel did not reach) changes the drafts,
  which the identity check catches, while the output still equals the target's.
* Spiffy's parameters reach the drafter through ``drafter_params`` (API and CLI).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dloom import ARTargetDecoder, StrategyRegistration, hookimpl
from dloom.check.target import target_greedy
from dloom.check.tiny import tiny_ar, tiny_dllm
from dloom.cli import app
from dloom.errors import HookContractError
from dloom.hooks.registry import Registry, Strategy, get_registry
from dloom.types import ChainState, Verdict
from dloom_plugins.failfast import FailFast, FailFastDecoder

PAIR = dict(vocab=16, hidden=32, layers=2, init=0.8, context=128)
PROMPTS = [[5, 6, 7, 8], [9, 3], [3, 4, 5], [7, 8, 9, 10, 11], [12, 4, 4]]
NEW = 14


@pytest.fixture(scope="module")
def pair():
    return tiny_ar(0, **PAIR), tiny_dllm(0, **PAIR)


@pytest.fixture(scope="module")
def reference(pair):
    return target_greedy(pair[0], PROMPTS, NEW)


class RecordingFailFast(FailFast):
    """FailFast that records every round's proposed chains (active rows' first ``length``
    tokens) as the decoder lays them out for verification."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.rounds: list[list[list[int] | None]] = []

    @hookimpl
    def dloom_build_mask(self, state, graph):
        if isinstance(state, ChainState):
            lengths = torch.where(state.active, graph.length, -1).tolist()
            self.rounds.append([
                row[:n] if n >= 0 else None for row, n in zip(graph.tokens.tolist(), lengths)
            ])
        return super().dloom_build_mask(state, graph)


def drafts(pair, prompts, registry=None, cache="none", **params):
    """The output, every round's chains and the drafter forwards of one generation."""
    target, drafter = pair
    plugin = RecordingFailFast(**params)
    decoder = ARTargetDecoder(
        target, [plugin], drafter=drafter, max_new_tokens=NEW, drafter_cache=cache, registry=registry,
    )
    result = decoder.generate(prompts)
    return result.token_lists, plugin.rounds, result.drafter_forwards


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
@pytest.mark.parametrize("cache", ["none", "prefix"])
@pytest.mark.parametrize("drafter", ["spiffy+threshold", "spiffy+quota", "spiffy+frechet"])
def test_a_speculating_drafter_gives_the_targets_greedy_output(pair, reference, drafter, cache):
    target, dllm = pair
    decoder = FailFastDecoder(target, dllm, max_new_tokens=NEW, drafter_cache=cache, drafter_strategy=drafter)
    batch = decoder.generate(PROMPTS)
    assert batch.token_lists == reference
    assert [decoder.generate([p]).token_lists[0] for p in PROMPTS] == reference


SPIFFY_OVER = [  # (base drafter, its parameters, whether Spiffy must save forwards)
    ("threshold", {}, False),  # tau 0.05 commits most of a small block per forward
    ("threshold", {"drafter_tau": 0.9}, False),
    ("quota", {}, True),  # one position per forward: Spiffy's drafts are accepted
    ("frechet", {}, True),
]


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
@pytest.mark.parametrize("cache", ["none", "prefix"])
@pytest.mark.parametrize("base, params, saves", SPIFFY_OVER)
def test_spiffy_in_the_drafter_proposes_its_base_rules_chains_in_fewer_forwards(
    pair, reference, base, params, saves, cache
):
    tokens, plain, plain_forwards = drafts(pair, PROMPTS, cache=cache, drafter_strategy=base, **params)
    tokens_s, spec, spec_forwards = drafts(pair, PROMPTS, cache=cache, drafter_strategy=f"spiffy+{base}",
                                           drafter_params="spiffy.budget=10", **params)
    assert tokens == tokens_s == reference
    assert len(spec) == len(plain) and spec == plain  # every round, every row, token for token
    assert spec_forwards <= plain_forwards
    if saves:
        assert spec_forwards < plain_forwards, (spec_forwards, plain_forwards)


class TrustingVerifier:
    """A broken Spiffy verifier: after the kernel's step from the root, it jumps to a valid
    child draft of the root that the kernel did *not* reach (where there is one)."""

    @hookimpl
    def dloom_verify(self, state, graph, logits, kernel):
        rows = torch.arange(graph.tokens.shape[0])
        root = torch.zeros_like(rows)
        block = kernel(graph.tokens[:, 0], logits.of(root), graph.valid[:, 0])
        reached = (graph.tokens == block.unsqueeze(1)).all(-1)
        wrong = graph.children(root) & graph.valid & ~reached
        jump = wrong.any(-1)
        child = wrong.long().argmax(-1)
        return Verdict(
            block=torch.where(jump[:, None], graph.tokens[rows, child], block),
            logits=torch.where(jump[:, None, None], logits.of(child), logits.of(root)),
            accepted=jump.long(),
        )


@pytest.fixture
def registry_with_broken_verifier() -> Registry:
    base = get_registry()
    broken = Strategy("trusting", "tests", StrategyRegistration("trusting", TrustingVerifier))
    return Registry(strategies={**base.strategies, "trusting": broken}, plugins=dict(base.plugins))


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
def test_a_broken_drafter_verifier_changes_the_drafts_but_not_the_output(
    pair, reference, registry_with_broken_verifier
):
    registry = registry_with_broken_verifier
    _, plain, _ = drafts(pair, PROMPTS, registry=registry, drafter_strategy="quota")
    tokens, broken, _ = drafts(pair, PROMPTS, registry=registry, drafter_strategy="spiffy+quota+trusting@verify",
                               drafter_params="spiffy.budget=10")
    assert broken != plain  # the identity check of the test above catches the broken verifier
    assert tokens == reference  # the target's verification still decides every token


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_spiffy_parameters_reach_the_drafter(pair, reference, cache):
    target, dllm = pair
    decoder = FailFastDecoder(
        target, dllm, max_new_tokens=NEW, drafter_cache=cache, drafter_strategy="spiffy+quota",
        drafter_params="spiffy.budget=3,layout=packed",
    )
    failfast = next(c.plugin for c in decoder.composition.components if isinstance(c.plugin, FailFast))
    spiffy = next(c for c in failfast.drafter_decoder.composition.components if c.name == "spiffy")
    assert (spiffy.plugin.budget, spiffy.plugin.layout) == (3, "packed")
    assert decoder.generate(PROMPTS).token_lists == reference
    if cache == "prefix":  # the prefix cache evaluates a packed layout span by span: exact
        _, plain, _ = drafts(pair, PROMPTS, cache=cache, drafter_strategy="quota")
        _, packed, _ = drafts(pair, PROMPTS, cache=cache, drafter_strategy="spiffy+quota",
                              drafter_params="spiffy.budget=3,layout=packed")
        assert packed == plain


def test_cli_runs_failfast_with_a_calibrated_spiffy_drafter(tmp_path):
    """``dloom calibrate`` for the drafter's decoder (block length = small_block), then
    ``dloom generate --strategy failfast`` with that graph through ``drafter_params``: no
    fallback warning, the graph's drafts accepted, the target's tokens."""
    runner = CliRunner()
    graph = tmp_path / "graph.json"
    calibrated = runner.invoke(app, [
        "calibrate", "--model", "toy-dllm", "--strategy", "quota", "--gen-length", "16",
        "--block-length", "8", "-n", "4", "-o", str(graph),
    ])
    assert calibrated.exit_code == 0, calibrated.output
    drafters = {
        "plain": ["--param", "drafter_strategy=quota"],
        "spiffy": ["--param", "drafter_strategy=spiffy+quota",
                   "--param", f"drafter_params=spiffy.graph={graph},spiffy.budget=10"],
    }
    texts, forwards = {}, {}
    for name, options in drafters.items():
        generated = runner.invoke(app, [
            "generate", "copy ab", "add 1 2", "--strategy", "failfast", "--gen-length", "16", "--json", *options,
        ])
        assert generated.exit_code == 0, generated.output
        assert "no built-in draft graph" not in generated.output
        rows = [json.loads(line) for line in generated.stdout.splitlines()]
        texts[name] = [r["text"] for r in rows]
        evaluated = runner.invoke(app, [
            "eval", "--strategy", "failfast", "-n", "3", "--gen-length", "16", "--json", *options,
        ])
        assert evaluated.exit_code == 0, evaluated.output
        report = json.loads(evaluated.stdout.splitlines()[-1])
        forwards[name] = report["totals"]["drafter_forwards"]
    assert rows[0]["config"]["params"]["failfast"]["drafter_params"] == f"spiffy.graph={graph},spiffy.budget=10"
    assert texts["spiffy"] == texts["plain"]
    assert forwards["spiffy"] < forwards["plain"], forwards


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
def test_the_drafters_spiffy_drafts_no_first_forward_and_a_forced_one_is_refused_with_the_prefix_cache(pair, reference):
    """The drafting round takes no next-block priming, so FailFast turns Spiffy's
    ``first_forward`` off; forced on, it is harmless without a cache and refused, naming the
    fix, with the drafter's prefix cache (whose forward computes no next-block logits)."""
    target, dllm = pair
    decoder = FailFastDecoder(target, dllm, max_new_tokens=NEW, drafter_strategy="spiffy+quota")
    failfast = next(c.plugin for c in decoder.composition.components if isinstance(c.plugin, FailFast))
    spiffy = next(c for c in failfast.drafter_decoder.composition.components if c.name == "spiffy")
    assert spiffy.plugin.first_forward is False
    forced = dict(max_new_tokens=NEW, drafter_strategy="spiffy+quota", drafter_params="spiffy.first_forward=true,spiffy.budget=10")
    assert FailFastDecoder(target, dllm, drafter_cache="none", **forced).generate(PROMPTS).token_lists == reference
    with pytest.raises(HookContractError, match="spiffy.first_forward=false"):
        FailFastDecoder(target, dllm, drafter_cache="prefix", **forced).generate(PROMPTS)
