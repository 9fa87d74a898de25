"""Benchmark FailFast (dLLM drafter, AR target) against AR decoding and other drafters.

Greedy decoding, one prompt at a time (batch 1, the latency setting of speculative
decoding), on ``n`` held-out task prompts of the toy zoo, ``max_new_tokens`` 32. Methods:

* ``ar``: the target alone, one cached forward per token (:class:`dloom.ar.target.ARTarget`; the
  baseline every speed-up is relative to);
* ``ar_generate``: the target's ``transformers`` ``generate(do_sample=False)``;
* ``naive_L``: the naive dLLM drafter (Fast-dLLM threshold 0.9, fixed draft length ``L``);
* ``assisted``: ``transformers`` assisted generation with ``toy-ar-small`` as the assistant
  (``generate(..., assistant_model=..., do_sample=False)``, its default dynamic draft length);
* ``failfast``: FailFast (tau 0.45, N 10, N_max 60, L 10, drafter threshold 0.05, small
  blocks of 8), with the drafter's prefix cache (``failfast``) and without
  (``failfast_nocache``), and with drafter threshold 0.9 (``failfast_drafter_tau_0.9``).

Per method: generated tokens, target forwards per generated token, drafter (or assistant)
forwards, accepted draft tokens per verification and their histogram, wall-clock seconds and
the measured speed-up over ``ar`` (median of ``--repeats`` passes, methods interleaved), and
whether every output equals ``ar``'s token for token.

**Modelled** speed-up (labelled so in the JSON): ``time = target forwards x c_target +
drafter forwards x c_drafter``, the way FailFast's public code models latency. Two latency
sets are reported, each stated in the JSON:

* ``measured_toy``: ``c`` = the measured mean latency of one forward of each model on this
  machine (target: one decode step with a KV cache; drafter: one full canvas forward;
  assistant: one decode step), verification forwards costed like decode steps;
* ``gpu_ratio``: ``c_target = 1`` and ``c_drafter = --gpu-ratio`` (default 0.2: a 1.5B
  drafter against a 7B target when decoding is memory-bound, where a forward over 60
  draft tokens costs about what a one-token forward does).

Forwards are counted by forward hooks on the models, for every method alike.

Usage::

    python -m benchmarks.bench_failfast -n 70 --json benchmarks/results/failfast_n70.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dloom import load_model
from dloom.ar.target import ARTarget
from dloom.zoo.tasks import FAMILIES, held_out
from dloom_plugins.failfast import FailFastDecoder

MAX_NEW_TOKENS = 32


class ForwardClock:
    """Counts a module's forwards and the seconds they take (a forward pre-hook and hook)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count, self.seconds, self._started = 0, 0.0, 0.0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _start(self, module, args) -> None:
        self.count += 1
        self._started = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._started


def ar_decode(target: ARTarget, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy AR decoding: one cached forward per token, stop at EOS."""
    ids = torch.tensor([prompt], device=target.model.device)
    target.reset(ids, torch.ones_like(ids), max_new_tokens)
    token = ids[:, -1:]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = target.forward(token, torch.ones_like(token))
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(token))
        if out[-1] in target.model.eos_token_ids:
            break
    target.release()
    return out


def cut(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


def forward_latency(call: Callable[[], Any], repeats: int = 30) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def measure_latencies(target, drafter, assistant, prompt: list[int]) -> dict[str, float]:
    """Seconds per forward: target and assistant decode steps (cached), drafter full canvas."""
    from transformers import DynamicCache

    def decode_step(model) -> Callable[[], Any]:
        ids = torch.tensor([prompt + [3] * 16], device=model.device)
        cache = DynamicCache()
        with torch.no_grad():
            model.model(input_ids=ids, cache=cache, use_cache=True)
        step = torch.tensor([[4]], device=model.device)
        position = torch.tensor([[ids.shape[1]]], device=model.device)

        def call():
            with torch.no_grad():
                model.model(input_ids=step, position_ids=position, cache=cache, use_cache=True)
            cache.crop(-1)

        return call

    canvas = torch.tensor([prompt + [drafter.mask_token_id] * MAX_NEW_TOKENS], device=drafter.device)
    with torch.no_grad():
        drafter_call = lambda: drafter.model(input_ids=canvas)
        latencies = {"target": forward_latency(decode_step(target)), "drafter": forward_latency(drafter_call)}
    if assistant is not None:
        latencies["assistant"] = forward_latency(decode_step(assistant))
    return latencies


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    target = load_model(args.target, dtype=args.dtype, device=args.device, require_mask=False)
    drafter = load_model(args.drafter, dtype=args.dtype, device=args.device)
    models = {"target": target, "drafter": drafter}
    assistant = None
    if args.assistant != "none":
        assistant = load_model(args.assistant, dtype=args.dtype, device=args.device, require_mask=False)
        models["assistant"] = assistant
    counters = {name: ForwardClock(m.model) for name, m in models.items()}
    examples = held_out(args.n, seed=args.seed)
    prompts = target.encode([e.prompt for e in examples])
    eos = target.eos_token_ids
    ar_target = ARTarget(target)

    def failfast(params: dict[str, Any], cache: str) -> Callable[[list[int]], tuple[list[int], dict]]:
        decoder = FailFastDecoder(target, drafter, params=params, max_new_tokens=MAX_NEW_TOKENS, drafter_cache=cache)

        def call(prompt):
            result = decoder.generate([prompt])
            return result.token_lists[0], {"accepted": result.accepted[0], "proposed": result.proposed[0]}

        return call

    def generate(**extra) -> Callable[[list[int]], tuple[list[int], dict]]:
        def call(prompt):
            ids = torch.tensor([prompt], device=target.device)
            out = target.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False, pad_token_id=target.pad_token_id, eos_token_id=list(eos), **extra,
            )
            return cut(out[0, len(prompt):].tolist(), eos), {}

        return call

    methods: dict[str, Callable[[list[int]], tuple[list[int], dict]]] = {
        "ar": lambda p: (ar_decode(ar_target, p, MAX_NEW_TOKENS), {}),
        "ar_generate": generate(),
        "failfast": failfast({}, "prefix"),
        "failfast_nocache": failfast({}, "none"),
        "failfast_drafter_tau_0.9": failfast({"drafter_tau": 0.9}, "prefix"),
    }
    if assistant is not None:
        methods["assisted"] = generate(assistant_model=assistant.model)
    for length in args.naive_lengths:
        methods[f"naive_{length}"] = failfast({"policy": "naive", "naive_length": length, "drafter_tau": 0.9}, "prefix")
    descriptions = {
        "ar": "target alone, one cached forward per token (baseline)",
        "ar_generate": "target alone, transformers generate(do_sample=False)",
        "assisted": f"transformers assisted generation, assistant {args.assistant}",
        "failfast": "FailFast tau 0.45, N 10, N_max 60, L 10, drafter threshold 0.05, small block 8, drafter prefix cache",
        "failfast_nocache": "as failfast, drafter without KV cache",
        "failfast_drafter_tau_0.9": "as failfast, drafter threshold 0.9 (slower, surer drafts)",
        **{f"naive_{L}": f"naive dLLM drafter: Fast-dLLM threshold 0.9, fixed length {L}, drafter prefix cache"
           for L in args.naive_lengths},
    }
    records: dict[str, dict[str, Any]] = {name: {"seconds": []} for name in methods}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for name, method in methods.items():
            before = {k: c.count for k, c in counters.items()}
            rounds: dict[str, list[int]] = {"accepted": [], "proposed": []}
            texts = []
            start = time.perf_counter()
            for prompt in prompts:
                tokens, info = method(prompt)
                texts.append(tokens)
                for key in rounds:
                    rounds[key].extend(info.get(key, []))
            records[name]["seconds"].append(time.perf_counter() - start)
            if repeat == 0:
                outputs[name] = texts
                forwards = {k: c.count - before[k] for k, c in counters.items()}
                records[name].update(forwards=forwards, rounds=rounds)
    reference = outputs["ar"]
    latencies = measure_latencies(target, drafter, assistant, prompts[0])
    gpu = {"target": 1.0, "drafter": args.gpu_ratio, "assistant": args.gpu_ratio}
    results = {}
    for name, record in records.items():
        generated = sum(len(t) for t in outputs[name])
        forwards = record["forwards"]
        helper = "assistant" if name == "assisted" else "drafter"
        seconds = statistics.median(record["seconds"])
        accepted = record["rounds"]["accepted"]

        def modelled(c: dict[str, float], forwards=forwards, helper=helper) -> float:
            return forwards["target"] * c["target"] + forwards[helper] * c[helper]

        results[name] = {
            "description": descriptions[name],
            "generated_tokens": generated,
            "identical_to_ar": sum(a == b for a, b in zip(outputs[name], reference)) / len(reference),
            "accuracy": sum(FAMILIES[e.family].check(e.prompt, target.decode([t for t in o if t not in eos]))
                            for e, o in zip(examples, outputs[name])) / len(examples),
            "target_forwards": forwards["target"],
            "target_forwards_per_token": forwards["target"] / generated,
            "helper_forwards": forwards[helper],
            "helper": helper if name not in ("ar", "ar_generate") else None,
            "rounds": len(accepted) or None,
            "accepted_per_round": statistics.mean(accepted) if accepted else None,
            "proposed_per_round": statistics.mean(record["rounds"]["proposed"]) if accepted else None,
            "accepted_histogram": {str(k): v for k, v in sorted(Counter(accepted).items())} if accepted else None,
            "wall_seconds": seconds,
            "tokens_per_second": generated / seconds,
            "measured_speedup_vs_ar": None,
            "modelled_seconds": {"measured_toy": modelled(latencies), "gpu_ratio": modelled(gpu)},
        }
    base = results["ar"]
    for entry in results.values():
        entry["measured_speedup_vs_ar"] = base["wall_seconds"] / entry["wall_seconds"]
        entry["modelled_speedup_vs_ar"] = {
            k: base["modelled_seconds"][k] / v for k, v in entry["modelled_seconds"].items()
        }
    return {
        "benchmark": "failfast",
        "command": args.command,
        "target": args.target, "drafter": args.drafter, "assistant": args.assistant,
        "n": args.n, "seed": args.seed, "max_new_tokens": MAX_NEW_TOKENS, "batch_size": 1,
        "decoding": "greedy", "repeats": args.repeats, "dtype": args.dtype, "device": args.device,
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "latency_model": {
            "what": "MODELLED time = target forwards x c_target + drafter (or assistant) forwards x c_helper",
            "measured_toy": {f"c_{k}_seconds": v for k, v in latencies.items()},
            "gpu_ratio": {"c_target": 1.0, "c_drafter": args.gpu_ratio, "c_assistant": args.gpu_ratio,
                          "assumption": "memory-bound GPU decoding: a verification forward costs one decode step; "
                                        "drafter / target latency ratio stated by --gpu-ratio"},
        },
        "methods": results,
    }


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=70, help="held-out task prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="toy-ar")
    parser.add_argument("--drafter", default="toy-dllm")
    parser.add_argument("--assistant", default="toy-ar-small", help="'none' skips assisted generation")
    parser.add_argument("--naive-lengths", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--gpu-ratio", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/failfast_n{n}.json")
    args = parser.parse_args()
    args.command = "python -m benchmarks.bench_failfast " + " ".join(sys.argv[1:])
    report = run(args)
    path = args.json or Path(__file__).parent / "results" / f"failfast_n{args.n}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in report["methods"].items():
        print(
            f"{name:18s} identical {r['identical_to_ar']:.0%}  target fwd/token {r['target_forwards_per_token']:.3f}  "
            f"helper fwd {r['helper_forwards']:5d}  acc/round {r['accepted_per_round'] or 0:5.2f}  "
            f"TPS {r['tokens_per_second']:7.1f}  measured x{r['measured_speedup_vs_ar']:.2f}  "
            f"modelled x{r['modelled_speedup_vs_ar']['measured_toy']:.2f} (toy) x{r['modelled_speedup_vs_ar']['gpu_ratio']:.2f} (gpu ratio)"
        )
    print(f"wrote {path}")
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    """The report's table in Markdown (what docs/strategies/failfast.md shows)."""
    lines = [
        "| method | identical to AR | target forwards / token | drafter or assistant forwards "
        "| accepted / round | tokens/s | measured speed-up | modelled (toy latencies) | modelled (GPU ratio) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["methods"].items():
        accepted = "–" if r["accepted_per_round"] is None else f"{r['accepted_per_round']:.2f}"
        lines.append(
            f"| `{name}` | {r['identical_to_ar']:.0%} | {r['target_forwards_per_token']:.3f} | "
            f"{r['helper_forwards']} | {accepted} | {r['tokens_per_second']:.1f} | "
            f"{r['measured_speedup_vs_ar']:.2f}× | {r['modelled_speedup_vs_ar']['measured_toy']:.2f}× | "
            f"{r['modelled_speedup_vs_ar']['gpu_ratio']:.2f}× |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
