"""The oracle NFE: the fewest forwards any commit rule could need to produce the greedy output.

The oracle decodes with the engine itself (its layout, blocks, block alignment, per-row
progression, EOS handling) under a commit rule that knows the answer: at every forward it
commits each masked position of the active block whose candidate (the argmax) already equals
the token the reference decode ends with there, and, where none does, the most confident
position (every commit rule commits at least one). The reference commits one token per step,
the most confident (:class:`OneTokenPerStep`: LLaDA's quota rule with ``steps ==
gen_length``), greedy, without a cache: the process every lossless strategy reproduces.

The commit hook sees confidences, not candidates, so the oracle also observes every kernel
step's proposal (the decoder's ``on_proposal`` observer, called just before the commit rule)
and keeps its candidates; the engine decodes exactly as it does for any commit rule. Each
prompt is decoded alone (a batch of one), which is how the engine decodes every row of a batch
anyway, so the oracle knows its row and block; its targets are laid out by
:meth:`DiffusionDecoder.generated_region`.

Guarantee, checked: the oracle's output (its tokens up to the first EOS) equals the
reference's, token for token (:class:`OracleMismatchError` otherwise). The one exception is a
dead end: a state where no candidate of the block is its final token, so that no commit rule
passing through it can reach the greedy output. The greedy oracle can walk into one (an
untrained model does, a trained one rarely); such a prompt is reported as not reached, and its
forward count is not a bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dloom.decode.commit import commit_top, sorted_profile
from dloom.decode.decoder import DiffusionDecoder
from dloom.decode.generation import Prompts
from dloom.decode.kernel import selectable_positions
from dloom.decode.prompts import check_prompts
from dloom.decode.session import StepRecord
from dloom.errors import ConfigurationError, OracleMismatchError
from dloom.hooks.specs import hookimpl
from dloom.types import BlockSchedule


class OneTokenPerStep:
    """The reference's commit rule: each step commits the most confident selectable position
    (ties: the leftmost), the quota rule's commits when the step budget is one step per
    position (the core's own, so the oracle needs no plugin)."""

    @hookimpl
    def dloom_select_commit(
        self, confidence: torch.Tensor, selectable: torch.Tensor, schedule: BlockSchedule
    ) -> torch.Tensor:
        """``(B, K)`` bool: one position per row, the highest of ``confidence`` ``(B, K)``
        among ``selectable`` ``(B, K)``."""
        _, ranks = sorted_profile(confidence, selectable)
        return commit_top(ranks, selectable, torch.ones_like(ranks[:, 0]))



@dataclass(frozen=True)
class OracleResult:
    """Per-prompt oracle figures (``N`` prompts).

    :ivar nfe: ``(N,)`` long, the oracle's forwards per prompt (a bound where ``reached``).
    :ivar reached: ``(N,)`` bool, the oracle reproduced the reference (it met no dead end).
    :ivar reference_nfe: ``(N,)`` long, the reference's (quota, one token per step).
    :ivar generated: ``(N, G)`` long, the oracle's generated region (where ``reached``, its
        tokens up to the first EOS are the reference's; positions after it may stay masked).
    :ivar generated_lengths: ``(N,)`` long, answer tokens before the first EOS.
    """

    nfe: torch.Tensor
    reached: torch.Tensor
    reference_nfe: torch.Tensor
    generated: torch.Tensor
    generated_lengths: torch.Tensor


class OracleCommit:
    """A commit rule that knows one row's final tokens.

    :param targets: ``(J, K)`` long, the reference's tokens of the row's blocks, block ``j``
        as the engine lays it out (:meth:`DiffusionDecoder.generated_region`).
    :param mask_token_id: / :param eos_ids: ``(E,)`` long, the model's.
    :param generated: ``(J, K)`` bool, the generated positions of those blocks (``None``: all).
        With blocks aligned at position 0 the first block starts with the prompt's last
        partial block, whose EOS ids (a chat template's end-of-turn) do not end the row.

    :ivar candidates: ``(1, K)`` long, the current step's candidates (:meth:`see_proposal`).
    """

    def __init__(
        self, targets: torch.Tensor, mask_token_id: int, eos_ids: torch.Tensor,
        generated: torch.Tensor | None = None,
    ):
        self.targets = targets
        self.generated = torch.ones_like(targets, dtype=torch.bool) if generated is None else generated
        self.mask_token_id, self.eos_ids = mask_token_id, eos_ids
        self.block = torch.zeros((), dtype=torch.long, device=targets.device)
        self.dead_end = torch.zeros((), dtype=torch.bool, device=targets.device)
        self.candidates: torch.Tensor | None = None

    def see_proposal(self, candidates: torch.Tensor, confidence: torch.Tensor) -> None:
        """The decoder's ``on_proposal`` observer: keep the step's ``(1, K)`` candidates."""
        self.candidates = candidates

    def observe(self, record: StepRecord) -> None:
        """The engine's observer: after a step that completes the block, the next step is on
        the next block (a finished row takes no further step). Stays on the device."""
        generated = self.generated[record.block]
        done = ~selectable_positions(record.after, self.mask_token_id, self.eos_ids, generated).any()
        self.block = record.block[0] + done.long()

    def matches(self, selectable: torch.Tensor) -> torch.Tensor:
        """``(1, K)`` bool, the selectable positions whose candidate is the final token."""
        return selectable & (self.candidates == self.targets[self.block].unsqueeze(0))

    @hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        match = self.matches(selectable)
        _, ranks = sorted_profile(confidence, selectable)
        one = torch.ones(selectable.shape[0], dtype=torch.long, device=selectable.device)
        top = commit_top(ranks, selectable, one)
        found = match.any(-1, keepdim=True)
        self.dead_end = self.dead_end | (selectable.any(-1, keepdim=True) & ~found).any()
        return torch.where(found, match, top)


def check_decoder(decoder: Any) -> None:
    """Raise :class:`ConfigurationError` unless ``decoder`` has a greedy output for the oracle
    to reach: a :class:`DiffusionDecoder` with ``temperature=0`` and ``low_confidence``."""
    if not isinstance(decoder, DiffusionDecoder):
        raise ConfigurationError(
            f"the oracle needs a dloom.DiffusionDecoder, got {type(decoder).__name__} "
            "(FailFast's target forwards have no commit rule to bound)"
        )
    if decoder.temperature != 0 or decoder.remasking != "low_confidence":
        raise ConfigurationError(
            f"the oracle reproduces a greedy decode: temperature={decoder.temperature}, "
            f"remasking={decoder.remasking!r}; allowed: temperature=0, remasking='low_confidence'"
        )


def oracle_nfe(decoder: DiffusionDecoder, prompts: Prompts, oracle=OracleCommit) -> OracleResult:
    """The oracle's forwards per prompt under ``decoder``'s model, lengths and layout.

    :param decoder: gives the model, ``gen_length`` and ``block_length``; its strategy,
        steps, cache and sampling settings are not used (the oracle is greedy and uncached).
    :param prompts: texts or token-id lists (one row each).
    :param oracle: the commit rule class (tests pass deliberately broken ones).
    :return: an :class:`OracleResult`.
    :raises ConfigurationError: for a decoder that samples (no greedy output to reach) or
        is not a :class:`DiffusionDecoder`.
    :raises OracleMismatchError: when the oracle's output differs from the reference's
        without a dead end (it committed a token that is not final).
    """
    check_decoder(decoder)
    model = decoder.model
    prompts = check_prompts(model, prompts, None)
    lengths: dict[str, Any] = dict(gen_length=decoder.gen_length, block_length=decoder.block_length)
    reference = DiffusionDecoder(model, OneTokenPerStep(), steps=decoder.gen_length, **lengths)
    eos_ids = torch.tensor(model.eos_token_ids, dtype=torch.long, device=model.device)
    rows = []
    for index, prompt in enumerate(prompts):
        expected = reference.generate([prompt])
        start, end = reference.generated_region([prompt])
        columns = expected.sequences[0, int(start[0]):int(end[0])]
        targets = columns.view(-1, decoder.block_length)
        first_generated = len(prompt) - int(start[0])  # the prompt's last partial block
        generated = torch.arange(targets.numel(), device=targets.device).view_as(targets) >= first_generated
        rule = oracle(targets, model.mask_token_id, eos_ids, generated)
        oracle_decoder = DiffusionDecoder(model, rule, on_proposal=rule.see_proposal, **lengths)
        got = oracle_decoder.generate([prompt], observer=rule.observe)
        reached = got.token_lists == expected.token_lists
        if not reached and not bool(rule.dead_end):
            raise OracleMismatchError(
                f"prompt {index}: the oracle decoded {got.token_lists[0]}, the reference "
                f"{expected.token_lists[0]}; the oracle must commit only final tokens"
            )
        reached_row = torch.tensor([reached], device=got.nfe.device)
        rows.append((got.nfe, reached_row, expected.nfe, got.generated, got.generated_lengths))
    return OracleResult(*(torch.cat(part) for part in zip(*rows)))
