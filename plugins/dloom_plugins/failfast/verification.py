"""Ratio-based verification of a draft against the target (speculative rejection sampling);
sample-and-match verification is the core's :func:`dloom.ar.chains.match_chains`."""

from __future__ import annotations

import torch

from dloom.sdk import ACCEPT_TAG, RESAMPLE_TAG, RowStreams, gumbel_argmax, uniform_noise


def verify_ratio(
    draft: torch.Tensor, draft_len: torch.Tensor, logits: torch.Tensor, draft_probs: torch.Tensor,
    temperature: float, generator: RowStreams | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling: accept ``x_i`` with probability ``min(1, p/q)``.

    Exact only when ``draft_probs[:, i]`` is the distribution ``draft[:, i]`` was sampled
    from given exactly ``draft[:, :i]`` (a left-to-right drafter).

    :param draft: ``(B, K)`` long, draft tokens (entries at ``>= draft_len`` ignored).
    :param draft_len: ``(B,)`` long, ``k <= K`` per row.
    :param logits: ``(B, K + 1, V)``, the target's logits for draft positions ``0 .. K``
        (entry ``i`` given the accepted prefix and ``draft[:, :i]``).
    :param draft_probs: ``(B, K, V)`` float64, the drafter's ``q_i``.
    :param temperature: ``> 0`` (the target's ``p_i = softmax(logits / temperature)``).
    :return: ``accepted`` ``(B,)`` long (draft tokens kept) and ``token`` ``(B,)`` long, the
        target's token at position ``accepted`` (from the residual after a rejection, else
        the bonus).
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
