"""The frame drafts are written in: positions ranked by confidence, tokens by probability.

Both calibration and drafting express a state as ``(i, j)`` pairs relative to a root block
and one distribution over it (the root's predecessor's): position rank ``i`` orders the
root's masked positions by the probability of their most likely token (ties by position),
vocabulary rank ``j`` orders a position's tokens by probability (the mask token excluded).
Using one frame in both places makes the calibrated graph the graph the run-time fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dloom.sdk import propose, without_mask


@dataclass(frozen=True)
class Frame:
    """Ranks of one distribution over a block (``B`` rows, ``K`` positions, ``J`` ranks).

    :ivar position_by_rank: ``(B, K)`` long, the position of each confidence rank (masked
        positions first).
    :ivar rank_of_position: ``(B, K)`` long, the inverse permutation.
    :ivar masked: ``(B,)`` long, masked positions per row (ranks ``>=`` this are not masked).
    :ivar tokens: ``(B, K, J)`` long, each position's ``J`` most likely tokens.
    :ivar probs: ``(B, K, J)`` float64, their probabilities.
    """

    position_by_rank: torch.Tensor
    rank_of_position: torch.Tensor
    masked: torch.Tensor
    tokens: torch.Tensor
    probs: torch.Tensor


def rank_frame(
    logits: torch.Tensor, block: torch.Tensor, mask_token_id: int, token_ranks: int
) -> Frame:
    """Rank the masked positions of ``block`` and their tokens under ``logits``.

    :param logits: ``(B, K, V)`` the distribution the drafts are filled from.
    :param block: ``(B, K)`` long, the root block.
    :param token_ranks: ``J``, how many tokens per position to rank.
    """
    probs = torch.softmax(without_mask(logits, mask_token_id), dim=-1)
    top_probs, top_tokens = torch.topk(probs, k=min(token_ranks, probs.shape[-1] - 1), dim=-1)
    is_masked = block == mask_token_id
    # Positions are ranked by the kernel's own greedy confidence, in the kernel's precision:
    # float32 logits saturate near-certain positions to equal confidences, which the commit
    # rules order by position, and so must the drafts.
    _, kernel_confidence = propose(logits, 0.0, "low_confidence", None, mask_token_id)
    kernel_confidence = kernel_confidence.to(torch.float64)
    confidence = torch.where(is_masked, kernel_confidence, torch.full_like(kernel_confidence, -1.0))
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    inverse = torch.empty_like(order)
    inverse.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return Frame(order, inverse, is_masked.sum(-1), top_tokens, top_probs)
