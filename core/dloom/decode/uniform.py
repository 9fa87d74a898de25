"""The uniform-noise transition kernel: DiffusionGemma's denoising of a canvas.

A uniform-noise model has no mask token. Each canvas (a block of ``K`` positions) starts as
random tokens; every step the model predicts every position from the current canvas and the
previous step's logits (self-conditioning), the kernel draws a sample of every position from
the tempered prediction, the commit rule (``dloom_select_commit``, e.g. ``entropy_bound``)
accepts some positions, and every position it did not accept is renoised with a fresh random
token. A canvas ends when the stopping rule fires (stable and confident) or its step budget
is spent; its tokens are then the argmax of the last prediction, with the positions after the
first EOS padded. Until then nothing of the canvas is final: the sequence the session holds
keeps the placeholder (the pad id) at the canvas's columns, and the kernel returns the final
tokens in the step that ends the canvas (:meth:`UniformKernel.settle` says so), so streaming,
per-row progression and continuous batching see final tokens only.

This reproduces transformers' ``DiffusionGemmaForBlockDiffusion.generate`` (its
``EntropyBoundSampler``, ``LinearTemperatureScheduleLogitsProcessor`` and
``StableAndConfidentStoppingCriteria``) row by row. Random numbers: each row owns a
``torch.Generator`` seeded with ``seed + stream`` (:class:`RowGenerators`) and makes,
per canvas, the calls ``generate`` makes on torch's global generator: ``randint`` for the
initial canvas, then per step ``multinomial`` for the sample and ``randint`` for the renoising.
A prompt decoded alone with seed ``s`` therefore draws what ``torch.manual_seed(s)`` then
``generate`` draws, and each row of a batch decodes as it would alone. The price: one
generator call per row and draw (a Python loop over rows) and one host read per step of which
rows start a canvas; the token identity with ``generate`` needs torch's own generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dloom.decode.kernel import KernelStep, RowStreams, Settlement
from dloom.errors import ConfigurationError
from dloom.hooks import calls as hooks
from dloom.types import BlockSchedule

DEFAULT_DENOISING_STEPS = 48
"""A canvas's step budget when the checkpoint's generation config sets none (transformers'
default ``max_denoising_steps``)."""


@dataclass(frozen=True)
class UniformSettings:
    """The denoising schedule of the uniform kernel (``generation_config.json`` names).

    :ivar t_min: the temperature at a canvas's last step (``> 0``).
    :ivar t_max: the temperature at its first step (``> t_min``); step ``n`` of ``N`` counted
        down (``N .. 1``) divides the logits by ``t_min + (t_max - t_min) * n / N``.
    :ivar stability_threshold: steps the argmax canvas must repeat for the canvas to stop
        early (``>= 0``; 0: stable at once).
    :ivar confidence_threshold: the mean entropy of the tempered prediction below which the
        canvas may stop early (``> 0``).
    """

    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    def __post_init__(self) -> None:
        if not 0 < self.t_min < self.t_max:
            raise ConfigurationError(
                f"t_min {self.t_min!r} and t_max {self.t_max!r}; allowed: 0 < t_min < t_max"
            )
        if isinstance(self.stability_threshold, bool) or not isinstance(self.stability_threshold, int) \
                or self.stability_threshold < 0:
            raise ConfigurationError(f"stability_threshold is {self.stability_threshold!r}; allowed: an int >= 0")
        if not self.confidence_threshold > 0:
            raise ConfigurationError(f"confidence_threshold is {self.confidence_threshold!r}; allowed: > 0")

    @classmethod
    def from_generation(cls, generation: Mapping[str, Any]) -> UniformSettings:
        """The settings a checkpoint's ``generation_config.json`` sets (``null`` or absent:
        transformers' defaults, those of this class)."""
        values = {name: generation[name] for name in cls.__dataclass_fields__ if generation.get(name) is not None}
        return cls(**values)


class RowGenerators:
    """One ``torch.Generator`` per row, seeded with ``seed + stream``: what ``torch.manual_seed``
    gives a prompt decoded alone (stream 0) under ``seed``.

    :param seed: the decoder's seed (:class:`~dloom.decode.kernel.RowStreams`' ``seed``).
    :param streams: ``(B,)`` long, each row's stream.
    :param device: where the generators draw.
    """

    def __init__(self, seed: int, streams: torch.Tensor, device: torch.device) -> None:
        self.seed, self.device = seed, device
        self.rows: list[torch.Generator] = []
        self.join(streams)

    def join(self, streams: torch.Tensor) -> None:
        """Append a fresh generator for each of ``streams`` (``(J,)`` long)."""
        self.rows += [
            torch.Generator(self.device).manual_seed(self.seed + int(stream)) for stream in streams.tolist()
        ]

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order."""
        self.rows = [self.rows[i] for i in index.tolist()]

    def randint(self, high: int, width: int, rows: list[int]) -> torch.Tensor:
        """``(len(rows), width)`` long uniform in ``[0, high)``: one ``randint((1, width))`` of
        each of ``rows``' generators."""
        if not rows:
            return torch.empty((0, width), dtype=torch.long, device=self.device)
        return torch.cat([
            torch.randint(0, high, (1, width), generator=self.rows[r], device=self.device) for r in rows
        ])

    def multinomial(self, probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``(len(rows), K)`` long: row ``r``'s sample of each of its ``K`` distributions
        ``probs[r]`` (``probs``: ``(B, K, V)``), one ``multinomial`` call of its generator."""
        if not rows:
            return torch.empty((0, probs.shape[1]), dtype=torch.long, device=self.device)
        return torch.stack([
            torch.multinomial(probs[r], 1, generator=self.rows[r]).squeeze(-1) for r in rows
        ])


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """``(B, K)`` entropy of ``softmax(logits)`` (``(B, K, V)``), as ``torch.distributions``
    computes it (what ``generate``'s sampler and stopping rule read)."""
    return torch.distributions.Categorical(logits=logits).entropy()


class UniformKernel(KernelStep):
    """One denoising step of every row's canvas (``B`` rows, canvases of ``K``, ``V`` logits);
    the arguments of :class:`~dloom.decode.kernel.KernelStep` (``mask_token_id``: the
    placeholder of positions not yet final, the pad id; ``steps_per_block``: the canvas's step
    budget ``N``; ``generator``: a :class:`~dloom.decode.kernel.RowStreams` whose seed and
    streams seed :class:`RowGenerators`), and:

    :param width: ``K``.
    :param vocab_size: ``V``, the range of random tokens.
    :param settings: the temperature schedule and the stopping rule.

    :ivar canvas: ``(B, K)`` long, each row's current (noisy) canvas: the decoder's input.
    :ivar conditioning: ``(B, K, V)`` float32, each row's last step's tempered logits (its
        self-conditioning input), or ``None`` before any step.
    :ivar conditioned: ``(B,)`` bool, rows whose canvas has taken a step (the others get no
        self-conditioning signal).
    :ivar draft: ``(B, K)`` long, the argmax of each row's last prediction.
    :ivar accepted: ``(B, K)`` bool, the positions the rule accepted in each row's last step
        (the others were renoised).
    :ivar stopped: ``(B,)`` bool, rows whose stopping rule fired in their last step.
    :ivar complete: ``(B,)`` bool, rows whose canvas ended in their last step (stopped, or
        its step budget spent).
    """

    samples = True

    def __init__(
        self, *args, width: int, vocab_size: int, settings: UniformSettings | None = None, **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.generator, RowStreams):
            raise ConfigurationError("the uniform kernel draws from the decoder's row streams (a seed)")
        self.width, self.vocab_size = width, vocab_size
        self.settings = settings or UniformSettings()
        self.rngs = RowGenerators(self.generator.seed, self.generator.streams, self.steps.device)
        rows = len(self.rngs.rows)
        self.canvas = self.rngs.randint(vocab_size, width, list(range(rows)))
        self.conditioning: torch.Tensor | None = None
        self.conditioned = torch.zeros_like(self.steps, dtype=torch.bool)
        self.draft = self.canvas.clone()
        self.accepted = torch.zeros_like(self.canvas, dtype=torch.bool)
        self.complete = torch.zeros_like(self.conditioned)
        self.stopped = torch.zeros_like(self.conditioned)
        self.history = self._fresh_history(rows)

    def _fresh_history(self, rows: int) -> torch.Tensor:
        """``(S, rows, K)`` long, no argmax canvas seen yet (``-1``)."""
        return torch.full(
            (self.settings.stability_threshold, rows, self.width), -1, dtype=torch.long, device=self.steps.device
        )

    def __call__(self, block: torch.Tensor, logits: torch.Tensor, advance: torch.Tensor) -> torch.Tensor:
        """Denoise every canvas one step from its logits ``(B, K, V)``; the block ``(B, K)``
        (placeholders) comes back with a row's final tokens in the step that ends its canvas.
        Rows where ``advance`` (``(B,)`` bool) is ``False`` take no step and draw nothing
        (one host read of which rows step)."""
        if set(self.signals) - {"entropy"}:
            raise ConfigurationError(
                f"the uniform kernel gives a commit rule the signal 'entropy' only, not {', '.join(self.signals)}"
            )
        settings, n = self.settings, self.steps_per_block
        remaining = (n - self.steps).to(torch.int32)  # generate's cur_step, N .. 1
        temperature = settings.t_min + (settings.t_max - settings.t_min) * (remaining / n)
        processed = logits / temperature[:, None, None]
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        rows = advance.nonzero().flatten().tolist()
        index = torch.tensor(rows, dtype=torch.long, device=block.device)
        sample = self.canvas.index_copy(0, index, self.rngs.multinomial(probs, rows))
        argmax = processed.argmax(-1)
        entropies = entropy(processed)
        selectable = advance.unsqueeze(1).expand_as(block)
        schedule = BlockSchedule(self.steps, n, self.masked_at_start)
        signals = {"entropy": entropies} if self.signals else None
        answer = hooks.proposed_commit(self.pm, probs.amax(-1), selectable, schedule, signals)
        accept = answer & selectable
        empty = advance & ~accept.any(-1)
        stray = empty & (answer & ~selectable).any(-1)
        self.idle = torch.maximum(self.idle, empty.any().long() + stray.any().long())
        self.non_finite = self.non_finite | (advance & ~torch.isfinite(probs.sum((-1, -2)))).any()
        noise = self.canvas.index_copy(0, index, self.rngs.randint(self.vocab_size, self.width, rows))
        stepping = advance.unsqueeze(1)
        self.canvas = torch.where(stepping, torch.where(accept, sample, noise), self.canvas)
        self.draft = torch.where(stepping, argmax, self.draft)
        self.accepted = torch.where(stepping, accept, self.accepted)
        kept = processed if self.conditioning is None else self.conditioning
        self.conditioning = torch.where(stepping.unsqueeze(-1), processed, kept)
        self.conditioned = self.conditioned | advance
        self.steps = self.steps + advance.long()
        self.stopped = advance & self._stops(argmax, entropies, advance)
        self.complete = self.stopped | (advance & (self.steps >= n))
        return torch.where(self.complete.unsqueeze(1), self._final(self.draft), block)

    def _stops(self, argmax: torch.Tensor, entropies: torch.Tensor, advance: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool, StableAndConfident: the argmax canvas ``(B, K)`` equals each of the
        last ``stability_threshold`` ones and the mean entropy is below
        ``confidence_threshold``; the stepping rows (``advance``) record ``argmax``."""
        stable = (self.history == argmax.unsqueeze(0)).all(-1).all(0)
        if self.history.shape[0]:
            rolled = torch.cat([self.history[1:], argmax.unsqueeze(0)])
            self.history = torch.where(advance[None, :, None], rolled, self.history)
        return stable & (entropies.mean(-1) < self.settings.confidence_threshold)

    def _final(self, draft: torch.Tensor) -> torch.Tensor:
        """``draft`` ``(B, K)`` with every position after its first EOS set to the pad id."""
        is_eos = torch.isin(draft, self.eos_ids)
        seen = is_eos.long().cumsum(-1)
        after = (seen > 1) | ((seen == 1) & ~is_eos)
        return torch.where(after, self.mask_token_id, draft)

    def pending(self, block: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool, rows whose canvas has not ended."""
        return ~self.complete

    def settle(self, block: torch.Tensor) -> Settlement:
        """Complete: the canvas ended in the last step (``block`` ``(B, K)`` holds its final
        tokens); ended: it is complete and holds an EOS."""
        return Settlement(self.complete & torch.isin(block, self.eos_ids).any(-1), self.complete)

    def start_block(self, moving: torch.Tensor, block: torch.Tensor) -> None:
        """Rows ``moving`` (``(B,)`` bool) start a new canvas: a fresh random one (one host
        read of which rows)."""
        super().start_block(moving, block)
        rows = moving.nonzero().flatten().tolist()
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=moving.device)
        self.canvas = self.canvas.index_copy(0, index, self.rngs.randint(self.vocab_size, self.width, rows))
        self.conditioned = self.conditioned & ~moving
        self.complete, self.stopped = self.complete & ~moving, self.stopped & ~moving
        self.history = torch.where(moving[None, :, None], -1, self.history)

    def select(self, index: torch.Tensor) -> None:
        super().select(index)
        self.rngs.select(index)
        self.canvas, self.draft, self.accepted = self.canvas[index], self.draft[index], self.accepted[index]
        self.conditioned, self.complete = self.conditioned[index], self.complete[index]
        self.stopped = self.stopped[index]
        self.history = self.history[:, index]
        if self.conditioning is not None:
            self.conditioning = self.conditioning[index]

    def join(self, block: torch.Tensor, streams: torch.Tensor) -> None:
        super().join(block, streams)
        first = len(self.rngs.rows)
        self.rngs.join(streams)
        canvas = self.rngs.randint(self.vocab_size, self.width, list(range(first, len(self.rngs.rows))))
        self.canvas = torch.cat([self.canvas, canvas])
        self.draft = torch.cat([self.draft, canvas])
        self.accepted = torch.cat([self.accepted, torch.zeros_like(canvas, dtype=torch.bool)])
        joining = torch.zeros(len(streams), dtype=torch.bool, device=canvas.device)
        self.conditioned, self.complete = torch.cat([self.conditioned, joining]), torch.cat([self.complete, joining])
        self.stopped = torch.cat([self.stopped, joining])
        self.history = torch.cat([self.history, self._fresh_history(len(streams))], dim=1)
        if self.conditioning is not None:
            rest = self.conditioning.new_zeros(len(streams), *self.conditioning.shape[1:])
            self.conditioning = torch.cat([self.conditioning, rest])
