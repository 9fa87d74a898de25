"""The report's Markdown: the headline table, every configuration's figures, the distance to
the limit, Fréchet's δ choice, Spiffy's calibration, FailFast and the targets checklist, all
read from the report's JSON object (``benchmarks/report.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.report_measure import HOOKS, rule_alone
from benchmarks.report_targets import chosen_by_phrase
from dloom.hooks.registry import get_registry

ROOT = Path(__file__).resolve().parents[1]
PLOTS = {
    "accuracy_nfe": "report-accuracy-nfe.png",
    "speedup": "report-speedup.png",
    "acceptance": "report-acceptance.png",
}
CALIBRATION_PLOT = "report-calibration.png"
"""Written when the run measured Spiffy against its calibration size (``--matrix full``)."""
MARKER = "<!-- report:{name}:{end} -->"


def percent(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def blocks(report: dict[str, Any]) -> str:
    gen, block = report["gen_length"], report["block_length"]
    return f"one block of {gen}" if gen == block else f"{gen} positions in blocks of {block}"


def guarantee(row: dict[str, Any]) -> str:
    """The row's guarantee, naming what a speculative configuration is lossless against."""
    return f"{row['guarantee']} against {row['commit_rule']}" if row["speculation"] else row["guarantee"]


def headline_table(report: dict[str, Any]) -> str:
    """The headline: accuracy, forwards and speed of each headline configuration."""
    lines = [
        f"Measured by `{report['command']}` on `{report['model']}` ({report['n']} held-out "
        f"prompts, greedy, {blocks(report)}, {report['dtype']}, {report['device']}, "
        f"{report['torch_threads']} thread(s), {report['date']}). Ratios are against the "
        "baseline of the same run.",
        "",
        "| strategy | guarantee | accuracy | NFE / prompt | fewer NFE | tokens / forward "
        "| TPS speed-up | outputs = baseline | outputs = its rule alone |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        if row["headline"]:
            lines.append(
                f"| {row['label']} | {guarantee(row)} | {row['accuracy']:.0%} | "
                f"{row['nfe_mean']:.2f} | {row['nfe_ratio']:.1f}× | {row['tpf']:.2f} | "
                f"{row['tps_ratio']:.2f}× | {percent(row['identical_to_baseline'])} | "
                f"{percent(row['identical_to_commit_rule'])} |"
            )
    return "\n".join(lines)


def detail_tables(report: dict[str, Any]) -> str:
    """Every configuration's figures, hook shares and acceptance."""
    out = [
        "## Every configuration",
        "",
        "| configuration | strategy | cache | accuracy | NFE | TPF | TPS | fewer NFE | TPS speed-up | = baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        out.append(
            f"| {row['label']} | `{row['strategy']}` | {row['cache']} | {row['accuracy']:.1%} | "
            f"{row['nfe_mean']:.2f} | {row['tpf']:.2f} | {row['tps']:.0f} | {row['nfe_ratio']:.2f}× | "
            f"{row['tps_ratio']:.2f}× | {percent(row['identical_to_baseline'])} |"
        )
    out += ["", "## Where the time goes", "",
            "Share of the wall time spent in the model's forward and in each hook.", "",
            "| configuration | " + " | ".join(HOOKS) + " |", "|---|" + "---|" * len(HOOKS)]
    for row in report["rows"]:
        out.append(f"| {row['label']} | " + " | ".join(f"{row['hook_share'][h]:.1%}" for h in HOOKS) + " |")
    out += ["", oracle_table(report)]
    speculative = [r for r in report["rows"] if r["speculation"]]
    if speculative:
        out += ["", "## Speculation", "",
                "Drafts accepted per row-verification (each accepted draft saves one forward), "
                "and the share of outputs equal to the commit rule run alone.", "",
                "| configuration | guarantee | verifications | accepted drafts | per verification "
                "| = its rule alone |",
                "|---|---|---|---|---|---|"]
        for row in speculative:
            s = row["speculation"]
            out.append(
                f"| {row['label']} | {s['guarantee']} | {s['verifications']} | {s['accepted_drafts']} | "
                f"{s['accepted_per_verification']:.2f} | {percent(row['identical_to_commit_rule'])} |"
            )
    return "\n".join(out)


def ratio(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}×"


def oracle_table(report: dict[str, Any]) -> str:
    """Distance to the limit: every configuration's figures against the oracle NFE of the
    same prompts."""
    oracle = report["oracle"]
    out = [
        "## Distance to the limit", "",
        f"The oracle commits, at every forward, each masked position whose argmax is already "
        f"the final greedy token (the engine's own layout, `dloom.decode.oracle`): "
        f"**{oracle['nfe_mean']:.2f} forwards per prompt**, on the "
        f"{oracle['reached_share']:.0%} of prompts where it reproduces the greedy output (the "
        "others meet a dead end); *NFE ÷ oracle* compares NFE on those prompts. *Spiffy could "
        "save at most* is the commit rule alone in NFE over one forward per prompt plus one per "
        "block of two steps or more: a row's first forward is plain, a later block's first "
        "step can come from the forward that completed the block before it, and at best one "
        "verification completes a block (for a Spiffy row: over its rule's; *Spiffy saves* is "
        "what it measured). "
        "*Padding share*: generated positions after the first EOS.", "",
        "| configuration | cache | accuracy | NFE | oracle NFE | NFE ÷ oracle | NFE / answer token "
        "| padding share | tokens / forward | TPS | Spiffy could save at most | Spiffy saves |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        ceiling = row["spiffy_max_saving"] if row["speculation"] else row.get("spiffy_ceiling")
        out.append(
            f"| {row['label']} | {row['cache']} | {row['accuracy']:.1%} | {row['nfe_mean']:.2f} | "
            f"{oracle['nfe_mean']:.2f} | {ratio(row['nfe_over_oracle'])} | "
            f"{row['nfe_per_answer_token']:.3f} | {row['padding_share']:.0%} | {row['tpf']:.2f} | "
            f"{row['tps']:.0f} | {ratio(ceiling)} | {ratio(spiffy_saving(report, row))} |"
        )
    return "\n".join(out)


def spiffy_saving(report: dict[str, Any], row: dict[str, Any]) -> float | None:
    """A speculative row's measured saving over its commit rule alone (same parameters and
    cache), ``None`` for other rows or when that rule was not measured."""
    alone = rule_alone(report["rows"], row) if row["speculation"] else None
    return alone["nfe_mean"] / row["nfe_mean"] if alone else None


def default_delta_note(choice: dict[str, Any]) -> str:
    """Whether the run's chosen δ is the one ``frechet`` uses when given none."""
    (default,) = (p.default for p in get_registry().get("frechet").parameters if p.name == "delta")
    if choice["delta"] == default:
        return f"`frechet`'s default δ ({default:g}) is this choice."
    return f"`frechet`'s default δ is {default:g}, not this run's choice."


def frechet_table(report: dict[str, Any]) -> str:
    """Fréchet's δ sweep against threshold 0.9 (no cache) and the δ chosen at matched accuracy."""
    choice = report["frechet_choice"]
    tolerance = choice["tolerance"]
    chosen = (f"**Chosen: δ = {choice['delta']:g}**, {choice['saving']:.1%} fewer NFE than threshold "
              f"0.9 at {choice['accuracy']:.1%} accuracy (threshold 0.9: {choice['reference_accuracy']:.1%})."
              if choice["delta"] is not None else
              f"**No δ is matched**: every δ is more than {tolerance:.0%} below threshold 0.9's accuracy.")
    out = [
        "## Fréchet's δ at matched accuracy", "",
        f"The rule (`report_targets.choose_delta`): among the δ whose accuracy is at most "
        f"{100 * tolerance:g} point below threshold 0.9's in this run (no cache), the one with "
        f"the largest NFE saving; ties go to the smaller δ. {default_delta_note(choice)}", "", chosen, "",
        "| δ | accuracy | NFE | fewer NFE than threshold 0.9 | matched |",
        "|---|---|---|---|---|",
        f"| threshold 0.9 | {choice['reference_accuracy']:.1%} | {choice['reference_nfe_mean']:.2f} | | |",
    ]
    for c in choice["candidates"]:
        out.append(f"| {c['delta']:g} | {c['accuracy']:.1%} | {c['nfe_mean']:.2f} | {c['saving']:.1%} | "
                   f"{'yes' if c['matched'] else 'no'} |")
    return "\n".join(out)


def calibration_table(report: dict[str, Any]) -> str:
    """The draft graphs Spiffy decoded with, and Spiffy's NFE ratio against calibration size."""
    calibration = report["calibration"]
    out = [
        "## Spiffy's calibration", "",
        f"Each rule's draft graph ({calibration['budget']} nodes) was calibrated by "
        f"`dloom_plugins.spiffy.calibrate` on the first prompts of the `{calibration['tasks']}` "
        f"training stream (seed {calibration['seed']}; never a held-out prompt) reaching "
        f"{calibration['paths']} paths, on at least {calibration['min_prompts']} prompt(s).", "",
        "| rule | prompts | paths | distinct formulas | seconds | graph |", "|---|---|---|---|---|---|",
    ]
    for rule, g in calibration["graphs"].items():
        out.append(f"| {rule} | {g['prompts']} | {g['paths']} | {g['distinct_formulas']} | {g['seconds']} | "
                   f"`{Path(g['graph']).name}` |")
    curve = calibration["curve"]
    if curve:
        cache = calibration.get("curve_cache", "none")
        out += ["", f"Spiffy's NFE ratio (its rule alone over Spiffy, both with cache `{cache}`, the same "
                "held-out prompts) against the calibration size of its graph:", "",
                "| rule | calibration paths | prompts | Spiffy NFE | rule NFE ÷ Spiffy NFE | = its rule alone |",
                "|---|---|---|---|---|---|"]
        for point in curve:
            out.append(f"| {point['rule']} | {point['paths']} | {point['prompts']} | {point['nfe_mean']:.2f} | "
                       f"{point['nfe_ratio']:.2f}× | {percent(point['identical_to_commit_rule'])} |")
        out += ["", f"![Spiffy against calibration size](../assets/{CALIBRATION_PLOT})"]
    return "\n".join(out)


def failfast_table(report: dict[str, Any]) -> str:
    """FailFast against AR decoding and assisted generation, target forwards counted by hooks."""
    ff = report["failfast"]
    out = [
        "## FailFast", "",
        f"`{ff['drafter']}` drafts for the AR target `{ff['target']}` (FailFast's defaults but the "
        f"drafter's commit threshold: `failfast@τ` commits the drafter's tokens at τ, where the paper's "
        f"FailFast uses 0.05; the drafter's prefix cache). The targets use `{ff['best']}`: of the "
        f"thresholds whose outputs all equal AR decoding's, the one with the {chosen_by_phrase(ff)} on these "
        "same prompts (the first measured when none does). "
        f"FailFast runs against the target alone (one cached forward per token)"
        + (f" and `transformers`' assisted generation with `{ff['assistant']}`" if ff["assistant"] else
           " (no assistant model, so no assisted generation)") + "; greedy, one prompt at a "
        f"time, at most {ff['max_new_tokens']} new tokens, forwards counted by forward hooks on "
        "each model (prefill included). An AR target stops at its EOS, so it has no padding and "
        "no oracle.", "",
        "| method | accuracy | target forwards / prompt | fewer target forwards than AR "
        "| tokens / target forward | helper forwards | TPS | outputs = AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ar = ff["methods"]["ar"]
    for name, m in ff["methods"].items():
        out.append(
            f"| `{name}` | {m['accuracy']:.1%} | {m['target_forwards_per_prompt']:.2f} | "
            f"{ar['target_forwards'] / m['target_forwards']:.2f}× | {m['tokens_per_target_forward']:.2f} | "
            f"{m['helper_forwards']} | {m['tps']:.0f} | {m['identical_to_ar']:.0%} |"
        )
    return "\n".join(out)


def targets_table(report: dict[str, Any]) -> str:
    """Issue 19's targets, each with its figure from this run and whether it is met."""
    marks = {True: "met", False: "**missed**", None: "not measured"}
    out = ["## Targets", "",
           "Each figure is computed from this run (`report_targets.checklist`).", "",
           "| | target | measured | details |", "|---|---|---|---|"]
    for item in report["targets"]:
        box = {True: "[x]", False: "[ ]", None: "[–]"}[item["met"]]
        out.append(f"| {box} {marks[item['met']]} | {item['target']} | {item['measured']} | {item['detail']} |")
    return "\n".join(out)


def micro_table(path: Path) -> str:
    """The pytest-benchmark results: mean time per hook call or per decoded batch."""
    data = json.loads(path.read_text())
    out = ["## Micro-benchmarks", "",
           f"`python -m pytest benchmarks/test_bench_strategies.py` (pytest-benchmark), "
           f"JSON: `{shown(path)}`.", "",
           "| benchmark | mean | min | rounds | NFE / prompt |", "|---|---|---|---|---|"]
    for bench in data["benchmarks"]:
        stats, nfe = bench["stats"], bench["extra_info"].get("nfe_mean")
        out.append(f"| `{bench['name']}` | {seconds(stats['mean'])} | {seconds(stats['min'])} | "
                   f"{stats['rounds']} | {'' if nfe is None else f'{nfe:.2f}'} |")
    return "\n".join(out)


def seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value / 1e-9:.0f} ns"


def shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


READING = """\
**Reading the tables.** *NFE* is forwards per prompt and *tokens / forward* (TPF) generated
tokens per forward; *fewer NFE* and *TPS speed-up* divide by the baseline's figure. *Outputs
= baseline* is the share of prompts whose output equals quota's one token per step; a
lossless strategy must reach 100 % in *outputs = its rule alone*. A Spiffy verification
forward carries up to `D* + 1` rows per prompt: on a GPU that costs little more than a plain
forward, on a CPU it costs nearly `D* + 1` of them, so there its TPS speed-up trails its NFE
ratio. With a few prompts the accuracies are noisy; the ratios are the point."""


def resumed(report: dict[str, Any]) -> str:
    """The page's note on measurements reused from a stopped run (``--resume``), or ``""``."""
    reused = report.get("reused") or []
    if not reused:
        return ""
    return (f"; resumed with `--resume`, which reused {len(reused)} measurements of the stopped run "
            f"({', '.join(reused)}), so {report['seconds']} s is this part's time")


def report_page(report: dict[str, Any], out: Path, micro: Path | None) -> str:
    """The whole generated page."""
    images = "\n\n".join(
        f"![{alt}](../assets/{PLOTS[key]})" for key, alt in (
            ("accuracy_nfe", "accuracy versus NFE"), ("speedup", "speed-up over the baseline"),
            ("acceptance", "drafts accepted per verification"),
        )
    )
    parts = [
        "<!-- Generated by benchmarks/report.py from one run; do not edit by hand. -->",
        "",
        "# Benchmark report",
        "",
        "Generated by `benchmarks/report.py`; every number on this page comes from one run, "
        f"recorded in `{shown(out)}` ({report['machine']}, torch "
        f"{report['torch']}, {report['seconds']} s){resumed(report)}.",
        "",
        headline_table(report),
        "",
        READING,
        "",
        targets_table(report),
        "",
        images,
        "",
        detail_tables(report),
    ]
    if report.get("frechet_choice"):
        parts += ["", frechet_table(report)]
    if report.get("calibration"):
        parts += ["", calibration_table(report)]
    if report.get("failfast"):
        parts += ["", failfast_table(report)]
    if micro is not None:
        parts += ["", micro_table(micro)]
    return "\n".join(parts) + "\n"


def replace_marked(text: str, name: str, body: str) -> str:
    """``text`` with the lines between the ``report:NAME`` markers replaced by ``body``."""
    start, end = MARKER.format(name=name, end="start"), MARKER.format(name=name, end="end")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"markers {start} ... {end} not found")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)

