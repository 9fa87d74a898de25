"""The benchmark report: one run that measures every strategy and rewrites the docs' figures.

::

    python benchmarks/report.py -n 140            # the published report
    python benchmarks/report.py -n 140 --micro    # plus the pytest-benchmark suite

In one process it decodes the same held-out task prompts of the toy zoo with every
configuration in :data:`CONFIGS` (the one-token-per-step baseline first), grades them with
:func:`dloom.evaluation.evaluate`, and records accuracy, NFE, tokens per forward (TPF),
tokens per second (TPS), hook time shares, Spiffy's acceptance (drafts accepted per
row-verification, as a histogram) and the ratios against the baseline of the same run; and the
distance to the limit: the oracle NFE of the same prompts (:mod:`dloom.oracle`), each
configuration's NFE ÷ oracle, NFE per answer token, padding share (generated positions after
the first EOS) and, for Spiffy, the most it could save over its commit rule alone.
Then it writes, all from that one run (``DOCS`` is ``--docs``, default ``docs/``):

* ``--out`` (default ``benchmarks/results/report.json``): every figure, machine-readable;
* ``DOCS/benchmarks/report.md``: the generated tables (never edit it by hand);
* ``DOCS/assets/report-accuracy-nfe.png``, ``report-speedup.png``, ``report-acceptance.png``;
* the headline table between ``<!-- report:headline:start -->`` and
  ``<!-- report:headline:end -->`` in ``--readme`` and ``DOCS/index.md``;
* with ``--micro``: the pytest-benchmark suite ``benchmarks/test_bench_strategies.py``, its
  JSON at ``--micro-json`` (default ``benchmarks/results/pytest-benchmark.json``) and its
  table in the report page.

Every ratio compares two configurations measured in this run on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import matplotlib
import matplotlib.ticker
import torch

from dloom import DiffusionDecoder, hookimpl, load_model
from dloom.evaluation import evaluate, select_examples
from dloom.oracle import oracle_nfe
from dloom.registry import get_registry

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ("forward", "select_commit", "draft", "prune", "build_mask", "verify")
PLOTS = {
    "accuracy_nfe": "report-accuracy-nfe.png",
    "speedup": "report-speedup.png",
    "acceptance": "report-acceptance.png",
}
MARKER = "<!-- report:{name}:{end} -->"


@dataclass(frozen=True)
class Config:
    """One measured configuration.

    :ivar name: short identifier (JSON key and plot label).
    :ivar label: how the tables name it.
    :ivar strategy: a registered strategy or composition.
    :ivar params: strategy parameters.
    :ivar cache: KV cache mode.
    :ivar headline: whether it appears in the README's headline table.
    """

    name: str
    label: str
    strategy: str
    params: dict[str, Any] = field(default_factory=dict)
    cache: str = "none"
    headline: bool = False


BASELINE = Config("quota", "quota, one token per step (baseline)", "quota", headline=True)
CONFIGS: tuple[Config, ...] = (
    BASELINE,
    Config("threshold", "threshold τ = 0.9", "threshold", {"tau": 0.9}, headline=True),
    Config("factor", "factor f = 1", "factor", {"f": 1.0}, headline=True),
    Config("frechet", "Fréchet δ = 0", "frechet", {"delta": 0.0}, headline=True),
    Config("spiffy+quota", "Spiffy over quota", "spiffy+quota", headline=True),
    Config("spiffy+threshold", "Spiffy over threshold τ = 0.9", "spiffy+threshold", {"tau": 0.9},
           headline=True),
    Config("spiffy+frechet", "Spiffy over Fréchet δ = 0", "spiffy+frechet", {"delta": 0.0}),
    Config("threshold/dual", "threshold τ = 0.9, dual cache", "threshold", {"tau": 0.9}, cache="dual"),
    Config("frechet/dual", "Fréchet δ = 0, dual cache", "frechet", {"delta": 0.0}, cache="dual"),
    Config(
        "spiffy+frechet/dual", "Spiffy (packed) over Fréchet δ = 0, dual cache", "spiffy+frechet",
        {"delta": 0.0, "layout": "packed"}, cache="dual", headline=True,
    ),
)


class AcceptanceRecorder:
    """A ``dloom_verify`` wrapper keeping the drafts each row-verification accepted.

    Registered on a decoder's plugin manager next to its timing wrapper; it holds the
    device tensors and reads them once at the end, adding no host synchronisation per step.
    """

    def __init__(self) -> None:
        self._steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    @hookimpl(wrapper=True)
    def dloom_verify(self, state):
        verdict = yield
        self._steps.append((verdict.accepted, state.active))
        return verdict

    def histogram(self) -> list[int]:
        """``counts[k]``: row-verifications (rows still decoding) that accepted ``k`` drafts."""
        if not self._steps:
            return []
        accepted = torch.cat([a[active] for a, active in self._steps]).long().cpu()
        return torch.bincount(accepted).tolist()


class BlockFloor:
    """A ``dloom_select_commit`` wrapper counting, per row, the steps that are among the first
    two of their block: ``sum over blocks of min(steps, 2)``, the fewest forwards a
    speculative strategy over this commit rule could take (a block's first forward is plain;
    at best one verification then completes the block). Device tensors, read once."""

    def __init__(self) -> None:
        self._steps: list[torch.Tensor] = []

    @hookimpl(wrapper=True)
    def dloom_select_commit(self, confidence, selectable, schedule):
        commit = yield
        self._steps.append((selectable.any(-1) & (schedule.step_in_block < 2)).sum())
        return commit

    def total(self) -> int:
        return int(torch.stack(self._steps).sum()) if self._steps else 0


def measure(model, config: Config, examples, batch_size: int) -> dict[str, Any]:
    """Decode and grade ``examples`` with ``config``; the row of the report (with texts)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = DiffusionDecoder(model, config.strategy, params=config.params, cache=config.cache)
    recorder, floor = AcceptanceRecorder(), BlockFloor()
    decoder.pm.register(recorder)
    speculative = decoder.composition.provider("dloom_draft") is not None
    if not speculative:
        decoder.pm.register(floor)
    report = evaluate(decoder, examples, batch_size=batch_size, progress=False)
    claim = get_registry().get(decoder.composition.provider("dloom_select_commit")).claim
    return {
        "name": config.name,
        "label": config.label,
        "strategy": decoder.composition.name,
        "params": decoder.composition.params(),
        "cache": config.cache,
        "commit_rule": decoder.composition.provider("dloom_select_commit"),
        "guarantee": report.speculation["guarantee"] if report.speculation else claim.kind,
        "headline": config.headline,
        "accuracy": report.accuracy,
        "nfe_mean": report.nfe_mean,
        "tpf": report.tpf,
        "tps": report.tps,
        "hook_share": {hook: report.hook_share.get(hook, 0.0) for hook in HOOKS},
        "speculation": report.speculation,
        "acceptance_histogram": recorder.histogram(),
        "nfe_per_answer_token": 1 / report.tpf if report.tpf else None,
        "padding_share": 1 - report.tpf * report.nfe_mean / decoder.gen_length,
        "spiffy_floor_nfe_mean": None if speculative else floor.total() / len(examples),
        "warnings": [str(w.message) for w in caught],
        "texts": [o["text"] for o in report.outputs],
        "nfe": [o["nfe"] for o in report.outputs],
    }


def measure_oracle(model, examples) -> dict[str, Any]:
    """The oracle NFE of ``examples`` under the baseline's lengths (:func:`dloom.oracle.oracle_nfe`)."""
    result = oracle_nfe(DiffusionDecoder(model, BASELINE.strategy), [e.prompt for e in examples])
    reached = result.nfe[result.reached]
    return {
        "nfe": result.nfe.tolist(),
        "reached": result.reached.tolist(),
        "nfe_mean": float(reached.float().mean()) if len(reached) else None,
        "reached_share": float(result.reached.float().mean()),
    }


def compare(rows: list[dict[str, Any]], oracle: dict[str, Any]) -> None:
    """Add ratios against the baseline (the first row) and the oracle, and output agreement,
    in place.

    ``nfe_over_oracle`` compares NFE on the prompts where the oracle reproduced the greedy
    output; ``spiffy_max_saving`` is a speculative row's commit rule alone (same parameters
    and cache) in NFE over the fewest forwards speculation over it could take.

    ``identical_to_commit_rule`` compares a speculative configuration with its commit rule
    run alone under the same parameters and cache (``None`` when not measured or not
    speculative); the texts are dropped afterwards.
    """
    base = rows[0]

    def same(a, b) -> float:
        return sum(x == y for x, y in zip(a["texts"], b["texts"])) / len(a["texts"])

    def alone(row) -> dict[str, Any] | None:
        rule = row["commit_rule"]
        return next((r for r in rows if r["speculation"] is None and r["strategy"] == rule
                     and r["params"] == {rule: row["params"][rule]} and r["cache"] == row["cache"]),
                    None)

    for row in rows:
        row["nfe_ratio"] = base["nfe_mean"] / row["nfe_mean"] if row["nfe_mean"] else 0.0
        row["tps_ratio"] = row["tps"] / base["tps"] if base["tps"] else 0.0
        row["identical_to_baseline"] = same(row, base)
        reference = alone(row) if row["speculation"] else None
        row["identical_to_commit_rule"] = same(row, reference) if reference else None
        kept = [nfe for nfe, reached in zip(row["nfe"], oracle["reached"]) if reached]
        row["nfe_over_oracle"] = (
            sum(kept) / len(kept) / oracle["nfe_mean"] if oracle["nfe_mean"] else None
        )
        floor = reference["spiffy_floor_nfe_mean"] if reference else None
        row["spiffy_max_saving"] = reference["nfe_mean"] / floor if floor else None
    for row in rows:
        row.pop("texts")
        row.pop("nfe")


def run(
    model_name: str, n: int, batch_size: int, configs: Sequence[Config], command: str
) -> dict[str, Any]:
    """Measure ``configs`` on the same ``n`` held-out prompts; the report's JSON object
    (``command`` is recorded as the way to reproduce it)."""
    started = time.perf_counter()
    model = load_model(model_name)
    examples = select_examples("all", n)
    # Warm up (lazy initialisation, allocator) so that the first configuration's TPS is fair.
    DiffusionDecoder(model, BASELINE.strategy).generate([e.prompt for e in examples[:2]])
    rows = []
    for config in configs:
        rows.append(measure(model, config, examples, batch_size))
        row = rows[-1]
        print(f"{config.name:22s} acc {row['accuracy']:6.1%}  NFE {row['nfe_mean']:6.2f}  "
              f"TPF {row['tpf']:5.2f}  TPS {row['tps']:7.1f}", file=sys.stderr, flush=True)
    oracle = measure_oracle(model, examples)
    print(f"{'oracle':22s} NFE {oracle['nfe_mean']:6.2f}  reached {oracle['reached_share']:6.1%}",
          file=sys.stderr, flush=True)
    compare(rows, oracle)
    sample = DiffusionDecoder(model, BASELINE.strategy).config
    return {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "model": model_name,
        "n": n,
        "batch_size": batch_size,
        "gen_length": sample["gen_length"],
        "block_length": sample["block_length"],
        "temperature": sample["temperature"],
        "dtype": sample["dtype"],
        "device": sample["device"],
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "baseline": BASELINE.name,
        "oracle": {key: oracle[key] for key in ("nfe_mean", "reached_share")},
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }


# --- tables ----------------------------------------------------------------------------


def percent(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def blocks(report: dict[str, Any]) -> str:
    gen, block = report["gen_length"], report["block_length"]
    return f"one block of {gen}" if gen == block else f"{gen} positions in blocks of {block}"


def guarantee(row: dict[str, Any]) -> str:
    """The row's guarantee, naming what a speculative configuration is lossless against."""
    return f"{row['guarantee']} against {row['commit_rule']}" if row["speculation"] else row["guarantee"]


def headline_table(report: dict[str, Any]) -> str:
    """The headline: accuracy, forwards and speed of each headline configuration."""
    lines = [
        f"Measured by `{report['command']}` on `{report['model']}` ({report['n']} held-out "
        f"prompts, greedy, {blocks(report)}, {report['dtype']}, {report['device']}, "
        f"{report['torch_threads']} thread(s), {report['date']}). Ratios are against the "
        "baseline of the same run.",
        "",
        "| strategy | guarantee | accuracy | NFE / prompt | fewer NFE | tokens / forward "
        "| TPS speed-up | outputs = baseline | outputs = its rule alone |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        if row["headline"]:
            lines.append(
                f"| {row['label']} | {guarantee(row)} | {row['accuracy']:.0%} | "
                f"{row['nfe_mean']:.2f} | {row['nfe_ratio']:.1f}× | {row['tpf']:.2f} | "
                f"{row['tps_ratio']:.2f}× | {percent(row['identical_to_baseline'])} | "
                f"{percent(row['identical_to_commit_rule'])} |"
            )
    return "\n".join(lines)


def detail_tables(report: dict[str, Any]) -> str:
    """Every configuration's figures, hook shares and acceptance."""
    out = [
        "## Every configuration",
        "",
        "| configuration | strategy | cache | accuracy | NFE | TPF | TPS | fewer NFE | TPS speed-up | = baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        out.append(
            f"| {row['label']} | `{row['strategy']}` | {row['cache']} | {row['accuracy']:.1%} | "
            f"{row['nfe_mean']:.2f} | {row['tpf']:.2f} | {row['tps']:.0f} | {row['nfe_ratio']:.2f}× | "
            f"{row['tps_ratio']:.2f}× | {percent(row['identical_to_baseline'])} |"
        )
    out += ["", "## Where the time goes", "",
            "Share of the wall time spent in the model's forward and in each hook.", "",
            "| configuration | " + " | ".join(HOOKS) + " |", "|---|" + "---|" * len(HOOKS)]
    for row in report["rows"]:
        out.append(f"| {row['label']} | " + " | ".join(f"{row['hook_share'][h]:.1%}" for h in HOOKS) + " |")
    out += ["", oracle_table(report)]
    speculative = [r for r in report["rows"] if r["speculation"]]
    if speculative:
        out += ["", "## Speculation", "",
                "Drafts accepted per row-verification (each accepted draft saves one forward), "
                "and the share of outputs equal to the commit rule run alone.", "",
                "| configuration | guarantee | verifications | accepted drafts | per verification "
                "| = its rule alone |",
                "|---|---|---|---|---|---|"]
        for row in speculative:
            s = row["speculation"]
            out.append(
                f"| {row['label']} | {s['guarantee']} | {s['verifications']} | {s['accepted_drafts']} | "
                f"{s['accepted_per_verification']:.2f} | {percent(row['identical_to_commit_rule'])} |"
            )
    return "\n".join(out)


def ratio(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}×"


def oracle_table(report: dict[str, Any]) -> str:
    """Distance to the limit: each configuration against the oracle NFE of the same prompts."""
    oracle = report["oracle"]
    out = [
        "## Distance to the limit", "",
        f"The oracle commits, at every forward, each masked position whose argmax is already "
        f"the final greedy token (the engine's own layout, `dloom.oracle`): "
        f"**{oracle['nfe_mean']:.2f} forwards per prompt**, on the "
        f"{oracle['reached_share']:.0%} of prompts where it reproduces the greedy output (the "
        "others meet a dead end). *Spiffy could save at most* is the commit rule alone in NFE "
        "over the sum, over its blocks, of min(steps, 2): a block's first forward is plain and "
        "at best one verification completes it.", "",
        "| configuration | NFE | NFE ÷ oracle | NFE / answer token | padding share "
        "| Spiffy could save at most | Spiffy saves |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        out.append(
            f"| {row['label']} | {row['nfe_mean']:.2f} | {ratio(row['nfe_over_oracle'])} | "
            f"{row['nfe_per_answer_token']:.3f} | {row['padding_share']:.0%} | "
            f"{ratio(row['spiffy_max_saving'])} | {ratio(spiffy_saving(report, row))} |"
        )
    return "\n".join(out)


def spiffy_saving(report: dict[str, Any], row: dict[str, Any]) -> float | None:
    """A speculative row's measured saving over its commit rule alone (same parameters and
    cache), ``None`` for other rows or when that rule was not measured."""
    if not row["speculation"]:
        return None
    rule = row["commit_rule"]
    alone = next((r for r in report["rows"] if r["speculation"] is None and r["strategy"] == rule
                  and r["params"] == {rule: row["params"][rule]} and r["cache"] == row["cache"]), None)
    return alone["nfe_mean"] / row["nfe_mean"] if alone else None


def micro_table(path: Path) -> str:
    """The pytest-benchmark results: mean time per hook call or per decoded batch."""
    data = json.loads(path.read_text())
    out = ["## Micro-benchmarks", "",
           f"`python -m pytest benchmarks/test_bench_strategies.py` (pytest-benchmark), "
           f"JSON: `{shown(path)}`.", "",
           "| benchmark | mean | min | rounds | NFE / prompt |", "|---|---|---|---|---|"]
    for bench in data["benchmarks"]:
        stats, nfe = bench["stats"], bench["extra_info"].get("nfe_mean")
        out.append(f"| `{bench['name']}` | {seconds(stats['mean'])} | {seconds(stats['min'])} | "
                   f"{stats['rounds']} | {'' if nfe is None else f'{nfe:.2f}'} |")
    return "\n".join(out)


def seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value / 1e-9:.0f} ns"


def shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


READING = """\
**Reading the tables.** *NFE* is forwards per prompt and *tokens / forward* (TPF) generated
tokens per forward; *fewer NFE* and *TPS speed-up* divide by the baseline's figure. *Outputs
= baseline* is the share of prompts whose output equals quota's one token per step; a
lossless strategy must reach 100 % in *outputs = its rule alone*. A Spiffy verification
forward carries up to `D* + 1` rows per prompt: on a GPU that costs little more than a plain
forward, on a CPU it costs nearly `D* + 1` of them, so there its TPS speed-up trails its NFE
ratio. With a few prompts the accuracies are noisy; the ratios are the point."""


def report_page(report: dict[str, Any], out: Path, micro: Path | None) -> str:
    """The whole generated page."""
    images = "\n\n".join(
        f"![{alt}](../assets/{PLOTS[key]})" for key, alt in (
            ("accuracy_nfe", "accuracy versus NFE"), ("speedup", "speed-up over the baseline"),
            ("acceptance", "drafts accepted per verification"),
        )
    )
    parts = [
        "<!-- Generated by benchmarks/report.py from one run; do not edit by hand. -->",
        "",
        "# Benchmark report",
        "",
        "Generated by `benchmarks/report.py`; every number on this page comes from one run, "
        f"recorded in `{shown(out)}` ({report['machine']}, torch "
        f"{report['torch']}, {report['seconds']} s).",
        "",
        headline_table(report),
        "",
        READING,
        "",
        images,
        "",
        detail_tables(report),
    ]
    if micro is not None:
        parts += ["", micro_table(micro)]
    return "\n".join(parts) + "\n"


def replace_marked(text: str, name: str, body: str) -> str:
    """``text`` with the lines between the ``report:NAME`` markers replaced by ``body``."""
    start, end = MARKER.format(name=name, end="start"), MARKER.format(name=name, end="end")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"markers {start} ... {end} not found")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)


# --- plots -----------------------------------------------------------------------------


GUARANTEE_MARKERS = {
    "reference": "s", "approximate": "^", "bound": "D", "lossless": "o", "near-lossless": "X",
}


def plot_accuracy_nfe(report: dict[str, Any], path: Path) -> None:
    """Accuracy against forwards per prompt; the marker says the guarantee."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in report["rows"]:
        ax.scatter(row["nfe_mean"], 100 * row["accuracy"], s=50, label=f"{row['name']} ({guarantee(row)})",
                   marker=GUARANTEE_MARKERS.get(row["guarantee"], "v"))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_xlabel("forwards per prompt (NFE, log scale)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{report['model']}: accuracy versus NFE ({report['n']} prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup(report: dict[str, Any], path: Path) -> None:
    """Fewer forwards and tokens-per-second speed-up of every configuration over the baseline."""
    rows = report["rows"][1:]
    y = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
    for offset, key, label in ((-0.2, "nfe_ratio", "fewer NFE (×)"), (0.2, "tps_ratio", "TPS speed-up (×)")):
        # bars grow from 1 (no change): right is a gain, left a loss
        ax.barh([i + offset for i in y], [r[key] - 1 for r in rows], left=1, height=0.4, label=label)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"ratio against {report['baseline']} one token per step (log scale)")
    ax.legend(fontsize=8, ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(report: dict[str, Any], path: Path) -> None:
    """Histogram of drafts accepted per row-verification, one bar group per configuration."""
    rows = [r for r in report["rows"] if r["acceptance_histogram"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        counts = row["acceptance_histogram"]
        total = sum(counts)
        ax.bar([k + (i - (len(rows) - 1) / 2) * width for k in range(len(counts))],
               [100 * c / total for c in counts], width=width, label=row["name"])
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("drafts accepted in one row-verification")
    ax.set_ylabel("share of row-verifications (%)")
    ax.set_title("Spiffy: acceptance per verification")
    if rows:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no speculative configuration", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the command -----------------------------------------------------------------------


def run_micro(path: Path) -> None:
    """Run the pytest-benchmark suite, saving its JSON at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "benchmarks" / "test_bench_strategies.py"), "-q",
         "-p", "no:cacheprovider", f"--benchmark-json={path}"],
        cwd=ROOT, check=True,
    )


def write(report: dict[str, Any], out: Path, docs: Path, readme: Path, micro: Path | None) -> list[Path]:
    """Write the page, the plots and the two headline tables; return what was written."""
    assets = docs / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    (docs / "benchmarks").mkdir(parents=True, exist_ok=True)
    plots = {key: assets / name for key, name in PLOTS.items()}
    plot_accuracy_nfe(report, plots["accuracy_nfe"])
    plot_speedup(report, plots["speedup"])
    plot_acceptance(report, plots["acceptance"])
    page = docs / "benchmarks" / "report.md"
    page.write_text(report_page(report, out, micro))
    headline = headline_table(report)
    for target in (readme, docs / "index.md"):
        target.write_text(replace_marked(target.read_text(), "headline", headline))
    return [page, *plots.values(), readme, docs / "index.md"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy-dllm", help="zoo name or checkpoint directory (with a tokenizer)")
    parser.add_argument("-n", type=int, default=140, help="held-out prompts, balanced over the task families")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady CPU timings)")
    parser.add_argument("--configs", default="all", help="comma-separated configuration names "
                        f"(the baseline always runs): {', '.join(c.name for c in CONFIGS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "report.json")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="docs directory to write into")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--micro", action="store_true", help="also run the pytest-benchmark suite")
    parser.add_argument("--micro-json", type=Path,
                        default=ROOT / "benchmarks" / "results" / "pytest-benchmark.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = None if args.configs == "all" else set(args.configs.split(","))
    unknown = (wanted or set()) - {c.name for c in CONFIGS}
    if unknown:
        parser.error(f"unknown configuration {min(unknown)!r}")
    configs = [c for c in CONFIGS if c is BASELINE or wanted is None or c.name in wanted]
    command = " ".join(
        ["python benchmarks/report.py", f"-n {args.n}"]
        + ([f"--model {args.model}"] if args.model != "toy-dllm" else [])
        + ([f"--configs {args.configs}"] if wanted is not None else [])
        + (["--micro"] if args.micro else [])
    )
    report = run(args.model, args.n, args.batch_size, configs, command)
    if args.micro:
        run_micro(args.micro_json)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    written = write(report, args.out, args.docs, args.readme, args.micro_json if args.micro else None)
    for path in [args.out, *written]:
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
