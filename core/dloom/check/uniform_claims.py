"""The claims of the uniform-noise kernel, tested on decodes of a strategy that runs on it.

On the uniform kernel (:mod:`dloom.decode.uniform`, DiffusionGemma) a row's canvas starts as
random tokens; every step the commit rule accepts some of its sampled positions and the
kernel renoises the others, until the canvas stops or spends its step budget. Whatever the
rule, decodes on that kernel keep four promises (:data:`dloom.check.kernel_claims.KERNEL_CLAIMS`):

* ``prompt_kept``: the prompt is never changed (it is the encoder's prefix, outside every
  canvas, which no kernel step writes, so only broken machinery breaks it);
* ``step_budget``: every canvas ends within its step budget (the model's
  ``max_denoising_steps``), so a row takes at most ``max_denoising_steps`` steps per canvas;
  the kernel ends a canvas once the budget is spent, so only a broken kernel breaks it;
* ``deterministic``: two decodes with one seed give the same tokens (the kernel draws from
  per-row generators of the seed; a rule drawing from an unseeded source breaks it);
* ``accepts``: every step accepts at least one position of every row that steps (a rule
  that accepts nothing leaves the whole canvas to be renoised, and the decoder stops it).

:func:`check_uniform_claims` decodes :data:`~dloom.check.kernel_claims.PROMPTS` seeded
random prompts on a tiny model of the kernel (:func:`dloom.check.tiny.tiny_uniform_dllm`:
canvases of :data:`CANVAS`, :data:`STEPS` steps each) twice with one seed, watching every step
of the first through its session (the kernel's accepted positions and step counts, the
session's prompt columns).
"""

from __future__ import annotations

import warnings

import torch

from dloom.check import tiny
from dloom.check.kernel_claims import (
    ACCEPTS,
    DETERMINISTIC,
    KERNEL_CLAIMS,
    PROMPT_KEPT,
    PROMPTS,
    SEED,
    STEP_BUDGET,
    KernelClaims,
)
from dloom.check.resolve import Resolved
from dloom.decode.decoder import DiffusionDecoder
from dloom.decode.session import DecodeSession, StepRecord
from dloom.decode.transition import UNIFORM
from dloom.decode.uniform import UniformKernel
from dloom.errors import HookContractError, each_warning_once

CANVAS = 4
STEPS = 4
"""A canvas's step budget on the tiny model (its ``max_denoising_steps``)."""
GEN_LENGTH = 8
PROMPT_LENGTH = 5
VOCAB = 16


class _Watch:
    """An observer of every step of a :class:`~dloom.decode.session.DecodeSession` on the
    uniform kernel: records the first break of ``prompt_kept``, ``step_budget`` and
    ``accepts``, and what held. Every row of the batch steps in every step (a row whose
    canvas ended starts its next one, a finished row leaves the batch).

    :param prompts: ``(P, L)`` long, the prompts of the rows (by row id).
    """

    def __init__(self, prompts: torch.Tensor) -> None:
        self.prompts = prompts
        self.session: DecodeSession | None = None
        self.steps: dict[tuple[int, int], int] = {}
        self.breaks: dict[str, str] = {}
        self.row_steps = 0
        self.accepted = 0

    def _break(self, claim: str, problem: str) -> None:
        self.breaks.setdefault(claim, problem)

    def __call__(self, record: StepRecord) -> None:
        assert self.session is not None
        kernel = self.session.kernel
        assert isinstance(kernel, UniformKernel)
        rows = record.rows.tolist()
        width = self.prompts.shape[1]
        kept = (self.session.x[:, :width] == self.prompts[record.rows]).all(-1).tolist()
        accepted = kernel.accepted.sum(-1).tolist()
        for i, key in enumerate(zip(rows, record.block.tolist())):
            where = f"prompt {key[0]}, canvas {key[1]}"
            if not kept[i]:
                self._break(PROMPT_KEPT, f"prompt {key[0]}: its prompt tokens changed by canvas {key[1]}")
            steps = self.steps[key] = self.steps.get(key, 0) + 1
            if steps > kernel.steps_per_block:
                self._break(
                    STEP_BUDGET,
                    f"{where}: the canvas took step {steps}, past its budget of {kernel.steps_per_block} steps",
                )
            self.row_steps += 1
            self.accepted += accepted[i]
            if not accepted[i]:
                self._break(ACCEPTS, f"{where}: step {steps} accepted no position (the whole canvas renoised)")


def _decode(strategy: Resolved, model, prompts: list[list[int]], watch: _Watch | None) -> list[list[int]] | None:
    """One seeded decode of ``prompts`` with ``strategy`` (watched with ``watch``): each
    prompt's generated tokens, or ``None`` when the watch saw a break that stops the decode
    (a step that accepted nothing, which the decoder refuses, or a canvas past its budget).

    The decoder's warnings are silenced (they would be about this tiny model, which the user
    did not choose)."""
    with each_warning_once(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder = DiffusionDecoder(model, strategy.spec, params=strategy.params, gen_length=GEN_LENGTH, seed=SEED)
    session = DecodeSession(decoder, observer=watch)
    if watch is not None:
        watch.session = session
    session.admit(prompts)
    tokens: dict[int, list[int]] = {}
    limit = decoder.steps + 1  # a canvas past its budget shows by then; stop a kernel that never ends one
    for _ in range(limit):
        if not session.size:
            break
        try:
            done = session.step()
        except HookContractError:
            if watch is None or ACCEPTS not in watch.breaks:  # another break of the hook contract: the caller's
                raise
            return None
        if done is not None:
            for row, length, row_tokens in zip(done.rows.tolist(), done.lengths.tolist(), done.token_lists()):
                tokens[row] = row_tokens[:length]
    if session.size:
        return None
    return [tokens[row] for row in range(len(prompts))]


def check_uniform_claims(strategy: Resolved) -> KernelClaims:
    """Test the uniform kernel's claims (``KERNEL_CLAIMS["uniform"]``) on decodes of ``strategy``.

    :raises HookContractError: when a hook breaks its contract otherwise than by accepting
        nothing (the caller reports it).
    """
    model = tiny.tiny_uniform_dllm(0, vocab=VOCAB, canvas=CANVAS, steps=STEPS)
    prompts = tiny.tiny_prompts(PROMPTS, vocab=VOCAB, length=PROMPT_LENGTH, seed=SEED)
    settings = {
        "prompts": PROMPTS, "prompt_length": PROMPT_LENGTH, "gen_length": GEN_LENGTH, "canvas_length": CANVAS,
        "max_denoising_steps": STEPS, "seed": SEED,
    }
    report = KernelClaims(UNIFORM, model.name, settings)
    watch = _Watch(torch.tensor(prompts))
    first = _decode(strategy, model, prompts, watch)
    second = None if first is None else _decode(strategy, model, prompts, None)
    breaks = dict(watch.breaks)
    if first is not None and second is not None and first != second:
        row = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        breaks[DETERMINISTIC] = (
            f"two decodes with seed {SEED} differ: prompt {row}: {first[row]} vs {second[row]}"
        )
    held = {
        PROMPT_KEPT: f"the {PROMPTS} prompts never changed over {watch.row_steps} row steps",
        STEP_BUDGET: (
            f"no canvas took more than its budget of {STEPS} steps (at most "
            f"{max(watch.steps.values(), default=0)})"
        ),
        DETERMINISTIC: f"two decodes with seed {SEED} gave the same tokens",
        ACCEPTS: f"each of {watch.row_steps} row steps accepted a position ({watch.accepted} in all)",
    }
    for name in KERNEL_CLAIMS[UNIFORM]:
        if name in breaks:
            report.claims[name] = {"verdict": "broken", "detail": breaks[name]}
        elif first is None:
            report.claims[name] = {"verdict": "untested", "detail": "the decode stopped at a break"}
        else:
            report.claims[name] = {"verdict": "holds", "detail": held[name]}
    return report
