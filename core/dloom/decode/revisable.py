"""The revisable transition kernel: a step may fill masked positions and rewrite filled ones.

LLaDA2.1 decodes with token-to-token edits: a step commits masked positions (mask to token,
M2T) and may also rewrite generated positions it filled earlier (token to token, T2T) where
the model now prefers another token; once a block holds no mask, further steps (post steps)
only edit, until a post step changes nothing or the rule's edit budget runs out. A token is
final when its row leaves the block: the session streams a block, and lets a row finish, only
once the kernel says the block is settled (:meth:`RevisableKernel.settle`).

Both kinds of write go through the one commit hook, ``dloom_select_commit``: an editing rule
(:attr:`dloom.types.StrategyRegistration.edits`) is offered the masked positions and the
filled generated positions whose candidate differs from their token, told apart by
:attr:`dloom.types.BlockSchedule.masked`, with the post steps taken so far
(:attr:`~dloom.types.BlockSchedule.post_steps`). A fill rule is offered masked positions only;
with it this kernel is the absorbing one, step for step (a filled block is final at once).

Prompt positions are never offered (the kernel's ``generated`` positions only), nor are
positions outside the active block.

An editing rule may also answer with :class:`dloom.types.Edits`, deleting positions and
inserting masks in a post step (LLaDA2.2's DELETE and SPLIT): the kernel applies them after
the step's commits, within the row's generated positions of the block
(:func:`dloom.decode.levenshtein.relayout`). Its ``remask`` returns filled positions to the
mask in a fill step (WINO's narrow-out): generated filled positions that the step did not
commit, at most ``n - 1`` of them in a row whose step filled ``n`` masked positions, the
least probable tokens first (:func:`kept_remasks`). A fill step therefore always leaves
fewer masks than it found, and a block ends within ``K`` fill steps plus the edit budget.
"""

from __future__ import annotations

import torch

from dloom.decode.commit import sorted_profile
from dloom.decode.kernel import (
    KernelStep,
    RowStreams,
    Settlement,
    apply_commit,
    commit_signals,
    eos_clear,
    propose,
)
from dloom.decode.levenshtein import relayout
from dloom.hooks import calls as hooks
from dloom.types import BlockSchedule, Edits


def kept_remasks(remask: torch.Tensor, probability: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """The remasks the kernel keeps: each row's ``filled - 1`` positions of ``remask`` (none
    when it filled one or none) whose current token is least probable, ties to the lower
    position.

    :param remask: ``(B, K)`` bool, the remasks asked for, within the step's scope.
    :param probability: ``(B, K)`` float, each position's current token's probability.
    :param filled: ``(B,)`` long, the masked positions each row's step filled.
    :return: ``(B, K)`` bool, a subset of ``remask``.
    """
    _, ranks = sorted_profile(-probability, remask)  # least probable first
    return remask & (ranks < (filled - 1).clamp(min=0).unsqueeze(-1))


class RevisableKernel(KernelStep):
    """One step of the revisable kernel on every row's active block (``B`` rows, blocks of
    ``K``); the arguments of :class:`~dloom.decode.kernel.KernelStep`, and:

    :param edits: the commit rule edits (an editing rule); ``False``: a fill rule, and the
        kernel is the absorbing one.
    :param post_step_budget: the most post steps a block takes (the editing rule's edit
        budget): a block whose post steps are spent settles without a further forward.
        ``None`` (a rule built outside the registry): none beyond a post step that changes
        nothing.

    :ivar post_steps: ``(B,)`` long, each row's steps in its block since the block held no
        mask (the step that began so included).
    :ivar changed: ``(B,)`` bool, each row's last step changed its block.
    :ivar post_step: ``(B,)`` bool, each row's last step began with no mask in the block.
    """

    def __init__(self, *args, edits: bool = False, post_step_budget: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.edits = edits
        self.post_step_budget = post_step_budget
        rows = self.steps.shape[0]
        self.post_steps = torch.zeros_like(self.steps)
        self.changed = torch.ones(rows, dtype=torch.bool, device=self.steps.device)
        self.post_step = torch.zeros_like(self.changed)

    def _generated(self, block: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(block, dtype=torch.bool) if self.generated is None else self.generated

    def __call__(self, block: torch.Tensor, logits: torch.Tensor, advance: torch.Tensor) -> torch.Tensor:
        """The next ``(B, K)`` blocks: masked positions filled and, for an editing rule, filled
        ones rewritten; rows where ``advance`` (``(B,)`` bool) is ``False`` take no step."""
        generated = self._generated(block)
        masked = (block == self.mask_token_id) & generated
        post_step = ~masked.any(-1) & advance
        self.post_steps = self.post_steps + post_step.long()
        candidates, confidence = propose(logits, self.temperature, self.remasking, self.generator, self.mask_token_id)
        if self.on_proposal is not None:
            self.on_proposal(candidates, confidence)
        fillable = masked & advance.unsqueeze(1)
        selectable = fillable
        if self.edits:
            selectable = fillable | (generated & ~masked & (candidates != block) & advance.unsqueeze(1))
        schedule = BlockSchedule(
            self.steps, self.steps_per_block, self.masked_at_start, masked=masked, post_steps=self.post_steps,
        )
        signals = None
        if self.signals:  # only what the rule declared
            signals = commit_signals(logits, candidates, block, self.signals, self.mask_token_id)
        reply = (hooks.proposed_edits if self.edits else hooks.proposed_commit)(
            self.pm, confidence, selectable, schedule, signals,
        )
        edits = reply if isinstance(reply, Edits) else None
        answer = reply.commit if isinstance(reply, Edits) else reply
        commit = answer & selectable
        empty = fillable.any(-1) & ~(commit & masked).any(-1)
        stray = empty & (answer & ~selectable).any(-1)  # IDLE_DECODED: it committed only positions not offered
        self.idle = torch.maximum(self.idle, empty.any().long() + stray.any().long())
        picked = torch.gather(logits, -1, candidates.unsqueeze(-1)).squeeze(-1)
        finite = torch.isfinite(picked) & torch.isfinite(confidence)
        self.non_finite = self.non_finite | (selectable.any(-1, keepdim=True) & ~finite).any()
        self.steps = self.steps + advance.long()
        if isinstance(self.generator, RowStreams):
            self.generator.advance(advance)
        new = apply_commit(block, candidates, commit)
        if edits is not None and edits.remask is not None:  # back to the mask, in a fill step
            fill_step = (masked.any(-1) & advance).unsqueeze(1)
            asked = edits.remask & fill_step & generated & ~masked & ~commit
            if signals is None or "token_probability" not in signals:
                signals = commit_signals(logits, candidates, block, ("token_probability",), self.mask_token_id)
            kept = kept_remasks(asked, signals["token_probability"], (commit & masked).sum(-1))
            new = torch.where(kept, self.mask_token_id, new)
        if edits is not None:  # deletes and splits of the filled positions offered in a post step
            offered = selectable & ~masked & post_step.unsqueeze(1)
            new = relayout(new, edits.delete & offered, edits.split & offered, generated, self.mask_token_id)
        self.changed = torch.where(advance, (new != block).any(-1), self.changed)
        self.post_step = torch.where(advance, post_step, self.post_step)
        return new

    def settle(self, block: torch.Tensor) -> Settlement:
        """Where each row stands with its block ``(B, K)`` after a step. Complete: no mask left
        and, for an editing rule, a post step that changed nothing or no post step left in the
        budget. Ended: for a fill rule, a
        generated EOS with nothing masked before it (as on the absorbing kernel); for an
        editing rule, a complete block holding a generated EOS (an EOS may be edited away
        until then)."""
        unmasked = ~((block == self.mask_token_id) & self._generated(block)).any(-1)
        eos = eos_clear(block, self.mask_token_id, self.eos_ids, self.generated)
        if not self.edits:
            return Settlement(eos, unmasked)
        settled = self.post_step & ~self.changed
        if self.post_step_budget is not None:
            settled = settled | (self.post_steps >= self.post_step_budget)
        complete = unmasked & settled
        return Settlement(complete & eos, complete)

    def unchanged_post_steps(self) -> torch.Tensor | None:
        """``(B,)`` bool, rows whose last step was a post step that changed nothing (the
        step that settles a block unless its edit budget ran out); ``None`` for a fill rule,
        which takes no post step."""
        return self.post_step & ~self.changed if self.edits else None

    def pending(self, block: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool, rows whose block a step may still change."""
        ended, complete = self.settle(block)
        return ~(ended | complete)

    def start_block(self, moving: torch.Tensor, block: torch.Tensor) -> None:
        super().start_block(moving, block)
        self.post_steps = torch.where(moving, 0, self.post_steps)
        self.changed = self.changed | moving
        self.post_step = self.post_step & ~moving

    def select(self, index: torch.Tensor) -> None:
        super().select(index)
        self.post_steps, self.changed, self.post_step = self.post_steps[index], self.changed[index], self.post_step[index]

    def join(self, block: torch.Tensor, streams: torch.Tensor) -> None:
        super().join(block, streams)
        rows = block.shape[0]
        self.post_steps = torch.cat([self.post_steps, self.post_steps.new_zeros(rows)])
        self.changed = torch.cat([self.changed, self.changed.new_ones(rows)])
        self.post_step = torch.cat([self.post_step, self.post_step.new_zeros(rows)])
