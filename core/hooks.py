"""Typed calls of the decoding hooks. The core never calls ``pm.hook`` anywhere else."""

from __future__ import annotations

from typing import Callable

import pluggy
import torch

from dloom.errors import HookContractError
from dloom.types import BlockSchedule, DecodeState, DraftGraph, Verdict, VerificationLayout


def _answer(value, hook: str):
    if value is None:
        raise HookContractError(f"no plugin answered {hook}; the composition lacks a provider")
    return value


def select_commit(
    pm: pluggy.PluginManager,
    confidence: torch.Tensor,
    selectable: torch.Tensor,
    schedule: BlockSchedule,
) -> torch.Tensor:
    """Positions to unmask: ``(B, K)`` bool, restricted to ``selectable``.

    Whether every row with a selectable position committed one is checked by the decoder
    together with its other per-step checks (one host synchronisation per step).
    """
    commit = _answer(
        pm.hook.dloom_select_commit(
            confidence=confidence, selectable=selectable, schedule=schedule
        ),
        "dloom_select_commit",
    )
    if commit.shape != selectable.shape or commit.dtype != torch.bool:
        raise HookContractError(
            f"dloom_select_commit must return a bool tensor of shape {tuple(selectable.shape)}, "
            f"got {commit.dtype} {tuple(commit.shape)}"
        )
    return commit & selectable


def draft(pm: pluggy.PluginManager, state: DecodeState) -> DraftGraph | None:
    """A draft graph, or ``None`` when no plugin speculates this step."""
    return pm.hook.dloom_draft(state=state)


def prune(pm: pluggy.PluginManager, graph: DraftGraph, budget: int) -> DraftGraph:
    """The graph cut to at most ``budget`` nodes (the core default keeps it whole)."""
    pruned = _answer(pm.hook.dloom_prune(graph=graph, budget=budget), "dloom_prune")
    if pruned.num_nodes > max(budget, 0) and pruned is not graph:
        raise HookContractError(
            f"dloom_prune returned {pruned.num_nodes} nodes for a budget of {budget}"
        )
    return pruned


def build_mask(
    pm: pluggy.PluginManager, state: DecodeState, graph: DraftGraph
) -> VerificationLayout:
    """The verification layout for ``graph`` rooted at ``state``."""
    return _answer(pm.hook.dloom_build_mask(state=state, graph=graph), "dloom_build_mask")


def verify(
    pm: pluggy.PluginManager,
    state: DecodeState,
    graph: DraftGraph,
    layout: VerificationLayout,
    logits: torch.Tensor,
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Verdict:
    """The accepted path of one verification forward."""
    return _answer(
        pm.hook.dloom_verify(
            state=state, graph=graph, layout=layout, logits=logits, kernel=kernel
        ),
        "dloom_verify",
    )
