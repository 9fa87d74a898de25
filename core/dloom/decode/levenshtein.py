"""DELETE and SPLIT in a block of fixed width: LLaDA2.2's Levenshtein edits as the revisable
kernel applies them (:class:`dloom.types.Edits`).

Each row's generated positions of the block are rebuilt in order: a deleted position writes
nothing, a split one writes a mask and then its token, every other one its token; the
tokens written fill the row's generated positions from the first, what is pushed past the
last is dropped, and the positions left over are masked. Positions that are not generated
(the prompt's tail in a block aligned at position 0) are neither rebuilt nor moved. One
cumulative sum and one scatter for the whole batch, no loop over rows.
"""

from __future__ import annotations

import torch


def relayout(
    block: torch.Tensor, delete: torch.Tensor, split: torch.Tensor, generated: torch.Tensor, mask_token_id: int,
) -> torch.Tensor:
    """The blocks after their deletes and splits.

    :param block: ``(B, K)`` long, the tokens of each row's block.
    :param delete: ``(B, K)`` bool, positions removed (a deleted position's split is moot).
    :param split: ``(B, K)`` bool, positions with a mask inserted before them.
    :param generated: ``(B, K)`` bool, the positions rebuilt; deletes and splits elsewhere
        are ignored.
    :param mask_token_id: the mask id.
    :return: ``(B, K)`` long, a new tensor; ``block`` itself where nothing is deleted or split.
    """
    rows, width = block.shape
    kept = generated & ~delete
    written = kept.long() + (kept & split).long()  # tokens each position writes: 0, 1 or 2
    rank = written.cumsum(-1) - 1  # where a kept token lands among the row's generated positions
    slots = generated.sum(-1, keepdim=True)
    # the r-th generated position of each row is order[:, r] (generated positions first, in order)
    order = torch.argsort((~generated).to(torch.int8), dim=-1, stable=True)
    landing = kept & (rank < slots)
    column = torch.where(landing, torch.gather(order, -1, rank.clamp(0, width - 1)), width)
    rebuilt = torch.where(generated, torch.full_like(block, mask_token_id), block)
    spill = torch.cat([rebuilt, rebuilt.new_zeros(rows, 1)], dim=-1)  # column K takes what lands nowhere
    return spill.scatter(-1, column, block)[:, :width]
