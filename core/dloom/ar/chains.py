"""The core's side of speculation against an autoregressive target: sampling the target,
laying token chains out for one target forward, and greedy-match verification.

Lossless verification of a chain ``x_0 .. x_{k-1}`` (``docs/concepts.md``, "Lossless"): the
target's forward over the row's accepted tokens and the chain gives the distributions
``p_0 .. p_k`` of the token after each prefix. Draw ``y_i ~ p_i`` (the argmax at temperature
0) and keep chain tokens while ``y_i == x_i``; the first ``y_i`` that differs, or the bonus
``y_k``, is appended. Every appended token is a sample of the target given the tokens before
it, so the output is distributed as the target's own decoding, whatever proposed the chain.
"""

from __future__ import annotations

import torch

from dloom.decode.kernel import RowStreams, gumbel_argmax
from dloom.types import ChainLayout, ChainState, ChainVerdict, DraftChains

GUMBEL_TAG, ACCEPT_TAG, RESAMPLE_TAG = 2, 3, 4
"""Tags of the arrays one verification draws from a row's stream (a drafter's kernel steps
use 0 and 1, :func:`dloom.decode.kernel.propose`)."""


class TargetKernel:
    """The target's own decoding step, which a chain verifier samples with (the ``kernel``
    argument of ``dloom_verify`` for a :class:`~dloom.types.ChainState`).

    ``kernel(logits)`` maps ``(B, T, V)`` target logits to ``(B, T)`` tokens: the argmax at
    ``temperature == 0``, else a float64 Gumbel-max sample of ``softmax(logits /
    temperature)`` drawn from each row's stream. The decoder advances the streams of the
    active rows once after every verification.

    :ivar temperature: the target's sampling temperature.
    :ivar streams: the rows' :class:`~dloom.decode.kernel.RowStreams` (``None`` at temperature 0),
        for a verifier that draws more (the ratio test: :data:`ACCEPT_TAG`,
        :data:`RESAMPLE_TAG`).
    """

    def __init__(self, temperature: float, streams: RowStreams | None) -> None:
        self.temperature = temperature
        self.streams = streams

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:  # widening to float64 changes no order: the argmax as it is
            return torch.argmax(logits, dim=-1)
        return gumbel_argmax(logits.to(torch.float64) / self.temperature, self.streams, GUMBEL_TAG)


def uncached_tokens(state: ChainState) -> torch.Tensor:
    """``(B,)`` long, accepted tokens (prompt included) of each active row past the target's
    cached columns (at least 1: the last accepted token); 0 for finished rows."""
    return torch.where(state.active, state.prompt_length + state.lengths - state.cached, 0)


def chain_layout(state: ChainState, chains: DraftChains) -> ChainLayout:
    """Each active row's uncached accepted tokens, then its chain's ``length`` tokens, right-
    padded to ``chains.span`` columns (finished rows feed nothing)."""
    cached = state.cached
    uncached = uncached_tokens(state)
    fed = uncached + torch.where(state.active, chains.length, 0)
    width = chains.span if chains.span is not None else int(fed.max())
    slot = torch.arange(width, device=fed.device).unsqueeze(0)
    accepted_column = (cached + slot).clamp(max=state.tokens.shape[1] - 1).expand(fed.shape[0], -1)
    accepted = torch.gather(state.tokens, 1, accepted_column)
    draft_index = (slot - uncached.unsqueeze(1)).clamp(0, chains.tokens.shape[1] - 1)
    drafted = torch.gather(chains.tokens, 1, draft_index)
    slot_mask = slot < fed.unsqueeze(1)
    ids = torch.where(slot < uncached.unsqueeze(1), accepted, drafted)
    pad = state.tokens.new_zeros(())
    return ChainLayout(
        input_ids=torch.where(slot_mask, ids, pad), slot_mask=slot_mask.long(),
        first_output=(uncached - 1).clamp(min=0),
    )


def chain_logits(outputs: torch.Tensor, layout: ChainLayout, longest: int) -> torch.Tensor:
    """``(B, longest + 1, V)``: entry ``i`` is the target's distribution of each row's
    ``i``-th chain token (given its accepted tokens and chain tokens ``< i``), read from the
    forward's ``(B, S, V)`` outputs; entries past a row's chain are meaningless."""
    rows = layout.first_output.unsqueeze(1) + torch.arange(longest + 1, device=outputs.device)
    rows = rows.clamp(max=outputs.shape[1] - 1).unsqueeze(-1).expand(-1, -1, outputs.shape[-1])
    return outputs.gather(1, rows)


def match_chains(chains: DraftChains, logits: torch.Tensor, kernel: TargetKernel) -> ChainVerdict:
    """Sample-and-match verification: lossless for any drafter (the module docstring).

    :param logits: ``(B, T' + 1, V)`` from :func:`chain_logits` (``T' >= chains.length``).
    """
    samples = kernel(logits)
    width = logits.shape[1] - 1
    draft = chains.tokens[:, :width]
    if draft.shape[1] < width:  # a chain tensor narrower than the longest chain is padded
        draft = torch.nn.functional.pad(draft, (0, width - draft.shape[1]))
    valid = torch.arange(width, device=draft.device) < chains.length.unsqueeze(1)
    accepted = ((samples[:, :width] == draft) & valid).long().cumprod(-1).sum(-1)
    return ChainVerdict(accepted=accepted, token=samples.gather(1, accepted.unsqueeze(1)).squeeze(1))
