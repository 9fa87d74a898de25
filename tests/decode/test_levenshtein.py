"""DELETE and SPLIT (LLaDA2.2's Levenshtein edits) through the revisable kernel's API: an
editing rule answers :class:`dloom.Edits`, the kernel rebuilds the block in its fixed width,
in post steps only, never moving prompt positions or final tokens, and blocks still end."""

from __future__ import annotations

import random

import pytest
import torch

import dloom
from dloom import Edits, Parameter, StrategyRegistration
from dloom.check import tiny
from dloom.check.kernel_claims import check_kernel_claims
from dloom.check.resolve import resolve
from dloom.decode.commit import sorted_profile
from dloom.decode.levenshtein import relayout
from dloom.errors import HookContractError
from dloom.hooks.registry import Strategy, get_registry

M = 99  # the mask id of the relayout tests


def reference_relayout(tokens, delete, split, generated, mask):
    """The documented semantics, one row, as a plain loop over Python lists."""
    slots = [j for j, g in enumerate(generated) if g]
    written = []
    for j in slots:
        if delete[j]:
            continue
        written += [mask, tokens[j]] if split[j] else [tokens[j]]
    written = (written + [mask] * len(slots))[: len(slots)]
    out = list(tokens)
    for j, token in zip(slots, written):
        out[j] = token
    return out


@pytest.mark.parametrize("tokens, delete, split, expected", [
    # p is a prompt position (not generated), a..e generated
    ("pabcde", "..x...", "....x.", "pacMde"),  # delete b, split d: c moves left, a mask before d
    ("pabcde", ".x....", "......", "pbcdeM"),  # delete a: the block ends in a mask
    ("pabcde", "......", ".x....", "pMabcd"),  # split a: e is pushed out of the block
    ("pabcde", "..xx..", "..x...", "padeMM"),  # a deleted position's split is moot
    ("pabcde", "x.....", "x.....", "pabcde"),  # the prompt position is not rebuilt
])
def test_relayout_examples(tokens, delete, split, expected):
    ids = {c: i for i, c in enumerate("pabcde")}
    ids["M"] = M
    block = torch.tensor([[ids[c] for c in tokens]])
    generated = torch.tensor([[False] + [True] * 5])
    flags = [torch.tensor([[c == "x" for c in f]]) for f in (delete, split)]
    assert relayout(block, *flags, generated, M).tolist() == [[ids[c] for c in expected]]


def test_relayout_is_the_reference_on_random_rows_and_the_identity_without_edits():
    rng = random.Random(0)
    rows, width = 64, 8
    block = torch.tensor([[rng.randrange(10) for _ in range(width)] for _ in range(rows)])
    generated = torch.tensor([[rng.random() < 0.8 for _ in range(width)] for _ in range(rows)])
    delete = torch.tensor([[rng.random() < 0.2 for _ in range(width)] for _ in range(rows)])
    split = torch.tensor([[rng.random() < 0.2 for _ in range(width)] for _ in range(rows)])
    new = relayout(block, delete, split, generated, M)
    for row in range(rows):
        args = (block[row].tolist(), delete[row].tolist(), split[row].tolist(), generated[row].tolist())
        assert new[row].tolist() == reference_relayout(*args, M)
    none = torch.zeros_like(delete)
    assert torch.equal(relayout(block, none, none, generated, M), block)


class DeleteAndSplit:
    """A test-only LLaDA2.2-style rule: fill the most confident masked position per step;
    in the first ``rounds`` post steps delete the first filled position offered and split
    the last one. It asks for deletes and splits in every step, so the kernel's restriction
    to post steps shows. It records each step's request."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.asked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        masked = selectable if schedule.masked is None else selectable & schedule.masked
        _, ranks = sorted_profile(confidence, masked)
        fills = masked & (ranks == 0)
        if schedule.masked is None:  # the contract probe, or a kernel that does not edit
            return fills
        offered = (selectable & ~schedule.masked).long()
        first = torch.zeros_like(selectable).scatter_(-1, offered.argmax(-1, keepdim=True), True) & offered.bool()
        last = torch.zeros_like(selectable).scatter_(-1, (offered.cumsum(-1)).argmax(-1, keepdim=True), True)
        last = last & offered.bool() & ~first
        in_budget = (schedule.post_steps <= self.rounds).unsqueeze(1)
        delete, split = first & in_budget, last & in_budget
        self.asked.append((schedule.masked.any(-1), delete.clone(), split.clone()))
        return Edits(fills, delete, split)


ROUNDS = Parameter("rounds", 2, int, "post steps that delete and split", low=0)


@pytest.fixture
def delete_split(monkeypatch):
    rules: list[DeleteAndSplit] = []

    def build(rounds):
        rules.append(DeleteAndSplit(rounds))
        return rules[-1]

    registration = StrategyRegistration(
        "delete_split", build, parameters=(ROUNDS,), kernels=("revisable",), edits=True, edit_budget="rounds",
    )
    monkeypatch.setitem(get_registry().strategies, "delete_split", Strategy("delete_split", "tests", registration))
    return rules


PROMPTS = tiny.tiny_prompts(6, vocab=16, length=5, seed=1)  # 5 tokens: the first block holds one


def test_the_kernel_deletes_and_splits_in_post_steps_keeping_prompt_and_final_tokens(delete_split):
    model = tiny.tiny_revisable_dllm(0, vocab=16, hidden=32, layers=2, init=0.8)
    decoder = dloom.DiffusionDecoder(model, "delete_split", gen_length=8, block_length=4, temperature=1.0, seed=2)
    steps = []
    result = decoder.generate(PROMPTS, observer=steps.append)
    rule = delete_split[-1]
    assert len(rule.asked) == len(steps)
    mask = model.mask_token_id
    first_seen: dict[tuple[int, int], torch.Tensor] = {}
    last_seen: dict[tuple[int, int], list[int]] = {}
    edited = 0
    for record, (had_mask, delete, split) in zip(steps, rule.asked):
        for i, key in enumerate(zip(record.rows.tolist(), record.block.tolist())):
            before, after = record.before[i], record.after[i]
            generated = first_seen.setdefault(key, before == mask)  # masked at the block's first step
            assert torch.equal(after[~generated], before[~generated])  # prompt positions never move
            if had_mask[i]:  # a fill step: deletes and splits ignored, filled tokens kept
                assert torch.equal(after[before != mask], before[before != mask])
            else:  # a post step: exactly the documented rebuild of the block
                expected = reference_relayout(
                    before.tolist(), delete[i].tolist(), split[i].tolist(), generated.tolist(), mask,
                )
                assert after.tolist() == expected
                edited += int(delete[i].any() or split[i].any())
            last_seen[key] = after.tolist()
    assert edited > 4, "too few deletes and splits: the test is vacuous"
    assert result.sequences[:, :5].tolist() == PROMPTS
    start = 4  # blocks of 4 from position 0: the first block is columns 4..7
    for (row, block), tokens in last_seen.items():  # a settled block is final: as last stepped
        assert result.sequences[row, start + 4 * block : start + 4 * block + 4].tolist() == tokens
        assert mask not in tokens


def test_dloom_check_finds_every_kernel_claim_held_by_a_rule_that_deletes_and_splits(delete_split):
    report = check_kernel_claims(resolve("delete_split"))
    assert report.failed == [], report.claims
    assert "post steps in a block" in report.claims["edit_budget"]["detail"]


class FillsWithEdits:
    """A fill rule (not registered as editing) that answers Edits."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        _, ranks = sorted_profile(confidence, selectable)
        return Edits(selectable & (ranks == 0), torch.zeros_like(selectable), torch.zeros_like(selectable))


class BadlyShapedEdits(DeleteAndSplit):
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        answer = super().dloom_select_commit(confidence, selectable, schedule)
        return answer if not isinstance(answer, Edits) else Edits(answer.commit, answer.delete[:, :1], answer.split)


def test_edits_from_a_fill_rule_are_refused_naming_what_may_answer_them():
    model = tiny.tiny_revisable_dllm(0)
    for adapter in (model, tiny.tiny_dllm(0)):
        decoder = dloom.DiffusionDecoder(adapter, FillsWithEdits(), gen_length=4, block_length=4)
        with pytest.raises(HookContractError, match=r"returned Edits .* only an editing rule .* on the revisable kernel"):
            decoder.generate([[3, 4]])


def test_a_badly_shaped_edits_field_is_named(monkeypatch):
    registration = StrategyRegistration(
        "bad_edits", BadlyShapedEdits, parameters=(ROUNDS,), kernels=("revisable",), edits=True, edit_budget="rounds",
    )
    monkeypatch.setitem(get_registry().strategies, "bad_edits", Strategy("bad_edits", "tests", registration))
    decoder = dloom.DiffusionDecoder(tiny.tiny_revisable_dllm(0), "bad_edits", gen_length=4, block_length=4)
    with pytest.raises(HookContractError, match=r"dloom_select_commit \(Edits.delete\) must return a bool tensor of shape \(1, 4\)"):
        decoder.generate([[3, 4]])
