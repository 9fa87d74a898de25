"""Spiffy at ``budget=auto`` against its base rule in wall time, for every rule and cache mode
(issue 54).

::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_cost_rules --model long-dllm-words -n 10 --repeats 5 \\
        --out benchmarks/results/cost_auto_rules_long.json
    OMP_NUM_THREADS=1 python -m benchmarks.bench_cost_rules --model random-512x8 --gen 32 -n 4 --repeats 5 \\
        --out benchmarks/results/cost_auto_rules_random512x8.json

For each commit rule at its setting (default: the settings the operating-points report chose
on the dev split, ``choices`` of ``benchmarks/results/operating-points-words.json``, and
quota) and each cache mode, on ``-n`` held-out prompts of the model's workload, one prompt per
batch, one thread: the rule alone, Spiffy over it at ``budget=auto`` (the ``D`` its chooser
picks under this machine's measured cost curve) and at a fixed ``--budget`` for reference.
Spiffy's graph for a rule is calibrated here on ``--calibration-n`` training prompts of the
same model (``random-WxN``, :func:`benchmarks.bench_engine.bench_model`: the seeded random
model itself, on toy-dllm's training prompts; its accuracy means nothing, so none is
reported).

Timing: every prompt is decoded by the three decoders of a rule and cache back to back, in an
order that rotates with the prompt and the pass; a pass sums each decoder's prompts. On a
machine shared with other jobs the load drifts, so beside the ratio of the medians the
report gives the **paired ratio**: the median over passes of the rule's pass time over
Spiffy's (:func:`paired_ratio`). Writes ``--out`` (JSON) and prints
:func:`wall_time_section` of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine import bench_model
from benchmarks.report import workload_tasks
from dloom import DiffusionDecoder
from dloom.evaluation import select_examples
from dloom_plugins.spiffy import Spiffy
from dloom_plugins.spiffy.calibrate import calibrate

CHOICES = Path(__file__).parent / "results" / "operating-points-words.json"
"""The operating-points report whose ``choices`` give each rule's setting."""
CACHES = ("none", "prefix", "dual")
RUNS = ("rule", "auto", "fixed", "again")
"""The rule alone, Spiffy at ``budget=auto``, Spiffy at the fixed ``--budget``, and the rule
alone again: an A/A control, whose ratio to the rule is the spread of identical work timed
in the same passes (what a ratio of ``auto`` at ``D = 0``, the rule's own steps, is)."""


def rule_settings(choices: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Each rule's parameters from an operating-points report's ``choices`` (``{rule:
    {"parameter": name, "value": v}}``), and quota (no parameter), in that order.

    :raises ValueError: for a choice without its parameter or value.
    """
    settings: dict[str, dict[str, float]] = {}
    for rule, choice in choices.items():
        if "parameter" not in choice or "value" not in choice:
            raise ValueError(f"choice {rule!r} is {dict(choice)!r}; expected a 'parameter' and a 'value'")
        settings[str(choice.get("rule", rule))] = {str(choice["parameter"]): float(choice["value"])}
    settings.setdefault("quota", {})
    return settings


def paired_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    """The median over passes of ``base[i] / other[i]``: the speed-up of ``other`` measured
    pass by pass, robust to load that drifts between passes (each pass times both under
    the same load).

    :raises ValueError: for passes of different counts, none, or a non-positive time.
    """
    if len(base) != len(other) or not base:
        raise ValueError(f"paired passes needed; got {len(base)} and {len(other)}")
    if min(*base, *other) <= 0:
        raise ValueError(f"pass times must be positive; got {list(base)} and {list(other)}")
    return statistics.median(b / o for b, o in zip(base, other))


def rotation(names: Sequence[str], shift: int) -> list[str]:
    """``names`` rotated left by ``shift`` (modulo their count)."""
    shift %= len(names)
    return [*names[shift:], *names[:shift]]


def measure(decoders: Mapping[str, DiffusionDecoder], prompts: Sequence[str], repeats: int) -> dict[str, Any]:
    """Each decoder's pass times (one untimed warm-up prompt each first), its tokens and NFE
    (module docstring: interleaved per prompt, the order rotating)."""
    names = list(decoders)
    for decoder in decoders.values():
        decoder.generate([prompts[0]])
    found: dict[str, Any] = {name: {"passes": []} for name in names}
    for repeat in range(repeats):
        seconds = dict.fromkeys(names, 0.0)
        tokens: dict[str, list[list[int]]] = {name: [] for name in names}
        nfe = dict.fromkeys(names, 0)
        for index, prompt in enumerate(prompts):
            for name in rotation(names, repeat + index):
                started = time.perf_counter()
                result = decoders[name].generate([prompt])
                seconds[name] += time.perf_counter() - started
                tokens[name] += result.token_lists
                nfe[name] += int(result.nfe.sum())
        for name in names:
            found[name]["passes"].append(seconds[name])
            found[name].update(tokens=tokens[name], nfe=nfe[name])
    return found


def spiffy_of(decoder: DiffusionDecoder) -> Spiffy:
    return next(p for p in decoder.pm.get_plugins() if isinstance(p, Spiffy))


def compare(found: Mapping[str, Any], decoders: Mapping[str, DiffusionDecoder]) -> dict[str, Any]:
    """The rows of one rule and cache: seconds (median pass), NFE, and for Spiffy its ``D``,
    the ratios to the rule (of the medians, paired) and whether its outputs are the rule's."""
    base = found["rule"]
    rows: dict[str, Any] = {}
    for name, row in found.items():
        entry = {"seconds": statistics.median(row["passes"]), "passes": row["passes"], "nfe": row["nfe"]}
        if name != "rule":
            entry.update(
                wall_vs_rule=statistics.median(base["passes"]) / entry["seconds"],
                paired_vs_rule=paired_ratio(base["passes"], row["passes"]), nfe_vs_rule=base["nfe"] / row["nfe"],
                identical=row["tokens"] == base["tokens"],
            )
        if name in ("auto", "fixed"):
            plugin = spiffy_of(decoders[name])
            # plain_steps: the decoder takes the rule's plain steps only (Spiffy declined drafting)
            entry.update(budget=plugin.chosen_budget, plain_steps=decoders[name].speculative_step is None)
            if plugin.choice is not None and plugin.choice["speedups"] is not None:
                entry["expected_speedups"] = plugin.choice["speedups"]
        rows[name] = entry
    return rows


def calibration_prompts(model, count: int) -> list[str]:
    return [e.prompt for e in select_examples(workload_tasks(model), count, 0, split="train")]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = bench_model(args.model)
    prompts = [e.prompt for e in select_examples(workload_tasks(model), args.n, 0)]
    training = calibration_prompts(model, args.calibration_n)
    settings = rule_settings(json.loads(args.choices.read_text())["choices"])
    if args.rules:
        unknown = sorted(set(args.rules) - set(settings))
        if unknown:
            raise SystemExit(f"--rules {', '.join(unknown)}: allowed: {', '.join(settings)}")
        settings = {rule: settings[rule] for rule in args.rules}
    shape = {"gen_length": args.gen, "block_length": args.block}
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    rows = []
    folder = Path(tempfile.mkdtemp())
    for rule, params in settings.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = DiffusionDecoder(model, rule, params=params, **shape)
            graph = folder / f"{rule}.json"
            calibrate(base, training, budget=args.budget,
                      description={"split": "train", "seed": 0, "prompts": len(training)}).save(graph)
        for cache in args.caches:
            spiffy = {**params, "graph": str(graph)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                decoders = {
                    "rule": DiffusionDecoder(model, rule, params=params, cache=cache, **shape),
                    "auto": DiffusionDecoder(model, f"spiffy+{rule}", params={**spiffy, "budget": "auto"},
                                             cache=cache, **shape),
                    "fixed": DiffusionDecoder(model, f"spiffy+{rule}", params={**spiffy, "budget": args.budget},
                                              cache=cache, **shape),
                    "again": DiffusionDecoder(model, rule, params=params, cache=cache, **shape),
                }
            found = compare(measure(decoders, prompts, args.repeats), decoders)
            rows.append({"rule": rule, "params": params, "cache": cache, "runs": found})
            load.append(os.getloadavg()[0])
            print(f"{rule} {params} {cache}: auto D={found['auto']['budget']} "
                  f"{found['auto']['paired_vs_rule']:.2f}x, fixed {found['fixed']['paired_vs_rule']:.2f}x "
                  f"({time.perf_counter() - started:.0f} s, load {load[-1]:.1f})", file=sys.stderr, flush=True)
    sample = decoders["rule"]
    return {
        "command": "python -m benchmarks.bench_cost_rules " + " ".join(args.argv),
        "model": args.model, "n": args.n, "repeats": args.repeats, "calibration_n": args.calibration_n,
        "budget": args.budget, "gen_length": sample.gen_length, "block_length": sample.block_length,
        "threads": 1, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": load, "seconds": time.perf_counter() - started,
        "settings": settings, "rows": rows,
    }


def setting_label(rule: str, params: Mapping[str, float]) -> str:
    """``"threshold τ 0.7"``, ``"quota"``."""
    symbols = {"tau": "τ", "delta": "δ"}
    return " ".join([rule, *(f"{symbols.get(k, k)} {v:g}" for k, v in params.items())])


def wall_time_section(results: Mapping[str, Any]) -> str:
    """A Markdown section of a :func:`run` result: one table row per rule and cache mode,
    with Spiffy at ``budget=auto`` (its ``D``) and at the fixed budget against the rule."""
    budget = results["budget"]
    load = results["load_average"]
    lines = [
        f"### Wall time at `budget=auto`: `{results['model']}`",
        "",
        f"{results['n']} held-out prompts, one per batch, gen length {results['gen_length']}, block "
        f"{results['block_length']}, one CPU thread ({results['machine']}, torch {results['torch']}), "
        f"{results['repeats']} interleaved passes; load average {min(load):.1f}–{max(load):.1f} on a shared "
        "2-core machine. *paired*: the median over passes of the rule's pass time over Spiffy's; *of medians*: "
        "the ratio of the median passes; *rule vs itself*: the same ratio for a second decoder of the rule "
        "alone, timed in the same passes (identical work: the spread a ratio has here). Command: "
        f"`OMP_NUM_THREADS=1 {results['command']}`.",
        "",
        f"| rule | cache | rule s | rule vs itself (paired) | auto D | auto vs rule (paired) | (of medians) | "
        f"auto NFE (rule) | identical | D={budget} vs rule (paired) | D={budget} fewer NFE | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        rule, auto, fixed = (row["runs"][name] for name in RUNS[:3])
        again = row["runs"].get("again")  # runs before the control have none
        control = "–" if again is None else f"{again['paired_vs_rule']:.2f}×"
        lines.append(
            f"| {setting_label(row['rule'], row['params'])} | {row['cache']} | {rule['seconds']:.2f} | {control} | "
            f"{auto['budget']} | {auto['paired_vs_rule']:.2f}× | {auto['wall_vs_rule']:.2f}× | "
            f"{auto['nfe']} ({rule['nfe']}) | {'yes' if auto['identical'] else '**no**'} | "
            f"{fixed['paired_vs_rule']:.2f}× | {fixed['nfe_vs_rule']:.2f}× | "
            f"{'yes' if fixed['identical'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="long-dllm-words", help="zoo name, checkpoint directory or random-WxN")
    parser.add_argument("--choices", type=Path, default=CHOICES, help="an operating-points report (its choices)")
    parser.add_argument("--rules", nargs="*", default=None, help="a subset of the rules (default: all)")
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    parser.add_argument("--budget", type=int, default=10, help="the fixed budget, and the calibrated graph's nodes")
    parser.add_argument("--gen", type=int, default=None, help="gen length (default: the model's)")
    parser.add_argument("--block", type=int, default=None, help="block length (default: the model's)")
    parser.add_argument("-n", type=int, default=10, help="held-out prompts")
    parser.add_argument("--calibration-n", type=int, default=30, help="training prompts calibrating each graph")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed passes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    results = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(wall_time_section(results))
    return results


if __name__ == "__main__":
    main()
