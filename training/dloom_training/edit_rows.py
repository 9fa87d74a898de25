"""Token-to-token (T2T) editing rows, LLaDA2.1's recipe: some filled answer positions of a
row's drawn block hold a wrong token, which the model sees (not a mask) and learns to
restore, while the block's right tokens are scored to stay and its masks to be filled.

Two sources of wrong tokens: the model's own low-threshold drafts (:func:`draft_edits`: the
block decoded by dloom's threshold rule at a low ``τ``, its wrong commits shown) and uniform
noise (:func:`noise_edits`: random filled positions replaced by a uniformly drawn other
token).  Only answer-region positions are ever replaced; the prompt is never an input here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import LlamaForCausalLM

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import Example

from .codec import Codec
from .decoder_states import own_commits, threshold_rollout
from .rows import position_ids, region_logits

__all__ = ["EDIT_RATE", "EDIT_TAUS", "Edits", "draft_edits", "noise_edits", "threshold_draft", "wrong_tokens"]

EDIT_TAUS = (0.3, 0.5, 0.7)
"""The low thresholds a draft edit row decodes its block at by default (``--edit-tau``)."""
EDIT_RATE = 0.3
"""The largest share of a noise edit row's filled block positions replaced by default (``--edit-rate``)."""


class Edits(NamedTuple):
    """``R`` edit rows over a ``G``-position region."""

    shown: torch.Tensor
    """``(R, G)`` long: what the region shows the model where it is not masked (wrong tokens at
    ``corrupted``)."""
    masked: torch.Tensor
    """``(R, G)`` bool: the drawn block's positions that hold the mask token."""
    target: torch.Tensor
    """``(R, G)`` long: the labels, the right token at every position (at ``corrupted``, the
    token the wrong one replaced)."""
    lengths: torch.Tensor
    """``(R,)`` long: the target answers' lengths."""
    corrupted: torch.Tensor
    """``(R, G)`` bool: the drawn block's positions that hold a wrong token."""


def wrong_tokens(right: torch.Tensor, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """A token other than ``right`` at every position, uniform over the vocabulary's tokens but
    ``<pad>`` and ``<mask>`` (any shape; ``right`` holds no ``<pad>``/``<mask>``)."""
    allowed = torch.tensor([i for i in range(vocab_size) if i not in (tok.PAD_ID, tok.MASK_ID)])
    drawn = allowed[torch.randint(len(allowed) - 1, right.shape, generator=gen)]
    return torch.where(drawn == right, allowed[-1], drawn)  # the last allowed stands in for ``right``


def noise_edits(
    target: torch.Tensor, masked: torch.Tensor, block: torch.Tensor, lengths: torch.Tensor, rate: float,
    vocab_size: int, gen: torch.Generator,
) -> Edits:
    """Uniform-noise edit rows: each filled position of a row's drawn block is replaced with
    probability ``r`` (``r`` uniform over ``(0, rate]`` per row) by :func:`wrong_tokens`, at
    least one a row (a row whose block is all masks has one of them filled and replaced).

    :param target: ``(R, G)`` long, the answer regions (what the filled positions hold).
    :param masked: ``(R, G)`` bool, the drawn block's masked positions.
    :param block: ``(R, G)`` bool, each row's drawn block.
    :param lengths: ``(R,)`` long, the answers' lengths (unchanged: the labels are the answer).
    """
    r = len(target)
    masked = masked.clone()
    empty = ~(block & ~masked).any(-1)  # nothing filled to replace: fill one masked position
    pick = torch.where(block & masked, torch.rand(masked.shape, generator=gen), -1.0).argmax(-1)
    masked[empty.nonzero()[:, 0], pick[empty]] = False
    filled = block & ~masked
    ratio = rate * (1 - torch.rand(r, 1, generator=gen))  # in (0, rate]
    corrupted = filled & (torch.rand(masked.shape, generator=gen) < ratio)
    none = ~corrupted.any(-1)
    first = torch.where(filled, torch.rand(masked.shape, generator=gen), -1.0).argmax(-1)
    corrupted[none.nonzero()[:, 0], first[none]] = True
    shown = torch.where(corrupted, wrong_tokens(target, vocab_size, gen), target)
    return Edits(shown, masked, target, lengths, corrupted)


def draft_edits(
    model: LlamaForCausalLM, examples: Sequence[Example], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    target: torch.Tensor, masked: torch.Tensor, current: torch.Tensor, block_length: int, lengths: torch.Tensor,
    tau: torch.Tensor, gen: torch.Generator, codec: Codec,
) -> Edits:
    """Draft edit rows: each row's drawn block drafted by the model at the low threshold ``tau``
    (:func:`threshold_draft`), shown where the row is not ``masked``.  The draft's wrong tokens
    there are the corrupted positions, labelled with the right answer closest to the draft
    (:func:`~dloom_training.decoder_states.own_commits`; the row's answer for families that list
    none), so the model learns to restore its own plausible mistakes.  A row whose shown draft
    is right everywhere has its right tokens scored to stay.

    :param prompt_ids: ``(R, P)`` long, left-padded prompts; ``prompt_mask`` their key padding.
    :param target: ``(R, G)`` long, the answer regions; ``lengths`` ``(R,)`` their lengths.
    :param masked: ``(R, G)`` bool, the drawn block's positions that stay masked.
    :param current: ``(R,)`` long, each row's drawn block.
    :param tau: ``(R,)`` float, each row's draft threshold.
    """
    g = target.shape[1]
    block_of = torch.arange(g) // block_length
    draft = threshold_draft(model, prompt_ids, prompt_mask, target, current, block_length, tau)
    block = block_of[None, :] == current[:, None]
    filled = block & ~masked
    settled = block_of[None, :] < current[:, None]
    target, lengths, corrupted = own_commits(examples, target, filled, draft, settled, lengths, gen, codec)
    shown = torch.where(filled, draft, target)
    return Edits(shown, masked, target, lengths, corrupted)


def threshold_draft(
    model: LlamaForCausalLM, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, target: torch.Tensor,
    current: torch.Tensor, block_length: int, tau: torch.Tensor,
) -> torch.Tensor:
    """The drawn block of ``R`` rows decoded whole by dloom's threshold rule at ``tau``, without
    gradient: the earlier blocks hold the answer, the later ones masks; each forward commits the
    block's masked positions surer than ``τ`` (at least the surest) to their argmax, until none
    is left (:func:`~dloom_training.decoder_states.threshold_rollout`, then the forward that
    commits the rest).

    :param target: ``(R, G)`` long, the answer regions; ``current`` ``(R,)`` each row's block.
    :return: ``(R, G)`` long, the region with the drafted block (masks after it).
    """
    r, g = target.shape
    block = (torch.arange(g) // block_length)[None, :] == current[:, None]
    state = threshold_rollout(model, prompt_ids, prompt_mask, target, current, block_length,
                              torch.full((r,), block_length, dtype=torch.long), tau, torch.zeros(r, dtype=torch.bool))
    attention_mask = torch.cat([prompt_mask, torch.ones_like(state)], dim=1)
    with torch.no_grad():  # the rollout stops before the forward that would commit the block's last masks
        output = model(input_ids=torch.cat([prompt_ids, state], dim=1), attention_mask=attention_mask,
                       position_ids=position_ids(attention_mask))
        logits = region_logits(model, output.logits, prompt_ids.shape[1]).float()
    logits[..., tok.MASK_ID] = -math.inf
    return torch.where(block & (state == tok.MASK_ID), logits.argmax(-1), state)
