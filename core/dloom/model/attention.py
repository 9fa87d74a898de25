"""Attention masks the decoder builds itself: the block-causal layout (SDAR-style models).

In a block-causal dLLM, attention is full inside a block and causal across blocks: a query
in block ``i`` sees the keys of blocks ``<= i``; padding is never seen. Because nothing
before a block attends to it, the keys and values of everything before the active block are
final once that block starts, which makes prefix caching exact.

Where the blocks lie is the model's :attr:`dloom.ModelAdapter.block_alignment`:

- ``"prompt"``: the whole prompt is block ``-1``, seen by every query; the generated region
  is split into blocks of ``block_length`` from its first position (:func:`block_ids`).
- ``"absolute"``: blocks of ``block_length`` counted from each row's position 0, prompt
  included, as SDAR was trained (:func:`absolute_block_ids`): the prompt's last partial
  block is decoded together with the first generated positions. Position ids ignore left
  padding, so a row's blocks are where they are when it is decoded alone.
"""

from __future__ import annotations

import torch

from dloom.errors import ModelError


def block_ids(length: int, prompt_len: int, block_length: int, device: torch.device) -> torch.Tensor:
    """``(L,)`` long block index of every position: ``-1`` in the prompt, then 0, 1, ..."""
    offset = torch.arange(length, device=device) - prompt_len
    return torch.where(offset < 0, -1, torch.div(offset, block_length, rounding_mode="floor"))


def absolute_block_ids(position_ids: torch.Tensor, block_length: int) -> torch.Tensor:
    """``(B, L)`` long block index of every position counted from position 0, prompt included
    (``block_alignment="absolute"``); ``position_ids`` ``(B, L)`` ignore left padding."""
    return torch.div(position_ids, block_length, rounding_mode="floor")


def mask_from_block_ids(padding_mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """The block-causal mask given every position's block index.

    :param padding_mask: ``(B, L)``, 1 (or ``True``) on real tokens, or ``None`` (no padding).
    :param ids: ``(L,)`` or ``(B, L)`` long block indices.
    :return: ``(B, 1, L, L)`` bool (``(1, 1, L, L)`` without padding and with ``(L,)`` ids),
        ``True`` where query ``q`` may attend to key ``k``: ``block(k) <= block(q)`` and ``k``
        is not padding.
    """
    ids = ids if ids.dim() == 2 else ids.unsqueeze(0)
    layout = ids.unsqueeze(1) <= ids.unsqueeze(2)  # (B, L, L): [query, key]
    if padding_mask is not None:
        layout = layout & padding_mask.bool()[:, None, :]
    return layout.unsqueeze(1)


def block_causal_mask(padding_mask: torch.Tensor, prompt_len: int, block_length: int) -> torch.Tensor:
    """The block-causal attention mask of a whole sequence, blocks aligned at the prompt's end.

    :param padding_mask: ``(B, L)``, 1 (or ``True``) on real tokens, 0 on left padding.
    :param prompt_len: prompt width ``P`` (padding included); the blocks start there.
    :param block_length: positions per generated block.
    :return: ``(B, 1, L, L)`` bool, ``True`` where query ``q`` may attend to key ``k``:
        ``block(k) <= block(q)`` and ``k`` is not padding.
    """
    length = padding_mask.shape[1]
    ids = block_ids(length, prompt_len, block_length, padding_mask.device)
    return mask_from_block_ids(padding_mask, ids.expand(padding_mask.shape[0], -1))


def model_mask(mask: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """A ``(B, 1, Q, K)`` bool mask in the form the model's attention implementation takes.

    ``transformers`` passes a 4-D mask through untouched: SDPA and flex attention read a bool
    mask (``True`` = attend), eager attention adds it to the scores, so it gets ``0`` where
    allowed and the dtype's minimum elsewhere.

    :raises ModelError: for an implementation that cannot take an arbitrary 4-D mask (flash
        attention).
    """
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if "flash" in implementation:
        raise ModelError(
            f"attention implementation {implementation!r} cannot take a block-causal 4-D mask; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    if implementation != "eager":
        return mask
    dtype = next(model.parameters()).dtype
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)
