"""Operating points: every commit rule swept on a dev split, each rule's setting chosen there,
and the choices scored on held-out prompts against one token per step.

::

    python -m benchmarks.operating_points --workers 2          # long-dllm-words: 300 dev, 300 held-out
    python -m benchmarks.operating_points ... --resume         # the same run, stopped: measure the rest
    python -m benchmarks.operating_points --model toy-dllm --n-dev 40 -n 60 --no-spiffy --target none

Stages (each stage's measurements run at once with ``--workers``; every finished one is kept
at once next to ``--out`` and reused by ``--resume``):

1. **dev** (``--n-dev`` prompts of :func:`dloom.zoo.tasks.dev`, never one of the ``-n``
   held-out prompts of stage 2): one token per step (quota) and every grid point of the
   model's kernel's grids (:func:`report_operating_points.grids_for`: the fill rules of
   :data:`~report_operating_points.GRIDS`, and on the revisable kernel every fill and editing
   rule of :data:`~report_operating_points.EDIT_MODEL_GRIDS`); each curve's setting is chosen there
   (:func:`report_operating_points.choose`: the fewest NFE within one point of quota's
   accuracy);
2. **held-out** (``-n`` prompts, the ones ``dloom eval -n`` scores): quota, every grid point
   (``--test-grid all``) or only the chosen ones (``chosen``), the oracle, and with
   ``--spiffy`` each chosen rule's draft graph calibrated on training prompts
   (:mod:`report_calibration`); with ``--target``, FailFast against AR decoding and assisted
   generation (:mod:`report_failfast`, in wall time and in the latency model);
3. with ``--spiffy``: each chosen rule under ``--spiffy-cache`` (default dual), alone and
   with Spiffy over it (its graph from stage 2); with ``--test-grid all``, also Spiffy over
   the threshold setting that keeps quota's accuracy on the held-out rows when the dev
   choice does not (:func:`accuracy_keeping_threshold`, its graph calibrated then).

From the held-out rows: accuracy–NFE curves and their Pareto front, every rule's NFE at the
accuracy one point below quota's (interpolated on its curve,
:func:`report_operating_points.equal_accuracy`), the chosen settings' figures, and issue 42's
targets with their measured figures (:func:`targets`: issue 53's on a model that edits,
:func:`edit_targets`). It writes ``--out`` (default
``benchmarks/results/operating-points.json``), ``DOCS/benchmarks/PAGE.md`` and
``DOCS/assets/PAGE.png`` (``--page``, default ``operating-points``).

Spiffy runs (``--spiffy``, the default where it can) only on the absorbing kernel: on a model
that edits (``long-dllm-words-edit``) the run is ``--no-spiffy``, and its rows carry each
answer's edits (:mod:`dloom.decode.edit_ledger`)::

    python -m benchmarks.operating_points --model long-dllm-words-edit --target none \
        --out benchmarks/results/operating-points-edit.json --page operating-points-edit

``--wall-time`` adds :mod:`benchmarks.bench_cost_rules` results to the page (Spiffy at
``budget=auto`` against every rule and cache mode, in wall time; the JSON names the files),
and ``--render`` writes the page and plot again from ``--out``'s figures, measuring nothing::

    python -m benchmarks.operating_points --render --out benchmarks/results/operating-points-words.json \
        --wall-time benchmarks/results/cost_auto_rules_long.json benchmarks/results/cost_auto_rules_random512x8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_cost_rules import wall_time_section
from benchmarks.report import partner_defaults, shown_path, workload_tasks
from benchmarks.report_failfast import break_even_cost_ratio, check_models
from benchmarks.report_jobs import Context, Job, Runner, calibration_job, row_job
from benchmarks.report_measure import (
    BASELINE,
    CACHES,
    Config,
    cached,
    compare,
    drop_texts,
    spiffy_over,
)
from benchmarks.report_operating_points import (
    TOLERANCE,
    Grid,
    GridSpec,
    as_grid,
    choose,
    curves,
    edit_over_fill,
    equal_accuracy,
    grid_configs,
    grids_for,
    pareto_front,
    setting,
)
from benchmarks.report_store import MeasurementStore, run_identity
from benchmarks.report_tables import replace_marked
from benchmarks.report_targets import find_row, target_item
from dloom import DiffusionDecoder, load_model
from dloom.decode.transition import check_kernel
from dloom.errors import ConfigurationError, ModelError
from dloom.evaluation import select_examples
from dloom.hooks.composition import compose

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "operating-points.json"
DEFAULT_PAGE = "operating-points"
"""The default ``--page``: the run writes ``DOCS/benchmarks/<page>.md`` and ``DOCS/assets/<page>.png``."""
GOALS = {"frechet_saving": 0.20, "spiffy_speedup": 1.5, "stack_over_oracle": 1.5, "failfast_wall": 3.0}
"""Issue 42's targets: Fréchet's NFE saving over threshold at equal accuracy, Spiffy's NFE
ratio over the accuracy-keeping threshold, the best stack's NFE over the oracle's, FailFast's
wall-time speed-up over AR decoding."""
EDIT_GOALS = {"edit_over_fill": 1.5, "stack_over_oracle": 1.5}
"""Issue 53's targets on a model that edits: the best editing rule's NFE advantage over the
best fill rule at equal accuracy, and the best stack's NFE over the oracle's."""


def grids_json(grids: Mapping[str, GridSpec]) -> dict[str, dict[str, Any]]:
    """The run's grids as its JSON records them (:func:`grids_from_json` reads them back)."""
    return {name: {"rule": grid.rule, "parameter": grid.parameter, "values": list(grid.values),
                   "fixed": dict(grid.fixed), "cautious_when_larger": grid.cautious_when_larger, "edits": grid.edits}
            for name, grid in ((name, as_grid(name, spec)) for name, spec in grids.items())}


def grids_from_json(recorded: Mapping[str, Mapping[str, Any]]) -> dict[str, GridSpec]:
    """A report's grids from its JSON (a run before grids named their rule recorded the
    parameter and values of a fill rule's own curve)."""
    return {name: Grid(g["rule"], g["parameter"], tuple(g["values"]), g["cautious_when_larger"], dict(g["fixed"]),
                       g["edits"]) if "rule" in g else (g["parameter"], tuple(g["values"]))
            for name, g in recorded.items()}


def runs_spiffy(kernel: str) -> bool:
    """Whether Spiffy runs on models of ``kernel`` (it states its guarantee for the kernels
    its registration names)."""
    try:
        check_kernel(compose("spiffy+threshold"), kernel)
    except ConfigurationError:
        return False
    return True


def editing(report: Mapping[str, Any]) -> bool:
    """Whether ``report`` swept an editing rule (its targets are then issue 53's)."""
    return any(as_grid(name, spec).edits for name, spec in grids_from_json(report.get("grids", {})).items())


def accuracy_keeping_threshold(test_rows: Sequence[Mapping[str, Any]],
                               choices: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The threshold setting that keeps one token per step's accuracy on the held-out rows
    themselves (:func:`report_operating_points.choose` over threshold's held-out curve;
    ``test_rows[0]`` is quota), when it is matched there and is not the dev split's choice;
    else ``None``. Spiffy's target is also measured over it: a dev choice that loses accuracy
    on held-out prompts is not the accuracy-keeping threshold the target names."""
    curve = [r for r in test_rows if r["commit_rule"] == "threshold"]
    if not curve or "threshold" not in choices:
        return None
    keeping = choose(curve, test_rows[0]["accuracy"])
    return keeping if keeping["matched"] and keeping["name"] != choices["threshold"]["name"] else None


def spiffy_over_setting(rule: Config, graph: str) -> Config:
    """Spiffy over one grid setting (:func:`report_measure.spiffy_over`), named by the setting
    (``spiffy+threshold@0.9``) so that it stands apart from Spiffy over the dev choice."""
    return dataclasses.replace(spiffy_over(rule, graph), name=f"spiffy+{rule.name}")


def chosen_config(choice: Mapping[str, Any]) -> Config:
    """The configuration of a curve's chosen setting (no cache), as its grid point was measured."""
    curve = choice.get("curve", choice["rule"])
    fixed = choice.get("fixed", {})
    return next(config for config in grid_configs({curve: Grid(choice["rule"], choice["parameter"], (choice["value"],),
                                                                fixed=fixed)}))


def measure(
    model, model_name: str, tasks: str, n_dev: int, n: int, batch_size: int, *, test_grid: str = "all",
    spiffy: bool = True, spiffy_cache: str = "dual", calibration_paths: int = 500, spiffy_budget: int = 10,
    target: str | None = None, assistant: str | None = None, drafter_taus: Sequence[float] = (0.05, 0.9),
    failfast_n: int = 100, failfast_repeats: int = 3,
    workers: int = 1, device: str = "cpu", out: Path = DEFAULT_OUT, resume: bool = False,
    graphs: Path = ROOT / "benchmarks" / "results" / "graphs",
    grids: Mapping[str, GridSpec] | None = None,
) -> dict[str, Any]:
    """Run the three stages (module docstring) over ``grids`` (default: the grids of the
    model's kernel, :func:`report_operating_points.grids_for`); the run's figures (rows
    without texts).

    :raises ConfigurationError: with ``spiffy`` on a model whose kernel Spiffy does not run
        on, or a grid whose rule the model's kernel refuses.
    """
    grids = grids_for(model.kernel) if grids is None else grids
    for name, spec in grids.items():
        check_kernel(compose(as_grid(name, spec).rule), model.kernel)
    if spiffy and not runs_spiffy(model.kernel):
        raise ConfigurationError(f"Spiffy does not run on the model's {model.kernel!r} kernel; allowed: --no-spiffy")
    dev_examples = select_examples(tasks, n_dev, split="dev", evaluated=max(n, 1))
    test_examples = select_examples(tasks, n)
    DiffusionDecoder(model, BASELINE.strategy).generate([e.prompt for e in test_examples[:2]])  # warm up
    grid = grid_configs(grids)

    def runner(examples, split: str) -> Runner:
        store = MeasurementStore(out.with_suffix(f".{split}.measurements.jsonl"),
                                 run_identity(model, examples, batch_size), resume)
        context = Context(model, examples, tasks, batch_size, spiffy_budget)
        return Runner(store, context, workers, model_name, device)

    dev = runner(dev_examples, "dev")
    try:
        dev_rows = dev.run([row_job(BASELINE), *map(row_job, grid)])
    finally:
        dev.close()
    reused = list(dev.store.reused)
    dev_base = dev_rows[0]
    choices = {curve: choose([r for r in dev_rows if (setting(r, grids) or ("",))[0] == curve], dev_base["accuracy"],
                             grids=grids) for curve in grids}
    rules = [chosen_config(choices[curve]) for curve in grids]

    test = runner(test_examples, "test")
    try:
        swept = grid if test_grid == "all" else rules
        common = [Job("oracle", "oracle")]
        if target is not None:
            common.append(Job("failfast", "failfast", {"target": target, "assistant": assistant,
                                                       "drafter_taus": list(drafter_taus), "n": failfast_n,
                                                       "repeats": failfast_repeats}))
        description = {"tasks": tasks, "split": "train", "seed": 0}
        calibrations = [calibration_job(rule, [calibration_paths], graphs / Path(model_name).name, description,
                                        test.context) for rule in rules] if spiffy else []
        first = test.run([row_job(BASELINE), *map(row_job, swept), *common, *calibrations])
        test_rows = first[:1 + len(swept)]
        oracle, failfast = (*first[1 + len(swept):1 + len(swept) + len(common)], None)[:2]
        records = first[1 + len(swept) + len(common):]
        keeping = accuracy_keeping_threshold(test_rows, choices) if test_grid == "all" else None
        kept = [chosen_config(keeping)] if spiffy and keeping is not None else []
        kept_records = test.run([calibration_job(rule, [calibration_paths], graphs / Path(model_name).name,
                                                 description, test.context) for rule in kept]) if kept else []
        if spiffy:
            stacked = [cached(rule, spiffy_cache) for rule in rules]
            stacked += [cached(spiffy_over(rule, record[-1]["graph"]), spiffy_cache)
                        for rule, record in zip(rules, records)]
            stacked += [cached(spiffy_over_setting(rule, record[-1]["graph"]), spiffy_cache)
                        for rule, record in zip(kept, kept_records)]
            test_rows += [row for row in test.run(list(map(row_job, stacked))) if row["name"] not in
                          {r["name"] for r in test_rows}]
    finally:
        test.close()
    reused += test.store.reused
    compare(test_rows, oracle)
    compare(dev_rows, {"reached": [False] * n_dev, "nfe_mean": None})
    drop_texts(test_rows)
    drop_texts(dev_rows)
    for row in test_rows:  # graph files named from the repository, as the page shows them
        if "spiffy" in row["params"]:
            row["params"]["spiffy"]["graph"] = shown_path(Path(row["params"]["spiffy"]["graph"]))
    for row in test_rows:
        found = next((c for c in choices.values() if c["name"] == row["name"]), None)
        row["chosen_on_dev"] = found is not None
    report = {
        "kernel": model.kernel,
        "dev": {"n": n_dev, "rows": dev_rows, "equal_accuracy": equal_accuracy(dev_rows, dev_base, grids=grids)},
        "choices": choices,
        "tolerance": TOLERANCE,
        "grids": grids_json(grids),
        "test_grid": test_grid,
        "rows": test_rows,
        "oracle": {key: oracle[key] for key in ("nfe_mean", "reached_share")},
        "equal_accuracy": equal_accuracy(test_rows, test_rows[0], grids=grids),
        "pareto": [p["name"] for p in pareto_front([r for r in test_rows if r["cache"] == "none"])],
        "accuracy_keeping_threshold": keeping,
        "spiffy": {"cache": spiffy_cache, "paths": calibration_paths, "budget": spiffy_budget,
                   "graphs": {rule.name: {**record[-1], "graph": shown_path(Path(record[-1]["graph"]))}
                              for rule, record in zip([*rules, *kept], [*records, *kept_records])}}
        if spiffy else None,
        "failfast": failfast,
        "reused": reused,
    }
    report["targets"] = targets(report)
    return report


def spiffy_target(report: Mapping[str, Any], choice: Mapping[str, Any], stacked_name: str, which: str) -> dict[str, Any]:
    """Issue 42's Spiffy target over one threshold setting ``choice`` (``which`` says how it
    was chosen), from its row alone and Spiffy's row ``stacked_name`` under the run's cache."""
    goal = GOALS["spiffy_speedup"]
    name = (f"Spiffy ≥ {goal:g}× fewer NFE than the accuracy-keeping threshold, 100 % identical "
            f"(τ = {choice['value']:g}, {which})")
    spiffy = report.get("spiffy")
    if not spiffy:
        return target_item(name, "not measured", None, "run without --spiffy")
    cache = spiffy["cache"]
    suffix, under = ("", "no cache") if cache == "none" else (f"/{cache}", f"{cache} cache")
    alone = find_row(report, f"{choice['name']}{suffix}")
    stacked = find_row(report, f"{stacked_name}{suffix}")
    if alone is None or stacked is None:
        return target_item(name, "not measured", None, "threshold or Spiffy over it missing")
    ratio = alone["nfe_mean"] / stacked["nfe_mean"]
    identical = stacked["identical_to_commit_rule"]
    return target_item(name, f"{ratio:.2f}×, {identical:.0%} identical", ratio >= goal and identical == 1.0,
                       f"{under}: {alone['nfe_mean']:.2f} → {stacked['nfe_mean']:.2f} NFE; held-out accuracy "
                       f"{alone['accuracy']:.1%}" + ("" if ratio >= goal else f"; {goal / ratio:.2f}× short"))


def edit_targets(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 53's targets on a model that edits, with their figures from ``report``.

    * the best editing rule needs ``EDIT_GOALS["edit_over_fill"]`` times fewer NFE than the
      best fill rule at equal accuracy (one point below quota's, each curve interpolated:
      :func:`report_operating_points.edit_over_fill`);
    * the best stack within ``EDIT_GOALS["stack_over_oracle"]`` of the oracle's NFE. Spiffy
      and FailFast are refused on the revisable kernel, so no speculative stack runs on such
      a model: its stack is the best configuration measured, the held-out row of the fewest
      NFE among those within one point of quota's accuracy (quota itself aside), whatever
      rule it runs.
    """
    items = []
    goal = EDIT_GOALS["edit_over_fill"]
    equal = report["equal_accuracy"]
    name = (f"best editing rule ≥ {goal:g}× fewer NFE than the best fill rule at equal accuracy "
            f"({equal['accuracy']:.1%}, one point below quota)")
    grids = grids_from_json(report["grids"])
    versus = edit_over_fill(equal, grids)
    if versus["ratio"] is None:
        reason = {"edit unreached": "no editing rule reaches that accuracy",
                  "fill unreached": f"no fill rule reaches that accuracy; {versus['edit']} does in "
                                    f"{versus['edit_nfe'] or 0:.2f} NFE"}.get(versus["bound"] or "",
                                                                          "both NFE are only bounded above")
        items.append(target_item(name, "not comparable", True if versus["bound"] == "fill unreached" else None, reason))
    else:
        ratio, bound = versus["ratio"], versus["bound"]
        shown = f"{ratio:.2f}×" + ("" if bound == "equal" else f" ({bound})")
        # a bound decides the target only on its own side: "at least" a met goal, "at most" a missed one
        met = {"equal": ratio >= goal, "at least": True if ratio >= goal else None,
               "at most": False if ratio < goal else None}[bound]
        detail = (f"{versus['edit']} {versus['edit_nfe']:.2f} against {versus['fill']} {versus['fill_nfe']:.2f} NFE "
                  "(interpolated on each curve's held-out front)"
                  + ("" if ratio >= goal else f"; {goal / ratio:.2f}× short" + ("" if bound == "equal" else " at most")))
        if met is None and bound == "at least":  # the editing NFE only bounded above: its measured floor decides
            edit_rows = [row for curve, found in curves(report["rows"], grids).items()
                         if as_grid(curve, grids[curve]).edits for row in found]
            fewest = min(edit_rows, key=lambda row: row["nfe_mean"])
            if versus["fill_nfe"] / fewest["nfe_mean"] < goal:
                met = False
                detail += (f"; no editing setting measured takes fewer than {fewest['nfe_mean']:.2f} NFE at any "
                           f"accuracy ({fewest['label']}), and {goal:g}× needs ≤ {versus['fill_nfe'] / goal:.2f}")
        items.append(target_item(name, shown, met, detail))
    goal = EDIT_GOALS["stack_over_oracle"]
    name = (f"best stack within {goal:g}× of the oracle's NFE (stack: the fewest-NFE configuration within one "
            "point of quota's accuracy; Spiffy and FailFast are refused on the revisable kernel)")
    floor = report["rows"][0]["accuracy"] - report["tolerance"] - 1e-9
    kept = [r for r in report["rows"][1:] if r["accuracy"] >= floor and r.get("nfe_over_oracle") is not None]
    if not kept:
        items.append(target_item(name, "not measured", None, "no row keeps accuracy, or the oracle reproduced no output"))
    else:
        best = min(kept, key=lambda r: r["nfe_over_oracle"])
        over = best["nfe_over_oracle"]
        items.append(target_item(name, f"{over:.2f}× ({best['label']})", over <= goal,
                                 f"{best['nfe_mean']:.2f} NFE at {best['accuracy']:.1%}; oracle "
                                 f"{report['oracle']['nfe_mean']:.2f} NFE on {report['oracle']['reached_share']:.0%} "
                                 "of the prompts (the fewest forwards a fill rule needs for quota's own output)"
                                 + ("" if over <= goal else f"; {over / goal:.2f}× over")))
    return items


def targets(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The targets with their figures from ``report``: issue 53's on a model that edits
    (:func:`edit_targets`), else issue 42's: ``{"target", "measured", "met" (``None``: not
    measured), "detail"}`` each."""
    if editing(report):
        return edit_targets(report)
    items = []
    goal = GOALS["frechet_saving"]
    frechet = report["equal_accuracy"]["rules"].get("frechet", {})
    at = report["equal_accuracy"]["accuracy"]
    name = f"Fréchet ≥ {goal:.0%} fewer NFE than threshold at equal accuracy ({at:.1%}, one point below quota)"
    threshold = report["equal_accuracy"]["rules"].get("threshold", {})
    if frechet.get("saving_vs_reference") is None:
        items.append(target_item(name, "not comparable", None,
                           f"threshold {threshold.get('bound')}, Fréchet {frechet.get('bound')} at that accuracy"))
    else:
        saving = frechet["saving_vs_reference"]
        bound = "" if frechet["saving_bound"] == "equal" else " (at least)"
        items.append(target_item(name, f"{saving:.1%}{bound}", saving >= goal,
                           f"{frechet['nfe_mean']:.2f} against {threshold['nfe_mean']:.2f} NFE (interpolated on "
                           "each rule's held-out curve)" + ("" if saving >= goal else f"; {goal - saving:.1%} short")))
    items.append(spiffy_target(report, report["choices"]["threshold"], "spiffy+threshold", "chosen on dev"))
    keeping = report.get("accuracy_keeping_threshold")
    if keeping is not None:
        items.append(spiffy_target(report, keeping, f"spiffy+{keeping['name']}",
                                   "the one that keeps accuracy on these held-out prompts"))
    goal = GOALS["stack_over_oracle"]
    name = f"best stack (Spiffy over a rule) within {goal:g}× of the oracle's NFE"
    stacks = [r for r in report["rows"] if r["speculation"] and r.get("nfe_over_oracle") is not None]
    if not stacks:
        items.append(target_item(name, "not measured", None, "no Spiffy row, or the oracle reproduced no output"))
    else:
        best = min(stacks, key=lambda r: r["nfe_over_oracle"])
        items.append(target_item(name, f"{best['nfe_over_oracle']:.2f}× ({best['label']})", best["nfe_over_oracle"] <= goal,
                           f"oracle {report['oracle']['nfe_mean']:.2f} NFE on {report['oracle']['reached_share']:.0%} "
                           "of the prompts"))
    goal = GOALS["failfast_wall"]
    name = f"FailFast ≥ {goal:g}× AR decoding in wall time on this CPU, identical outputs"
    failfast = report.get("failfast")
    if not failfast:
        items.append(target_item(name, "not measured", None, "run without --target"))
    else:
        best = failfast["methods"][failfast["best"]]
        speedup = best["wall_speedup_vs_ar"]
        items.append(target_item(
            name, f"{speedup:.2f}×, {best['identical_to_ar']:.0%} identical",
            speedup >= goal and best["identical_to_ar"] == 1.0,
            f"drafter τ {best['drafter_tau']!r} (chosen by {failfast['chosen_by']}); modelled "
            f"{best['modelled_speedup_vs_ar']:.2f}× (drafter/target forward cost ratio "
            f"{failfast['latency']['ratio']:.2f}); {best['target_forwards_per_prompt']:.1f} target forwards "
            "per prompt" + ("" if speedup >= goal else f"; {goal / speedup:.2f}× short")
            + break_even_note(failfast["methods"]["ar"], best, goal, failfast["latency"]["ratio"])))
    return items


def break_even_note(ar: Mapping[str, Any], method: Mapping[str, Any], goal: float, ratio: float) -> str:
    """Where the latency model would reach ``goal`` with this run's forwards: the drafter/target
    cost ratio it needs (:func:`report_failfast.break_even_cost_ratio`) against the measured
    ``ratio``."""
    needed = break_even_cost_ratio(ar, method, goal)
    if needed is None:
        return f"; the latency model cannot reach {goal:g}× with these target forwards, however cheap the drafter"
    return f"; the latency model reaches {goal:g}× at a drafter/target cost ratio ≤ {needed:.2f} (measured {ratio:.2f})"


# --- the page and the plot ------------------------------------------------------------------


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def editing_section(report: Mapping[str, Any]) -> list[str]:
    """The page's account of a run on a model that edits: its curves (which rule, which
    parameter swept, which held fixed) and what "stack" means there."""
    lines = ["## Rules and grids", "",
             f"`{report['model']}` decodes with the `{report.get('kernel', 'revisable')}` kernel, so editing rules run "
             "on it as well as fill rules. Each curve sweeps one parameter of its rule, the others held fixed. "
             "*Edits / answer* counts the writes that changed a filled position (rewrites, remasks, moves); "
             "*fixed by an edit* is the share of answers that are right while the answer of their drafts alone "
             "(each position's first filled token) is wrong, *broken by an edit* the other way round "
             "(`dloom.decode.edit_ledger`).", "",
             "| curve | rule | kind | swept | values | fixed |", "|---|---|---|---|---|---|"]
    for name, spec in grids_from_json(report["grids"]).items():
        grid = as_grid(name, spec)
        fixed = ", ".join(f"{key} = {value:g}" for key, value in grid.fixed.items()) or "–"
        lines.append(f"| {name} | `{grid.rule}` | {'edits' if grid.edits else 'fills'} | {grid.parameter} | "
                     f"{', '.join(f'{v:g}' for v in grid.values)} | {fixed} |")
    lines += ["", "**Stack.** Spiffy and FailFast are refused on the revisable kernel (their guarantee is stated "
              "for the absorbing one), so no speculation runs over any rule of this model. The *best stack* is "
              "therefore the best configuration measured: the held-out row of the fewest NFE within one point of "
              "quota's accuracy, whatever rule it runs. The oracle is the fewest forwards a fill rule needs to "
              "write quota's own output; an editing rule writes other outputs, so it may need fewer.", ""]
    return lines


def page(report: Mapping[str, Any], out: Path, plot_file: str = f"{DEFAULT_PAGE}.png",
         wall_time: Sequence[Mapping[str, Any]] = ()) -> str:
    """The generated Markdown page of a run (never edited by hand); ``plot_file``: the
    plot's name in ``DOCS/assets``; ``wall_time``: :mod:`benchmarks.bench_cost_rules`
    results (files named by ``report["wall_time"]``), each a section on Spiffy's wall time at
    ``budget=auto`` against every rule and cache mode."""
    edits = editing(report)
    lines = [
        "# Operating points: settings chosen on a dev split" + (" (a model that edits)" if edits else ""),
        "",
        "<!-- generated by benchmarks/operating_points.py; do not edit by hand -->",
        "",
        f"Generated on {report['date']} by `{report['command']}` ({report['seconds']:.0f} s"
        + (f"; resumed with `--resume`, which reused {len(report['reused'])} measurements of the stopped run, so "
           f"{report['seconds']:.0f} s is this part's time" if report.get("reused") else "")
        + f", {report['machine']}, torch {report['torch']}, {report['torch_threads']} thread(s)); every figure is in "
        f"`{shown_path(out)}`. Model `{report['model']}`, suite `{report['tasks']}`, greedy, batch "
        f"{report['batch_size']}.",
        "",
        f"Each rule's setting was chosen on **{report['dev']['n']} dev prompts** (held-out prompts drawn apart from "
        f"the ones scored below, `select_examples(split=\"dev\")`): the fewest NFE within {report['tolerance']:.0%} "
        f"(one point) of one token per step's accuracy there. The figures below are on **{report['n']} held-out "
        "prompts** (those `dloom eval -n` scores), which the choice never saw.",
        "",
        *(editing_section(report) if edits else []),
        "## Targets",
        "",
        "| target | measured | met | detail |",
        "|---|---|---|---|",
        *(f"| {t['target']} | {t['measured']} | {'–' if t['met'] is None else ('yes' if t['met'] else 'no')} | "
          f"{t['detail']} |" for t in report["targets"]),
        "",
        "## Chosen settings",
        "",
        "| rule | chosen on dev | dev accuracy | dev NFE | held-out accuracy | held-out NFE | NFE ratio vs quota |",
        "|---|---|---|---|---|---|---|",
    ]
    base = report["rows"][0]
    for rule, choice in report["choices"].items():
        row = find_row(report, choice["name"])
        fixed = "".join(f", {key} = {value:g}" for key, value in choice.get("fixed", {}).items())
        shown = f"{choice['parameter']} = {choice['value']:g}{fixed}" + ("" if choice["matched"] else " (none matched)")
        lines.append(
            f"| {rule} | {shown} | {_percent(choice['accuracy'])} | {choice['nfe_mean']:.2f} | "
            + (f"{_percent(row['accuracy'])} | {row['nfe_mean']:.2f} | {row['nfe_ratio']:.2f}× |" if row else "– | – | – |"))
    lines += [f"| quota (one token per step) | – | {_percent(report['dev']['rows'][0]['accuracy'])} | "
              f"{report['dev']['rows'][0]['nfe_mean']:.2f} | {_percent(base['accuracy'])} | {base['nfe_mean']:.2f} | 1.00× |",
              ""]
    equal = report["equal_accuracy"]
    lines += [
        "## At equal accuracy",
        "",
        f"Each rule's NFE at {equal['accuracy']:.1%} held-out accuracy (one point below quota's "
        f"{equal['baseline_accuracy']:.1%}), interpolated linearly between the two settings of its curve's front "
        "that bracket it; the saving is against threshold's NFE there.",
        "",
        "| rule | NFE at that accuracy | how | saving vs threshold |",
        "|---|---|---|---|",
    ]
    for rule, point in equal["rules"].items():
        nfe = "–" if point["nfe_mean"] is None else f"{point['nfe_mean']:.2f}"
        saving = _percent(point["saving_vs_reference"]) + (" (at least)" if point["saving_bound"] == "at least" else "")
        lines.append(f"| {rule} | {nfe} | {point['bound']} | {saving} |")
    wall = any("wall_seconds" in row for row in report["rows"])
    extra = (["wall ms / prompt"] if wall else []) + (["edits / answer", "fixed by an edit", "broken by an edit"]
                                                        if edits else [])
    lines += ["", f"![accuracy against NFE per rule, held-out](../assets/{plot_file})", "",
              "## Every row (held-out)", "",
              "| configuration | accuracy | NFE | TPF | TPS | " + "".join(f"{c} | " for c in extra)
              + "NFE ÷ oracle | identical to its rule | Pareto |",
              "|---|---|---|---|---|" + "---|" * len(extra) + "---|---|---|"]
    for row in report["rows"]:
        identical = row["identical_to_commit_rule"]
        over = row.get("nfe_over_oracle")
        cells = ([f"{1000 * row['wall_seconds'] / report['n']:.1f}" if row.get("wall_seconds") else "–"] if wall else [])
        if edits:
            per_answer = row.get("edits_per_answer")
            cells += ["–" if per_answer is None else f"{per_answer:.2f}", _percent(row.get("fixed_by_edit_share")),
                      _percent(row.get("broken_by_edit_share"))]
        lines.append(
            f"| {row['label']}{' (chosen)' if row.get('chosen_on_dev') else ''} | {_percent(row['accuracy'])} | "
            f"{row['nfe_mean']:.2f} | {row['tpf']:.2f} | {row['tps']:.1f} | " + "".join(f"{c} | " for c in cells)
            + f"{'–' if over is None else f'{over:.2f}'} | "
            f"{'–' if identical is None else f'{identical:.0%}'} | {'yes' if row['name'] in report['pareto'] else ''} |")
    lines += ["", "## Every row (dev)", "", "| configuration | accuracy | NFE |", "|---|---|---|"]
    lines += [f"| {row['label']} | {_percent(row['accuracy'])} | {row['nfe_mean']:.2f} |" for row in report["dev"]["rows"]]
    failfast = report.get("failfast")
    if failfast:
        lines += ["", "## FailFast", "",
                  f"`{failfast['drafter']}` drafts for `{failfast['target']}`, greedy, one prompt at a time, "
                  f"{failfast['n']} held-out prompts; wall time is the median of {failfast['repeats']} passes, "
                  f"methods interleaved. Latency model: drafter forwards × {failfast['latency']['drafter']*1e3:.2f} ms "
                  f"+ target forwards × {failfast['latency']['target']*1e3:.2f} ms (one forward of each measured on "
                  f"this machine: ratio {failfast['latency']['ratio']:.2f}). The drafter τ is chosen by "
                  f"{failfast['chosen_by']} among the lossless ones.", "",
                  "| method | accuracy | target forwards / prompt | helper forwards | wall s | wall speed-up | "
                  "modelled speed-up | identical to AR |", "|---|---|---|---|---|---|---|---|"]
        for name, m in failfast["methods"].items():
            lines.append(f"| {name}{' (chosen)' if name == failfast['best'] else ''} | {_percent(m['accuracy'])} | "
                         f"{m['target_forwards_per_prompt']:.1f} | {m['helper_forwards']} | {m['wall_seconds']:.2f} | "
                         f"{m['wall_speedup_vs_ar']:.2f}× | {m['modelled_speedup_vs_ar']:.2f}× | "
                         f"{m['identical_to_ar']:.0%} |")
    if wall_time:
        lines += ["", "## Wall time at `budget=auto`", "",
                  "Spiffy's default budget chooses its drafts from the forward cost measured when the decoder is "
                  "built; these runs time it against each rule alone, at the settings chosen above, with each "
                  f"cache mode (`benchmarks.bench_cost_rules`; files: "
                  f"{', '.join(f'`{name}`' for name in report.get('wall_time', []))}).", ""]
        lines += [wall_time_section(results) for results in wall_time]
    return "\n".join(lines) + "\n"


def headline(report: Mapping[str, Any]) -> str:
    """The README's operating-point table (between ``<!-- report:operating-points:start -->``
    and ``<!-- report:operating-points:end -->``): quota, each rule at its dev-chosen setting and Spiffy
    over it, held-out figures, then the targets."""
    base = report["rows"][0]
    chosen = {c["name"] for c in report["choices"].values()}
    spiffy = report.get("spiffy") or {}
    suffix = "" if spiffy.get("cache", "none") == "none" else f"/{spiffy.get('cache')}"
    shown = [base, *(r for r in report["rows"] if r["name"] in chosen)]
    shown += [r for r in report["rows"] if suffix and r["name"] in {f"{n}{suffix}" for n in chosen}]
    shown += [r for r in report["rows"] if r["speculation"]]
    lines = [
        f"Measured by `{report['command']}` on `{report['model']}` ({report['date']}): each rule's setting chosen on "
        f"{report['dev']['n']} dev prompts (the fewest forwards within one point of one token per step's accuracy), "
        f"scored on {report['n']} other held-out prompts; greedy, {report['torch_threads']} CPU thread(s). "
        "Ratios are against one token per step in the same run.",
        "",
        "| configuration | accuracy | NFE / prompt | fewer NFE | TPS speed-up | outputs = its rule alone |",
        "|---|---|---|---|---|---|",
    ]
    for row in shown:
        identical = row["identical_to_commit_rule"]
        lines.append(f"| {row['label']}{' (quota)' if row is base else ''} | {row['accuracy']:.1%} | "
                     f"{row['nfe_mean']:.2f} | {row['nfe_ratio']:.1f}× | {row['tps_ratio']:.2f}× | "
                     f"{'' if identical is None else f'{identical:.0%}'} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {'–' if t['met'] is None else ('yes' if t['met'] else 'no')} |"
              for t in report["targets"]]
    return "\n".join(lines)


ZOOM_POINTS = 5.0
"""On a model that edits, the plot's second panel shows accuracies within this many points of
quota's, where the rules that keep accuracy are told apart."""


def _draw(ax: Any, report: Mapping[str, Any]) -> None:
    """One panel of :func:`plot` on the matplotlib axes ``ax``."""
    chosen = {c["name"] for c in report["choices"].values()}
    grids = grids_from_json(report["grids"])
    for rule, curve in curves(report["rows"], grids).items():
        xs, ys = [r["nfe_mean"] for r in curve], [100 * r["accuracy"] for r in curve]
        edits = as_grid(rule, grids[rule]).edits
        ax.plot(xs, ys, marker="D" if edits else "o", linestyle="--" if edits else "-",
                label=f"{rule} (edits)" if edits else rule)
        for r in curve:
            if r["name"] in chosen:
                ax.scatter([r["nfe_mean"]], [100 * r["accuracy"]], s=160, facecolors="none", edgecolors="black")
    base = report["rows"][0]
    ax.scatter([base["nfe_mean"]], [100 * base["accuracy"]], marker="s", color="black", label="quota")
    for row in report["rows"]:
        if row["speculation"]:
            ax.scatter([row["nfe_mean"]], [100 * row["accuracy"]], marker="*", s=120, label=row["label"])
    front = [r for r in report["rows"] if r["name"] in report["pareto"]]
    front.sort(key=lambda r: r["nfe_mean"])
    ax.step([r["nfe_mean"] for r in front], [100 * r["accuracy"] for r in front], where="post", color="grey",
            linestyle=":", label="Pareto front")
    ax.axhline(100 * report["equal_accuracy"]["accuracy"], color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("NFE per prompt (log)")
    ax.set_ylabel(f"held-out accuracy, % of {report['n']}")


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Accuracy against NFE: each rule's held-out curve (an editing rule's dashed), its
    chosen setting circled, quota, the Spiffy stacks and the Pareto front; on a model that
    edits, a second panel within :data:`ZOOM_POINTS` of quota's accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not editing(report):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _draw(ax, report)
        ax.legend(fontsize=7)
    else:
        fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.8))
        for panel in (ax, zoom):
            _draw(panel, report)
        top = 100 * max(r["accuracy"] for r in report["rows"])
        low = 100 * report["rows"][0]["accuracy"] - ZOOM_POINTS
        near = [r["nfe_mean"] for r in report["rows"] if 100 * r["accuracy"] >= low and r["cache"] == "none"]
        zoom.set_ylim(low, top + 0.5)
        zoom.set_xlim(0.95 * min(near), 1.05 * max(n for n in near if n < report["rows"][0]["nfe_mean"]))
        zoom.set_title(f"within {ZOOM_POINTS:g} points of quota (quota off to the right)", fontsize=9)
        ax.set_title("every setting", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recorded_options(argv: list[str]) -> list[str]:
    """``argv`` as the recorded command writes it: without the options that only say where
    outputs go or that reuse a stopped run (``--resume``, ``--docs``, ``--readme``)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            continue
        elif arg in ("--docs", "--readme"):
            skip = True
        elif not arg.startswith(("--docs=", "--readme=")):
            shown.append(arg)
    return shown


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="long-dllm-words", help="zoo name or checkpoint directory (with a tokenizer)")
    parser.add_argument("--n-dev", type=int, default=300, help="dev prompts the settings are chosen on")
    parser.add_argument("-n", type=int, default=300, help="held-out prompts the choices are scored on")
    parser.add_argument("--test-grid", choices=("all", "chosen"), default="all",
                        help="held-out rows: every grid point (curves) or the chosen settings only")
    parser.add_argument("--spiffy", action=argparse.BooleanOptionalAction, default=None,
                        help="Spiffy over each chosen setting (graphs calibrated on training prompts); default: "
                        "where the model's kernel runs it (not on the revisable kernel)")
    parser.add_argument("--spiffy-cache", choices=CACHES, default="dual")
    parser.add_argument("--calibration-paths", type=int, default=500)
    parser.add_argument("--spiffy-budget", type=int, default=10)
    parser.add_argument("--target", default=None, help="AR target for FailFast; 'none': without (default: the zoo's)")
    parser.add_argument("--assistant", default=None, help="assistant for assisted generation; 'none': without")
    parser.add_argument("--drafter-taus", default="0.05,0.5,0.9", help="FailFast drafter thresholds, each in (0, 1)")
    parser.add_argument("--failfast-n", type=int, default=100, help="FailFast: the first N held-out prompts")
    parser.add_argument("--failfast-repeats", type=int, default=3, help="FailFast: passes per method (median)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    parser.add_argument("--page", default=DEFAULT_PAGE,
                        help="the page and plot's name: DOCS/benchmarks/PAGE.md and DOCS/assets/PAGE.png")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--wall-time", type=Path, nargs="+", default=None, metavar="JSON",
                        help="benchmarks.bench_cost_rules results shown on the page (Spiffy at budget=auto "
                        "against every rule and cache mode, in wall time)")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: write the page and plot from --out's figures (and --wall-time's)")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also write the headline table into this README and DOCS/index.md (between "
                        "<!-- report:operating-points:start --> and <!-- report:operating-points:end -->)")
    args = parser.parse_args(argv)
    if args.n_dev < 1 or args.n < 1:
        parser.error(f"--n-dev {args.n_dev} and -n {args.n}: allowed: 1 or more prompts each")
    if not args.page or not all(c.isalnum() or c in "-_." for c in args.page) or args.page.startswith("."):
        parser.error(f"--page {args.page!r}: allowed: a file name of letters, digits, '-', '_' and '.'")
    counts = {"--workers": args.workers, "--threads": args.threads, "--batch-size": args.batch_size,
              "--calibration-paths": args.calibration_paths, "--spiffy-budget": args.spiffy_budget,
              "--failfast-n": args.failfast_n, "--failfast-repeats": args.failfast_repeats}
    bad = {flag: value for flag, value in counts.items() if value < 1}
    if bad:
        flag, value = next(iter(bad.items()))
        parser.error(f"{flag} {value}: allowed: 1 or more")
    try:
        taus = tuple(float(t) for t in args.drafter_taus.split(",") if t.strip())
    except ValueError:
        parser.error(f"--drafter-taus {args.drafter_taus!r}: comma-separated numbers, each in (0, 1)")
    if not taus or any(not 0 < t < 1 for t in taus) or len(set(taus)) < len(taus):
        parser.error(f"--drafter-taus {args.drafter_taus!r}: distinct thresholds, each in (0, 1)")
    wall_time = [read_wall_time(path, parser) for path in args.wall_time or []]
    if args.render:
        if not args.out.is_file():
            parser.error(f"--render: --out {args.out} holds no run's figures; allowed: the JSON a run wrote")
        report = json.loads(args.out.read_text())
        if args.wall_time is not None:
            report["wall_time"] = [shown_path(path) for path in args.wall_time]
            args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        else:
            wall_time = [read_wall_time(ROOT / path, parser) for path in report.get("wall_time", [])]
        write_pages(report, args, wall_time, [args.out] if args.wall_time is not None else None)
        return
    args.target, default_assistant = partner_defaults(args.model, args.target)
    args.assistant = args.assistant or default_assistant
    target = None if args.target == "none" else args.target
    assistant = None if args.assistant == "none" else args.assistant
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    command = " ".join(["python -m benchmarks.operating_points", *recorded_options(
        list(argv if argv is not None else sys.argv[1:]))])
    try:
        model = load_model(args.model, device=args.device)
        tasks = workload_tasks(model)
        if target is not None:
            check_models(model, target, assistant)
        spiffy = args.spiffy if args.spiffy is not None else runs_spiffy(model.kernel)
        report = measure(
            model, args.model, tasks, args.n_dev, args.n, args.batch_size, test_grid=args.test_grid,
            spiffy=spiffy, spiffy_cache=args.spiffy_cache, calibration_paths=args.calibration_paths,
            spiffy_budget=args.spiffy_budget, target=target, assistant=assistant, drafter_taus=taus,
            failfast_n=args.failfast_n, failfast_repeats=args.failfast_repeats,
            workers=args.workers, device=args.device, out=args.out, resume=args.resume,
        )
    except (ConfigurationError, ModelError) as error:
        parser.exit(2, f"operating_points.py: error: {error}\n")
    report = {
        "command": command, "date": datetime.date.today().isoformat(), "model": args.model, "tasks": tasks,
        "n": args.n, "batch_size": args.batch_size, "torch_threads": args.threads,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
        **report, "seconds": round(time.perf_counter() - started, 1),
        "wall_time": [shown_path(path) for path in args.wall_time or []],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    write_pages(report, args, wall_time, [args.out])


def read_wall_time(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A :mod:`benchmarks.bench_cost_rules` result file (``--wall-time``), or the parser's
    error naming it."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        parser.error(f"--wall-time {path}: cannot read it as JSON ({error})")
    if not isinstance(results, dict) or "rows" not in results or "model" not in results:
        parser.error(f"--wall-time {path}: not a benchmarks.bench_cost_rules result (no 'model' and 'rows')")
    return results


def write_pages(report: Mapping[str, Any], args: argparse.Namespace, wall_time: Sequence[Mapping[str, Any]],
                written: list[Path] | None = None) -> None:
    """Write a run's page and plot (and with ``--readme`` its headline), naming each file
    written on stderr."""
    written = list(written or [])
    (args.docs / "benchmarks").mkdir(parents=True, exist_ok=True)
    (args.docs / "assets").mkdir(parents=True, exist_ok=True)
    page_path, plot_path = args.docs / "benchmarks" / f"{args.page}.md", args.docs / "assets" / f"{args.page}.png"
    page_path.write_text(page(report, args.out, plot_path.name, wall_time))
    plot(report, plot_path)
    written += [page_path, plot_path]
    if args.readme is not None:
        for target in (args.readme, args.docs / "index.md"):
            target.write_text(replace_marked(target.read_text(), "operating-points", headline(report)))
            written.append(target)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
