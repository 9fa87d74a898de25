"""Verifying a draft against the target: sampling the target, ``match`` and ``ratio``."""

from __future__ import annotations

import torch

from dloom.kernel import RowStreams, uniform_noise

# Tags of the arrays one verification draws from a row's stream (the drafter's kernel steps
# use 0 and 1, :func:`dloom.kernel.propose`).
GUMBEL_TAG, ACCEPT_TAG, RESAMPLE_TAG = 2, 3, 4


def gumbel_argmax(
    scores: torch.Tensor, generator: torch.Generator | RowStreams | None, tag: int = GUMBEL_TAG
) -> torch.Tensor:
    """A sample of ``softmax(scores)`` per row by Gumbel-max in float64.

    :param scores: ``(B, ..., V)`` float64 log-weights (``-inf`` = impossible).
    :param generator: a :class:`~dloom.kernel.RowStreams` (row ``b`` from its prompt's
        stream), a ``torch.Generator`` or ``None``.
    :return: ``(B, ...)`` long.
    """
    uniform = uniform_noise(generator, scores.shape, tag, scores.device)
    return torch.argmax(scores - torch.log(-torch.log(uniform)), dim=-1)


def sample_target(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token: argmax at ``temperature == 0``, else a sample of
    ``softmax(logits / temperature)`` (float64 Gumbel-max).

    :param logits: ``(B, K, V)``. :return: ``(B, K)`` long.
    """
    logits64 = logits.to(torch.float64)
    if temperature == 0:
        return torch.argmax(logits64, dim=-1)
    return gumbel_argmax(logits64 / temperature, generator)


def verify_match(
    draft: torch.Tensor, draft_len: torch.Tensor, logits: torch.Tensor, temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample-and-match verification (exact for any drafter).

    :param draft: ``(B, K)`` long, draft tokens (entries at ``>= draft_len`` ignored).
    :param draft_len: ``(B,)`` long, ``k <= K`` per row.
    :param logits: ``(B, K + 1, V)``, the target's logits for draft positions ``0 .. K``
        (entry ``i`` given the accepted prefix and ``draft[:, :i]``).
    :return: ``accepted`` ``(B,)`` long (draft tokens kept) and ``token`` ``(B,)`` long, the
        target's token at position ``accepted`` (correction or bonus).
    """
    width = draft.shape[1]
    samples = sample_target(logits, temperature, generator)
    valid = torch.arange(width, device=draft.device) < draft_len.unsqueeze(1)
    agree = (samples[:, :width] == draft) & valid
    accepted = agree.long().cumprod(-1).sum(-1)
    return accepted, samples.gather(1, accepted.unsqueeze(1)).squeeze(1)


def verify_ratio(
    draft: torch.Tensor, draft_len: torch.Tensor, logits: torch.Tensor, draft_probs: torch.Tensor,
    temperature: float, generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling: accept ``x_i`` with probability ``min(1, p/q)``.

    Exact only when ``draft_probs[:, i]`` is the distribution ``draft[:, i]`` was sampled
    from given exactly ``draft[:, :i]`` (a left-to-right drafter).

    :param draft_probs: ``(B, K, V)`` float64, the drafter's ``q_i``.
    :param temperature: ``> 0`` (the target's ``p_i = softmax(logits / temperature)``).
    :return: as :func:`verify_match`.
    """
    width = draft.shape[1]
    p = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
    index = draft.unsqueeze(-1)
    p_x = p[:, :width].gather(-1, index).squeeze(-1)
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    uniform = uniform_noise(generator, draft.shape, ACCEPT_TAG, draft.device)
    valid = torch.arange(width, device=draft.device) < draft_len.unsqueeze(1)
    accepted = ((uniform * q_x < p_x) & valid).long().cumprod(-1).sum(-1)
    at = accepted.view(-1, 1, 1).expand(-1, 1, p.shape[-1])
    p_at = p.gather(1, at).squeeze(1)
    padded_q = torch.cat([draft_probs, torch.zeros_like(p[:, :1])], dim=1)
    residual = torch.clamp(p_at - padded_q.gather(1, at).squeeze(1), min=0.0)
    rejected = (accepted < draft_len).unsqueeze(1) & (residual.sum(-1, keepdim=True) > 0)
    final = torch.where(rejected, residual, p_at)
    return accepted, gumbel_argmax(torch.log(final), generator, RESAMPLE_TAG)
