"""The exact output distribution of the transition kernel, by enumeration.

The reference process (``docs/concepts.md``, "The decode loop") on one prompt is a Markov chain whose state is the
generated region (plus the step index within the active block, which quota rules read).
From each state one forward gives the active block's logits; every masked position draws its
candidate independently from ``softmax(logits / T)`` with the mask token excluded (the
argmax when ``T == 0``), its confidence is the candidate's untempered probability (as
:func:`dloom.decode.kernel.propose` computes it for ``low_confidence`` remasking), the decoder's
commit rule (``dloom_select_commit``, called through :func:`dloom.hooks.calls.select_commit` with
the :class:`~dloom.types.BlockSchedule` the engine would pass) picks positions, and those
take their candidates. :func:`exact_distribution` follows every candidate tuple (``V^m``
for ``m`` masked positions) and adds up the probability of each final output, stopping a
path where the engine stops a row (:func:`dloom.decode.session.finished_rows`: an EOS with nothing
masked before it, or nothing masked). An output is the generated tokens up to and including
the first EOS, as in :attr:`dloom.GenerationResult.token_lists`.

Scope: ``low_confidence`` remasking only (``random`` remasking draws a uniform confidence
that would have to be integrated; ``margin``/``entropy`` are not implemented), no KV cache,
bidirectional models, ``vocab <= 8`` and ``gen_length <= 4``. Speculation hooks
(``dloom_draft`` ...) are not run: the kernel *is* what a speculative strategy must reproduce.
Values of ``confidence`` at non-selectable positions are meaningless by the hook contract;
the enumeration fills them with the position's top probability.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from dloom.decode.decoder import DiffusionDecoder
from dloom.decode.kernel import commit_signals, without_mask
from dloom.decode.session import finished_rows
from dloom.errors import ConfigurationError, HookContractError, NonFiniteLogitsError
from dloom.hooks import calls as hooks
from dloom.types import BlockSchedule

MAX_VOCAB = 8
MAX_GEN_LENGTH = 4

Output = tuple[int, ...]


def _check_scope(decoder: DiffusionDecoder) -> None:
    model = decoder.model
    if decoder.remasking != "low_confidence":
        raise ConfigurationError(
            f"exact enumeration supports remasking='low_confidence' only, got "
            f"{decoder.remasking!r} ('random' would need its uniform confidence integrated)"
        )
    if getattr(decoder, "cache", "none") != "none":
        raise ConfigurationError(
            f"exact enumeration runs the reference process without a KV cache; the decoder "
            f"has cache={decoder.cache!r} (use cache='none')"
        )
    if model.attention != "bidirectional":
        raise ConfigurationError(
            f"exact enumeration supports bidirectional models; {model.name!r} is {model.attention!r}"
        )
    if decoder.gen_length > MAX_GEN_LENGTH:
        raise ConfigurationError(_too_big("gen_length", decoder.gen_length))


def _too_big(what: str, value: int) -> str:
    return (
        f"exact enumeration is limited to vocab <= {MAX_VOCAB} and gen_length <= "
        f"{MAX_GEN_LENGTH} (about V^gen_length states); got {what} {value}. Use a model "
        "from dloom.check.tiny"
    )


def _output(generated: list[int], eos_ids: set[int]) -> Output:
    for index, token in enumerate(generated):
        if token in eos_ids:
            return tuple(generated[: index + 1])
    return tuple(generated)


def _step(
    decoder: DiffusionDecoder, block: torch.Tensor, logits: torch.Tensor, step: int,
    steps_per_block: int,
) -> dict[tuple[int, ...], float]:
    """The distribution of the active block after one kernel step.

    :param block: ``(K,)`` long, the block's current tokens.
    :param logits: ``(K, V)`` the block's logits.
    :return: ``{new block tokens: probability}``.
    """
    mask_id = decoder.mask_token_id
    width = block.shape[0]
    logits64 = without_mask(logits, mask_id)
    probs = torch.softmax(logits64, dim=-1)
    masked = torch.nonzero(block == mask_id).flatten()
    if decoder.temperature > 0:
        tempered = torch.softmax(logits64 / decoder.temperature, dim=-1)
    else:
        tempered = torch.zeros_like(probs).scatter_(-1, logits64.argmax(-1, keepdim=True), 1.0)
    choices = [torch.nonzero(tempered[j] > 0).flatten() for j in masked.tolist()]
    grid = torch.cartesian_prod(*choices) if len(choices) > 1 else choices[0].unsqueeze(-1)
    count = grid.shape[0]
    candidates = block.expand(count, width).clone()
    candidates[:, masked] = grid
    chance = tempered[masked.unsqueeze(0), grid].prod(-1)  # (N,)
    confidence = probs.max(-1).values.expand(count, width).clone()
    confidence[:, masked] = probs[masked.unsqueeze(0), grid]
    selectable = (block == mask_id).expand(count, width)
    schedule = BlockSchedule(
        torch.full((count,), step, dtype=torch.long), steps_per_block,
        torch.full((count,), width, dtype=torch.long),
    )
    names = hooks.declared_signals(decoder.pm)
    signals = None
    if names:
        signals = commit_signals(
            logits.expand(count, *logits.shape), candidates, block.expand(count, width), names, mask_id,
        )
    commit = hooks.select_commit(decoder.pm, confidence, selectable.clone(), schedule, signals)
    if not bool(commit.any(-1).all()):
        raise HookContractError(
            f"commit rule {decoder.composition.provider('dloom_select_commit')!r} committed no "
            "position in a row that had masked positions; every step must commit at least one"
        )
    after = torch.where(commit, candidates, block.expand(count, width))
    result: dict[tuple[int, ...], float] = defaultdict(float)
    for row, p in zip(after.tolist(), chance.tolist()):
        result[tuple(row)] += p
    return result


def exact_distribution(decoder: DiffusionDecoder, prompt: Sequence[int]) -> dict[Output, float]:
    """The exact distribution of ``decoder``'s outputs on ``prompt`` under the kernel.

    :param decoder: fixes the model, commit rule, lengths, steps and temperature.
    :param prompt: token ids (one prompt, no padding).
    :return: ``{output tokens: probability}``, summing to one (up to rounding).
    :raises ConfigurationError: outside the scope in the module docstring.
    :raises HookContractError: when the commit rule commits nothing in some state.
    """
    _check_scope(decoder)
    model = decoder.model
    mask_id = decoder.mask_token_id
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ConfigurationError("exact enumeration needs a non-empty prompt")
    gen, width = decoder.gen_length, decoder.block_length
    steps_per_block = decoder.steps // (gen // width)
    device = model.device
    eos_ids = torch.tensor(model.eos_token_ids, dtype=torch.long, device=device)
    eos_set = set(model.eos_token_ids)
    frontier: dict[tuple[tuple[int, ...], int], float] = {((mask_id,) * gen, 0): 1.0}
    outputs: dict[Output, float] = defaultdict(float)
    positions = torch.arange(len(prompt) + gen, device=device).unsqueeze(0)
    while frontier:
        keys = list(frontier)
        tokens = torch.tensor([prompt + list(state) for state, _ in keys], device=device)
        logits = model.logits(tokens, None, positions.expand(len(keys), -1))[:, len(prompt):]
        if logits.shape[-1] > MAX_VOCAB:
            raise ConfigurationError(_too_big("vocab", logits.shape[-1]))
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError(f"model {model.name!r} returned NaN or inf logits")
        successors: list[tuple[tuple[int, ...], int, float]] = []
        for index, (state, step) in enumerate(keys):
            block = next(b for b in range(gen // width) if mask_id in state[b * width : (b + 1) * width])
            start = block * width
            current = torch.tensor(state[start : start + width], device=device)
            moves = _step(decoder, current, logits[index, start : start + width], step, steps_per_block)
            for new_block, p in moves.items():
                new_state = state[:start] + new_block + state[start + width :]
                next_step = step + 1 if mask_id in new_block else 0
                successors.append((new_state, next_step, frontier[(state, step)] * p))
        done = finished_rows(
            torch.tensor([s for s, _, _ in successors], device=device), mask_id, eos_ids
        ).tolist()
        frontier = defaultdict(float)
        for (state, step, p), finished in zip(successors, done):
            if finished:
                outputs[_output(list(state), eos_set)] += p
            else:
                frontier[(state, step)] += p
    return dict(outputs)
