"""Average the weights of several checkpoints of one model into a new checkpoint.

Each floating-point tensor of the output is the plain mean (in float32, saved in the first
source's dtype) of the same tensor in every source; every other file (config, tokenizer,
``progress.json``) is copied from the *last* source, whose ``progress.json`` gains an
``"averaged_from"`` list naming the sources and their steps. ``training-weights/`` of the last
source (the optimizer's weights of an ``--ema`` run) is copied too, so ``--resume`` from the
output continues the last source's optimizer weights, its average going on from the output's::

    python training/average.py OUT SRC1 SRC2 ... [--weights 1,1,2]

``--weights`` gives each source a relative weight (default: equal). The sources must hold the
same tensors with the same shapes (a tensor missing from one of them, or of another shape, is an
error); their configs are not compared.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def average(sources: list[Path], weights: list[float]) -> dict[str, torch.Tensor]:
    """The weighted mean of the sources' ``model.safetensors``, tensor by tensor."""
    if len(weights) != len(sources):
        raise ValueError(f"{len(weights)} weights for {len(sources)} sources")
    if any(w <= 0 for w in weights):
        raise ValueError(f"weights must be positive, got {weights}")
    states = [load_file(str(s / WEIGHTS)) for s in sources]
    names = set(states[0])
    for source, state in zip(sources[1:], states[1:]):
        if set(state) != names:
            raise ValueError(f"{source} holds other tensors than {sources[0]}: {sorted(names ^ set(state))}")
    total = sum(weights)
    out = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            out[name] = first
            continue
        shapes = {tuple(state[name].shape) for state in states}
        if len(shapes) > 1:
            raise ValueError(f"{name} has shapes {sorted(shapes)} across the sources")
        mean = sum(w / total * state[name].float() for w, state in zip(weights, states))
        out[name] = mean.to(first.dtype).contiguous()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("sources", type=Path, nargs="+")
    parser.add_argument("--weights", default=None, help="comma-separated relative weights, one per source")
    args = parser.parse_args()
    weights = [float(w) for w in args.weights.split(",")] if args.weights else [1.0] * len(args.sources)
    state = average(args.sources, weights)
    last = args.sources[-1]
    args.out.mkdir(parents=True, exist_ok=True)
    for f in last.iterdir():
        if f.is_file() and f.name != WEIGHTS:
            shutil.copy(f, args.out / f.name)
    if (last / "training-weights").is_dir():
        shutil.copytree(last / "training-weights", args.out / "training-weights", dirs_exist_ok=True)
    save_file(state, str(args.out / WEIGHTS), metadata={"format": "pt"})
    progress_path = args.out / "progress.json"
    if progress_path.exists():
        progress = json.loads(progress_path.read_text())
        progress["averaged_from"] = [
            {"source": str(s), "steps": json.loads((s / "progress.json").read_text()).get("steps")
             if (s / "progress.json").exists() else None, "weight": w}
            for s, w in zip(args.sources, weights)
        ]
        progress_path.write_text(json.dumps(progress, indent=2) + "\n")
    print(f"averaged {len(args.sources)} checkpoints into {args.out}")


if __name__ == "__main__":
    main()
