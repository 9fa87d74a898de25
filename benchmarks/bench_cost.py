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
import functools
import json
import platform
import statistics
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_failfast import ar_decode, cut
from benchmarks.report import workload_tasks
from dloom import DiffusionDecoder, load_model
from dloom.ar.target import ARTarget
from dloom.evaluation import select_examples
from dloom.model.cost import CostCurve
from dloom_plugins.failfast import FailFast, FailFastDecoder
from dloom_plugins.spiffy import Spiffy
from dloom_plugins.spiffy.budget import (
    choose_budget,
    expected_accepted,
    speedups,
    steps_per_block,
)
from dloom_plugins.spiffy.calibrate import calibrate

CALIBRATION_PROMPTS = 75


def build(model, strategy: str, params: dict[str, Any]) -> DiffusionDecoder:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiffusionDecoder(model, strategy, params=params)


def timed_pass(decoder: DiffusionDecoder, prompts: list[str]) -> tuple[float, list[list[int]], int]:
    """Wall seconds of decoding ``prompts`` one at a time, the tokens and the NFE."""
    tokens, nfe, seconds = [], 0, 0.0
    for prompt in prompts:
        started = time.perf_counter()
        result = decoder.generate([prompt])
        seconds += time.perf_counter() - started
        tokens += result.token_lists
        nfe += int(result.nfe.sum())
    return seconds, tokens, nfe


def measure(decoders: dict[str, DiffusionDecoder], prompts: list[str], repeats: int) -> dict[str, Any]:
    """Each decoder's median wall time over ``repeats`` interleaved passes (after one untimed
    warm-up prompt each), its tokens, NFE and Spiffy's chosen budget."""
    for decoder in decoders.values():
        decoder.generate(prompts[:1])
    passes: dict[str, list[float]] = {name: [] for name in decoders}
    found: dict[str, Any] = {}
    for _ in range(repeats):
        for name, decoder in decoders.items():
            seconds, tokens, nfe = timed_pass(decoder, prompts)
            passes[name].append(seconds)
            found[name] = {"tokens": tokens, "nfe": nfe}
    for name, decoder in decoders.items():
        plugin = next((p for p in decoder.pm.get_plugins() if isinstance(p, Spiffy)), None)
        found[name].update(seconds=statistics.median(passes[name]), best=min(passes[name]), passes=passes[name],
                           budget=None if plugin is None else plugin.chosen_budget,
                           choice=None if plugin is None else plugin.choice)
    return found


def failfast_rows(target_name: str, drafter, prompts: list[str], max_new_tokens: int, repeats: int) -> dict[str, Any]:
    """AR decoding of ``target_name`` against FailFast drafting always and ``drafting=auto``
    (one untimed warm-up prompt each: ``auto`` decides within it and keeps its decision), with
    the paths the decoders' batches took (``result.drafting``). Each prompt is decoded by the
    three back to back, in an order that rotates, so that a machine's changing load falls on
    them alike; a pass sums each one's prompts."""
    target = load_model(target_name)
    ids = target.encode(prompts)
    ar_target = ARTarget(target)
    eos = tuple(target.eos_token_ids)
    decoders = {mode: FailFastDecoder(target, drafter, params={"drafting": mode}, max_new_tokens=max_new_tokens)
                for mode in ("always", "auto")}
    paths: dict[str, Counter[str]] = {f"failfast {mode}": Counter() for mode in decoders}

    def failfast(prompt: list[int], mode: str) -> list[int]:
        result = decoders[mode].generate([prompt])
        paths[f"failfast {mode}"][result.drafting["path"]] += 1
        return result.token_lists[0]

    methods: dict[str, Callable[[list[int]], list[int]]] = {
        "ar": lambda prompt: ar_decode(ar_target, prompt, max_new_tokens),
        **{f"failfast {mode}": functools.partial(failfast, mode=mode) for mode in decoders},
    }
    found: dict[str, Any] = {name: {"passes": []} for name in methods}
    for method in methods.values():
        method(list(ids[0]))
    names = list(methods)
    for repeat in range(repeats):  # interleaved per prompt, the order rotating: drifting load hits all alike
        seconds = dict.fromkeys(names, 0.0)
        outputs: dict[str, list[list[int]]] = {name: [] for name in names}
        for index, prompt in enumerate(ids):
            shift = (repeat + index) % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                outputs[name].append(cut(methods[name](list(prompt)), eos))
                seconds[name] += time.perf_counter() - started
        for name in names:
            found[name]["outputs"] = outputs[name]
            found[name]["passes"].append(seconds[name])
    for row in found.values():
        row["seconds"], row["best"] = statistics.median(row["passes"]), min(row["passes"])
    base = found["ar"]
    plugin = next(p for p in decoders["auto"].pm.get_plugins() if isinstance(p, FailFast))
    return {
        "target": target_name, "decision": plugin.ledger.report if plugin.ledger else None,
        "rows": {name: {"seconds": row["seconds"], "passes": row["passes"], "wall_vs_ar": base["seconds"] / row["seconds"],
                        "best_vs_ar": base["best"] / row["best"], "paths": dict(paths.get(name, {})),
                        "identical": row["outputs"] == base["outputs"]} for name, row in found.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="long-dllm-words")
    parser.add_argument("--graph", default=None, help="a graph file for threshold(tau) (default: calibrate one "
                        f"on {CALIBRATION_PROMPTS} training prompts; '' = the built-in one)")
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--budget", type=int, default=10, help="the fixed budget compared with auto")
    parser.add_argument("-n", type=int, default=20, help="held-out prompts")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed passes (median)")
    parser.add_argument("--target", default=None, help="also FailFast: this AR target, the model drafting")
    parser.add_argument("--failfast-only", action="store_true", help="only the FailFast rows (needs --target)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.failfast_only and args.target is None:
        parser.error("--failfast-only needs --target")
    torch.set_num_threads(1)
    model = load_model(args.model)
    tasks = workload_tasks(model)
    prompts = [e.prompt for e in select_examples(tasks, args.n, 0)]
    summary = {"model": args.model, "n": args.n, "threads": 1, "repeats": args.repeats,
               "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__}
    if not args.failfast_only:
        summary.update(spiffy_rows(args, model, tasks, prompts))
    if args.target is not None:
        summary["failfast"] = failfast_rows(args.target, model, prompts, DiffusionDecoder(model, "quota").gen_length,
                                            args.repeats)
        print("\n| run | wall s (median) | vs AR (median) | vs AR (best pass) | identical |\n|---|---|---|---|---|")
        for name, row in summary["failfast"]["rows"].items():
            print(f"| {name} | {row['seconds']:.2f} | {row['wall_vs_ar']:.2f}x | {row['best_vs_ar']:.2f}x | "
                  f"{row['identical']} |")
        print(summary["failfast"]["decision"])
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def spiffy_rows(args: argparse.Namespace, model, tasks: str, prompts: list[str]) -> dict[str, Any]:
    """The rule, Spiffy at ``budget=auto``, at ``--budget`` and at the flat curve's budget,
    printed as a table."""
    if args.graph is None:  # calibrated here: the file records A(D) on its calibration paths
        rule_decoder = DiffusionDecoder(model, "threshold", params={"tau": args.tau})
        training = [e.prompt for e in select_examples(tasks, CALIBRATION_PROMPTS, 0, split="train")]
        graph_file = Path(tempfile.mkdtemp()) / "graph.json"
        calibrate(rule_decoder, training, budget=args.budget,
                  description={"tasks": tasks, "split": "train", "seed": 0}).save(graph_file)
        args.graph = str(graph_file)
    rule = {"tau": args.tau}
    spiffy = {**rule, "graph": args.graph}
    decoders = {
        "rule": build(model, "threshold", rule),
        "auto": build(model, "spiffy+threshold", {**spiffy, "budget": "auto"}),
        "fixed": build(model, "spiffy+threshold", {**spiffy, "budget": args.budget}),
    }
    graph = next(p for p in decoders["auto"].pm.get_plugins() if isinstance(p, Spiffy)).graph
    accepted = expected_accepted(graph)
    steps = steps_per_block(graph)
    flat_budget = choose_budget(accepted, CostCurve.flat(), steps)
    if flat_budget != args.budget:
        decoders["flat"] = build(model, "spiffy+threshold", {**spiffy, "budget": flat_budget})
    rows = measure(decoders, prompts, args.repeats)
    rows.setdefault("flat", rows["fixed"])
    choice = rows["auto"]["choice"]
    base = rows["rule"]
    summary = {
        "tau": args.tau,
        "graph": args.graph if not args.graph.startswith(tempfile.gettempdir()) else
        f"calibrated on {CALIBRATION_PROMPTS} training prompts", "calibration": dict(graph.calibration),
        "curve": choice["curve"], "accepted": accepted, "expected_speedups": choice["speedups"],
        "auto_budget": rows["auto"]["budget"], "flat_budget": flat_budget,
        "steps_per_block": steps, "flat_expected_speedups": speedups(accepted, CostCurve.flat(), steps),
        "rows": {
            name: {
                "budget": row["budget"], "seconds": row["seconds"], "passes": row["passes"], "nfe": row["nfe"],
                "wall_vs_rule": base["seconds"] / row["seconds"], "best_vs_rule": base["best"] / row["best"],
                "nfe_vs_rule": base["nfe"] / row["nfe"],
                "identical": row["tokens"] == base["tokens"],
            }
            for name, row in rows.items()
        },
    }
    print("| run | D | wall s (median) | vs rule (median) | vs rule (best pass) | NFE | fewer NFE | identical |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, row in summary["rows"].items():
        print(f"| {name} | {row['budget'] if row['budget'] is not None else '-'} | {row['seconds']:.2f} | "
              f"{row['wall_vs_rule']:.2f}x | {row['best_vs_rule']:.2f}x | {row['nfe']} | {row['nfe_vs_rule']:.2f}x | "
              f"{row['identical']} |")
    return summary


if __name__ == "__main__":
    main()
