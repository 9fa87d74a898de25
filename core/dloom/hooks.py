"""Typed calls of the decoding hooks. The core never calls ``pm.hook`` anywhere else.

Every call checks the hook's contract: a plugin that raises something other than a dloom
error, or returns the wrong type or shape, becomes a :class:`~dloom.errors.HookContractError`
naming the plugin and the hook (the plugin's own exception is its ``__cause__``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pluggy
import torch

from dloom.errors import DloomError, HookContractError
from dloom.types import BlockSchedule, DecodeState, DraftGraph, Verdict, VerificationLayout


def providers(pm: pluggy.PluginManager, hook: str) -> str:
    """The plugins that answer ``hook`` (wrappers left out), for messages."""
    names = [
        impl.plugin_name for impl in getattr(pm.hook, hook).get_hookimpls()
        if not (impl.wrapper or impl.hookwrapper)
    ]
    return ", ".join(repr(n) for n in reversed(names)) or "(none)"


def _call(pm: pluggy.PluginManager, hook: str, **kwargs: Any) -> Any:
    """``pm.hook.<hook>(**kwargs)``; a non-dloom exception becomes a HookContractError."""
    try:
        return getattr(pm.hook, hook)(**kwargs)
    except DloomError:
        raise
    except Exception as error:  # noqa: BLE001 - a plugin's failure, named with its hook
        raise HookContractError(
            f"plugin {providers(pm, hook)} raised {type(error).__name__} in {hook}: {error}"
        ) from error


def _answer(pm: pluggy.PluginManager, value, hook: str, kind: type):
    if value is None:
        raise HookContractError(f"no plugin answered {hook}; the composition lacks a provider")
    _check_type(pm, value, hook, kind)
    return value


def _check_type(pm: pluggy.PluginManager, value, hook: str, kind: type) -> None:
    if not isinstance(value, kind):
        raise HookContractError(
            f"plugin {providers(pm, hook)} returned a {type(value).__name__} from {hook}; "
            f"expected a {kind.__name__}"
        )


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
        pm,
        _call(
            pm, "dloom_select_commit", confidence=confidence, selectable=selectable, schedule=schedule
        ),
        "dloom_select_commit",
        torch.Tensor,
    )
    if commit.shape != selectable.shape or commit.dtype != torch.bool:
        raise HookContractError(
            f"plugin {providers(pm, 'dloom_select_commit')}: dloom_select_commit must return a bool tensor of shape {tuple(selectable.shape)}, "
            f"got {commit.dtype} {tuple(commit.shape)}"
        )
    return commit & selectable


def configure(pm: pluggy.PluginManager, config: Mapping[str, Any]) -> None:
    """Let every plugin of the decoder check its settings (they raise on a mismatch)."""
    _call(pm, "dloom_configure", config=config)


def draft(pm: pluggy.PluginManager, state: DecodeState) -> DraftGraph | None:
    """A draft graph, or ``None`` when no plugin speculates this step."""
    graph = _call(pm, "dloom_draft", state=state)
    if graph is not None:
        _check_type(pm, graph, "dloom_draft", DraftGraph)
        rows, width = state.block.shape
        nodes = graph.depth.shape[0]
        if graph.tokens.shape != (rows, nodes, width) or graph.parents.shape != (nodes, nodes):
            raise HookContractError(
                f"dloom_draft returned tokens {tuple(graph.tokens.shape)} and parents "
                f"{tuple(graph.parents.shape)} for {nodes} nodes; expected "
                f"{(rows, nodes, width)} and {(nodes, nodes)} (node 0 is the root)"
            )
    return graph


def prune(pm: pluggy.PluginManager, graph: DraftGraph, budget: int | None) -> DraftGraph:
    """The graph with at most ``budget`` valid drafts per row (the core default keeps it
    whole: without a pruning plugin a budget is not enforced)."""
    pruned = _answer(pm, _call(pm, "dloom_prune", graph=graph, budget=budget), "dloom_prune", DraftGraph)
    if budget is not None and pruned is not graph:
        kept = int(pruned.valid[:, 1:].sum(-1).max()) if pruned.num_nodes else 0
        if kept > max(budget, 0):
            raise HookContractError(
                f"dloom_prune kept {kept} drafts in a row for a budget of {budget}"
            )
    return pruned


def build_mask(
    pm: pluggy.PluginManager, state: DecodeState, graph: DraftGraph
) -> VerificationLayout:
    """The verification layout for ``graph`` rooted at ``state``."""
    layout = _answer(
        pm, _call(pm, "dloom_build_mask", state=state, graph=graph), "dloom_build_mask",
        VerificationLayout,
    )
    expected = tuple(graph.valid.shape)
    if tuple(layout.node_rows.shape) != expected or tuple(layout.node_offsets.shape) != expected:
        raise HookContractError(
            f"dloom_build_mask returned node_rows {tuple(layout.node_rows.shape)} and "
            f"node_offsets {tuple(layout.node_offsets.shape)}; expected {expected}"
        )
    return layout


def verify(
    pm: pluggy.PluginManager,
    state: DecodeState,
    graph: DraftGraph,
    logits: torch.Tensor,
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> Verdict:
    """The accepted path of one verification forward."""
    verdict = _answer(
        pm, _call(pm, "dloom_verify", state=state, graph=graph, logits=logits, kernel=kernel),
        "dloom_verify", Verdict,
    )
    if verdict.block.shape != state.block.shape:
        raise HookContractError(
            f"dloom_verify returned a block of shape {tuple(verdict.block.shape)}; expected "
            f"{tuple(state.block.shape)}"
        )
    return verdict
