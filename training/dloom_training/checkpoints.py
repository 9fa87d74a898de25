"""Checkpoints of a training run: the weights, tokenizer and run record (``progress.json``),
written so that a killed run leaves a whole checkpoint, and read back to resume."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

from transformers import LlamaForCausalLM

from dloom.zoo import tokenizer as tok

from .workloads import SHORT, Workload

__all__ = ["CHECKPOINT_MINUTES", "PROGRESS", "TRAINING_WEIGHTS", "run_history", "save_checkpoint", "save_model",
           "unfinished_run"]


CHECKPOINT_MINUTES = 5.0
"""How often a training run saves its weights and ``progress.json`` (``--checkpoint-minutes``)."""


def save_model(model: LlamaForCausalLM, directory: Path, workload: Workload = SHORT) -> None:
    """Save float16 safetensors weights and the workload's tokenizer files into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).half().save_pretrained(directory, safe_serialization=True)
    if workload is SHORT:
        tok.save(directory)
    else:
        tok.save(directory, workload.alphabet, workload.max_positions, workload.words)


PROGRESS = "progress.json"
"""The run record a training run rewrites at every checkpoint: ``finished`` is false until
the run's budget is spent; ``--resume`` continues an unfinished one."""


TRAINING_WEIGHTS = "training-weights"
"""The sub-directory of a checkpoint with an averaged model (``--ema``) that holds the
weights the optimizer steps, which ``--resume`` continues; the checkpoint's own weights are
the average, the model that is evaluated, probed and shipped."""


def save_checkpoint(
    model: LlamaForCausalLM, directory: Path, workload: Workload, record: dict,
    training: LlamaForCausalLM | None = None,
) -> None:
    """Save the weights, tokenizer and ``record`` (as ``progress.json``) into ``directory``;
    ``training`` (with an averaged ``model``): the optimizer's weights, into
    ``directory/training-weights``; without it, a ``training-weights`` an earlier averaged
    run left there is removed once the record is in (the weights are the optimizer's again).

    The files are written into ``directory/.partial`` and then moved in one by one
    (``os.replace``), the training weights first and ``progress.json`` last: a run killed
    while saving leaves the previous checkpoint, or new weights with the previous record,
    never a half-written file.
    """
    partial = directory / ".partial"
    save_model(model, partial, workload)
    if training is not None:
        save_model(training, partial / TRAINING_WEIGHTS, workload)
        (directory / TRAINING_WEIGHTS).mkdir(parents=True, exist_ok=True)
        for path in sorted((partial / TRAINING_WEIGHTS).iterdir()):
            os.replace(path, directory / TRAINING_WEIGHTS / path.name)
        (partial / TRAINING_WEIGHTS).rmdir()
    (partial / PROGRESS).write_text(json.dumps(record, indent=2) + "\n")
    for path in sorted(partial.iterdir(), key=lambda p: p.name == PROGRESS):
        os.replace(path, directory / path.name)
    partial.rmdir()
    if training is None and (directory / TRAINING_WEIGHTS).is_dir():
        shutil.rmtree(directory / TRAINING_WEIGHTS)


def unfinished_run(directory: Path) -> dict | None:
    """The record of the unfinished run saved in ``directory``, or ``None`` (no run, or finished)."""
    path = directory / PROGRESS
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return None if record.get("finished") else record


_HISTORY_KEYS = (
    "seed", "peak_lr", "steps", "batch", "train_weights", "pad_weight", "t_max", "masks", "prefix_share",
    "causal_share", "loss_mean", "decoder_share", "decoder_fill", "decoder_rounds", "decoder_taus", "first_forward_share",
    "own_earlier_share", "label_smoothing", "edit_share", "edit_draft_share", "edit_taus", "edit_rate", "ema",
    "init_from", "train_seconds",
    "final_loss_avg", "overall", "per_family",
)


def run_history(directory: Path) -> list[dict]:
    """The training record of the checkpoint in ``directory``: its earlier runs, then its last
    (from ``eval.json``, or ``progress.json`` for a run stopped before its evaluation)."""
    path = directory / "eval.json"
    previous = json.loads((path if path.is_file() else directory / PROGRESS).read_text())
    last = {"model": previous.get("model"), **{k: previous.get(k) for k in _HISTORY_KEYS}}
    return [*previous.get("history", []), last]
