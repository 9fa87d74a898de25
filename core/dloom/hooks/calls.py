"""Typed calls of the decoding hooks. The core never calls ``pm.hook`` anywhere else.

Every call checks the hook's contract: a plugin that raises something other than a dloom
error, or returns the wrong type or shape, becomes a :class:`~dloom.errors.HookContractError`
naming the plugin and the hook (the plugin's own exception is its ``__cause__``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast, overload

import pluggy
import torch

from dloom.errors import DloomError, HookContractError
from dloom.hooks.specs import SIGNALS_ATTRIBUTE
from dloom.types import (
    BlockSchedule,
    ChainLayout,
    ChainState,
    ChainVerdict,
    DecodeState,
    DraftChains,
    DraftGraph,
    Edits,
    NodeLogits,
    Verdict,
    VerificationLayout,
)

DEFAULTS_PLUGIN = "dloom.defaults"  # the core's fallback plugin (dloom.hooks.composition)


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
    signals: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Positions to unmask: ``(B, K)`` bool, restricted to ``selectable``.

    Whether every row with a selectable position committed one is checked by the decoder
    together with its other per-step checks (one host synchronisation per step).

    :param signals: the signals the rule declared (:func:`declared_signals`), by name;
        ``None``: none.
    """
    return proposed_commit(pm, confidence, selectable, schedule, signals) & selectable


def declared_signals(pm: pluggy.PluginManager) -> tuple[str, ...]:
    """The signals (:data:`~dloom.hooks.specs.COMMIT_SIGNALS`) the commit rules of ``pm``
    declared with :func:`~dloom.hooks.specs.reads_signals`, in declaration order."""
    names: dict[str, None] = {}
    for impl in pm.hook.dloom_select_commit.get_hookimpls():
        names.update(dict.fromkeys(getattr(impl.function, SIGNALS_ATTRIBUTE, ())))
    return tuple(names)


def proposed_commit(
    pm: pluggy.PluginManager,
    confidence: torch.Tensor,
    selectable: torch.Tensor,
    schedule: BlockSchedule,
    signals: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The commit rule's answer as it gave it: ``(B, K)`` bool, type and shape checked but
    *not* restricted to ``selectable``, so that a caller can see commits to positions that
    are not selectable (already decoded, or in a row that is not decoding): a contract
    break that :func:`select_commit` drops. An :class:`~dloom.types.Edits` answer is refused
    (only :func:`proposed_edits` takes one)."""
    answer = _call(
        pm, "dloom_select_commit", confidence=confidence, selectable=selectable, schedule=schedule,
        signals={} if signals is None else signals,
    )
    if isinstance(answer, Edits):
        raise HookContractError(
            f"plugin {providers(pm, 'dloom_select_commit')} returned Edits (deletes and splits) from "
            "dloom_select_commit: only an editing rule (StrategyRegistration(edits=True)) on the revisable "
            "kernel may; return a (B, K) bool tensor"
        )
    return _commit_mask(pm, _answer(pm, answer, "dloom_select_commit", torch.Tensor), selectable, "")


def proposed_edits(
    pm: pluggy.PluginManager,
    confidence: torch.Tensor,
    selectable: torch.Tensor,
    schedule: BlockSchedule,
    signals: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor | Edits:
    """An editing rule's answer as it gave it (on the revisable kernel): a ``(B, K)`` bool
    tensor or an :class:`~dloom.types.Edits` (three tensors, and a fourth, ``remask``, or
    ``None``), each type and shape checked, none restricted to ``selectable`` (as
    :func:`proposed_commit`)."""
    answer = _call(
        pm, "dloom_select_commit", confidence=confidence, selectable=selectable, schedule=schedule,
        signals={} if signals is None else signals,
    )
    if not isinstance(answer, Edits):
        return _commit_mask(pm, _answer(pm, answer, "dloom_select_commit", torch.Tensor), selectable, "")
    for name in ("commit", "delete", "split", "remask"):
        if name == "remask" and answer.remask is None:
            continue
        _check_type(pm, getattr(answer, name), f"dloom_select_commit (Edits.{name})", torch.Tensor)
        _commit_mask(pm, getattr(answer, name), selectable, f" (Edits.{name})")
    return answer


def _commit_mask(pm: pluggy.PluginManager, mask: torch.Tensor, selectable: torch.Tensor, part: str) -> torch.Tensor:
    """``mask``, once it is a bool tensor shaped as ``selectable``."""
    if mask.shape != selectable.shape or mask.dtype != torch.bool:
        raise HookContractError(
            f"plugin {providers(pm, 'dloom_select_commit')}: dloom_select_commit{part} must return a bool tensor of shape "
            f"{tuple(selectable.shape)}, got {mask.dtype} {tuple(mask.shape)}"
        )
    return mask


def configure(pm: pluggy.PluginManager, config: Mapping[str, Any]) -> None:
    """Let every plugin of the decoder check its settings (they raise on a mismatch)."""
    _call(pm, "dloom_configure", config=config)


@overload
def draft(pm: pluggy.PluginManager, state: DecodeState) -> DraftGraph | None: ...
@overload
def draft(pm: pluggy.PluginManager, state: ChainState) -> DraftChains: ...
def draft(pm: pluggy.PluginManager, state: DecodeState | ChainState) -> DraftGraph | DraftChains | None:
    """Drafts for ``state``: a :class:`DraftGraph` of future blocks for a
    :class:`DecodeState`, :class:`DraftChains` of tokens for a :class:`ChainState`; ``None``
    when no plugin speculates this step (a chain state always needs an answer)."""
    graph = _call(pm, "dloom_draft", state=state)
    if isinstance(state, ChainState):
        chains = _answer(pm, graph, "dloom_draft", DraftChains)
        _check_chains(pm, "dloom_draft", chains, state.tokens.shape[0])
        return chains
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


def _check_chains(pm: pluggy.PluginManager, hook: str, chains: DraftChains, rows: int) -> None:
    shapes = (chains.tokens.dim(), chains.tokens.shape[0], tuple(chains.length.shape), tuple(chains.open.shape))
    if shapes != (2, rows, (rows,), (rows,)):
        raise HookContractError(
            f"plugin {providers(pm, hook)}: {hook} returned chains with tokens "
            f"{tuple(chains.tokens.shape)}, length {tuple(chains.length.shape)} and open "
            f"{tuple(chains.open.shape)}; expected ({rows}, T), ({rows},) and ({rows},)"
        )


@overload
def prune(pm: pluggy.PluginManager, graph: DraftGraph, budget: int | None) -> DraftGraph: ...
@overload
def prune(pm: pluggy.PluginManager, graph: DraftChains, budget: int | None) -> DraftChains: ...
def prune(pm: pluggy.PluginManager, graph: DraftGraph | DraftChains, budget: int | None):
    """The drafts cut to at most ``budget`` per row: draft nodes of a :class:`DraftGraph`,
    chain tokens of :class:`DraftChains` (the core default keeps them whole).

    The budget binds every speculator, whether or not it prunes: more drafts after pruning
    is a :class:`~dloom.errors.HookContractError`. A graph is checked here (one host
    synchronisation, only with a budget); chains are checked by the decoder with its next
    host synchronisation (a deferred check added to :attr:`DraftChains.checks`).
    """
    kind = DraftChains if isinstance(graph, DraftChains) else DraftGraph
    pruned = _answer(pm, _call(pm, "dloom_prune", graph=graph, budget=budget), "dloom_prune", kind)
    if budget is None:
        return pruned
    pruners = [p for p in providers(pm, "dloom_prune").split(", ") if p != repr(DEFAULTS_PLUGIN)]
    unpruned = "" if pruners else (
        f" (no plugin prunes: drafter {providers(pm, 'dloom_draft')} must stay within the budget)"
    )
    if isinstance(pruned, DraftChains):
        _check_chains(pm, "dloom_prune", pruned, graph.tokens.shape[0])
        error = HookContractError(
            f"dloom_draft/dloom_prune proposed chains of more than {budget} tokens for a draft "
            f"budget of {budget}{unpruned}"
        )
        return replace(pruned, checks=(*pruned.checks, ((pruned.length > budget).any(), error)))
    kept = int(pruned.valid[:, 1:].sum(-1).max()) if pruned.num_nodes else 0
    if kept > max(budget, 0):
        raise HookContractError(f"dloom_prune kept {kept} drafts in a row for a budget of {budget}{unpruned}")
    return pruned


@overload
def build_mask(pm: pluggy.PluginManager, state: DecodeState, graph: DraftGraph) -> VerificationLayout: ...
@overload
def build_mask(pm: pluggy.PluginManager, state: ChainState, graph: DraftChains) -> ChainLayout: ...
def build_mask(
    pm: pluggy.PluginManager, state: DecodeState | ChainState, graph: DraftGraph | DraftChains
) -> VerificationLayout | ChainLayout:
    """The verification layout for ``graph`` rooted at ``state``."""
    if isinstance(state, ChainState):
        layout = _answer(
            pm, _call(pm, "dloom_build_mask", state=state, graph=graph), "dloom_build_mask", ChainLayout
        )
        rows = state.tokens.shape[0]
        if layout.input_ids.shape != layout.slot_mask.shape or layout.input_ids.shape[0] != rows:
            raise HookContractError(
                f"plugin {providers(pm, 'dloom_build_mask')}: dloom_build_mask returned input_ids "
                f"{tuple(layout.input_ids.shape)} and slot_mask {tuple(layout.slot_mask.shape)}; "
                f"expected two ({rows}, S) tensors"
            )
        return layout
    layout = _answer(
        pm, _call(pm, "dloom_build_mask", state=state, graph=graph), "dloom_build_mask",
        VerificationLayout,
    )
    expected = tuple(cast(DraftGraph, graph).valid.shape)  # a DecodeState's drafts are a graph
    if tuple(layout.node_rows.shape) != expected or tuple(layout.node_offsets.shape) != expected:
        raise HookContractError(
            f"dloom_build_mask returned node_rows {tuple(layout.node_rows.shape)} and "
            f"node_offsets {tuple(layout.node_offsets.shape)}; expected {expected}"
        )
    return layout


@overload
def verify(
    pm: pluggy.PluginManager, state: DecodeState, graph: DraftGraph, logits: NodeLogits,
    kernel: Callable[..., torch.Tensor],
) -> Verdict: ...
@overload
def verify(
    pm: pluggy.PluginManager, state: ChainState, graph: DraftChains, logits: torch.Tensor,
    kernel: Callable[..., torch.Tensor],
) -> ChainVerdict: ...
def verify(
    pm: pluggy.PluginManager,
    state: DecodeState | ChainState,
    graph: DraftGraph | DraftChains,
    logits: NodeLogits | torch.Tensor,
    kernel: Callable[..., torch.Tensor],
) -> Verdict | ChainVerdict:
    """The accepted path of one verification forward."""
    if isinstance(state, ChainState):
        verdict = _answer(
            pm, _call(pm, "dloom_verify", state=state, graph=graph, logits=logits, kernel=kernel),
            "dloom_verify", ChainVerdict,
        )
        rows = (state.tokens.shape[0],)
        if tuple(verdict.accepted.shape) != rows or tuple(verdict.token.shape) != rows:
            raise HookContractError(
                f"plugin {providers(pm, 'dloom_verify')}: dloom_verify returned accepted "
                f"{tuple(verdict.accepted.shape)} and token {tuple(verdict.token.shape)}; "
                f"expected {rows} each"
            )
        return verdict
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
