"""The length policies: how many draft tokens a round proposes (fail fast, win big; naive)."""

from __future__ import annotations

import torch

from dloom.failfast.settings import FailFastSettings


def proposal_length(
    done: torch.Tensor, first_low: torch.Tensor, cap: torch.Tensor, settings: FailFastSettings
) -> torch.Tensor:
    """The draft length each row's policy stops at, given what is committed so far.

    The ``failfast`` policy's lengths are ``L_j = initial_length + j * n`` (capped at
    ``cap``); it stops at the first ``L_j`` whose first ``L_j`` tokens hold a confidence
    below ``tau`` or that reaches ``cap``. Committed confidences never change, so this closed
    form equals running the checks one by one as tokens get committed.

    :param done: ``(B,)`` long, committed draft tokens in a row (contiguous from the prefix).
    :param first_low: ``(B,)`` long, index of the first committed draft token with confidence
        below ``tau`` (``done`` when there is none).
    :param cap: ``(B,)`` long, the most tokens the row may propose (``>= 1``).
    :return: ``(B,)`` long, ``L_stop``; the row stops drafting once ``done >= L_stop``.
    """
    if settings.policy == "naive":
        return torch.clamp(cap, max=settings.naive_length)
    start, step = settings.initial_length, settings.n
    past_low = torch.div(first_low + 1 - start + step - 1, step, rounding_mode="floor").clamp(min=0)
    at_cap = torch.div(cap - start + step - 1, step, rounding_mode="floor").clamp(min=0)
    return torch.minimum(start + torch.minimum(past_low, at_cap) * step, cap)
