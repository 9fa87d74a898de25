"""The length policies: how many draft tokens a round proposes (fail fast, win big; naive).
FailFast's ``dloom_prune``."""

from __future__ import annotations

import dataclasses

import torch

from dloom.sdk import DraftChains

from .settings import FailFastSettings


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


def prune_chains(chains: DraftChains, settings: FailFastSettings, budget: int | None) -> DraftChains:
    """The chains with the policy applied: rows whose policy stops now are closed with their
    proposal length; the others stay open (the drafter continues them).

    The policy reads each row's final drafted tokens (``drafted``), their confidences and the
    row's ``limit`` (room, first drafted EOS). With the ``failfast`` policy a round proposes at
    most ``n_max`` tokens; a ``budget`` caps both policies. Committed confidences never
    change, so the length of a row closed earlier is recomputed unchanged.
    """
    drafted = chains.length if chains.drafted is None else chains.drafted
    limit = drafted if chains.limit is None else chains.limit
    cap = torch.clamp(limit, max=settings.n_max) if settings.policy == "failfast" else limit
    if budget is not None:
        cap = torch.clamp(cap, max=budget)
    done = torch.minimum(drafted, cap)
    width = chains.tokens.shape[1]
    position = torch.arange(width, device=done.device)
    low = position.unsqueeze(0) < done.unsqueeze(1)
    if chains.confidence is not None:
        low = low & (chains.confidence < settings.tau)
    else:
        low = torch.zeros_like(low)
    first_low = torch.where(low, position, width).amin(-1) if width else done
    first_low = torch.minimum(first_low, done)
    length = proposal_length(done, first_low, cap, settings)
    stop = done >= length
    return dataclasses.replace(
        chains, length=torch.where(stop, length, torch.minimum(chains.length, cap)),
        open=chains.open & ~stop,
    )
