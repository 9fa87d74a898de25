"""The diffusion decoder: semi-autoregressive block decoding with the transition kernel.

The sequence is ``prompt + gen_length`` mask tokens, split into blocks of ``block_length``
decoded left to right. Each step of the active block runs one forward, proposes a candidate
and a confidence per position (:func:`dloom.kernel.propose`), asks the strategy's commit
rule which positions to unmask, and commits them.

Per-row early stop: a row that has committed EOS with nothing masked before it is finished.
Its tokens never change afterwards, its NFE stops counting, and from the next block on it is
dropped from the forward batch. The loop synchronises with the host once per step (to learn
whether the block is done and to check the step's contracts) and once per block (to compact
the batch); never per token or per row.

Each step's forward goes through a :class:`dloom.cache.BlockForward`, built at block start
for the rows still decoding: with ``cache="prefix"`` or ``"dual"`` it reuses the keys and
values of the block-start forward (:mod:`dloom.cache`). For a block-causal model the decoder
builds the block-causal attention mask itself (:func:`dloom.attention.block_causal_mask`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

import torch

from dloom import hooks
from dloom.adapter import ModelAdapter
from dloom.attention import block_causal_mask
from dloom.cache import CACHE_MODES, BlockForward, cache_argument
from dloom.composition import StrategySpec, build_plugin_manager, compose
from dloom.errors import ConfigurationError, HookContractError, ModelError, NonFiniteLogitsError
from dloom.kernel import REMASKING, apply_commit, propose
from dloom.metrics import GenerationResult, HookTimer
from dloom.registry import Registry
from dloom.types import BlockSchedule

Prompts = Sequence[str] | Sequence[Sequence[int]] | torch.Tensor
DEFAULT_GEN_LENGTH = 128
DEFAULT_BLOCK_LENGTH = 32


def finished_rows(generated: torch.Tensor, mask_token_id: int, eos_ids: torch.Tensor) -> torch.Tensor:
    """Rows whose output is final: an EOS with nothing masked before it, or nothing masked.

    :param generated: ``(B, G)`` long, the generated region.
    :param eos_ids: ``(E,)`` long.
    :return: ``(B,)`` bool.
    """
    masked = generated == mask_token_id
    clear_before = masked.long().cumsum(-1) == 0
    eos_clear = (torch.isin(generated, eos_ids) & clear_before).any(-1)
    return eos_clear | ~masked.any(-1)


def generated_lengths(generated: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """``(B,)`` tokens up to and including the first EOS (``G`` when there is none)."""
    is_eos = torch.isin(generated, eos_ids)
    width = generated.shape[1]
    index = torch.arange(width, device=generated.device).expand_as(generated)
    first = torch.where(is_eos, index, torch.full_like(index, width)).min(-1).values
    return torch.clamp(first + 1, max=width)


class DiffusionDecoder:
    """Decode a dLLM with a strategy composition.

    :param model: the model adapter (:func:`dloom.load_model`).
    :param strategy: a registered name, ``"a+b"``, a plugin object or a list of those.
    :param gen_length: generated positions per row (default: the checkpoint's, else 128).
    :param block_length: positions per block; must divide ``gen_length`` (default: the
        block size the model was trained with, for block-causal models; else
        ``min(32, gen_length)``).
    :param steps: step budget over all blocks, a multiple of the number of blocks; quota
        rules spread each block's masks over ``steps / blocks`` steps (default
        ``gen_length``: one token per step).
    :param temperature: 0 for greedy, > 0 samples with float64 Gumbel-max.
    :param remasking: confidence kind, one of :data:`dloom.kernel.REMASKING`.
    :param seed: seeds the decoder's ``torch.Generator`` (``None``: nondeterministic).
    :param cache: KV cache mode, one of :data:`dloom.cache.CACHE_MODES`: ``"none"``,
        ``"prefix"`` (reuse the keys and values before the active block) or ``"dual"`` (also
        those after it); exact for block-causal models, approximate for bidirectional ones.
    :param params: strategy parameters by name (``"tau"``) or by component (``"spiffy.budget"``).
    :param sync_timing: synchronise the device around timed sections (exact per-hook times
        on a GPU at some cost).
    :param strategy_params: more strategy parameters as keyword arguments.
    :raises ConfigurationError: for inconsistent lengths, steps or parameters, or an unknown
        cache mode.
    :raises ModelError: for a model without a mask token, with causal attention, or (with a
        cache) whose forward takes no ``transformers`` cache.
    :raises CompositionError: when the strategies cannot be combined.
    """

    def __init__(
        self,
        model: ModelAdapter,
        strategy: StrategySpec = "quota",
        *,
        gen_length: int | None = None,
        block_length: int | None = None,
        steps: int | None = None,
        temperature: float = 0.0,
        remasking: str = "low_confidence",
        seed: int | None = None,
        cache: str = "none",
        params: Mapping[str, Any] | None = None,
        sync_timing: bool = False,
        registry: Registry | None = None,
        **strategy_params: Any,
    ) -> None:
        if model.mask_token_id is None:
            raise ModelError(f"model {model.name!r} has no mask token; it cannot be a dLLM")
        if model.attention == "causal":
            raise ModelError(
                f"model {model.name!r} has causal attention; a diffusion decoder needs "
                "'bidirectional' or 'block-causal' (pass attention=... to load_model if the "
                "config is wrong)"
            )
        self.model = model
        self.gen_length = gen_length or model.default_gen_length or DEFAULT_GEN_LENGTH
        self.block_length = (
            block_length or model.default_block_length or min(DEFAULT_BLOCK_LENGTH, self.gen_length)
        )
        self.steps = steps or self.gen_length
        self.temperature = float(temperature)
        self.remasking = remasking
        self.seed = seed
        self.cache = cache
        self._validate()
        self.composition = compose(strategy, {**(params or {}), **strategy_params}, registry)
        if self.composition.provider("dloom_select_commit") is None:
            raise ConfigurationError(
                f"strategy {self.composition.name!r} has no commit rule (dloom_select_commit); "
                "add one, for example 'quota', 'threshold' or 'factor'"
            )
        self._sync = (
            torch.cuda.synchronize if sync_timing and model.device.type == "cuda" else None
        )
        self.timer = HookTimer(self._sync)
        self.pm = build_plugin_manager(self.composition, self.timer)

    def _validate(self) -> None:
        g, k, s = self.gen_length, self.block_length, self.steps
        if g <= 0 or k <= 0 or s <= 0:
            raise ConfigurationError(
                f"gen_length, block_length and steps must be positive; got {g}, {k}, {s}"
            )
        if g % k:
            raise ConfigurationError(
                f"gen_length {g} is not a multiple of block_length {k}; allowed block lengths "
                "divide gen_length"
            )
        blocks = g // k
        if s % blocks:
            raise ConfigurationError(
                f"steps {s} do not divide over {blocks} blocks (gen_length {g} / block_length "
                f"{k}); allowed: a multiple of {blocks}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigurationError(f"temperature is {self.temperature!r}; allowed: >= 0")
        if self.remasking not in REMASKING:
            raise ConfigurationError(
                f"remasking is {self.remasking!r}; allowed: {', '.join(REMASKING)}"
            )
        if self.cache not in CACHE_MODES:
            raise ConfigurationError(f"cache is {self.cache!r}; allowed: {', '.join(CACHE_MODES)}")
        if self.cache != "none" and cache_argument(self.model.model) is None:
            raise ModelError(
                f"cache {self.cache!r} needs a model whose forward takes a transformers cache; "
                f"model {self.model.name!r} takes none (use cache='none')"
            )

    @property
    def config(self) -> dict[str, Any]:
        """The settings, JSON-ready (recorded in every result)."""
        return {
            "model": self.model.name,
            "strategy": self.composition.name,
            "params": self.composition.params(),
            "gen_length": self.gen_length,
            "block_length": self.block_length,
            "steps": self.steps,
            "temperature": self.temperature,
            "remasking": self.remasking,
            "seed": self.seed,
            "cache": self.cache,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
        }

    def _batch(
        self, prompts: Prompts, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``(B, P)`` prompt ids and their ``(B, P)`` padding mask."""
        device = self.model.device
        if isinstance(prompts, torch.Tensor):
            ids = prompts.to(device=device, dtype=torch.long)
            if ids.dim() != 2:
                raise ModelError(f"prompt tensor must be (B, P); got shape {tuple(ids.shape)}")
            mask = (
                torch.ones_like(ids) if attention_mask is None else attention_mask.to(device).long()
            )
            return ids, mask
        if len(prompts) == 0:
            raise ModelError("no prompts given")
        rows = (
            self.model.encode(prompts)  # type: ignore[arg-type]
            if isinstance(prompts[0], str)
            else [list(map(int, p)) for p in prompts]  # type: ignore[arg-type]
        )
        empty = [i for i, r in enumerate(rows) if not r]
        if empty:
            raise ModelError(f"prompt {empty[0]} is empty; every prompt needs at least one token")
        width = max(len(r) for r in rows)
        pad = self.model.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        return ids.to(device), mask.to(device)

    def _forward(self, block_forward: BlockForward, tokens, timings) -> torch.Tensor:
        if self._sync:
            self._sync()
        start = time.perf_counter()
        logits = block_forward(tokens)
        if self._sync:
            self._sync()
        timings["forward"] += time.perf_counter() - start
        return logits

    def generate(
        self, prompts: Prompts, attention_mask: torch.Tensor | None = None
    ) -> GenerationResult:
        """Decode a batch of prompts.

        :param prompts: texts, token-id lists (left-padded here), or a ``(B, P)`` tensor of
            left-padded ids with its ``attention_mask``.
        :return: the decoded batch with its metrics.
        :raises ModelError: for empty prompts or a sequence beyond the model's context.
        :raises NonFiniteLogitsError: when the model returns NaN or inf.
        """
        start_time = time.perf_counter()
        self.timer.seconds.clear()
        timings: dict[str, float] = {"forward": 0.0}
        model, mask_id = self.model, self.model.mask_token_id
        prompt_ids, prompt_mask = self._batch(prompts, attention_mask)
        batch, prompt_len = prompt_ids.shape
        total = prompt_len + self.gen_length
        if model.max_context is not None and total > model.max_context:
            raise ModelError(
                f"prompt of {prompt_len} tokens + gen_length {self.gen_length} = {total} "
                f"exceeds the model's context of {model.max_context} tokens"
            )
        device = prompt_ids.device
        tokens = torch.cat(
            [prompt_ids, torch.full((batch, self.gen_length), mask_id, device=device)], dim=1
        )
        full_mask = torch.cat([prompt_mask, torch.ones_like(tokens[:, prompt_len:])], dim=1)
        positions = torch.clamp(full_mask.cumsum(-1) - 1, min=0)
        padded = bool((prompt_mask == 0).any())
        eos_ids = torch.tensor(model.eos_token_ids, dtype=torch.long, device=device)
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
        nfe = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        forwards = 0
        blocks = self.gen_length // self.block_length
        steps_per_block = self.steps // blocks

        for block in range(blocks):
            rows = torch.nonzero(~finished).squeeze(1)
            if rows.numel() == 0:
                break
            start = prompt_len + block * self.block_length
            end = start + self.block_length
            x, done = tokens[rows], finished[rows]
            attn = full_mask[rows] if padded else None
            if model.attention == "block-causal":
                attn = block_causal_mask(full_mask[rows], prompt_len, self.block_length)
            block_forward = BlockForward(model, self.cache, attn, positions[rows], start, end)
            masked_at_start = (x[:, start:end] == mask_id).sum(-1)
            step = 0
            while True:
                current = x[:, start:end]
                selectable = (current == mask_id) & ~done.unsqueeze(1)
                logits = self._forward(block_forward, x, timings)
                forwards += 1
                nfe.index_add_(0, rows, selectable.any(-1).long())
                candidates, confidence = propose(
                    logits, self.temperature, self.remasking, generator, mask_id
                )
                schedule = BlockSchedule(step, steps_per_block, masked_at_start)
                commit = hooks.select_commit(self.pm, confidence, selectable, schedule)
                x[:, start:end] = apply_commit(current, candidates, commit)
                done = done | finished_rows(x[:, prompt_len:], mask_id, eos_ids)
                status = torch.stack(
                    [
                        ((x[:, start:end] == mask_id) & ~done.unsqueeze(1)).any(),
                        ~torch.isfinite(logits).all(),
                        (selectable.any(-1) & ~commit.any(-1)).any(),
                    ]
                ).tolist()
                more, non_finite, idle = status
                if non_finite:
                    raise NonFiniteLogitsError(
                        f"model {model.name!r} returned NaN or inf logits at block {block}, "
                        f"step {step}; try dtype='float32' or check the checkpoint"
                    )
                if idle:
                    raise HookContractError(
                        f"commit rule {self.composition.provider('dloom_select_commit')!r} "
                        f"committed no position in a row that had masked positions "
                        f"(block {block}, step {step}); every step must commit at least one"
                    )
                step += 1
                if not more:
                    break
            tokens[rows] = x
            finished[rows] = done

        generated = tokens[:, prompt_len:]
        lengths = generated_lengths(generated, eos_ids)
        length_list = lengths.tolist()
        generated_list = generated.tolist()
        token_lists = [row[:n] for row, n in zip(generated_list, length_list)]
        texts = None
        if model.tokenizer is not None:
            texts = [model.decode([t for t in row if t not in model.eos_token_ids]) for row in token_lists]
        hook_seconds = {**timings, **self.timer.seconds}
        return GenerationResult(
            sequences=tokens,
            generated=generated,
            generated_lengths=lengths,
            nfe=nfe,
            forwards=forwards,
            wall_seconds=time.perf_counter() - start_time,
            hook_seconds=hook_seconds,
            config=self.config,
            texts=texts,
            token_lists=token_lists,
        )
