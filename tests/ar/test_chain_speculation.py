"""The AR-target decoder's speculation loop (:class:`dloom.ARTargetDecoder`): prompt-lookup
drafting written against the public hooks (the example of ``docs/plugins.md``, lossless and
with a broken verifier that is caught), a user's verifier replacing FailFast's, the draft
budget over chain drafters, and the compositions it refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import dloom
from dloom.ar.chains import chain_layout, match_chains
from dloom.ar.target import ARTarget
from dloom.check.target import target_greedy
from dloom.check.tiny import tiny_ar, tiny_dllm
from dloom.errors import CompositionError, ConfigurationError, HookContractError
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


# --- a user's verifier over FailFast's drafts -----------------------------------------------------


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


# --- the draft budget binds every chain drafter ---------------------------------------------------


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


# --- handing the batch to the target alone ---------------------------------------------------------


def oracle_then(reference: list[list[int]], alone: bool, rounds: int):
    """For ``rounds`` rounds, row ``b`` proposes the next ``b % 3`` tokens of the target's
    greedy output (accepted at temperature 0: the rows drift apart); then nothing, handing the
    batch to the target alone (``alone``) or proposing empty chains, round after round."""

    class OracleThenStop:
        calls = 0

        @dloom.hookimpl
        def dloom_draft(self, state):
            self.calls += 1
            rows = len(reference)
            table = torch.tensor([row + [0] * (state.max_new_tokens - len(row)) for row in reference])
            columns = (state.lengths.unsqueeze(1) + torch.arange(2)).clamp(max=table.shape[1] - 1)
            wanted = torch.arange(rows) % 3 if self.calls <= rounds else torch.zeros(rows, dtype=torch.long)
            return dloom.DraftChains(
                tokens=table.gather(1, columns), length=torch.minimum(wanted, state.room) * state.active,
                open=torch.zeros_like(state.active), target_alone=alone and self.calls > rounds,
                decision={"why": "test"},
            )

        @dloom.hookimpl
        def dloom_build_mask(self, state, graph):
            return chain_layout(state, graph)

        @dloom.hookimpl
        def dloom_verify(self, state, graph, logits, kernel):
            return match_chains(graph, logits, kernel)

    return OracleThenStop()


@pytest.mark.parametrize("rounds", [0, 3])
def test_target_alone_is_the_targets_plain_loop_with_the_tokens_of_empty_chains(pair, reference, rounds):
    """From the first round or mid-batch (rows then at different lengths): the target's greedy
    tokens, one target forward per token with no more rounds, and under sampling the very
    tokens of verifying empty chains (the same random draws)."""
    target = pair[0]
    result = dloom.ARTargetDecoder(target, oracle_then(reference, True, rounds), max_new_tokens=12).generate(PROMPTS)
    assert result.token_lists == reference
    assert result.drafting == {"path": "target alone", "drafted_rounds": rounds, "why": "test"}
    assert result.verifications == sum(len(row) for row in result.accepted) <= rounds * len(PROMPTS)
    longest = max(map(len, reference))
    drafted = 1 + max((len(row) for row in result.accepted), default=0)  # prefill and the rounds
    assert result.forwards <= drafted + longest
    assert result.summary()["drafting"]["path"] == result.speculation["drafting"]["path"] == "target alone"
    for temperature in (0.0, 1.5):
        alone, empty = (
            dloom.ARTargetDecoder(target, oracle_then(reference, flag, rounds), max_new_tokens=12, temperature=temperature,
                                  seed=3).generate(PROMPTS)
            for flag in (True, False)
        )
        assert alone.token_lists == empty.token_lists
        assert alone.nfe.tolist() == empty.nfe.tolist()
        assert empty.drafting == {"path": "drafted", "why": "test"}


def test_target_alone_runs_its_forwards_in_inference_mode(pair, reference, monkeypatch):
    """The plain loop turns autograd's bookkeeping off entirely (``torch.inference_mode``: no
    version counters or views tracked, cheaper per operation than ``no_grad``), and only there:
    the drafted rounds' forwards, whose outputs the hooks keep, run as before."""
    target = pair[0]
    modes: list[bool] = []
    forward = ARTarget.forward

    def recording(self, ids, slot_mask):
        modes.append(torch.is_inference_mode_enabled())
        return forward(self, ids, slot_mask)

    monkeypatch.setattr(ARTarget, "forward", recording)
    result = dloom.ARTargetDecoder(target, oracle_then(reference, True, 2), max_new_tokens=12).generate(PROMPTS)
    assert result.token_lists == reference
    assert modes[:2] == [False, False] and len(modes) > 2 and all(modes[2:])
