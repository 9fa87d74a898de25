"""What a verification costs besides its forward, for ``budget="auto"``.

A plain step of the base rule is a forward and one kernel step. A verification of ``D``
drafts is a forward of ``D + 1`` nodes (the cost curve) and, besides, Spiffy's draft, prune
and layout hooks and the verifier's walk: ``min(longest path, D) + 1`` kernel steps
whatever it accepts (:func:`dloom.decode.speculation.follow_graph` reads nothing back to
stop early). On a small model on a CPU these cost a good part of a forward: on
``long-dllm-words`` about 2–4 ms a verification, against a forward of 4–25 ms.

:func:`verification_overhead` times that work on a synthetic state of the decoder's shapes
(one row, a fully masked block of ``K`` positions, random logits of the vocabulary's width),
with the real hooks and the real walk; each kernel step of the walk is the kernel's
proposal (:func:`dloom.decode.kernel.propose`: the softmax over the vocabulary that
dominates a step) and the commit of the most confident position. The plain step's own
kernel step is not subtracted, so the estimate errs towards the base rule.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from dloom.sdk import (
    DecodeState,
    DraftGraph,
    NodeLogits,
    VerificationLayout,
    follow_graph,
    propose,
)


class Drafter(Protocol):
    """What a timed verification calls: Spiffy's budget in effect and its hooks."""

    chosen_budget: int | None

    def dloom_draft(self, state: DecodeState) -> DraftGraph | None: ...
    def dloom_prune(self, graph: DraftGraph, budget: int | None) -> DraftGraph: ...
    def dloom_build_mask(self, state: DecodeState, graph: DraftGraph) -> VerificationLayout: ...


class ProposalKernel:
    """A stand-in for the decoder's kernel step in a timed walk: the proposal over the
    vocabulary, then the most confident masked position committed in each advancing row."""

    def __init__(self, mask_token_id: int) -> None:
        self.mask_token_id = mask_token_id
        self.eos_ids = torch.empty(0, dtype=torch.long)
        self.generated = None

    def __call__(self, block: torch.Tensor, logits: torch.Tensor, advance: torch.Tensor) -> torch.Tensor:
        candidates, confidence = propose(logits, 0.0, "low_confidence", None, self.mask_token_id)
        masked = block == self.mask_token_id
        pick = torch.where(masked, confidence, -torch.inf).argmax(-1, keepdim=True)  # (B, 1)
        stepped = block.scatter(1, pick, candidates.gather(1, pick))
        return torch.where((advance.unsqueeze(1) & masked.any(-1, keepdim=True)), stepped, block)


def verification_overhead(
    plugin: Drafter, config: Mapping[str, Any], budgets: Sequence[int], repeats: int = 5,
) -> list[float]:
    """Seconds of one verification's work besides its forward, for each ``D`` of
    ``budgets`` (module docstring), the median of ``repeats`` after one untimed run.

    :param plugin: a Spiffy whose graph is loaded; its budget in effect is set to each ``D``
        in turn (the caller sets it afterwards).
    :param config: the decoder's settings (``block_length``, ``vocab_size``, ``device``,
        ``shift_logits``).
    """
    width, vocab = int(config["block_length"]), int(config["vocab_size"])
    device = torch.device(config.get("device", "cpu"))
    shift = 1 if config.get("shift_logits") else 0
    mask = vocab - 1
    kernel = ProposalKernel(mask)
    kernel.eos_ids = kernel.eos_ids.to(device)
    one = torch.ones(1, dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    state = DecodeState(
        tokens=torch.full((1, shift + width), mask, dtype=torch.long, device=device),
        attention_mask=torch.ones(1, shift + width, dtype=torch.long, device=device),
        block_start=shift, block_end=shift + width, mask_token_id=mask, active=one,
        logits=torch.randn(1, width, vocab, generator=generator, device=device), span_start=0,
        known=one, width=width, span_lead=shift,
    )
    drawn: list[torch.Tensor] = []  # random outputs, drawn at the first (largest) budget's shape

    def random_outputs(rows: int, columns: int) -> torch.Tensor:
        if not drawn or drawn[0].shape[0] < rows or drawn[0].shape[1] < columns:
            drawn[:] = [torch.randn(rows, columns, vocab, generator=generator, device=device)]
        return drawn[0][:rows, :columns]

    def verification() -> float:
        sync()
        started = time.perf_counter()
        graph = plugin.dloom_draft(state)
        assert graph is not None, "a known distribution and a masked block: drafts"
        graph = plugin.dloom_prune(graph, None)
        layout = plugin.dloom_build_mask(state, graph)
        sync()
        hooks = time.perf_counter() - started
        columns = layout.input_ids.shape[1] + (width if layout.next_block else 0)
        outputs = random_outputs(layout.input_ids.shape[0], columns)
        sync()
        started = time.perf_counter()
        follow_graph(graph, NodeLogits(outputs, layout, width), kernel)  # type: ignore[arg-type]
        sync()
        return hooks + time.perf_counter() - started

    found = {}
    for budget in sorted(budgets, reverse=True):  # the largest first: one draw of outputs serves all
        plugin.chosen_budget = budget
        verification()
        times = [verification() for _ in range(repeats)]
        found[budget] = statistics.median(times)
    return [found[budget] for budget in budgets]
