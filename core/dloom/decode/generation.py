"""Steps every decoder takes around its loop: checking and left-padding the prompts, one
random stream per prompt, and turning generated ids into token lists and texts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dloom.decode.kernel import RowStreams
from dloom.decode.prompts import check_prompts
from dloom.errors import ConfigurationError
from dloom.model.adapter import ModelAdapter, left_pad_prompts

Prompts = Sequence[str] | Sequence[Sequence[int]] | torch.Tensor
"""What a decoder's ``generate`` takes: texts, token-id lists, or a ``(B, P)`` left-padded tensor."""


def row_streams(
    row_offset: int | Sequence[int] | torch.Tensor, batch: int, device: torch.device
) -> torch.Tensor:
    """Each prompt's random stream index, ``(B,)`` long on ``device``.

    :param row_offset: an int (prompt ``i`` gets stream ``row_offset + i``) or one index per
        prompt (a sequence or a ``(B,)`` tensor).
    :param batch: the number of prompts ``B``.
    :raises ConfigurationError: for a negative index, or a sequence whose length is not ``B``.
    """
    allowed = "allowed: an int >= 0, or one int >= 0 per prompt (a sequence or a 1-D tensor)"
    if isinstance(row_offset, int) and not isinstance(row_offset, bool):
        if row_offset < 0:
            raise ConfigurationError(f"row_offset is {row_offset}; {allowed}")
        return torch.arange(batch, device=device) + row_offset
    try:
        streams = torch.as_tensor(row_offset, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigurationError(f"row_offset is {row_offset!r}; {allowed}") from error
    if streams.dtype == torch.bool or streams.is_floating_point() or streams.is_complex() or streams.dim() != 1:
        raise ConfigurationError(f"row_offset is {row_offset!r}; {allowed}")
    if streams.numel() != batch:
        raise ConfigurationError(
            f"row_offset has {streams.numel()} stream indices for {batch} prompts; {allowed}"
        )
    if bool((streams < 0).any()):
        raise ConfigurationError(
            f"row_offset {streams.tolist()} has a negative stream index; {allowed}"
        )
    return streams.long()


def prepare_prompts(
    model: ModelAdapter, prompts: Any, attention_mask: torch.Tensor | None,
    row_offset: int | Sequence[int] | torch.Tensor, seed: int | None, samples: bool,
) -> tuple[torch.Tensor, torch.Tensor, RowStreams | None]:
    """Check the prompts, left-pad them and give each its random stream.

    :param samples: whether decoding draws random numbers (else no streams are made).
    :return: ``(B, P)`` prompt ids and padding mask on the model's device, and the
        :class:`~dloom.decode.kernel.RowStreams` of the prompts (``None`` when ``samples`` is false).
    :raises ModelError: for empty prompts. :raises ConfigurationError: for a bad ``row_offset``.
    """
    prompts = check_prompts(model, prompts, attention_mask)
    prompt_ids, prompt_mask = left_pad_prompts(model, prompts, attention_mask)
    stream_ids = row_streams(row_offset, prompt_ids.shape[0], prompt_ids.device)
    return prompt_ids, prompt_mask, RowStreams(seed, stream_ids) if samples else None


def token_lists_and_texts(
    model: ModelAdapter, generated: torch.Tensor, lengths: torch.Tensor
) -> tuple[list[list[int]], list[str] | None]:
    """Each row's generated tokens up to its length, and their text without EOS tokens
    (``None`` without a tokenizer); one device-to-host copy of ``generated``.

    :param generated: ``(B, G)`` long. :param lengths: ``(B,)`` long.
    """
    token_lists = [row[:n] for row, n in zip(generated.tolist(), lengths.tolist())]
    if model.tokenizer is None:
        return token_lists, None
    eos = set(model.eos_token_ids)
    return token_lists, [model.decode([t for t in row if t not in eos]) for row in token_lists]
