"""Calibration: record the reference process and keep its most frequent draft formulas.

For every step of the base strategy run one forward per step, the state reached is a root
``X``, and the distribution of its predecessor is the one drafts would be filled from at
run time. Each later state of the block, ``X1, X2, ...``, is written as a formula: the
``(position rank, vocabulary rank)`` pairs of the tokens committed since ``X``, in that
frame (:mod:`dloom_plugins.spiffy.frame`). A path ends at the block's end, at a row that
finished, or at a token outside the ``token_ranks`` most likely ones. Two paths reaching
the same formula count for the same node, whose parents are every formula that preceded it
on some path.

Selection of ``D`` nodes: starting from the root, repeatedly add the node with the highest
score among nodes with a parent already kept, so the kept subgraph stays connected (ties:
fewer pairs, then the smaller formula). Scores (:data:`SCORES`, recorded in the file):

* ``"own"`` (the default): ``frequency(n)``, how often the node itself was reached;
* ``"own+parents"`` (the paper's best score): ``frequency(n) + sum of frequency(p)`` over
  the node's non-root parents ``p``. On the toy zoo it keeps rare siblings of frequent
  nodes over deeper frequent nodes, and accepts fewer drafts (``docs/strategies/spiffy.md``).

The kept nodes are written in order of their number of pairs (a child always has more
pairs than its parents), each with the kept subset of its parents. The file's
``calibration`` records the roots drafting started from (``roots``) and, for each nested
budget ``D``, the drafts a verification of the first ``D`` kept nodes accepts on the
recorded paths, per root (``accepted``: what ``budget=auto`` weighs,
:mod:`dloom_plugins.spiffy.budget`).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dloom import DiffusionDecoder
from dloom.sdk import ConfigurationError, StepRecord

from .budget import accepted_on_paths, selection_order
from .frame import rank_frame
from .graph import CalibratedGraph, GraphNode

Formula = frozenset  # of (position rank, vocabulary rank) pairs
ROOT: Formula = frozenset()
SCORES = ("own", "own+parents")


class TransitionRecorder:
    """An observer for :meth:`DiffusionDecoder.generate` that counts draft formulas.

    :param mask_token_id: the model's mask id.
    :param token_ranks: vocabulary ranks a formula may use (``J``).
    """

    def __init__(self, mask_token_id: int, token_ranks: int) -> None:
        self.mask_token_id = mask_token_id
        self.token_ranks = token_ranks
        self.frequency: Counter[Formula] = Counter()
        self.parents: dict[Formula, set[Formula]] = defaultdict(set)
        self.paths = 0
        self.roots = 0  # states drafting starts from (each step's state with a masked position)
        self.path_counts: Counter[tuple[Formula, ...]] = Counter()  # each root's later formulas
        self._steps: dict[tuple[int, int], list[tuple[torch.Tensor, ...]]] = defaultdict(list)

    def __call__(self, record: StepRecord) -> None:
        """Keep the state after the step, with the frame the next drafts would use."""
        frame = rank_frame(record.logits, record.after, self.mask_token_id, self.token_ranks)
        after, ranks, tokens = (
            t.cpu() for t in (record.after, frame.rank_of_position, frame.tokens)
        )
        for index, (block, row) in enumerate(zip(record.block.tolist(), record.rows.tolist())):
            self._steps[(block, row)].append((after[index], ranks[index], tokens[index]))

    def flush(self) -> None:
        """Turn the recorded blocks into counted paths (call after each ``generate``)."""
        for states in self._steps.values():
            for start in range(len(states) - 1):
                self._count_paths_from(states, start)
        self._steps.clear()

    def _count_paths_from(self, states: Sequence[tuple[torch.Tensor, ...]], start: int) -> None:
        """Count the path of formulas from root ``states[start]`` to the block's end."""
        root, rank_of_position, top_tokens = states[start]
        masked = root == self.mask_token_id
        if not bool(masked.any()):
            return
        self.roots += 1
        previous = ROOT
        path = []
        for later, _, _ in states[start + 1 :]:
            formula = self._formula(masked, later, rank_of_position, top_tokens)
            if formula is None or formula == previous:  # outside the ranks, or row finished
                break
            self.frequency[formula] += 1
            self.parents[formula].add(previous)
            path.append(formula)
            previous = formula
        self.paths += previous != ROOT
        self.path_counts[tuple(path)] += 1

    def _formula(self, masked, later, rank_of_position, top_tokens) -> Formula | None:
        """``later``'s commits since the root as ``(i, j)`` pairs, or ``None`` when a token
        is not among its position's ``token_ranks`` likeliest."""
        pairs = []
        for position in torch.nonzero(masked & (later != self.mask_token_id)).flatten().tolist():
            hits = torch.nonzero(top_tokens[position] == later[position]).flatten()
            if hits.numel() == 0:
                return None
            pairs.append((int(rank_of_position[position]), int(hits[0])))
        return frozenset(pairs)


def select_nodes(
    frequency: Counter[Formula],
    parents: dict[Formula, set[Formula]],
    budget: int,
    score_kind: str = "own",
) -> list[GraphNode]:
    """The connected ``budget`` nodes of highest score (module doc)."""
    return [node for node, _ in select_formulas(frequency, parents, budget, score_kind)]


def select_formulas(
    frequency: Counter[Formula],
    parents: dict[Formula, set[Formula]],
    budget: int,
    score_kind: str = "own",
) -> list[tuple[GraphNode, Formula]]:
    """:func:`select_nodes` with each node's formula, in the file's order."""
    if score_kind not in SCORES:
        raise ConfigurationError(f"score is {score_kind!r}; allowed: {', '.join(SCORES)}")

    def score(formula: Formula) -> int:
        inherited = sum(frequency[p] for p in parents[formula] if p != ROOT)
        return frequency[formula] + (inherited if score_kind == "own+parents" else 0)

    kept: list[Formula] = []
    kept_set = {ROOT}
    while len(kept) < budget:
        frontier = [f for f in frequency if f not in kept_set and parents[f] & kept_set]
        if not frontier:
            break
        best = max(frontier, key=lambda f: (score(f), -len(f), sorted(f, reverse=True)))
        kept.append(best)
        kept_set.add(best)
    kept.sort(key=len)
    ids = {ROOT: 0, **{formula: index for index, formula in enumerate(kept, start=1)}}
    return [
        (GraphNode(
            pairs=tuple(sorted(formula)),
            parents=tuple(sorted(ids[p] for p in parents[formula] if p in ids)),
            frequency=frequency[formula],
            score=float(score(formula)),
        ), formula)
        for formula in kept
    ]


def calibrate(
    decoder: DiffusionDecoder,
    prompts: Sequence[Any],
    budget: int,
    token_ranks: int = 4,
    score: str = "own",
    batch_size: int = 16,
    description: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> CalibratedGraph:
    """Run the reference process on ``prompts`` and build a ``budget``-node draft graph.

    :param decoder: a decoder of the base strategy (it must not speculate itself).
    :param prompts: texts or token-id lists.
    :param budget: ``D``, the number of drafts to keep (>= 1).
    :param token_ranks: vocabulary ranks formulas may use.
    :param score: how nodes are ranked for selection, one of :data:`SCORES`.
    :param description: extra entries for the file's ``calibration`` record (tasks, seed).
    :param progress: called with the number of prompts done after each batch.
    :raises ConfigurationError: for a speculative base, a budget below 1, or no prompts.
    """
    if decoder.composition.provider("dloom_draft") is not None:
        raise ConfigurationError(
            f"calibrate the base strategy alone, not {decoder.composition.name!r}: a draft "
            "graph records the reference process, one forward per step"
        )
    if score not in SCORES:
        raise ConfigurationError(f"score is {score!r}; allowed: {', '.join(SCORES)}")
    if budget < 1:
        raise ConfigurationError(f"budget is {budget!r}; allowed: an integer >= 1")
    if not prompts:
        raise ConfigurationError("no calibration prompts given")
    recorder = TransitionRecorder(decoder.mask_token_id, token_ranks)
    started = time.perf_counter()
    done = 0
    for batch in _batches(list(prompts), batch_size):
        decoder.generate(batch, observer=recorder)
        recorder.flush()
        done += len(batch)
        if progress is not None:
            progress(done)
    selected = select_formulas(recorder.frequency, recorder.parents, budget, score)
    nodes = [node for node, _ in selected]
    if not nodes:
        raise ConfigurationError(
            "calibration recorded no transition (every block finished in one step); use "
            "more prompts or a base rule that takes several steps per block"
        )
    setup = decoder.setup
    return CalibratedGraph(
        model=str(decoder.model.name),
        tokenizer_sha256=setup["tokenizer_sha256"],
        base={
            "strategy": setup["commit_rule"],
            "params": dict(setup["commit_params"]),
            "steps_per_block": setup["steps_per_block"],
        },
        block_length=decoder.block_length,
        temperature=decoder.temperature,
        remasking=decoder.remasking,
        nodes=tuple(nodes),
        score=score,
        calibration={
            "prompts": len(prompts),
            "paths": recorder.paths,
            "roots": recorder.roots,
            # drafts a verification of the first D kept nodes accepts, D = 1 .. budget
            "accepted": [round(a, 4) for a in accepted_on_paths(
                recorder.path_counts, recorder.roots,
                [selected[i - 1][1] for i in selection_order(nodes)],
            )],
            "distinct_formulas": len(recorder.frequency),
            "token_ranks": token_ranks,
            "gen_length": decoder.gen_length,
            "seconds": round(time.perf_counter() - started, 1),
            **(description or {}),
        },
    )


def _batches(items: list[Any], size: int) -> Iterable[list[Any]]:
    for index in range(0, len(items), size):
        yield items[index : index + size]
