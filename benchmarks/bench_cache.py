"""Benchmark KV caching: accuracy, drift, speed and recomputed positions of none/prefix/dual.

One run measures, for cache modes ``none``, ``prefix`` and ``dual``, at a short prompt (the
task prompts as they are) and a long one (each prompt left-filled with spaces to about four
times its length, within the model's context):

- accuracy on ``n`` held-out task examples (:func:`dloom.evaluation.evaluate`), graded
  against the original prompt;
- drift: the share of outputs whose text differs from the uncached output;
- TPS (generated tokens per second; the median of ``--repeats`` timed passes, modes
  interleaved) and its ratio to ``none``;
- with ``--refresh K``: the same for ``prefix`` and ``dual`` rebuilt by a full forward every
  ``K`` forwards of a block (rows ``prefix/K``, ``dual/K``);
- query positions per forward: how many positions each forward recomputes, averaged over
  the forwards (counted by a hook on the model). This is the work caching saves, whatever
  the hardware.

Usage::

    python -m benchmarks.bench_cache --json cache.json            # toy-dllm when trained
    PYTHONPATH=training python -m benchmarks.bench_cache --model random --json x.json  # untrained

``--model random`` builds the toy-dllm architecture with random weights and the zoo's
tokenizer in a temporary directory (speed figures are meaningful, accuracy is not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from dloom import DiffusionDecoder, load_model, zoo
from dloom.evaluation import evaluate, select_examples
from dloom.model.cache_policy import BUILTIN_CACHE_MODES as CACHE_MODES
from dloom.zoo.tasks import FAMILIES, Example

FILLER = " "


def random_toy_model(directory: Path) -> Path:
    """Save an untrained model with toy-dllm's architecture and the zoo tokenizer."""
    from dloom.zoo import tokenizer
    from dloom_training.models import build_model

    torch.manual_seed(0)
    build_model("toy-dllm").save_pretrained(directory)
    tokenizer.save(directory)
    return directory


def label(mode: str, refresh: int | None) -> str:
    """A row's name: the cache mode, with ``/k`` when it is refreshed every ``k`` forwards."""
    return mode if refresh is None else f"{mode}/{refresh}"


def resolve_model(name: str | None, scratch: Path) -> str:
    if name == "random":
        return str(random_toy_model(scratch / "random-toy-dllm"))
    if name is not None:
        return name
    if (zoo.model_path("toy-dllm") / "config.json").is_file():
        return "toy-dllm"
    sys.exit("toy-dllm is not trained yet: pass --model PATH, or --model random")


def lengthen(examples: list[Example], width: int) -> list[Example]:
    """The examples with their prompts left-filled to ``width`` characters."""
    return [
        Example(**{**vars(e), "prompt": FILLER * max(0, width - len(e.prompt)) + e.prompt})
        for e in examples
    ]


class ForwardCounter:
    """Counts forwards and the query positions (per row) each one processes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards = 0
        self.positions = 0
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.forwards += 1
        self.positions += ids.shape[1]

    def reset(self) -> None:
        self.forwards = self.positions = 0

    @property
    def mean(self) -> float:
        return self.positions / self.forwards if self.forwards else 0.0


def measure(args: argparse.Namespace, model_name: str) -> dict[str, Any]:
    adapter = load_model(model_name, device=args.device, dtype=args.dtype)
    gen_length = args.gen_length or adapter.default_gen_length or 32
    examples = select_examples(args.tasks, args.n, args.seed)
    short_width = max(len(e.prompt) for e in examples)
    room = (adapter.max_context or 4 * short_width + gen_length) - gen_length
    long_width = min(4 * short_width, room)
    variants = {"short": examples, "long": lengthen(examples, long_width)}
    variants = {name: variants[name] for name in args.lengths}
    counter = ForwardCounter(adapter.model)
    settings = [(mode, None) for mode in CACHE_MODES]
    settings += [(mode, k) for k in args.refresh for mode in CACHE_MODES if mode != "none"]
    decoders = {
        label(mode, refresh): DiffusionDecoder(
            adapter, args.strategy, params=dict(p.split("=", 1) for p in args.param),
            gen_length=gen_length, block_length=args.block_length, cache=mode, cache_refresh=refresh,
        )
        for mode, refresh in settings
    }
    rows = []
    for variant, prompts in variants.items():
        evaluate(decoders["none"], prompts[: args.batch_size], args.batch_size)  # warm-up
        reports, positions, tps = {}, {}, {mode: [] for mode in decoders}
        for repeat in range(args.repeats):
            for mode in decoders:
                counter.reset()
                report = evaluate(decoders[mode], prompts, args.batch_size)
                tps[mode].append(report.tps)
                if repeat == 0:
                    reports[mode], positions[mode] = report, counter.mean
        base = reports["none"]
        base_tps = statistics.median(tps["none"])
        for mode in decoders:
            report = reports[mode]
            graded = [
                FAMILIES[e.family].check(e.prompt, out["text"])
                for e, out in zip(examples, report.outputs)
            ]
            drift = sum(a["text"] != b["text"] for a, b in zip(report.outputs, base.outputs))
            median_tps = statistics.median(tps[mode])
            rows.append({
                "prompt": variant,
                "prompt_chars_mean": statistics.mean(len(e.prompt) for e in prompts),
                "prompt_width": max(len(e.prompt) for e in prompts),
                "cache": mode,
                "cache_refresh": decoders[mode].cache_refresh,
                "accuracy": sum(graded) / len(graded),
                "drift_vs_none": drift / report.n,
                "nfe_mean": report.nfe_mean,
                "tpf": report.tpf,
                "tps": median_tps,
                "tps_runs": tps[mode],
                "tps_ratio_vs_none": median_tps / base_tps if base_tps else 0.0,
                "query_positions_per_forward": positions[mode],
                "query_positions_ratio_vs_none": positions[mode] / positions["none"],
            })
    return {
        "model": model_name,
        "strategy": args.strategy,
        "params": args.param,
        "n": len(examples),
        "gen_length": gen_length,
        "block_length": args.block_length,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "lengths": args.lengths,
        "device": args.device,
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "max_context": adapter.max_context,
        "rows": rows,
        "notes": [
            (
                "long prompts are the task prompts left-filled with spaces; a model never "
                "trained on such filler may lose accuracy there, which says nothing about caching"
            ),
            (
                "query_positions_per_forward is the hardware-independent saving; a forward's "
                "fixed cost (Python, mask building, kernel launches) hides part of it when "
                "the sequence is short, while a long one is compute-bound in the positions "
                "it recomputes and the TPS ratio approaches the positions ratio"
            ),
        ],
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\nKV cache on {result['model']} ({result['strategy']}, n={result['n']}, gen "
        f"{result['gen_length']}, block {result['block_length']}, {result['device']}, "
        f"{result['torch_threads']} threads)"
    )
    header = f"{'prompt':<7}{'width':>6}{'cache':>8}{'acc':>7}{'drift':>7}{'NFE':>7}{'TPS':>9}{'x none':>8}{'q/fwd':>8}{'q ratio':>9}"
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        print(
            f"{row['prompt']:<7}{row['prompt_width']:>6}{row['cache']:>8}{row['accuracy']:>7.1%}"
            f"{row['drift_vs_none']:>7.1%}{row['nfe_mean']:>7.1f}{row['tps']:>9.1f}"
            f"{row['tps_ratio_vs_none']:>7.2f}x{row['query_positions_per_forward']:>8.1f}"
            f"{row['query_positions_ratio_vs_none']:>9.2f}"
        )


def _lengths(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in ("short", "long")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown prompt length {unknown}; allowed: short, long")
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", help="zoo name or checkpoint directory; 'random' for an untrained toy-dllm (default: toy-dllm)")
    parser.add_argument("--strategy", default="quota")
    parser.add_argument("--param", action="append", default=[], help="strategy parameter NAME=VALUE")
    parser.add_argument("--tasks", default="all")
    parser.add_argument("-n", type=int, default=70, help="held-out examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gen-length", type=int, default=None)
    parser.add_argument("--block-length", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=35)
    parser.add_argument("--lengths", type=_lengths, default=["short", "long"], metavar="short,long",
                        help="prompt lengths to measure (default: both)")
    parser.add_argument("--refresh", type=int, action="append", default=[], metavar="K",
                        help="also measure prefix and dual with a full forward every K forwards (repeatable)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per mode (median TPS)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(args, resolve_model(args.model, Path(scratch)))
    if args.model == "random":
        result["model"] = "random (untrained toy-dllm architecture)"
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
