"""The papers' decoding setups on real checkpoints, for a GPU with local weights.

Runs LLaDA-8B-Instruct and Dream-v0-Instruct-7B on GSM8K-style prompts with the settings
Fast-dLLM evaluates GSM8K with (generation length 256, block length 32; threshold 0.9), in
bf16 with ``device_map``, and records accuracy, NFE, tokens per forward (TPF), tokens per
second (TPS), wall time and peak GPU memory for each configuration:

- ``quota``: one token per step (the LLaDA baseline every speed-up is measured against);
- ``threshold`` with ``tau=0.9`` (Fast-dLLM's parallel decoding);
- ``frechet`` with ``delta=0`` (the Fréchet certificate);
- each with every KV cache mode (``none``, ``prefix``, ``dual``): the checkpoints load onto
  ``transformers``' own classes, whose forwards take a cache;
- Spiffy (uncalibrated default graph) alone and over threshold;
- FailFast: the Qwen2.5 target verifying Dream's drafts (they share a tokenizer), when both
  ``--qwen`` and ``--dream`` are given.

Nothing is downloaded: every path is a local checkpoint directory. See
``benchmarks/gpu/README.md`` for the setup and what the numbers can and cannot be compared
with::

    python -m benchmarks.gpu.run_papers --llada /models/LLaDA-8B-Instruct \\
        --dream /models/Dream-v0-Instruct-7B --qwen /models/Qwen2.5-7B-Instruct \\
        --prompts gsm8k_test.jsonl -n 200 --out benchmarks/results/gpu_papers.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

#: Strategies and parameters run on every dLLM (name, parameters).
STRATEGIES: list[tuple[str, dict[str, float]]] = [
    ("quota", {}),
    ("threshold", {"tau": 0.9}),
    ("frechet", {"delta": 0.0}),
    # Spiffy without a graph calibrated for the checkpoint uses the uncalibrated default
    # graph (lossless, fewer drafts accepted); calibrate with `dloom calibrate` for more. A
    # fixed budget: budget=auto takes no drafts from an uncalibrated graph.
    ("spiffy", {"budget": 10}),
    ("spiffy+threshold", {"tau": 0.9, "spiffy.budget": 10}),
]
#: Why FailFast is not run when a model it needs is missing.
FAILFAST_NEEDS = "FailFast needs the Qwen2.5 target (--qwen) and the Dream drafter (--dream)"
CACHES = ("none", "prefix", "dual")

#: GSM8K-style example problems (written for this script), used when no --prompts file is given.
EXAMPLES: list[dict[str, str]] = [
    {"question": "A baker makes 24 rolls in the morning and 18 in the afternoon. She sells 35 of them. How many rolls are left?", "answer": "7"},
    {"question": "Tom reads 12 pages a day. How many days does he need to finish a book of 156 pages?", "answer": "13"},
    {"question": "A bus carries 45 people. 3 buses and 2 cars with 4 people each go on a trip. How many people go?", "answer": "143"},
    {"question": "Mia buys 4 notebooks at $3 each and a pen for $2. She pays with a $20 bill. How much change does she get?", "answer": "6"},
    {"question": "A garden has 6 rows of 14 tulips. Rabbits eat 19 tulips. How many tulips remain?", "answer": "65"},
    {"question": "A train travels 80 km per hour for 3 hours and then 60 km per hour for 2 hours. How far does it travel?", "answer": "360"},
    {"question": "There are 5 boxes with 12 apples each. 1/4 of the apples are rotten. How many good apples are there?", "answer": "45"},
    {"question": "Sam earns $15 an hour and works 7 hours a day for 5 days. How much does he earn?", "answer": "525"},
]
INSTRUCTION = "Solve the problem step by step. End with the final answer as '#### <number>'."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Reproduce the papers' decoding setups (LLaDA / Dream on GSM8K-style "
        "prompts) on local checkpoints; needs a GPU for realistic numbers.",
    )
    parser.add_argument("--llada", type=Path, help="local LLaDA-8B-Instruct directory")
    parser.add_argument("--dream", type=Path, help="local Dream-v0-Instruct-7B directory")
    parser.add_argument("--qwen", type=Path, help="local Qwen2.5-Instruct directory (FailFast target)")
    parser.add_argument("--prompts", type=Path, help="JSONL with 'question' and 'answer' (GSM8K format: '... #### 42'); default: 8 embedded examples")
    parser.add_argument("-n", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--fewshot", type=int, default=0, help="prepend the first K records of --prompts as solved examples (evaluated on the rest)")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per batch (left-padded: every family dloom loads natively honours the padding mask, LLaDA included)")
    parser.add_argument("--caches", default=",".join(CACHES), help="comma-separated cache modes to try")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument(
        "--device-map", default=None,
        help="from_pretrained device_map ('auto' needs accelerate; 'none' to use --device); "
        "default: 'auto' when accelerate is installed, else 'none'",
    )
    parser.add_argument("--device", default="cuda", help="device when --device-map none")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--plan", action="store_true", help="print the runs and exit without loading anything")
    return parser.parse_args(argv)


def read_problems(path: Path | None) -> list[dict[str, str]]:
    """``{"question", "answer"}`` records; a GSM8K answer keeps only the number after ``####``."""
    if path is None:
        return list(EXAMPLES)
    problems = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            answer = str(record["answer"]).split("####")[-1].strip().replace(",", "")
            problems.append({"question": record["question"], "answer": answer, "solution": str(record["answer"])})
    return problems


def build_prompts(problems: list[dict[str, str]], fewshot: int) -> tuple[list[str], list[dict[str, str]]]:
    """User messages (instruction, optional solved examples, question) and the evaluated problems."""
    shots, rest = problems[:fewshot], problems[fewshot:]
    prefix = "".join(
        f"Question: {s['question']}\nAnswer: {s.get('solution', '#### ' + s['answer'])}\n\n" for s in shots
    )
    return [f"{INSTRUCTION}\n\n{prefix}Question: {p['question']}\nAnswer:" for p in rest], rest


def final_number(text: str) -> str | None:
    """The number after the last ``####``, else the last number in the text."""
    tail = text.split("####")[-1] if "####" in text else text
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", tail)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs, as records; pending strategies carry a reason instead of settings."""
    runs: list[dict[str, Any]] = []
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    for family, path in (("llada", args.llada), ("dream", args.dream)):
        if path is None:
            continue
        for strategy, params in STRATEGIES:
            for cache in caches:
                runs.append({"model": family, "path": str(path), "strategy": strategy, "params": params, "cache": cache})
    if args.qwen is not None and args.dream is not None:
        runs.append({"model": "qwen", "path": str(args.qwen), "drafter": str(args.dream),
                     "strategy": "failfast", "params": {}, "cache": "none"})
    elif args.qwen is not None or args.dream is not None:
        runs.append({"model": "qwen", "strategy": "failfast", "pending": FAILFAST_NEEDS})
    return runs


def device_map_of(args: argparse.Namespace) -> str | None:
    """The ``device_map`` to load with: ``--device-map``, else ``"auto"`` when accelerate
    is installed, else ``None`` (one device, ``--device``)."""
    import importlib.util

    if args.device_map is None:
        return "auto" if importlib.util.find_spec("accelerate") is not None else None
    return None if args.device_map == "none" else args.device_map


def load(path: Path, args: argparse.Namespace, **kwargs):
    """The checkpoint at ``path`` with the run's dtype and placement.

    :raises SystemExit: with dloom's message (a missing accelerate for ``--device-map auto``,
        an unknown device, a checkpoint it cannot load), before any decoding.
    """
    from dloom import load_model
    from dloom.errors import DloomError

    try:
        return load_model(path, dtype=args.dtype, device_map=device_map_of(args), device=args.device, **kwargs)
    except DloomError as error:
        raise SystemExit(f"error: {error}") from None


def run_one(adapter, run: dict[str, Any], prompts: list[str], problems, args, drafter=None) -> dict[str, Any]:
    """Decode every prompt with one configuration; accuracy and speed over all of them.
    With a ``drafter``, ``adapter`` is FailFast's AR target."""
    import torch

    from dloom import DiffusionDecoder
    from dloom.errors import DloomError
    from dloom_plugins.failfast import FailFastDecoder

    try:
        if drafter is not None:
            decoder = FailFastDecoder(adapter, drafter, run["strategy"], params=run["params"], max_new_tokens=args.gen_length)
        else:
            decoder = DiffusionDecoder(
                adapter, run["strategy"], params=run["params"], gen_length=args.gen_length,
                block_length=args.block_length, cache=run["cache"],
            )
    except DloomError as error:
        return {**run, "skipped": str(error)}
    batch = args.batch_size
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    correct = nfe = generated = 0
    seconds = 0.0
    outputs = []
    for start in range(0, len(prompts), batch):
        try:
            result = decoder.generate(prompts[start : start + batch])
        except Exception as error:  # a model's own code failing on this configuration
            return {**run, "failed": f"{type(error).__name__}: {error}"}
        seconds += result.wall_seconds
        nfe += int(result.nfe.sum())
        generated += result.total_generated
        for offset, text in enumerate(result.texts or [""] * len(result.token_lists)):
            problem = problems[start + offset]
            answer = final_number(text)
            correct += answer == problem["answer"]
            outputs.append({"question": problem["question"], "text": text, "answer": answer, "expected": problem["answer"]})
    return {
        **run, "n": len(prompts), "accuracy": correct / len(prompts), "nfe_mean": nfe / len(prompts),
        "tpf": generated / nfe if nfe else 0.0, "tps": generated / seconds if seconds else 0.0,
        "wall_seconds": seconds,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "config": decoder.config, "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = plan(args)
    if not runs:
        print("nothing to run: pass --llada, --dream and/or --qwen", file=sys.stderr)
        return 2
    if args.plan:
        for run in runs:
            print(json.dumps(run))
        return 0

    import torch

    problems = read_problems(args.prompts)
    prompt_texts, problems = build_prompts(problems, args.fewshot)
    if args.n is not None:
        prompt_texts, problems = prompt_texts[: args.n], problems[: args.n]
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "runs": [],
    }
    adapters: dict[str, Any] = {}
    for run in runs:
        if "pending" in run:
            print(f"{run['model']:6s} {run['strategy']:16s} pending: {run['pending']}", file=sys.stderr)
            report["runs"].append(run)
            continue
        drafter = None
        if run["strategy"] == "failfast":  # the target and its drafter together
            adapters.clear()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            adapter = load(Path(run["path"]), args, require_mask=False)
            drafter = load(Path(run["drafter"]), args)
            run = {**run, "loaded": {"profile": adapter.profile, "attention": adapter.attention, "dtype": str(adapter.dtype)}}
        else:
            if run["model"] not in adapters:
                adapters.clear()  # one 7-8B model on the GPU at a time
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                adapters[run["model"]] = load(Path(run["path"]), args)
            adapter = adapters[run["model"]]
        texts = prompt_texts if args.no_chat else adapter.chat_prompts(prompt_texts)
        record = run_one(adapter, run, texts, problems, args, drafter=drafter)
        del drafter
        report["runs"].append(record)
        if "skipped" in record or "failed" in record:
            why = record.get("skipped") or record["failed"]
            print(f"{run['model']:6s} {run['strategy']:16s} cache={run['cache']:6s} not run: {why}", file=sys.stderr)
        else:
            print(
                f"{run['model']:6s} {run['strategy']:16s} cache={run['cache']:6s} acc {record['accuracy']:6.1%}  "
                f"NFE {record['nfe_mean']:7.1f}  TPF {record['tpf']:5.2f}  TPS {record['tps']:7.1f}",
                file=sys.stderr,
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
