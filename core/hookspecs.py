"""The hooks of dloom: what a strategy plugin may implement.

A decoder owns one :class:`pluggy.PluginManager` holding exactly the plugins of its strategy
(plus cross-cutting wrappers such as timing and tracing). Every decoding hook is
*single-answer* (``firstresult``): the first non-``None`` result wins and ``None`` only ever
means "not me". Two plugins answering the same decoding hook in one decoder is a
composition error, raised when the decoder is built.

The core calls these hooks only through the typed functions in :mod:`dloom.hooks`.

Shapes used below: ``B`` rows in the batch, ``K`` positions in the active block (or draft
span), ``V`` vocabulary size, ``N`` draft-graph nodes, ``R`` rows of a verification layout,
``S`` its sequence length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:
    import torch

    from dloom.types import (
        BlockSchedule,
        DecodeState,
        DraftGraph,
        StrategyRegistration,
        Verdict,
        VerificationLayout,
    )

PROJECT_NAME = "dloom"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def dloom_register_strategies(register: Callable[[StrategyRegistration], None]) -> None:
    """Register the strategies this plugin provides.

    Called once per process on the global registry, for every plugin loaded from the
    ``dloom`` entry-point group (built-ins included).

    :param register: call it once per strategy with a
        :class:`~dloom.types.StrategyRegistration`. The core stamps each strategy with the
        name of the plugin that registered it and rejects a name that is already taken.
    """


@hookspec(firstresult=True)
def dloom_select_commit(
    confidence: torch.Tensor,
    selectable: torch.Tensor,
    schedule: BlockSchedule,
) -> torch.Tensor | None:
    """Choose which masked positions of the active block to unmask this step.

    Stops at the first non-``None`` result.

    :param confidence: ``(B, K)`` float64, the confidence of each position's candidate
        token (its probability, or Dream's margin / negative entropy, or a uniform draw under
        ``random`` remasking). Values at non-selectable positions are meaningless.
    :param selectable: ``(B, K)`` bool, masked positions of the active block in rows that are
        still decoding. Rows with no selectable position must commit nothing.
    :param schedule: where this step lies in the block's step budget (used by quota rules).
    :return: ``(B, K)`` bool, the positions to commit: a subset of ``selectable`` holding at
        least one position in every row that has a selectable one; ``None`` if this plugin
        is not a commit rule.
    """


@hookspec(firstresult=True)
def dloom_draft(state: DecodeState) -> DraftGraph | None:
    """Speculate future states and return them as a draft graph.

    Stops at the first non-``None`` result; with no implementation the decoder does not
    speculate and runs one forward per step.

    :param state: the current decode state, including the most recent distribution over the
        active block (``state.logits``, ``(B, K, V)``) when one is known.
    :return: a :class:`~dloom.types.DraftGraph` whose nodes are guessed future states of the
        span, or ``None`` to decline (for example before any distribution is known).
    """


@hookspec(firstresult=True)
def dloom_prune(graph: DraftGraph, budget: int) -> DraftGraph | None:
    """Shrink a draft graph to at most ``budget`` nodes, keeping every node reachable.

    Stops at the first non-``None`` result; the core's default keeps the graph as it is.

    :param graph: the graph from :func:`dloom_draft`.
    :param budget: the most nodes the verification forward may evaluate (``D*``).
    :return: a graph with ``N <= budget`` nodes, or ``None`` to leave the choice to the
        next implementation.
    """


@hookspec(firstresult=True)
def dloom_build_mask(state: DecodeState, graph: DraftGraph) -> VerificationLayout | None:
    """Lay out one forward pass that evaluates the current state and every draft node.

    Stops at the first non-``None`` result.

    :param state: the current decode state (the root of the graph).
    :param graph: the (pruned) draft graph.
    :return: a :class:`~dloom.types.VerificationLayout`: ``(R, S)`` input ids, attention
        mask and position ids, and where each ``(row, node)`` span sits in it.
    """


@hookspec(firstresult=True)
def dloom_verify(
    state: DecodeState,
    graph: DraftGraph,
    layout: VerificationLayout,
    logits: torch.Tensor,
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Verdict | None:
    """Decide which draft steps the verification forward accepts.

    Stops at the first non-``None`` result. A lossless implementation samples the real next
    state with ``kernel`` and follows the graph only while the sample equals a draft node.

    :param state: the state the forward started from.
    :param graph: the graph that was evaluated.
    :param layout: the layout the forward ran on.
    :param logits: ``(R, S, V)`` logits of that forward, already aligned so that
        ``logits[:, i]`` is the distribution of token ``i``.
    :param kernel: one step of the transition kernel: ``kernel(tokens, logits)`` maps a
        ``(B, K)`` span state and its ``(B, K, V)`` logits to the next span state.
    :return: a :class:`~dloom.types.Verdict` with the new state and how many steps each row
        advanced.
    """
