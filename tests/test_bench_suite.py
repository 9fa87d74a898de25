"""The pytest-benchmark suite (``benchmarks/test_bench_strategies.py``) takes the strategies
it measures by name, a third party's included, and runs in its quick mode."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import dloom
import dloom_plugins

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "test_bench_strategies.py"

THIRD_PARTY = '''
import torch
import dloom
from dloom.hooks.registry import Strategy, get_registry


class EntropyBounded:
    def __init__(self, bound: float = 0.5) -> None:
        self.bound = bound

    @dloom.hookimpl
    @dloom.reads_signals("entropy")
    def dloom_select_commit(self, selectable, signals):
        entropy = torch.where(selectable, signals["entropy"], torch.inf)
        surest = torch.zeros_like(selectable).scatter_(-1, entropy.argmin(-1, keepdim=True), True)
        return ((entropy <= self.bound) | surest) & selectable


def pytest_configure(config):
    registration = dloom.StrategyRegistration(
        "entropy-bounded", EntropyBounded, [dloom.Parameter("bound", 0.5, float, "nats", low=0.0)]
    )
    get_registry().strategies["entropy-bounded"] = Strategy("entropy-bounded", "third-party", registration)
'''


@pytest.fixture
def suite(pytester, monkeypatch):
    """Run the suite in a subprocess that imports this checkout and a third-party plugin."""
    pytester.makepyfile(third_party=textwrap.dedent(THIRD_PARTY))
    paths = [ROOT, Path(dloom.__file__).parents[1], Path(dloom_plugins.__file__).parents[1], pytester.path]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(map(str, paths)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def run(*args: str):
        return pytester.runpytest_subprocess(
            str(SUITE), "-p", "third_party", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *args
        )

    return run


def test_a_third_party_strategy_is_benchmarked_against_the_builtins(suite):
    result = suite(
        "--strategies", "quota,entropy-bounded,spiffy+entropy-bounded", "--benchmark-disable",
        "--bench-prompts", "2", "-k", "select_commit or decode", "-v",
    )
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines([
        "*test_select_commit?entropy-bounded? PASSED*", "*test_decode?spiffy+entropy-bounded? PASSED*",
    ])


def test_unknown_strategies_are_usage_errors(suite, monkeypatch):
    monkeypatch.setenv("DLOOM_BENCH_STRATEGIES", "quota,entropie-bounded")
    result = suite("--collect-only")
    assert result.ret != 0
    assert "--strategies: unknown strategy 'entropie-bounded'" in result.stdout.str() + result.stderr.str()
