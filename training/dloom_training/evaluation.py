"""Held-out accuracy: of a model in memory (:func:`evaluate`), of a saved checkpoint, and the
``eval.json`` written at a run's end (:func:`write_evaluation`, :func:`end_run`,
:func:`reevaluate`)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from dloom.zoo.tasks import Example, held_out

from .checkpoints import PROGRESS, unfinished_run
from .codec import CHARACTERS, Codec
from .decoding import decode_ar, decode_dllm, decode_threshold
from .models import n_params
from .workloads import CHECKABLE, SHORT, SPECS, Workload

__all__ = ["accuracy_line", "end_run", "evaluate", "evaluate_saved", "reevaluate", "write_evaluation"]


def evaluate(
    model: LlamaForCausalLM, kind: str, examples: Sequence[Example], batch: int = 128, codec: Codec = CHARACTERS,
    tau: float | None = None,
) -> dict:
    """Exact-match accuracy (``TaskFamily.check``) overall and per family, plus samples: a dLLM
    decoded one token per step, or with ``tau`` by the threshold rule (:func:`decode_threshold`;
    the result then also has ``nfe``, the mean forwards per prompt)."""
    model.eval()
    answers: list[str] = []
    forwards: list[torch.Tensor] = []
    for start in range(0, len(examples), batch):
        prompts = [e.prompt for e in examples[start : start + batch]]
        if kind == "dllm" and tau is not None:
            texts, taken = decode_threshold(model, prompts, tau, codec)
            answers += texts
            forwards.append(taken)
        elif kind == "dllm":
            answers += decode_dllm(model, prompts, codec=codec)
        else:
            answers += decode_ar(model, prompts, codec)
    per: dict[str, list[bool]] = {}
    for e, a in zip(examples, answers, strict=True):
        per.setdefault(e.family, []).append(CHECKABLE[e.family].check(e.prompt, a))
    hits = [h for v in per.values() for h in v]
    samples = [{"prompt": e.prompt, "output": a} for e, a in list(zip(examples, answers))[: 2 * len(per)]]
    return {
        "overall": sum(hits) / len(hits),
        "per_family": {f: sum(v) / len(v) for f, v in per.items()},
        "n": len(hits),
        "samples": samples,
        **({"nfe": float(torch.cat(forwards).float().mean())} if forwards else {}),
    }


def write_evaluation(directory: Path, kind: str, record: dict, eval_n: int, workload: Workload) -> dict:
    """Evaluate the weights saved in ``directory`` on ``eval_n`` held-out prompts and write
    ``eval.json``: the finished run's ``record`` (without ``finished``), the parameter count,
    the decoding and :func:`evaluate`'s result.  Returns what it wrote."""
    reloaded, result, eval_seconds = evaluate_saved(directory, kind, eval_n, workload)
    summary = {
        **{k: v for k, v in record.items() if k != "finished"},
        "params": n_params(reloaded),
        "eval_seconds": eval_seconds,
        "decoding": "greedy, one token per step (low-confidence)" if kind == "dllm" else "greedy AR",
        **result,
    }
    (directory / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[{record['model']}] eval {accuracy_line(result)}", flush=True)
    return summary


def end_run(name: str, out: Path, eval_n: int) -> dict:
    """End the unfinished run saved in ``out/name`` where it stopped, leaving the rest of its
    budget unspent: its record (``progress.json``) is marked finished, with ``ended_early``
    true, and its weights, untouched, are evaluated into ``eval.json`` as at the end of a run
    (:func:`write_evaluation`).  A later ``--resume`` starts a new run from them.

    :raises ValueError: ``out/name`` holds no unfinished run.
    """
    directory = out / name
    run = unfinished_run(directory)
    if run is None:
        raise ValueError(f"{directory}: no unfinished run to end (no {PROGRESS}, or its run finished)")
    record = {**run, "finished": True, "ended_early": True}
    (directory / PROGRESS).write_text(json.dumps(record, indent=2) + "\n")
    print(f"[{name}] run ended at step {run['steps']} after {run['train_seconds']:.0f}s of its "
          f"{run['budget_seconds'] or 0:.0f}s budget", flush=True)
    return write_evaluation(directory, SPECS[name].kind, record, eval_n, SPECS[name].workload)


def evaluate_saved(
    directory: Path, kind: str, eval_n: int, workload: Workload = SHORT
) -> tuple[LlamaForCausalLM, dict, float]:
    """Reload the float16 checkpoint in ``directory`` as float32 and evaluate it on ``eval_n``
    held-out prompts of ``workload``: the model, :func:`evaluate`'s result, the seconds it took."""
    model = LlamaForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    t0 = time.time()
    result = evaluate(model, kind, held_out(eval_n, seed=0, suite=workload.suite), codec=workload.codec)
    return model, result, round(time.time() - t0, 1)


def accuracy_line(result: dict) -> str:
    """``overall 0.812 add=1.00 sort=0.86 ...`` for the training log."""
    return f"overall {result['overall']:.3f} " + " ".join(f"{f}={a:.2f}" for f, a in result["per_family"].items())


def reevaluate(name: str, out: Path, eval_n: int) -> dict:
    """Evaluate the saved ``out/name`` again on the current task suite; update its ``eval.json``.

    The training record (steps, mix, loss, history) is kept; accuracy, per-family accuracy,
    ``n`` and samples are replaced, and ``reevaluated`` records why the figures may differ
    from the end of training (the suite changed since).
    """
    directory = out / name
    record = json.loads((directory / "eval.json").read_text())
    _, result, eval_seconds = evaluate_saved(directory, SPECS[name].kind, eval_n, SPECS[name].workload)
    record.update(result, eval_seconds=eval_seconds,
                  reevaluated="after training, on the task suite of this dloom version")
    (directory / "eval.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[{name}] re-evaluated {accuracy_line(result)}", flush=True)
    return record
