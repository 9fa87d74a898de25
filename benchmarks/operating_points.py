"""Operating points: every commit rule swept on a dev split, each rule's setting chosen there,
and the choices scored on held-out prompts against one token per step.

::

    python -m benchmarks.operating_points --workers 2          # long-dllm-words: 300 dev, 300 held-out
    python -m benchmarks.operating_points ... --resume         # the same run, stopped: measure the rest
    python -m benchmarks.operating_points --model toy-dllm --n-dev 40 -n 60 --no-spiffy --target none

Stages (each stage's measurements run at once with ``--workers``; every finished one is kept
at once next to ``--out`` and reused by ``--resume``):

1. **dev** (``--n-dev`` prompts of :func:`dloom.zoo.tasks.dev`, never one of the ``-n``
   held-out prompts of stage 2): one token per step (quota) and every grid point of
   :data:`report_operating_points.GRIDS`; each rule's setting is chosen there
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
targets with their measured figures (:func:`targets`). It writes ``--out`` (default
``benchmarks/results/operating-points.json``), ``DOCS/benchmarks/operating-points.md`` and
``DOCS/assets/operating-points.png``.
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
    GRIDS,
    TOLERANCE,
    choose,
    curves,
    equal_accuracy,
    grid_configs,
    pareto_front,
    setting_name,
)
from benchmarks.report_store import MeasurementStore, run_identity
from benchmarks.report_tables import replace_marked
from benchmarks.report_targets import find_row, target_item
from dloom import DiffusionDecoder, load_model
from dloom.errors import ConfigurationError, ModelError
from dloom.evaluation import select_examples

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "operating-points.json"
PAGE = Path("benchmarks") / "operating-points.md"
PLOT = "operating-points.png"
GOALS = {"frechet_saving": 0.20, "spiffy_speedup": 1.5, "stack_over_oracle": 1.5, "failfast_wall": 3.0}
"""Issue 42's targets: Fréchet's NFE saving over threshold at equal accuracy, Spiffy's NFE
ratio over the accuracy-keeping threshold, the best stack's NFE over the oracle's, FailFast's
wall-time speed-up over AR decoding."""


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
    """The configuration of a rule's chosen setting (no cache)."""
    return Config(setting_name(choice["rule"], choice["value"]),
                  f"{choice['rule']} {choice['parameter']} = {choice['value']:g}", choice["rule"],
                  {choice["parameter"]: choice["value"]})


def measure(
    model, model_name: str, tasks: str, n_dev: int, n: int, batch_size: int, *, test_grid: str = "all",
    spiffy: bool = True, spiffy_cache: str = "dual", calibration_paths: int = 500, spiffy_budget: int = 10,
    target: str | None = None, assistant: str | None = None, drafter_taus: Sequence[float] = (0.05, 0.9),
    failfast_n: int = 100, failfast_repeats: int = 3,
    workers: int = 1, device: str = "cpu", out: Path = DEFAULT_OUT, resume: bool = False,
    graphs: Path = ROOT / "benchmarks" / "results" / "graphs",
    grids: Mapping[str, tuple[str, Sequence[float]]] = GRIDS,
) -> dict[str, Any]:
    """Run the three stages (module docstring) over ``grids`` (every rule of
    :data:`report_operating_points.GRIDS`, each with a grid of its parameter); the run's
    figures (rows without texts)."""
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
    choices = {rule: choose([r for r in dev_rows if r["commit_rule"] == rule], dev_base["accuracy"])
               for rule in grids}
    rules = [chosen_config(choices[rule]) for rule in grids]

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
        "dev": {"n": n_dev, "rows": dev_rows, "equal_accuracy": equal_accuracy(dev_rows, dev_base)},
        "choices": choices,
        "tolerance": TOLERANCE,
        "grids": {rule: {"parameter": parameter, "values": list(values)} for rule, (parameter, values) in grids.items()},
        "test_grid": test_grid,
        "rows": test_rows,
        "oracle": {key: oracle[key] for key in ("nfe_mean", "reached_share")},
        "equal_accuracy": equal_accuracy(test_rows, test_rows[0]),
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


def targets(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 42's targets with their figures from ``report``: ``{"target", "measured", "met"
    (``None``: not measured), "detail"}`` each."""
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


def page(report: Mapping[str, Any], out: Path) -> str:
    """The generated Markdown page of a run (never edited by hand)."""
    lines = [
        "# Operating points: settings chosen on a dev split",
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
        shown = f"{choice['parameter']} = {choice['value']:g}" + ("" if choice["matched"] else " (none matched)")
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
    lines += ["", f"![accuracy against NFE per rule, held-out]({'../assets/' + PLOT})", "",
              "## Every row (held-out)", "",
              "| configuration | accuracy | NFE | TPF | TPS | NFE ÷ oracle | identical to its rule | Pareto |",
              "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        identical = row["identical_to_commit_rule"]
        over = row.get("nfe_over_oracle")
        lines.append(
            f"| {row['label']}{' (chosen)' if row.get('chosen_on_dev') else ''} | {_percent(row['accuracy'])} | "
            f"{row['nfe_mean']:.2f} | {row['tpf']:.2f} | {row['tps']:.1f} | {'–' if over is None else f'{over:.2f}'} | "
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


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Accuracy against NFE: each rule's held-out curve, its chosen setting circled, quota,
    the Spiffy stacks and the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    chosen = {c["name"] for c in report["choices"].values()}
    for rule, curve in curves(report["rows"]).items():
        xs, ys = [r["nfe_mean"] for r in curve], [100 * r["accuracy"] for r in curve]
        ax.plot(xs, ys, marker="o", label=rule)
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
    ax.legend(fontsize=7)
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
    parser.add_argument("--spiffy", action=argparse.BooleanOptionalAction, default=True,
                        help="Spiffy over each chosen setting (graphs calibrated on training prompts)")
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
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also write the headline table into this README and DOCS/index.md (between "
                        "<!-- report:operating-points:start --> and <!-- report:operating-points:end -->)")
    args = parser.parse_args(argv)
    if args.n_dev < 1 or args.n < 1:
        parser.error(f"--n-dev {args.n_dev} and -n {args.n}: allowed: 1 or more prompts each")
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
        report = measure(
            model, args.model, tasks, args.n_dev, args.n, args.batch_size, test_grid=args.test_grid,
            spiffy=args.spiffy, spiffy_cache=args.spiffy_cache, calibration_paths=args.calibration_paths,
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
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    (args.docs / "benchmarks").mkdir(parents=True, exist_ok=True)
    (args.docs / "assets").mkdir(parents=True, exist_ok=True)
    (args.docs / PAGE).write_text(page(report, args.out))
    plot(report, args.docs / "assets" / PLOT)
    written = [args.out, args.docs / PAGE, args.docs / "assets" / PLOT]
    if args.readme is not None:
        for target in (args.readme, args.docs / "index.md"):
            target.write_text(replace_marked(target.read_text(), "operating-points", headline(report)))
            written.append(target)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
