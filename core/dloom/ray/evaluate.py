"""``dloom eval --ray N``: the task-suite evaluation with its decoding spread over Ray actors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dloom.evaluation import EvalReport, evaluate_rows
from dloom.ray.batch import DecodeSpec, iter_decoded
from dloom.zoo.tasks import Example


def evaluate_on_ray(
    spec: DecodeSpec,
    examples: Sequence[Example],
    actors: int,
    batch_size: int = 32,
    on_batch: Callable[[list[dict[str, Any]]], None] | None = None,
) -> EvalReport:
    """:func:`dloom.evaluation.evaluate` with the decoding spread over a pool of Ray actors,
    each holding one model replica; the grades, NFE and outputs are those of ``evaluate``
    (decoding is batch-invariant). TPS and hook shares are over the actors' decoding time,
    summed.

    :param spec: the decoder each actor builds.
    :param actors: model replicas.
    :param on_batch: called with the output records of each row as it arrives.
    :raises dloom.errors.EvaluationInterrupted: on Ctrl-C, carrying the report of the rows that arrived.
    :raises dloom.errors.EvaluationFailed: when decoding raises after some rows arrived, carrying their report.
    """
    rows = iter_decoded([e.prompt for e in examples], spec, actors=actors, batch_size=batch_size)
    return evaluate_rows(rows, examples, {"batch_size": batch_size, "ray_actors": actors}, on_batch)
