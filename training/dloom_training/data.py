"""The training data stream: batches of a workload's mix, seeded per part of a run."""

from __future__ import annotations

import random
from collections.abc import Iterator

from dloom.zoo.tasks import Example, train_stream

from .workloads import Workload

__all__ = ["MAX_EXTRA_PAD", "part_seed", "training_batches"]


MAX_EXTRA_PAD = 4
"""The most extra left padding a training batch draws (prompts at shifted positions)."""


def part_seed(seed: int, start_step: int) -> int:
    """The seed of the part of a run that starts at ``start_step``: ``seed`` itself for a new
    run, ``seed * 100_000_000 + start_step`` for a continued one (new data and masks,
    deterministic in the run's seed and where it was continued)."""
    return seed if start_step == 0 else seed * 100_000_000 + start_step


def training_batches(
    seed: int, weights: dict[str, float], workload: Workload, start_step: int = 0
) -> Iterator[tuple[list[Example], int]]:
    """Training batches of ``workload.batch`` examples and their extra left padding; a run
    continued at ``start_step`` draws from the stream of :func:`part_seed` (new data)."""
    data_seed = part_seed(seed, start_step)
    families = [workload.sources.get(name, name) for name in weights]
    stream = train_stream(data_seed, families=families, weights=list(weights.values()), suite=workload.suite)
    pad_rng = random.Random(f"pad:{data_seed}")
    while True:
        yield [next(stream) for _ in range(workload.batch)], pad_rng.randint(0, MAX_EXTRA_PAD)
