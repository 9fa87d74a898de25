"""Options of the pytest-benchmark suite (``benchmarks/test_bench_strategies.py``): which
strategies it measures and on how many prompts (``docs/benchmarks/index.md``)."""

from __future__ import annotations

import os

BUILT_INS = ("quota", "threshold", "factor", "frechet", "spiffy+quota", "spiffy+threshold")
"""The strategies the suite measures by default."""
PROMPTS = 32


def pytest_addoption(parser) -> None:
    group = parser.getgroup("dloom benchmarks")
    group.addoption(
        "--strategies", default=os.environ.get("DLOOM_BENCH_STRATEGIES") or ",".join(BUILT_INS),
        help="comma-separated registered strategies or compositions to decode with (their commit "
        "rules also get a dloom_select_commit micro-benchmark); default: $DLOOM_BENCH_STRATEGIES, "
        f"else {','.join(BUILT_INS)}",
    )
    group.addoption(
        "--bench-prompts", type=int, default=int(os.environ.get("DLOOM_BENCH_PROMPTS") or PROMPTS),
        help=f"held-out prompts each decode takes (default: $DLOOM_BENCH_PROMPTS, else {PROMPTS})",
    )
