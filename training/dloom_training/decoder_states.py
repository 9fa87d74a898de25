"""The states a decoder reaches inside a block, built for training rows without gradient:
a confidence-order decoder's (:func:`least_confident`), dloom's threshold decoder's
(:func:`threshold_rollout`), and the targets of rows that hold the model's own commits
(:func:`own_commits`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import LlamaForCausalLM

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import Example

from .codec import CHARACTERS, Codec
from .rows import answer_lengths, answer_region, position_ids, region_logits
from .workloads import CHECKABLE

__all__ = ["DECODER_FILLS", "least_confident", "own_commits", "threshold_rollout"]


def least_confident(
    model: LlamaForCausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    target: torch.Tensor,
    block: torch.Tensor,
    revealed: torch.Tensor,
    rounds: int = 1,
    hold_guesses: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks of a confidence-order decoder's state inside one block, for ``R`` rows.

    :param prompt_ids: ``(R, P)`` long, left-padded prompts; ``prompt_mask`` their ``(R, P)``
        key padding.
    :param target: ``(R, G)`` long, the answer regions.
    :param block: ``(R, G)`` bool, each row's drawn block (one run of positions).
    :param revealed: ``(R, 1)`` long, how many of the block's positions to reveal, below the
        block's length (so at least one stays masked).
    :param rounds: the reveals are spread over this many forwards (at most ``revealed``
        forwards a row): each forward reveals the next share of a row's ``revealed`` positions,
        those the model is surest of in the state the earlier rounds left.  ``1``: all of them
        from the block fully masked; ``rounds`` at least the block's length: one a forward, the
        state a one-token-per-step decoder reaches.
    :param hold_guesses: what a revealed position holds for the later rounds: the model's argmax
        there (``True``: the decoder's own commits) or the answer's token.
    :return: ``(R, G)`` bool, the block's positions other than the ``revealed`` ones the model
        was surest of (largest max-probability over the tokens a decoder may commit) when they
        were revealed (the region from the block on masked but for the earlier rounds' reveals),
        and ``(R, G)`` long, the model's argmax (over those tokens) at each revealed position,
        from the round that revealed it (the first forward's elsewhere); reads the model without
        gradient.
    """
    ahead = block.int().cummax(-1).values.bool()  # the block and every position after it
    state = torch.where(ahead, torch.full_like(target, tok.MASK_ID), target)
    shown = torch.zeros_like(block)
    guess = torch.zeros_like(target)
    for r in range(rounds):
        goal = (revealed[:, 0] * (r + 1) + rounds - 1) // rounds  # reveals due by the end of round r
        need = goal - shown.sum(-1)
        rows = (need > 0).nonzero()[:, 0] if r else torch.arange(len(target))
        if not len(rows):
            continue
        attention_mask = torch.cat([prompt_mask[rows], torch.ones_like(state[rows])], dim=1)
        with torch.no_grad():
            output = model(input_ids=torch.cat([prompt_ids[rows], state[rows]], dim=1),
                           attention_mask=attention_mask, position_ids=position_ids(attention_mask))
            logits = region_logits(model, output.logits, prompt_ids.shape[1])
            logits[..., [tok.PAD_ID, tok.MASK_ID]] = -math.inf
            probability, argmax = logits.softmax(-1).max(-1)
        confidence = torch.where(block[rows] & ~shown[rows], probability, -math.inf)
        rank = confidence.argsort(-1, descending=True).argsort(-1)  # 0: the surest open position
        new = block[rows] & ~shown[rows] & (rank < need[rows, None])
        guess[rows] = torch.where(new | (r == 0), argmax, guess[rows])
        shown[rows] |= new
        state[rows] = torch.where(new, argmax if hold_guesses else target[rows], state[rows])
    return block & ~shown, guess


DECODER_FILLS = ("answer", "model", "threshold")
"""What a decoder row's revealed positions hold (:func:`dllm_loss`'s ``decoder_fill``)."""


def threshold_rollout(
    model: LlamaForCausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    target: torch.Tensor,
    current: torch.Tensor,
    block_length: int,
    forwards: torch.Tensor,
    tau: torch.Tensor,
    own_earlier: torch.Tensor,
) -> torch.Tensor:
    """The states dloom's threshold decoder reaches in ``R`` rows' drawn blocks, without gradient.

    The rule is Fast-dLLM's, as ``dloom.DiffusionDecoder(model, "threshold", tau=τ)`` applies
    it: each forward reads the region, and in the leftmost block with masks commits every
    masked position whose confidence (the argmax's probability, the mask token excluded)
    exceeds ``τ`` -- at least the surest one -- to its argmax, right or wrong.  Only the rows
    still decoding are run, all of them in one batched forward.

    :param prompt_ids: ``(R, P)`` long, left-padded prompts; ``prompt_mask`` their key padding.
    :param target: ``(R, G)`` long, the answer regions.
    :param current: ``(R,)`` long, each row's drawn block.
    :param block_length: the blocks' length ``K`` (``G`` a multiple of it).
    :param forwards: ``(R,)`` long, the forwards each row spends in its drawn block.
    :param tau: ``(R,)`` float, each row's threshold.
    :param own_earlier: ``(R,)`` bool: the row's earlier blocks are decoded by the same rule from
        the region's start (the forwards that takes are not counted in ``forwards``); else
        they hold the answer.
    :return: ``(R, G)`` long, the region after those forwards (the mask token where nothing is
        committed; every block after the drawn one masked).  A forward that would commit the
        drawn block's last masks is not applied: that row stops one forward early, so the drawn
        block keeps at least one masked position to score.
    """
    g = target.shape[1]
    block_of = torch.arange(g, device=target.device) // block_length
    ahead = (block_of[None, :] >= current[:, None]) | own_earlier[:, None]
    state = torch.where(ahead, torch.full_like(target, tok.MASK_ID), target)
    spent = torch.zeros_like(forwards)
    active = (forwards > 0) | (own_earlier & (current > 0))
    p = prompt_ids.shape[1]
    while bool(active.any()):
        rows = active.nonzero()[:, 0]
        region = state[rows]
        attention_mask = torch.cat([prompt_mask[rows], torch.ones_like(region)], dim=1)
        with torch.no_grad():
            output = model(input_ids=torch.cat([prompt_ids[rows], region], dim=1), attention_mask=attention_mask,
                           position_ids=position_ids(attention_mask))
            logits = region_logits(model, output.logits, p).float()
        logits[..., tok.MASK_ID] = -math.inf
        probability, candidate = logits.softmax(-1).max(-1)
        open_positions = region == tok.MASK_ID
        open_block = block_of[open_positions.int().argmax(-1)]  # the leftmost block with masks
        selectable = open_positions & (block_of[None, :] == open_block[:, None])
        confidence = torch.where(selectable, probability, -math.inf)
        commit = selectable & (confidence > tau[rows, None])
        commit[torch.arange(len(rows)), confidence.argmax(-1)] = True
        in_drawn = open_block == current[rows]
        apply = ~(in_drawn & (commit.sum(-1) == selectable.sum(-1)))
        state[rows] = torch.where(commit & apply[:, None], candidate, region)
        spent[rows] += (in_drawn & apply).long()
        before = block_of[(state[rows] == tok.MASK_ID).int().argmax(-1)] < current[rows]
        active[rows] = apply & (before | (spent[rows] < forwards[rows]))
    return state


def own_commits(
    examples: Sequence[Example],
    target: torch.Tensor,
    revealed: torch.Tensor,
    guess: torch.Tensor,
    settled: torch.Tensor,
    lengths: torch.Tensor,
    gen: torch.Generator,
    codec: Codec = CHARACTERS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The targets of ``R`` decoder rows whose revealed positions hold the model's guesses.

    :param examples: the rows' examples.
    :param target: ``(R, G)`` long, their answer regions; ``lengths`` ``(R,)`` their answers' lengths.
    :param revealed: ``(R, G)`` bool, the drawn block's positions the state reveals.
    :param guess: ``(R, G)`` long, the model's argmax at every position.
    :param settled: ``(R, G)`` bool, the positions before the drawn block (the answer's, clean).
    :return: ``(R, G)`` targets, ``(R,)`` lengths and ``(R, G)`` bool mistakes.  A row whose
        family lists its right answers (``TaskFamily.answers``) gets, among those that agree
        with its answer at ``settled``, one that agrees with ``guess`` at the most ``revealed``
        positions, drawn uniformly; any other row keeps its answer.  The mistakes are the
        ``revealed`` positions where ``guess`` differs from the new target: a decoder would
        commit them first, so :func:`dllm_loss` leaves them masked and scores them, and the
        state holds the guesses at the other revealed positions.
    """
    target, lengths = target.clone(), lengths.clone()
    for i, example in enumerate(examples):
        family = CHECKABLE.get(example.family)
        answers = None if family is None else family.answers(example.prompt)
        if not answers:
            continue
        regions = answer_region(answers, target.shape[1], codec)
        agreeing = torch.where(revealed[i], regions == guess[i], False).sum(-1)
        agreeing[~torch.where(settled[i], regions == target[i], True).all(-1)] = -1  # the answer holds them
        best = (agreeing == agreeing.max()).nonzero()[:, 0]
        chosen = int(best[torch.randint(len(best), (1,), generator=gen)])
        target[i], lengths[i] = regions[chosen], answer_lengths(regions[chosen : chosen + 1])[0]
    return target, lengths, revealed & (guess != target)
