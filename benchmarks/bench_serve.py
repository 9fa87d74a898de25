"""Load benchmark of ``dloom serve``: throughput and latency against concurrency, continuously
batched versus one request at a time, in one run.

Two servers run in this process (uvicorn on 127.0.0.1, free ports) over the same model: one
keeps a running batch of up to ``--max-batch-size`` rows that waiting rows join between
forwards, the other decodes one request at a time (``max_batch_size=1``, the same code path
otherwise). For each strategy
and each concurrency ``c``, ``c`` client threads send ``--requests`` completions in total
(held-out task prompts, greedy; at least one per client) and wait for each answer before sending the next; the two
servers take turns, ``--repeats`` times per level, and the fastest try of each is kept (on a
shared CPU, noise only adds time). Reported:
generated tokens per second (``usage.completion_tokens`` over the wall time of the level),
p50 and p99 latency, mean rows per forward (the server's NFE over its forwards), and whether
every try of both servers returned the same texts.

    python -m benchmarks.bench_serve --out benchmarks/results/serve.json --plot docs/assets/serve.png
    python -m benchmarks.bench_serve --table benchmarks/results/serve.json   # the docs' table
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import httpx
import torch

import dloom
from dloom.evaluation import select_examples
from dloom.serve.app import ServeConfig
from dloom.serve.background import BackgroundServer
from dloom.serve.decoders import DecodeDefaults

MODES = {"continuous": None, "one at a time": 1}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


class Server(BackgroundServer):
    """A server in this process, read through its ``/metrics``."""

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


def run_level(server: Server, model: str, strategy: str, prompts: list[str], concurrency: int) -> dict:
    """``len(prompts)`` requests from ``concurrency`` clients; their figures and texts."""
    forwards, nfe = server.metric("dloom_forwards_total"), server.metric("dloom_nfe_total")
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    latencies, tokens, texts = [], 0, [""] * len(prompts)

    def client() -> None:
        nonlocal tokens
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    index, prompt = queue.pop(0)
                sent = time.perf_counter()
                answer = http.post(f"{server.url}/v1/completions", json={
                    "model": model, "prompt": prompt, "strategy": strategy,
                })
                answer.raise_for_status()
                body = answer.json()
                with lock:
                    latencies.append(time.perf_counter() - sent)
                    tokens += body["usage"]["completion_tokens"]
                    texts[index] = body["choices"][0]["text"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - start
    steps = server.metric("dloom_forwards_total") - forwards
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "generated_tokens": tokens,
        "wall_seconds": wall,
        "tokens_per_second": tokens / wall,
        "latency_p50": percentile(latencies, 0.50),
        "latency_p99": percentile(latencies, 0.99),
        "forwards": steps,
        "rows_per_forward": (server.metric("dloom_nfe_total") - nfe) / steps,
        "texts": texts,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy, modes in results["strategies"].items():
        for mode, levels in modes.items():
            xs = [level["concurrency"] for level in levels]
            style = "-o" if mode == "continuous" else "--s"
            speed.plot(xs, [level["tokens_per_second"] for level in levels], style, label=f"{strategy}, {mode}")
            latency.plot(xs, [level["latency_p50"] for level in levels], style, label=f"{strategy}, {mode}")
    for axis, label in ((speed, "generated tokens / s"), (latency, "p50 latency (s)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    speed.set_yscale("log")
    latency.set_yscale("log")
    speed.legend(fontsize=8)
    figure.suptitle(f"dloom serve on {results['model']}: continuous batching vs one request at a time")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def table(results: dict) -> str:
    """The results as the markdown table of ``docs/benchmarks/serve.md``."""
    lines = [
        "| strategy | clients | continuous tokens/s | one at a time tokens/s | ratio | continuous p50 / p99 (s) "
        "| one at a time p50 / p99 (s) | rows per forward | forwards (continuous / one at a time) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, modes in results["strategies"].items():
        for batched, alone in zip(modes["continuous"], modes["one at a time"]):
            lines.append(
                f"| {strategy} | {batched['concurrency']} | {batched['tokens_per_second']:.0f} "
                f"| {alone['tokens_per_second']:.0f} | {batched['tokens_per_second'] / alone['tokens_per_second']:.2f}x "
                f"| {batched['latency_p50']:.2f} / {batched['latency_p99']:.2f} "
                f"| {alone['latency_p50']:.2f} / {alone['latency_p99']:.2f} | {batched['rows_per_forward']:.1f} "
                f"| {batched['forwards']:.0f} / {alone['forwards']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy-dllm")
    parser.add_argument("--strategies", default="quota,threshold", help="comma-separated")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least one per client)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="of the continuous server (dloom serve's default)")
    parser.add_argument("--block-length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="tries per level and mode; the fastest is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve.json"))
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="print the markdown table of a results file and stop")
    args = parser.parse_args()
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return
    torch.set_num_threads(args.threads)
    model = dloom.load_model(args.model, device=args.device)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [e.prompt for e in select_examples("all", max([args.requests, *levels]))]
    strategies = args.strategies.split(",")
    results = {
        "model": args.model, "requests_per_level": args.requests, "max_batch_size": args.max_batch_size,
        "block_length": args.block_length, "repeats": args.repeats, "device": args.device, "torch_threads": args.threads,
        "cpu": platform.processor() or platform.machine(), "date": date.today().isoformat(),
        "strategies": {s: {} for s in strategies},
    }
    defaults = DecodeDefaults(block_length=args.block_length)
    servers = {
        mode: Server(ServeConfig(model, defaults, max_batch_size=size or args.max_batch_size, max_queued_tokens=1 << 20))
        for mode, size in MODES.items()
    }
    try:
        for strategy in strategies:
            for mode, server in servers.items():
                run_level(server, args.model, strategy, prompts[:2], 1)  # warm-up
                results["strategies"][strategy][mode] = []
            for concurrency in levels:
                tries = {mode: [] for mode in servers}
                for _ in range(args.repeats):  # the modes alternate, so that drift hits both alike
                    for mode, server in servers.items():
                        level_prompts = prompts[: max(args.requests, concurrency)]  # every client sends one at least
                        tries[mode].append(run_level(server, args.model, strategy, level_prompts, concurrency))
                reference = tries["continuous"][0]["texts"]
                identical = all(run["texts"] == reference for runs in tries.values() for run in runs)
                for mode, runs in tries.items():  # the fastest try: noise on a shared CPU only adds time
                    row = {**max(runs, key=lambda run: run["tokens_per_second"]), "identical_texts": identical}
                    results["strategies"][strategy][mode].append(row)
                    print(f"{strategy:>10} {mode:>14} c={concurrency:<3} {row['tokens_per_second']:8.1f} tok/s "
                          f"p50 {row['latency_p50']:.3f}s p99 {row['latency_p99']:.3f}s "
                          f"rows/forward {row['rows_per_forward']:.1f} forwards {row['forwards']:.0f}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    for strategy, modes in results["strategies"].items():
        batched, alone = modes["continuous"], modes["one at a time"]
        results.setdefault("summary", {})[strategy] = {
            "speedup_by_concurrency": {
                str(b["concurrency"]): b["tokens_per_second"] / a["tokens_per_second"] for b, a in zip(batched, alone)
            },
            "identical_texts": all(level["identical_texts"] for level in batched),
        }
        print(strategy, json.dumps(results["summary"][strategy]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot is not None:
        plot(results, args.plot)
    print(table(results))


if __name__ == "__main__":
    main()
