"""Train the toy zoo on CPU: ``PYTHONPATH=training python -m dloom_training.train --model all`` (300 minutes).

Models (``SPECS``), all transformers ``LlamaForCausalLM`` over a character vocabulary.  The
toy zoo (``toy-*``, workload ``SHORT``: the 54-character alphabet, answers in 32 positions)
and the long-answer zoo (``long-*``, workload ``LONG``, section below) are trained by the
same loop; each model's ``Workload`` gives its suite, vocabulary, answer region and batch.

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
  shape, 0.94 M) is the assistant of assisted generation.  The trainer encodes with the checkpoint's own
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
  2. That model made a dLLM (:func:`dllm_from_ar`) and trained for 21 minutes: 1,503 steps,
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
  that causal model made a dLLM (:func:`dllm_from_ar`),  300   100 %
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
import copy
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from dloom.model.attention import model_mask
from dloom.zoo import ZOO_DIR, long_tasks
from dloom.zoo import tokenizer as tok
from dloom.zoo.corpus import TEXT
from dloom.zoo.tasks import (
    ALPHABET,
    FAMILIES,
    GEN_LENGTH,
    Example,
    TaskFamily,
    held_out,
    lookup_curriculum,
    train_stream,
)

from .codec import CHARACTERS, Codec

__all__ = [
    "LONG", "LONG_WORDS", "SHORT", "SPECS", "ModelSpec", "Workload", "build_config", "build_model", "decode_ar", "decode_dllm",
    "Trace", "dllm_from_ar", "trace_dllm", "end_run", "evaluate", "main", "reevaluate", "save_checkpoint", "unfinished_run",
]


# Training mix: addition and lookup are the slowest to learn, so they are drawn more often.
TRAIN_WEIGHTS = {"add": 2.5, "sort": 1.0, "reverse": 1.0, "copy": 0.8, "lookup": 1.5, "code": 1.0, "story": 0.8}
CURRICULUM = {"lookup3": lookup_curriculum(3), "lookup4": lookup_curriculum(4)}
"""Training-only families, drawn only when ``--weights`` gives them a weight: ``lookup``
with three or four key-value pairs instead of five (fewer distractors)."""
# The long-answer mix: the two arithmetic families most (every step of a chain must be
# right), the grammar-checked tale least, and continuing Shakespeare for natural text.
LONG_WEIGHTS = {"chain": 1.6, "word": 1.2, "tale": 0.5, "prog": 1.0, "text": 0.7}
BATCH = 64  # the notes' recipe used 128; halved for twice the updates on contended cores
LONG_BATCH = 32  # 4x the positions per example: 32 rows of ~184 positions, ~1.5 s a step
WARMUP = 100
MIN_LR_FRACTION = 0.05
T_MIN = 0.02
MASK_ORDERS = ("uniform", "block")
"""The training mask orders of a dLLM (:func:`dllm_loss`'s ``block_length`` None or set)."""
MAX_EXTRA_PAD = 4


@dataclass(frozen=True)
class Workload:
    """What a model is trained and evaluated on: its task suite, vocabulary and answer region.

    ``suite`` holds the checkable families (evaluated; ``--weights`` may name them and the
    ``sources``); ``sources`` are training-only families, drawn when ``mix`` (or
    ``--weights``) gives them a weight; ``block_length`` is the dLLM's decoding block
    (semi-autoregressive: blocks left to right, one token per step inside a block);
    ``words``, the tokenizer's multi-character tokens (none: one token per character), so
    ``gen_length`` counts tokens, not characters.
    """

    name: str
    gen_length: int
    block_length: int
    alphabet: str
    suite: dict[str, TaskFamily]
    sources: dict[str, TaskFamily]
    mix: dict[str, float]
    batch: int
    max_positions: int
    monitor_per_family: int
    words: tuple[str, ...] = ()

    @cached_property
    def codec(self) -> Codec:
        """Text to ids and back with this workload's tokenizer."""
        return Codec.over(self.alphabet, self.words)


SHORT = Workload("short", GEN_LENGTH, GEN_LENGTH, ALPHABET, FAMILIES, CURRICULUM, TRAIN_WEIGHTS, BATCH, 128, 10)
"""The toy zoo's: answers of 8..31 characters in one block of 32, the 54-character alphabet."""
LONG = Workload("long", long_tasks.GEN_LENGTH, 32, long_tasks.ALPHABET, long_tasks.FAMILIES,
                {"text": TEXT, "sums": long_tasks.SUMS},
                LONG_WEIGHTS, LONG_BATCH, 256, 6)
"""The long-answer zoo's: 128 positions in four blocks of 32, printable ASCII and newline."""
LONG_WORDS = Workload("long-words", 64, 16, long_tasks.ALPHABET, long_tasks.FAMILIES, {"sums": long_tasks.SUMS},
                      {"chain": 2.5, "word": 2.0, "tale": 1.2, "prog": 0.8, "sums": 1.5}, 64, 128, 6,
                      words=long_tasks.WORD_TOKENS)
"""The long-answer suite in word tokens (``long_tasks.WORD_TOKENS``; issue 42): 64 positions
in four blocks of 16 (the longest answer, a ten-step ``chain``, is 59 tokens), batches of 64
(rows of at most 96 positions instead of 184), ``long-dllm``'s last mix without the
Shakespeare ``text``, whose words are not in the vocabulary."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture, workload and share of the ``all`` time budget of one zoo model."""

    kind: str  # "dllm" or "ar"
    hidden: int
    layers: int
    heads: int
    ffn: int
    share: float  # fraction of the --minutes budget when training "all" (toy zoo only)
    lr: float = 2e-3
    workload: Workload = SHORT


ALL_MINUTES = 300.0
"""The default wall-time budget of ``--model all``; a single model's default is its share."""
# Shares follow the wall time that made the shipped zoo (62, 76, 158 and 14 minutes).
SPECS: dict[str, ModelSpec] = {
    # toy-dllm's architecture trained as a causal LM: not shipped, the initialisation
    # ``toy-dllm`` starts from (``--init-from``).
    "toy-dllm-ar": ModelSpec("ar", hidden=192, layers=4, heads=6, ffn=512, share=0.20),
    "toy-dllm": ModelSpec("dllm", hidden=192, layers=4, heads=6, ffn=512, share=0.25),
    "toy-ar": ModelSpec("ar", hidden=256, layers=5, heads=8, ffn=640, share=0.50, lr=1.5e-3),
    "toy-ar-small": ModelSpec("ar", hidden=128, layers=3, heads=4, ffn=256, share=0.05),
    # The long-answer zoo (``LONG``): long-dllm-ar is long-dllm's shape trained causally,
    # the stage long-dllm starts from; long-ar is the AR target (2.3x), long-ar-small the
    # drafter (0.29x).  Shares are for a single model's default budget (of ALL_MINUTES).
    "long-dllm-ar": ModelSpec("ar", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG),
    "long-dllm": ModelSpec("dllm", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG),
    # long-dllm trained on for parallel (threshold) decoding, from long-dllm's weights (issue 42).
    "long-dllm-par": ModelSpec("dllm", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG),
    "long-ar": ModelSpec("ar", hidden=256, layers=6, heads=8, ffn=768, share=0.8, lr=1.5e-3, workload=LONG),
    "long-ar-small": ModelSpec("ar", hidden=128, layers=3, heads=4, ffn=384, share=0.2, workload=LONG),
    # The long suite in word tokens (``LONG_WORDS``, issue 42): long-dllm's shape, its causal
    # stage first (as long-dllm-ar for long-dllm), then the dLLM from it.
    "long-dllm-words-ar": ModelSpec("ar", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG_WORDS),
    "long-dllm-words": ModelSpec("dllm", hidden=192, layers=5, heads=6, ffn=512, share=0.4, workload=LONG_WORDS),
    # long-ar-small's shape in word tokens: the small AR assistant of assisted generation
    # next to FailFast on long-dllm-words-ar (0.35x long-dllm-words with the larger embedding).
    "long-dllm-words-ar-small": ModelSpec("ar", hidden=128, layers=3, heads=4, ffn=384, share=0.2,
                                          workload=LONG_WORDS),
}
ZOO = ("toy-dllm", "toy-ar", "toy-ar-small")
"""The models the package ships (``--model all --eval-only`` re-evaluates them)."""
RECIPE = ("toy-dllm-ar", "toy-dllm", "toy-ar", "toy-ar-small")
"""What ``--model all`` trains, in this order: ``toy-dllm`` starts from the ``toy-dllm-ar``
trained just before it (``--init-out``)."""
CHECKPOINT_MINUTES = 5.0
"""How often a training run saves its weights and ``progress.json`` (``--checkpoint-minutes``)."""


def build_model(name: str) -> LlamaForCausalLM:
    """A freshly initialised zoo model (call ``torch.manual_seed`` first to reproduce it)."""
    return LlamaForCausalLM(build_config(name))


def build_config(name: str) -> LlamaConfig:
    """The transformers config of zoo model ``name``, with its ``dloom`` section (a long-answer
    model's also names its decoding ``block_length``)."""
    spec = SPECS[name]
    workload = spec.workload
    bidirectional = spec.kind == "dllm"
    blocks = {} if workload is SHORT else {"block_length": workload.block_length}
    config = LlamaConfig(  # type: ignore[call-arg]  # extra keys are kept as config attributes
        vocab_size=workload.codec.size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=workload.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.PAD_ID,
        eos_token_id=tok.EOS_ID,
        bos_token_id=None,
        mask_token_id=tok.MASK_ID,
        is_causal=not bidirectional,
        dloom={
            "kind": spec.kind,
            "attention": "bidirectional" if bidirectional else "causal",
            "shift": not bidirectional,
            "gen_length": workload.gen_length,
            **blocks,
        },
    )
    return config


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- encoding
def encode_prompts(
    prompts: Sequence[str], extra_pad: int = 0, codec: Codec = CHARACTERS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts: ``input_ids``, ``attention_mask``, both ``(B, P)`` int64."""
    encoded = [codec.encode(prompt) for prompt in prompts]
    width = max(len(ids) for ids in encoded) + extra_pad
    ids = torch.full((len(prompts), width), tok.PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt_ids in enumerate(encoded):
        if prompt_ids:
            ids[row, width - len(prompt_ids) :] = torch.tensor(prompt_ids)
            mask[row, width - len(prompt_ids) :] = 1
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The zoo's position convention: ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def answer_region(answers: Sequence[str], gen_length: int = GEN_LENGTH, codec: Codec = CHARACTERS) -> torch.Tensor:
    """``(B, gen_length)`` answer ids followed by ``<eos>`` padding (at least one).

    :raises ValueError: an answer of ``gen_length`` tokens or more.
    """
    region = torch.full((len(answers), gen_length), tok.EOS_ID, dtype=torch.long)
    for row, answer in enumerate(answers):
        ids = codec.encode(answer)
        if len(ids) >= gen_length:
            raise ValueError(f"answer {answer!r} is {len(ids)} tokens; a region of {gen_length} holds {gen_length - 1}")
        region[row, : len(ids)] = torch.tensor(ids)
    return region


def answer_lengths(region: torch.Tensor) -> torch.Tensor:
    """``(B,)`` the answers' lengths in tokens: the first ``<eos>`` of each ``(B, G)`` region row."""
    return (region == tok.EOS_ID).int().argmax(-1)


def region_logits(model: LlamaForCausalLM, logits: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The ``(B, G, V)`` logits of the answer region from a dLLM's ``(B, P + G, V)`` output:
    columns ``P..`` for an unshifted model, ``P - 1..`` for a shifted (Dream-style) one, whose
    output at ``i`` predicts token ``i + 1``."""
    shifted = getattr(getattr(model, "config", None), "dloom", {}).get("shift", False)
    start = prompt_width - int(shifted)
    return logits[:, start : start + logits.shape[1] - prompt_width]


# --------------------------------------------------------------------------- losses
DECODER_TAUS = (0.9, 0.95)
"""The thresholds a ``"threshold"`` decoder row draws from by default (``--decoder-tau``)."""


def dllm_loss(
    model: LlamaForCausalLM,
    batch: Sequence[Example],
    extra_pad: int,
    gen: torch.Generator,
    pad_weight: float = 1.0,
    t_max: float = 1.0,
    gen_length: int = GEN_LENGTH,
    block_length: int | None = None,
    prefix_share: float = 0.0,
    causal_share: float = 0.0,
    loss_mean: str = "token",
    decoder_share: float = 0.0,
    decoder_fill: str = "answer",
    decoder_rounds: int = 1,
    decoder_taus: Sequence[float] = DECODER_TAUS,
    first_forward_share: float = 0.0,
    own_earlier_share: float = 0.0,
    label_smoothing: float = 0.0,
    codec: Codec = CHARACTERS,
) -> torch.Tensor:
    """Masked-diffusion cross-entropy over the masked positions of a ``gen_length`` region.

    The mask ratio ``t`` of each row is stratified over ``[T_MIN, t_max]``.  ``t_max < 1``
    trains on lightly masked answers only, where most of an answer's context is visible
    (for ``lookup``: a value's key is usually already written next to it).

    ``block_length`` ``None`` (LLaDA's masks): every position of the region is masked with
    probability ``t``, and the loss covers all masked positions.  ``block_length`` ``K``
    (block-order masks, the states a semi-autoregressive decoder meets): each row draws one
    of the region's ``gen_length // K`` blocks uniformly; the blocks before it are clean, its
    positions are masked with probability ``t``, every position after it is masked, and the
    loss covers the drawn block's masked positions only (a decoder never reads its
    predictions for a later block).  A ``prefix_share`` of the rows (drawn per row) masks
    their block from a uniform cut to its end instead: the state a decoder meets when it has
    committed the block's start, where a result must be computed from the visible operands
    (random masks mostly leave one copy of a repeated number visible, so a model can learn
    to copy it instead).  A ``decoder_share`` of the rows (drawn per row, apart from the
    prefix rows) holds the state a confidence-order decoder meets: of the drawn block, the
    ``m`` positions (``m`` uniform over ``0 .. K - 1``) the model itself is surest of with the
    block fully masked hold their answer, the rest are masked (:func:`_least_confident`; one
    more forward, without gradient, on those rows).  ``decoder_rounds`` ``N`` reveals them over
    ``N`` such forwards instead, each round's positions the surest given the earlier rounds'
    (``N`` at least ``K``: one a forward, the very state a one-token-per-step decoder reaches,
    at the cost of up to ``m`` forwards a row).  A decoder commits the easy positions
    first and leaves the hard ones, those the left context leaves open, to be read from
    what it committed on both sides; random masks rarely leave exactly those masked.
    ``decoder_fill`` is what those revealed positions hold: ``"answer"``, the row's answer;
    ``"model"``, the model's own argmax there, the state its decoder reaches, with the row's
    target the right answer closest to it (for families that list their right answers; the
    row's answer otherwise), and every revealed position where the argmax is not that answer's
    token masked and scored (:func:`_own_commits`).  A decoder that picked another filler than
    the row's answer for a slot (``went`` for ``walked``) never meets the answer-filled state,
    and in its own state the right continuation is that filler's answer; and a position the
    model is sure of but wrong at, which the decoder would commit first, is revealed with the
    answer's token (so never scored) in ``"answer"`` rows.  ``"threshold"``: the state dloom's
    threshold decoder (Fast-dLLM's rule, ``dloom.DiffusionDecoder(model, "threshold", tau=τ)``)
    reaches after ``f`` forwards in the drawn block (``f`` uniform over ``0 .. decoder_rounds -
    1``, ``τ`` drawn per row from ``decoder_taus``; :func:`threshold_rollout`): its commits are
    kept in the state even where they are wrong, and the block's still-masked positions are
    scored against the right answer closest to them (:func:`_own_commits`; the row's answer
    for families that list none), so the model learns to be unsure where its parallel commits
    went astray.  An ``own_earlier_share`` of those rows has its earlier blocks decoded by the
    same rule from the region's start (its own mistakes there too) instead of the answer's.
    A ``first_forward_share`` of the decoder rows (any fill) is at its block's first forward:
    the block entirely masked (``f = 0``, nothing revealed), where a threshold decoder commits
    the most positions at once.

    A ``causal_share`` of the rows (drawn per row) is trained as the causal stage was: the
    clean answer behind a causal attention mask, each position of the answer and its first
    ``<eos>`` predicted from the ones before it (:func:`ar_loss`'s positions).
    One such row teaches every step of a running sum, where a masked row teaches about one,
    so a bidirectional model learns the arithmetic from them and the masked rows teach it to
    use it among masks.  The loss is then the masked rows' mean plus the causal rows' mean.

    ``loss_mean`` is how the masked rows' mean is taken: ``"token"``, over their masked
    positions (each position weighs the same, so a row masked at ``t`` weighs in proportion
    to ``t``); ``"row"``, each row's own mean, then the mean over rows (each row weighs the
    same: LLaDA's ``1/t``-weighted objective in expectation, and the weighting of a
    block-by-block decoder's states, which meets each mask ratio of a block once, the
    lightly masked end of a block as often as its fully masked start).

    ``pad_weight`` scales the loss of the ``<eos>`` padding after each answer's first
    ``<eos>`` (1.0: LLaDA's plain mean over every masked position).  A lower weight leaves
    more of the gradient to the answer's own tokens, which are a quarter of the region for an
    8-character answer.  ``label_smoothing`` ``ε`` is the cross-entropy's (``torch``'s: the
    target ``1 - ε`` plus ``ε`` spread over the vocabulary), which caps a scored position's
    confidence below 1.  ``codec`` encodes the prompts and answers.
    """
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in batch], extra_pad, codec)
    target = answer_region([e.answer for e in batch], gen_length, codec)
    b = len(batch)
    t = T_MIN + (t_max - T_MIN) * (torch.arange(b) + torch.rand(b, generator=gen)) / b
    drawn = torch.rand(b, gen_length, generator=gen) < t[:, None]
    if block_length is None:
        masked, later = drawn, torch.zeros(b, gen_length, dtype=torch.bool)
        none = ~masked.any(-1)
        masked[none, torch.randint(gen_length, (int(none.sum()),), generator=gen)] = True
    else:
        block_of = torch.arange(gen_length) // block_length
        current = torch.randint(gen_length // block_length, (b, 1), generator=gen)
        in_block = torch.arange(gen_length) % block_length
        cut = torch.randint(block_length, (b, 1), generator=gen)
        row_kind = torch.rand(b, 1, generator=gen)
        prefix_rows = row_kind < prefix_share
        drawn = torch.where(prefix_rows, in_block[None, :] >= cut, drawn)
        if decoder_share > 0:
            decoder_rows = ~prefix_rows & (row_kind < prefix_share + decoder_share)
            revealed = torch.randint(block_length, (b, 1), generator=gen)
            if first_forward_share > 0:
                revealed[torch.rand(b, generator=gen) < first_forward_share] = 0
        masked, later = drawn & (block_of[None, :] == current), block_of[None, :] > current
        none = ~masked.any(-1)  # at least one scored position: one of the drawn block's
        offset = torch.randint(block_length, (int(none.sum()),), generator=gen)
        masked[none, current[none, 0] * block_length + offset] = True
    causal = torch.rand(b, generator=gen) < causal_share if causal_share > 0 else torch.zeros(b, dtype=torch.bool)
    lengths = answer_lengths(target)
    shown = target  # what the unmasked positions hold: the answer, but for threshold rows' own commits
    if decoder_share > 0 and block_length is not None:
        rows = (decoder_rows[:, 0] & ~causal).nonzero()[:, 0]  # a causal row's masks are cleared anyway
        if len(rows) and decoder_fill == "threshold":
            taus = torch.tensor(list(decoder_taus), dtype=torch.float)
            tau = taus[torch.randint(len(taus), (len(rows),), generator=gen)]
            forwards = torch.where(revealed[rows, 0] > 0,
                                   torch.randint(decoder_rounds, (len(rows),), generator=gen), 0)
            own = torch.rand(len(rows), generator=gen) < own_earlier_share
            state = threshold_rollout(model, prompt_ids[rows], prompt_mask[rows], target[rows], current[rows, 0],
                                      block_length, forwards, tau, own)
            drawn_block = (block_of[None, :] == current)[rows]
            masked[rows] = drawn_block & (state == tok.MASK_ID)
            settled = (block_of[None, :] < current[rows]) & ~own[:, None]
            committed = (block_of[None, :] <= current[rows]) & (state != tok.MASK_ID) & ~settled
            target[rows], lengths[rows], _ = _own_commits([batch[i] for i in rows.tolist()], target[rows],
                                                          committed, state, settled, lengths[rows], gen, codec)
            shown = target.clone()
            shown[rows] = torch.where(block_of[None, :] <= current[rows], state, target[rows])
        elif len(rows):
            drawn_block = (block_of[None, :] == current)[rows]
            masked[rows], guess = _least_confident(model, prompt_ids[rows], prompt_mask[rows], target[rows],
                                                   drawn_block, revealed[rows], decoder_rounds,
                                                   hold_guesses=decoder_fill == "model")
            if decoder_fill == "model":
                settled = block_of[None, :] < current[rows]
                target[rows], lengths[rows], mistaken = _own_commits(
                    [batch[i] for i in rows.tolist()], target[rows], drawn_block & ~masked[rows], guess,
                    settled, lengths[rows], gen, codec)
                masked[rows] |= mistaken
    masked, later = masked & ~causal[:, None], later & ~causal[:, None]  # causal rows: the clean answer
    noisy = torch.where(masked | later, torch.full_like(target, tok.MASK_ID), shown)
    input_ids = torch.cat([prompt_ids, noisy], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(noisy)], dim=1)
    positions = position_ids(attention_mask)
    if causal_share > 0:
        attention_mask = model_mask(row_attention(attention_mask, causal), model)
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
    logits = region_logits(model, output.logits, prompt_ids.shape[1])
    through_eos = torch.arange(gen_length)[None, :] <= lengths[:, None]  # the answer and its first <eos>
    weight = torch.where(through_eos, 1.0, pad_weight)
    parts = []
    if masked.any():
        parts.append(_weighted_mean(logits, target, weight, masked, by_row=loss_mean == "row",
                                    label_smoothing=label_smoothing))
    through = causal[:, None] & through_eos  # causal rows: the causal stage's positions
    if through.any():
        parts.append(_weighted_mean(logits, target, weight, through, label_smoothing=label_smoothing))
    return torch.stack(parts).sum()


def _least_confident(
    model: LlamaForCausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    target: torch.Tensor,
    block: torch.Tensor,
    revealed: torch.Tensor,
    rounds: int = 1,
    hold_guesses: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks of a confidence-order decoder's state inside one block, for ``R`` rows.

    :param prompt_ids: ``(R, P)`` long, left-padded prompts; ``prompt_mask`` their ``(R, P)``
        key padding.
    :param target: ``(R, G)`` long, the answer regions.
    :param block: ``(R, G)`` bool, each row's drawn block (one run of positions).
    :param revealed: ``(R, 1)`` long, how many of the block's positions to reveal, below the
        block's length (so at least one stays masked).
    :param rounds: the reveals are spread over this many forwards (at most ``revealed``
        forwards a row): each forward reveals the next share of a row's ``revealed`` positions,
        those the model is surest of in the state the earlier rounds left.  ``1``: all of them
        from the block fully masked; ``rounds`` at least the block's length: one a forward, the
        state a one-token-per-step decoder reaches.
    :param hold_guesses: what a revealed position holds for the later rounds: the model's argmax
        there (``True``: the decoder's own commits) or the answer's token.
    :return: ``(R, G)`` bool, the block's positions other than the ``revealed`` ones the model
        was surest of (largest max-probability over the tokens a decoder may commit) when they
        were revealed (the region from the block on masked but for the earlier rounds' reveals),
        and ``(R, G)`` long, the model's argmax (over those tokens) at each revealed position,
        from the round that revealed it (the first forward's elsewhere); reads the model without
        gradient.
    """
    ahead = block.int().cummax(-1).values.bool()  # the block and every position after it
    state = torch.where(ahead, torch.full_like(target, tok.MASK_ID), target)
    shown = torch.zeros_like(block)
    guess = torch.zeros_like(target)
    for r in range(rounds):
        goal = (revealed[:, 0] * (r + 1) + rounds - 1) // rounds  # reveals due by the end of round r
        need = goal - shown.sum(-1)
        rows = (need > 0).nonzero()[:, 0] if r else torch.arange(len(target))
        if not len(rows):
            continue
        attention_mask = torch.cat([prompt_mask[rows], torch.ones_like(state[rows])], dim=1)
        with torch.no_grad():
            output = model(input_ids=torch.cat([prompt_ids[rows], state[rows]], dim=1),
                           attention_mask=attention_mask, position_ids=position_ids(attention_mask))
            logits = region_logits(model, output.logits, prompt_ids.shape[1])
            logits[..., [tok.PAD_ID, tok.MASK_ID]] = -math.inf
            probability, argmax = logits.softmax(-1).max(-1)
        confidence = torch.where(block[rows] & ~shown[rows], probability, -math.inf)
        rank = confidence.argsort(-1, descending=True).argsort(-1)  # 0: the surest open position
        new = block[rows] & ~shown[rows] & (rank < need[rows, None])
        guess[rows] = torch.where(new | (r == 0), argmax, guess[rows])
        shown[rows] |= new
        state[rows] = torch.where(new, argmax if hold_guesses else target[rows], state[rows])
    return block & ~shown, guess


DECODER_FILLS = ("answer", "model", "threshold")
"""What a decoder row's revealed positions hold (:func:`dllm_loss`'s ``decoder_fill``)."""


def threshold_rollout(
    model: LlamaForCausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    target: torch.Tensor,
    current: torch.Tensor,
    block_length: int,
    forwards: torch.Tensor,
    tau: torch.Tensor,
    own_earlier: torch.Tensor,
) -> torch.Tensor:
    """The states dloom's threshold decoder reaches in ``R`` rows' drawn blocks, without gradient.

    The rule is Fast-dLLM's, as ``dloom.DiffusionDecoder(model, "threshold", tau=τ)`` applies
    it: each forward reads the region, and in the leftmost block with masks commits every
    masked position whose confidence (the argmax's probability, the mask token excluded)
    exceeds ``τ`` -- at least the surest one -- to its argmax, right or wrong.  Only the rows
    still decoding are run, all of them in one batched forward.

    :param prompt_ids: ``(R, P)`` long, left-padded prompts; ``prompt_mask`` their key padding.
    :param target: ``(R, G)`` long, the answer regions.
    :param current: ``(R,)`` long, each row's drawn block.
    :param block_length: the blocks' length ``K`` (``G`` a multiple of it).
    :param forwards: ``(R,)`` long, the forwards each row spends in its drawn block.
    :param tau: ``(R,)`` float, each row's threshold.
    :param own_earlier: ``(R,)`` bool: the row's earlier blocks are decoded by the same rule from
        the region's start (the forwards that takes are not counted in ``forwards``); else
        they hold the answer.
    :return: ``(R, G)`` long, the region after those forwards (the mask token where nothing is
        committed; every block after the drawn one masked).  A forward that would commit the
        drawn block's last masks is not applied: that row stops one forward early, so the drawn
        block keeps at least one masked position to score.
    """
    g = target.shape[1]
    block_of = torch.arange(g, device=target.device) // block_length
    ahead = (block_of[None, :] >= current[:, None]) | own_earlier[:, None]
    state = torch.where(ahead, torch.full_like(target, tok.MASK_ID), target)
    spent = torch.zeros_like(forwards)
    active = (forwards > 0) | (own_earlier & (current > 0))
    p = prompt_ids.shape[1]
    while bool(active.any()):
        rows = active.nonzero()[:, 0]
        region = state[rows]
        attention_mask = torch.cat([prompt_mask[rows], torch.ones_like(region)], dim=1)
        with torch.no_grad():
            output = model(input_ids=torch.cat([prompt_ids[rows], region], dim=1), attention_mask=attention_mask,
                           position_ids=position_ids(attention_mask))
            logits = region_logits(model, output.logits, p).float()
        logits[..., tok.MASK_ID] = -math.inf
        probability, candidate = logits.softmax(-1).max(-1)
        open_positions = region == tok.MASK_ID
        open_block = block_of[open_positions.int().argmax(-1)]  # the leftmost block with masks
        selectable = open_positions & (block_of[None, :] == open_block[:, None])
        confidence = torch.where(selectable, probability, -math.inf)
        commit = selectable & (confidence > tau[rows, None])
        commit[torch.arange(len(rows)), confidence.argmax(-1)] = True
        in_drawn = open_block == current[rows]
        apply = ~(in_drawn & (commit.sum(-1) == selectable.sum(-1)))
        state[rows] = torch.where(commit & apply[:, None], candidate, region)
        spent[rows] += (in_drawn & apply).long()
        before = block_of[(state[rows] == tok.MASK_ID).int().argmax(-1)] < current[rows]
        active[rows] = apply & (before | (spent[rows] < forwards[rows]))
    return state



def _own_commits(
    examples: Sequence[Example],
    target: torch.Tensor,
    revealed: torch.Tensor,
    guess: torch.Tensor,
    settled: torch.Tensor,
    lengths: torch.Tensor,
    gen: torch.Generator,
    codec: Codec = CHARACTERS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The targets of ``R`` decoder rows whose revealed positions hold the model's guesses.

    :param examples: the rows' examples.
    :param target: ``(R, G)`` long, their answer regions; ``lengths`` ``(R,)`` their answers' lengths.
    :param revealed: ``(R, G)`` bool, the drawn block's positions the state reveals.
    :param guess: ``(R, G)`` long, the model's argmax at every position.
    :param settled: ``(R, G)`` bool, the positions before the drawn block (the answer's, clean).
    :return: ``(R, G)`` targets, ``(R,)`` lengths and ``(R, G)`` bool mistakes.  A row whose
        family lists its right answers (``TaskFamily.answers``) gets, among those that agree
        with its answer at ``settled``, one that agrees with ``guess`` at the most ``revealed``
        positions, drawn uniformly; any other row keeps its answer.  The mistakes are the
        ``revealed`` positions where ``guess`` differs from the new target: a decoder would
        commit them first, so :func:`dllm_loss` leaves them masked and scores them, and the
        state holds the guesses at the other revealed positions.
    """
    target, lengths = target.clone(), lengths.clone()
    for i, example in enumerate(examples):
        family = _CHECKABLE.get(example.family)
        answers = None if family is None else family.answers(example.prompt)
        if not answers:
            continue
        regions = answer_region(answers, target.shape[1], codec)
        agreeing = torch.where(revealed[i], regions == guess[i], False).sum(-1)
        agreeing[~torch.where(settled[i], regions == target[i], True).all(-1)] = -1  # the answer holds them
        best = (agreeing == agreeing.max()).nonzero()[:, 0]
        chosen = int(best[torch.randint(len(best), (1,), generator=gen)])
        target[i], lengths[i] = regions[chosen], answer_lengths(regions[chosen : chosen + 1])[0]
    return target, lengths, revealed & (guess != target)


LOSS_MEANS = ("token", "row")
"""How :func:`dllm_loss` averages its masked rows' cross-entropy."""


def _weighted_mean(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, scored: torch.Tensor, by_row: bool = False,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The ``weight``-weighted mean cross-entropy (with ``label_smoothing``) over the ``scored``
    ``(B, G)`` positions; ``by_row``: the mean over the rows with a scored position of each
    row's weighted mean."""
    loss = F.cross_entropy(logits[scored], target[scored], reduction="none",
                           label_smoothing=label_smoothing) * weight[scored]
    if not by_row:
        return loss.sum() / weight[scored].sum()
    row = scored.nonzero()[:, 0]
    sums = torch.zeros(len(scored), dtype=loss.dtype).index_add(0, row, loss)
    weights = torch.zeros(len(scored), dtype=loss.dtype).index_add(0, row, weight[scored])
    has = scored.any(-1)
    return (sums[has] / weights[has]).mean()


def row_attention(attention_mask: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """``(B, 1, L, L)`` bool attention (``True`` = attend) for ``(B, L)`` key padding: every
    valid key for a row of ``causal`` ``False``, the keys up to the query's own for a row of
    ``causal`` ``True``; each query also attends to itself, so a padding query has a key."""
    length = attention_mask.shape[1]
    keys = attention_mask.bool()[:, None, None, :]
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = keys & (lower | ~causal[:, None, None, None])
    return allowed | torch.eye(length, dtype=torch.bool)


def ar_loss(
    model: LlamaForCausalLM, batch: Sequence[Example], extra_pad: int, codec: Codec = CHARACTERS
) -> torch.Tensor:
    """Next-token cross-entropy over each answer and its ``<eos>``, the prompt left-padded."""
    prompt_ids, prompt_mask = encode_prompts([e.prompt for e in batch], extra_pad, codec)
    answers = [codec.encode(e.answer) for e in batch]
    width = max(len(ids) for ids in answers) + 1
    region = torch.full((len(batch), width), tok.PAD_ID, dtype=torch.long)
    region_mask = torch.zeros_like(region)
    for row, ids in enumerate(answers):
        region[row, : len(ids) + 1] = torch.tensor([*ids, tok.EOS_ID])
        region_mask[row, : len(ids) + 1] = 1
    input_ids = torch.cat([prompt_ids, region], dim=1)
    attention_mask = torch.cat([prompt_mask, region_mask], dim=1)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)
    ).logits
    p = prompt_ids.shape[1]
    predicted = logits[:, p - 1 : -1]  # position i predicts token i + 1
    keep = region_mask.bool()
    return F.cross_entropy(predicted[keep], region[keep])


# --------------------------------------------------------------------------- decoding
_CHECKABLE = {**FAMILIES, **long_tasks.FAMILIES}
"""Every checkable family by name (the two suites' names are disjoint)."""

DECODING_ORDERS = ("confidence", "left-to-right")
"""Which masked position of the current block :func:`trace_dllm` commits at each step."""


class Trace(NamedTuple):
    """One-token-per-step decoding of ``B`` prompts over a ``G``-position region."""

    region: torch.Tensor
    """``(B, G)`` long: the decoded tokens."""
    step: torch.Tensor
    """``(B, G)`` long: the step that committed each position (a permutation of ``0 .. G - 1``)."""
    confidence: torch.Tensor
    """``(B, G)`` float: the max-probability each position had when it was committed."""


@torch.no_grad()
def decode_dllm(
    model: LlamaForCausalLM, prompts: Sequence[str], order: str = "confidence", codec: Codec = CHARACTERS
) -> list[str]:
    """Greedy one-token-per-step answers of a dLLM (:func:`trace_dllm`), as text."""
    return [codec.decode(row) for row in trace_dllm(model, prompts, order, codec).region.tolist()]


@torch.no_grad()
def trace_dllm(
    model: LlamaForCausalLM, prompts: Sequence[str], order: str = "confidence", codec: Codec = CHARACTERS
) -> Trace:
    """Greedy decoding, one token per step, blocks left to right, with each commit's step.

    The region has the model's ``dloom.gen_length`` positions (``GEN_LENGTH`` if it names
    none), decoded in blocks of ``dloom.block_length`` (default: one block): each step
    commits one masked position of the leftmost block that still has masks to its argmax.
    ``order`` ``"confidence"`` picks the position of highest max-probability (LLaDA's
    semi-autoregressive low-confidence remasking, the zoo's evaluation); ``"left-to-right"``
    the leftmost one (a diagnostic: what the model knows when no later position is ever
    committed first).

    :return: the tokens, and each position's commit step and confidence.
    :raises ValueError: for an ``order`` outside :data:`DECODING_ORDERS`.
    """
    if order not in DECODING_ORDERS:
        raise ValueError(f"order is {order!r}; allowed: {', '.join(DECODING_ORDERS)}")
    dloom = getattr(model.config, "dloom", {})
    gen_length = dloom.get("gen_length", GEN_LENGTH)
    block_length = dloom.get("block_length", gen_length)
    prompt_ids, prompt_mask = encode_prompts(prompts, codec=codec)
    b, p = prompt_ids.shape
    x = torch.cat([prompt_ids, torch.full((b, gen_length), tok.MASK_ID, dtype=torch.long)], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones((b, gen_length), dtype=torch.long)], dim=1)
    pos = position_ids(attention_mask)
    rows = torch.arange(b)
    block = torch.arange(gen_length) // block_length
    leftmost_first = -torch.arange(gen_length, dtype=torch.float)[None, :].expand(b, -1)
    committed_at = torch.zeros((b, gen_length), dtype=torch.long)
    committed_confidence = torch.zeros((b, gen_length))
    for step in range(gen_length):
        output = model(input_ids=x, attention_mask=attention_mask, position_ids=pos)
        logits = region_logits(model, output.logits, p).float()
        logits[..., [tok.PAD_ID, tok.MASK_ID]] = -math.inf
        probability, candidate = logits.softmax(-1).max(-1)
        priority = leftmost_first if order == "left-to-right" else probability
        still = (x[:, p:] == tok.MASK_ID) & (block == step // block_length)[None, :]
        choice = torch.where(still, priority, -math.inf).argmax(-1)
        x[rows, p + choice] = torch.where(still[rows, choice], candidate[rows, choice], x[rows, p + choice])
        committed_at[rows, choice] = step
        committed_confidence[rows, choice] = probability[rows, choice]
    return Trace(x[:, p:], committed_at, committed_confidence)


@torch.no_grad()
def decode_ar(model: LlamaForCausalLM, prompts: Sequence[str], codec: Codec = CHARACTERS) -> list[str]:
    """Greedy generation of up to the model's ``dloom.gen_length`` tokens (``GEN_LENGTH`` if
    it names none); stops once every row emitted ``<eos>``. Each step feeds only the new
    token, with the model's KV cache (a 128-token answer costs one prompt forward and 127
    one-token forwards, not 128 forwards of the growing sequence)."""
    x, attention_mask = encode_prompts(prompts, codec=codec)
    positions = position_ids(attention_mask)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    generated, cache = [], DynamicCache(config=model.config)
    for _ in range(getattr(model.config, "dloom", {}).get("gen_length", GEN_LENGTH)):
        out = model(input_ids=x, attention_mask=attention_mask, position_ids=positions, cache=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        logits[:, [tok.PAD_ID, tok.MASK_ID]] = -math.inf
        nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, tok.EOS_ID), nxt)
        generated.append(nxt)
        done |= nxt == tok.EOS_ID
        if done.all():
            break
        x, positions = nxt[:, None], positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)[:, None]], dim=1)
    return [codec.decode(row) for row in torch.stack(generated, 1).tolist()]


def evaluate(
    model: LlamaForCausalLM, kind: str, examples: Sequence[Example], batch: int = 128, codec: Codec = CHARACTERS
) -> dict:
    """Exact-match accuracy (``TaskFamily.check``) overall and per family, plus samples."""
    model.eval()
    answers: list[str] = []
    for start in range(0, len(examples), batch):
        prompts = [e.prompt for e in examples[start : start + batch]]
        if kind == "dllm":
            answers += decode_dllm(model, prompts, codec=codec)
        else:
            answers += decode_ar(model, prompts, codec)
    per: dict[str, list[bool]] = {}
    for e, a in zip(examples, answers, strict=True):
        per.setdefault(e.family, []).append(_CHECKABLE[e.family].check(e.prompt, a))
    hits = [h for v in per.values() for h in v]
    samples = [{"prompt": e.prompt, "output": a} for e, a in list(zip(examples, answers))[: 2 * len(per)]]
    return {
        "overall": sum(hits) / len(hits),
        "per_family": {f: sum(v) / len(v) for f, v in per.items()},
        "n": len(hits),
        "samples": samples,
    }


# --------------------------------------------------------------------------- training
def _part_seed(seed: int, start_step: int) -> int:
    """The seed of the part of a run that starts at ``start_step``: ``seed`` itself for a new
    run, ``seed * 100_000_000 + start_step`` for a continued one (new data and masks,
    deterministic in the run's seed and where it was continued)."""
    return seed if start_step == 0 else seed * 100_000_000 + start_step


def _batches(
    seed: int, weights: dict[str, float], workload: Workload, start_step: int = 0
) -> Iterator[tuple[list[Example], int]]:
    """Training batches of ``workload.batch`` examples and their extra left padding; a run
    continued at ``start_step`` draws from the stream of :func:`_part_seed` (new data)."""
    data_seed = _part_seed(seed, start_step)
    families = [workload.sources.get(name, name) for name in weights]
    stream = train_stream(data_seed, families=families, weights=list(weights.values()), suite=workload.suite)
    pad_rng = random.Random(f"pad:{data_seed}")
    while True:
        yield [next(stream) for _ in range(workload.batch)], pad_rng.randint(0, MAX_EXTRA_PAD)


def _lr(step: int, progress: float, peak: float, start: int = 0) -> float:
    """Cosine in ``progress`` (0..1) from ``peak`` to 5 % of it, after a linear warm-up over
    the ``WARMUP`` steps from ``start``: to ``peak`` for a new run (``start`` 0), to the
    scheduled rate for a run continued at step ``start`` (its optimizer moments are new)."""
    progress = min(1.0, max(0.0, progress))
    cosine = peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))
    if step - start < WARMUP:
        return (peak if start == 0 else cosine) * (step - start + 1) / WARMUP
    return cosine


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


def check_parallel_options(
    name: str, decoder_share: float, decoder_fill: str, decoder_taus: Sequence[float], first_forward_share: float,
    own_earlier_share: float, label_smoothing: float,
) -> None:
    """Check the parallel-decoding options of a run (:func:`dllm_loss`'s) before any work.

    :raises ValueError: naming the bad value and what is allowed: a threshold outside
        ``(0, 1)``, a share or ``label_smoothing`` outside ``[0, 1]`` (``label_smoothing``
        below 1), ``first_forward_share`` without decoder rows, ``own_earlier_share`` without
        the ``"threshold"`` fill.
    """
    bad = [tau for tau in decoder_taus if not 0 < tau < 1]
    if not decoder_taus or bad:
        raise ValueError(f"{name}: decoder_taus {list(decoder_taus)} are thresholds: each must be in (0, 1)")
    for option, share in (("first_forward_share", first_forward_share), ("own_earlier_share", own_earlier_share)):
        if not 0 <= share <= 1:
            raise ValueError(f"{name}: {option} {share} is a share of the decoder rows: it must be in [0, 1]")
    if first_forward_share and not decoder_share:
        raise ValueError(f"{name}: first_forward_share {first_forward_share} is a share of the decoder rows: "
                         "it needs a decoder_share")
    if own_earlier_share and decoder_fill != "threshold":
        raise ValueError(f"{name}: own_earlier_share {own_earlier_share} decodes a row's earlier blocks with the "
                         f"threshold rule: it needs decoder_fill 'threshold', got {decoder_fill!r}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"{name}: label_smoothing {label_smoothing} must be in [0, 1)")


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
    "own_earlier_share", "label_smoothing", "ema", "init_from", "train_seconds",
    "final_loss_avg", "overall", "per_family",
)


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
) -> dict:
    """Train (or, with ``resume``, continue training) one model, save it, evaluate it.

    Every ``checkpoint_minutes`` of wall time the run saves its weights and its record
    (``progress.json``: steps, elapsed seconds, budget, loss and monitor curves) into
    ``out/name`` (:func:`save_checkpoint`), so a run that is killed keeps its last minutes.

    ``resume`` continues the checkpoint in ``out/name``.  If its run is unfinished (killed
    before its budget was spent), the run goes on where it stopped: same schedule position
    (steps and elapsed seconds count on, the cosine follows them), its seed, peak lr, mix,
    ``pad_weight``, ``t_max``, a fresh AdamW warmed up again over ``WARMUP`` steps, new data
    (:func:`_batches`); ``minutes``/``steps``, if given, replace its total budget, and
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
    spec = SPECS[name]
    workload = spec.workload
    directory = out / name
    run = unfinished_run(directory) if resume else None
    if run is not None:
        seed, pad_weight, t_max = run["seed"], run["pad_weight"], run["t_max"]
        init_from = None if run["init_from"] is None else Path(run["init_from"])
        mix = {**run["train_weights"], **(weights or {})}
        masks = masks or run.get("masks", "uniform")
        prefix_share = run.get("prefix_share", 0.0) if prefix_share is None else prefix_share
        causal_share = run.get("causal_share", 0.0) if causal_share is None else causal_share
        loss_mean = loss_mean or run.get("loss_mean", "token")
        decoder_share = run.get("decoder_share", 0.0) if decoder_share is None else decoder_share
        decoder_fill = decoder_fill or run.get("decoder_fill", "answer")
        decoder_rounds = decoder_rounds or run.get("decoder_rounds", 1)
        decoder_taus = tuple(decoder_taus or run.get("decoder_taus", DECODER_TAUS))
        first_forward_share = run.get("first_forward_share", 0.0) if first_forward_share is None \
            else first_forward_share
        own_earlier_share = run.get("own_earlier_share", 0.0) if own_earlier_share is None else own_earlier_share
        label_smoothing = run.get("label_smoothing", 0.0) if label_smoothing is None else label_smoothing
        ema_before = run.get("ema", 0.0)
        ema = ema_before if ema is None else ema
        peak = lr if lr is not None else run["peak_lr"]
        if minutes is None and steps is None:
            minutes = None if run["budget_seconds"] is None else run["budget_seconds"] / 60
            steps = run["total_steps"]
        start_step, elapsed_before, history = run["steps"], run["train_seconds"], run["history"]
        curves = {"loss_curve": run["loss_curve"], "monitor_curve": run["monitor_curve"]}
    else:
        mix = {**workload.mix, **(weights or {})}
        masks = masks or "uniform"
        prefix_share = prefix_share or 0.0
        causal_share = causal_share or 0.0
        loss_mean = loss_mean or "token"
        decoder_share = decoder_share or 0.0
        decoder_fill = decoder_fill or "answer"
        decoder_rounds = decoder_rounds or 1
        decoder_taus = tuple(decoder_taus or DECODER_TAUS)
        first_forward_share = first_forward_share or 0.0
        own_earlier_share = own_earlier_share or 0.0
        label_smoothing = label_smoothing or 0.0
        ema_before, ema = 0.0, ema or 0.0
        from_checkpoint = resume or init_from is not None
        peak = lr if lr is not None else spec.lr / 2 if from_checkpoint else spec.lr
        start_step, elapsed_before, history = 0, 0.0, []
        curves = {"loss_curve": [], "monitor_curve": []}
    if minutes is None and steps is None:
        raise ValueError(f"{name}: no budget (give minutes or steps)")
    for option, share in (("prefix_share", prefix_share), ("decoder_share", decoder_share)):
        if share and masks != "block":
            raise ValueError(f"{name}: {option} {share} needs block masks, the run's are {masks!r}")
    if prefix_share + decoder_share > 1:
        raise ValueError(f"{name}: prefix_share {prefix_share} and decoder_share {decoder_share} are shares "
                         "of the same rows: their sum must be at most 1")
    if decoder_fill != "answer" and not decoder_share:
        raise ValueError(f"{name}: decoder_fill {decoder_fill!r} fills the decoder rows: it needs a decoder_share")
    if decoder_rounds < 1 or (decoder_rounds > 1 and not decoder_share):
        raise ValueError(f"{name}: decoder_rounds {decoder_rounds} is the number of forwards that reveal a "
                         "decoder row's positions: it must be at least 1, and above 1 it needs a decoder_share")
    check_parallel_options(name, decoder_share, decoder_fill, decoder_taus, first_forward_share,
                           own_earlier_share, label_smoothing)
    if not 0 <= ema < 1:
        raise ValueError(f"{name}: ema {ema} is a decay per step: it must be in [0, 1)")
    torch.manual_seed(_part_seed(seed, start_step))
    averaged = None
    if resume:
        trained = directory / TRAINING_WEIGHTS if run is not None and ema_before > 0 else directory
        model = LlamaForCausalLM.from_pretrained(trained, local_files_only=True, dtype=torch.float32)
        if ema > 0:
            average_from = LlamaForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
            averaged = AveragedModel(average_from, multi_avg_fn=get_ema_multi_avg_fn(ema), use_buffers=True)
            averaged.n_averaged.fill_(1)  # it holds an average already: the next update blends into it
        if run is None:
            history = _history(directory)
    elif init_from is not None:
        model = dllm_from_ar(init_from, name)
        history = _history(init_from)
    else:
        model = build_model(name)
    if ema > 0 and averaged is None:
        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema), use_buffers=True)
    # what the monitor reads and the checkpoints hold
    evaluated = model if averaged is None else cast(LlamaForCausalLM, averaged.module)
    model.train()
    print(f"[{name}] {n_params(model):,} parameters, kind={spec.kind}, workload={workload.name}, "
          f"resume={resume}" + (f" (continuing at step {start_step})" if run is not None else "")
          + (f", weights averaged (ema {ema})" if averaged is not None else ""), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(_part_seed(seed, start_step))
    batches = _batches(seed, mix, workload, start_step)
    monitor = held_out(len(workload.suite) * workload.monitor_per_family, seed=1, suite=workload.suite)
    budget = None if steps is not None or minutes is None else minutes * 60
    total = steps

    def record(step: int, elapsed: float, running: float | None, finished: bool) -> dict:
        return {
            "model": name, "kind": spec.kind, "workload": workload.name, "params": n_params(model), "seed": seed,
            "peak_lr": peak, "steps": step, "batch": workload.batch, "train_weights": mix,
            "pad_weight": pad_weight, "t_max": t_max, "masks": masks,
            "prefix_share": prefix_share, "causal_share": causal_share, "loss_mean": loss_mean,
            "decoder_share": decoder_share, "decoder_fill": decoder_fill,
            "decoder_rounds": decoder_rounds, "decoder_taus": list(decoder_taus),
            "first_forward_share": first_forward_share, "own_earlier_share": own_earlier_share,
            "label_smoothing": label_smoothing, "ema": ema,
            "init_from": None if init_from is None else str(init_from),
            "train_seconds": round(elapsed, 1), "budget_seconds": budget, "total_steps": total,
            "final_loss_avg": running, "finished": finished, **curves, "history": history,
        }

    start = time.time() - elapsed_before
    last_save = time.time()
    step, running = start_step, None
    while True:
        elapsed = time.time() - start
        if (total is not None and step >= total) or (budget is not None and elapsed >= budget):
            break
        # --steps: cosine over steps; --minutes: cosine over wall-clock time (robust to CPU
        # contention, which on shared cores changes the speed several-fold mid-run).
        progress = step / total if total is not None else elapsed / budget
        for group in opt.param_groups:
            group["lr"] = _lr(step, progress, peak, start_step)
        batch, extra_pad = next(batches)
        if spec.kind == "dllm":
            blocks = workload.block_length if masks == "block" else None
            loss = dllm_loss(model, batch, extra_pad, gen, pad_weight, t_max, workload.gen_length, blocks,
                             prefix_share, causal_share, loss_mean, decoder_share, decoder_fill,
                             decoder_rounds, decoder_taus, first_forward_share, own_earlier_share, label_smoothing,
                             workload.codec)
        else:
            loss = ar_loss(model, batch, extra_pad, workload.codec)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if averaged is not None:
            averaged.update_parameters(model)
        step += 1
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == start_step + 1:
            elapsed = time.time() - start
            curves["loss_curve"].append([step, round(elapsed), round(running, 4)])
            print(f"[{name}] step {step} progress {progress:.3f} loss {loss.item():.4f} avg {running:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} elapsed {elapsed:.0f}s", flush=True)
        if step % 300 == 0:
            acc = evaluate(evaluated, spec.kind, monitor, codec=workload.codec)
            model.train()
            curves["monitor_curve"].append([step, round(acc["overall"], 3), acc["per_family"]])
            print(f"[{name}] step {step} monitor {_accuracy_line(acc)}", flush=True)
        if time.time() - last_save >= checkpoint_minutes * 60:
            save_checkpoint(evaluated, directory, workload, record(step, time.time() - start, running, False),
                            None if averaged is None else model)
            last_save = time.time()
            print(f"[{name}] checkpoint saved to {directory} at step {step}", flush=True)
    train_seconds = time.time() - start
    save_checkpoint(evaluated, directory, workload, record(step, train_seconds, running, True),
                    None if averaged is None else model)
    print(f"[{name}] saved to {directory} after {step} steps, {train_seconds:.0f}s", flush=True)

    return _write_evaluation(directory, spec.kind, record(step, train_seconds, running, True), eval_n, workload)


def _write_evaluation(directory: Path, kind: str, record: dict, eval_n: int, workload: Workload) -> dict:
    """Evaluate the weights saved in ``directory`` on ``eval_n`` held-out prompts and write
    ``eval.json``: the finished run's ``record`` (without ``finished``), the parameter count,
    the decoding and :func:`evaluate`'s result.  Returns what it wrote."""
    reloaded, result, eval_seconds = _evaluate_saved(directory, kind, eval_n, workload)
    summary = {
        **{k: v for k, v in record.items() if k != "finished"},
        "params": n_params(reloaded),
        "eval_seconds": eval_seconds,
        "decoding": "greedy, one token per step (low-confidence)" if kind == "dllm" else "greedy AR",
        **result,
    }
    (directory / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[{record['model']}] eval {_accuracy_line(result)}", flush=True)
    return summary


def end_run(name: str, out: Path, eval_n: int) -> dict:
    """End the unfinished run saved in ``out/name`` where it stopped, leaving the rest of its
    budget unspent: its record (``progress.json``) is marked finished, with ``ended_early``
    true, and its weights, untouched, are evaluated into ``eval.json`` as at the end of a run
    (:func:`_write_evaluation`).  A later ``--resume`` starts a new run from them.

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
    return _write_evaluation(directory, SPECS[name].kind, record, eval_n, SPECS[name].workload)


def _history(directory: Path) -> list[dict]:
    """The training record of the checkpoint in ``directory``: its earlier runs, then its last
    (from ``eval.json``, or ``progress.json`` for a run stopped before its evaluation)."""
    path = directory / "eval.json"
    previous = json.loads((path if path.is_file() else directory / PROGRESS).read_text())
    last = {"model": previous.get("model"), **{k: previous.get(k) for k in _HISTORY_KEYS}}
    return [*previous.get("history", []), last]


_SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def dllm_from_ar(checkpoint: Path, name: str = "toy-dllm") -> LlamaForCausalLM:
    """A causal zoo checkpoint turned into the initialisation of a masked-diffusion model.

    Dream's recipe (Dream 7B starts from Qwen2.5 7B): the weights are kept, attention becomes
    bidirectional (``is_causal=False``) and the logits stay shifted -- the output at ``i``
    predicts token ``i + 1``, as in the causal model -- so what the causal model learnt
    carries over.  The checkpoint must have the architecture of zoo model ``name``.  A dLLM
    checkpoint made so (``long-dllm``) is taken as it is: a new dLLM trained on from it
    (``long-dllm-par`` from ``long-dllm``).

    :raises ValueError: naming the mismatch, for a checkpoint that is neither a causal nor a
        shifted dLLM zoo checkpoint, or another shape.
    """
    source = LlamaConfig.from_pretrained(checkpoint, local_files_only=True)
    kind = getattr(source, "dloom", {}).get("kind")
    if kind not in ("ar", "dllm"):
        raise ValueError(f"{checkpoint}: expected a zoo checkpoint (dloom kind 'ar' or 'dllm'), got {kind!r}")
    if kind == "dllm" and not source.dloom.get("shift", False):
        raise ValueError(f"{checkpoint}: a dLLM checkpoint to start from must have shifted logits (Dream style)")
    config = build_config(name)
    shape = {k: getattr(config, k) for k in _SHAPE}
    wrong = {k: getattr(source, k) for k in _SHAPE if getattr(source, k) != shape[k]}
    if wrong:
        raise ValueError(f"{checkpoint}: architecture {wrong} differs from {name}'s {shape}")
    config.dloom["shift"] = True
    return LlamaForCausalLM.from_pretrained(checkpoint, config=config, local_files_only=True, dtype=torch.float32)


def _evaluate_saved(
    directory: Path, kind: str, eval_n: int, workload: Workload = SHORT
) -> tuple[LlamaForCausalLM, dict, float]:
    """Reload the float16 checkpoint in ``directory`` as float32 and evaluate it on ``eval_n``
    held-out prompts of ``workload``: the model, :func:`evaluate`'s result, the seconds it took."""
    model = LlamaForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    t0 = time.time()
    result = evaluate(model, kind, held_out(eval_n, seed=0, suite=workload.suite), codec=workload.codec)
    return model, result, round(time.time() - t0, 1)


def _accuracy_line(result: dict) -> str:
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
    _, result, eval_seconds = _evaluate_saved(directory, SPECS[name].kind, eval_n, SPECS[name].workload)
    record.update(result, eval_seconds=eval_seconds,
                  reevaluated="after training, on the task suite of this dloom version")
    (directory / "eval.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[{name}] re-evaluated {_accuracy_line(result)}", flush=True)
    return record


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
              ("--decoder-share", args.decoder_share))
    for option, value in (("--masks", args.masks), ("--loss-mean", args.loss_mean),
                          ("--decoder-fill", args.decoder_fill), ("--decoder-rounds", args.decoder_rounds),
                          ("--decoder-tau", args.decoder_tau), ("--first-forward-share", args.first_forward_share),
                          ("--own-earlier-share", args.own_earlier_share),
                          ("--label-smoothing", args.label_smoothing), *shares):
        if value is not None and args.model not in dllms:
            parser.error(f"{option} is a dLLM's training option: use it with --model {' or '.join(dllms)}")
    for option, value in shares:
        if value is not None and not 0 <= value <= 1:
            parser.error(f"{option} must be in [0, 1], got {value}")
    if (args.prefix_share or 0) + (args.decoder_share or 0) > 1:
        parser.error(f"--prefix-share {args.prefix_share} and --decoder-share {args.decoder_share} are shares of "
                     "the same rows: their sum must be at most 1")
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
                  args.label_smoothing)


if __name__ == "__main__":
    main()
