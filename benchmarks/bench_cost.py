"""Spiffy's budget chosen from the measured forward cost, in wall time (issue 54).

::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_cost -n 20
    python -m benchmarks.bench_cost --model toy-dllm --graph "" --tau 0.9 -n 10 --out /tmp/cost.json

On ``-n`` held-out prompts of the model's workload, one prompt per batch, one thread: the
threshold rule alone, Spiffy over it at ``budget=auto`` (the chooser of
:mod:`dloom_plugins.spiffy.budget` under this machine's measured cost curve,
:func:`dloom.model.cost.measure_cost_curve`) and at a fixed ``--budget``: wall time, NFE and
whether the outputs are the rule's. Then the same chooser under a flat synthetic curve (a
GPU-like forward): the budget it picks and the NFE Spiffy saves at it, measured. Writes
``--out`` (JSON) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import workload_tasks
from dloom import DiffusionDecoder, load_model
from dloom.evaluation import select_examples
from dloom.model.cost import CostCurve
from dloom_plugins.spiffy import Spiffy
from dloom_plugins.spiffy.budget import choose_budget, expected_accepted, speedups

GRAPH = "benchmarks/results/graphs/long-dllm-words/threshold@0.9__paths500.json"


def run(model, strategy: str, params: dict[str, Any], prompts: list[str]) -> dict[str, Any]:
    """Decode ``prompts`` one at a time after one untimed warm-up prompt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder = DiffusionDecoder(model, strategy, params=params)
    plugin = next((p for p in decoder.pm.get_plugins() if isinstance(p, Spiffy)), None)
    decoder.generate(prompts[:1])
    tokens, nfe, seconds = [], 0, 0.0
    for prompt in prompts:
        started = time.perf_counter()
        result = decoder.generate([prompt])
        seconds += time.perf_counter() - started
        tokens += result.token_lists
        nfe += int(result.nfe.sum())
    return {
        "strategy": strategy, "params": params, "seconds": seconds, "nfe": nfe, "tokens": tokens,
        "budget": None if plugin is None else plugin.chosen_budget,
        "choice": None if plugin is None else plugin.choice,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="long-dllm-words")
    parser.add_argument("--graph", default=GRAPH, help="a graph for threshold(tau) ('' = built-in)")
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--budget", type=int, default=10, help="the fixed budget compared with auto")
    parser.add_argument("-n", type=int, default=20, help="held-out prompts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(args.model)
    prompts = [e.prompt for e in select_examples(workload_tasks(model), args.n, 0)]
    rule = {"tau": args.tau}
    spiffy = {**rule, "graph": args.graph}
    rows = {
        "rule": run(model, "threshold", rule, prompts),
        "auto": run(model, "spiffy+threshold", {**spiffy, "budget": "auto"}, prompts),
        "fixed": run(model, "spiffy+threshold", {**spiffy, "budget": args.budget}, prompts),
    }
    choice = rows["auto"]["choice"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = next(p for p in DiffusionDecoder(model, "spiffy+threshold", params={**spiffy, "budget": 1})
                     .pm.get_plugins() if isinstance(p, Spiffy)).graph
    accepted = expected_accepted(graph)
    flat_budget = choose_budget(accepted, CostCurve.flat())
    rows["flat"] = (rows["fixed"] if flat_budget == args.budget
                    else run(model, "spiffy+threshold", {**spiffy, "budget": flat_budget}, prompts))
    base = rows["rule"]
    summary = {
        "model": args.model, "n": args.n, "tau": args.tau, "graph": args.graph, "threads": 1,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
        "curve": choice["curve"], "accepted": accepted, "expected_speedups": choice["speedups"],
        "auto_budget": rows["auto"]["budget"], "flat_budget": flat_budget,
        "flat_expected_speedups": speedups(accepted, CostCurve.flat()),
        "rows": {
            name: {
                "budget": row["budget"], "seconds": row["seconds"], "nfe": row["nfe"],
                "wall_vs_rule": base["seconds"] / row["seconds"], "nfe_vs_rule": base["nfe"] / row["nfe"],
                "identical": row["tokens"] == base["tokens"],
            }
            for name, row in rows.items()
        },
    }
    print("| run | D | wall s | wall vs rule | NFE | fewer NFE | identical |\n|---|---|---|---|---|---|---|")
    for name, row in summary["rows"].items():
        print(f"| {name} | {row['budget'] if row['budget'] is not None else '-'} | {row['seconds']:.2f} | "
              f"{row['wall_vs_rule']:.2f}x | {row['nfe']} | {row['nfe_vs_rule']:.2f}x | {row['identical']} |")
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
