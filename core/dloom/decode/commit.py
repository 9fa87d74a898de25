"""Vectorised helpers for commit rules (``dloom_select_commit`` implementations).

All work on ``(B, K)`` tensors without Python loops over rows or positions.
"""

from __future__ import annotations

import torch


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
