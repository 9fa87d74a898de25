"""The training losses: a dLLM's masked-diffusion cross-entropy over its kinds of rows
(:func:`dllm_loss`) and a causal model's next-token loss (:func:`ar_loss`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from dloom.model.attention import model_mask
from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import GEN_LENGTH, Example

from .codec import CHARACTERS, Codec
from .decoder_states import least_confident, own_commits, threshold_rollout
from .edit_rows import EDIT_RATE, EDIT_TAUS, Edits, draft_edits, noise_edits
from .rows import (
    answer_lengths,
    answer_region,
    encode_prompts,
    position_ids,
    region_logits,
    row_attention,
)

__all__ = ["DECODER_TAUS", "LOSS_MEANS", "MASK_ORDERS", "T_MIN", "ar_loss", "dllm_loss"]


T_MIN = 0.02
MASK_ORDERS = ("uniform", "block")
"""The training mask orders of a dLLM (:func:`dllm_loss`'s ``block_length`` None or set)."""
DECODER_TAUS = (0.9, 0.95)
"""The thresholds a ``"threshold"`` decoder row draws from by default (``--decoder-tau``)."""


def dllm_loss(
    model: LlamaForCausalLM,
    batch: Sequence[Example],
    extra_pad: int,
    gen: torch.Generator,
    pad_weight: float = 1.0,
    t_max: float = 1.0,
    gen_length: int = GEN_LENGTH,
    block_length: int | None = None,
    prefix_share: float = 0.0,
    causal_share: float = 0.0,
    loss_mean: str = "token",
    decoder_share: float = 0.0,
    decoder_fill: str = "answer",
    decoder_rounds: int = 1,
    decoder_taus: Sequence[float] = DECODER_TAUS,
    first_forward_share: float = 0.0,
    own_earlier_share: float = 0.0,
    label_smoothing: float = 0.0,
    codec: Codec = CHARACTERS,
    edit_share: float = 0.0,
    edit_draft_share: float = 0.0,
    edit_taus: Sequence[float] = EDIT_TAUS,
    edit_rate: float = EDIT_RATE,
) -> torch.Tensor:
    """Masked-diffusion cross-entropy over the masked positions of a ``gen_length`` region.

    The mask ratio ``t`` of each row is stratified over ``[T_MIN, t_max]``.  ``t_max < 1``
    trains on lightly masked answers only, where most of an answer's context is visible
    (for ``lookup``: a value's key is usually already written next to it).

    ``block_length`` ``None`` (LLaDA's masks): every position of the region is masked with
    probability ``t``, and the loss covers all masked positions.  ``block_length`` ``K``
    (block-order masks, the states a semi-autoregressive decoder meets): each row draws one
    of the region's ``gen_length // K`` blocks uniformly; the blocks before it are clean, its
    positions are masked with probability ``t``, every position after it is masked, and the
    loss covers the drawn block's masked positions only (a decoder never reads its
    predictions for a later block).  A ``prefix_share`` of the rows (drawn per row) masks
    their block from a uniform cut to its end instead: the state a decoder meets when it has
    committed the block's start, where a result must be computed from the visible operands
    (random masks mostly leave one copy of a repeated number visible, so a model can learn
    to copy it instead).  A ``decoder_share`` of the rows (drawn per row, apart from the
    prefix rows) holds the state a confidence-order decoder meets: of the drawn block, the
    ``m`` positions (``m`` uniform over ``0 .. K - 1``) the model itself is surest of with the
    block fully masked hold their answer, the rest are masked (:func:`least_confident`; one
    more forward, without gradient, on those rows).  ``decoder_rounds`` ``N`` reveals them over
    ``N`` such forwards instead, each round's positions the surest given the earlier rounds'
    (``N`` at least ``K``: one a forward, the very state a one-token-per-step decoder reaches,
    at the cost of up to ``m`` forwards a row).  A decoder commits the easy positions
    first and leaves the hard ones, those the left context leaves open, to be read from
    what it committed on both sides; random masks rarely leave exactly those masked.
    ``decoder_fill`` is what those revealed positions hold: ``"answer"``, the row's answer;
    ``"model"``, the model's own argmax there, the state its decoder reaches, with the row's
    target the right answer closest to it (for families that list their right answers; the
    row's answer otherwise), and every revealed position where the argmax is not that answer's
    token masked and scored (:func:`own_commits`).  A decoder that picked another filler than
    the row's answer for a slot (``went`` for ``walked``) never meets the answer-filled state,
    and in its own state the right continuation is that filler's answer; and a position the
    model is sure of but wrong at, which the decoder would commit first, is revealed with the
    answer's token (so never scored) in ``"answer"`` rows.  ``"threshold"``: the state dloom's
    threshold decoder (Fast-dLLM's rule, ``dloom.DiffusionDecoder(model, "threshold", tau=τ)``)
    reaches after ``f`` forwards in the drawn block (``f`` uniform over ``0 .. decoder_rounds -
    1``, ``τ`` drawn per row from ``decoder_taus``; :func:`threshold_rollout`): its commits are
    kept in the state even where they are wrong, and the block's still-masked positions are
    scored against the right answer closest to them (:func:`own_commits`; the row's answer
    for families that list none), so the model learns to be unsure where its parallel commits
    went astray.  An ``own_earlier_share`` of those rows has its earlier blocks decoded by the
    same rule from the region's start (its own mistakes there too) instead of the answer's.
    A ``first_forward_share`` of the decoder rows (any fill) is at its block's first forward:
    the block entirely masked (``f = 0``, nothing revealed), where a threshold decoder commits
    the most positions at once.

    A ``causal_share`` of the rows (drawn per row) is trained as the causal stage was: the
    clean answer behind a causal attention mask, each position of the answer and its first
    ``<eos>`` predicted from the ones before it (:func:`ar_loss`'s positions).
    One such row teaches every step of a running sum, where a masked row teaches about one,
    so a bidirectional model learns the arithmetic from them and the masked rows teach it to
    use it among masks.  The loss is then the masked rows' mean plus the causal rows' mean.

    ``loss_mean`` is how the masked rows' mean is taken: ``"token"``, over their masked
    positions (each position weighs the same, so a row masked at ``t`` weighs in proportion
    to ``t``); ``"row"``, each row's own mean, then the mean over rows (each row weighs the
    same: LLaDA's ``1/t``-weighted objective in expectation, and the weighting of a
    block-by-block decoder's states, which meets each mask ratio of a block once, the
    lightly masked end of a block as often as its fully masked start).

    ``pad_weight`` scales the loss of the ``<eos>`` padding after each answer's first
    ``<eos>`` (1.0: LLaDA's plain mean over every masked position).  A lower weight leaves
    more of the gradient to the answer's own tokens, which are a quarter of the region for an
    8-character answer.  ``label_smoothing`` ``ε`` is the cross-entropy's (``torch``'s: the
    target ``1 - ε`` plus ``ε`` spread over the vocabulary), which caps a scored position's
    confidence below 1.  ``codec`` encodes the prompts and answers.

    An ``edit_share`` of the rows (drawn per row, apart from the prefix and decoder rows; block
    masks only) are token-to-token editing rows (LLaDA2.1's T2T rows, :mod:`dloom_training.edit_rows`):
    some filled positions of the drawn block hold a wrong token, shown to the model, and the
    whole drawn block is scored: its wrong tokens against the right ones (restore), its right
    tokens against themselves (keep) and its masks (fill).  An ``edit_draft_share`` of them take
    their wrong tokens from the model's own draft of the block at a low threshold drawn from
    ``edit_taus`` (:func:`~dloom_training.edit_rows.draft_edits`), the others from uniform
    noise over up to ``edit_rate`` of their filled block positions
    (:func:`~dloom_training.edit_rows.noise_edits`).  No other row shows a wrong token it scores.
    """
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in batch], extra_pad, codec)
    target = answer_region([e.answer for e in batch], gen_length, codec)
    b = len(batch)
    t = T_MIN + (t_max - T_MIN) * (torch.arange(b) + torch.rand(b, generator=gen)) / b
    drawn = torch.rand(b, gen_length, generator=gen) < t[:, None]
    if block_length is None:
        masked, later = drawn, torch.zeros(b, gen_length, dtype=torch.bool)
        none = ~masked.any(-1)
        masked[none, torch.randint(gen_length, (int(none.sum()),), generator=gen)] = True
    else:
        block_of = torch.arange(gen_length) // block_length
        current = torch.randint(gen_length // block_length, (b, 1), generator=gen)
        in_block = torch.arange(gen_length) % block_length
        cut = torch.randint(block_length, (b, 1), generator=gen)
        row_kind = torch.rand(b, 1, generator=gen)
        prefix_rows = row_kind < prefix_share
        drawn = torch.where(prefix_rows, in_block[None, :] >= cut, drawn)
        if decoder_share > 0:
            decoder_rows = ~prefix_rows & (row_kind < prefix_share + decoder_share)
            revealed = torch.randint(block_length, (b, 1), generator=gen)
            if first_forward_share > 0:
                revealed[torch.rand(b, generator=gen) < first_forward_share] = 0
        masked, later = drawn & (block_of[None, :] == current), block_of[None, :] > current
        none = ~masked.any(-1)  # at least one scored position: one of the drawn block's
        offset = torch.randint(block_length, (int(none.sum()),), generator=gen)
        masked[none, current[none, 0] * block_length + offset] = True
    causal = torch.rand(b, generator=gen) < causal_share if causal_share > 0 else torch.zeros(b, dtype=torch.bool)
    lengths = answer_lengths(target)
    shown = target  # what the unmasked positions hold: the answer, but for threshold rows' own commits
    if decoder_share > 0 and block_length is not None:
        rows = (decoder_rows[:, 0] & ~causal).nonzero()[:, 0]  # a causal row's masks are cleared anyway
        if len(rows) and decoder_fill == "threshold":
            taus = torch.tensor(list(decoder_taus), dtype=torch.float)
            tau = taus[torch.randint(len(taus), (len(rows),), generator=gen)]
            forwards = torch.where(revealed[rows, 0] > 0,
                                   torch.randint(decoder_rounds, (len(rows),), generator=gen), 0)
            own = torch.rand(len(rows), generator=gen) < own_earlier_share
            state = threshold_rollout(model, prompt_ids[rows], prompt_mask[rows], target[rows], current[rows, 0],
                                      block_length, forwards, tau, own)
            drawn_block = (block_of[None, :] == current)[rows]
            masked[rows] = drawn_block & (state == tok.MASK_ID)
            settled = (block_of[None, :] < current[rows]) & ~own[:, None]
            committed = (block_of[None, :] <= current[rows]) & (state != tok.MASK_ID) & ~settled
            target[rows], lengths[rows], _ = own_commits([batch[i] for i in rows.tolist()], target[rows],
                                                          committed, state, settled, lengths[rows], gen, codec)
            shown = target.clone()
            shown[rows] = torch.where(block_of[None, :] <= current[rows], state, target[rows])
        elif len(rows):
            drawn_block = (block_of[None, :] == current)[rows]
            masked[rows], guess = least_confident(model, prompt_ids[rows], prompt_mask[rows], target[rows],
                                                   drawn_block, revealed[rows], decoder_rounds,
                                                   hold_guesses=decoder_fill == "model")
            if decoder_fill == "model":
                settled = block_of[None, :] < current[rows]
                target[rows], lengths[rows], mistaken = own_commits(
                    [batch[i] for i in rows.tolist()], target[rows], drawn_block & ~masked[rows], guess,
                    settled, lengths[rows], gen, codec)
                masked[rows] |= mistaken
    scored = masked  # the positions the loss covers: the masks, and an edit row's whole drawn block
    if edit_share > 0 and block_length is not None:
        edit_rows = (row_kind[:, 0] >= prefix_share + decoder_share) & (
            row_kind[:, 0] < prefix_share + decoder_share + edit_share) & ~causal
        rows = edit_rows.nonzero()[:, 0]
        drafted = torch.rand(len(rows), generator=gen) < edit_draft_share
        shown, scored = shown.clone(), masked.clone()
        for part, edits in _edits(model, batch, prompt_ids, prompt_mask, target, masked, lengths, current[:, 0],
                                  block_length, rows, drafted, edit_taus, edit_rate, gen, codec):
            shown[part], masked[part], target[part], lengths[part] = edits.shown, edits.masked, edits.target, \
                edits.lengths
            scored[part] = (block_of[None, :] == current[part])
    masked, later = masked & ~causal[:, None], later & ~causal[:, None]  # causal rows: the clean answer
    scored = scored & ~causal[:, None]
    noisy = torch.where(masked | later, torch.full_like(target, tok.MASK_ID), shown)
    input_ids = torch.cat([prompt_ids, noisy], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy)], dim=1)
    positions = position_ids(attention_mask)
    if causal_share > 0:
        attention_mask = model_mask(row_attention(attention_mask, causal), model)
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
    logits = region_logits(model, output.logits, prompt_ids.shape[1])
    through_eos = torch.arange(gen_length)[None, :] <= lengths[:, None]  # the answer and its first <eos>
    weight = torch.where(through_eos, 1.0, pad_weight)
    parts = []
    if scored.any():
        parts.append(_weighted_mean(logits, target, weight, scored, by_row=loss_mean == "row",
                                    label_smoothing=label_smoothing))
    through = causal[:, None] & through_eos  # causal rows: the causal stage's positions
    if through.any():
        parts.append(_weighted_mean(logits, target, weight, through, label_smoothing=label_smoothing))
    return torch.stack(parts).sum()

def _edits(
    model: LlamaForCausalLM, batch: Sequence[Example], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    target: torch.Tensor, masked: torch.Tensor, lengths: torch.Tensor, current: torch.Tensor, block_length: int,
    rows: torch.Tensor, drafted: torch.Tensor, edit_taus: Sequence[float], edit_rate: float, gen: torch.Generator,
    codec: Codec,
) -> list[tuple[torch.Tensor, Edits]]:
    """The edit rows ``rows`` of a batch, ``drafted`` (``(len(rows),)`` bool) from the model's
    drafts and the rest from noise: ``(row indices, their Edits)`` for each source with rows."""
    parts = []
    drafts, noised = rows[drafted], rows[~drafted]
    if len(drafts):
        taus = torch.tensor(list(edit_taus), dtype=torch.float)
        tau = taus[torch.randint(len(taus), (len(drafts),), generator=gen)]
        parts.append((drafts, draft_edits(model, [batch[i] for i in drafts.tolist()], prompt_ids[drafts],
                                          prompt_mask[drafts], target[drafts], masked[drafts], current[drafts],
                                          block_length, lengths[drafts], tau, gen, codec)))
    if len(noised):
        block = (torch.arange(target.shape[1]) // block_length)[None, :] == current[noised, None]
        parts.append((noised, noise_edits(target[noised], masked[noised], block, lengths[noised], edit_rate,
                                          codec.size, gen)))
    return parts


LOSS_MEANS = ("token", "row")
"""How :func:`dllm_loss` averages its masked rows' cross-entropy."""


def _weighted_mean(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, scored: torch.Tensor, by_row: bool = False,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The ``weight``-weighted mean cross-entropy (with ``label_smoothing``) over the ``scored``
    ``(B, G)`` positions; ``by_row``: the mean over the rows with a scored position of each
    row's weighted mean."""
    loss = F.cross_entropy(logits[scored], target[scored], reduction="none",
                           label_smoothing=label_smoothing) * weight[scored]
    if not by_row:
        return loss.sum() / weight[scored].sum()
    row = scored.nonzero()[:, 0]
    sums = torch.zeros(len(scored), dtype=loss.dtype).index_add(0, row, loss)
    weights = torch.zeros(len(scored), dtype=loss.dtype).index_add(0, row, weight[scored])
    has = scored.any(-1)
    return (sums[has] / weights[has]).mean()


def ar_loss(
    model: LlamaForCausalLM, batch: Sequence[Example], extra_pad: int, codec: Codec = CHARACTERS
) -> torch.Tensor:
    """Next-token cross-entropy over each answer and its ``<eos>``, the prompt left-padded."""
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in batch], extra_pad, codec)
    answers = [codec.encode(e.answer) for e in batch]
    width = max(len(ids) for ids in answers) + 1
    region = torch.full((len(batch), width), tok.PAD_ID, dtype=torch.long)
    region_mask = torch.zeros_like(region)
    for row, ids in enumerate(answers):
        region[row, : len(ids) + 1] = torch.tensor([*ids, tok.EOS_ID])
        region_mask[row, : len(ids) + 1] = 1
    input_ids = torch.cat([prompt_ids, region], dim=1)
    attention_mask = torch.cat([prompt_mask, region_mask], dim=1)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)
    ).logits
    p = prompt_ids.shape[1]
    predicted = logits[:, p - 1 : -1]  # position i predicts token i + 1
    keep = region_mask.bool()
    return F.cross_entropy(predicted[keep], region[keep])
