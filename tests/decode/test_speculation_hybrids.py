"""One speculation loop, two kinds of target: single-hook replacements (who answers a hook),
the draft budget for every speculator, prompt-lookup drafting of an AR target (the example of
``docs/plugins.md``, lossless and with a broken verifier that is caught), and the observer's
step records."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import dloom
from dloom import DiffusionDecoder
from dloom.ar.chains import match_chains
from dloom.check.target import target_greedy
from dloom.check.tiny import tiny_ar, tiny_dllm
from dloom.decode.speculation import follow_graph, layout_drafts
from dloom.errors import CompositionError, ConfigurationError, HookContractError
from dloom.hooks.composition import compose
from dloom.types import DraftGraph
from dloom_plugins.failfast import FailFastDecoder

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAIR = dict(vocab=16, hidden=32, layers=2, init=0.8, context=64)
PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 3, 9, 3], [3, 4, 5], [7, 8, 9, 10, 7, 8]]


def docs_example(name: str) -> dict:
    """The namespace of the ``docs/plugins.md`` python block whose first line is ``# name``."""
    text = (DOCS / "plugins.md").read_text()
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if b.startswith(f"# {name}"))
    namespace: dict = {}
    exec(compile(block, f"docs/plugins.md:{name}", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def pair():
    return tiny_ar(2, **PAIR), tiny_dllm(2, **PAIR)


@pytest.fixture(scope="module")
def reference(pair):
    return target_greedy(pair[0], PROMPTS, 12)


class CountingPrune:
    """Keeps every draft and counts its calls (a user's pruning)."""

    def __init__(self) -> None:
        self.calls = 0

    @dloom.hookimpl
    def dloom_prune(self, graph, budget):
        self.calls += 1
        return graph


class CountingMatch:
    """A user's chain verifier: sample and match, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    @dloom.hookimpl
    def dloom_verify(self, state, graph, logits, kernel):
        self.calls += 1
        return match_chains(graph, logits, kernel)


class AcceptEverything:
    """A broken chain verifier: keeps every drafted token."""

    @dloom.hookimpl
    def dloom_verify(self, state, graph, logits, kernel):
        token = kernel(logits).gather(1, graph.length.unsqueeze(1)).squeeze(1)
        return dloom.ChainVerdict(accepted=graph.length, token=token)


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
    decoder = DiffusionDecoder(tiny_adapter, ["spiffy", dloom.replace("prune", prune), "quota"], **options)
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


def test_failfast_with_a_users_verifier_is_lossless_and_calls_only_it(pair, reference):
    target, drafter = pair
    verifier = CountingMatch()
    decoder = FailFastDecoder(target, drafter, ["failfast", dloom.replace("verify", verifier)], max_new_tokens=12)
    result = decoder.generate(PROMPTS)
    assert result.token_lists == reference
    assert verifier.calls == result.forwards - 1  # every round (the prefill is not one)
    assert decoder.composition.hook_table()["dloom_verify"]["replaces"] == ["failfast"]


def test_failfast_with_a_broken_verifier_is_caught(pair, reference):
    target, drafter = pair
    decoder = FailFastDecoder(
        target, drafter, ["failfast", dloom.replace("verify", AcceptEverything())], max_new_tokens=12
    )
    assert decoder.generate(PROMPTS).token_lists != reference


# --- the draft budget binds every speculator ----------------------------------------------------


def test_a_speculator_without_prune_that_exceeds_the_budget_is_a_contract_error(tiny_adapter):
    options = dict(gen_length=8, block_length=8)
    DiffusionDecoder(tiny_adapter, [OneDraft(), "quota"], draft_budget=1, **options).generate([[5, 6, 7]])
    with pytest.raises(HookContractError, match="kept 1 drafts in a row for a budget of 0 .no plugin prunes"):
        DiffusionDecoder(tiny_adapter, [OneDraft(), "quota"], draft_budget=0, **options).generate([[5, 6, 7]])


def test_a_chain_drafter_without_prune_that_exceeds_the_budget_is_a_contract_error(pair):
    lookup = docs_example("prompt_lookup.py")["PromptLookup"]
    decoder = dloom.ARTargetDecoder(pair[0], lookup(), max_new_tokens=12, draft_budget=0)
    with pytest.raises(HookContractError, match="chains of more than 0 tokens for a draft budget of 0 .no plugin prunes"):
        decoder.generate(PROMPTS)


def test_failfast_prunes_to_the_budget_and_budget_zero_is_plain_ar_decoding(pair, reference):
    target, drafter = pair
    for budget in (0, 2):
        result = FailFastDecoder(target, drafter, max_new_tokens=12, draft_budget=budget).generate(PROMPTS)
        assert result.token_lists == reference
        assert max(max(row) for row in result.proposed) == budget
    with pytest.raises(ConfigurationError, match="draft_budget is -1; allowed: >= 0 or None"):
        FailFastDecoder(target, drafter, draft_budget=-1)


# --- prompt lookup: a second AR drafter written against the public hooks -------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prompt_lookup_from_the_docs_is_lossless(pair, reference, temperature):
    """Greedy: the target's greedy tokens, alone or batched. Sampled: reproducible under a
    seed (the distribution of match verification is proved in
    proofs_tests/test_failfast_lossless.py, whatever drafts)."""
    lookup = docs_example("prompt_lookup.py")["PromptLookup"]
    decoder = dloom.ARTargetDecoder(pair[0], lookup(), max_new_tokens=12, temperature=temperature, seed=1)
    batch = decoder.generate(PROMPTS)
    if temperature == 0:
        assert batch.token_lists == reference
        assert batch.token_lists == [decoder.generate([p]).token_lists[0] for p in PROMPTS]
        assert batch.accepted_drafts > 0  # the repeated prompts are looked up
    else:
        assert batch.token_lists == decoder.generate(PROMPTS).token_lists


def test_a_broken_verifier_over_prompt_lookup_is_caught(pair, reference):
    lookup = docs_example("prompt_lookup.py")["PromptLookup"]
    decoder = dloom.ARTargetDecoder(pair[0], [lookup(), dloom.replace("verify", AcceptEverything())], max_new_tokens=12)
    assert decoder.generate(PROMPTS).token_lists != reference


def test_the_ar_target_decoder_refuses_a_commit_rule_and_a_composition_that_drafts_nothing(pair):
    with pytest.raises(ConfigurationError, match="'quota' is a commit rule, which an AR target does not take"):
        dloom.ARTargetDecoder(pair[0], "failfast+quota", drafter=pair[1])
    with pytest.raises(CompositionError, match="speculates \\(dloom_verify\\) but nothing provides dloom_draft"):
        dloom.ARTargetDecoder(pair[0], [CountingMatch()])

    class OnlyChecks:
        @dloom.hookimpl
        def dloom_configure(self, config):
            pass

    with pytest.raises(ConfigurationError, match="drafts nothing"):
        dloom.ARTargetDecoder(pair[0], [OnlyChecks()])


# --- step records -------------------------------------------------------------------------------


def test_a_step_record_keeps_the_block_before_the_step(tiny_adapter):
    records = []
    DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=8).generate([[5, 6, 7]], observer=records.append)
    assert len(records) == 8
    for record in records:  # every plain step commits one position
        assert int((record.before != record.after).sum()) == 1
