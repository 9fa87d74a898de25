"""Operating points: each commit rule's settings swept, chosen on a dev split, compared at
equal accuracy (``benchmarks/operating_points.py`` runs the measurements).

A rule's *curve* is its rows over a grid of one parameter (threshold's τ, factor's f,
Fréchet's δ), the rule's other parameters held fixed (:class:`Grid`), each row an accuracy and
a mean NFE on the same prompts. A curve is named by its grid (the rule's name, or a name of
its own where one rule has two curves, as ``joint_threshold``'s speed and quality modes), and
its rows by the curve and the value (``threshold@0.9``). Which grids a run sweeps depends on
the model's transition kernel (:func:`grids_for`): editing rules only where the kernel can
run them. From the curves:

* :func:`choose`: a rule's setting on the **dev** split: the fewest NFE among the settings
  whose accuracy is at most ``tolerance`` (one point) below one token per step's on the same
  dev prompts; the most accurate setting, flagged unmatched, when none is.
* :func:`pareto_front`: the points no other point beats in both NFE and accuracy.
* :func:`nfe_at_accuracy`: the NFE a rule needs to reach an accuracy, interpolated linearly
  between the two points of its own front that bracket it (``None`` when no setting reaches
  it; the cheapest point's NFE, marked ``"at most"``, when even that one does).
* :func:`equal_accuracy`: every rule's NFE at the accuracy that keeps one token per step's
  within ``tolerance``, and each rule's saving against a reference rule there.
* :func:`edit_over_fill`: the best editing rule's NFE against the best fill rule's there.

No figure is written here: every function reads rows a run measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.report_measure import Config


@dataclass(frozen=True)
class Grid:
    """One curve's settings: ``rule`` (a registered strategy) at every value of ``parameter``,
    its other parameters ``fixed``.

    :ivar cautious_when_larger: a larger value commits less per forward.
    :ivar edits: the rule edits (it needs the revisable kernel).
    """

    rule: str
    parameter: str
    values: tuple[float, ...]
    cautious_when_larger: bool = True
    fixed: dict[str, float] = field(default_factory=dict)
    edits: bool = False


GridSpec = Grid | tuple[str, Sequence[float]]
"""A grid, or ``(parameter, values)`` for a rule of :data:`CAUTIOUS_WHEN_LARGER` whose curve
is named by the rule."""

CAUTIOUS_WHEN_LARGER = {"threshold": True, "factor": False, "frechet": True, "entropy_bound": False}
"""Per fill rule, whether a larger value of its parameter commits less per forward."""

GRIDS: dict[str, tuple[str, tuple[float, ...]]] = {
    "threshold": ("tau", (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)),
    "factor": ("f", (2.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.02, 0.01)),
    "frechet": ("delta", (0.25, 0.5, 0.75, 0.9, 0.95, 0.97, 0.98, 0.99)),
}
"""Each swept rule's parameter and grid on a fill-only (absorbing) model, from its most
parallel setting to its most cautious: threshold commits what is above τ, factor while
``(n + 1)(1 - c_(n)) < f``, Fréchet while ``L_n - U_n > δ`` (``docs/strategies.md``)."""

EDIT_MODEL_GRIDS: dict[str, GridSpec] = {
    "threshold": ("tau", (0.5, 0.6, 0.7, 0.8, 0.9, 0.99)),
    "factor": ("f", (2.0, 1.0, 0.5, 0.25, 0.1)),
    "frechet": ("delta", (0.25, 0.5, 0.75, 0.9)),
    "entropy_bound": Grid("entropy_bound", "gamma", (1.0, 0.1, 0.01, 0.005, 0.002, 0.001), cautious_when_larger=False),
    "joint_threshold-speed": Grid("joint_threshold", "tau", (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9),
                                  fixed={"edit_tau": 0.0}, edits=True),
    "joint_threshold-quality": Grid("joint_threshold", "tau", (0.1, 0.3, 0.5, 0.7, 0.9),
                                    fixed={"edit_tau": 0.5}, edits=True),
    "frechet_edit": Grid("frechet_edit", "delta", (0.0, 0.25, 0.5, 0.75, 0.9), fixed={"edit_tau": 0.0}, edits=True),
    "wino": Grid("wino", "tau", (0.4, 0.5, 0.6, 0.7, 0.8), fixed={"remask_tau": 0.9, "max_post_steps": 0}, edits=True),
    "wino-post": Grid("wino", "tau", (0.3, 0.4, 0.5, 0.6, 0.7), fixed={"remask_tau": 0.9, "max_post_steps": 4},
                      edits=True),
}
"""The grids on a model whose kernel edits (the revisable kernel: ``long-dllm-words-edit``):
every fill rule and every editing rule, each grid from its most parallel setting to its most
cautious, reaching below one token per step's accuracy at the bold end and to it at the
cautious end where the rule can (checked on 60 dev prompts with ``dloom eval``; the fill
rules keep quota's accuracy from τ 0.7, f 1, δ 0.5 and γ 0.001 on, so their grids stop
sooner than :data:`GRIDS`, and γ needs values far below the entropy bound's default 0.1).

An editing rule has two knobs: how boldly it fills and how readily it edits. Each editing
curve sweeps the fill knob, which sets the forwards, with the edit knob fixed at a published
mode, since the edits are what repair the bold fills:

* ``joint_threshold-speed``: LLaDA2.1's speed mode, ``edit_tau = 0`` (rewrite every filled
  token whose candidate differs), over the fill threshold τ down to 0.05;
* ``joint_threshold-quality``: its quality mode, ``edit_tau = 0.5``, over τ;
* ``frechet_edit``: Fréchet's certified fills over δ (from 0, its boldest, where it still
  keeps accuracy on this model), with the speed mode's edits;
* ``wino``: WINO's own decoding (draft above τ, remask below ``remask_tau = 0.9`` in fill
  steps, no post step: a full block is final), over τ;
* ``wino-post``: the same with up to 4 post steps rewriting tokens below ``remask_tau``
  (on 100 held-out prompts remasks alone repaired little on this model; post steps did).

``max_post_steps`` keeps the rule's default elsewhere (16 for ``joint_threshold`` and
``frechet_edit``): a block settles at the first post step that changes nothing. A new
editing rule's curve is one more entry here."""
TOLERANCE = 0.01
"""How far (one point) below one token per step's accuracy a setting may be and still count
as keeping it."""
_EPSILON = 1e-9  # accuracies are fractions k / n: compared with a margin for rounding


def setting_name(rule: str, value: float) -> str:
    """``threshold@0.99``: a grid point's row name."""
    return f"{rule}@{value:g}"


def as_grid(name: str, spec: GridSpec) -> Grid:
    """``spec`` as a :class:`Grid` (a ``(parameter, values)`` pair is the grid of the rule
    ``name``).

    :raises ValueError: for a pair naming a rule outside :data:`CAUTIOUS_WHEN_LARGER`.
    """
    if isinstance(spec, Grid):
        return spec
    if name not in CAUTIOUS_WHEN_LARGER:
        raise ValueError(f"grid {name!r} is a (parameter, values) pair; allowed for the rules "
                         f"{', '.join(CAUTIOUS_WHEN_LARGER)}, else a Grid naming its rule")
    parameter, values = spec
    return Grid(name, parameter, tuple(values), CAUTIOUS_WHEN_LARGER[name])


def grids_for(kernel: str) -> dict[str, GridSpec]:
    """The grids a run sweeps on a model decoding with ``kernel``: with editing rules
    (:data:`EDIT_MODEL_GRIDS`) on the revisable kernel, where they run; the fill rules of
    :data:`GRIDS` elsewhere (an editing rule is refused on the absorbing kernel)."""
    return dict(EDIT_MODEL_GRIDS) if kernel == "revisable" else dict(GRIDS)


def _described(grid: Grid) -> str:
    fixed = ", ".join(f"{key} = {value:g}" for key, value in grid.fixed.items())
    return f" ({fixed})" if fixed else ""


def grid_configs(grids: Mapping[str, GridSpec] = GRIDS) -> list[Config]:
    """Every grid point of ``grids`` as a configuration without a cache, curve by curve."""
    configs = []
    for name, spec in grids.items():
        grid = as_grid(name, spec)
        configs += [Config(setting_name(name, value), f"{grid.rule} {grid.parameter} = {value:g}{_described(grid)}",
                           grid.rule, {**grid.fixed, grid.parameter: float(value)}) for value in grid.values]
    return configs


def setting(row: Mapping[str, Any], grids: Mapping[str, GridSpec] = GRIDS) -> tuple[str, str, float] | None:
    """``(curve, parameter, value)`` of a swept row (its name is ``curve@value``); ``None``
    for a row of no curve of ``grids``."""
    curve = str(row["name"]).split("@")[0] if "@" in str(row["name"]) else row["commit_rule"]
    if curve not in grids:
        return None
    grid = as_grid(curve, grids[curve])
    if row["commit_rule"] != grid.rule:
        return None
    return curve, grid.parameter, float(row["params"][grid.rule][grid.parameter])


def _caution(row: Mapping[str, Any], grids: Mapping[str, GridSpec] = GRIDS) -> float:
    """How cautious a swept row's setting is (higher: commits less per forward)."""
    found = setting(row, grids)
    if found is None:
        return 0.0
    curve, _, value = found
    return value if as_grid(curve, grids[curve]).cautious_when_larger else -value


def choose(rows: Sequence[Mapping[str, Any]], reference_accuracy: float,
           tolerance: float = TOLERANCE, grids: Mapping[str, GridSpec] = GRIDS) -> dict[str, Any]:
    """One curve's operating point from its grid ``rows`` (same prompts as the reference):
    the fewest NFE among those with accuracy ``>= reference_accuracy - tolerance``, ties to
    the more cautious setting; else the most accurate, ``matched`` false.

    :return: ``{"rule", "parameter", "value", "name", "accuracy", "nfe_mean", "matched",
        "curve", "fixed"}`` (``rule``: the strategy; ``fixed``: its parameters held fixed).
    """
    if not rows:
        raise ValueError("choose needs at least one row of the rule's grid")
    floor = reference_accuracy - tolerance - _EPSILON
    matched = [row for row in rows if row["accuracy"] >= floor]
    if matched:
        best = min(matched, key=lambda r: (r["nfe_mean"], -_caution(r, grids)))
    else:
        best = max(rows, key=lambda r: (r["accuracy"], -r["nfe_mean"]))
    curve, parameter, value = setting(best, grids) or (best["commit_rule"], "", 0.0)
    grid = as_grid(curve, grids[curve]) if curve in grids else None
    return {"rule": grid.rule if grid else curve, "parameter": parameter, "value": value, "name": best["name"],
            "accuracy": best["accuracy"], "nfe_mean": best["nfe_mean"], "matched": bool(matched),
            "curve": curve, "fixed": dict(grid.fixed) if grid else {}}


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


def curves(rows: Sequence[Mapping[str, Any]], grids: Mapping[str, GridSpec] = GRIDS) -> dict[str, list[Mapping[str, Any]]]:
    """The swept rows by curve, each list in its grid's order."""
    by_curve: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        found = setting(row, grids)
        if found is not None and row["cache"] == "none" and not row["speculation"]:
            by_curve.setdefault(found[0], []).append(row)
    return {curve: sorted(found, key=lambda r: _caution(r, grids)) for curve, found in by_curve.items()}


def equal_accuracy(rows: Sequence[Mapping[str, Any]], baseline: Mapping[str, Any], reference: str = "threshold",
                   tolerance: float = TOLERANCE, grids: Mapping[str, GridSpec] = GRIDS) -> dict[str, Any]:
    """Every swept rule's NFE at the accuracy that keeps ``baseline``'s (one token per step,
    same prompts) within ``tolerance``, and its saving against ``reference`` there:
    ``saving_vs_reference`` is ``1 - nfe / reference nfe`` and ``saving_bound`` says what it
    is: ``"equal"`` (both interpolated), ``"at least"`` (the rule's NFE only bounded above),
    ``None`` with no saving where the reference is unreached or only bounded above (either
    would overstate it) or the rule is unreached."""
    target = baseline["accuracy"] - tolerance
    at = {rule: nfe_at_accuracy(curve, target) for rule, curve in curves(rows, grids).items()}
    ref = at.get(reference)
    for point in at.values():
        bound = None
        if ref is not None and ref["bound"] == "interpolated" and point["nfe_mean"] is not None:
            bound = "equal" if point["bound"] == "interpolated" else "at least"
        point["saving_vs_reference"] = 1 - point["nfe_mean"] / ref["nfe_mean"] if bound else None
        point["saving_bound"] = bound
    return {"accuracy": target, "baseline_accuracy": baseline["accuracy"], "tolerance": tolerance,
            "reference": reference, "rules": at}


def edit_over_fill(equal: Mapping[str, Any], grids: Mapping[str, GridSpec]) -> dict[str, Any]:
    """The best editing curve against the best fill curve at equal accuracy (each curve's NFE
    at that accuracy, :func:`equal_accuracy`'s ``equal``): ``ratio`` is the fill curve's NFE
    over the editing one's (how many times fewer forwards editing needs).

    A curve whose cheapest setting already reaches the accuracy has only an upper bound on
    its NFE (``"at most"``), so ``bound`` says what the ratio is: ``"equal"`` (both
    interpolated), ``"at least"`` (the editing NFE is a bound), ``"at most"`` (the fill NFE
    is), ``None`` with no ratio when both are bounds; ``"fill unreached"`` (no fill curve
    reaches the accuracy, no ratio) or ``"edit unreached"``.

    :return: ``{"edit", "fill"`` (the best curves' names, ``None`` when none reaches),
        ``"edit_nfe", "fill_nfe", "ratio", "bound"}``.
    """
    def best(edits: bool) -> tuple[str | None, dict[str, Any] | None]:
        reached = [(name, point) for name, point in equal["rules"].items() if point["nfe_mean"] is not None
                   and name in grids and as_grid(name, grids[name]).edits == edits]
        return min(reached, key=lambda item: item[1]["nfe_mean"]) if reached else (None, None)

    (edit, edit_point), (fill, fill_point) = best(True), best(False)
    result: dict[str, Any] = {"edit": edit, "fill": fill, "edit_nfe": edit_point and edit_point["nfe_mean"],
                              "fill_nfe": fill_point and fill_point["nfe_mean"], "ratio": None}
    if edit_point is None:
        return {**result, "bound": "edit unreached"}
    if fill_point is None:
        return {**result, "bound": "fill unreached"}
    bounds = {(True, True): "equal", (False, True): "at least", (True, False): "at most", (False, False): None}
    bound = bounds[(edit_point["bound"] == "interpolated", fill_point["bound"] == "interpolated")]
    ratio = fill_point["nfe_mean"] / edit_point["nfe_mean"] if bound else None
    return {**result, "ratio": ratio, "bound": bound}
