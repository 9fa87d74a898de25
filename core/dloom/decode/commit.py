"""Vectorised helpers for commit rules (``dloom_select_commit`` implementations).

All work on ``(B, K)`` tensors without Python loops over rows or positions.
"""

from __future__ import annotations

import torch

from dloom.types import BlockSchedule


def sorted_profile(
    confidence: torch.Tensor, selectable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's confidences sorted descending, non-selectable positions last.

    :param confidence: ``(B, K)`` float.
    :param selectable: ``(B, K)`` bool.
    :return: ``sorted_confidence`` ``(B, K)`` float64 (``-inf`` where not selectable) and
        ``ranks`` ``(B, K)`` long, the rank of every position in that order (0 = most
        confident; ties keep position order).
    """
    masked = torch.where(
        selectable, confidence.to(torch.float64), torch.full_like(confidence, -torch.inf, dtype=torch.float64)
    )
    values, order = torch.sort(masked, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return values, ranks


def commit_top(
    ranks: torch.Tensor, selectable: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Commit each row's ``count`` most confident selectable positions (at least one).

    :param ranks: ``(B, K)`` long, from :func:`sorted_profile`.
    :param selectable: ``(B, K)`` bool.
    :param count: ``(B,)`` long, how many to commit per row.
    :return: ``(B, K)`` bool.
    """
    return selectable & (ranks < count.clamp(min=1).unsqueeze(-1))


def offered_fills(selectable: torch.Tensor, schedule: BlockSchedule) -> torch.Tensor:
    """``(B, K)`` bool, the offered positions that are still masked: all of ``selectable`` on
    the absorbing kernel, where only masked positions are offered; on the revisable kernel
    those of them that :attr:`~dloom.types.BlockSchedule.masked` marks (the rest are filled
    positions offered for an edit)."""
    return selectable if schedule.masked is None else selectable & schedule.masked


def threshold_edits(
    confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule, edit_tau: float, max_post_steps: int,
) -> torch.Tensor:
    """LLaDA2.1's token-to-token edits: every offered filled position whose candidate's
    confidence exceeds ``edit_tau``, while the block has taken at most ``max_post_steps``
    post steps (steps begun with no mask in the block). On the absorbing kernel, where no
    filled position is offered, none.

    :param confidence: ``(B, K)`` float.
    :param selectable: ``(B, K)`` bool, what the kernel offers.
    :return: ``(B, K)`` bool, a subset of the offered filled positions.
    """
    if schedule.masked is None or schedule.post_steps is None:
        return torch.zeros_like(selectable)
    in_budget = (schedule.post_steps <= max_post_steps).unsqueeze(1)
    return selectable & ~schedule.masked & (confidence > edit_tau) & in_budget
