"""Spiffy's draft budget chosen for the hardware: ``budget=auto``.

A verification forward of ``D`` drafts evaluates ``D + 1`` nodes per batch row and takes
``1 + A(D)`` kernel steps, where ``A(D)`` is the expected number of drafts it accepts; a
plain step of the base rule takes one step for a forward of one node. Every kernel step
commits what the base rule commits, so over a block of ``s`` steps, whose first forward
has nothing to draft from, the expected speed-up under a forward cost curve
(:class:`dloom.model.cost.CostCurve`) is

    ``s cost(1) / (cost(1) + (s - 1) / (1 + A(D)) (cost(D + 1) + h(D)))``

where ``h(D)`` is a verification's work besides its forward (Spiffy's hooks and the
verifier's walk, :mod:`dloom_plugins.spiffy.overhead`): measured, it is what keeps a small
model on a CPU from drafting where its forwards alone would say it pays.
:func:`choose_budget` takes the ``D`` that maximises it if it beats the base rule by
:data:`MIN_GAIN` (:data:`CACHED_MIN_GAIN` with a cache); ``D = 0`` is the base rule alone.

``A(D)`` of a calibrated graph (:func:`expected_accepted`). Calibration keeps nodes one at a
time, each the best-scoring node with a kept parent, so the first ``D`` nodes of that order
are a connected graph of ``D`` drafts. A graph made by this dloom records, in its
``calibration``, ``"accepted"``: for each ``D`` the drafts a verification of the first
``D`` nodes accepts on the calibration paths, averaged over the ``"roots"`` drafting started
from (:func:`accepted_on_paths`). For an older graph (the built-in ones) it is estimated at
load from the nodes' frequencies: ``A(D) = sum of frequency(n) / paths`` over the first
``D`` nodes. That counts a node's visits whether or not the path reached it through kept
nodes, and divides by the roots that had a path, so it over-estimates ``A`` slightly.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from dloom.sdk import ConfigurationError, CostCurve

from .graph import CalibratedGraph, GraphNode

S = TypeVar("S", bound=Hashable)


def selection_order(nodes: Sequence[GraphNode]) -> list[int]:
    """Node ids (1-based) in the order calibration kept them: repeatedly the highest-scoring
    node with a parent already kept (ties: the smaller id, fewer pairs first in the file)."""
    kept: list[int] = []
    kept_set = {0}
    while len(kept) < len(nodes):
        frontier = [i for i, node in enumerate(nodes, start=1) if i not in kept_set and set(node.parents) & kept_set]
        best = max(frontier, key=lambda i: (nodes[i - 1].score, -i))
        kept.append(best)
        kept_set.add(best)
    return kept


def accepted_on_paths(paths: Mapping[tuple[S, ...], int], roots: int, order: Sequence[S]) -> list[float]:
    """``[A(1), ..., A(D)]``: for the first ``D`` formulas of ``order``, the drafts a
    verification accepts on the recorded ``paths`` (each a root's later states, counted),
    averaged over ``roots``: a path is followed while its states are kept drafts."""
    if roots < 1:
        raise ConfigurationError(f"roots is {roots!r}; allowed: >= 1")
    found = []
    for budget in range(1, len(order) + 1):
        kept = set(order[:budget])
        total = 0
        for path, count in paths.items():
            steps = 0
            while steps < len(path) and path[steps] in kept:
                steps += 1
            total += steps * count
        found.append(total / roots)
    return found


def expected_accepted(graph: CalibratedGraph) -> list[float]:
    """``[A(0) = 0, A(1), ..., A(D)]`` for the graph's nested budgets (module docstring).

    :raises ConfigurationError: for a recorded ``accepted`` list of another length.
    """
    recorded = graph.calibration.get("accepted")
    if recorded is not None:
        if not isinstance(recorded, list) or len(recorded) != graph.budget:
            raise ConfigurationError(
                f"draft graph calibration 'accepted' is {recorded!r}; expected {graph.budget} numbers, one per budget"
            )
        return [0.0, *(float(a) for a in recorded)]
    paths = max(float(graph.calibration.get("paths", 0) or 0), 1.0)
    found, total = [0.0], 0.0
    for node_id in selection_order(graph.nodes):
        total += graph.nodes[node_id - 1].frequency
        found.append(total / paths)
    return found


MIN_GAIN = 1.1
"""The expected speed-up over the base rule a drafting budget must reach to be chosen: the
decoder's own work per step (its bookkeeping, the session's host read) is in neither the
forward cost curve nor the measured verification overhead."""

CACHED_MIN_GAIN = 1.25
""":data:`MIN_GAIN` with a prefix or dual cache, where the curve's uncached forwards only
approximate a verification: a cached row also attends to the cached columns and takes its
own copy of its row's cache. On ``long-dllm-words`` and ``random-512x8`` on a CPU the
budgets chosen with a cache under :data:`MIN_GAIN` ran at 76–89 % of the speed-up expected
(``docs/benchmarks/cost.md``)."""


def steps_per_block(graph: CalibratedGraph) -> float:
    """``s``, the base rule's mean kernel steps per block on the calibration prompts: each
    step but a block's last leaves a root (``roots``, else ``paths``, per block, plus one);
    an uncalibrated graph gives the rule's step budget per block."""
    info = graph.calibration
    roots = info.get("roots", info.get("paths"))
    prompts, gen_length = info.get("prompts"), info.get("gen_length")
    if not roots or not prompts or not gen_length:
        return float(graph.base["steps_per_block"])
    blocks = prompts * max(gen_length // graph.block_length, 1)
    return roots / blocks + 1


def speedups(
    accepted: Sequence[float], cost: CostCurve, steps: float, overhead: Sequence[float] | None = None,
) -> list[float]:
    """Expected tokens per second of each ``D`` against the base rule's (``D = 0``: 1).

    A block takes ``steps`` forwards of one node under the base rule. Under Spiffy its first
    forward has no distribution to draft from (one node); each later verification of ``D``
    drafts takes ``1 + A(D)`` of the remaining ``steps - 1`` steps for a forward of ``D + 1``
    nodes and ``overhead[D]`` seconds of work besides
    (:func:`dloom_plugins.spiffy.overhead.verification_overhead`; ``None``: none).
    """
    extra = [0.0] * len(accepted) if overhead is None else overhead
    if len(extra) < len(accepted):
        raise ConfigurationError(f"overhead has {len(extra)} entries; expected one per budget, {len(accepted)}")
    plain = steps * cost(1)
    return [1.0] + [
        plain / (cost(1) + (steps - 1) / (1 + a) * (cost(d + 1) + extra[d])) for d, a in enumerate(accepted) if d
    ]


def choose_budget(
    accepted: Sequence[float], cost: CostCurve, steps: float, overhead: Sequence[float] | None = None,
    min_gain: float = MIN_GAIN,
) -> int:
    """The ``D`` in ``0 .. len(accepted) - 1`` of the most expected tokens per second
    (:func:`speedups`), or ``0`` when none reaches ``min_gain``. Ties go to the larger
    ``D``: drafts that cost nothing more may still be accepted (an uncalibrated graph, whose
    ``A`` is unknown and taken as 0, never drafts).

    :param accepted: ``A(D)`` for each ``D``, ``accepted[0] == 0``.
    :param cost: the forward's cost curve, in nodes per batch row.
    :param steps: the base rule's kernel steps per block (:func:`steps_per_block`).
    :param overhead: seconds of each verification's work besides its forward, per ``D``
        (``overhead[0]`` unused; ``None``: none).
    :param min_gain: the bar (:data:`MIN_GAIN`, or :data:`CACHED_MIN_GAIN` with a cache).
    """
    gains = speedups(accepted, cost, steps, overhead)
    best = max(range(len(gains)), key=lambda d: (gains[d], d))
    return best if gains[best] >= min_gain else 0
