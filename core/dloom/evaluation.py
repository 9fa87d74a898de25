"""Task-suite evaluation: accuracy per family plus NFE, TPF and TPS, as ``dloom eval`` reports.

Accuracy is exact match as judged by each family's checker (``dloom.zoo.tasks``) on the
decoded text up to the first EOS.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from dloom.decode.decoders import Decoder
from dloom.errors import ConfigurationError, EvaluationFailed, EvaluationInterrupted
from dloom.metrics import speculation_summary
from dloom.zoo import long_tasks
from dloom.zoo.tasks import (
    ALPHABET,
    EVALUATED,
    FAMILIES,
    Example,
    TaskFamily,
    dev,
    held_out,
    train_stream,
)

SUITES: dict[str, dict[str, TaskFamily]] = {"all": FAMILIES, "long": long_tasks.FAMILIES}
"""Task suites by the name ``--tasks`` selects them with: the toy suite and the long-answer one."""
_CHECKERS = {**FAMILIES, **long_tasks.FAMILIES}
_ALPHABETS = {"long": long_tasks.ALPHABET, "all": ALPHABET}


def workload_suite(tokenizer: Any) -> str | None:
    """The suite of :data:`SUITES` a model with ``tokenizer`` is evaluated on: ``"long"``
    when it writes every character of the long-answer suite (the long zoo's tokenizer),
    ``"all"`` when it writes the toy suite's, ``None`` when it writes neither (or is ``None``)."""
    vocabulary = tokenizer.get_vocab() if tokenizer is not None else {}
    for suite, alphabet in _ALPHABETS.items():
        if all(character in vocabulary for character in alphabet):
            return suite
    return None


@dataclass
class EvalReport:
    """Aggregate results of decoding a list of task examples.

    :ivar accuracy: share of examples answered correctly, in [0, 1].
    :ivar per_task: ``{family: {"accuracy": float, "n": int}}``.
    :ivar nfe_mean: mean forwards per example.
    :ivar tpf: generated tokens per row-forward, over all examples.
    :ivar tps: generated tokens per wall-clock second, over all batches.
    :ivar wall_seconds: the decoding's wall time, summed over batches (grading excluded).
    :ivar n: number of examples.
    :ivar hook_share: share of wall time per hook and for the forward.
    :ivar config: the decoder's settings plus the evaluation's own.
    :ivar outputs: one ``{"family", "prompt", "text", "correct", "nfe"}`` record per example.
    :ivar speculation: acceptance over all batches for a speculative strategy (``None``
        otherwise); see :attr:`dloom.metrics.GenerationResult.speculation`.
    :ivar complete: ``False`` when the run was interrupted: the figures cover the
        ``n`` examples that finished.
    :ivar oracle_nfe_mean: the oracle's mean forwards over the examples where it reproduces
        the greedy output (:func:`add_oracle`; ``None`` unless asked for).
    :ivar oracle_reached_share: the share of examples where it does.
    :ivar edits_per_answer: on an editing kernel (:attr:`dloom.metrics.GenerationResult.edits`),
        the mean edits per example; ``None`` for a decoder whose rule does not edit.
    :ivar fixed_by_edit_share: the share of examples whose answer is correct while the answer
        of their drafts alone (each position's first filled token) is wrong: an edit fixed a
        wrong draft (``None`` likewise).
    :ivar broken_by_edit_share: the share whose drafts' answer is correct and final answer
        wrong: an edit broke a right draft (``None`` likewise).
    """

    accuracy: float
    per_task: dict[str, dict[str, float]]
    nfe_mean: float
    tpf: float
    tps: float
    n: int
    hook_share: dict[str, float]
    config: dict[str, Any]
    outputs: list[dict[str, Any]] = field(default_factory=list)
    speculation: dict[str, Any] | None = None
    complete: bool = True
    oracle_nfe_mean: float | None = None
    oracle_reached_share: float | None = None
    wall_seconds: float = 0.0
    edits_per_answer: float | None = None
    fixed_by_edit_share: float | None = None
    broken_by_edit_share: float | None = None

    def to_json(self, with_outputs: bool = False) -> dict[str, Any]:
        """The JSON object of ``dloom eval --json``."""
        data = {
            "accuracy": self.accuracy,
            "per_task": self.per_task,
            "nfe_mean": self.nfe_mean,
            "tpf": self.tpf,
            "tps": self.tps,
            "wall_seconds": self.wall_seconds,
            "n": self.n,
            "hook_share": self.hook_share,
            "speculation": self.speculation,
            "config": self.config,
            "complete": self.complete,
        }
        if self.oracle_reached_share is not None:
            data["oracle_nfe_mean"] = self.oracle_nfe_mean
            data["oracle_reached_share"] = self.oracle_reached_share
        if self.edits_per_answer is not None:
            data["edits_per_answer"] = self.edits_per_answer
            data["fixed_by_edit_share"] = self.fixed_by_edit_share
            data["broken_by_edit_share"] = self.broken_by_edit_share
        if with_outputs:
            data["outputs"] = self.outputs
        return data


def add_oracle(report: EvalReport, decoder: Any, examples: Sequence[Example]) -> None:
    """Set ``report``'s oracle figures for ``examples`` under ``decoder``'s lengths
    (:func:`dloom.decode.oracle.oracle_nfe`: two greedy decodes per example)."""
    from dloom.decode.oracle import oracle_nfe

    result = oracle_nfe(decoder, [e.prompt for e in examples])
    reached = result.nfe[result.reached].float()
    report.oracle_nfe_mean = float(reached.mean()) if len(reached) else None
    report.oracle_reached_share = float(result.reached.float().mean())


SPLITS = ("held-out", "dev", "train")
"""The prompt splits :func:`select_examples` draws from."""


def select_examples(
    tasks: str, n: int, seed: int = 0, split: str = "held-out", evaluated: int | None = None,
) -> list[Example]:
    """``n`` examples from ``tasks``: ``"all"`` (the toy suite), ``"long"`` (the long-answer
    suite, :mod:`dloom.zoo.long_tasks`) or comma-separated family names of one suite.

    :param split: one of :data:`SPLITS`: ``"held-out"`` (balanced over families, what
        evaluations use), ``"dev"`` (held-out prompts for choosing settings, never one of
        the first :data:`~dloom.zoo.tasks.EVALUATED` held-out ones: :func:`dloom.zoo.tasks.dev`)
        or ``"train"`` (the training stream, what calibrations use, never a held-out prompt).
    :param evaluated: ``"dev"`` only: the held-out examples it must avoid are the first
        ``evaluated`` (default :data:`~dloom.zoo.tasks.EVALUATED`), for a run that scores
        fewer on a suite whose small families the default would exhaust.
    :raises ConfigurationError: for an unknown family or split, or ``n < 1``.
    """
    if split not in SPLITS:
        raise ConfigurationError(f"split is {split!r}; allowed: {', '.join(map(repr, SPLITS))}")
    if n < 1:
        raise ConfigurationError(f"-n is {n}; allowed: a positive number of examples")
    names = None if tasks in SUITES else [t.strip() for t in tasks.split(",") if t.strip()]
    unknown = [t for t in names or [] if t not in _CHECKERS]
    if unknown or names == []:
        raise ConfigurationError(
            f"unknown task family {unknown[0] if unknown else tasks!r}; known: all, long, "
            + ", ".join(_CHECKERS)
        )
    suites = {name for name, suite in SUITES.items() for t in names or [] if t in suite}
    if len(suites) > 1:
        raise ConfigurationError(f"tasks {tasks!r} mix the toy and the long-answer suites; allowed: families of one")
    suite = SUITES[tasks if names is None else suites.pop()]
    if split == "train":
        return list(itertools.islice(train_stream(seed, families=names, suite=suite), n))
    if split == "dev":
        try:
            return dev(n, seed=seed, families=names, suite=suite, evaluated=evaluated or EVALUATED)
        except ValueError as error:
            raise ConfigurationError(f"{error}; allowed: fewer dev examples (-n {n})") from error
    return held_out(n, seed=seed, families=names, suite=suite)


class _Tally:
    """What :func:`evaluate` accumulates over batches."""

    def __init__(self) -> None:
        self.outputs: list[dict[str, Any]] = []
        self.generated = self.nfe_total = 0
        self.wall = 0.0
        self.hook_seconds: dict[str, float] = defaultdict(float)
        self.speculation: dict[str, Any] | None = None

    def add(self, chunk: Sequence[Example], result: Any) -> list[dict[str, Any]]:
        """Grade one decoded batch; return its output records."""
        texts = result.texts or [""] * len(chunk)
        records = self._grade(chunk, texts, result.nfe.tolist())
        edits = getattr(result, "edits", None)
        if edits is not None:
            drafts = getattr(result, "draft_texts", None) or [""] * len(chunk)
            self._grade_drafts(chunk, records, edits.tolist(), drafts)
        self.generated += result.total_generated
        self._add_time(result.wall_seconds, result.hook_seconds, getattr(result, "speculation", None))
        return records

    def add_rows(self, chunk: Sequence[Example], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Grade result rows decoded elsewhere (:mod:`dloom.ray`): ``GenerationResult.row``
        records, the first row of each decoded batch carrying its ``batch`` summary."""
        records = self._grade(chunk, [row["text"] or "" for row in rows], [row["nfe"] for row in rows])
        if all("edits" in row for row in rows):
            self._grade_drafts(chunk, records, [row["edits"] for row in rows],
                               [row["draft_text"] or "" for row in rows])
        self.generated += sum(len(row["tokens"]) for row in rows)
        for batch in (row["batch"] for row in rows if "batch" in row):
            self._add_time(batch["wall_seconds"], batch["hook_seconds"], batch["speculation"])
        return records

    def _grade(self, chunk: Sequence[Example], texts: Sequence[str], nfes: Sequence[int]) -> list[dict[str, Any]]:
        records = [
            {
                "family": example.family,
                "prompt": example.prompt,
                "text": text,
                "correct": _CHECKERS[example.family].check(example.prompt, text),
                "nfe": nfe,
            }
            for example, text, nfe in zip(chunk, texts, nfes)
        ]
        self.outputs.extend(records)
        self.nfe_total += sum(nfes)
        return records

    @staticmethod
    def _grade_drafts(chunk: Sequence[Example], records: Sequence[dict[str, Any]], edits: Sequence[int],
                      drafts: Sequence[str]) -> None:
        """Add each record's ``edits`` and whether its drafts alone answer correctly
        (``draft_correct``), in place."""
        for example, record, count, draft in zip(chunk, records, edits, drafts):
            record["edits"] = count
            record["draft_correct"] = _CHECKERS[example.family].check(example.prompt, draft)

    def _add_time(self, wall: float, hook_seconds: dict[str, float], speculation: dict[str, Any] | None) -> None:
        self.wall += wall
        for name, seconds in hook_seconds.items():
            self.hook_seconds[name] += seconds
        self.speculation = _add_speculation(self.speculation, speculation)

    def fail(self, error: Exception, config: dict[str, Any]) -> NoReturn:
        """Re-raise ``error``: as itself when nothing was graded yet, else as
        :class:`EvaluationFailed` carrying the report of what was."""
        if not self.outputs:
            raise error
        raise EvaluationFailed(self.report(config, complete=False), error) from error

    def report(self, config: dict[str, Any], complete: bool) -> EvalReport:
        outputs, wall, nfe_total = self.outputs, self.wall, self.nfe_total
        per_task: dict[str, dict[str, float]] = {}
        for family in dict.fromkeys(o["family"] for o in outputs):
            rows = [o for o in outputs if o["family"] == family]
            per_task[family] = {"accuracy": sum(o["correct"] for o in rows) / len(rows), "n": len(rows)}
        n = len(outputs)
        edited = n > 0 and all("edits" in o for o in outputs)
        return EvalReport(
            accuracy=sum(o["correct"] for o in outputs) / n if n else 0.0,
            per_task=per_task,
            nfe_mean=nfe_total / n if n else 0.0,
            tpf=self.generated / nfe_total if nfe_total else 0.0,
            tps=self.generated / wall if wall > 0 else 0.0,
            n=n,
            hook_share={k: v / wall for k, v in self.hook_seconds.items()} if wall > 0 else {},
            config=config,
            outputs=outputs,
            speculation=self.speculation,
            complete=complete,
            wall_seconds=wall,
            edits_per_answer=sum(o["edits"] for o in outputs) / n if edited else None,
            fixed_by_edit_share=sum(o["correct"] and not o["draft_correct"] for o in outputs) / n if edited else None,
            broken_by_edit_share=sum(o["draft_correct"] and not o["correct"] for o in outputs) / n if edited else None,
        )


def evaluate(
    decoder: Decoder,
    examples: Sequence[Example],
    batch_size: int = 32,
    on_batch: Callable[[list[dict[str, Any]]], None] | None = None,
) -> EvalReport:
    """Decode ``examples`` in batches and grade them. Draws nothing: progress is reported
    through ``on_batch`` (``dloom eval`` draws its progress bar from it).

    :param decoder: any :class:`~dloom.decode.decoders.Decoder` over a model with a tokenizer.
    :param examples: task examples (prompts and checkers).
    :param batch_size: prompts per batch.
    :param on_batch: called with each batch's output records (one per example, in order) as
        soon as it is graded (``dloom eval --json`` streams them).
    :raises EvaluationInterrupted: on Ctrl-C, carrying the report of the finished batches.
    :raises EvaluationFailed: when a batch raises after others finished, carrying their report.
    """
    if batch_size < 1:
        raise ConfigurationError(f"batch size is {batch_size}; allowed: >= 1")
    tally = _Tally()
    config = {**decoder.config, "batch_size": batch_size, "torch_threads": torch.get_num_threads()}
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            records = tally.add(chunk, decoder.generate([e.prompt for e in chunk], row_offset=start))
            if on_batch is not None:
                on_batch(records)
    except KeyboardInterrupt:
        raise EvaluationInterrupted(tally.report(config, complete=False)) from None
    except Exception as error:
        tally.fail(error, config)
    return tally.report(config, complete=True)


def evaluate_rows(
    rows: Iterable[dict[str, Any]],
    examples: Sequence[Example],
    settings: Mapping[str, Any],
    on_batch: Callable[[list[dict[str, Any]]], None] | None = None,
) -> EvalReport:
    """:func:`evaluate` over result rows decoded elsewhere (by a pool of workers: the Ray
    front-end's :func:`dloom.ray.evaluate_on_ray`), graded as they arrive, in any order.

    :param rows: ``GenerationResult.row`` records (the first of each decoded batch carrying
        its ``batch`` summary), each with ``"index"`` (its example's position in ``examples``) and ``"config"``
        (the decoder's settings).
    :param settings: how the rows were decoded, added to the report's config
        (``{"batch_size": 32, "ray_actors": 2}``).
    :param on_batch: called with the output records of each row as it arrives.
    :raises EvaluationInterrupted: on Ctrl-C, carrying the report of the rows that arrived.
    :raises EvaluationFailed: when ``rows`` raises after some rows arrived, carrying their report.
    """
    tally = _Tally()
    config: dict[str, Any] = {}
    try:
        for row in rows:
            config = config or {**row["config"], **settings}
            records = tally.add_rows([examples[row["index"]]], [row])
            if on_batch is not None:
                on_batch(records)
    except KeyboardInterrupt:
        raise EvaluationInterrupted(tally.report(config, complete=False)) from None
    except Exception as error:
        tally.fail(error, config)
    return tally.report(config, complete=True)


def _add_speculation(total: dict[str, Any] | None, batch: dict[str, Any] | None) -> dict[str, Any] | None:
    """Acceptance figures summed over batches (the guarantee is the weakest seen), and an
    AR target's ``drafting`` (:attr:`dloom.ar.result.ARTargetResult.drafting`): the last
    batch's, with ``batches`` counting the batches by path."""
    if batch is None:
        return total
    summed = dict(batch) if total is None else speculation_summary(
        total["verifications"] + batch["verifications"],
        total["accepted_drafts"] + batch["accepted_drafts"],
        total["guarantee"] == batch["guarantee"] == "lossless",
    )
    if "drafting" in batch:
        batches = dict((total or {}).get("drafting", {}).get("batches", {}))
        batches[batch["drafting"]["path"]] = batches.get(batch["drafting"]["path"], 0) + 1
        summed["drafting"] = {**batch["drafting"], "batches": batches}
    return summed
