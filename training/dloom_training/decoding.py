"""Greedy decoding for the trainer's evaluation: a dLLM one token per step (:func:`trace_dllm`),
a causal model token by token (:func:`decode_ar`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import DynamicCache, LlamaForCausalLM

from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import GEN_LENGTH

from .codec import CHARACTERS, Codec
from .rows import encode_prompts, position_ids, region_logits

__all__ = ["DECODING_ORDERS", "Trace", "decode_ar", "decode_dllm", "decode_threshold", "trace_dllm"]


DECODING_ORDERS = ("confidence", "left-to-right")
"""Which masked position of the current block :func:`trace_dllm` commits at each step."""


class Trace(NamedTuple):
    """One-token-per-step decoding of ``B`` prompts over a ``G``-position region."""

    region: torch.Tensor
    """``(B, G)`` long: the decoded tokens."""
    step: torch.Tensor
    """``(B, G)`` long: the step that committed each position (a permutation of ``0 .. G - 1``)."""
    confidence: torch.Tensor
    """``(B, G)`` float: the max-probability each position had when it was committed."""


@torch.no_grad()
def decode_dllm(
    model: LlamaForCausalLM, prompts: Sequence[str], order: str = "confidence", codec: Codec = CHARACTERS
) -> list[str]:
    """Greedy one-token-per-step answers of a dLLM (:func:`trace_dllm`), as text."""
    return [codec.decode(row) for row in trace_dllm(model, prompts, order, codec).region.tolist()]


@torch.no_grad()
def trace_dllm(
    model: LlamaForCausalLM, prompts: Sequence[str], order: str = "confidence", codec: Codec = CHARACTERS
) -> Trace:
    """Greedy decoding, one token per step, blocks left to right, with each commit's step.

    The region has the model's ``dloom.gen_length`` positions (``GEN_LENGTH`` if it names
    none), decoded in blocks of ``dloom.block_length`` (default: one block): each step
    commits one masked position of the leftmost block that still has masks to its argmax.
    ``order`` ``"confidence"`` picks the position of highest max-probability (LLaDA's
    semi-autoregressive low-confidence remasking, the zoo's evaluation); ``"left-to-right"``
    the leftmost one (a diagnostic: what the model knows when no later position is ever
    committed first).

    :return: the tokens, and each position's commit step and confidence.
    :raises ValueError: for an ``order`` outside :data:`DECODING_ORDERS`.
    """
    if order not in DECODING_ORDERS:
        raise ValueError(f"order is {order!r}; allowed: {', '.join(DECODING_ORDERS)}")
    dloom = getattr(model.config, "dloom", {})
    gen_length = dloom.get("gen_length", GEN_LENGTH)
    block_length = dloom.get("block_length", gen_length)
    prompt_ids, prompt_mask = encode_prompts(prompts, codec=codec)
    b, p = prompt_ids.shape
    x = torch.cat([prompt_ids, torch.full((b, gen_length), tok.MASK_ID, dtype=torch.long)], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones((b, gen_length), dtype=torch.long)], dim=1)
    pos = position_ids(attention_mask)
    rows = torch.arange(b)
    block = torch.arange(gen_length) // block_length
    leftmost_first = -torch.arange(gen_length, dtype=torch.float)[None, :].expand(b, -1)
    committed_at = torch.zeros((b, gen_length), dtype=torch.long)
    committed_confidence = torch.zeros((b, gen_length))
    for step in range(gen_length):
        output = model(input_ids=x, attention_mask=attention_mask, position_ids=pos)
        logits = region_logits(model, output.logits, p).float()
        logits[..., [tok.PAD_ID, tok.MASK_ID]] = -math.inf
        probability, candidate = logits.softmax(-1).max(-1)
        priority = leftmost_first if order == "left-to-right" else probability
        still = (x[:, p:] == tok.MASK_ID) & (block == step // block_length)[None, :]
        choice = torch.where(still, priority, -math.inf).argmax(-1)
        x[rows, p + choice] = torch.where(still[rows, choice], candidate[rows, choice], x[rows, p + choice])
        committed_at[rows, choice] = step
        committed_confidence[rows, choice] = probability[rows, choice]
    return Trace(x[:, p:], committed_at, committed_confidence)


@torch.no_grad()
def decode_ar(model: LlamaForCausalLM, prompts: Sequence[str], codec: Codec = CHARACTERS) -> list[str]:
    """Greedy generation of up to the model's ``dloom.gen_length`` tokens (``GEN_LENGTH`` if
    it names none); stops once every row emitted ``<eos>``. Each step feeds only the new
    token, with the model's KV cache (a 128-token answer costs one prompt forward and 127
    one-token forwards, not 128 forwards of the growing sequence)."""
    x, attention_mask = encode_prompts(prompts, codec=codec)
    positions = position_ids(attention_mask)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    generated, cache = [], DynamicCache(config=model.config)
    for _ in range(getattr(model.config, "dloom", {}).get("gen_length", GEN_LENGTH)):
        out = model(input_ids=x, attention_mask=attention_mask, position_ids=positions, cache=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        logits[:, [tok.PAD_ID, tok.MASK_ID]] = -math.inf
        nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, tok.EOS_ID), nxt)
        generated.append(nxt)
        done |= nxt == tok.EOS_ID
        if done.all():
            break
        x, positions = nxt[:, None], positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)[:, None]], dim=1)
    return [codec.decode(row) for row in torch.stack(generated, 1).tolist()]


@torch.no_grad()
def decode_threshold(
    model: LlamaForCausalLM, prompts: Sequence[str], tau: float, codec: Codec = CHARACTERS
) -> tuple[list[str], torch.Tensor]:
    """Greedy threshold decoding of a dLLM (Fast-dLLM's rule, as dloom's ``threshold`` strategy
    and :func:`~dloom_training.decoder_states.threshold_rollout` apply it): blocks left to right
    (the model's ``dloom.block_length``), each forward commits, in the leftmost block with masks,
    every masked position whose confidence (the argmax's probability, the mask token excluded)
    exceeds ``tau``, and at least the surest one.  Only the rows still decoding are run.

    :return: the answers, and ``(B,)`` long the forwards each row took.
    """
    dloom = getattr(model.config, "dloom", {})
    gen_length = dloom.get("gen_length", GEN_LENGTH)
    block_of = torch.arange(gen_length) // dloom.get("block_length", gen_length)
    prompt_ids, prompt_mask = encode_prompts(prompts, codec=codec)
    region = torch.full((len(prompts), gen_length), tok.MASK_ID, dtype=torch.long)
    forwards = torch.zeros(len(prompts), dtype=torch.long)
    while bool((region == tok.MASK_ID).any()):
        rows = (region == tok.MASK_ID).any(-1).nonzero()[:, 0]
        attention_mask = torch.cat([prompt_mask[rows], torch.ones_like(region[rows])], dim=1)
        output = model(input_ids=torch.cat([prompt_ids[rows], region[rows]], dim=1), attention_mask=attention_mask,
                       position_ids=position_ids(attention_mask))
        logits = region_logits(model, output.logits, prompt_ids.shape[1]).float()
        logits[..., tok.MASK_ID] = -math.inf
        probability, candidate = logits.softmax(-1).max(-1)
        open_positions = region[rows] == tok.MASK_ID
        open_block = block_of[open_positions.int().argmax(-1)]
        selectable = open_positions & (block_of[None, :] == open_block[:, None])
        confidence = torch.where(selectable, probability, -math.inf)
        commit = selectable & (confidence > tau)
        commit[torch.arange(len(rows)), confidence.argmax(-1)] = True
        region[rows] = torch.where(commit, candidate, region[rows])
        forwards[rows] += 1
    return [codec.decode(row) for row in region.tolist()], forwards
