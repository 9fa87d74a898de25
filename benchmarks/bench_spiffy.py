"""Spiffy on a zoo model: NFE and TPS against the same base rule alone, in one run.

On ``toy-dllm`` by default; ``--model long-dllm --block-length 32`` measures the long-answer
workload (the task suite follows the model's tokenizer unless ``--tasks`` names one).

For each base rule (quota one token per step, threshold 0.9, Fréchet), calibrate draft
graphs of ``D`` nodes on training prompts, then decode held-out prompts with the base alone
and with Spiffy over it (every ``D``, and ``D = max`` pruned to a few ``D*``), each with a
block's first forward drafted and not (``first_forward``), and the pruned ones also with the
old confidence-only pruning score (``prune=confidence``; the default ranks drafts by the
probability that the commit rule takes them). The full
stack (threshold or Fréchet + dual cache + Spiffy, packed layout, exact under the dual
cache) is compared with quota one token per step, no cache. Every Spiffy run is checked to
give the base's outputs (``identical``). Writes one JSON file::

    python -m benchmarks.bench_spiffy -n 70 --out benchmarks/results/spiffy_n70.json

Ratios are ``base / spiffy`` for NFE (higher = fewer forwards) and ``spiffy / base`` for
TPS (higher = faster), both measured in this run on this machine. On a CPU a forward over
``D* + 1`` rows costs about ``D* + 1`` times a plain one, unlike on a GPU, where a forward
with drafts costs little more than a plain one (the paper: about 25 % more).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dloom import DiffusionDecoder, load_model
from dloom.evaluation import SUITES, evaluate, select_examples, workload_suite
from dloom_plugins.spiffy.calibrate import calibrate

BASES = {"quota": {}, "threshold": {"tau": 0.9}, "frechet": {"delta": 0.0}}
SHARES = ("forward", "select_commit", "draft", "prune", "build_mask", "verify")


def run(model, strategy: str, examples, *, params=None, cache="none", block_length=8, batch=32) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a graph must fit: no silent fallback
        decoder = DiffusionDecoder(model, strategy, params=params or {}, cache=cache, block_length=block_length)
    report = evaluate(decoder, examples, batch_size=batch)
    return {
        "strategy": decoder.composition.name,
        "params": decoder.composition.params(),
        "cache": cache,
        "accuracy": report.accuracy,
        "nfe_mean": report.nfe_mean,
        "tpf": report.tpf,
        "tps": report.tps,
        "hook_share": {k: round(report.hook_share.get(k, 0.0), 4) for k in SHARES},
        "speculation": report.speculation,
        "texts": [o["text"] for o in report.outputs],
    }


def compare(spiffy: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    texts = spiffy.pop("texts")
    spiffy["identical"] = sum(a == b for a, b in zip(texts, base["texts"])) / len(texts)
    spiffy["nfe_ratio"] = base["nfe_mean"] / spiffy["nfe_mean"]
    spiffy["tps_ratio"] = spiffy["tps"] / base["tps"]
    return spiffy


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy-dllm")
    parser.add_argument("-n", type=int, default=70, help="held-out prompts")
    parser.add_argument("--calibration-n", type=int, default=70, help="training prompts to calibrate on")
    parser.add_argument("--budgets", default="3,5,8,10", help="D values")
    parser.add_argument("--pruned", default="3,5", help="D* values for the largest D")
    parser.add_argument("--score", default="own", help="calibration score (own or own+parents)")
    parser.add_argument("--tasks", default="auto", choices=("auto", *SUITES),
                        help="task suite (auto: the one the model's tokenizer writes, else all)")
    parser.add_argument("--block-length", type=int, default=8)
    parser.add_argument("--bases", default=",".join(BASES))
    parser.add_argument("--tau", type=float, default=BASES["threshold"]["tau"], help="the threshold base's tau")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tasks = (workload_suite(model.tokenizer) or "all") if args.tasks == "auto" else args.tasks
    examples = select_examples(tasks, args.n)
    calibration = [e.prompt for e in select_examples(tasks, args.calibration_n, split="train")]
    budgets = [int(b) for b in args.budgets.split(",")]
    pruned = [int(b) for b in args.pruned.split(",") if b]
    started = time.time()
    report: dict[str, Any] = {"model": args.model, "tasks": tasks, "n": args.n, "calibration_n": args.calibration_n,
                              "block_length": args.block_length, "score": args.score,
                              "torch_threads": args.threads, "bases": {}}
    workdir = Path(tempfile.mkdtemp(prefix="dloom-spiffy-"))
    bases = {**BASES, "threshold": {"tau": args.tau}}
    report["threshold_tau"] = args.tau
    for name in args.bases.split(","):
        params = bases[name]
        base = run(model, name, examples, params=params, block_length=args.block_length)
        rows = []
        for budget in budgets:
            decoder = DiffusionDecoder(model, name, params=params, block_length=args.block_length)
            graph = calibrate(decoder, calibration, budget, score=args.score,
                              description={"split": "train", "n": args.calibration_n})
            path = workdir / f"{name}-D{budget}.json"
            graph.save(path)
            for keep in [budget] + ([p for p in pruned if p < budget] if budget == max(budgets) else []):
                variants = [(False, "rule"), (True, "rule")] + ([(True, "confidence")] if keep < budget else [])
                for first_forward, prune in variants:
                    result = run(model, f"spiffy+{name}", examples, block_length=args.block_length,
                                 params={**params, "graph": str(path), "budget": keep,
                                         "first_forward": first_forward, "prune": prune})
                    rows.append({"D": budget, "D*": keep, "first_forward": first_forward, "prune": prune,
                                 **compare(result, base)})
                    spec = rows[-1]["speculation"] or {}
                    print(f"{name:9s} D={budget:2d} D*={keep:2d} first_forward={first_forward!s:5s} "
                          f"prune={prune:10s} NFE x{rows[-1]['nfe_ratio']:.2f} "
                          f"accepted/verification {spec.get('accepted_per_verification', float('nan')):.3f} "
                          f"TPS x{rows[-1]['tps_ratio']:.2f} identical {rows[-1]['identical']:.0%}", flush=True)
        base.pop("texts")
        report["bases"][name] = {"base": base, "spiffy": rows, "graph_dir": str(workdir)}
    # The full stack against one token per step.
    reference = run(model, "quota", examples, block_length=args.block_length)
    stack = []
    for name in ("threshold", "frechet"):
        if name not in report["bases"]:
            continue
        params = bases[name]
        alone = run(model, name, examples, params=params, cache="dual", block_length=args.block_length)
        path = workdir / f"{name}-D{max(budgets)}.json"
        full = run(model, f"spiffy+{name}", examples, cache="dual", block_length=args.block_length,
                   params={**params, "graph": str(path), "layout": "packed", "budget": max(pruned or budgets)})
        for label, result in ((f"{name} + dual", alone), (f"{name} + dual + spiffy", full)):
            row = {"label": label, **compare(dict(result), reference)}
            stack.append(row)
            print(f"{label:28s} NFE x{row['nfe_ratio']:.2f} TPS x{row['tps_ratio']:.2f} "
                  f"accuracy {row['accuracy']:.1%}", flush=True)
    reference.pop("texts")
    report["full_stack"] = {"reference": reference, "rows": stack}
    report["seconds"] = round(time.time() - started, 1)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
