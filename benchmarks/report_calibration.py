"""Spiffy's draft graphs for the report, calibrated on training-split prompts only.

:func:`calibration_examples` draws prompts from the suite's training stream and refuses any
held-out prompt (and any prompt the report evaluates on); :func:`calibrate_to_paths` runs
:func:`dloom_plugins.spiffy.calibrate.calibrate` on the shortest prefix of that stream whose
calibration records at least the wanted number of paths. Prefixes of one stream nest, so the
graphs of a growing calibration size (:func:`calibrate_sizes`) see ever more of the same prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report_measure import Config
from dloom import DiffusionDecoder
from dloom.errors import ConfigurationError
from dloom.evaluation import select_examples
from dloom.zoo.tasks import Example, is_held_out
from dloom_plugins.spiffy.calibrate import calibrate
from dloom_plugins.spiffy.graph import CalibratedGraph

MAX_ATTEMPTS = 8
"""Calibrations tried per graph before giving up on reaching the wanted paths."""


def calibration_examples(tasks: str, n: int, seed: int, evaluated: Sequence[Example] = ()) -> list[Example]:
    """The first ``n`` examples of ``tasks``' training stream (``seed``).

    :raises ConfigurationError: when one of them is a held-out prompt or one of ``evaluated``
        (the split is broken: a calibration must never see what the report grades).
    """
    examples = select_examples(tasks, n, seed, split="train")
    graded = {(e.family, e.prompt) for e in evaluated}
    leaked = [e for e in examples if is_held_out(e.family, e.prompt) or (e.family, e.prompt) in graded]
    if leaked:
        raise ConfigurationError(
            f"calibration prompt {leaked[0].prompt!r} ({leaked[0].family}) is held out or evaluated; "
            "allowed: training-split prompts only"
        )
    return examples


def calibrate_to_paths(
    decoder: DiffusionDecoder,
    prompts: Callable[[int], Sequence[str]],
    paths: int,
    budget: int,
    min_prompts: int = 1,
    description: dict[str, Any] | None = None,
    paths_per_prompt: float | None = None,
) -> CalibratedGraph:
    """The draft graph of ``budget`` nodes calibrated on the fewest prompts ``prompts(k)``
    (``k >= min_prompts``) found to record at least ``paths`` paths.

    The first try takes ``paths / paths_per_prompt`` prompts (default: the fewest that
    could, as a block of ``b`` steps yields at most ``b - 1`` paths); each later one scales
    the count by the paths still missing (by four when these prompts recorded none: every
    block took one step).

    :param prompts: ``k`` -> the first ``k`` calibration prompts (a prefix of one stream).
    :raises ConfigurationError: when :data:`MAX_ATTEMPTS` calibrations fall short, or the
        base rule records no transition at all.
    """
    blocks = math.ceil(decoder.gen_length / decoder.block_length)
    rate = paths_per_prompt or max(decoder.gen_length - blocks, 1)
    count = max(min_prompts, math.ceil(paths / rate))
    got = 0
    for _ in range(MAX_ATTEMPTS):
        try:
            graph = calibrate(decoder, list(prompts(count)), budget, description=description)
        except ConfigurationError as error:
            if "recorded no transition" not in str(error):
                raise
            got = 0  # every block of these prompts took one step: look at more of them
        else:
            got = graph.calibration["paths"]
            if got >= paths:
                return graph
        count = 4 * count if got == 0 else max(count + 1, math.ceil(count * paths / got * 1.05))
    raise ConfigurationError(
        f"{decoder.composition.name}: {MAX_ATTEMPTS} calibrations reached {got} of {paths} paths; "
        "allowed: a path target the rule's steps can reach (fewer --calibration-paths)"
    )


def graph_record(graph: CalibratedGraph, path: Path) -> dict[str, Any]:
    """What the report keeps of a saved graph: its file, prompts, paths and nodes."""
    info = graph.calibration
    return {"graph": str(path), "prompts": info["prompts"], "paths": info["paths"],
            "distinct_formulas": info["distinct_formulas"], "nodes": graph.budget,
            "seconds": info["seconds"]}


def calibrate_sizes(
    model, rule: Config, sizes: Sequence[int], prompts: Callable[[int], Sequence[str]], budget: int,
    out: Path, min_prompts: int, description: dict[str, Any],
) -> list[dict[str, Any]]:
    """Graphs for ``rule`` (no cache) at each calibration size of ``sizes`` (paths, ascending);
    the largest also calibrated on at least ``min_prompts`` prompts. Saved under ``out``;
    their :func:`graph_record` entries (``target_paths``: the size asked for), one per
    distinct graph: a size the previous graph's prompts already reach adds none."""
    decoder = DiffusionDecoder(model, rule.strategy, params=rule.params)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    for index, size in enumerate(sizes):
        floor = min_prompts if index == len(sizes) - 1 else 1
        if records and records[-1]["paths"] >= size and records[-1]["prompts"] >= floor:
            continue
        rate = records[-1]["paths"] / records[-1]["prompts"] if records else None
        graph = calibrate_to_paths(decoder, prompts, size, budget, floor, description, rate)
        path = out / f"{rule.name}__paths{size}.json"
        graph.save(path)
        records.append({"target_paths": size, **graph_record(graph, path)})
    return records
