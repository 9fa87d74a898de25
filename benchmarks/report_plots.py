"""The report's plots (matplotlib, files only), read from the report's JSON object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

from benchmarks.report_tables import guarantee

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

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



def plot_calibration(report: dict[str, Any], path: Path) -> None:
    """Spiffy's NFE ratio over its rule alone against the calibration paths of its graph."""
    curve = report["calibration"]["curve"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for rule in dict.fromkeys(point["rule"] for point in curve):
        points = [p for p in curve if p["rule"] == rule]
        ax.plot([p["paths"] for p in points], [p["nfe_ratio"] for p in points], marker="o", label=rule)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("calibration paths of the draft graph (log scale)")
    ax.set_ylabel("rule NFE ÷ Spiffy NFE")
    ax.set_title(f"{report['model']}: Spiffy against calibration size ({report['n']} prompts, "
                 f"cache {report['calibration'].get('curve_cache', 'none')})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
