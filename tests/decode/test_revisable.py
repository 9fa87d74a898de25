"""The revisable kernel: fill rules decode on it exactly as on the absorbing kernel, and
LLaDA2.1's joint threshold fills and edits as its own ``generate`` does (a plain loop written
here, one full forward per step), batch-invariantly, never touching prompt positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dloom
from conftest import revisable
from dloom.decode.commit import sorted_profile
from dloom.decode.revisable import RevisableKernel
from dloom.errors import ConfigurationError
from dloom.hooks.composition import build_plugin_manager, compose
from dloom.hooks.timing import HookTimer

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


@pytest.mark.parametrize("strategy, params", [
    ("quota", {}), ("threshold", {"tau": 0.5}), ("factor", {"f": 1.0}), ("frechet", {}),
])
def test_a_fill_rule_decodes_on_the_revisable_kernel_as_on_the_absorbing_one(sharp_adapter, strategy, params):
    settings = dict(gen_length=16, block_length=4, **params)
    absorbing = dloom.DiffusionDecoder(sharp_adapter, strategy, **settings).generate(PROMPTS)
    result = dloom.DiffusionDecoder(revisable(sharp_adapter), strategy, **settings).generate(PROMPTS)
    assert torch.equal(result.sequences, absorbing.sequences)
    assert torch.equal(result.nfe, absorbing.nfe) and result.forwards == absorbing.forwards


def reference_joint_threshold(adapter, prompt, gen_length, block_length, tau, edit_tau, max_post_steps):
    """LLaDA2.1's ``generate`` with ``eos_early_stop``, one row, written as a plain loop over
    this model's layout (blocks after the prompt, every forward over the whole sequence),
    candidates and probabilities as dloom's kernel reads them (the mask token excluded).

    :return: the generated tokens, the forwards, the blocks whose edit budget ran out, and
        the blocks that settled on a post step that changed nothing and had a block after
        them (dloom takes that next block's first step from the settling forward).
    """
    mask, eos = adapter.mask_token_id, adapter.eos_token_ids
    x = torch.tensor([prompt + [mask] * gen_length])
    start, forwards, exhausted, reusable, unchanged = len(prompt), 0, 0, 0, False
    for block in range(gen_length // block_length):
        lo, hi = start + block * block_length, start + (block + 1) * block_length
        reusable += unchanged  # the last block settled unchanged, and this one follows it
        post_steps, unchanged = 0, False
        while True:
            old = x[0, lo:hi].clone()
            masked = old == mask
            if not masked.any():
                post_steps += 1
            if post_steps > max_post_steps:
                exhausted += 1
                break
            logits = adapter.model(input_ids=x).logits[0, lo:hi].double()
            forwards += 1
            logits[:, mask] = -torch.inf
            probs = torch.softmax(logits, -1)
            x0 = probs.argmax(-1)
            p = probs.gather(-1, x0[:, None])[:, 0]
            fill = torch.zeros_like(masked)
            if masked.any():
                high = masked & (p > tau)
                if high.sum() >= 1:
                    fill = high
                else:
                    fill[torch.where(masked, p, -torch.inf).argmax()] = True
            edit = ~masked & (p > edit_tau) & (x0 != old)
            x[0, lo:hi] = torch.where(fill | edit, x0, old)
            if not masked.any() and not edit.any():
                unchanged = True
                break
        if any(t in eos for t in x[0, start:hi].tolist()):
            break
    generated = x[0, start:].tolist()
    ends = [i for i, t in enumerate(generated) if t in eos]
    return generated[: ends[0] + 1] if ends else generated, forwards, exhausted, reusable


@pytest.mark.parametrize("tau, edit_tau, max_post_steps", [(0.5, 0.5, 16), (0.3, 0.0, 16), (0.3, 0.0, 2), (0.5, 0.2, 0)])
def test_the_joint_threshold_decodes_as_llada21s_generate(sharp_adapter, tau, edit_tau, max_post_steps):
    decoder = dloom.DiffusionDecoder(
        revisable(sharp_adapter), "joint_threshold", gen_length=16, block_length=4,
        tau=tau, edit_tau=edit_tau, max_post_steps=max_post_steps,
    )
    result = decoder.generate(PROMPTS)
    edited = reused = 0
    for row, prompt in enumerate(PROMPTS):
        tokens, forwards, exhausted, reusable = reference_joint_threshold(
            sharp_adapter, prompt, 16, 4, tau, edit_tau, max_post_steps,
        )
        # without a cache a block settling on an unchanged post step hands its forward on
        assert result.token_lists[row] == tokens and int(result.nfe[row]) == forwards - reusable
        edited += exhausted
        reused += reusable
    if (tau, edit_tau, max_post_steps) == (0.3, 0.0, 2):
        assert edited, "no block ran out of its edit budget: the case is vacuous"
    if (tau, edit_tau, max_post_steps) == (0.5, 0.5, 16):
        assert reused, "no block settled unchanged before another: the case is vacuous"


def test_edits_happen_and_a_batch_decodes_as_its_rows_alone(sharp_adapter):
    settings = dict(gen_length=16, block_length=4, tau=0.3, edit_tau=0.0, max_post_steps=4)
    decoder = dloom.DiffusionDecoder(revisable(sharp_adapter), "joint_threshold", **settings)
    batch = decoder.generate(PROMPTS)
    fills_only = dloom.DiffusionDecoder(
        revisable(sharp_adapter), "joint_threshold", **{**settings, "edit_tau": 1.0, "max_post_steps": 0},
    ).generate(PROMPTS)
    assert batch.token_lists != fills_only.token_lists, "no edit changed any output: the test is vacuous"
    for row, prompt in enumerate(PROMPTS):
        alone = decoder.generate([prompt])
        assert alone.token_lists[0] == batch.token_lists[row] and int(alone.nfe[0]) == int(batch.nfe[row])


def test_without_edits_the_joint_threshold_is_the_threshold_rule(sharp_adapter):
    threshold = dloom.DiffusionDecoder(sharp_adapter, "threshold", gen_length=16, block_length=4, tau=0.5).generate(PROMPTS)
    joint = dloom.DiffusionDecoder(
        revisable(sharp_adapter), "joint_threshold", gen_length=16, block_length=4, tau=0.5, edit_tau=1.0,
        max_post_steps=0,
    ).generate(PROMPTS)
    assert joint.token_lists == threshold.token_lists and torch.equal(joint.nfe, threshold.nfe)


def test_the_kernel_never_offers_prompt_positions(sharp_adapter):
    """An editing rule that rewrites everything it is offered: positions outside the
    generated ones, and positions whose candidate is already their token, stay as they are."""
    composition = compose("joint_threshold", {"tau": 0.5, "edit_tau": 0.0}, None)
    pm = build_plugin_manager(composition, HookTimer())
    mask = sharp_adapter.mask_token_id
    block = torch.tensor([[5, 6, mask, 7]])
    kernel = RevisableKernel(
        pm, 0.0, "low_confidence", None, mask, torch.tensor([2]), 4, torch.tensor([1]), edits=True,
    )
    generated = torch.tensor([[False, True, True, True]])
    kernel.restrict(generated)
    logits = torch.full((1, 4, 40), -10.0, dtype=torch.float64)
    logits[..., 30] = 10.0  # every position's candidate is 30
    logits[0, 3, 7] = 20.0  # position 3's candidate is its own token
    new = kernel(block, logits, torch.tensor([True]))
    assert new.tolist() == [[5, 30, 30, 7]]


def test_an_editing_rule_is_refused_on_the_absorbing_kernel_and_spiffy_on_the_revisable_one(sharp_adapter):
    with pytest.raises(ConfigurationError, match="'joint_threshold' supports the 'revisable' kernel.*not the model's 'absorbing'"):
        dloom.DiffusionDecoder(sharp_adapter, "joint_threshold", gen_length=8, block_length=4)
    with pytest.raises(ConfigurationError, match="'spiffy' supports the 'absorbing' kernel.*not the model's 'revisable'"):
        dloom.DiffusionDecoder(revisable(sharp_adapter), "spiffy+threshold", gen_length=8, block_length=4)


def test_an_editing_rule_must_bound_its_post_steps():
    """Without an edit budget a rule that always edits would keep its block open forever."""
    from dloom.errors import PluginLoadError
    from dloom.hooks.registry import check_registration
    from dloom.types import Parameter, StrategyRegistration

    unbounded = StrategyRegistration("edits_forever", object, edits=True, kernels=("revisable",))
    with pytest.raises(PluginLoadError, match="edit_budget must name the integer parameter.*got None, allowed: none"):
        check_registration(unbounded, [])
    misnamed = StrategyRegistration(
        "edits_forever", object, parameters=(Parameter("rounds", 4, int, "post steps"), Parameter("tau", 0.5, float, "x")),
        edits=True, edit_budget="tau", kernels=("revisable",),
    )
    with pytest.raises(PluginLoadError, match="got 'tau', allowed: rounds"):
        check_registration(misnamed, [])
    check_registration(dataclasses.replace(misnamed, edit_budget="rounds"), [])


class EditOnce:
    """A third-party editing rule, as docs/hooks.md describes one: the most confident masked
    position, and every offered filled position in the block's first post step only."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.seen: list[tuple[bool, bool]] = []

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        masked = selectable & schedule.masked
        self.seen.append((bool((selectable & ~schedule.masked).any()), bool((schedule.post_steps > 0).any())))
        _, ranks = sorted_profile(confidence, masked)
        edits = selectable & ~schedule.masked & (schedule.post_steps == 1).unsqueeze(1)
        return (masked & (ranks == 0)) | edits


def test_a_registered_third_party_editing_rule_is_offered_filled_positions(sharp_adapter, monkeypatch):
    from dloom.hooks.registry import Strategy, get_registry
    from dloom.types import Parameter, StrategyRegistration

    rules: list[EditOnce] = []

    def build(rounds):
        rules.append(EditOnce(rounds))
        return rules[-1]

    registration = StrategyRegistration(
        "edit_once", build, parameters=(Parameter("rounds", 3, int, "post steps"),),
        kernels=("revisable",), edits=True, edit_budget="rounds",
    )
    monkeypatch.setitem(get_registry().strategies, "edit_once", Strategy("edit_once", "test", registration))
    result = dloom.DiffusionDecoder(revisable(sharp_adapter), "edit_once", gen_length=8, block_length=4).generate(PROMPTS)
    offered_edits = any(edits for edits, _ in rules[-1].seen)
    post_steps_seen = any(post for _, post in rules[-1].seen)
    assert offered_edits and post_steps_seen
    fills_only = dloom.DiffusionDecoder(sharp_adapter, "quota", gen_length=8, block_length=4, steps=8).generate(PROMPTS)
    # one position per step, then post steps: at least one more forward per block than filling alone
    assert all(int(a) > int(b) for a, b in zip(result.nfe, fills_only.nfe))


MASK, VOCAB = 39, 40


def distribution(probabilities: dict[int, float]) -> torch.Tensor:
    """``(V,)`` logits whose softmax (mask token left out) gives ``probabilities``, the rest
    spread evenly over the other tokens."""
    probs = torch.zeros(VOCAB, dtype=torch.float64)
    rest = (1.0 - sum(probabilities.values())) / (VOCAB - 1 - len(probabilities))
    probs[:MASK] = rest
    for token, p in probabilities.items():
        probs[token] = p
    return probs.log()


class Answers:
    """An editing rule answering a fixed ``Edits(commit, none, none, remask)``, recording
    the signals it is given."""

    def __init__(self, commit, remask) -> None:
        self.commit, self.remask = torch.tensor(commit, dtype=torch.bool), torch.tensor(remask, dtype=torch.bool)
        self.signals: dict = {}

    @dloom.hookimpl
    @dloom.reads_signals("token_probability")
    def dloom_select_commit(self, selectable, signals):
        self.signals = dict(signals)
        none = torch.zeros_like(selectable)
        return dloom.Edits(self.commit & selectable, none, none, remask=self.remask)


def remask_step(block, logits, commit, remask, generated, advance=None):
    rule = Answers(commit, remask)
    kernel = RevisableKernel(
        build_plugin_manager(compose(rule)), 0.0, "low_confidence", None, MASK, torch.tensor([2]), 4,
        (torch.tensor(block) == MASK).sum(-1), edits=True,
    )
    kernel.restrict(torch.tensor(generated))
    rows = len(block)
    advance = torch.ones(rows, dtype=torch.bool) if advance is None else torch.tensor(advance)
    return kernel(torch.tensor(block), logits, advance), rule


def test_remasks_keep_one_fill_net_least_probable_first_never_the_prompt_nor_this_steps_commits():
    # position 0 is a prompt position in every row; tokens' probabilities are the numbers below
    block = [
        [5, 11, 12, 13, MASK, MASK],  # fills 4 and 5, asks to remask all: keeps 1, the least probable (2)
        [5, 11, 11, 13, MASK, MASK],  # fills 4 and 5, rewrites 3, asks all: 1 and 2 tie, the lower (1) kept
        [5, 11, 12, 13, MASK, MASK],  # fills 4 only: keeps no remask
        [5, 11, 12, 13, 14, 15],      # a post step: remasks ignored
        [5, 11, MASK, MASK, MASK, MASK],  # fills 4 of 4, asks 1: kept (3 allowed)
    ]
    logits = torch.stack([
        torch.stack([
            distribution({5: 0.01, 25: 0.9}), distribution({11: 0.2, 20: 0.7}), distribution({12: 0.1, 21: 0.8}),
            distribution({13: 0.3, 22: 0.6}), distribution({23: 0.9}), distribution({24: 0.8}),
        ]),
        torch.stack([
            distribution({5: 0.01, 25: 0.9}), distribution({11: 0.2, 20: 0.7}), distribution({11: 0.2, 20: 0.7}),
            distribution({13: 0.05, 22: 0.9}), distribution({23: 0.9}), distribution({24: 0.8}),
        ]),
        *[torch.stack([
            distribution({5: 0.01, 25: 0.9}), distribution({11: 0.2, 20: 0.7}), distribution({12: 0.1, 21: 0.8}),
            distribution({13: 0.3, 22: 0.6}), distribution({14: 0.2, 23: 0.7}), distribution({15: 0.2, 24: 0.7}),
        ])] * 3,
    ])
    commit = [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 0], [0] * 6, [0, 0, 1, 1, 1, 1]]
    remask = [[1] * 6, [1] * 6, [1] * 6, [1] * 6, [0, 1, 0, 0, 0, 0]]
    generated = [[False] + [True] * 5] * 5
    new, rule = remask_step(block, logits, commit, remask, generated)
    assert new.tolist() == [
        [5, 11, MASK, 13, 23, 24],
        [5, MASK, 11, 22, 23, 24],
        [5, 11, 12, 13, 23, MASK],
        [5, 11, 12, 13, 14, 15],
        [5, MASK, 21, 22, 23, 24],
    ]
    # the signal: each position's current token's probability, 0 where masked
    assert rule.signals["token_probability"].dtype == torch.float64
    torch.testing.assert_close(
        rule.signals["token_probability"][0], torch.tensor([0.01, 0.2, 0.1, 0.3, 0.0, 0.0], dtype=torch.float64),
    )
    torch.testing.assert_close(
        rule.signals["token_probability"][3], torch.tensor([0.01, 0.2, 0.1, 0.3, 0.2, 0.2], dtype=torch.float64),
    )


def test_a_row_that_takes_no_step_is_not_remasked():
    block = [[5, 11, 12, MASK], [5, 11, 12, MASK]]
    logits = torch.stack([torch.stack([distribution({23: 0.9})] * 4)] * 2)
    new, _ = remask_step(block, logits, [[0, 0, 0, 1]] * 2, [[0, 1, 1, 0]] * 2, [[True] * 4] * 2, [True, False])
    assert new.tolist() == [[5, 11, 12, 23], [5, 11, 12, MASK]]  # one fill: no remask kept


def test_the_kernel_ranks_remasks_itself_when_the_rule_reads_no_signal():
    class Unread(Answers):
        @dloom.hookimpl
        def dloom_select_commit(self, selectable):
            none = torch.zeros_like(selectable)
            return dloom.Edits(self.commit & selectable, none, none, remask=self.remask)

    rule = Unread([[0, 0, 1, 1, 1]], [[1, 1, 1, 0, 0]])
    kernel = RevisableKernel(
        build_plugin_manager(compose(rule)), 0.0, "low_confidence", None, MASK, torch.tensor([2]), 4,
        torch.tensor([3]), edits=True,
    )
    logits = torch.stack([
        distribution({11: 0.5}), distribution({12: 0.05}), distribution({13: 0.9}),
        distribution({23: 0.9}), distribution({24: 0.9}),
    ])[None]
    new = kernel(torch.tensor([[11, 12, MASK, MASK, MASK]]), logits, torch.tensor([True]))
    assert new.tolist() == [[MASK, MASK, 13, 23, 24]]  # 3 filled: 2 remasks kept, all asked
    rule.remask = torch.tensor([[1, 1, 0, 0, 0]], dtype=torch.bool)
    rule.commit = torch.tensor([[0, 0, 1, 1, 0]], dtype=torch.bool)
    kernel = RevisableKernel(
        build_plugin_manager(compose(rule)), 0.0, "low_confidence", None, MASK, torch.tensor([2]), 4,
        torch.tensor([3]), edits=True,
    )
    new = kernel(torch.tensor([[11, 12, MASK, MASK, MASK]]), logits, torch.tensor([True]))
    assert new.tolist() == [[11, MASK, 13, 23, MASK]]  # 2 filled: 1 kept, the least probable (12 at 0.05)


def test_a_badly_shaped_remask_is_named():
    from dloom.errors import HookContractError

    class BadRemask:
        @dloom.hookimpl
        def dloom_select_commit(self, confidence, selectable):
            _, ranks = sorted_profile(confidence, selectable)
            none = torch.zeros_like(selectable)
            return dloom.Edits(selectable & (ranks == 0), none, none, remask=none[:, :1].long())

    kernel = RevisableKernel(
        build_plugin_manager(compose(BadRemask())), 0.0, "low_confidence", None, MASK, torch.tensor([2]), 4,
        torch.tensor([2]), edits=True,
    )
    logits = torch.stack([distribution({23: 0.9})] * 2)[None]
    with pytest.raises(HookContractError, match=r"\(Edits.remask\) must return a bool tensor of shape \(1, 2\), got torch.int64 \(1, 1\)"):
        kernel(torch.tensor([[MASK, MASK]]), logits, torch.tensor([True]))
