"""One training run of one zoo model (:func:`train_one`), in its steps: plan the run from the
options and any checkpoint it continues (:func:`plan_run`), load or build the weights
(:func:`load_weights`), train until the budget is spent with checkpoints on the way
(:func:`train_loop`), then save and evaluate."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from transformers import LlamaForCausalLM

from dloom.zoo.tasks import Example, held_out

from .checkpoints import (
    CHECKPOINT_MINUTES,
    TRAINING_WEIGHTS,
    run_history,
    save_checkpoint,
    unfinished_run,
)
from .data import part_seed, training_batches
from .evaluation import accuracy_line, evaluate, write_evaluation
from .losses import ar_loss, dllm_loss
from .models import build_model, dllm_from_ar, n_params
from .options import RowOptions
from .schedule import learning_rate
from .workloads import SPECS, ModelSpec

MONITOR_EVERY = 300
"""The steps between two monitor evaluations of a run by default (``--monitor-every``)."""

__all__ = ["MONITOR_EVERY", "RunPlan", "load_weights", "plan_run", "train_loop", "train_one"]


@dataclass
class RunPlan:
    """What one run of model ``name`` does: its seed, peak rate, mix, row options, average and
    budget, and where it starts (step, seconds, the earlier runs and the curves it continues).

    ``run`` is the unfinished run's record it continues (``None``: a new run); ``minutes`` and
    ``steps`` the total budget (``steps`` set: the cosine runs over steps).  ``monitor_n``: the
    monitor's held-out prompts (``None``: the workload's ``monitor_per_family`` of each family);
    ``monitor_tau``: the monitor also decodes a dLLM's prompts by the threshold rule at this
    ``τ`` (its accuracy and forwards go to ``monitor_threshold_curve``); ``monitor_every``: the
    steps between two monitors.
    """

    name: str
    seed: int
    peak: float
    mix: dict[str, float]
    rows: RowOptions
    ema: float
    ema_before: float
    init_from: Path | None
    minutes: float | None
    steps: int | None
    start_step: int = 0
    elapsed_before: float = 0.0
    history: list[dict] = field(default_factory=list)
    curves: dict[str, list] = field(default_factory=lambda: {"loss_curve": [], "monitor_curve": []})
    run: dict | None = None
    monitor_n: int | None = None
    monitor_tau: float | None = None
    monitor_every: int = 300

    @property
    def spec(self) -> ModelSpec:
        return SPECS[self.name]

    @property
    def budget(self) -> float | None:
        """The wall-clock budget in seconds, ``None`` for a run over steps."""
        return None if self.steps is not None or self.minutes is None else self.minutes * 60

    def record(self, model: torch.nn.Module, step: int, elapsed: float, running: float | None,
               finished: bool) -> dict:
        """The run's record at ``step`` (``progress.json``; ``eval.json`` at its end)."""
        spec, workload = self.spec, self.spec.workload
        return {
            "model": self.name, "kind": spec.kind, "workload": workload.name, "params": n_params(model),
            "seed": self.seed, "peak_lr": self.peak, "steps": step, "batch": workload.batch,
            "train_weights": self.mix, **self.rows.record(), "ema": self.ema,
            "init_from": None if self.init_from is None else str(self.init_from),
            "monitor_n": self.monitor_n, "monitor_tau": self.monitor_tau, "monitor_every": self.monitor_every,
            "train_seconds": round(elapsed, 1), "budget_seconds": self.budget, "total_steps": self.steps,
            "final_loss_avg": running, "finished": finished, **self.curves, "history": self.history,
        }

    def check(self) -> None:
        """Check the plan before any work.

        :raises ValueError: no budget, bad row options (:meth:`RowOptions.check`) or an ``ema``
            outside ``[0, 1)``.
        """
        if self.minutes is None and self.steps is None:
            raise ValueError(f"{self.name}: no budget (give minutes or steps)")
        self.rows.check(self.name)
        if not 0 <= self.ema < 1:
            raise ValueError(f"{self.name}: ema {self.ema} is a decay per step: it must be in [0, 1)")
        if self.monitor_every < 1:
            raise ValueError(f"{self.name}: monitor_every {self.monitor_every} is a number of steps: it must be at "
                             "least 1")
        if self.monitor_n is not None and self.monitor_n < 1:
            raise ValueError(f"{self.name}: monitor_n {self.monitor_n} is a number of prompts: it must be at least 1")
        if self.monitor_tau is not None and not 0 < self.monitor_tau < 1:
            raise ValueError(f"{self.name}: monitor_tau {self.monitor_tau} is a threshold: it must be in (0, 1)")


def plan_run(
    name: str, minutes: float | None, steps: int | None, seed: int, directory: Path, resume: bool, lr: float | None,
    weights: dict[str, float] | None, rows: dict, ema: float | None, init_from: Path | None,
    monitor_n: int | None = None, monitor_tau: float | None = None, monitor_every: int | None = None,
) -> RunPlan:
    """The plan of a run of ``name`` whose checkpoint lives in ``directory`` (:func:`train_one`'s
    arguments; ``rows``, the :class:`RowOptions` given, ``None`` for those not given).  An
    unfinished run continued keeps its monitor settings but for those given."""
    plan = _plan(name, minutes, steps, seed, directory, resume, lr, weights, rows, ema, init_from)
    recorded = plan.run or {}
    plan.monitor_n = monitor_n if monitor_n is not None else recorded.get("monitor_n")
    plan.monitor_tau = monitor_tau if monitor_tau is not None else recorded.get("monitor_tau")
    plan.monitor_every = monitor_every or recorded.get("monitor_every") or MONITOR_EVERY
    if plan.monitor_tau is not None:
        plan.curves.setdefault("monitor_threshold_curve", [])
    return plan


def _plan(
    name: str, minutes: float | None, steps: int | None, seed: int, directory: Path, resume: bool, lr: float | None,
    weights: dict[str, float] | None, rows: dict, ema: float | None, init_from: Path | None,
) -> RunPlan:
    """:func:`plan_run` but for the monitor settings."""
    spec = SPECS[name]
    run = unfinished_run(directory) if resume else None
    if run is None:
        from_checkpoint = resume or init_from is not None
        peak = lr if lr is not None else spec.lr / 2 if from_checkpoint else spec.lr
        return RunPlan(name, seed, peak, {**spec.workload.mix, **(weights or {})}, RowOptions.new(rows),
                       ema or 0.0, 0.0, init_from, minutes, steps)
    ema_before = run.get("ema", 0.0)
    if minutes is None and steps is None:
        minutes = None if run["budget_seconds"] is None else run["budget_seconds"] / 60
        steps = run["total_steps"]
    return RunPlan(
        name, run["seed"], lr if lr is not None else run["peak_lr"], {**run["train_weights"], **(weights or {})},
        RowOptions.continued(run, rows), ema_before if ema is None else ema, ema_before,
        None if run["init_from"] is None else Path(run["init_from"]), minutes, steps, run["steps"],
        run["train_seconds"], run["history"],
        {key: run[key] for key in ("loss_curve", "monitor_curve", "monitor_threshold_curve") if key in run}, run,
    )


def load_weights(plan: RunPlan, directory: Path, resume: bool) -> tuple[LlamaForCausalLM, AveragedModel | None]:
    """The weights the optimizer trains and, with an ``ema``, their average.

    ``resume``: the checkpoint in ``directory`` (the optimizer's weights from
    ``training-weights/`` if the continued run averaged; a new average starts from the
    checkpoint's weights); else ``plan.init_from`` made a dLLM, or a fresh model.  A run that
    starts from a checkpoint's weights takes its history (``plan.history`` is set).
    """
    averaged = None
    if resume:
        trained = directory / TRAINING_WEIGHTS if plan.run is not None and plan.ema_before > 0 else directory
        model = LlamaForCausalLM.from_pretrained(trained, local_files_only=True, dtype=torch.float32)
        if plan.ema > 0:
            average_from = LlamaForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
            averaged = AveragedModel(average_from, multi_avg_fn=get_ema_multi_avg_fn(plan.ema), use_buffers=True)
            averaged.n_averaged.fill_(1)  # it holds an average already: the next update blends into it
        if plan.run is None:
            plan.history = run_history(directory)
    elif plan.init_from is not None:
        model = dllm_from_ar(plan.init_from, plan.name)
        plan.history = run_history(plan.init_from)
    else:
        model = build_model(plan.name)
    if plan.ema > 0 and averaged is None:
        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(plan.ema), use_buffers=True)
    return model, averaged


def batch_loss(plan: RunPlan, model: LlamaForCausalLM, batch: Sequence[Example], extra_pad: int,
               gen: torch.Generator) -> torch.Tensor:
    """The loss of one batch: :func:`dllm_loss` with the plan's row options for a dLLM,
    :func:`ar_loss` for a causal model."""
    spec, rows = plan.spec, plan.rows
    workload = spec.workload
    if spec.kind != "dllm":
        return ar_loss(model, batch, extra_pad, workload.codec)
    blocks = workload.block_length if rows.masks == "block" else None
    return dllm_loss(model, batch, extra_pad, gen, rows.pad_weight, rows.t_max, workload.gen_length, blocks,
                     rows.prefix_share, rows.causal_share, rows.loss_mean, rows.decoder_share, rows.decoder_fill,
                     rows.decoder_rounds, rows.decoder_taus, rows.first_forward_share, rows.own_earlier_share,
                     rows.label_smoothing, workload.codec, edit_share=rows.edit_share,
                     edit_draft_share=rows.edit_draft_share, edit_taus=rows.edit_taus, edit_rate=rows.edit_rate)


def train_loop(
    plan: RunPlan, model: LlamaForCausalLM, averaged: AveragedModel | None, directory: Path,
    checkpoint_minutes: float,
) -> tuple[int, float, float | None]:
    """Train until the plan's budget is spent: AdamW steps on the plan's batches under the
    scheduled rate, the loss logged every 50 steps, the monitor every 300, a checkpoint every
    ``checkpoint_minutes``; then the last checkpoint, marked finished.

    :return: the step reached, the run's training seconds (its earlier parts included) and
        the running mean of the loss.
    """
    name, spec = plan.name, plan.spec
    workload = spec.workload
    # what the monitor reads and the checkpoints hold
    evaluated = model if averaged is None else cast(LlamaForCausalLM, averaged.module)
    training = None if averaged is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=plan.peak, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(part_seed(plan.seed, plan.start_step))
    batches: Iterator[tuple[list[Example], int]] = training_batches(plan.seed, plan.mix, workload, plan.start_step)
    monitor_n = plan.monitor_n or len(workload.suite) * workload.monitor_per_family
    monitor = held_out(monitor_n, seed=1, suite=workload.suite)
    budget, total = plan.budget, plan.steps
    start = time.time() - plan.elapsed_before
    last_save = time.time()
    step, running = plan.start_step, None
    while True:
        elapsed = time.time() - start
        if (total is not None and step >= total) or (budget is not None and elapsed >= budget):
            break
        # --steps: cosine over steps; --minutes: cosine over wall-clock time (robust to CPU
        # contention, which on shared cores changes the speed several-fold mid-run).
        progress = step / total if total is not None else elapsed / cast(float, budget)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, progress, plan.peak, plan.start_step)
        batch, extra_pad = next(batches)
        loss = batch_loss(plan, model, batch, extra_pad, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if averaged is not None:
            averaged.update_parameters(model)
        step += 1
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == plan.start_step + 1:
            elapsed = time.time() - start
            plan.curves["loss_curve"].append([step, round(elapsed), round(running, 4)])
            print(f"[{name}] step {step} progress {progress:.3f} loss {loss.item():.4f} avg {running:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} elapsed {elapsed:.0f}s", flush=True)
        if step % plan.monitor_every == 0:
            monitor_step(plan, evaluated, monitor, step)
            model.train()
        if time.time() - last_save >= checkpoint_minutes * 60:
            save_checkpoint(evaluated, directory, workload, plan.record(model, step, time.time() - start, running,
                                                                        False), training)
            last_save = time.time()
            print(f"[{name}] checkpoint saved to {directory} at step {step}", flush=True)
    train_seconds = time.time() - start
    save_checkpoint(evaluated, directory, workload, plan.record(model, step, train_seconds, running, True), training)
    print(f"[{name}] saved to {directory} after {step} steps, {train_seconds:.0f}s", flush=True)
    return step, train_seconds, running


def monitor_step(plan: RunPlan, evaluated: LlamaForCausalLM, monitor: Sequence[Example], step: int) -> None:
    """Evaluate the monitor prompts at ``step`` into the plan's ``monitor_curve`` and the log."""
    acc = evaluate(evaluated, plan.spec.kind, monitor, codec=plan.spec.workload.codec)
    plan.curves["monitor_curve"].append([step, round(acc["overall"], 3), acc["per_family"]])
    print(f"[{plan.name}] step {step} monitor {accuracy_line(acc)}", flush=True)
    if plan.monitor_tau is not None and plan.spec.kind == "dllm":
        acc = evaluate(evaluated, "dllm", monitor, codec=plan.spec.workload.codec, tau=plan.monitor_tau)
        plan.curves["monitor_threshold_curve"].append([step, round(acc["overall"], 3), round(acc["nfe"], 2),
                                                       acc["per_family"]])
        print(f"[{plan.name}] step {step} monitor threshold {plan.monitor_tau:g} {accuracy_line(acc)} "
              f"nfe {acc['nfe']:.2f}", flush=True)


def train_one(
    name: str,
    minutes: float | None,
    steps: int | None,
    seed: int,
    out: Path,
    eval_n: int,
    resume: bool = False,
    lr: float | None = None,
    weights: dict[str, float] | None = None,
    pad_weight: float = 1.0,
    t_max: float = 1.0,
    init_from: Path | None = None,
    checkpoint_minutes: float = CHECKPOINT_MINUTES,
    masks: str | None = None,
    prefix_share: float | None = None,
    causal_share: float | None = None,
    loss_mean: str | None = None,
    decoder_share: float | None = None,
    ema: float | None = None,
    decoder_fill: str | None = None,
    decoder_rounds: int | None = None,
    decoder_taus: Sequence[float] | None = None,
    first_forward_share: float | None = None,
    own_earlier_share: float | None = None,
    label_smoothing: float | None = None,
    edit_share: float | None = None,
    edit_draft_share: float | None = None,
    edit_taus: Sequence[float] | None = None,
    edit_rate: float | None = None,
    monitor_n: int | None = None,
    monitor_tau: float | None = None,
    monitor_every: int | None = None,
) -> dict:
    """Train (or, with ``resume``, continue training) one model, save it, evaluate it.

    Every ``checkpoint_minutes`` of wall time the run saves its weights and its record
    (``progress.json``: steps, elapsed seconds, budget, loss and monitor curves) into
    ``out/name`` (:func:`save_checkpoint`), so a run that is killed keeps its last minutes.

    ``resume`` continues the checkpoint in ``out/name``.  If its run is unfinished (killed
    before its budget was spent), the run goes on where it stopped: same schedule position
    (steps and elapsed seconds count on, the cosine follows them), its seed, peak lr, mix,
    ``pad_weight``, ``t_max``, a fresh AdamW warmed up again over ``WARMUP`` steps, new data
    (:func:`training_batches`); ``minutes``/``steps``, if given, replace its total budget, and
    ``lr``/``weights`` its peak and mix.  If its run finished, a new run starts from its
    weights with a fresh optimizer and schedule (warm-up and cosine again, peak ``lr``); use
    another ``seed`` so it sees new data.  ``eval.json`` lists the earlier runs under
    ``history``.  ``weights`` overrides the training mix (the workload's ``mix``) family by
    family; ``pad_weight`` and ``t_max`` are :func:`dllm_loss`'s.  ``masks`` is its mask
    order: ``"uniform"`` (the default of a new run) or ``"block"`` (blocks of the workload's
    ``block_length``), with ``prefix_share`` (default 0) of the rows masked from a cut on, and
    ``causal_share`` (default 0) trained causally, ``decoder_share`` (default 0) in a
    confidence-order decoder's states, filled per ``decoder_fill`` (default ``"answer"``) and
    revealed over ``decoder_rounds`` forwards (default 1), thresholds ``decoder_taus`` (default
    :data:`DECODER_TAUS`), ``first_forward_share`` and ``own_earlier_share`` (default 0),
    ``label_smoothing`` (default 0), and ``loss_mean`` (default ``"token"``) how the masked rows are averaged
    (:func:`dllm_loss`); given on resuming an unfinished
    run, they replace the run's from the current step on (the record keeps the last ones).  ``init_from`` (a dLLM
    only) starts instead from a causal checkpoint of the same architecture made
    bidirectional (:func:`dllm_from_ar`); its runs head the history.

    ``ema`` (default 0: none; given on resuming, it replaces the run's) keeps an exponential
    moving average of the weights, updated after every optimizer step with decay ``ema``
    (``torch.optim.swa_utils``; 0.9995 averages about the last 2,000 steps).  The monitor,
    the checkpoint's weights and the final evaluation are the average's; the optimizer's own
    weights go to ``training-weights/`` (:data:`TRAINING_WEIGHTS`), where ``--resume``
    continues them, the average continuing from the checkpoint's weights.  An average
    started on resuming a run without one starts from its weights.
    """
    directory = out / name
    rows = {"pad_weight": pad_weight, "t_max": t_max, "masks": masks, "prefix_share": prefix_share,
            "causal_share": causal_share, "loss_mean": loss_mean, "decoder_share": decoder_share,
            "decoder_fill": decoder_fill, "decoder_rounds": decoder_rounds, "decoder_taus": decoder_taus,
            "first_forward_share": first_forward_share, "own_earlier_share": own_earlier_share,
            "label_smoothing": label_smoothing, "edit_share": edit_share, "edit_draft_share": edit_draft_share,
            "edit_taus": edit_taus, "edit_rate": edit_rate}
    plan = plan_run(name, minutes, steps, seed, directory, resume, lr, weights, rows, ema, init_from, monitor_n,
                    monitor_tau, monitor_every)
    plan.check()
    torch.manual_seed(part_seed(plan.seed, plan.start_step))
    model, averaged = load_weights(plan, directory, resume)
    model.train()
    spec = plan.spec
    print(f"[{name}] {n_params(model):,} parameters, kind={spec.kind}, workload={spec.workload.name}, "
          f"resume={resume}" + (f" (continuing at step {plan.start_step})" if plan.run is not None else "")
          + (f", weights averaged (ema {plan.ema})" if averaged is not None else ""), flush=True)
    step, train_seconds, running = train_loop(plan, model, averaged, directory, checkpoint_minutes)
    return write_evaluation(directory, spec.kind, plan.record(model, step, train_seconds, running, True), eval_n,
                            spec.workload)
