"""The report's measurements: configurations, one decoded row per configuration, the oracle,
and the comparisons between rows of one run (``benchmarks/report.py`` runs them).

A row is the JSON object of one configuration: accuracy, NFE, tokens per forward (TPF),
tokens per second (TPS), decoding wall time, for an editing rule its edits per answer and the
shares of answers an edit fixed or broke (:class:`dloom.evaluation.EvalReport`), hook shares, Spiffy's acceptance, NFE per answer token, padding
share (generated positions after the first EOS) and, for a commit rule alone, the fewest
forwards Spiffy over it could take (:class:`BlockFloor`). :func:`compare` then adds the
ratios against the baseline (the first row), the oracle and each speculative row's rule alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dloom import DiffusionDecoder, hookimpl
from dloom.decode.oracle import oracle_nfe
from dloom.evaluation import evaluate
from dloom.hooks.composition import compose
from dloom.hooks.registry import get_registry

HOOKS = ("forward", "select_commit", "draft", "prune", "build_mask", "verify")
CACHES = ("none", "prefix", "dual")
DELTAS = (0.0, 0.1, 0.25, 0.5, 0.75)
"""Fréchet's δ grid of the full matrix (δ lies in [0, 1))."""
SPIFFY_BUDGET = 10
"""The fixed Spiffy budget of the report's rows (Spiffy's default is ``auto``)."""


@dataclass(frozen=True)
class Config:
    """One measured configuration.

    :ivar name: short identifier (JSON key and plot label).
    :ivar label: how the tables name it.
    :ivar strategy: a registered strategy or composition.
    :ivar params: strategy parameters.
    :ivar cache: KV cache mode.
    :ivar headline: whether it appears in the README's headline table.
    """

    name: str
    label: str
    strategy: str
    params: dict[str, Any] = field(default_factory=dict)
    cache: str = "none"
    headline: bool = False


BASELINE = Config("quota", "quota, one token per step (baseline)", "quota", headline=True)
CONFIGS: tuple[Config, ...] = (
    BASELINE,
    Config("threshold", "threshold τ = 0.9", "threshold", {"tau": 0.9}, headline=True),
    Config("factor", "factor f = 1", "factor", {"f": 1.0}, headline=True),
    Config("frechet", "Fréchet δ = 0", "frechet", {"delta": 0.0}, headline=True),
    Config("spiffy+quota", "Spiffy over quota", "spiffy+quota", {"budget": SPIFFY_BUDGET}, headline=True),
    Config("spiffy+threshold", "Spiffy over threshold τ = 0.9", "spiffy+threshold",
           {"tau": 0.9, "budget": SPIFFY_BUDGET}, headline=True),
    Config("spiffy+frechet", "Spiffy over Fréchet δ = 0", "spiffy+frechet", {"delta": 0.0, "budget": SPIFFY_BUDGET}),
    Config("threshold/dual", "threshold τ = 0.9, dual cache", "threshold", {"tau": 0.9}, cache="dual"),
    Config("frechet/dual", "Fréchet δ = 0, dual cache", "frechet", {"delta": 0.0}, cache="dual"),
    Config(
        "spiffy+frechet/dual", "Spiffy (packed) over Fréchet δ = 0, dual cache", "spiffy+frechet",
        {"delta": 0.0, "layout": "packed", "budget": SPIFFY_BUDGET}, cache="dual", headline=True,
    ),
)


def registered_config(name: str) -> Config:
    """A configuration for any registered strategy or composition (``name`` as
    ``--strategy`` takes it: a third party's, once its plugin is installed), at its default
    parameters, without a cache.

    :raises DloomError: naming the unknown strategy or the malformed composition.
    """
    compose(name)
    return Config(name, f"{name} (registered strategy, defaults)", name)
"""The headline matrix: the toy report's configurations, Spiffy with its built-in graphs."""


def cached(config: Config, cache: str) -> Config:
    """``config`` under KV cache ``cache`` (``name/cache`` and ``label, cache cache``; Spiffy
    packs its drafts under the dual cache, where packing is exact)."""
    if cache == "none":
        return config
    params = dict(config.params)
    if cache == "dual" and config.strategy.startswith("spiffy+"):
        params["layout"] = "packed"
    packed = " (packed)" if params.get("layout") == "packed" else ""
    return Config(f"{config.name}/{cache}", f"{config.label}{packed}, {cache} cache", config.strategy,
                  params, cache, headline=False)


def frechet(delta: float) -> Config:
    """Fréchet at ``delta``, named ``frechet-δ``."""
    return Config(f"frechet-{delta:g}", f"Fréchet δ = {delta:g}", "frechet", {"delta": float(delta)})


def base_rules(deltas: Sequence[float]) -> list[Config]:
    """The commit rules of the full matrix, without cache: quota, threshold 0.9, factor 1 and
    Fréchet at every δ of ``deltas``."""
    return [BASELINE, CONFIGS[1], CONFIGS[2], *(frechet(d) for d in deltas)]


def spiffy_over(rule: Config, graph: str, budget: int | str = SPIFFY_BUDGET) -> Config:
    """Spiffy over ``rule`` (its parameters) with the draft graph file ``graph`` at ``budget``
    (default: the fixed budget the published figures were measured at); named
    ``spiffy+quota``, ``spiffy+threshold``, ``spiffy+factor``, ``spiffy+frechet``."""
    return Config(f"spiffy+{rule.strategy}", f"Spiffy over {rule.label.split(',')[0].split(' (')[0]}",
                  f"spiffy+{rule.strategy}", {**rule.params, "graph": graph, "budget": budget})


class AcceptanceRecorder:
    """A ``dloom_verify`` wrapper keeping the drafts each row-verification accepted.

    Registered on a decoder's plugin manager next to its timing wrapper; it holds the
    device tensors and reads them once at the end, adding no host synchronisation per step.
    """

    def __init__(self) -> None:
        self._steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    @hookimpl(wrapper=True)
    def dloom_verify(self, state):
        verdict = yield
        self._steps.append((verdict.accepted, state.active))
        return verdict

    def histogram(self) -> list[int]:
        """``counts[k]``: row-verifications (rows still decoding) that accepted ``k`` drafts."""
        if not self._steps:
            return []
        accepted = torch.cat([a[active] for a, active in self._steps]).long().cpu()
        return torch.bincount(accepted).tolist()


class BlockFloor:
    """A ``dloom_select_commit`` wrapper counting the steps that are the second of their
    block; with one forward per row added (:meth:`total` of ``rows``), the fewest forwards
    a speculative strategy over this commit rule could take: a row's first block takes its
    first forward plain, a later block's first step can be taken from the forward that
    completed the block before it (Spiffy's ``first_forward``), and at best one verification
    then completes the block. Device tensors, read once."""

    def __init__(self) -> None:
        self._steps: list[torch.Tensor] = []

    @hookimpl(wrapper=True)
    def dloom_select_commit(self, confidence, selectable, schedule):
        commit = yield
        self._steps.append((selectable.any(-1) & (schedule.step_in_block == 1)).sum())
        return commit

    def total(self, rows: int) -> int:
        """The floor's forwards over ``rows`` decoded rows."""
        return rows + (int(torch.stack(self._steps).sum()) if self._steps else 0)


def measure(model, config: Config, examples, batch_size: int) -> dict[str, Any]:
    """Decode and grade ``examples`` with ``config``; the row of the report (with its texts,
    which :func:`drop_texts` removes once every comparison is made)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = DiffusionDecoder(model, config.strategy, params=config.params, cache=config.cache)
    recorder, floor = AcceptanceRecorder(), BlockFloor()
    decoder.pm.register(recorder)
    speculative = decoder.composition.provider("dloom_draft") is not None
    if not speculative:
        decoder.pm.register(floor)
    report = evaluate(decoder, examples, batch_size=batch_size)
    rule = decoder.composition.provider("dloom_select_commit")
    claim = get_registry().get(rule).claim
    settings = {"temperature": decoder.temperature, "remasking": decoder.remasking}
    unclaimed = claim is not None and claim.unmet({**decoder.composition.params()[rule], **settings})
    floor_mean = None if speculative else floor.total(len(examples)) / len(examples)
    return {
        "name": config.name,
        "label": config.label,
        "strategy": decoder.composition.name,
        "params": decoder.composition.params(),
        "cache": config.cache,
        "commit_rule": rule,
        "delta": decoder.composition.params()[rule].get("delta") if rule == "frechet" else None,
        # a claim whose holds_when these parameters break is not made: no exactness promise
        "guarantee": report.speculation["guarantee"] if report.speculation else "approximate" if unclaimed else claim.kind,
        "headline": config.headline,
        "accuracy": report.accuracy,
        "nfe_mean": report.nfe_mean,
        "tpf": report.tpf,
        "tps": report.tps,
        "wall_seconds": report.wall_seconds,
        # on an editing kernel (None for a fill rule): dloom.evaluation's edit figures
        "edits_per_answer": report.edits_per_answer,
        "fixed_by_edit_share": report.fixed_by_edit_share,
        "broken_by_edit_share": report.broken_by_edit_share,
        "hook_share": {hook: report.hook_share.get(hook, 0.0) for hook in HOOKS},
        "speculation": report.speculation,
        "acceptance_histogram": recorder.histogram(),
        "nfe_per_answer_token": 1 / report.tpf if report.tpf else None,
        "padding_share": 1 - report.tpf * report.nfe_mean / decoder.gen_length,
        "spiffy_floor_nfe_mean": floor_mean,
        "spiffy_ceiling": report.nfe_mean / floor_mean if floor_mean else None,
        "warnings": [str(w.message) for w in caught],
        "texts": [o["text"] for o in report.outputs],
        "nfe": [o["nfe"] for o in report.outputs],
    }


def measure_oracle(model, examples) -> dict[str, Any]:
    """The oracle NFE of ``examples`` under the baseline's lengths (:func:`dloom.decode.oracle.oracle_nfe`)."""
    result = oracle_nfe(DiffusionDecoder(model, BASELINE.strategy), [e.prompt for e in examples])
    reached = result.nfe[result.reached]
    return {
        "nfe": result.nfe.tolist(),
        "reached": result.reached.tolist(),
        "nfe_mean": float(reached.float().mean()) if len(reached) else None,
        "reached_share": float(result.reached.float().mean()),
    }


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The share of prompts on which rows ``a`` and ``b`` (with texts) wrote the same text."""
    return sum(x == y for x, y in zip(a["texts"], b["texts"])) / len(a["texts"])


def rule_alone(rows: Sequence[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The row of a speculative ``row``'s commit rule run alone with the same parameters and
    cache, or ``None`` when it was not measured."""
    rule = row["commit_rule"]
    return next((r for r in rows if r["speculation"] is None and r["strategy"] == rule
                 and r["params"] == {rule: row["params"][rule]} and r["cache"] == row["cache"]), None)


def compare(rows: list[dict[str, Any]], oracle: dict[str, Any]) -> None:
    """Add ratios against the baseline (the first row) and the oracle, and output agreement,
    in place (the rows keep their texts).

    ``nfe_over_oracle`` compares NFE on the prompts where the oracle reproduced the greedy
    output; ``spiffy_max_saving`` is a speculative row's commit rule alone (same parameters
    and cache) in NFE over the fewest forwards speculation over it could take.

    ``identical_to_commit_rule`` compares a speculative configuration with its commit rule
    run alone under the same parameters and cache (``None`` when not measured or not
    speculative).
    """
    base = rows[0]
    for row in rows:
        row["nfe_ratio"] = base["nfe_mean"] / row["nfe_mean"] if row["nfe_mean"] else 0.0
        row["tps_ratio"] = row["tps"] / base["tps"] if base["tps"] else 0.0
        row["identical_to_baseline"] = same_outputs(row, base)
        reference = rule_alone(rows, row) if row["speculation"] else None
        row["identical_to_commit_rule"] = same_outputs(row, reference) if reference else None
        kept = [nfe for nfe, reached in zip(row["nfe"], oracle["reached"]) if reached]
        row["nfe_over_oracle"] = (
            sum(kept) / len(kept) / oracle["nfe_mean"] if oracle["nfe_mean"] else None
        )
        row["spiffy_max_saving"] = reference["spiffy_ceiling"] if reference else None


def drop_texts(rows: Sequence[dict[str, Any]]) -> None:
    """Remove the texts and per-prompt NFE the comparisons needed, in place."""
    for row in rows:
        row.pop("texts", None)
        row.pop("nfe", None)
