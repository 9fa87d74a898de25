"""``benchmarks/bench_cost_rules.py``: the rules' settings from an operating-points report, the
paired ratio, the rotation of the decoding order and the Markdown section of a result."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.bench_cost_rules")


def test_rule_settings_read_the_choices_and_add_quota(bench):
    choices = {
        "threshold": {"rule": "threshold", "parameter": "tau", "value": 0.7, "name": "threshold@0.7"},
        "frechet": {"rule": "frechet", "parameter": "delta", "value": 0.5},
    }
    assert bench.rule_settings(choices) == {"threshold": {"tau": 0.7}, "frechet": {"delta": 0.5}, "quota": {}}
    with pytest.raises(ValueError, match="choice 'factor' is .*expected a 'parameter' and a 'value'"):
        bench.rule_settings({"factor": {"rule": "factor", "value": 1.0}})


def test_the_paired_ratio_is_the_median_of_the_per_pass_ratios(bench):
    # pass 2 ran under a load spike that slowed both alike: the ratio of the medians (4/2 = 2)
    # says less than the passes, each 1.5x
    assert bench.paired_ratio([3.0, 30.0, 4.5], [2.0, 20.0, 3.0]) == pytest.approx(1.5)
    assert bench.paired_ratio([1.0, 2.0, 9.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="paired passes needed; got 2 and 1"):
        bench.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="paired passes needed; got 0 and 0"):
        bench.paired_ratio([], [])
    with pytest.raises(ValueError, match="must be positive"):
        bench.paired_ratio([1.0], [0.0])


def test_the_order_rotates_through_every_position(bench):
    names = ["rule", "auto", "fixed"]
    assert [bench.rotation(names, shift) for shift in range(4)] == [
        ["rule", "auto", "fixed"], ["auto", "fixed", "rule"], ["fixed", "rule", "auto"], ["rule", "auto", "fixed"]]
    assert bench.RUNS[0] == "rule" and "again" in bench.RUNS  # the rule timed against itself too


def result(identical: bool = True) -> dict:
    run = {"seconds": 1.0, "passes": [1.0], "nfe": 20}
    spiffy = {"seconds": 1.0, "passes": [1.0], "identical": identical, "wall_vs_rule": 0.98,
              "paired_vs_rule": 1.02, "nfe_vs_rule": 1.0}
    return {
        "model": "random-512x8", "n": 4, "gen_length": 32, "block_length": 8, "machine": "x86_64",
        "torch": "2.x", "repeats": 5, "load_average": [2.5, 7.25], "budget": 10,
        "command": "python -m benchmarks.bench_cost_rules --model random-512x8",
        "rows": [
            {"rule": "threshold", "params": {"tau": 0.7}, "cache": "dual", "runs": {
                "rule": run, "auto": {**spiffy, "budget": 0, "nfe": 20},
                "fixed": {**spiffy, "budget": 10, "nfe": 10, "paired_vs_rule": 0.4, "nfe_vs_rule": 2.0},
                "again": {**spiffy, "paired_vs_rule": 0.97}}},
            {"rule": "quota", "params": {}, "cache": "none", "runs": {
                "rule": run, "auto": {**spiffy, "budget": 1, "nfe": 15},
                "fixed": {**spiffy, "budget": 10, "nfe": 8, "identical": False}}},
        ],
    }


def test_the_wall_time_section_has_a_row_per_rule_and_cache(bench):
    section = bench.wall_time_section(result())
    lines = section.splitlines()
    assert lines[0] == "### Wall time at `budget=auto`: `random-512x8`"
    assert "load average 2.5–7.2" in section and "`OMP_NUM_THREADS=1 python -m benchmarks.bench_cost_rules" in section
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| rule")]
    assert rows == [
        "| threshold τ 0.7 | dual | 1.00 | 0.97× | 0 | 1.02× | 0.98× | 20 (20) | yes | 0.40× | 2.00× | yes |",
        "| quota | none | 1.00 | – | 1 | 1.02× | 0.98× | 15 (20) | yes | 1.02× | 1.00× | **no** |",
    ]
    assert section.endswith("\n")
