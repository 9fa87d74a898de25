"""Decisions and targets computed from one report run: Fréchet's δ at matched accuracy, and
issue 19's targets as a checklist, each with its measured figure (no figure is written here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MATCHED_ACCURACY = 0.01
"""Fréchet's δ is chosen among the δ whose accuracy is at most this far (one point) below
threshold 0.9's."""
_EPSILON = 1e-9  # accuracies are fractions k / n: compare them with a margin for rounding


def choose_delta(
    reference: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]], tolerance: float = MATCHED_ACCURACY
) -> dict[str, Any]:
    """The Fréchet δ with the largest NFE saving over ``reference`` (threshold 0.9, same run,
    same cache) among ``candidates`` whose accuracy is no more than ``tolerance`` below the
    reference's (a more accurate δ is matched too); ties go to the smaller δ.

    :param reference: a row with ``accuracy`` and ``nfe_mean``.
    :param candidates: Fréchet rows with ``delta``, ``name``, ``accuracy`` and ``nfe_mean``.
    :return: ``{"delta", "name", "accuracy", "nfe_mean", "saving"}`` of the choice (all
        ``None`` when no δ is matched), the reference's figures, ``tolerance`` and every
        candidate with its saving and whether it was matched. ``saving`` is
        ``1 - nfe_mean / reference nfe_mean``.
    """
    floor = reference["accuracy"] - tolerance - _EPSILON
    table = [
        {
            "delta": row["delta"], "name": row["name"], "accuracy": row["accuracy"], "nfe_mean": row["nfe_mean"],
            "saving": 1 - row["nfe_mean"] / reference["nfe_mean"], "matched": row["accuracy"] >= floor,
        }
        for row in sorted(candidates, key=lambda r: r["delta"])
    ]
    matched = [entry for entry in table if entry["matched"]]
    best = max(matched, key=lambda e: (e["saving"], -e["delta"])) if matched else None
    keys = ("delta", "name", "accuracy", "nfe_mean", "saving")
    return {
        **{key: best[key] if best else None for key in keys},
        "reference_accuracy": reference["accuracy"],
        "reference_nfe_mean": reference["nfe_mean"],
        "tolerance": tolerance,
        "candidates": table,
    }


def find_row(report: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((r for r in report["rows"] if r["name"] == name), None)


def target_item(target: str, measured: str, met: bool | None, detail: str) -> dict[str, Any]:
    return {"target": target, "measured": measured, "met": met, "detail": detail}


def chosen_by_phrase(failfast: Mapping[str, Any]) -> str:
    """How a FailFast run chose its drafter τ among the lossless ones, in words: by wall time
    (``chosen_by`` "wall time"), or by target forwards (runs recorded before wall time)."""
    return "least wall time" if failfast.get("chosen_by") == "wall time" else "fewest target forwards"


def _not_measured(target: str, why: str) -> dict[str, Any]:
    return target_item(target, "not measured", None, why)


def frechet_item(report: Mapping[str, Any]) -> dict[str, Any]:
    target = "Fréchet ≥ 25 % fewer NFE than threshold 0.9 at matched accuracy"
    choice = report.get("frechet_choice")
    if not choice:
        return _not_measured(target, "no Fréchet δ sweep in this run (--matrix full)")
    if choice["delta"] is None:
        best = max(choice["candidates"], key=lambda c: c["accuracy"])
        return target_item(target, "no δ within 1 point", False,
                     f"threshold 0.9 {choice['reference_accuracy']:.1%}; the most accurate δ "
                     f"({best['delta']:g}) {best['accuracy']:.1%}")
    saving = choice["saving"]
    return target_item(
        target, f"{saving:.1%} at δ = {choice['delta']:g}", saving >= 0.25,
        f"{choice['nfe_mean']:.2f} against {choice['reference_nfe_mean']:.2f} NFE; accuracy "
        f"{choice['accuracy']:.1%} against {choice['reference_accuracy']:.1%}"
        + ("" if saving >= 0.25 else f"; {0.25 - saving:.1%} short; {_frechet_why(report, choice)}"),
    )


def _frechet_why(report: Mapping[str, Any], choice: Mapping[str, Any]) -> str:
    """Why no matched δ saves a quarter: what the saving δ cost in accuracy, and what the
    parallel rules cost against one token per step, from the run's rows."""
    saving = [c for c in choice["candidates"] if c["saving"] >= 0.25]
    why = []
    if saving:
        best = max(saving, key=lambda c: c["accuracy"])
        why.append(f"the δ saving ≥ 25 % (δ ≤ {max(c['delta'] for c in saving):g}) reach at most "
                   f"{best['accuracy']:.1%}, {100 * (choice['reference_accuracy'] - best['accuracy']):.1f} points "
                   "below threshold 0.9")
    baseline = find_row(report, report.get("baseline", "quota"))
    if baseline is not None and "accuracy" in baseline:
        why.append(f"threshold 0.9 is itself {100 * (baseline['accuracy'] - choice['reference_accuracy']):.1f} "
                   f"points below one token per step ({baseline['accuracy']:.1%})")
    return ("; ".join(why) + "; " if why else "") + (
        "closing it needs a model whose confidences hold when several positions commit in one "
        "forward (trained in the states parallel rules reach)")


def spiffy_item(report: Mapping[str, Any], rule: str, goal: float) -> dict[str, Any]:
    target = f"Spiffy ≥ {goal:g}× fewer NFE than {rule}{' 0.9' if rule == 'threshold' else ''}, 100 % identical outputs"
    alone, spiffy = find_row(report, rule), find_row(report, f"spiffy+{rule}")
    if alone is None or spiffy is None:
        return _not_measured(target, f"{rule} or Spiffy over it not in this run")
    ratio = alone["nfe_mean"] / spiffy["nfe_mean"]
    identical = spiffy["identical_to_commit_rule"]
    met = ratio >= goal and identical == 1.0
    ceiling = spiffy.get("spiffy_max_saving")
    detail = (f"{alone['nfe_mean']:.2f} → {spiffy['nfe_mean']:.2f} NFE (no cache); "
              f"at most {ceiling:.2f}× possible (a row's first forward is plain, one per block after)" if ceiling else
              f"{alone['nfe_mean']:.2f} → {spiffy['nfe_mean']:.2f} NFE (no cache)")
    if ratio < goal:
        detail += f"; {goal / ratio:.2f}× short; {_spiffy_why(report, rule, spiffy)}"
    shown = "" if identical is None else f", {identical:.0%} identical"
    return target_item(target, f"{ratio:.2f}×{shown}", met, detail)


def _spiffy_why(report: Mapping[str, Any], rule: str, spiffy: Mapping[str, Any]) -> str:
    """Why Spiffy saved less: how often its verifications accepted nothing (its acceptance
    histogram) and what more calibration did (the run's calibration curve)."""
    why = []
    histogram = spiffy.get("acceptance_histogram")
    if histogram and sum(histogram):
        accepted = sum(k * count for k, count in enumerate(histogram)) / sum(histogram)
        why.append(f"{histogram[0] / sum(histogram):.0%} of its verifications accepted no draft "
                   f"({accepted:.2f} drafts each)")
    calibration = report.get("calibration") or {}
    curve = sorted((p for p in calibration.get("curve", []) if p["rule"] == rule), key=lambda p: p["paths"])
    if len(curve) >= 2:
        first, last = curve[0], curve[-1]
        why.append(f"calibrating on {last['paths']} paths instead of {first['paths']} moved its ratio from "
                   f"{first['nfe_ratio']:.2f}× to {last['nfe_ratio']:.2f}× (cache {calibration.get('curve_cache', 'none')})")
    return ("; ".join(why) + "; " if why else "") + (
        "closing it needs drafts that match more often: a larger draft graph (--spiffy-budget; "
        "its extra rows are cheap on a GPU) or a model whose next states are more predictable")


def oracle_item(report: Mapping[str, Any]) -> dict[str, Any]:
    target = "best full stack (Spiffy over a rule, any cache) within 1.3× of the oracle's NFE"
    stacks = [r for r in report["rows"] if r["speculation"] and r.get("nfe_over_oracle") is not None]
    if not stacks:
        return _not_measured(target, "no Spiffy row, or the oracle reproduced no greedy output")
    best = min(stacks, key=lambda r: r["nfe_over_oracle"])
    met = best["nfe_over_oracle"] <= 1.3
    oracle = report["oracle"]
    return target_item(
        target, f"{best['nfe_over_oracle']:.2f}× ({best['label']})", met,
        f"oracle {oracle['nfe_mean']:.2f} NFE on {oracle['reached_share']:.0%} of the prompts"
        + ("" if met else f"; {best['nfe_over_oracle'] / 1.3:.2f}× too many forwards{_oracle_why(report, best)}"),
    )


def _oracle_why(report: Mapping[str, Any], best: Mapping[str, Any]) -> str:
    """Why the best stack stays far from the oracle: its rule alone's distance, which Spiffy
    only divides (it reproduces the rule's commits)."""
    alone = next((r for r in report["rows"] if not r["speculation"] and r.get("nfe_over_oracle") is not None
                  and (r.get("commit_rule"), r.get("cache"), r.get("delta"))
                  == (best.get("commit_rule"), best.get("cache"), best.get("delta"))), None)
    if alone is None:
        return ""
    return (f"; its rule alone is {alone['nfe_over_oracle']:.2f}× the oracle, and Spiffy, which commits what "
            "its rule commits, divides that; closing it needs a rule that commits more of the positions "
            "already final at each forward without losing accuracy")


def failfast_items(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    ar_target = "FailFast ≥ 4× fewer target forwards than AR decoding, identical outputs"
    assisted_target = "FailFast fewer target forwards than transformers' assisted generation"
    failfast = report.get("failfast")
    if not failfast:
        why = "no FailFast run (--target and --assistant)"
        return [_not_measured(ar_target, why), _not_measured(assisted_target, why)]
    methods = failfast["methods"]
    ff, ar = methods[failfast["best"]], methods["ar"]
    measured_at = ", ".join(f"{m['drafter_tau']!r}" for m in methods.values() if "drafter_tau" in m)
    chosen = (f"drafter τ {ff['drafter_tau']!r}, the {chosen_by_phrase(failfast)} of the lossless ones (τ measured: "
              f"{measured_at})" if ff["identical_to_ar"] == 1.0 else
              f"drafter τ {ff['drafter_tau']!r}: no drafter τ measured ({measured_at}) was lossless")
    ratio = ar["target_forwards"] / ff["target_forwards"]
    items = [target_item(
        ar_target, f"{ratio:.2f}×, {ff['identical_to_ar']:.0%} identical", ratio >= 4 and ff["identical_to_ar"] == 1.0,
        f"{ar['target_forwards_per_prompt']:.1f} → {ff['target_forwards_per_prompt']:.1f} target forwards per prompt; "
        f"{ff['accepted_per_round']:.2f} draft tokens accepted per round; {chosen}"
        + ("" if ratio >= 4 else f"; {4 / ratio:.2f}× short"),
    )]
    assisted = methods.get("assisted")
    if assisted is None:
        items.append(_not_measured(assisted_target, "no assistant model (--assistant)"))
    else:
        fewer = assisted["target_forwards"] / ff["target_forwards"]
        items.append(target_item(
            assisted_target, f"{fewer:.2f}× fewer", ff["target_forwards"] < assisted["target_forwards"],
            f"{assisted['target_forwards_per_prompt']:.1f} (assisted, {failfast['assistant']}) against "
            f"{ff['target_forwards_per_prompt']:.1f} target forwards per prompt",
        ))
    return items


def checklist(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 19's targets with their figures from ``report``: ``{"target", "measured", "met"
    (``None``: not measured), "detail"}`` each."""
    return [
        frechet_item(report),
        spiffy_item(report, "threshold", 1.4),
        spiffy_item(report, "quota", 2.5),
        oracle_item(report),
        *failfast_items(report),
    ]
