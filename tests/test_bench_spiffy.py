"""``benchmarks/bench_spiffy.py``: one run measures Spiffy against its base on the suite the
model's tokenizer writes, and every Spiffy output equals its base's."""

from __future__ import annotations

import importlib
import json

import pytest

from dloom.zoo import model_path


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.bench_spiffy")


@pytest.mark.parametrize("model, block, calibration, suite", [
    ("toy-dllm", "8", "10", "all"),  # toy prompts often finish a block in one step: more of them
    ("long-dllm", "32", "2", "long"),
])
def test_measures_spiffy_over_its_base_on_the_models_suite(bench, tmp_path, model, block, calibration, suite):
    if not (model_path(model) / "model.safetensors").exists():
        pytest.skip(f"{model} not installed")
    out = tmp_path / "spiffy.json"
    bench.main(["--model", model, "--block-length", block, "--bases", "threshold", "--budgets", "3",
                "--pruned", "", "-n", "2", "--calibration-n", calibration, "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["tasks"] == suite
    base = report["bases"]["threshold"]["base"]
    rows = report["bases"]["threshold"]["spiffy"]
    assert [(r["D"], r["D*"], r["first_forward"], r["prune"]) for r in rows] == [
        (3, 3, False, "rule"), (3, 3, True, "rule")]
    for spiffy in rows:
        assert spiffy["identical"] == 1.0
        assert spiffy["nfe_ratio"] == pytest.approx(base["nfe_mean"] / spiffy["nfe_mean"])
    assert [row["label"] for row in report["full_stack"]["rows"]] == [
        "threshold + dual", "threshold + dual + spiffy"]
