"""The plugin author's path, end to end on the command line: a third-party entropy rule,
written from the docs (``docs/hooks.md``'s entropy rule, ``docs/plugins.md``'s
registration) and installed through a ``dloom`` entry point, runs (``dloom generate``), is
checked (``dloom check``), is swapped into another strategy (``NAME@HOOK``) and is
benchmarked next to the built-ins (``python -m benchmarks.report --configs``; the
pytest-benchmark suite's ``--strategies`` is ``tests/test_bench_suite.py``'s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dloom.cli import app

ROOT = Path(__file__).resolve().parents[1]

ENTROPY_BOUNDED = '''
    """An entropy-bounded commit rule, written from dloom's docs."""

    import torch

    from dloom.sdk import Claim, Parameter, StrategyRegistration, commit_top, hookimpl, reads_signals, sorted_profile


    class EntropyBounded:
        """The most confident masked position, and every other one whose entropy is under ``bound`` nats."""

        def __init__(self, bound: float = 0.5) -> None:
            self.bound = bound

        @hookimpl
        @reads_signals("entropy")
        def dloom_select_commit(self, confidence, selectable, signals):
            _, ranks = sorted_profile(confidence, selectable)
            surest = commit_top(ranks, selectable, torch.ones_like(ranks[:, 0]))
            return surest | (selectable & (signals["entropy"] < self.bound))


    @hookimpl
    def dloom_register_strategies(register):
        register(StrategyRegistration(
            name="entropy-bounded",
            plugin_class=EntropyBounded,
            parameters=[Parameter("bound", 0.5, float, "entropy in nats under which a position commits", low=0.0)],
            summary="the most confident masked position, and every one under an entropy bound",
            claim=Claim(
                "lossless", against="quota", conditions="bound = 0: quota at one token per step",
                holds_when={"bound": 0.0},
            ),
        ))
'''

SWAP = "spiffy+threshold+entropy-bounded@select_commit"  # the rule replaces threshold's


def dloom_command(*args: str):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.filterwarnings("ignore:no built-in draft graph")  # an uncalibrated graph still drafts
@pytest.mark.filterwarnings("ignore:strategy 'entropy-bounded'. lossless against quota not claimed")  # bound > 0
def test_a_third_party_entropy_rule_runs_is_checked_benchmarked_and_swapped_in(
    site, tiny_model_dir, tmp_path, report_module,
):
    site.install("entropy_bounded", ENTROPY_BOUNDED, ep_name="entropy-bounded")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([5, 6, 7], [8, 9], [10, 11, 12, 13])))

    def generate(strategy: str, *params: str) -> list[dict]:
        args = ["--param", *params] if params else []
        result = dloom_command(
            "generate", "--model", tiny_model_dir, "--prompts", prompts, "--json", "--gen-length", "8",
            "--block-length", "4", "--strategy", strategy, *args,
        )
        return [json.loads(line) for line in result.stdout.splitlines()]

    # it runs: at bound 0 it is quota at one token per step, its claim; a loose bound commits more per step
    quota, strict, loose = generate("quota"), generate("entropy-bounded", "bound=0"), generate("entropy-bounded", "bound=5")
    assert [r["tokens"] for r in strict] == [r["tokens"] for r in quota]
    assert sum(r["nfe"] for r in loose) < sum(r["nfe"] for r in quota)

    # it is checked: dloom check tests the claim where it holds (bound 0)
    check = dloom_command(
        "check", "--strategy", "entropy-bounded", "--param", "bound=0", "--model", tiny_model_dir, "-n", "4",
        "--gen-length", "8", "--block-length", "4", "--samples", "3000", "--seeds", "1", "--epsilon", "0.2", "--json",
    )
    assert json.loads(check.stdout)["verdict"] == "lossless"

    # it is swapped into Spiffy over threshold: Spiffy is lossless over whichever rule it runs, so the
    # swap decodes what the rule alone decodes, not what threshold does
    swapped, threshold = generate(SWAP, "bound=5"), generate("spiffy+threshold")
    assert {r["config"]["strategy"] for r in swapped} == {SWAP}
    assert [r["tokens"] for r in swapped] == [r["tokens"] for r in loose] != [r["tokens"] for r in threshold]

    # it is benchmarked next to the built-ins: the report measures it and Spiffy over it against quota
    for name in ("README.md", "docs/index.md"):  # the report rewrites their headline tables
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    report_module.main([
        "--model", "toy-dllm", "-n", "2", "--configs", "entropy-bounded,spiffy+entropy-bounded", "--target", "none",
        "--out", str(tmp_path / "report.json"), "--docs", str(tmp_path / "docs"), "--readme", str(tmp_path / "README.md"),
    ])
    base, rule, spiffy = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert (base["name"], rule["name"], spiffy["name"]) == ("quota", "entropy-bounded", "spiffy+entropy-bounded")
    assert rule["params"] == {"entropy-bounded": {"bound": 0.5}} and rule["nfe_mean"] < base["nfe_mean"]
    assert rule["guarantee"] == "approximate"  # its claim is made at bound 0 only
    assert rule["nfe_ratio"] == base["nfe_mean"] / rule["nfe_mean"]
    assert spiffy["commit_rule"] == "entropy-bounded" and spiffy["identical_to_commit_rule"] == 1.0
    assert "| entropy-bounded (registered strategy, defaults) |" in (tmp_path / "docs/benchmarks/report.md").read_text()
