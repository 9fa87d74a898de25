"""Benchmark the decode engine itself: what the loop costs beyond the model's forwards.

For each strategy (quota, threshold, Fréchet, spiffy+threshold) x cache mode (none, prefix,
dual) x batch size x generation length, one run measures:

- ``overhead``: wall time / time inside the model's forwards (1.0 = the loop costs nothing);
- ``wasted``: the share of row-forwards (rows summed over every model call, counted by a
  hook on the model) spent on rows that took no kernel step: ``1 - sum(NFE) / row-forwards``
  (plain rules; a speculative step's layout rows are drafts, not waste, so it is left out);
- ``loop/step``: the time outside the model's forwards per step, ``(wall - forward) / steps``
  (the loop's own cost; the table computes it from the recorded times);
- ``model overhead``: wall time / time inside the model's own ``forward`` calls (timed by
  hooks on the model: unlike ``overhead``, the preparation of a forward's inputs, masks and
  cache view counts as loop);
- ``ops/step``: torch calls the decoder makes outside the model per step (functions,
  methods and tensor attributes, counted by a ``TorchFunctionMode`` over one ``generate``
  of the first batch): an exact count of the loop's dispatches, unlike its times on a shared
  machine;
- ``syncs_per_forward``: device-to-host reads of the decoder (``.tolist()``, ``.item()``,
  ``bool``/``int`` of a tensor, ``torch.nonzero``) per step, counted by patching them;
- ``memory``: the peak resident memory one ``generate`` of a batch adds, over the peak a
  bare ``model(input_ids)`` forward of the same shape adds: the batch's own ``(B, L)``, ``B``
  prompts of the padded length ``L`` (its full logits kept); Linux only (the peak is reset
  through ``/proc/self/clear_refs``). Run as a script, the benchmark restarts itself with
  ``MALLOC_MMAP_THRESHOLD_`` fixed, so that glibc returns freed tensors to the system and
  the peak follows live memory. ``memory_rows`` is the most rows one model call of that
  ``generate`` held (more than ``B`` for a speculative layout evaluated in one call), and
  ``memory_vs_rows`` the same peak over a bare forward of ``(memory_rows, L)`` (the widest
  call's rows at full length; equal to ``memory`` when no call held more than ``B``);
- for threshold without a cache, ``vs_hand_loop``: dloom's wall time over that of a minimal
  hand-written Fast-dLLM threshold loop decoding the same prompts (the yardstick a user
  would write: block by block, every row of the batch until the block is done).

Usage::

    python -m benchmarks.bench_engine --json engine.json                 # the default grid
    python -m benchmarks.bench_engine --batch 1 8 --gen 64 --json x.json  # a reduced grid
    python -m benchmarks.bench_engine --batch 1 --static-shapes --json s.json  # static shapes

It runs on the toy zoo's ``toy-dllm`` (trained: realistic confidences, so threshold and
Fréchet take realistic steps; context 128, so gen 64 at most) on the CPU. ``--model
random-WxN`` (e.g. ``random-512x8``, the issue's second yardstick) is a randomly initialised
bidirectional Llama of width ``W`` and ``N`` layers (heads of 64, FFN 3W) with toy-dllm's
tokenizer and conventions: its forwards cost what a larger model's do, while its flat
confidences make threshold and Fréchet commit about one position a step. Run it against an
older checkout (``PYTHONPATH`` pointing at its package) for before/after figures: nothing
here depends on the engine's internals. ``test_engine_step`` is a pytest-benchmark case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Any

import torch

from dloom import DiffusionDecoder, load_model
from dloom.zoo.tasks import held_out

STRATEGIES = {
    "quota": ("quota", {}),
    "threshold": ("threshold", {"tau": 0.9}),
    "frechet": ("frechet", {"delta": 0.0}),
    # Spiffy at the fixed budget these figures were measured at (the default is auto)
    "spiffy+threshold": ("spiffy+threshold", {"tau": 0.9, "spiffy.budget": 10}),
    # every verification in calls of the batch's rows, however small (the default keeps a
    # verification of fewer than spiffy.call_tokens query tokens in one call)
    "spiffy+threshold,call_tokens=0": ("spiffy+threshold", {"tau": 0.9, "spiffy.budget": 10, "spiffy.call_tokens": 0}),
}
CACHES = ("none", "prefix", "dual")
_SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "nonzero")


@contextmanager
def counting_syncs(model: torch.nn.Module):
    """Count the decoder's device-to-host reads (the model's own are not counted)."""
    counts = {"decoder": 0}
    inside = [0]
    originals = {name: getattr(torch.Tensor, name) for name in _SYNC_METHODS}
    nonzero = torch.nonzero

    def wrap(original):
        def counted(*args, **kwargs):
            if not inside[0]:
                counts["decoder"] += 1
            return original(*args, **kwargs)
        return counted

    pre = model.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1))
    post = model.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1))
    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(original))
    torch.nonzero = wrap(nonzero)
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = nonzero
        pre.remove()
        post.remove()


@contextmanager
def model_time(model: torch.nn.Module):
    """Seconds spent inside ``model``'s forward calls (outermost calls only)."""
    spent = {"seconds": 0.0}
    depth = [0, 0.0]

    def before(*_):
        if not depth[0]:
            depth[1] = time.perf_counter()
        depth[0] += 1

    def after(*_):
        depth[0] -= 1
        if not depth[0]:
            spent["seconds"] += time.perf_counter() - depth[1]

    pre, post = model.register_forward_pre_hook(before), model.register_forward_hook(after)
    try:
        yield spent
    finally:
        pre.remove()
        post.remove()


def ops_per_step(adapter, decoder, chunk: list[str]) -> float:
    """Torch calls outside the model per step over one ``generate`` of ``chunk``."""
    from torch.overrides import TorchFunctionMode

    inside, count = [0], [0]

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                count[0] += 1
            return func(*args, **(kwargs or {}))

    pre = adapter.model.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1))
    post = adapter.model.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1))
    try:
        with Counting():
            result = decoder.generate(chunk)
    finally:
        pre.remove()
        post.remove()
    return count[0] / result.forwards


MMAP_THRESHOLD = "65536"  # bytes: larger allocations are mapped, and unmapped when freed


def _status_mib(field: str) -> float:
    text = open("/proc/self/status").read()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) / 1024


def peak_memory_mib(call) -> tuple[float | None, Any]:
    """Peak resident memory (MiB) above the current level while ``call()`` runs, and its
    result; ``None`` where ``/proc/self/clear_refs`` cannot reset the peak (not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current resident size
    except OSError:
        return None, call()
    base = _status_mib("VmRSS")
    out = call()
    return _status_mib("VmHWM") - base, out


def bare_forward_mib(adapter, shape: tuple[int, int]) -> float | None:
    """Peak memory (MiB) a bare ``model(input_ids)`` forward of ``shape`` adds, its full
    ``(B, L, V)`` logits kept (after one warm-up forward of that shape)."""
    ids = torch.randint(0, adapter.mask_token_id, shape)
    with torch.no_grad():
        adapter.model(input_ids=ids)
        bare, _ = peak_memory_mib(lambda: adapter.model(input_ids=ids).logits)
    return bare


def memory_ratio(adapter, decoder, chunk: list[str], calls: list[int]) -> dict[str, Any]:
    """Peak memory of one ``generate`` of ``chunk`` over that of a bare forward of its
    ``(B, L)`` shape, and over a bare forward of its widest model call's rows (see the
    module docstring)."""
    first = len(calls)
    generated, result = peak_memory_mib(lambda: decoder.generate(chunk))
    rows = max(calls[first:], default=0)
    batch, length = result.sequences.shape
    bare = bare_forward_mib(adapter, (batch, length))
    wide = bare if rows <= batch else bare_forward_mib(adapter, (rows, length))
    ratio = lambda over: generated / over if generated is not None and over else None
    return {
        "memory_mib": generated, "bare_memory_mib": bare, "memory": ratio(bare),
        "memory_rows": rows, "memory_shape": [batch, length],
        "bare_rows_memory_mib": wide, "memory_vs_rows": ratio(wide),
    }


RANDOM_MODEL = re.compile(r"random-(\d+)x(\d+)")


def bench_model(name: str):
    """The adapter ``--model`` names: a zoo name or a checkpoint directory, or ``random-WxN``
    (see the module docstring; seeded, so every run builds the same weights)."""
    match = RANDOM_MODEL.fullmatch(name)
    if match is None:
        return load_model(name)
    from transformers import LlamaForCausalLM

    toy = load_model("toy-dllm")
    width, layers = map(int, match.groups())
    if width % 64:
        raise SystemExit(f"--model {name}: the width must be a multiple of 64 (heads of 64)")
    config = toy.model.config.to_dict()
    config.update(hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers, head_dim=64,
                  num_attention_heads=width // 64, num_key_value_heads=width // 64, dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(type(toy.model.config)(**config)).eval()
    return dataclasses.replace(toy, model=model, name=name)


def prompts_for(adapter, count: int) -> list[str]:
    return [example.prompt for example in held_out(count)]


def hand_threshold_loop(adapter, prompts: list[str], gen_length: int, block_length: int, tau: float) -> int:
    """A minimal hand-written Fast-dLLM threshold loop (no cache, no early stop): left-pad,
    then for each block, forward the whole batch until every row's block is decoded; commit
    positions with confidence > tau, else each row's most confident one. Returns its
    forwards."""
    steps = 0
    model, mask_id = adapter.model, adapter.mask_token_id
    rows = adapter.encode(prompts)
    width = max(len(r) for r in rows)
    ids = torch.tensor([[adapter.pad_token_id] * (width - len(r)) + r + [mask_id] * gen_length for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * (len(r) + gen_length) for r in rows])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for start in range(width, width + gen_length, block_length):
            end = start + block_length
            while bool((ids[:, start:end] == mask_id).any()):
                logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
                steps += 1
                if adapter.shift_logits:
                    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
                probs = torch.softmax(logits[:, start:end].float(), dim=-1)
                probs[..., mask_id] = 0
                confidence, candidate = probs.max(-1)
                masked = ids[:, start:end] == mask_id
                confidence = torch.where(masked, confidence, -1.0)
                commit = masked & (confidence > tau)
                top = torch.zeros_like(commit).scatter_(1, confidence.argmax(-1, keepdim=True), True)
                commit |= top & masked & ~commit.any(-1, keepdim=True)
                ids[:, start:end] = torch.where(commit, candidate, ids[:, start:end])
    return steps


def run_case(adapter, strategy: str, cache: str, batch: int, gen_length: int, block_length: int,
             prompts: list[str], static_shapes: bool = False) -> dict[str, Any]:
    name, params = STRATEGIES[strategy]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder = DiffusionDecoder(
            adapter, name, gen_length=gen_length, block_length=block_length, cache=cache, params=params,
            **({"static_shapes": True} if static_shapes else {}),  # an older engine has no such setting
        )
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    decoder.generate(chunks[0])  # warm-up
    calls: list[int] = []
    hook = adapter.model.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    wall = forward = 0.0
    nfe = steps = 0
    try:
        with counting_syncs(adapter.model) as syncs, model_time(adapter.model) as inside:
            for chunk in chunks:
                started = time.perf_counter()
                result = decoder.generate(chunk)
                wall += time.perf_counter() - started
                forward += result.hook_seconds["forward"]
                nfe += int(result.nfe.sum())
                steps += result.forwards
        timed_calls = len(calls)
        memory = memory_ratio(adapter, decoder, chunks[0], calls)  # outside the sync count
    finally:
        hook.remove()
    ops = ops_per_step(adapter, decoder, chunks[0])
    row = {
        "strategy": strategy, "cache": cache, "batch": batch, "gen_length": gen_length,
        "block_length": block_length, "prompts": len(prompts), "steps": steps,
        "model_calls": timed_calls, "row_forwards": sum(calls[:timed_calls]), "nfe": nfe,
        "static_shapes": static_shapes,
        "wall_s": wall, "forward_s": forward, "overhead": wall / forward if forward else None,
        "model_s": inside["seconds"], "model_overhead": wall / inside["seconds"], "ops_per_step": ops,
        "syncs_per_forward": syncs["decoder"] / steps,
        "wasted": None if strategy.startswith("spiffy") else 1 - nfe / sum(calls[:timed_calls]),
        **memory,
    }
    if strategy == "threshold" and cache == "none":
        started = time.perf_counter()
        hand_steps = sum(hand_threshold_loop(adapter, c, gen_length, block_length, 0.9) for c in chunks)
        row["hand_loop_s"] = time.perf_counter() - started
        row["hand_loop_steps"] = hand_steps
        row["vs_hand_loop"] = wall / row["hand_loop_s"]  # whole decode (dloom stops rows at EOS)
        row["vs_hand_loop_per_step"] = (wall / steps) / (row["hand_loop_s"] / hand_steps)
    return row


def markdown(after: list[dict[str, Any]], before: list[dict[str, Any]] | None = None) -> str:
    """A markdown table of the rows, with a run of an older engine side by side when given
    (matched on strategy, cache, batch, generation and block length)."""
    key = lambda r: (r["strategy"], r["cache"], r["batch"], r["gen_length"], r["block_length"],
                     r.get("static_shapes", False))
    old = {key(r): r for r in before or []}
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    times = lambda v: "-" if v is None else f"{v:.2f}×"
    lines = [
        "| strategy | cache | batch | gen | block | wall (s) | overhead | model overhead | wasted | loop/step (ms) | ops/step | syncs/forward | memory | vs hand loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in after:
        was = old.get(key(row))
        for each in (row, was or {}):
            if "wall_s" in each:  # time outside the model per step
                each.setdefault("loop_ms", 1000 * (each["wall_s"] - each["forward_s"]) / each["steps"])
        pair = lambda field, fmt: (  # noqa: B023 - used in this iteration only
            fmt(row.get(field)) if was is None else f"{fmt(was.get(field))} → {fmt(row.get(field))}"  # noqa: B023
        )
        hand = "-"
        if "vs_hand_loop" in row:
            hand = f"{row['vs_hand_loop']:.2f}× ({row['vs_hand_loop_per_step']:.2f}× per step)"
        lines.append(
            f"| {row['strategy']} | {row['cache']} | {row['batch']} | {row['gen_length']} | "
            f"{row['block_length']} | {pair('wall_s', lambda v: f'{v:.2f}')} | "
            f"{pair('overhead', lambda v: f'{v:.2f}×')} | {pair('model_overhead', times)} | {pair('wasted', pct)} | "
            f"{pair('loop_ms', lambda v: f'{v:.2f}')} | {pair('ops_per_step', lambda v: '-' if v is None else f'{v:.0f}')} | "
            f"{pair('syncs_per_forward', lambda v: f'{v:.2f}')} | {pair('memory', times)} | {hand} |"
        )
    return "\n".join(lines) + "\n"


def memory_markdown(after: list[dict[str, Any]], before: list[dict[str, Any]] | None = None) -> str:
    """The memory figures of the rows as a markdown table (an older run's side by side when
    given, as in :func:`markdown`): the peak over a bare forward of the batch's ``(B, L)``,
    and over one of the widest model call's ``(rows, L)``."""
    key = lambda r: (r["strategy"], r["cache"], r["batch"], r["gen_length"], r["block_length"])
    old = {key(r): r for r in before or []}
    fields = (
        ("memory_mib", lambda v: f"{v:.1f}"), ("bare_memory_mib", lambda v: f"{v:.1f}"),
        ("memory", lambda v: f"{v:.2f}×"), ("memory_rows", str), ("memory_vs_rows", lambda v: f"{v:.2f}×"),
    )
    lines = [
        "| strategy | cache | batch | L | peak (MiB) | bare (B, L) (MiB) | memory | rows per call | vs bare (rows, L) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in after:
        was = old.get(key(row))
        cells = []
        for field, fmt in fields:
            now = "-" if row.get(field) is None else fmt(row[field])
            if was is not None:
                then = was.get(field)
                if field == "memory_vs_rows" and then is None and was.get("memory_rows", 0) <= row["batch"]:
                    then = was.get("memory")  # older runs: no call wider than the batch
                now = f"{'-' if then is None else fmt(then)} → {now}"
            cells.append(now)
        lines.append(
            f"| {row['strategy']} | {row['cache']} | {row['batch']} | {row['memory_shape'][1]} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="toy-dllm", help="zoo name, checkpoint directory or random-WxN")
    parser.add_argument("--strategies", nargs="+", default=[name for name in STRATEGIES if "," not in name])
    parser.add_argument("--caches", nargs="+", default=list(CACHES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--gen", nargs="+", type=int, default=[64])
    parser.add_argument("--block", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--static-shapes", action="store_true", help="decode with static_shapes=True")
    parser.add_argument(
        "--report", nargs="+", metavar="JSON",
        help="print the markdown table of a result file (after), or of an older run's and a "
        "newer run's side by side (before after), instead of measuring",
    )
    parser.add_argument(
        "--memory-report", nargs="+", metavar="JSON",
        help="as --report, the memory figures only (peak over the batch's bare forward and "
        "over the widest call's)",
    )
    args = parser.parse_args(argv)
    if args.report or args.memory_report:
        table = markdown if args.report else memory_markdown
        loaded = [json.load(open(path))["rows"] for path in args.report or args.memory_report]
        print(table(loaded[-1], loaded[0] if len(loaded) > 1 else None), end="")
        return loaded[-1]
    torch.set_num_threads(args.threads)
    adapter = bench_model(args.model)
    prompts = prompts_for(adapter, args.prompts)
    rows = []
    for gen_length in args.gen:
        for block_length in args.block:
            for strategy in args.strategies:
                for cache in args.caches:
                    for batch in args.batch:
                        row = run_case(adapter, strategy, cache, batch, gen_length, block_length, prompts,
                                       args.static_shapes)
                        rows.append(row)
                        wasted = "-" if row["wasted"] is None else f"{row['wasted']:.1%}"
                        print(
                            f"{strategy:17s} {cache:6s} B={batch:<3d} G={gen_length} K={block_length:<3d} "
                            f"overhead {row['overhead']:.2f}x (model {row['model_overhead']:.2f}x) "
                            f"ops/step {row['ops_per_step']:.0f} wasted {wasted:>6s} "
                            f"syncs/fwd {row['syncs_per_forward']:.2f} memory "
                            + ("-" if row["memory"] is None else f"{row['memory']:.2f}x")
                            + (f" vs hand loop {row['vs_hand_loop']:.2f}x (per step "
                               f"{row['vs_hand_loop_per_step']:.2f}x)" if "vs_hand_loop" in row else ""),
                            flush=True,
                        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "threads": args.threads, "torch": torch.__version__,
                       "rows": rows}, handle, indent=1)
    return rows


def test_engine_step(benchmark):
    """pytest-benchmark: one threshold generation of 8 prompts on toy-dllm, no cache."""
    adapter = load_model("toy-dllm")
    decoder = DiffusionDecoder(adapter, "threshold", gen_length=32, block_length=8)
    prompts = prompts_for(adapter, 8)
    result = benchmark(decoder.generate, prompts)
    benchmark.extra_info["nfe"] = int(result.nfe.sum())
    benchmark.extra_info["median_overhead"] = statistics.median(
        [result.wall_seconds / result.hook_seconds["forward"]]
    )


if __name__ == "__main__":
    if sys.platform == "linux" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        # glibc reads it at start-up only: restart with it (see ``memory`` above)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    main()
