"""An editing block that settles hands its last forward to the next block.

Without a cache, a post step that changes nothing ran its forward on exactly the tokens the
next block's first step runs its forward on, so the session takes that first step from the
settling forward's logits at the next block's columns (a primed row,
:mod:`dloom.decode.session`). Checked here against the same decode with the reuse switched
off (the kernel reporting no unchanged post step): same tokens, the same steps as an observer
sees them, the same commit-time log-probabilities, and exactly one forward fewer per block
that settled on an unchanged post step and had a block after it. Broken variants that prime a
row whose last step changed its block are caught.
"""

from __future__ import annotations

import pytest
import torch

import dloom
from conftest import revisable, staggered
from dloom.decode.revisable import RevisableKernel
from dloom.decode.session import DecodeSession, StepRecord
from dloom.model.runner import BlockForward

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
SETTINGS = dict(gen_length=16, block_length=4)

RULES = [
    ("joint_threshold", {"tau": 0.7, "edit_tau": 0.5}),  # LLaDA2.1's quality mode
    ("joint_threshold", {"tau": 0.5, "edit_tau": 0.0}),  # speed mode
    ("frechet_edit", {}),
    ("wino", {"max_post_steps": 2, "tau": 0.05, "remask_tau": 0.1}),
]
#: cases in which no block settles unchanged on this tiny model (every post step edits or
#: the budget runs out): speed mode's sampled edits at edit_tau 0, greedy WINO's rewrites
VACUOUS = [(*RULES[1], 1.0), (*RULES[3], 0.0)]


def no_reuse(monkeypatch) -> None:
    """The reuse off: the kernel reports no unchanged post step, so no plain step primes."""
    monkeypatch.setattr(RevisableKernel, "unchanged_post_steps", lambda self: None)


def decode(adapter, strategy, params, temperature, cache="none", logprobs=None):
    """Every row of :data:`PROMPTS` decoded in one session: ``{row: (tokens, nfe, token
    logprobs)}`` and every row's steps as the observer saw them, in order."""
    decoder = dloom.DiffusionDecoder(
        revisable(adapter), strategy, temperature=temperature, seed=7, cache=cache, **SETTINGS, **params,
    )
    steps: dict[int, list[tuple[int, list[int], list[int], torch.Tensor]]] = {}

    def observe(record: StepRecord) -> None:
        for i, row in enumerate(record.rows.tolist()):
            steps.setdefault(row, []).append(
                (int(record.block[i]), record.before[i].tolist(), record.after[i].tolist(), record.logits[i])
            )

    session = DecodeSession(decoder, observer=observe, logprobs=logprobs)
    session.admit(PROMPTS)
    out = {}
    while session.size:
        done = session.step()
        if done is not None:
            for i, (row, tokens) in enumerate(zip(done.rows.tolist(), done.token_lists())):
                token_logprobs = None if done.logprobs is None else done.logprobs.token[i]
                out[row] = (tokens, int(done.nfe[i]), token_logprobs)
    return out, steps


def reusable_settles(steps: list[tuple[int, list[int], list[int], torch.Tensor]], mask: int) -> int:
    """Blocks of one row's sequential decode whose last step was a post step (no mask before
    it) that changed nothing, and that another block followed."""
    last: dict[int, tuple[list[int], list[int]]] = {}
    for block, before, after, _ in steps:
        last[block] = (before, after)
    return sum(
        1 for block, (before, after) in last.items()
        if block + 1 in last and mask not in before and before == after
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("strategy, params", RULES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_a_settled_blocks_forward_serves_the_next_block(sharp_adapter, monkeypatch, strategy, params, temperature):
    mask = sharp_adapter.mask_token_id
    on, on_steps = decode(sharp_adapter, strategy, params, temperature, logprobs=2)
    no_reuse(monkeypatch)
    off, off_steps = decode(sharp_adapter, strategy, params, temperature, logprobs=2)
    saved = 0
    for row in range(len(PROMPTS)):
        (tokens, nfe, logprobs), (ref_tokens, ref_nfe, ref_logprobs) = on[row], off[row]
        assert tokens == ref_tokens
        assert torch.equal(logprobs.isnan(), ref_logprobs.isnan())
        assert torch.allclose(logprobs.nan_to_num(), ref_logprobs.nan_to_num(), atol=1e-9)
        # the observer sees every step of the sequential decode, the primed ones included
        assert [s[:3] for s in on_steps[row]] == [s[:3] for s in off_steps[row]]
        assert all(torch.allclose(a[3], b[3], atol=1e-9) for a, b in zip(on_steps[row], off_steps[row]))
        reused = reusable_settles(off_steps[row], mask)
        assert nfe == ref_nfe - reused
        saved += reused
    assert saved or (strategy, params, temperature) in VACUOUS, "no block settled on an unchanged post step before another block: the case is vacuous"


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_no_row_is_primed_with_a_cache(sharp_adapter, monkeypatch, cache):
    """With a cache the next step's forward reads a record, not the settling forward's
    tokens: every block pays its own first forward (as without the reuse)."""
    strategy, params = RULES[1]
    on, _ = decode(sharp_adapter, strategy, params, 0.0, cache=cache)
    no_reuse(monkeypatch)
    off, _ = decode(sharp_adapter, strategy, params, 0.0, cache=cache)
    assert {row: value[:2] for row, value in on.items()} == {row: value[:2] for row, value in off.items()}


def test_static_shapes_prime_no_row(sharp_adapter, monkeypatch):
    strategy, params = RULES[1]
    decoder = dloom.DiffusionDecoder(revisable(sharp_adapter), strategy, static_shapes=True, **SETTINGS, **params)
    on = decoder.generate(PROMPTS)
    no_reuse(monkeypatch)
    off = decoder.generate(PROMPTS)
    assert on.token_lists == off.token_lists and torch.equal(on.nfe, off.nfe)


def test_fill_steps_compute_no_next_block_logits(sharp_adapter, monkeypatch):
    """The next block's logits are asked of a forward only on steps where some row's block
    holds no mask; a fill rule on the revisable kernel never asks."""
    asked = []
    run_next = BlockForward.run_next

    def counting(self, *args):
        asked.append(1)
        return run_next(self, *args)

    monkeypatch.setattr(BlockForward, "run_next", counting)
    dloom.DiffusionDecoder(revisable(sharp_adapter), "threshold", tau=0.5, **SETTINGS).generate(PROMPTS)
    assert not asked
    strategy, params = RULES[0]
    result = dloom.DiffusionDecoder(revisable(sharp_adapter), strategy, **SETTINGS, **params).generate(PROMPTS)
    assert 0 < len(asked) < result.forwards


def primes_edited_post_steps(self):
    """Broken: every post step, also one whose edit changed the block (a block whose edit
    budget ran out on an edit settles after it)."""
    return self.post_step if self.edits else None


def active_block_as_next(self, *args):
    """Broken: the active block's logits served as the next block's."""
    logits, _ = self.run(*args)
    return logits, logits


@pytest.mark.parametrize("broken, params", [
    ((RevisableKernel, "unchanged_post_steps", primes_edited_post_steps),
     {"tau": 0.3, "edit_tau": 0.0, "max_post_steps": 2}),
    ((BlockForward, "run_next", active_block_as_next), {"tau": 0.7, "edit_tau": 0.5}),
], ids=["primes-an-edited-block", "wrong-columns"])
def test_a_broken_reuse_is_caught(sharp_adapter, monkeypatch, broken, params):
    reference, _ = decode(sharp_adapter, "joint_threshold", params, 0.0)
    monkeypatch.setattr(*broken)
    got, _ = decode(sharp_adapter, "joint_threshold", params, 0.0)
    assert [got[row][0] for row in range(len(PROMPTS))] != [reference[row][0] for row in range(len(PROMPTS))]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_rows_joining_and_leaving_mid_run_decode_as_they_do_alone(sharp_adapter, temperature):
    """Primed rows of a running batch (their next-block logits kept across the step) stay
    batch-invariant while other rows join (a longer prompt widens every row) and leave."""
    strategy, params = RULES[0]
    decoder = dloom.DiffusionDecoder(
        revisable(sharp_adapter), strategy, temperature=temperature, seed=7, **SETTINGS, **params,
    )
    schedule = {0: [2], 3: [0, 3], 5: [1]}  # step: prompts joining before it
    out, _, _ = staggered(decoder, PROMPTS, schedule, streams=list(range(len(PROMPTS))))
    for prompt, got in out.items():
        alone = decoder.generate([PROMPTS[prompt]], row_offset=prompt)
        assert got == (alone.token_lists[0], int(alone.nfe[0]))
    assert len(out) == len(PROMPTS)
