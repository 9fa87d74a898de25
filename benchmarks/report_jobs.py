"""The report's measurements as jobs, run in this process or in worker processes.

A :class:`Job` is one measurement: a configuration's row, a rule's calibrated draft graphs,
the oracle, or FailFast's comparison. :class:`Runner` runs a list of jobs whose inputs are all
known (a *stage*), takes each one from the :class:`report_store.MeasurementStore` when a
resumed run has it, stores each as soon as it finishes, and returns the results in the jobs'
order. With ``workers > 1`` the jobs of a stage run at once in that many spawned processes,
each holding its own copy of the model (``report.py --workers``): on a machine with ``W``
idle cores a stage takes about ``1 / W`` of the time; every process decodes with
``--threads`` threads, and each row's TPS is measured in the process that decoded it. A
worker ends itself once its parent is gone (a report killed by a signal cannot shut its pool
down, and its workers would go on decoding for nobody).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.report_calibration import calibrate_sizes, calibration_examples
from benchmarks.report_measure import Config, measure, measure_oracle
from benchmarks.report_store import MeasurementStore, file_digest, model_digest
from dloom import load_model
from dloom.evaluation import SUITES


@dataclass
class Context:
    """What every job reads: the dLLM, the graded prompts and the run's settings."""

    model: Any
    examples: Sequence[Any]
    tasks: str
    batch_size: int
    spiffy_budget: int = 10
    calibration_min_prompts: int = 32
    calibration_seed: int = 0


@dataclass(frozen=True)
class Job:
    """One measurement: ``kind`` (``row``, ``calibration``, ``oracle``, ``failfast``), the
    ``name`` it is logged and stored under, and its ``inputs`` (picklable keywords of the
    kind's function below; with the run's identity they are its store key)."""

    kind: str
    name: str
    inputs: dict[str, Any] = field(default_factory=dict)

    def key_settings(self) -> dict[str, Any]:
        settings = {key: dataclasses.asdict(value) if isinstance(value, Config) else value
                    for key, value in self.inputs.items()}
        if self.kind == "failfast":  # the models by their files, not the name they were given by
            for role in ("target", "assistant"):
                name = settings.pop(role)
                settings[f"{role}_files"] = None if name is None else model_digest(name)
        return settings


def row_job(config: Config) -> Job:
    return Job("row", config.name, {"config": config})


def calibration_job(rule: Config, sizes: Sequence[int], out: Path, description: dict[str, Any],
                    context: Context) -> Job:
    return Job("calibration", f"graphs of {rule.name}", {
        "rule": rule, "sizes": list(sizes), "out": str(out), "description": description,
        "budget": context.spiffy_budget, "min_prompts": context.calibration_min_prompts,
        "seed": context.calibration_seed,
    })


def log(row: dict[str, Any]) -> None:
    print(f"{row['name']:26s} acc {row['accuracy']:6.1%}  NFE {row['nfe_mean']:7.2f}  "
          f"TPF {row['tpf']:5.2f}  TPS {row['tps']:7.1f}", file=sys.stderr, flush=True)


def run_row(context: Context, config: Config) -> dict[str, Any]:
    row = measure(context.model, config, context.examples, context.batch_size)
    log(row)
    return row


def run_calibration(context: Context, rule: Config, sizes: list[int], out: str, description: dict[str, Any],
                    budget: int, min_prompts: int, seed: int) -> list[dict[str, Any]]:
    """:func:`report_calibration.calibrate_sizes`'s records, each with its graph file's
    SHA-256 (``sha256``)."""
    def prompts(count: int) -> list[str]:
        return [e.prompt for e in calibration_examples(context.tasks, count, seed, context.examples)]

    records = calibrate_sizes(context.model, rule, sizes, prompts, budget, Path(out), min_prompts, description)
    return [{**record, "sha256": file_digest(record["graph"])} for record in records]


def run_oracle(context: Context) -> dict[str, Any]:
    return measure_oracle(context.model, context.examples)


def run_failfast(context: Context, target: str, assistant: str | None, drafter_taus: list[float],
                 n: int | None = None, repeats: int = 3) -> dict[str, Any]:
    """FailFast on the first ``n`` of the run's prompts (all by default), ``repeats`` passes."""
    from benchmarks.report_failfast import measure_failfast

    return measure_failfast(context.model, target, assistant, context.examples[:n], SUITES[context.tasks],
                            drafter_taus=drafter_taus, repeats=repeats)


RUN: dict[str, Callable[..., Any]] = {
    "row": run_row, "calibration": run_calibration, "oracle": run_oracle, "failfast": run_failfast,
}


def graphs_on_disk(records: list[dict[str, Any]]) -> bool:
    """Whether every graph of stored calibration ``records`` is still the file it was."""
    return all(Path(r["graph"]).is_file() and file_digest(r["graph"]) == r.get("sha256") for r in records)


VALID: dict[str, Callable[[Any], bool]] = {"calibration": graphs_on_disk}


def execute(context: Context, job: Job) -> Any:
    return RUN[job.kind](context, **job.inputs)


# --- worker processes ---------------------------------------------------------------------

_WORKER: Context | None = None


def exit_with_parent(interval: float = 0.5) -> None:
    """End this process (``os._exit``) once its parent is gone, from a daemon thread that polls
    every ``interval`` seconds (an orphan is re-parented, so ``os.getppid()`` changes)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _start_worker(model_name: str, device: str, threads: int, context: Context) -> None:
    """A worker's initialiser: it ends with its parent (:func:`exit_with_parent`), and holds
    its own model, the parent's prompts and settings."""
    global _WORKER
    exit_with_parent()
    torch.set_num_threads(threads)
    _WORKER = dataclasses.replace(context, model=load_model(model_name, device=device))


def _execute_in_worker(job: Job) -> Any:
    assert _WORKER is not None
    return execute(_WORKER, job)


class Runner:
    """Runs stages of jobs (see the module docstring).

    :param store: where finished measurements are kept and resumed ones read.
    :param context: this process's :class:`Context`.
    :param workers: processes a stage's jobs run in; 1 runs them here, in order.
    :param model_name: / :param device: how a worker loads the model.
    """

    def __init__(self, store: MeasurementStore, context: Context, workers: int = 1,
                 model_name: str | None = None, device: str = "cpu") -> None:
        self.store, self.context, self.workers = store, context, workers
        self._pool: ProcessPoolExecutor | None = None
        if workers > 1:
            worker_context = dataclasses.replace(context, model=None)
            self._pool = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=(model_name, device, torch.get_num_threads(), worker_context),
            )

    def run(self, jobs: Sequence[Job]) -> list[Any]:
        """Every job's result, in ``jobs``' order; each stored as soon as it finishes."""
        results: list[Any] = [None] * len(jobs)
        keys = [self.store.key(job.kind, job.key_settings()) for job in jobs]
        pending = []
        for index, (job, key) in enumerate(zip(jobs, keys)):
            found, value = self.store.lookup(key, job.name, VALID.get(job.kind))
            if found:
                results[index] = value
            else:
                pending.append(index)
        if self._pool is None:
            for index in pending:
                results[index] = self.store.put(keys[index], jobs[index].name, execute(self.context, jobs[index]))
            return results
        futures: dict[Future, int] = {self._pool.submit(_execute_in_worker, jobs[i]): i for i in pending}
        try:
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in done:
                    index = futures.pop(future)
                    results[index] = self.store.put(keys[index], jobs[index].name, future.result())
        except BaseException:
            self.close(cancel=True)
            raise
        return results

    def close(self, cancel: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=not cancel, cancel_futures=cancel)
            self._pool = None
