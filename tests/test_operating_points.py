"""Operating points (issue 42): the dev split, each rule's setting chosen on it, the curves'
Pareto fronts and NFE at equal accuracy, the targets, and one end-to-end run on toy-dllm."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dloom.cli import commands as cli
from dloom.errors import ConfigurationError
from dloom.evaluation import select_examples
from dloom.zoo import long_tasks
from dloom.zoo.tasks import EVALUATED, dev, held_out, is_held_out

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def op():
    return importlib.import_module("benchmarks.report_operating_points")


@pytest.fixture(scope="module")
def command():
    return importlib.import_module("benchmarks.operating_points")


# --- the dev split ----------------------------------------------------------------------------


def test_the_dev_split_is_held_out_deterministic_balanced_and_never_an_evaluated_prompt():
    examples = dev(40, suite=long_tasks.FAMILIES)
    assert examples == dev(40, suite=long_tasks.FAMILIES)
    assert [e.family for e in examples[:4]] == list(long_tasks.FAMILIES)
    assert all(is_held_out(e.family, e.prompt) for e in examples)
    evaluated = {(e.family, e.prompt) for e in held_out(EVALUATED, suite=long_tasks.FAMILIES)}
    assert not evaluated & {(e.family, e.prompt) for e in examples}
    assert len({(e.family, e.prompt) for e in examples}) == 40


def test_the_dev_split_avoids_exactly_the_evaluated_prefix():
    """``evaluated=m`` refuses ``held_out(m)``: a smaller count frees prompts a larger one takes."""
    small = dev(100, suite=long_tasks.FAMILIES, evaluated=20)
    scored = {(e.family, e.prompt) for e in held_out(20, suite=long_tasks.FAMILIES)}
    assert not scored & {(e.family, e.prompt) for e in small}
    wider = {(e.family, e.prompt) for e in held_out(EVALUATED, suite=long_tasks.FAMILIES)}
    assert wider & {(e.family, e.prompt) for e in small}  # what the default would have refused


def test_a_family_with_no_prompt_left_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="family 'story' has no held-out prompt left.*fewer dev examples"):
        select_examples("all", 40, split="dev")
    assert len(select_examples("all", 40, split="dev", evaluated=40)) == 40


def test_dloom_eval_scores_the_dev_split_and_refuses_an_unknown_split():
    runner = CliRunner()
    bad = runner.invoke(cli.app, ["eval", "--split", "test", "-n", "2"])
    assert bad.exit_code == 2 and "--split is 'test'; allowed: 'held-out', 'dev'" in bad.output
    result = runner.invoke(cli.app, ["eval", "--tasks", "copy,add", "--split", "dev", "-n", "4", "--json",
                                     "--outputs", "--strategy", "threshold"])
    assert result.exit_code == 0, result.output
    prompts = [json.loads(line)["prompt"] for line in result.stdout.splitlines()[:-1]]
    assert prompts == [e.prompt for e in select_examples("copy,add", 4, split="dev")]
    assert not set(prompts) & {e.prompt for e in select_examples("copy,add", EVALUATED)}


# --- choosing, fronts, equal accuracy ---------------------------------------------------------


def row(rule: str, value: float, accuracy: float, nfe: float, cache: str = "none") -> dict:
    parameter = {"threshold": "tau", "factor": "f", "frechet": "delta"}[rule]
    return {"name": f"{rule}@{value:g}", "commit_rule": rule, "params": {rule: {parameter: value}},
            "accuracy": accuracy, "nfe_mean": nfe, "cache": cache, "speculation": None}


def test_choose_takes_the_fewest_nfe_within_one_point_of_the_reference(op):
    rows = [row("threshold", 0.9, 0.70, 16.0), row("threshold", 0.99, 0.905, 23.0),
            row("threshold", 0.999, 0.93, 40.0)]
    choice = op.choose(rows, reference_accuracy=0.91)
    assert (choice["value"], choice["matched"]) == (0.99, True)
    assert op.choose(rows, reference_accuracy=0.93)["value"] == 0.999
    unmatched = op.choose(rows, reference_accuracy=0.99)  # none within a point: the most accurate
    assert (unmatched["value"], unmatched["matched"]) == (0.999, False)
    # equal NFE: the more cautious setting (a smaller f is more cautious for factor)
    tie = [row("factor", 0.5, 0.92, 20.0), row("factor", 0.25, 0.92, 20.0)]
    assert op.choose(tie, 0.92)["value"] == 0.25


def test_the_pareto_front_drops_dominated_points(op):
    points = [{"name": n, "nfe_mean": x, "accuracy": a} for n, x, a in
              [("a", 10, 0.5), ("b", 12, 0.4), ("c", 20, 0.8), ("d", 20, 0.7), ("e", 30, 0.8), ("f", 40, 0.9)]]
    assert [p["name"] for p in op.pareto_front(points)] == ["a", "c", "f"]


def test_nfe_at_accuracy_interpolates_on_the_front(op):
    curve = [{"nfe_mean": 10.0, "accuracy": 0.6}, {"nfe_mean": 20.0, "accuracy": 0.8},
             {"nfe_mean": 25.0, "accuracy": 0.7}, {"nfe_mean": 40.0, "accuracy": 0.9}]
    assert op.nfe_at_accuracy(curve, 0.7) == {"nfe_mean": pytest.approx(15.0), "bound": "interpolated"}
    assert op.nfe_at_accuracy(curve, 0.85) == {"nfe_mean": pytest.approx(30.0), "bound": "interpolated"}
    assert op.nfe_at_accuracy(curve, 0.5) == {"nfe_mean": 10.0, "bound": "at most"}
    assert op.nfe_at_accuracy(curve, 0.95) == {"nfe_mean": None, "bound": "unreached"}


def test_equal_accuracy_compares_each_rule_with_threshold_where_both_are_interpolated(op):
    rows = [row("threshold", 0.9, 0.70, 16.0), row("threshold", 0.99, 0.90, 26.0),
            row("frechet", 0.9, 0.80, 15.0), row("frechet", 0.99, 0.95, 22.0),
            row("factor", 0.1, 0.95, 30.0), row("threshold", 0.99, 0.99, 9.0, cache="dual")]
    result = op.equal_accuracy(rows, {"accuracy": 0.90})
    assert result["accuracy"] == pytest.approx(0.89)
    threshold, frechet, factor = (result["rules"][r] for r in ("threshold", "frechet", "factor"))
    assert threshold["nfe_mean"] == pytest.approx(25.5) and threshold["bound"] == "interpolated"
    assert frechet["nfe_mean"] == pytest.approx(15 + 7 * 0.09 / 0.15)
    assert frechet["saving_vs_reference"] == pytest.approx(1 - frechet["nfe_mean"] / 25.5)
    assert frechet["saving_bound"] == "equal"
    assert factor["saving_bound"] == "at least"  # its cheapest setting already reaches it
    assert result["rules"]["threshold"]["saving_vs_reference"] == pytest.approx(0.0)


# --- targets and the run ----------------------------------------------------------------------


def synthetic(failfast_speedup: float = 3.5, identical: float = 1.0) -> dict:
    rows = [
        {**row("threshold", 0.9, 0.7, 16.0), "label": "threshold tau = 0.9"},
        {**row("threshold", 0.99, 0.9, 26.0), "label": "threshold tau = 0.99"},
        {**row("frechet", 0.9, 0.8, 15.0), "label": "frechet delta = 0.9"},
        {**row("frechet", 0.99, 0.95, 22.0), "label": "frechet delta = 0.99"},
        {**row("threshold", 0.99, 0.9, 20.0, cache="dual"), "name": "threshold@0.99/dual", "label": "t dual"},
        {"name": "spiffy+threshold/dual", "label": "Spiffy over threshold", "commit_rule": "threshold",
         "params": {}, "accuracy": 0.9, "nfe_mean": 12.0, "cache": "dual", "speculation": {"acceptance": 0.5},
         "identical_to_commit_rule": identical, "nfe_over_oracle": 1.4},
    ]
    op_module = importlib.import_module("benchmarks.report_operating_points")
    methods = {"failfast@0.05": {"wall_speedup_vs_ar": failfast_speedup, "identical_to_ar": 1.0, "drafter_tau": 0.05,
                                 "modelled_speedup_vs_ar": 5.0, "target_forwards_per_prompt": 12.0,
                                 "target_forwards": 120, "helper_forwards": 200},
               "ar": {"target_forwards": 900, "helper_forwards": 0}}
    return {"rows": rows, "equal_accuracy": op_module.equal_accuracy(rows[:4], {"accuracy": 0.9}),
            "choices": {"threshold": {"name": "threshold@0.99", "value": 0.99}},
            "spiffy": {"cache": "dual"}, "oracle": {"nfe_mean": 8.0, "reached_share": 1.0},
            "failfast": {"methods": methods, "best": "failfast@0.05", "chosen_by": "wall time",
                         "latency": {"ratio": 3.0}}}


def test_the_targets_carry_their_figures_and_fail_when_missed(command, op):
    met = command.targets(synthetic())
    assert [item["met"] for item in met] == [True, True, True, True]
    assert met[0]["measured"].startswith(f"{1 - (15 + 7 * 0.09 / 0.15) / 25.5:.1%}")
    assert met[1]["measured"] == "1.67×, 100% identical"
    missed = command.targets(synthetic(failfast_speedup=1.5, identical=0.99))
    assert missed[1]["met"] is False and missed[3]["met"] is False
    assert "2.00× short" in missed[3]["detail"]
    assert "cost ratio ≤ 0.90 (measured 3.00)" in missed[3]["detail"]  # (900 / 3 - 120) / 200


def test_the_break_even_cost_ratio_solves_the_latency_model(command):
    failfast = importlib.import_module("benchmarks.report_failfast")
    ar = {"target_forwards": 2431, "helper_forwards": 0}
    method = {"target_forwards": 460, "helper_forwards": 779}
    ratio = failfast.break_even_cost_ratio(ar, method, 3.0)
    modelled = ar["target_forwards"] / (method["target_forwards"] + method["helper_forwards"] * ratio)
    assert modelled == pytest.approx(3.0)
    assert failfast.break_even_cost_ratio(ar, method, 6.0) is None  # 2431 / 6 < 460 target forwards
    assert failfast.break_even_cost_ratio(ar, {"target_forwards": 460, "helper_forwards": 0}, 3.0) is None
    assert "however cheap the drafter" in command.break_even_note(ar, method, 6.0, 2.83)
    with pytest.raises(ValueError, match="speedup 0"):
        failfast.break_even_cost_ratio(ar, method, 0)


def test_the_accuracy_keeping_threshold_is_taken_on_held_out_when_the_dev_choice_loses_accuracy(command):
    quota = {"name": "quota", "commit_rule": "quota", "accuracy": 0.957, "nfe_mean": 46.6}
    rows = [quota, row("threshold", 0.7, 0.930, 10.4), row("threshold", 0.9, 0.950, 12.2),
            row("threshold", 0.99, 0.957, 15.0), row("frechet", 0.5, 0.957, 9.0)]
    dev_choice = {"threshold": {"name": "threshold@0.7"}}
    keeping = command.accuracy_keeping_threshold(rows, dev_choice)
    assert (keeping["name"], keeping["value"], keeping["matched"]) == ("threshold@0.9", 0.9, True)
    assert command.accuracy_keeping_threshold(rows, {"threshold": {"name": "threshold@0.9"}}) is None  # dev kept it
    assert command.accuracy_keeping_threshold(rows[:2], dev_choice) is None  # nothing keeps accuracy
    assert command.accuracy_keeping_threshold(rows, {}) is None


def test_spiffy_s_target_is_also_measured_over_the_held_out_accuracy_keeping_threshold(command):
    report = synthetic()
    report["accuracy_keeping_threshold"] = {"name": "threshold@0.9", "value": 0.9}
    report["rows"] += [{**row("threshold", 0.9, 0.7, 15.0, cache="dual"), "name": "threshold@0.9/dual"},
                       {"name": "spiffy+threshold@0.9/dual", "label": "Spiffy over threshold tau = 0.9",
                        "commit_rule": "threshold", "params": {}, "accuracy": 0.7, "nfe_mean": 11.0, "cache": "dual",
                        "speculation": {"acceptance": 0.4}, "identical_to_commit_rule": 1.0, "nfe_over_oracle": 1.3}]
    items = command.targets(report)
    assert len(items) == 5 and "chosen on dev" in items[1]["target"]
    kept = items[2]
    assert "τ = 0.9, the one that keeps accuracy" in kept["target"]
    assert (kept["measured"], kept["met"]) == ("1.36×, 100% identical", False)
    assert "15.00 → 11.00 NFE" in kept["detail"] and "1.10× short" in kept["detail"]


@pytest.mark.parametrize("argv, message", [
    (["--n-dev", "0"], "--n-dev 0 and -n 300"),
    (["--failfast-repeats", "0"], "--failfast-repeats 0: allowed: 1 or more"),
    (["--drafter-taus", "0.5,1"], "distinct thresholds, each in (0, 1)"),
])
def test_bad_options_are_refused_before_any_work(command, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        command.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_run_chooses_on_dev_scores_on_held_out_and_writes_its_page(command, tmp_path):
    grids = {"threshold": ("tau", (0.5, 0.999)), "frechet": ("delta", (0.5, 0.99))}
    from dloom import load_model

    model = load_model("toy-dllm")
    report = command.measure(model, "toy-dllm", "copy,add", 8, 8, 8, spiffy=False, grids=grids,
                             out=tmp_path / "op.json")
    dev_names = [r["name"] for r in report["dev"]["rows"]]
    assert dev_names == ["quota", "threshold@0.5", "threshold@0.999", "frechet@0.5", "frechet@0.99"]
    assert set(report["choices"]) == {"threshold", "frechet"}
    assert [r["name"] for r in report["rows"]][:1] == ["quota"] and len(report["rows"]) == 5
    chosen = [r["name"] for r in report["rows"] if r["chosen_on_dev"]]
    assert chosen == sorted({c["name"] for c in report["choices"].values()}, key=chosen.index)
    report.update(command="c", date="d", seconds=1.0, machine="m", torch="t", torch_threads=1, model="toy-dllm",
                  tasks="copy,add", n=8, batch_size=8)
    text = command.page(report, tmp_path / "op.json")
    assert "8 dev prompts" in text and "## Chosen settings" in text and "## FailFast" not in text
    assert "| threshold | tau = 0.5 |" in text  # every setting keeps accuracy here: the most parallel
    table = command.headline(report)
    rows = [line for line in table.split("| target |")[0].splitlines() if line.startswith("| ") and "%" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| quota, one token per step (baseline) (quota)",
                                                  "| threshold tau = 0.5", "| frechet delta = 0.5"]
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- report:operating-points:start -->\nold\n<!-- report:operating-points:end -->\n")
    report_tables = importlib.import_module("benchmarks.report_tables")
    assert table in report_tables.replace_marked(readme.read_text(), "operating-points", table)


# --- a model that edits -----------------------------------------------------------------------


def edit_row(curve: str, rule: str, parameter: str, value: float, accuracy: float, nfe: float, **fixed) -> dict:
    return {"name": f"{curve}@{value:g}", "label": f"{curve} {value:g}", "commit_rule": rule,
            "params": {rule: {**fixed, parameter: value}}, "accuracy": accuracy, "nfe_mean": nfe, "cache": "none",
            "speculation": None}


def edit_grids(op):
    return {"threshold": ("tau", (0.5, 0.9)),
            "speed": op.Grid("joint_threshold", "tau", (0.3, 0.5), fixed={"edit_tau": 0.0}, edits=True),
            "quality": op.Grid("joint_threshold", "tau", (0.3, 0.5), fixed={"edit_tau": 0.5}, edits=True)}


def test_two_curves_of_one_rule_are_told_apart_by_name_and_keep_their_fixed_parameters(op):
    grids = edit_grids(op)
    configs = op.grid_configs(grids)
    assert [c.name for c in configs] == ["threshold@0.5", "threshold@0.9", "speed@0.3", "speed@0.5",
                                         "quality@0.3", "quality@0.5"]
    assert configs[3].strategy == "joint_threshold" and configs[3].params == {"edit_tau": 0.0, "tau": 0.5}
    assert configs[3].label == "joint_threshold tau = 0.5 (edit_tau = 0)"
    assert configs[0].label == "threshold tau = 0.5" and configs[0].params == {"tau": 0.5}  # as before grids had rules
    rows = [edit_row("speed", "joint_threshold", "tau", 0.3, 0.95, 12.0, edit_tau=0.0),
            edit_row("quality", "joint_threshold", "tau", 0.5, 0.99, 12.5, edit_tau=0.5),
            edit_row("speed", "joint_threshold", "tau", 0.5, 0.99, 12.2, edit_tau=0.0)]
    assert op.setting(rows[1], grids) == ("quality", "tau", 0.5)
    assert op.setting(rows[1]) is None  # not a curve of the fill-only grids
    assert {curve: [r["name"] for r in found] for curve, found in op.curves(rows, grids).items()} == {
        "speed": ["speed@0.3", "speed@0.5"], "quality": ["quality@0.5"]}
    choice = op.choose([rows[0], rows[2]], 0.99, grids=grids)
    assert (choice["curve"], choice["rule"], choice["value"], choice["fixed"]) == ("speed", "joint_threshold", 0.5,
                                                                                   {"edit_tau": 0.0})
    with pytest.raises(ValueError, match="grid 'speed' is a \\(parameter, values\\) pair"):
        op.as_grid("speed", ("tau", (0.5,)))


def test_editing_rules_are_swept_only_on_a_kernel_that_runs_them(op):
    assert op.grids_for("absorbing") == op.GRIDS
    edit = op.grids_for("revisable")
    assert set(op.GRIDS) < set(edit) and "entropy_bound" in edit
    from dloom.hooks.registry import get_registry

    editing = {name for name, strategy in get_registry().strategies.items() if strategy.registration.edits}
    assert editing >= {"joint_threshold", "frechet_edit", "wino"}
    # every built-in editing rule has a curve on the editing model
    assert {op.as_grid(n, g).rule for n, g in edit.items() if op.as_grid(n, g).edits} == editing
    from dloom.decode.transition import check_kernel
    from dloom.hooks.composition import compose

    for name, spec in edit.items():
        check_kernel(compose(op.as_grid(name, spec).rule), "revisable")
        if op.as_grid(name, spec).edits:  # the reason the fill-only model does not sweep them
            with pytest.raises(ConfigurationError, match="not the model's 'absorbing'"):
                check_kernel(compose(op.as_grid(name, spec).rule), "absorbing")


def point(nfe, bound="interpolated"):
    return {"nfe_mean": nfe, "bound": bound}


@pytest.mark.parametrize("speed, threshold, expected", [
    (point(10.0), point(20.0), (2.0, "equal")),
    (point(10.0, "at most"), point(20.0), (2.0, "at least")),  # editing might need fewer still
    (point(10.0), point(20.0, "at most"), (2.0, "at most")),
    (point(10.0, "at most"), point(20.0, "at most"), (None, None)),
    (point(None, "unreached"), point(20.0), (None, "edit unreached")),
    (point(10.0), point(None, "unreached"), (None, "fill unreached")),
])
def test_edit_over_fill_compares_the_best_curve_of_each_kind(op, speed, threshold, expected):
    quality = point(30.0) if speed["nfe_mean"] is not None else point(None, "unreached")
    equal = {"rules": {"threshold": threshold, "speed": speed, "quality": quality}}
    result = op.edit_over_fill(equal, edit_grids(op))
    assert (result["ratio"], result["bound"]) == expected
    if speed["nfe_mean"] is not None:
        assert result["edit"] == "speed" and result["edit_nfe"] == 10.0  # the cheaper editing curve


def edit_report(command, op, speed_nfe: float) -> dict:
    grids = edit_grids(op)
    rows = [{"name": "quota", "label": "quota", "commit_rule": "quota", "params": {}, "accuracy": 0.99,
             "nfe_mean": 46.0, "cache": "none", "speculation": None, "nfe_over_oracle": 5.0},
            edit_row("threshold", "threshold", "tau", 0.5, 0.86, 9.0), edit_row("threshold", "threshold", "tau", 0.9,
                                                                                   0.99, 12.0),
            edit_row("speed", "joint_threshold", "tau", 0.3, 0.95, speed_nfe - 1, edit_tau=0.0),
            edit_row("speed", "joint_threshold", "tau", 0.5, 0.99, speed_nfe, edit_tau=0.0)]
    for row in rows[1:]:
        row["nfe_over_oracle"] = row["nfe_mean"] / 9.0
    return {"rows": rows, "grids": command.grids_json(grids), "tolerance": 0.01,
            "equal_accuracy": op.equal_accuracy(rows, rows[0], grids=grids),
            "oracle": {"nfe_mean": 9.0, "reached_share": 1.0}}


def test_the_edit_targets_carry_their_figures_and_fail_when_missed(command, op):
    recorded = command.grids_from_json(edit_report(command, op, 7.0)["grids"])
    assert recorded == {name: op.as_grid(name, spec) for name, spec in edit_grids(op).items()}
    met = command.targets(edit_report(command, op, 7.0))  # an editing grid: issue 53's targets
    assert [item["met"] for item in met] == [True, True]
    ratio = (9 + 3 * 0.12 / 0.13) / (6 + 0.03 / 0.04)  # each curve interpolated at 98 %
    assert met[0]["measured"] == f"{ratio:.2f}×" and "speed" in met[0]["detail"]
    assert met[1]["measured"].startswith("0.78× (speed 0.5)")  # the fewest NFE within a point: 7 / 9
    missed = command.targets(edit_report(command, op, 14.0))
    assert [item["met"] for item in missed] == [False, True] and "short" in missed[0]["detail"]
    assert missed[1]["measured"].startswith("1.33× (threshold 0.9)")
    bounded = edit_report(command, op, 10.0)
    bounded["rows"][3]["accuracy"] = 0.99  # every editing setting reaches quota's accuracy: its NFE only bounded
    bounded["equal_accuracy"] = op.equal_accuracy(bounded["rows"], bounded["rows"][0], grids=edit_grids(op))
    first = command.targets(bounded)[0]
    assert first["measured"] == f"{(9 + 3 * 0.12 / 0.13) / 9:.2f}× (at least)"
    assert first["met"] is False and "no editing setting measured takes fewer than 9.00 NFE" in first["detail"]


def test_an_editing_run_s_page_shows_its_grids_edits_and_plot(command, op, tmp_path):
    report = edit_report(command, op, 7.0)
    report["rows"][3].update(edits_per_answer=2.5, fixed_by_edit_share=0.1, broken_by_edit_share=0.0)
    for row in report["rows"]:
        row.update(tpf=3.0, tps=100.0, wall_seconds=1.5, identical_to_commit_rule=None, nfe_ratio=1.0)
    grids = command.grids_from_json(report["grids"])
    report.update(command="c", date="d", seconds=1.0, machine="m", torch="t", torch_threads=1, model="edit-model",
                  tasks="long", n=10, batch_size=8, dev={"n": 10, "rows": report["rows"]}, kernel="revisable",
                  pareto=["speed@6"], targets=command.targets(report),
                  choices={"speed": op.choose(report["rows"][3:], 0.99, grids=grids)})
    text = command.page(report, tmp_path / "op.json", "operating-points-edit.png")
    assert "(a model that edits)" in text and "## Rules and grids" in text and "**Stack.**" in text
    assert "| speed | `joint_threshold` | edits | tau | 0.3, 0.5 | edit_tau = 0 |" in text
    assert "| speed | tau = 0.5, edit_tau = 0 |" in text
    assert "wall ms / prompt | edits / answer | fixed by an edit | broken by an edit |" in text
    assert "| speed 0.3 | 95.0% | 6.00 | 3.00 | 100.0 | 150.0 | 2.50 | 10.0% | 0.0% |" in text
    assert "](../assets/operating-points-edit.png)" in text
    command.plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_spiffy_is_refused_on_a_kernel_it_does_not_run_on(command):
    assert command.runs_spiffy("absorbing") and not command.runs_spiffy("revisable")
    from dloom import load_model

    model = load_model("toy-dllm")
    import dataclasses

    revisable = dataclasses.replace(model, kernel="revisable")
    with pytest.raises(ConfigurationError, match="Spiffy does not run on the model's 'revisable' kernel"):
        command.measure(revisable, "toy-dllm", "copy", 2, 2, 2, spiffy=True)


def test_a_resumed_run_whose_grids_gained_a_curve_measures_only_that_curve(command, tmp_path):
    """The lead's path for a rule that lands after the run started: the same command with one
    more grid and ``--resume`` reuses every finished measurement."""
    from dloom import load_model

    model = load_model("toy-dllm")
    out = tmp_path / "op.json"
    first = {"threshold": ("tau", (0.5, 0.999))}
    command.measure(model, "toy-dllm", "copy,add", 4, 4, 4, spiffy=False, grids=first, out=out)
    grown = {**first, "frechet": ("delta", (0.5,))}
    report = command.measure(model, "toy-dllm", "copy,add", 4, 4, 4, spiffy=False, grids=grown, out=out, resume=True)
    assert sorted(report["reused"]) == sorted(["quota", "threshold@0.5", "threshold@0.999"] * 2 + ["oracle"])
    assert [r["name"] for r in report["rows"]] == ["quota", "threshold@0.5", "threshold@0.999", "frechet@0.5"]


def test_render_writes_the_page_again_with_wall_time_and_measures_nothing(command, tmp_path, capsys, monkeypatch):
    """``--render`` rebuilds a recorded run's page from its JSON (the committed words run here:
    the page is the committed one, byte for byte, apart from the JSON's path), with
    ``--wall-time``'s sections appended and the files named in the JSON for the next render."""
    import json
    import shutil

    out = tmp_path / "op.json"
    shutil.copy(command.ROOT / "benchmarks" / "results" / "operating-points-words.json", out)
    wall = tmp_path / "wall.json"
    wall.write_text(json.dumps({
        "model": "random-512x8", "n": 2, "gen_length": 32, "block_length": 8, "machine": "x86_64", "torch": "2.x",
        "repeats": 3, "load_average": [1.0, 1.5], "budget": 10, "command": "python -m benchmarks.bench_cost_rules",
        "rows": [{"rule": "quota", "params": {}, "cache": "none", "runs": {
            "rule": {"seconds": 1.0, "nfe": 20},
            "auto": {"budget": 0, "nfe": 20, "identical": True, "wall_vs_rule": 1.0, "paired_vs_rule": 1.01},
            "fixed": {"budget": 10, "nfe": 10, "identical": True, "paired_vs_rule": 0.4, "nfe_vs_rule": 2.0}}}],
    }))
    monkeypatch.setattr(command, "load_model", lambda *a, **k: pytest.fail("--render measured"))
    command.main(["--render", "--out", str(out), "--docs", str(tmp_path / "docs"), "--wall-time", str(wall)])
    text = (tmp_path / "docs" / "benchmarks" / "operating-points.md").read_text()
    committed = (command.ROOT / "docs" / "benchmarks" / "operating-points.md").read_text()
    before, _, section = text.partition("\n## Wall time at `budget=auto`\n")
    assert before.replace(str(out), "benchmarks/results/operating-points-words.json") + "\n" == committed.split(
        "\n## Wall time at `budget=auto`\n")[0] + "\n"
    assert "| quota | none | 1.00 | – | 0 | 1.01× | 1.00× | 20 (20) | yes | 0.40× | 2.00× | yes |" in section
    assert json.loads(out.read_text())["wall_time"] == [str(wall)]
    assert (tmp_path / "docs" / "assets" / "operating-points.png").stat().st_size > 0
    command.main(["--render", "--out", str(out), "--docs", str(tmp_path / "again")])  # the files the JSON names
    assert (tmp_path / "again" / "benchmarks" / "operating-points.md").read_text() == text
    with pytest.raises(SystemExit) as exit_info:
        command.main(["--render", "--out", str(tmp_path / "none.json")])
    assert exit_info.value.code == 2 and "holds no run's figures" in capsys.readouterr().err
