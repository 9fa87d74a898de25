"""Probes of a long-answer dLLM checkpoint while it trains (the figures in ``training/README.md``).

Each probe decodes held-out prompts (``held_out(400, seed=0)`` of the long-answer suite, the
first ``-n`` of each family) greedily at one token per step, as the zoo's evaluation does::

    python training/probe.py families training/checkpoints/long-dllm -n 10
    python training/probe.py families training/checkpoints/long-dllm -n 10 --order left-to-right
    python training/probe.py steps training/checkpoints/long-dllm -n 16
    python training/probe.py steps training/checkpoints/long-dllm -n 25 --family word
    python training/probe.py prefix training/checkpoints/long-dllm -n 16
    python training/probe.py tales training/checkpoints/long-dllm -n 10

* ``families``: exact answers per family, and the share of the answer's commits that were
  *out of order* (a position committed while a position to its left in the same block was
  still masked). ``--order left-to-right`` decodes strictly left to right instead: what the
  model knows when it never has to fill a gap before its right-hand context.
* ``steps``: ``--family`` answers (``chain`` or ``word``) exact, and their arithmetic steps
  right (``a+b=c`` with ``c`` the true sum, read from the model's own answer), by the number
  of digits of the true result.
* ``prefix``: the prefix state of every ``=`` of the ``chain`` answers (the true answer up
  to the ``=``, every later position masked): is the result's first token right?
* ``tales``: for each failing ``tale``, the commit that broke it: the first after which no
  tale of the grammar (its 360 answers for the prompt) fits the committed positions, with
  its confidence and the positions to its left still masked in its block.

The checkpoint's files are copied first, so a save in progress is never read half-written;
prompts and answers are encoded with the checkpoint's own tokenizer (characters or words).
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from dloom.zoo import long_tasks
from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import Example, held_out
from dloom_training.codec import Codec
from dloom_training.decoding import DECODING_ORDERS, trace_dllm
from dloom_training.rows import (
    answer_region,
    encode_prompts,
    position_ids,
    region_logits,
)

_EQUATION = re.compile(r"(\d+)([+-])(\d+)=(\d+)")


def load(checkpoint: Path) -> tuple[LlamaForCausalLM, Codec]:
    """The checkpoint's model in float32 and its tokenizer's codec, from a copy of its files."""
    with tempfile.TemporaryDirectory() as tmp:
        for f in checkpoint.iterdir():
            if f.is_file():
                shutil.copy(f, tmp)
        return LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval(), Codec.saved(tmp)


def examples(family: str, n: int) -> list[Example]:
    """The first ``n`` held-out prompts of ``family``."""
    return [e for e in held_out(400, seed=0, suite=long_tasks.FAMILIES) if e.family == family][:n]


def out_of_order(region: torch.Tensor, committed_at: torch.Tensor, block_length: int) -> tuple[int, int]:
    """Commits of answer positions (through the first ``<eos>``) made while a position to
    their left in the same block was still masked, and all such commits, over the rows."""
    g = region.shape[1]
    start = torch.arange(g) // block_length * block_length
    left_later = torch.stack([
        (committed_at[:, start[j]:j] > committed_at[:, j : j + 1]).any(-1) for j in range(g)
    ], dim=1)
    eos = (region == tok.EOS_ID).long()
    first_eos = torch.where(eos.any(-1), eos.argmax(-1), g)
    answer = torch.arange(g)[None, :] <= first_eos[:, None]
    return int((left_later & answer).sum()), int(answer.sum())


def probe_families(model: LlamaForCausalLM, codec: Codec, n: int, order: str) -> None:
    block_length = getattr(model.config, "dloom", {}).get("block_length", 32)
    for family, task in long_tasks.FAMILIES.items():
        batch = examples(family, n)
        trace = trace_dllm(model, [e.prompt for e in batch], order, codec)
        texts = [codec.decode(row) for row in trace.region.tolist()]
        exact = sum(task.check(e.prompt, t) for e, t in zip(batch, texts))
        late, total = out_of_order(trace.region, trace.step, block_length)
        print(f"{family}: {exact}/{len(batch)} exact, {late / total:.0%} of commits out of order;"
              f" e.g. {texts[0][:100]!r}", flush=True)


def probe_steps(model: LlamaForCausalLM, codec: Codec, n: int, family: str, order: str) -> None:
    batch = examples(family, n)
    trace = trace_dllm(model, [e.prompt for e in batch], order, codec)
    texts = [codec.decode(row) for row in trace.region.tolist()]
    by_digits: dict[int, list[bool]] = {}
    for t in texts:
        for a, op, b, c in _EQUATION.findall(t):
            true = int(a) + int(b) if op == "+" else int(a) - int(b)
            by_digits.setdefault(len(str(true)), []).append(true == int(c))
    exact = sum(long_tasks.FAMILIES[family].check(e.prompt, t) for e, t in zip(batch, texts))
    steps = [right for rights in by_digits.values() for right in rights]
    split = ", ".join(f"{d}-digit {sum(r)}/{len(r)}" for d, r in sorted(by_digits.items()))
    print(f"{family}: {exact}/{n} exact, arithmetic steps right {sum(steps)}/{len(steps)} ({split})")


@torch.no_grad()
def probe_prefix(model: LlamaForCausalLM, codec: Codec, n: int) -> None:
    rows, cuts = [], []
    (equals,) = codec.encode("=")
    for e in examples("chain", n):
        for i, token in enumerate(codec.encode(e.answer)):
            if token == equals:
                rows.append(e)
                cuts.append(i + 1)
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in rows], codec=codec)
    target = answer_region([e.answer for e in rows], model.config.dloom["gen_length"], codec)
    cut = torch.tensor(cuts)[:, None]
    x = torch.where(torch.arange(target.shape[1])[None, :] < cut, target, tok.MASK_ID)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(x)], dim=1)
    logits = region_logits(model, model(
        input_ids=torch.cat([prompt_ids, x], dim=1), attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
    ).logits, prompt_ids.shape[1])
    r = torch.arange(len(rows))
    right = logits[r, cut[:, 0]].argmax(-1) == target[r, cut[:, 0]]
    print(f"prefix states: first result token right in {int(right.sum())}/{len(rows)} "
          f"({float(right.float().mean()):.0%})")


def tale_answers(prompt: str, gen_length: int, codec: Codec) -> torch.Tensor:
    """``(360, G)`` long: every answer the tale grammar allows for ``prompt``, padded with ``<eos>``."""
    return answer_region(long_tasks.FAMILIES["tale"].answers(prompt), gen_length, codec)


def probe_tales(model: LlamaForCausalLM, codec: Codec, n: int) -> None:
    block_length = getattr(model.config, "dloom", {}).get("block_length", 32)
    batch = examples("tale", n)
    trace = trace_dllm(model, [e.prompt for e in batch], codec=codec)
    for e, region, step, confidence in zip(batch, trace.region, trace.step, trace.confidence):
        text = codec.decode(region.tolist())
        if long_tasks.FAMILIES["tale"].check(e.prompt, text):
            print(f"right: {text!r}")
            continue
        valid = tale_answers(e.prompt, len(region), codec)
        for s in range(len(region)):
            known = step <= s
            if not ((valid == region) | ~known).all(-1).any():
                j = int((step == s).nonzero())
                start = j - j % block_length
                left_masked = int((step[start:j] > s).sum())
                print(f"wrong: {text!r}\n  broke at step {s}: position {j} {codec.decode([int(region[j])])!r}, "
                      f"confidence {float(confidence[j]):.2f}, {left_masked} masked to its left in the block")
                break


def main() -> None:
    parser = argparse.ArgumentParser(prog="python training/probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("families", "steps", "prefix", "tales"))
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("-n", type=int, default=10, help="held-out prompts per family (default 10)")
    parser.add_argument("--order", choices=DECODING_ORDERS, default="confidence",
                        help="families, steps: the commit order (default: confidence, the zoo's evaluation)")
    parser.add_argument("--family", choices=("chain", "word"), default="chain", help="steps: the family")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not args.checkpoint.is_dir():
        parser.error(f"checkpoint {str(args.checkpoint)!r} is not a directory")
    if not 1 <= args.n <= 90:
        parser.error(f"-n is {args.n}; allowed: 1 to 90 (held-out prompts per family)")
    torch.set_num_threads(args.threads)
    model, codec = load(args.checkpoint)
    if args.probe == "families":
        probe_families(model, codec, args.n, args.order)
    elif args.probe == "steps":
        probe_steps(model, codec, args.n, args.family, args.order)
    elif args.probe == "prefix":
        probe_prefix(model, codec, args.n)
    else:
        probe_tales(model, codec, args.n)


if __name__ == "__main__":
    main()
