"""``benchmarks/sweep_commit_rules.py`` rewrites its table and keeps the page around it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    return importlib.import_module("benchmarks.sweep_commit_rules")


def _report(sweep, accuracy: float) -> dict:
    rows = [
        {"strategy": "quota", "param": None, "value": None, "accuracy": 0.75, "nfe_mean": 32.0, "tpf": 0.4, "tps": 50.0},
        {"strategy": "threshold", "param": "tau", "value": 0.9, "accuracy": accuracy, "nfe_mean": 3.0, "tpf": 4.0,
         "tps": 150.0},
        {"strategy": "frechet", "param": "delta", "value": 0.0, "accuracy": accuracy, "nfe_mean": 2.0, "tpf": 6.0,
         "tps": 300.0},
        {"strategy": "factor", "param": "f", "value": 1.0, "accuracy": 0.5, "nfe_mean": 2.5, "tpf": 5.0, "tps": 200.0},
    ]
    return {"model": "toy-dllm", "n": 10, "batch_size": 4, "torch_threads": 1, "rows": rows,
            "matched": sweep.matched_accuracy(rows)}


def test_the_table_is_replaced_and_the_prose_above_it_kept(sweep, tmp_path):
    page = tmp_path / "commit_rules.md"
    page.write_text("# Commit rules\n\nHand-written prose.\n\n")
    sweep.write_table(_report(sweep, 0.8), page)
    sweep.write_table(_report(sweep, 0.9), page)  # a second run replaces the first table
    text = page.read_text()
    assert text.startswith("# Commit rules\n\nHand-written prose.\n\n" + sweep.TABLE_START)
    assert text.count(sweep.TABLE_START) == 1
    assert "| threshold | tau = 0.9 | 90.0% |" in text and "80.0%" not in text
    assert "no configuration reached the accuracy floor" in text  # factor is below the floor


def test_a_new_page_holds_the_table_alone(sweep, tmp_path):
    page = tmp_path / "new.md"
    sweep.write_table(_report(sweep, 0.8), page)
    assert page.read_text().startswith(sweep.TABLE_START)
