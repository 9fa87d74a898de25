"""The claims a transition kernel brings, tested on decodes of a strategy that runs on it.

:func:`check_kernel_claims` tests those of the revisable kernel (below);
:mod:`dloom.check.uniform_claims` those of the uniform-noise kernel.

On the revisable kernel (:mod:`dloom.decode.revisable`) an editing rule rewrites filled
positions until its block settles. Whatever the rule, decodes on that kernel keep five
promises (:data:`KERNEL_CLAIMS`):

* ``prompt_kept``: prompt tokens are never edited (the kernel offers the rule no prompt
  position, so only a broken kernel breaks it);
* ``edit_budget``: a block ends within the strategy's edit budget
  (:attr:`dloom.types.StrategyRegistration.edit_budget`; a fill rule's is 0): the rule
  edits nothing in a post step (a step begun with no mask in the block) past the budget.
  In a decode the kernel cuts a block off once its budget is spent, so a rule that would
  edit further is silently truncated: the check lifts the cut-off by one post step and
  watches that step;
* ``deterministic``: two decodes with one seed give the same tokens (the kernel draws from
  per-row streams of the seed; a rule drawing from an unseeded source breaks it);
* ``fills``: every step that begins with a masked position fills at least one;
* ``progress``: every such step (a fill step) leaves the row's block with fewer masks than it
  began with, whatever the rule remasks (:attr:`dloom.types.Edits.remask`; the kernel keeps
  at most one remask fewer than the step's fills), so a block ends within ``K`` fill steps
  plus its edit budget. A broken kernel that kept every remask asked for would let a rule
  loop forever: the check stops a decode at the first step that breaks it.

:func:`check_kernel_claims` decodes :data:`PROMPTS` seeded random prompts on a tiny model
of the kernel (:func:`dloom.check.tiny.tiny_revisable_dllm`) at temperature 1, three times:
twice as a user would (``deterministic``) and once with the cut-off lifted
(``edit_budget``), watching every step of each (``prompt_kept``, ``fills``, ``progress``). The absorbing
kernel's claims (a committed token is final, at least one commit per step) are those of
the hook contract probe (:mod:`dloom.check.contract`) and the lossless checks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from dloom.check import tiny
from dloom.check.resolve import Resolved
from dloom.decode.decoder import DiffusionDecoder
from dloom.decode.session import StepRecord
from dloom.decode.transition import REVISABLE, UNIFORM
from dloom.errors import HookContractError, each_warning_once

PROMPT_KEPT = "prompt_kept"
EDIT_BUDGET = "edit_budget"
DETERMINISTIC = "deterministic"
FILLS = "fills"
PROGRESS = "progress"
STEP_BUDGET = "step_budget"
ACCEPTS = "accepts"
KERNEL_CLAIMS: dict[str, tuple[str, ...]] = {
    REVISABLE: (PROMPT_KEPT, EDIT_BUDGET, DETERMINISTIC, FILLS, PROGRESS),
    UNIFORM: (PROMPT_KEPT, STEP_BUDGET, DETERMINISTIC, ACCEPTS),
}
"""The claims ``dloom check`` tests on decodes, by kernel (:data:`dloom.decode.transition.KERNELS`)."""

TINY: dict[str, Any] = {"vocab": 16, "hidden": 32, "layers": 2, "init": 0.8}
"""The tiny model of the kernel checks (as the greedy check's, block-causal and revisable)."""
PROMPTS = 8
PROMPT_LENGTH = 5
"""Not a multiple of :data:`BLOCK_LENGTH`: every first block holds a prompt position."""
GEN_LENGTH = 8
BLOCK_LENGTH = 4
TEMPERATURE = 1.0
SEED = 0


@dataclass
class KernelClaims:
    """What :func:`check_kernel_claims` found.

    :ivar kernel: the kernel whose claims were tested.
    :ivar model: the tiny model's name.
    :ivar settings: the decodes' settings.
    :ivar claims: per claim of :data:`KERNEL_CLAIMS`: ``{"verdict": "holds" | "broken" |
        "untested", "detail": one sentence}`` (the first break seen, or what held).
    """

    kernel: str
    model: str
    settings: dict[str, Any]
    claims: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        """The broken claims, in the order of :data:`KERNEL_CLAIMS`."""
        return [name for name, outcome in self.claims.items() if outcome["verdict"] == "broken"]

    def to_json(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel, "model": self.model, "settings": self.settings, "claims": self.claims,
            "failed": self.failed,
        }


class _Watch:
    """An observer of every plain step (:class:`dloom.decode.session.StepRecord`): records
    the first break of ``prompt_kept``, ``edit_budget``, ``fills`` and ``progress``, and what
    held; raises :class:`~dloom.errors.HookContractError` at a break of ``progress``, which
    stops the decode (it might never end).

    A position not masked at the first step of its row's block is a prompt position (a
    block starts with its generated positions masked).

    :ivar stopped: the claim whose break stopped the decode (``fills``: the decoder stopped
        it; ``progress``: the watch), or ``None``.
    """

    def __init__(self, mask_id: int, budget: int) -> None:
        self.mask_id, self.budget = mask_id, budget
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.post_steps: dict[tuple[int, int], int] = {}
        self.breaks: dict[str, str] = {}
        self.fill_steps = 0
        self.edits = 0
        self.remasks = 0
        self.stopped: str | None = None

    def _break(self, claim: str, problem: str) -> None:
        self.breaks.setdefault(claim, problem)

    def __call__(self, record: StepRecord) -> None:
        masked_before = (record.before == self.mask_id).sum(-1).tolist()
        masked_after = (record.after == self.mask_id).sum(-1).tolist()
        for i, key in enumerate(zip(record.rows.tolist(), record.block.tolist())):
            before, after = record.before[i], record.after[i]
            where = f"prompt {key[0]}, block {key[1]}"
            if key not in self.kept:
                self.kept[key] = (before != self.mask_id, before.clone())
            prompt, tokens = self.kept[key]
            if not torch.equal(after[prompt], tokens[prompt]):
                edited = torch.nonzero(prompt & (after != tokens)).flatten().tolist()
                self._break(PROMPT_KEPT, f"{where}: prompt position(s) {edited} of the block were edited")
            changed = after != before
            if masked_before[i]:
                self.fill_steps += 1
                self.edits += int((changed & (before != self.mask_id)).sum())
                self.remasks += int(((before != self.mask_id) & (after == self.mask_id)).sum())
                if not bool(((before == self.mask_id) & (after != self.mask_id)).any()):
                    self._break(FILLS, f"{where}: a step began with {masked_before[i]} masked position(s) and filled none")
                    self.stopped = FILLS  # the decoder stops at this step
                elif masked_after[i] >= masked_before[i]:
                    self._break(
                        PROGRESS,
                        f"{where}: a fill step began with {masked_before[i]} masked position(s) and ended with "
                        f"{masked_after[i]}",
                    )
                    self.stopped = PROGRESS
                    raise HookContractError(f"kernel claim {PROGRESS!r} broken: a fill step left as many masks")
                continue
            steps = self.post_steps[key] = self.post_steps.get(key, 0) + 1
            self.edits += int(changed.sum())
            if bool(changed.any()) and steps > self.budget:
                self._break(
                    EDIT_BUDGET, f"{where}: the rule edited in post step {steps}, past its edit budget of {self.budget}",
                )


def _decode(strategy: Resolved, model, prompts: list[list[int]], lift: bool) -> tuple[_Watch, torch.Tensor | None]:
    """One seeded decode of ``prompts`` with ``strategy``, watched; its sequences, or ``None``
    when it stopped at a step that filled nothing (the decoder) or left no fewer masks (the
    watch; the watch names either).
    ``lift``: the kernel's cut-off one post step past the edit budget.

    The decoder's warnings are silenced (they would be about this tiny model and the check's
    temperature, which the user did not choose: a bound not certified at temperature 1),
    and the lines that issue them stay free to warn in the checks that follow."""
    with each_warning_once(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder = DiffusionDecoder(
            model, strategy.spec, params=strategy.params, gen_length=GEN_LENGTH, block_length=BLOCK_LENGTH,
            temperature=TEMPERATURE, seed=SEED,
        )
    options = decoder.kernel_options
    budget = options["post_step_budget"] if options.get("edits") else 0
    if lift and options.get("edits"):
        decoder.kernel_options = {**options, "post_step_budget": budget + 1}
    watch = _Watch(model.mask_token_id, budget)
    try:
        result = decoder.generate(prompts, observer=watch)
    except HookContractError:
        if watch.stopped not in (FILLS, PROGRESS):  # another break of the hook contract: the caller's to report
            raise
        return watch, None
    start = result.sequences[:, : len(prompts[0])]
    if not torch.equal(start, torch.tensor(prompts)):
        rows = torch.nonzero((start != torch.tensor(prompts)).any(-1)).flatten().tolist()
        watch._break(PROMPT_KEPT, f"the decoded sequences of prompt(s) {rows} no longer start with their prompt")
    return watch, result.sequences


def check_kernel_claims(strategy: Resolved, kernel: str = REVISABLE) -> KernelClaims:
    """Test the claims of ``kernel`` (:data:`KERNEL_CLAIMS`) on decodes of ``strategy``.

    :raises HookContractError: when a hook breaks its contract otherwise than by filling
        nothing (the caller reports it).
    :raises KeyError: for another kernel than the revisable one.
    """
    if kernel != REVISABLE:
        raise KeyError(f"kernel {kernel!r}; allowed: {REVISABLE!r} (the uniform kernel's: dloom.check.uniform_claims)")
    names = KERNEL_CLAIMS[kernel]
    model = tiny.tiny_revisable_dllm(0, **TINY)
    prompts = tiny.tiny_prompts(PROMPTS, vocab=TINY["vocab"], length=PROMPT_LENGTH, seed=SEED)
    settings = {
        "prompts": PROMPTS, "prompt_length": PROMPT_LENGTH, "gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH,
        "temperature": TEMPERATURE, "seed": SEED,
    }
    report = KernelClaims(kernel, model.name, settings)
    first, first_out = _decode(strategy, model, prompts, lift=False)
    watches = [first]
    second_out = None
    if first_out is not None:
        second, second_out = _decode(strategy, model, prompts, lift=False)
        lifted, _ = _decode(strategy, model, prompts, lift=True)
        watches += [second, lifted]
    breaks: dict[str, str] = {}
    for watch in watches:
        for claim, problem in watch.breaks.items():
            breaks.setdefault(claim, problem)
    if first_out is not None and second_out is not None and not torch.equal(first_out, second_out):
        row, column = torch.nonzero(first_out != second_out)[0].tolist()
        breaks[DETERMINISTIC] = (
            f"two decodes with seed {SEED} differ: prompt {row}, position {column}: "
            f"{int(first_out[row, column])} vs {int(second_out[row, column])}"
        )
    kept = sum(int(prompt.sum()) for prompt, _ in first.kept.values())
    held = {
        PROMPT_KEPT: f"{kept} prompt positions in the first blocks never changed",
        EDIT_BUDGET: (
            f"no edit past the budget of {watches[-1].budget} post step(s) with the cut-off lifted "
            f"({watches[-1].edits} edits in all, at most {max(watches[-1].post_steps.values(), default=0)} "
            "post steps in a block)"
        ),
        DETERMINISTIC: f"two decodes with seed {SEED} gave the same tokens",
        FILLS: f"each of {first.fill_steps} steps that began with a mask filled one",
        PROGRESS: (
            f"each of {first.fill_steps} steps that began with a mask left fewer ({first.remasks} remask(s) in all)"
        ),
    }
    stopped = {FILLS: "filled nothing", PROGRESS: "left its block no fewer masks"}
    for name in names:
        if name in breaks:
            report.claims[name] = {"verdict": "broken", "detail": breaks[name]}
        elif first_out is None:
            what = stopped[first.stopped or FILLS]
            report.claims[name] = {"verdict": "untested", "detail": f"the decode stopped at a step that {what}"}
        else:
            report.claims[name] = {"verdict": "holds", "detail": held[name]}
    return report
