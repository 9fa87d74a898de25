"""Operating points: each commit rule's settings swept, chosen on a dev split, compared at
equal accuracy (``benchmarks/operating_points.py`` runs the measurements).

A rule's *curve* is its rows over a grid of its parameter (threshold's τ, factor's f,
Fréchet's δ), each row an accuracy and a mean NFE on the same prompts. From the curves:

* :func:`choose`: a rule's setting on the **dev** split: the fewest NFE among the settings
  whose accuracy is at most ``tolerance`` (one point) below one token per step's on the same
  dev prompts; the most accurate setting, flagged unmatched, when none is.
* :func:`pareto_front`: the points no other point beats in both NFE and accuracy.
* :func:`nfe_at_accuracy`: the NFE a rule needs to reach an accuracy, interpolated linearly
  between the two points of its own front that bracket it (``None`` when no setting reaches
  it; the cheapest point's NFE, marked ``"at most"``, when even that one does).
* :func:`equal_accuracy`: every rule's NFE at the accuracy that keeps one token per step's
  within ``tolerance``, and each rule's saving against a reference rule there.

No figure is written here: every function reads rows a run measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.report_measure import Config

GRIDS: dict[str, tuple[str, tuple[float, ...]]] = {
    "threshold": ("tau", (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)),
    "factor": ("f", (2.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.02, 0.01)),
    "frechet": ("delta", (0.25, 0.5, 0.75, 0.9, 0.95, 0.97, 0.98, 0.99)),
}
"""Each swept rule's parameter and grid, from its most parallel setting to its most cautious:
threshold commits what is above τ, factor while ``(n + 1)(1 - c_(n)) < f``, Fréchet while
``L_n - U_n > δ`` (``docs/strategies.md``)."""
TOLERANCE = 0.01
"""How far (one point) below one token per step's accuracy a setting may be and still count
as keeping it."""
_EPSILON = 1e-9  # accuracies are fractions k / n: compared with a margin for rounding


def setting_name(rule: str, value: float) -> str:
    """``threshold@0.99``: a grid point's row name."""
    return f"{rule}@{value:g}"


def grid_configs(grids: Mapping[str, tuple[str, Sequence[float]]] = GRIDS) -> list[Config]:
    """Every grid point of ``grids`` as a configuration without a cache, rule by rule."""
    return [
        Config(setting_name(rule, value), f"{rule} {parameter} = {value:g}", rule, {parameter: float(value)})
        for rule, (parameter, values) in grids.items() for value in values
    ]


CAUTIOUS_WHEN_LARGER = {"threshold": True, "factor": False, "frechet": True}
"""Per swept rule, whether a larger value of its parameter commits less per forward."""


def setting(row: Mapping[str, Any]) -> tuple[str, str, float] | None:
    """``(rule, parameter, value)`` of a swept row (``None`` for a rule outside :data:`GRIDS`)."""
    rule = row["commit_rule"]
    if rule not in GRIDS:
        return None
    parameter = GRIDS[rule][0]
    return rule, parameter, float(row["params"][rule][parameter])


def _caution(row: Mapping[str, Any]) -> float:
    """How cautious a swept row's setting is (higher: commits less per forward)."""
    rule, _, value = setting(row) or ("", "", 0.0)
    return (value if CAUTIOUS_WHEN_LARGER[rule] else -value) if rule else 0.0


def choose(rows: Sequence[Mapping[str, Any]], reference_accuracy: float,
           tolerance: float = TOLERANCE) -> dict[str, Any]:
    """One rule's operating point from its grid ``rows`` (same prompts as the reference):
    the fewest NFE among those with accuracy ``>= reference_accuracy - tolerance``, ties to
    the more cautious setting; else the most accurate, ``matched`` false.

    :return: ``{"rule", "parameter", "value", "name", "accuracy", "nfe_mean", "matched"}``.
    """
    if not rows:
        raise ValueError("choose needs at least one row of the rule's grid")
    floor = reference_accuracy - tolerance - _EPSILON
    matched = [row for row in rows if row["accuracy"] >= floor]
    if matched:
        best = min(matched, key=lambda r: (r["nfe_mean"], -_caution(r)))
    else:
        best = max(rows, key=lambda r: (r["accuracy"], -r["nfe_mean"]))
    rule, parameter, value = setting(best) or (best["commit_rule"], "", 0.0)
    return {"rule": rule, "parameter": parameter, "value": value, "name": best["name"],
            "accuracy": best["accuracy"], "nfe_mean": best["nfe_mean"], "matched": bool(matched)}


def pareto_front(points: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The points (``nfe_mean``, ``accuracy``) that no other point dominates (as few NFE and
    as accurate, one of them strictly), by NFE ascending."""
    ordered = sorted(points, key=lambda p: (p["nfe_mean"], -p["accuracy"]))
    front: list[Mapping[str, Any]] = []
    for point in ordered:
        if not front or point["accuracy"] > front[-1]["accuracy"] + _EPSILON:
            front.append(point)
    return front


def nfe_at_accuracy(curve: Sequence[Mapping[str, Any]], accuracy: float) -> dict[str, Any]:
    """The NFE at which the curve's own front first reaches ``accuracy``.

    :return: ``{"nfe_mean", "bound"}``: ``bound`` is ``"interpolated"`` (between the two
        front points bracketing ``accuracy``), ``"at most"`` (the front's cheapest point
        already reaches it: the rule might need fewer) or ``"unreached"`` (``nfe_mean`` None).
    """
    front = pareto_front(curve)
    for index, point in enumerate(front):
        if point["accuracy"] >= accuracy - _EPSILON:
            if index == 0:
                return {"nfe_mean": point["nfe_mean"], "bound": "at most"}
            low = front[index - 1]
            share = (accuracy - low["accuracy"]) / (point["accuracy"] - low["accuracy"])
            return {"nfe_mean": low["nfe_mean"] + share * (point["nfe_mean"] - low["nfe_mean"]),
                    "bound": "interpolated"}
    return {"nfe_mean": None, "bound": "unreached"}


def curves(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The swept rows by rule, each list in its grid's order."""
    by_rule: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        found = setting(row)
        if found is not None and row["cache"] == "none" and not row["speculation"]:
            by_rule.setdefault(found[0], []).append(row)
    return {rule: sorted(found, key=_caution) for rule, found in by_rule.items()}


def equal_accuracy(rows: Sequence[Mapping[str, Any]], baseline: Mapping[str, Any], reference: str = "threshold",
                   tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Every swept rule's NFE at the accuracy that keeps ``baseline``'s (one token per step,
    same prompts) within ``tolerance``, and its saving against ``reference`` there:
    ``saving_vs_reference`` is ``1 - nfe / reference nfe`` and ``saving_bound`` says what it
    is: ``"equal"`` (both interpolated), ``"at least"`` (the rule's NFE only bounded above),
    ``None`` with no saving where the reference is unreached or only bounded above (either
    would overstate it) or the rule is unreached."""
    target = baseline["accuracy"] - tolerance
    at = {rule: nfe_at_accuracy(curve, target) for rule, curve in curves(rows).items()}
    ref = at.get(reference)
    for point in at.values():
        bound = None
        if ref is not None and ref["bound"] == "interpolated" and point["nfe_mean"] is not None:
            bound = "equal" if point["bound"] == "interpolated" else "at least"
        point["saving_vs_reference"] = 1 - point["nfe_mean"] / ref["nfe_mean"] if bound else None
        point["saving_bound"] = bound
    return {"accuracy": target, "baseline_accuracy": baseline["accuracy"], "tolerance": tolerance,
            "reference": reference, "rules": at}
