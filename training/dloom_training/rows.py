"""Tensors of a training or decoding row: left-padded prompts, answer regions, positions and
attention, and the answer region's logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LlamaForCausalLM

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import GEN_LENGTH

from .codec import CHARACTERS, Codec

__all__ = ["answer_lengths", "answer_region", "encode_prompts", "position_ids", "region_logits", "row_attention"]


def encode_prompts(
    prompts: Sequence[str], extra_pad: int = 0, codec: Codec = CHARACTERS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts: ``input_ids``, ``attention_mask``, both ``(B, P)`` int64."""
    encoded = [codec.encode(prompt) for prompt in prompts]
    width = max(len(ids) for ids in encoded) + extra_pad
    ids = torch.full((len(prompts), width), tok.PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt_ids in enumerate(encoded):
        if prompt_ids:
            ids[row, width - len(prompt_ids) :] = torch.tensor(prompt_ids)
            mask[row, width - len(prompt_ids) :] = 1
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The zoo's position convention: ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def answer_region(answers: Sequence[str], gen_length: int = GEN_LENGTH, codec: Codec = CHARACTERS) -> torch.Tensor:
    """``(B, gen_length)`` answer ids followed by ``<eos>`` padding (at least one).

    :raises ValueError: an answer of ``gen_length`` tokens or more.
    """
    region = torch.full((len(answers), gen_length), tok.EOS_ID, dtype=torch.long)
    for row, answer in enumerate(answers):
        ids = codec.encode(answer)
        if len(ids) >= gen_length:
            raise ValueError(f"answer {answer!r} is {len(ids)} tokens; a region of {gen_length} holds {gen_length - 1}")
        region[row, : len(ids)] = torch.tensor(ids)
    return region


def answer_lengths(region: torch.Tensor) -> torch.Tensor:
    """``(B,)`` the answers' lengths in tokens: the first ``<eos>`` of each ``(B, G)`` region row."""
    return (region == tok.EOS_ID).int().argmax(-1)


def region_logits(model: LlamaForCausalLM, logits: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The ``(B, G, V)`` logits of the answer region from a dLLM's ``(B, P + G, V)`` output:
    columns ``P..`` for an unshifted model, ``P - 1..`` for a shifted (Dream-style) one, whose
    output at ``i`` predicts token ``i + 1``."""
    shifted = getattr(getattr(model, "config", None), "dloom", {}).get("shift", False)
    start = prompt_width - int(shifted)
    return logits[:, start : start + logits.shape[1] - prompt_width]


def row_attention(attention_mask: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """``(B, 1, L, L)`` bool attention (``True`` = attend) for ``(B, L)`` key padding: every
    valid key for a row of ``causal`` ``False``, the keys up to the query's own for a row of
    ``causal`` ``True``; each query also attends to itself, so a padding query has a key."""
    length = attention_mask.shape[1]
    keys = attention_mask.bool()[:, None, None, :]
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = keys & (lower | ~causal[:, None, None, None])
    return allowed | torch.eye(length, dtype=torch.bool)
