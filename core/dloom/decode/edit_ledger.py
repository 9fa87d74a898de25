"""Edit accounting of an editing kernel: how many edits each row took, and its drafts.

On the revisable kernel an editing rule may rewrite a position it filled earlier
(``docs/editing.md``). Two figures tell whether that pays:

- **edits**: per row, the writes that changed a filled generated position: a token-to-token
  rewrite, a remask, or a token moved by a Levenshtein delete or split (each position whose
  token the move changed counts once). Filling a masked position is not an edit, nor is
  refilling a position an edit remasked (its remask was counted).
- **drafts**: per generated position, the first token any step filled it with. The drafts
  alone, read up to their first EOS, are the answer the row would have given had no edit
  happened to its fills (a fill rule's answer is its drafts). An edit *fixed a wrong draft*
  when the final answer is correct and the drafts' answer is not
  (:mod:`dloom.evaluation` scores both with the task's checker).

:class:`EditLedger` keeps both on the device for the rows of a running batch: it reads each
step's block before and after it, never synchronises, and follows the batch as rows join
and leave. On the revisable kernel a session step is one kernel step (speculation is refused
there); a verification that took several kernel steps would be read as one, and an edit
undone within it not counted.
"""

from __future__ import annotations

import torch


class EditLedger:
    """Edits and drafts of every row of a running batch (``B`` rows of width ``L``).

    :param tokens: ``(B, L)`` long, the rows as laid out (prompt, then masks over the
        generated region).
    :param mask_token_id: the mask id.

    :ivar edits: ``(B,)`` long, each row's edits so far.
    :ivar drafts: ``(B, L)`` long, ``tokens`` with each position a step has filled holding the
        first token it was filled with (positions never filled stay masked).
    """

    def __init__(self, tokens: torch.Tensor, mask_token_id: int) -> None:
        self.mask_token_id = mask_token_id
        self.drafts = tokens.clone()
        self.edits = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)

    def record(self, columns: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
               generated: torch.Tensor | None) -> None:
        """Count a step that moved every row's active block from ``before`` to ``after``.

        :param columns: ``(B, K)`` long, the block's columns in the rows.
        :param before: / :param after: ``(B, K)`` long, the block before and after the step.
        :param generated: ``(B, K)`` bool, the block's generated positions (``None``: all).
        """
        changed = (before != self.mask_token_id) & (after != before)
        if generated is not None:
            changed = changed & generated
        self.edits = self.edits + changed.sum(-1)
        drafted = torch.gather(self.drafts, 1, columns)
        self.drafts.scatter_(1, columns, torch.where(drafted == self.mask_token_id, after, drafted))

    def keep(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order."""
        self.drafts, self.edits = self.drafts[index], self.edits[index]

    def join(self, widened: int, tokens: torch.Tensor, pad_token_id: int) -> None:
        """Rows ``tokens`` (``(J, L)``, laid out at the batch's width) join, after ``widened``
        padding columns were added on the left of the running rows."""
        if widened:
            self.drafts = torch.cat([self.drafts.new_full((len(self.drafts), widened), pad_token_id), self.drafts], 1)
        self.drafts = torch.cat([self.drafts, tokens])
        self.edits = torch.cat([self.edits, self.edits.new_zeros(len(tokens))])
