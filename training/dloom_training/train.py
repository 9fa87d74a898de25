"""Train the toy zoo on CPU: ``PYTHONPATH=training python -m dloom_training.train --model all`` (300 minutes).

Models (``SPECS``), all transformers ``LlamaForCausalLM`` over a character vocabulary.  The
toy zoo (``toy-*``, workload ``SHORT``: the 54-character alphabet, answers in 32 positions)
and the long-answer zoo (``long-*``, workload ``LONG``, section below) are trained by the
same loop; each model's ``Workload`` gives its suite, vocabulary, answer region and batch.

This module is the command line; the trainer's parts live beside it, one role each:
``workloads`` (what each model trains on, ``SPECS``), ``models`` (building one, a dLLM from a
causal checkpoint), ``rows`` (prompt and answer tensors), ``decoder_states`` (the states a
decoder reaches, for training rows), ``losses`` (``dllm_loss``, ``ar_loss``), ``options``
(a dLLM run's row options), ``data`` (the batch stream), ``schedule`` (the learning rate),
``decoding`` and ``evaluation`` (held-out accuracy, ``eval.json``), ``checkpoints`` (saving
and resuming) and ``run`` (``train_one``, one run in its steps).

* ``toy-dllm`` — bidirectional (``is_causal=False``) masked-diffusion model, LLaDA-SFT
  style: prompt kept, every answer-region position (answer + ``<eos>`` padding to
  ``GEN_LENGTH``) masked independently with probability ``t``, one ``t`` per batch row,
  stratified over ``[0.02, 1]``; unweighted cross-entropy on the masked positions.  The
  shipped one starts from ``toy-dllm-ar`` (``--init-from``, Dream's recipe), so its logits
  are shifted by one.
* ``toy-ar`` — causal next-token model (the speculative-decoding target), about 2.1x the
  dLLM's parameters; loss on the answer and its single ``<eos>``.
* ``toy-ar-small`` — causal, about 0.28x the dLLM's parameters.
* ``toy-dllm-ar`` — not shipped: toy-dllm's architecture trained as a causal model, the
  initialisation ``--init-from`` turns into a dLLM (bidirectional, logits still shifted by
  one, Dream style).

``--model all`` follows the stages and time shares of the shipped recipe (``RECIPE``):
``toy-dllm-ar`` (saved under ``--init-out``, default ``training/checkpoints``, as it is not
shipped), then ``toy-dllm`` from it with the next seed, then ``toy-ar`` and
``toy-ar-small``, splitting ``--minutes`` by ``SPECS[...].share``.  It runs each stage once
with the default mix; the shipped weights came from several runs each, with their own
learning rates and mixes, listed below with their commands.  ``--model all --resume`` and
``--eval-only`` act on the three shipped models.

Recipe (the second of two 25-minute trials on these cores; ``docs/zoo.md``, "Retraining"): AdamW (weight decay 0.01), peak
lr 2e-3 (1.5e-3 for ``toy-ar``; half of it for a run that starts from a checkpoint,
``--resume`` or ``--init-from``), betas (0.9, 0.98), 100 linear warm-up steps, then cosine to 5 % of the peak, grad-clip 1.0.
Batch 64 (the notes used 128: on two shared cores a step of 128 took ~5 s, so the batch was
halved for twice the updates).  The training mix
draws ``add`` 2.5x and ``lookup`` 1.5x as often as the other families (``TRAIN_WEIGHTS``).

Schedule: with ``--minutes`` the cosine runs over *wall-clock* progress (elapsed / budget)
and training stops when the budget is spent — CPU contention on the shared cores changed
the step time several-fold during a run, so a step count planned from an initial timing
either overran or ended early.  With ``--steps N`` the cosine runs over steps instead.
The data stream, the masks and the initialisation are seeded by ``--seed``, so a
``--steps`` run is exactly reproducible; a ``--minutes`` run reproduces its data but its
step count (recorded in ``eval.json``) depends on the machine's speed.

Checkpoints and ``--resume``: every ``--checkpoint-minutes`` (default 5) a run saves its
weights and ``progress.json`` (steps, elapsed seconds, budget, seed, lr, mix, the loss curve
every 50 steps and the monitor accuracy every 300) into ``OUT/<model>``, so a run that is
stopped keeps all but its last few minutes.  ``--resume`` on an unfinished run (``finished``
false) continues it where it stopped: its steps and elapsed seconds count on and the cosine
follows them, with its seed, peak lr and mix, new data (the stream of seed ``seed *
100_000_000 + step``) and a fresh AdamW warmed up again over 100 steps to the scheduled rate
(the moments are not saved: the committed checkpoint is the float16 weights and the JSON
record only); ``--minutes``/``--steps`` then replace its total budget.  ``--resume`` on a
finished run starts a new run from its weights with a fresh optimizer and schedule (use a
new ``--seed`` for new data); ``eval.json`` keeps the earlier runs under ``history``.
``--finish`` ends an unfinished run where it stopped, its budget's rest unspent (its record
says ``ended_early``): the saved weights are evaluated into ``eval.json`` as at a run's end.
``--ema DECAY`` keeps an exponential moving average of the weights: the checkpoint's weights,
the monitor and the evaluation are the average's, and the optimizer's weights, which
``--resume`` continues, are saved under ``training-weights/`` next to them.

At the end of its budget each model is saved (float16 safetensors plus tokenizer files),
then reloaded from disk in float32 and evaluated on 350 held-out prompts (balanced over its
suite's families); ``eval.json`` next to the weights records accuracy, steps and wall time.

Evaluation (greedy, held-out prompts): the dLLM decodes its region (``GEN_LENGTH`` for the
toy zoo) in blocks of ``dloom.block_length`` (one block for the toy zoo, 32 for the long
one), one token per step, each step committing the masked position of the current block of
highest max-probability to its argmax (LLaDA low-confidence remasking, semi-autoregressive);
AR models generate greedily until ``<eos>``.

The long-answer zoo (issue 19; :mod:`dloom.zoo.long_tasks`, :mod:`dloom.zoo.corpus`):

* Workload ``LONG``: ``chain``, ``word``, ``tale``, ``prog`` (answers 45..127 characters,
  ~30 % padding of the 128-position region on held-out prompts) and the training-only
  ``text`` (continuing Shakespeare), mix ``LONG_WEIGHTS``; the 99-token tokenizer
  (``<pad>``, ``<mask>``, ``<eos>`` and ``long_tasks.ALPHABET``, printable ASCII and the
  newline) shared by the dLLM, the AR target and the drafter; batches of 32; regions of 128
  decoded in blocks of 32; 256 positions.
* Models: ``long-dllm`` (d = 192, 5 layers, 2.23 M), its causal stage ``long-dllm-ar`` (the
  same shape; not the AR target: the issue wants a target 2-4x the dLLM), ``long-ar``
  (d = 256, 6 layers, 5.14 M, 2.3x) and ``long-ar-small`` (d = 128, 3 layers, 0.65 M,
  0.29x), and ``long-dllm-par``, long-dllm trained on for threshold (parallel) decoding from its
  weights (``--init-from training/checkpoints/long-dllm``; issue 42): decoder rows in the
  states dloom's threshold decoder reaches, its own commits kept (``--decoder-fill threshold``,
  ``--decoder-tau``, ``--own-earlier-share``), a share at a block's first forward
  (``--first-forward-share``) and ``--label-smoothing``; ``training/README.md`` has the run.
* Workload ``LONG_WORDS`` (issue 42): the same suite in word tokens
  (``long_tasks.WORD_TOKENS``: a word or a number 0..999 with its leading space is one
  token, every other character one token), so an answer is 25 (``tale``) to 50 (``chain``)
  tokens instead of 76..100 characters; regions of 64 tokens in blocks of 16, batches of 64,
  no ``text``.  ``long-dllm-words-ar`` (long-dllm's shape, 2.67 M with the 2,351-token
  vocabulary) is its causal stage and ``long-dllm-words`` the dLLM made from it, as
  ``long-dllm`` from ``long-dllm-ar``; ``long-dllm-words-ar-small`` (``long-ar-small``'s
  shape, 0.94 M) is the assistant of assisted generation; ``long-dllm-words-edit`` is
  ``long-dllm-words`` trained on to edit its drafts (issue 53: token-to-token rows beside the
  mask-to-token ones, ``--edit-share``; ``training/README.md`` has the run).  The trainer encodes with the checkpoint's own
  tokenizer (:class:`~dloom_training.codec.Codec`).
  Sizes from measured seconds per step (one thread, batch 32 of 184 positions,
  forward + backward + AdamW, the two cores lightly loaded): 0.65 M 0.5 s, 1.79 M 1.2 s,
  3.44 M 1.8 s, 5.14 M 2.7 s, 7.65 M 3.8 s, 10.7 M 5.1 s (2.23 M, not timed so, lies between
  1.79 M and 3.44 M); with four other test runs on the two cores the 2.23 M model took
  4.2 s a step (60 steps in 254 s).  The dLLM is the smallest that is
  deeper than toy-dllm (chains need several carry-and-copy steps per answer) while its AR
  target still makes ~1,300 steps an hour alone on one core.
* Recipe (as for toy-dllm): ``long-dllm-ar`` causally on the mix, then ``long-dllm`` with
  ``--init-from training/checkpoints/long-dllm-ar`` (bidirectional, logits still shifted),
  then ``long-ar`` and ``long-ar-small``.  Session 1 of issue 19 (10:15 UTC) started the
  first stage, in the background, one thread, to be continued with ``--resume`` in later
  sessions (240 minutes of wall time in all)::

      OMP_NUM_THREADS=1 PYTHONPATH=training nohup python -m dloom_training.train --model long-dllm-ar --minutes 240 \
          --seed 0 --threads 1 --out training/checkpoints --checkpoint-minutes 5 \
          > training/logs/long-dllm-ar.log 2>&1 &
      # later sessions, after the checkpoint was committed:
      OMP_NUM_THREADS=1 PYTHONPATH=training nohup python -m dloom_training.train --model long-dllm-ar --resume \
          --threads 1 --out training/checkpoints >> training/logs/long-dllm-ar.log 2>&1 &

  ``training/checkpoints/long-dllm-ar/progress.json`` records how far it got.

Measured (2 CPU cores shared with other work, so step times varied several-fold).  Runs
before session 4 trained on an earlier ``lookup`` form (``k=31 b=72 x=15 d=94 ?xb`` →
``x=15,b=72``: two-digit values behind ``=``, four pairs; its curriculum had two and three
pairs), so their commands no longer reproduce their data exactly; ``--eval-only``
re-evaluated the shipped checkpoints on the current suite.

* ``toy-dllm`` (shipped in session 6): three runs on two threads, 138 minutes in all.

  1. ``toy-dllm-ar``, toy-dllm's shape trained causally for 62 minutes (the cores shared
     with a CI run for 20 of them): 4,058 steps, seed 0, peak lr 2e-3; greedy AR on 350
     held-out prompts 84.9 % (add 98, sort 68, reverse 52, copy 76, lookup 100, code 100,
     story 100 %).  Committed under ``training/checkpoints/toy-dllm-ar``.
  2. That model made a dLLM (:func:`~dloom_training.models.dllm_from_ar`) and trained for 21 minutes: 1,503 steps,
     seed 1, peak lr 1e-3; 75.1 % at one token per step (add 86, sort 54, reverse 78,
     copy 38, lookup 100, code 100, story 70 %).
  3. Resumed for 55 minutes with the families still behind drawn more often: 4,472 steps,
     seed 2, peak lr 1e-3, final average loss 0.025; 69 or 70 of the 70 monitor prompts
     right from step 2,700, and 100 % on 350 held-out prompts, every family 100 %.

  Commands::

      PYTHONPATH=training python -m dloom_training.train --model toy-dllm-ar --minutes 62 --seed 0 --threads 2 \
          --out training/checkpoints
      PYTHONPATH=training python -m dloom_training.train --model toy-dllm --init-from training/checkpoints/toy-dllm-ar \
          --seed 1 --minutes 21 --lr 1e-3 --threads 2 --out training/checkpoints
      PYTHONPATH=training python -m dloom_training.train --model toy-dllm --resume --seed 2 --minutes 55 --lr 1e-3 \
          --threads 2 --out training/checkpoints \
          --weights copy=1.6,sort=1.6,reverse=1.2,story=1.0,lookup=1.0

  then ``training/checkpoints/toy-dllm`` copied to ``core/dloom/zoo/models/toy-dllm``.

* The ``toy-dllm`` shipped in session 4, trained from scratch: 88 minutes (5,291 steps of
  64, seed 0, peak lr 2e-3), resumed for 70 minutes with one thread (2,114 steps, seed 1,
  peak lr 1e-3), then for 75 minutes with the lookup curriculum of that time (3,411 steps,
  seed 3, peak lr 7e-4).  On the current suite (350 held-out
  prompts, greedy, one token per step): 80.9 % (add 100, sort 84, reverse 90, copy 98,
  lookup 0, code 98, story 96 %).  Commands::

      OMP_WAIT_POLICY=PASSIVE PYTHONPATH=training python -m dloom_training.train --model toy-dllm --minutes 88 --seed 0 \
          --out core/dloom/zoo/models
      OMP_WAIT_POLICY=PASSIVE PYTHONPATH=training python -m dloom_training.train --model toy-dllm --resume --seed 1 \
          --minutes 70 --lr 1e-3 --threads 1 --out core/dloom/zoo/models
      PYTHONPATH=training python -m dloom_training.train --model toy-dllm --resume --seed 3 --minutes 75 --lr 7e-4 \
          --threads 1 --out core/dloom/zoo/models --weights add=1.5,lookup=1.5,lookup2=3,lookup3=2

  (``lookup2``/``lookup3``, two and three pairs of the earlier form, are gone; today's
  curriculum families are ``lookup3``/``lookup4``.)

  ``lookup`` is not learnt by the dLLM, in either form.  Session 4, on the current form:
  resuming with lookup drawn 4x (seed 4, peak lr 1e-3, 1,500 steps) or 5x with
  ``--pad-weight 0.2`` (600 steps) left lookup at 0-1 of 10 monitor prompts while the other
  families dropped under the higher learning rate (both runs discarded); a 0.5M-parameter
  masked-diffusion model trained on lookup alone for 3,000 steps (22 minutes) plateaued at
  loss 0.21 with none right, whereas the causal ``toy-ar-small`` architecture trained the
  same way learnt it at step ~1,300 (loss 0.46 → 0.0002 within 250 steps, every monitor
  prompt right).  The masked-diffusion objective has not found the retrieval step here.

  Session 5, lookup alone, one thread each, peak lr 2e-3 unless noted; small scripts over
  this module patched the shape, the lookup-only mix and the lr floor (``MIN_LR_FRACTION``)
  in, and were not kept (``--t-max`` and ``--init-from`` came out of them):

  ===================================================  ======  ===========================
  run                                                  steps   lookup, held-out, greedy
  ===================================================  ======  ===========================
  shipped toy-dllm resumed, lookup 12 of 19.1 draws,     600   0 %; the other families fell
  ``--t-max 0.4 --pad-weight 0.3``, lr 1e-3                    to 37 % overall (discarded)
  0.5M dLLM, ``--t-max 0.4 --pad-weight 0.3``          3,700   2 %
  0.5M dLLM with shifted logits, ``--pad-weight 0.3``  2,900   2 %
  0.5M dLLM, ``--pad-weight 0.3``, lr floor 50 %       2,800   1 %
  1.8M dLLM (toy-dllm's shape), lr floor 50 %            800   0 % (loss flat at 0.22)
  0.5M causal (toy-ar-small's shape)                   2,100   0 % (loss flat at 0.45)
  1.8M causal (toy-dllm's shape), lr floor 50 %        1,100   100 % (99 % from step 900)
  that causal model made a dLLM (:func:`~dloom_training.models.dllm_from_ar`),  300   100 %
  lr 1e-3
  ===================================================  ======  ===========================

  With every other position of its answer shown, the 0.5M dLLM wrote each key right and
  each value right 29-35 % of the time: it copies the key from the query but does not
  retrieve the key's value.  The causal model of toy-dllm's shape does, and keeps it once
  made bidirectional, as Dream 7B was made from Qwen2.5 7B: hence the recipe of the
  shipped toy-dllm, above.

* ``toy-ar`` (shipped in session 4): 28 minutes, one thread (508 steps, seed 0), resumed for
  60 minutes (1,130 steps, seed 1, peak lr 1e-3), then for 70 minutes on the current suite
  with the families it lacked drawn more often (1,968 steps, seed 2, peak lr 1.5e-3, final
  average loss 0.036; lookup right on every monitor prompt from step 600): 94.9 % on 350
  held-out prompts (add 94, sort 82, reverse 94, copy 94, lookup 100, code 100,
  story 100 %)::

      PYTHONPATH=training python -m dloom_training.train --model toy-ar --seed 0 --minutes 28 --threads 1 --out core/dloom/zoo/models
      PYTHONPATH=training python -m dloom_training.train --model toy-ar --resume --seed 1 --minutes 60 --lr 1e-3 \
          --threads 1 --out core/dloom/zoo/models
      PYTHONPATH=training python -m dloom_training.train --model toy-ar --resume --seed 2 --minutes 70 --lr 1.5e-3 \
          --threads 1 --out core/dloom/zoo/models \
          --weights add=0.5,sort=1.5,reverse=2,copy=1.5,lookup=2.5,code=0.3,story=0.3

* ``toy-ar-small``: 14 minutes, one thread (908 steps, seed 0); on the current suite 32.6 %
  held-out (code 100, story 100, the rest at most 18 %): a weak drafter, as intended::

      PYTHONPATH=training python -m dloom_training.train --model toy-ar-small --seed 0 --minutes 14 --threads 1 \
          --out core/dloom/zoo/models
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from dloom.zoo import ZOO_DIR

from .checkpoints import CHECKPOINT_MINUTES, unfinished_run
from .decoder_states import DECODER_FILLS
from .edit_rows import EDIT_RATE, EDIT_TAUS
from .evaluation import end_run, reevaluate
from .losses import DECODER_TAUS, LOSS_MEANS, MASK_ORDERS, T_MIN
from .run import MONITOR_EVERY, train_one
from .workloads import ALL_MINUTES, LONG, RECIPE, SHORT, SPECS, ZOO

__all__ = ["main"]


def _thresholds(text: str) -> tuple[float, ...]:
    """``--decoder-tau``'s ``0.9,0.95``: thresholds in ``(0, 1)``."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected thresholds like 0.9,0.95") from None
    bad = [v for v in values if not 0 < v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: thresholds must be in (0, 1), got {bad}")
    return values


def _family_weights(text: str) -> dict[str, float]:
    """Parse ``--weights lookup=4,sort=2`` into ``{"lookup": 4.0, "sort": 2.0}`` (any
    workload's family; :func:`main` checks them against the model's workload)."""
    weights: dict[str, float] = {}
    known = [name for w in (SHORT, LONG) for name in (*w.suite, *w.sources)]
    for item in text.split(","):
        family, _, value = item.partition("=")
        if family not in known:
            raise argparse.ArgumentTypeError(f"unknown task family {family!r}; known: {', '.join(known)}")
        try:
            weights[family] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight of {family!r} must be a number, got {value!r}") from None
        if weights[family] < 0:
            raise argparse.ArgumentTypeError(f"weight of {family!r} must be >= 0, got {value!r}")
    return weights


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dloom_training.train", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*SPECS, "all"], default="all")
    parser.add_argument("--minutes", type=float, default=None,
                        help=f"wall-time budget, split by SPECS[...].share for 'all' (default: {ALL_MINUTES:g} "
                        "for 'all', a single model's share of it otherwise)")
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (overrides --minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ZOO_DIR)
    parser.add_argument("--eval-n", type=int, default=350, help="held-out prompts (balanced over families)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resume", action="store_true",
                        help="continue the checkpoint in OUT/<model>: an unfinished run where it stopped "
                        "(its schedule, seed, lr and mix; --minutes/--steps replace its total budget), "
                        "a finished one with a new run (fresh optimizer and schedule)")
    parser.add_argument("--checkpoint-minutes", type=float, default=CHECKPOINT_MINUTES,
                        help="save the weights and progress.json this often (wall-clock minutes)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: SPECS[...].lr, half of it from a checkpoint)")
    parser.add_argument("--weights", type=_family_weights, default=None, metavar="FAMILY=W,...",
                        help="override the training mix for some families, e.g. lookup=4,sort=2; "
                        "lookup3/lookup4 (training-only, fewer key-value pairs) join the mix this way")
    parser.add_argument("--pad-weight", type=float, default=1.0,
                        help="toy-dllm: loss weight of the <eos> padding after an answer's first <eos>")
    parser.add_argument("--t-max", type=float, default=1.0,
                        help="toy-dllm: highest mask ratio t drawn in training (t is stratified over [0.02, T_MAX])")
    parser.add_argument("--masks", choices=MASK_ORDERS, default=None,
                        help="dLLMs: 'uniform' masks every answer position with probability t (the default "
                        "of a new run); 'block' trains on the states of block-by-block decoding (earlier blocks "
                        "clean, one block masked with probability t, later ones masked; loss on that block). "
                        "On --resume of an unfinished run it replaces the run's masks from then on")
    parser.add_argument("--prefix-share", type=float, default=None, metavar="P",
                        help="with --masks block: the share of rows whose block is masked from a random cut "
                        "to its end (the block's start committed), default 0")
    parser.add_argument("--decoder-share", type=float, default=None, metavar="P",
                        help="with --masks block: the share of rows (apart from --prefix-share's) in the state "
                        "a confidence-order decoder meets: the block's positions the model is surest of hold "
                        "their answer, the rest are masked (one more forward on those rows), default 0")
    parser.add_argument("--decoder-fill", choices=DECODER_FILLS, default=None,
                        help="with --decoder-share: what the decoder rows' revealed positions hold: 'answer' "
                        "(the row's answer, the default of a new run) or 'model' (the model's own argmax, with a "
                        "right answer that agrees with it as the target, for families that list their right "
                        "answers: word, tale). On --resume of an unfinished run it replaces the run's")
    parser.add_argument("--decoder-rounds", type=int, default=None, metavar="N",
                        help="with --decoder-share: reveal a decoder row's positions over N forwards, each "
                        "round's the surest given the earlier rounds' (N >= the block length: one a forward, the "
                        "state a one-token-per-step decoder reaches; up to N forwards a row); default 1. On "
                        "--resume of an unfinished run it replaces the run's")
    parser.add_argument("--decoder-tau", type=_thresholds, default=None, metavar="T,...",
                        help="with --decoder-fill threshold: the thresholds a decoder row's rollout draws from, "
                        f"one per row (default {','.join(map(str, DECODER_TAUS))}). On --resume of an unfinished "
                        "run it replaces the run's")
    parser.add_argument("--first-forward-share", type=float, default=None, metavar="P",
                        help="with --decoder-share: the share of decoder rows at their block's first forward "
                        "(the block entirely masked), default 0")
    parser.add_argument("--own-earlier-share", type=float, default=None, metavar="P",
                        help="with --decoder-fill threshold: the share of decoder rows whose earlier blocks are "
                        "decoded by the model itself with the threshold rule (its mistakes kept) instead of "
                        "holding the answer, default 0")
    parser.add_argument("--edit-share", type=float, default=None, metavar="P",
                        help="with --masks block: the share of rows (apart from --prefix-share's and "
                        "--decoder-share's) that are token-to-token editing rows (LLaDA2.1): some filled positions "
                        "of the drawn block hold a wrong token the model sees, and the whole block is scored (wrong "
                        "tokens restored, right ones kept, masks filled), default 0")
    parser.add_argument("--edit-draft-share", type=float, default=None, metavar="P",
                        help="with --edit-share: the share of edit rows whose wrong tokens are the model's own "
                        "commits in a draft of the block at a low threshold (--edit-tau); the others get uniform "
                        "noise (--edit-rate), default 0")
    parser.add_argument("--edit-tau", type=_thresholds, default=None, metavar="T,...",
                        help="with --edit-draft-share: the low thresholds a draft edit row decodes its block at, "
                        f"one per row (default {','.join(map(str, EDIT_TAUS))})")
    parser.add_argument("--edit-rate", type=float, default=None, metavar="R",
                        help="with --edit-share: a noise edit row replaces each filled position of its block with "
                        f"probability r, r uniform over (0, R] per row (default {EDIT_RATE})")
    parser.add_argument("--monitor-n", type=int, default=None, metavar="N",
                        help="the monitor's held-out prompts (default: the workload's per-family count of each "
                        "family); kept on --resume")
    parser.add_argument("--monitor-tau", type=float, default=None, metavar="T",
                        help="dLLMs: the monitor also decodes by the threshold rule at T (e.g. 0.9) and logs its "
                        "accuracy and forwards per prompt; kept on --resume")
    parser.add_argument("--monitor-every", type=int, default=None, metavar="N",
                        help=f"steps between two monitor evaluations (default {MONITOR_EVERY}); kept on --resume")
    parser.add_argument("--label-smoothing", type=float, default=None, metavar="E",
                        help="dLLMs: the cross-entropy's label smoothing (e.g. 0.05), default 0")
    parser.add_argument("--causal-share", type=float, default=None, metavar="P",
                        help="dLLMs: the share of rows trained as the causal stage was (clean answer, causal "
                        "attention, next-token loss), default 0")
    parser.add_argument("--loss-mean", choices=LOSS_MEANS, default=None,
                        help="dLLMs: 'token' averages the masked rows' loss over their masked positions (the "
                        "default of a new run), 'row' over rows (each row's mean: every mask ratio, so every "
                        "state of a block-by-block decoder, weighs the same). On --resume of an unfinished run "
                        "it replaces the run's from then on")
    parser.add_argument("--ema", type=float, default=None, metavar="DECAY",
                        help="keep an exponential moving average of the weights with this decay per step "
                        "(e.g. 0.9995); checkpoints, the monitor and the evaluation use it, the optimizer's "
                        "weights are saved in training-weights/ for --resume; default 0 (none). On --resume "
                        "of an unfinished run it replaces the run's from then on")
    parser.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                        help="a new dLLM (toy-dllm, long-dllm): start from this causal checkpoint of its "
                        "architecture (made by --model toy-dllm-ar / long-dllm-ar), turned bidirectional "
                        "with shifted logits")
    parser.add_argument("--init-out", type=Path, default=Path("training/checkpoints"), metavar="DIR",
                        help="--model all: where the toy-dllm-ar stage is saved (not shipped, so not in OUT)")
    parser.add_argument("--eval-only", action="store_true",
                        help="train nothing: evaluate OUT/<model> on the current suite and update its eval.json")
    parser.add_argument("--finish", action="store_true",
                        help="train nothing: end OUT/<model>'s unfinished run where it stopped (the rest of its "
                        "budget unspent), evaluate its weights and write eval.json as a finished run does")
    args = parser.parse_args(argv)
    if not 0 < args.pad_weight <= 1:
        parser.error(f"--pad-weight must be in (0, 1], got {args.pad_weight}")
    if not T_MIN < args.t_max <= 1:
        parser.error(f"--t-max must be in ({T_MIN}, 1], got {args.t_max}")
    if args.minutes is not None and args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.checkpoint_minutes <= 0:
        parser.error(f"--checkpoint-minutes must be > 0, got {args.checkpoint_minutes}")
    if args.weights is not None and args.model != "all":
        workload = SPECS[args.model].workload
        foreign = [f for f in args.weights if f not in workload.suite and f not in workload.sources]
        if foreign:
            known = ", ".join([*workload.suite, *workload.sources])
            parser.error(f"--weights: {', '.join(foreign)} not in {args.model}'s workload ({known})")
    dllms = [name for name, spec in SPECS.items() if spec.kind == "dllm"]
    if args.init_from is not None and (args.model not in dllms or args.resume):
        parser.error(f"--init-from starts a new dLLM: use it with --model {' or '.join(dllms)} and without --resume")
    shares = (("--prefix-share", args.prefix_share), ("--causal-share", args.causal_share),
              ("--decoder-share", args.decoder_share), ("--edit-share", args.edit_share),
              ("--edit-draft-share", args.edit_draft_share))
    for option, value in (("--masks", args.masks), ("--loss-mean", args.loss_mean),
                          ("--decoder-fill", args.decoder_fill), ("--decoder-rounds", args.decoder_rounds),
                          ("--decoder-tau", args.decoder_tau), ("--first-forward-share", args.first_forward_share),
                          ("--own-earlier-share", args.own_earlier_share),
                          ("--label-smoothing", args.label_smoothing), ("--edit-tau", args.edit_tau),
                          ("--edit-rate", args.edit_rate), ("--monitor-tau", args.monitor_tau), *shares):
        if value is not None and args.model not in dllms:
            parser.error(f"{option} is a dLLM's training option: use it with --model {' or '.join(dllms)}")
    for option, value in shares:
        if value is not None and not 0 <= value <= 1:
            parser.error(f"{option} must be in [0, 1], got {value}")
    if (args.prefix_share or 0) + (args.decoder_share or 0) > 1:
        parser.error(f"--prefix-share {args.prefix_share} and --decoder-share {args.decoder_share} are shares of "
                     "the same rows: their sum must be at most 1")
    if (args.prefix_share or 0) + (args.decoder_share or 0) + (args.edit_share or 0) > 1:
        parser.error(f"--prefix-share {args.prefix_share}, --decoder-share {args.decoder_share} and --edit-share "
                     f"{args.edit_share} are shares of the same rows: their sum must be at most 1")
    if args.edit_rate is not None and not 0 < args.edit_rate <= 1:
        parser.error(f"--edit-rate is the largest share of a row's filled positions replaced: it must be in (0, 1], "
                     f"got {args.edit_rate}")
    for option, count in (("--monitor-n", args.monitor_n), ("--monitor-every", args.monitor_every)):
        if count is not None and count < 1:
            parser.error(f"{option} must be at least 1, got {count}")
    if args.monitor_tau is not None and not 0 < args.monitor_tau < 1:
        parser.error(f"--monitor-tau is a threshold: it must be in (0, 1), got {args.monitor_tau}")
    if args.decoder_rounds is not None and args.decoder_rounds < 1:
        parser.error(f"--decoder-rounds is a number of forwards: it must be at least 1, got {args.decoder_rounds}")
    for option, value in (("--first-forward-share", args.first_forward_share),
                          ("--own-earlier-share", args.own_earlier_share)):
        if value is not None and not 0 <= value <= 1:
            parser.error(f"{option} must be in [0, 1], got {value}")
    if args.label_smoothing is not None and not 0 <= args.label_smoothing < 1:
        parser.error(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.ema is not None and not 0 <= args.ema < 1:
        parser.error(f"--ema is a decay per step: it must be in [0, 1), got {args.ema}")
    if args.finish and (args.model == "all" or args.resume or args.eval_only):
        parser.error("--finish ends one model's unfinished run: use it with one --model, without --resume "
                     "or --eval-only")
    if args.init_from is not None and not args.init_from.is_dir():
        parser.error(f"--init-from {args.init_from}: no such checkpoint directory")
    torch.set_num_threads(args.threads)
    follow_recipe = args.model == "all" and not (args.eval_only or args.resume)
    names = RECIPE if follow_recipe else ZOO if args.model == "all" else (args.model,)
    missing = [str(args.out / n) for n in names if (args.resume or args.eval_only) and not (args.out / n).is_dir()]
    if missing:
        parser.error(f"no checkpoint to {'evaluate' if args.eval_only else 'resume'}: {', '.join(missing)}")
    if args.finish:
        if unfinished_run(args.out / args.model) is None:
            parser.error(f"--finish: no unfinished run in {args.out / args.model}")
        end_run(args.model, args.out, args.eval_n)
        return
    if args.eval_only:
        for name in names:
            reevaluate(name, args.out, args.eval_n)
        return
    for name in names:
        budget = ALL_MINUTES if args.minutes is None else args.minutes
        split = args.minutes is None or args.model == "all"  # a share of the whole zoo's budget
        minutes = None if args.steps is not None else budget * SPECS[name].share if split else budget
        if args.resume and args.minutes is None and args.steps is None and unfinished_run(args.out / name):
            minutes = None  # an interrupted run goes on with its own budget
        out, seed, init_from = args.out, args.seed, args.init_from
        if follow_recipe and name == "toy-dllm-ar":
            out = args.init_out
        elif follow_recipe and name == "toy-dllm":  # new data, from the stage just trained
            seed, init_from = args.seed + 1, args.init_out / "toy-dllm-ar"
        elif SPECS[name].kind == "dllm" and init_from is None and not args.resume:
            print(f"[{name}] note: trained from scratch (no --init-from); such runs never learnt "
                  "'lookup' here (see this module's docstring)", flush=True)
        train_one(name, minutes, args.steps, seed, out, args.eval_n, args.resume, args.lr, args.weights,
                  args.pad_weight, args.t_max, init_from, args.checkpoint_minutes, args.masks, args.prefix_share,
                  args.causal_share, args.loss_mean, args.decoder_share, args.ema, args.decoder_fill,
                  args.decoder_rounds, args.decoder_tau, args.first_forward_share, args.own_earlier_share,
                  args.label_smoothing, args.edit_share, args.edit_draft_share, args.edit_tau, args.edit_rate,
                  args.monitor_n, args.monitor_tau, args.monitor_every)


if __name__ == "__main__":
    main()
