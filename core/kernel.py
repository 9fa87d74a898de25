"""Pieces of the transition kernel ``K`` (DESIGN.md, "The reference process").

One step on the active block: candidates and confidences from the block's logits
(:func:`propose`), a commit rule picks positions (the ``dloom_select_commit`` hook), and
those positions take their candidates (:func:`apply_commit`).
"""

from __future__ import annotations

import torch

REMASKING = ("low_confidence", "random", "margin", "entropy")


def propose(
    logits: torch.Tensor,
    temperature: float,
    remasking: str,
    generator: torch.Generator | None,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token and confidence for every position of the block.

    The mask token is never a candidate: its logit is set to ``-inf`` first (a trained dLLM
    gives it no mass; an untrained one could otherwise "commit" a mask forever).

    Sampling is Gumbel-max in float64 as in LLaDA: LLaDA's
    ``argmax(exp(l) / (-log u) ** T)`` is computed as the equal
    ``argmax(l - T * log(-log u))``, which does not overflow; with ``T == 0`` the candidate is
    the argmax and no random numbers are drawn. Confidences follow LLaDA and Dream: the
    candidate's probability under ``softmax(logits)`` (``low_confidence``), a uniform draw
    (``random``), the top-1 minus top-2 probability (``margin``) or the negative entropy
    (``entropy``).

    :param logits: ``(B, K, V)`` logits of the active block, any float dtype.
    :param temperature: ``T >= 0``.
    :param remasking: one of :data:`REMASKING`.
    :param generator: random source for the Gumbel noise and ``random`` remasking.
    :param mask_token_id: the mask token's id.
    :return: ``candidates`` ``(B, K)`` long and ``confidence`` ``(B, K)`` float64.
    """
    logits64 = logits.to(torch.float64).clone()
    logits64[..., mask_token_id] = -torch.inf
    if temperature > 0:
        uniform = torch.rand(
            logits64.shape, dtype=torch.float64, generator=generator, device=logits64.device
        )
        candidates = torch.argmax(logits64 - temperature * torch.log(-torch.log(uniform)), dim=-1)
    else:
        candidates = torch.argmax(logits64, dim=-1)
    if remasking == "random":
        confidence = torch.rand(
            candidates.shape, dtype=torch.float64, generator=generator, device=logits64.device
        )
        return candidates, confidence
    probs = torch.softmax(logits64, dim=-1)
    if remasking == "low_confidence":
        confidence = torch.gather(probs, -1, candidates.unsqueeze(-1)).squeeze(-1)
    elif remasking == "margin":
        top2 = torch.topk(probs, k=2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    elif remasking == "entropy":
        confidence = torch.sum(probs * torch.log(probs.clamp_min(1e-300)), dim=-1)
    else:
        raise ValueError(f"remasking is {remasking!r}; allowed: {', '.join(REMASKING)}")
    return candidates, confidence


def apply_commit(
    block: torch.Tensor, candidates: torch.Tensor, commit: torch.Tensor
) -> torch.Tensor:
    """The block after committing: ``commit`` positions take their candidates.

    :param block: ``(B, K)`` long, current tokens of the active block.
    :param candidates: ``(B, K)`` long.
    :param commit: ``(B, K)`` bool.
    :return: ``(B, K)`` long, a new tensor.
    """
    return torch.where(commit, candidates, block)
