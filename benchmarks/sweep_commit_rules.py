"""Accuracy versus NFE of the commit rules on the toy zoo, measured in one run.

Sweeps threshold τ, factor f and Fréchet δ against the one-token-per-step baseline
(``quota``) on held-out task prompts, writes the JSON report, an accuracy-versus-NFE plot and
a Markdown table that compares the rules at matched accuracy (within one point of threshold
0.9)::

    python -m benchmarks.sweep_commit_rules --model toy-dllm -n 500 \\
        --json benchmarks/results/commit_rules_n500.json \\
        --plot docs/assets/commit_rules.png --table docs/benchmarks/commit_rules.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dloom import DiffusionDecoder, load_model
from dloom.evaluation import evaluate, select_examples

SWEEP: dict[str, tuple[str, list[float]]] = {
    "threshold": ("tau", [0.5, 0.6, 0.7, 0.8, 0.9, 0.95]),
    "factor": ("f", [0.1, 0.3, 0.5, 0.7, 0.9, 1.0, 1.5, 2.0]),
    "frechet": ("delta", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]),
}
MATCH_POINTS = 0.01  # "matched accuracy": within one point of threshold 0.9


def run_sweep(model_name: str, n: int, batch_size: int, seed: int) -> dict[str, Any]:
    """Evaluate the baseline and every swept configuration on the same examples."""
    model = load_model(model_name)
    examples = select_examples("all", n, seed)
    rows = []
    configs = [("quota", None, None)] + [
        (strategy, name, value) for strategy, (name, values) in SWEEP.items() for value in values
    ]
    warm_up = DiffusionDecoder(model, "quota", seed=seed)
    evaluate(warm_up, examples[:batch_size], batch_size=batch_size)
    for strategy, name, value in configs:
        params = {} if name is None else {name: value}
        decoder = DiffusionDecoder(model, strategy, params=params, seed=seed)
        report = evaluate(decoder, examples, batch_size=batch_size)
        rows.append({
            "strategy": strategy, "param": name, "value": value,
            "accuracy": report.accuracy, "per_task": report.per_task,
            "nfe_mean": report.nfe_mean, "tpf": report.tpf, "tps": report.tps,
            "hook_share": report.hook_share,
        })
        label = strategy if name is None else f"{strategy} {name}={value}"
        print(f"{label:22s} acc {report.accuracy:6.1%}  NFE {report.nfe_mean:6.2f}  "
              f"TPF {report.tpf:5.2f}  TPS {report.tps:7.1f}", file=sys.stderr)
    return {
        "model": model_name, "n": n, "seed": seed, "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(), "rows": rows,
        "matched": matched_accuracy(rows),
    }


def _best_matched(rows: list[dict], strategy: str, floor: float) -> dict | None:
    """The configuration of ``strategy`` with the fewest forwards at accuracy >= ``floor``."""
    eligible = [r for r in rows if r["strategy"] == strategy and r["accuracy"] >= floor - 1e-12]
    return min(eligible, key=lambda r: r["nfe_mean"]) if eligible else None


def matched_accuracy(rows: list[dict]) -> dict[str, Any]:
    """Fréchet against threshold 0.9 and against the factor rule at matched accuracy."""
    reference = next(r for r in rows if r["strategy"] == "threshold" and r["value"] == 0.9)
    floor = reference["accuracy"] - MATCH_POINTS
    frechet = _best_matched(rows, "frechet", floor)
    factor = _best_matched(rows, "factor", floor)
    result: dict[str, Any] = {"accuracy_floor": floor, "threshold_0.9": reference,
                              "frechet": frechet, "factor": factor}
    for name, other in (("vs_threshold_0.9", reference), ("vs_factor", factor)):
        if frechet is not None and other is not None:
            result[name] = {
                "nfe_reduction": 1 - frechet["nfe_mean"] / other["nfe_mean"],
                "tps_ratio": frechet["tps"] / other["tps"],
            }
    return result


def write_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for strategy, marker in (("threshold", "o"), ("factor", "s"), ("frechet", "^")):
        rows = sorted((r for r in report["rows"] if r["strategy"] == strategy), key=lambda r: r["nfe_mean"])
        ax.plot([r["nfe_mean"] for r in rows], [100 * r["accuracy"] for r in rows], marker=marker, label=strategy)
    base = report["rows"][0]
    ax.scatter([base["nfe_mean"]], [100 * base["accuracy"]], color="black", zorder=3, label="one token per step")
    ax.set_xlabel("forwards per prompt (NFE)")
    ax.set_ylabel("exact match (%)")
    ax.set_title(f"{report['model']}: accuracy vs NFE, {report['n']} held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


TABLE_START = "Measured by `benchmarks/sweep_commit_rules.py`"


def write_table(report: dict[str, Any], path: Path) -> None:
    """Write the results table to ``path``, keeping what the page has above the table.

    The generated part starts at the line beginning with :data:`TABLE_START`; everything
    before it (the page's title, plot and prose) is kept as it is.
    """
    lines = [
        f"{TABLE_START} on `{report['model']}`, "
        f"{report['n']} held-out prompts, batch {report['batch_size']}, "
        f"{report['torch_threads']} CPU threads.",
        "",
        "| rule | parameter | accuracy | NFE | TPF | TPS |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        param = "-" if r["param"] is None else f"{r['param']} = {r['value']}"
        lines.append(f"| {r['strategy']} | {param} | {r['accuracy']:.1%} | {r['nfe_mean']:.2f} "
                     f"| {r['tpf']:.2f} | {r['tps']:.0f} |")
    m = report["matched"]
    lines += ["", f"At matched accuracy (≥ {m['accuracy_floor']:.1%}, threshold 0.9 minus one point):", ""]
    for name, label in (("vs_threshold_0.9", "threshold τ = 0.9"), ("vs_factor", "the best matched factor rule")):
        if name in m:
            f, g = m["frechet"], m[name]
            lines.append(f"- Fréchet δ = {f['value']} against {label}: "
                         f"NFE {-g['nfe_reduction']:+.1%}, TPS ratio {g['tps_ratio']:.2f}.")
        else:
            lines.append(f"- Fréchet against {label}: no configuration reached the accuracy floor.")
    head = ""
    if path.is_file():
        text = path.read_text()
        head = text[: text.index(TABLE_START)] if TABLE_START in text else text.rstrip("\n") + "\n\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy-dllm")
    parser.add_argument("-n", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None)
    args = parser.parse_args(argv)
    report = run_sweep(args.model, args.n, args.batch_size, args.seed)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
    if args.table:
        write_table(report, args.table)
    print(json.dumps(report["matched"], indent=2, default=str))


if __name__ == "__main__":
    main()
