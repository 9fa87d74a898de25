"""GPU probe: what decoding costs on models of the released shapes, with no download.

Builds random-weight models with the real shapes of LLaDA-8B, Dream-7B, SDAR-4B and the
Qwen2.5-7B target from configs in each family's own format (loaded through dloom's native
mapping, :mod:`dloom.model.checkpoints`), in bfloat16, one at a time, and records to JSON:

- ``forward_ms``: one forward's time versus extra draft rows (batch 1..16) and extra draft
  columns (0..4 blocks appended): Spiffy's cost curve;
- ``decode``: for quota, threshold, Fréchet and Spiffy with each cache mode, forwards,
  wall time over forward time (the engine's overhead per forward, timed with
  ``sync_timing=True``) and host synchronisations per generation (a second, untimed
  generation under ``torch.cuda.set_sync_debug_mode("warn")``, its warnings counted);
- ``peak_bytes``: peak GPU memory of each model's section;
- ``cuda_graph``: whether one uncached forward can be captured in a CUDA graph (and the
  error when not).

Random weights decode nonsense, so no quality is measured: only costs. Meant for one large
GPU in under 8 minutes (``--budget-s`` stops early, recording what was skipped)::

    python -m benchmarks.gpu.probe --out benchmarks/results/gpu_probe.json

``--smoke`` runs the same code on the CPU with tiny widths (seconds; the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

#: Released configs in each family's own format (the keys that set the shapes).
SHAPES: dict[str, dict[str, Any]] = {
    "llada-8b": {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": 4096, "n_heads": 32,
        "n_kv_heads": 32, "n_layers": 32, "mlp_hidden_size": 12288, "vocab_size": 126464,
        "embedding_size": 126464, "max_sequence_length": 4096, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "weight_tying": False, "mask_token_id": 126336,
        "eos_token_id": 126081, "pad_token_id": 126081,
    },
    "dream-7b": {
        "model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "mask_token_id": 151666, "eos_token_id": 151643, "pad_token_id": 151643,
    },
    "sdar-4b": {
        "model_type": "sdar", "architectures": ["SDARForCausalLM"], "hidden_size": 2560,
        "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "block_size": 4,
        "max_position_embeddings": 32768, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "mask_token_id": 151669, "eos_token_id": 151643,
        "pad_token_id": 151643,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "eos_token_id": 151645,
    },
}
#: Widths of ``--smoke`` (vocabularies stay real, so the real special ids exist).
SMOKE_WIDTHS = {
    "d_model": 32, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "mlp_hidden_size": 64,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
}
STRATEGIES = (("quota", {}), ("threshold", {"tau": 0.9}), ("frechet", {"delta": 0.0}), ("spiffy", {"budget": 10}))
CACHES = ("none", "prefix", "dual")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny widths on the CPU, float32")
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    parser.add_argument("--prompt-length", type=int, default=None, help="default 256 (smoke 8)")
    parser.add_argument("--gen-length", type=int, default=None, help="default 64 (smoke 8)")
    parser.add_argument("--block-length", type=int, default=None, help="default 32 (smoke 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed forwards per point (default 5, smoke 1)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new sections after this")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: stdout)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(SHAPES))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; allowed: {', '.join(SHAPES)}")
    defaults = (8, 8, 4, 1) if args.smoke else (256, 64, 32, 5)
    for name, value in zip(("prompt_length", "gen_length", "block_length", "repeats"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def family_config(name: str, smoke: bool) -> dict[str, Any]:
    """The released config of ``name`` (tiny widths with ``smoke``)."""
    config = dict(SHAPES[name])
    if smoke:
        config.update({k: v for k, v in SMOKE_WIDTHS.items() if k in config})
    return config


def build(name: str, smoke: bool, device, dtype):
    """A random-weight model of ``name``'s shape and its adapter, built on ``device``
    directly (no weights on disk): the config goes through the same mapping as a checkpoint."""
    import torch
    import transformers

    from dloom import ModelAdapter, get_registry
    from dloom.model.checkpoints import native_config

    raw = family_config(name, smoke)
    family = get_registry().families.detect(raw)
    profile, layout = family.profile, family.layout
    config = native_config(layout, raw) if layout else transformers.AutoConfig.for_model(
        raw["model_type"], **{k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    )
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    adapter = ModelAdapter(
        model, mask_token_id=raw.get("mask_token_id"), eos_token_ids=(int(raw["eos_token_id"]),),
        pad_token_id=int(raw.get("pad_token_id", raw["eos_token_id"])),
        shift_logits=bool(profile.shift_logits), attention=profile.attention or "bidirectional",
        name=name, default_block_length=profile.trained_block_length(raw),
        block_alignment=profile.block_alignment, profile=profile.name,
    )
    return adapter


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_forward(model, ids, mask, repeats: int) -> float:
    """Median milliseconds of one forward."""
    import torch

    times = []
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # warm-up
        for _ in range(repeats):
            synchronize(ids.device)
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            synchronize(ids.device)
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def forward_costs(adapter, args) -> list[dict[str, Any]]:
    """Forward time versus extra rows and extra columns (the block's draft copies)."""
    import torch

    device = adapter.device
    rows_list = (1, 2) if args.smoke else (1, 2, 4, 8, 16)
    columns_list = (0, args.block_length) if args.smoke else tuple(args.block_length * k for k in range(5))
    points = []
    for rows in rows_list:
        for extra in columns_list:
            length = args.prompt_length + args.block_length + extra
            ids = torch.randint(0, 1000, (rows, length), device=device)
            mask = torch.ones(rows, length, dtype=torch.long, device=device)
            points.append({"rows": rows, "extra_columns": extra, "length": length,
                           "ms": time_forward(adapter.model, ids, mask, args.repeats)})
    return points


def count_syncs(run, device) -> int | None:
    """The host synchronisations CUDA reports while ``run()`` runs (``None`` off CUDA, where
    they cannot be observed; ``run`` is then not called)."""
    import torch

    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def decode_costs(adapter, args, deadline: float) -> list[dict[str, Any]]:
    """Per strategy and cache mode: forwards, wall over forward time, host syncs."""
    import torch

    from dloom import DiffusionDecoder
    from dloom.errors import DloomError

    records = []
    prompts = torch.randint(0, 1000, (2, args.prompt_length)).tolist()
    for strategy, params in STRATEGIES:
        for cache in CACHES:
            record: dict[str, Any] = {"strategy": strategy, "params": params, "cache": cache}
            if time.perf_counter() > deadline:
                records.append({**record, "skipped": "time budget spent"})
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # uncalibrated Spiffy graph
                    timed, plain = (
                        DiffusionDecoder(
                            adapter, strategy, params=params, gen_length=args.gen_length,
                            block_length=args.block_length, cache=cache, sync_timing=timing,
                        )
                        for timing in (True, False)
                    )
                if not args.smoke:
                    timed.generate(prompts[:1])  # warm-up
                result = timed.generate(prompts)
                # counted without sync_timing, whose own synchronisations would be counted too
                syncs = count_syncs(lambda: plain.generate(prompts), adapter.device)  # noqa: B023 - called at once
            except DloomError as error:
                records.append({**record, "skipped": str(error)})
                continue
            forward = result.hook_seconds["forward"]
            records.append({
                **record, "forwards": result.forwards, "wall_s": result.wall_seconds,
                "forward_s": forward, "wall_over_forward": result.wall_seconds / forward if forward else None,
                "host_syncs": syncs,
            })
    return records


def graph_capture(adapter, args) -> dict[str, Any]:
    """Whether an uncached forward of one block-sized input is capturable in a CUDA graph."""
    import torch

    if adapter.device.type != "cuda":
        return {"captured": None, "why": "no CUDA device"}
    length = args.prompt_length + args.block_length
    ids = torch.randint(0, 1000, (1, length), device=adapter.device)
    try:
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                adapter.model(input_ids=ids)  # warm-up on a side stream, as capture requires
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = adapter.model(input_ids=ids).logits
            graph.replay()
            torch.cuda.synchronize()
        return {"captured": True, "logits_shape": list(out.shape)}
    except Exception as error:  # capture fails by raising; the probe records why
        return {"captured": False, "why": f"{type(error).__name__}: {error}"[:500]}


def probe_model(name: str, args, device, dtype, deadline: float) -> dict[str, Any]:
    import torch

    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    adapter = build(name, args.smoke, device, dtype)
    record: dict[str, Any] = {
        "model": name, "profile": adapter.profile, "attention": adapter.attention,
        "parameters": sum(p.numel() for p in adapter.model.parameters()),
        "build_s": time.perf_counter() - start,
        "forward_ms": forward_costs(adapter, args),
    }
    if adapter.mask_token_id is not None:
        record["decode"] = decode_costs(adapter, args, deadline)
    record["cuda_graph"] = graph_capture(adapter, args)
    record["peak_bytes"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    record["section_s"] = time.perf_counter() - start
    del adapter
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    started = time.perf_counter()
    deadline = started + args.budget_s
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "smoke": args.smoke,
        "settings": {k: args.__dict__[k] for k in ("prompt_length", "gen_length", "block_length", "repeats")},
        "models": [],
    }
    for name in args.models.split(","):
        if time.perf_counter() > deadline:
            report["models"].append({"model": name, "skipped": "time budget spent"})
            continue
        print(f"probing {name} on {device} ...", file=sys.stderr)
        report["models"].append(probe_model(name, args, device, dtype, deadline))
    report["wall_s"] = time.perf_counter() - started
    text = json.dumps(report, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
