"""Paired wall-time comparison of FailFast between two source trees of dloom.

Each tree is a directory holding ``core/`` and ``plugins/`` (for example one extracted with
``git archive COMMIT core plugins | tar -x -C DIR``, or this checkout). One *pass* runs
FailFast over the same ``n`` held-out toy prompts (greedy, batch 1, ``max_new_tokens`` 32,
the benchmark's default FailFast settings) in a fresh child process whose ``PYTHONPATH``
starts with that tree; trees alternate pass by pass (ABAB...), so slow phases of a shared
machine hit both alike. Per tree: the median and every pass's seconds (model loading and a
warm-up prompt excluded), wall and CPU (``time.process_time``: the process's own CPU
seconds, far less sensitive than wall time to other work on shared cores), and the exact counts of the first pass (target and drafter
forwards, generated tokens), which must be equal across trees when both decode the same way.

Usage::

    OMP_NUM_THREADS=1 python -m benchmarks.paired_failfast OLD_DIR NEW_DIR -n 20 --passes 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
from dloom import load_model
from dloom.zoo.tasks import held_out
try:
    from dloom_plugins.failfast import FailFastDecoder
except ImportError:  # trees from before FailFast moved into dloom_plugins
    from dloom.failfast import FailFastDecoder
n, cache, params = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
target = load_model("toy-ar", require_mask=False)
drafter = load_model("toy-dllm")
counts = {"target": 0, "drafter": 0}
def counter(name):
    def hook(module, args):
        counts[name] += 1
    return hook
target.model.register_forward_pre_hook(counter("target"))
drafter.model.register_forward_pre_hook(counter("drafter"))
prompts = target.encode([e.prompt for e in held_out(n, seed=0)])
decoder = FailFastDecoder(target, drafter, params=params, max_new_tokens=32, drafter_cache=cache)
decoder.generate([prompts[0]])  # warm-up
counts.update(target=0, drafter=0)
tokens = 0
start, cpu = time.perf_counter(), time.process_time()
for prompt in prompts:
    tokens += len(decoder.generate([prompt]).token_lists[0])
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens,
                  **{f"{k}_forwards": v for k, v in counts.items()}}))
"""


def one_pass(tree: Path, n: int, cache: str, params: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'core'}{os.pathsep}{tree / 'plugins'}")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(n), cache, params], env=env, check=True,
        capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (each with core/ and plugins/)")
    parser.add_argument("-n", type=int, default=20, help="held-out prompts per pass")
    parser.add_argument("--passes", type=int, default=5, help="passes per tree (interleaved)")
    parser.add_argument("--cache", default="prefix", choices=("none", "prefix"), help="drafter_cache")
    parser.add_argument("--params", default="{}", help="FailFast parameters as JSON")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {str(tree): [] for tree in args.trees}
    for _ in range(args.passes):
        for tree in args.trees:
            runs[str(tree)].append(one_pass(tree, args.n, args.cache, args.params))
    report = {
        "command": " ".join(sys.argv), "n": args.n, "passes": args.passes, "cache": args.cache,
        "params": json.loads(args.params), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "trees": {
            tree: {
                "median_seconds": statistics.median(r["seconds"] for r in passes),
                "median_cpu_seconds": statistics.median(r["cpu_seconds"] for r in passes),
                "seconds": [round(r["seconds"], 3) for r in passes],
                "cpu_seconds": [round(r["cpu_seconds"], 3) for r in passes],
                **{key: passes[0][key] for key in ("tokens", "target_forwards", "drafter_forwards")},
            }
            for tree, passes in runs.items()
        },
    }
    first = report["trees"][str(args.trees[0])]
    for entry in report["trees"].values():
        entry["relative_to_first"] = entry["median_seconds"] / first["median_seconds"]
        entry["cpu_relative_to_first"] = entry["median_cpu_seconds"] / first["median_cpu_seconds"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
