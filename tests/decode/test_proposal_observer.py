"""The engine's public seams for tools that watch a decode (dloom.decode.oracle uses both):
``DiffusionDecoder(on_proposal=...)`` sees every kernel step's candidates before the commit
rule, and ``DiffusionDecoder.generated_region`` says where each prompt is decoded."""

from __future__ import annotations

import torch

from conftest import MASK_ID, PAD_ID
from dloom import DiffusionDecoder, ModelAdapter

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def test_on_proposal_sees_the_candidates_every_step_commits(sharp_adapter):
    """One call per kernel step, before the commit, with the ``(B, K)`` candidates: each
    token a greedy step commits is the candidate the observer saw at that position (a
    wrong or stale candidate, or a missing call, fails)."""
    seen: list[torch.Tensor] = []
    committed: list[tuple[torch.Tensor, torch.Tensor]] = []
    previous: dict[int, torch.Tensor] = {}

    def observe(record):
        block = int(record.block[0])
        before = previous.get(block, torch.full_like(record.after, MASK_ID))
        committed.append(((before == MASK_ID) & (record.after != MASK_ID), record.after.clone()))
        previous[block] = record.after.clone()

    decoder = DiffusionDecoder(
        sharp_adapter, "threshold", tau=0.5, gen_length=16, block_length=8,
        on_proposal=lambda candidates, confidence: seen.append(candidates.clone()),
    )
    result = decoder.generate([PROMPTS[0]], observer=observe)
    assert len(seen) == len(committed) == result.forwards > 1
    for candidates, (new, after) in zip(seen, committed):
        assert candidates.shape == after.shape and candidates.dtype == torch.long
        assert new.any()
        assert torch.equal(after[new], candidates[new])


def test_on_proposal_does_not_change_the_decode(sharp_adapter):
    plain = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=8, steps=8)
    watched = DiffusionDecoder(
        sharp_adapter, "quota", gen_length=16, block_length=8, steps=8,
        on_proposal=lambda candidates, confidence: None,
    )
    a, b = plain.generate(PROMPTS), watched.generate(PROMPTS)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.nfe, b.nfe)


def test_generated_region_is_where_generate_decodes(sharp_adapter):
    decoder = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=8)
    start, end = decoder.generated_region(PROMPTS)
    result = decoder.generate(PROMPTS)
    assert start.shape == end.shape == (len(PROMPTS),)
    assert ((end - start) == 16).all()
    for row in range(len(PROMPTS)):
        assert torch.equal(result.sequences[row, int(start[row]) : int(end[row])], result.generated[row])


def test_generated_region_follows_absolute_block_alignment(sharp_adapter):
    """Blocks at multiples of ``K`` from each row's position 0: the region starts at the
    prompt's last partial block and ends on a block boundary."""
    adapter = ModelAdapter(
        sharp_adapter.model, mask_token_id=MASK_ID, eos_token_ids=(), pad_token_id=PAD_ID,
        attention="block-causal", block_alignment="absolute", max_context=96, name="absolute",
    )
    decoder = DiffusionDecoder(adapter, "quota", gen_length=8, block_length=4)
    prompts = [[5], [5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    start, end = decoder.generated_region(prompts)
    width = max(len(p) for p in prompts)  # left padding
    lengths = torch.tensor([len(p) for p in prompts])
    assert torch.equal(start, width - lengths % 4)
    assert ((end - start) % 4 == 0).all()
    assert torch.equal(end - width, 8 + (-lengths) % 4)
