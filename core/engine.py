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
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from dloom import hooks
from dloom.adapter import ModelAdapter, left_pad_prompts
from dloom.attention import block_causal_mask
from dloom.cache import CACHE_MODES, BlockForward, cache_argument, check_refresh
from dloom.composition import StrategySpec, build_plugin_manager, compose
from dloom.errors import ConfigurationError, HookContractError, ModelError, NonFiniteLogitsError
from dloom.kernel import REMASKING
from dloom.metrics import GenerationResult, HookTimer
from dloom.prompt_validation import check_lengths, check_prompts, check_special_ids, vocabulary_size
from dloom.registry import Registry
from dloom.speculation import KernelStep, layout_is_exact, node_logits, selectable_positions
from dloom.types import DecodeState

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
    :param cache_refresh: with a cache, rebuild it with a full forward every
        ``cache_refresh`` forwards of a block (``None``: once per block). Bounds the drift of
        a bidirectional model's cached decoding; plain steps only, so speculative
        strategies refuse it.
    :param draft_budget: the most drafts per row one verification forward may evaluate
        (speculative strategies; ``None``: the strategy's own budget).
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
        cache_refresh: int | None = None,
        draft_budget: int | None = None,
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
        check_lengths(gen_length=gen_length, block_length=block_length, steps=steps)
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
        self.cache_refresh = cache_refresh
        self.draft_budget = draft_budget
        self._validate()
        self.composition = compose(strategy, {**(params or {}), **strategy_params}, registry)
        self.guarantees = self.composition.guarantees_under(self.temperature, self.remasking)
        for component in self.composition.components:
            claim = component.strategy.claim if component.strategy is not None else None
            if claim is not None and claim.against == "target":
                raise ConfigurationError(
                    f"strategy {component.name!r} decodes an autoregressive target with a "
                    "dLLM drafter, not a dLLM alone: use dloom.failfast.FailFastDecoder, or "
                    f"`dloom generate --strategy {component.name} --target ... --drafter ...`"
                )
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
        self._speculates = self.composition.provider("dloom_draft") is not None
        if self._speculates and self.cache_refresh is not None:
            raise ConfigurationError(
                f"cache_refresh={self.cache_refresh} applies to plain steps; speculative strategy "
                f"{self.composition.name!r} verifies drafts on the block-start cache (use cache_refresh=None)"
            )
        hooks.configure(self.pm, self.setup)

    def _validate(self) -> None:
        check_special_ids(self.model)
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
        if self.draft_budget is not None and self.draft_budget < 0:
            raise ConfigurationError(f"draft_budget is {self.draft_budget!r}; allowed: >= 0 or None")
        if self.cache not in CACHE_MODES:
            raise ConfigurationError(f"cache is {self.cache!r}; allowed: {', '.join(CACHE_MODES)}")
        check_refresh(self.cache, self.cache_refresh)
        if self.cache != "none" and cache_argument(self.model.model) is None:
            raise ModelError(
                f"cache {self.cache!r} needs a model whose forward takes a transformers cache; "
                f"model {self.model.name!r} takes none (use cache='none')"
            )

    @property
    def setup(self) -> dict[str, Any]:
        """What :func:`dloom.hookspecs.dloom_configure` receives."""
        commit_rule = self.composition.provider("dloom_select_commit")
        return {
            **self.config,
            "tokenizer_sha256": self.model.tokenizer_sha256,
            "commit_rule": commit_rule,
            "commit_params": self.composition.params().get(commit_rule, {}),
            "steps_per_block": self.steps // (self.gen_length // self.block_length),
            "attention": self.model.attention,
            "shift_logits": self.model.shift_logits,
            "takes_attention_mask": self.model.can_pad,
            "vocab_size": vocabulary_size(self.model),
        }

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
            "cache_refresh": self.cache_refresh,
            "draft_budget": self.draft_budget,
            "guarantees": self.guarantees,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
        }

    @property
    def name(self) -> str:
        """The strategy's name, its composition's (:class:`dloom.decoding.Decoder`)."""
        return self.composition.name

    def totals(self) -> None:
        """``None``: every figure of this decoder is in each result
        (:class:`dloom.decoding.Decoder`)."""
        return None

    def _timed_forward(self, call, *args) -> torch.Tensor:
        """Run one model forward (``call(*args)``), adding its time to the ``forward`` share."""
        if self._sync:
            self._sync()
        start = time.perf_counter()
        logits = call(*args)
        if self._sync:
            self._sync()
        self._forward_seconds += time.perf_counter() - start
        return logits

    def _decode_block(
        self,
        block: int,
        rows: torch.Tensor,
        x: torch.Tensor,
        attention_mask: torch.Tensor,
        block_forward: BlockForward,
        generator: torch.Generator | None,
        eos_ids: torch.Tensor,
        counters: _Counters,
        observer: Callable[[StepRecord], None] | None,
    ) -> torch.Tensor:
        """Decode the active block of the rows ``x`` (``(B, L)``, updated in place; ``rows``
        are their indices in the whole batch) and return each row's NFE in it (``(B,)``).

        A plain step is one forward and one kernel step. Once a distribution of the block is
        known, a speculative composition drafts future states from it; one verification
        forward evaluates the current state and the drafts, and the verifier takes kernel
        steps along the drafts for as long as they match (:mod:`dloom.speculation`).
        Host synchronisation: once per forward, to learn whether the block is done.
        """
        mask_id = self.model.mask_token_id
        start, end = block_forward.start, block_forward.end
        kernel = KernelStep(
            self.pm, self.temperature, self.remasking, generator, mask_id, eos_ids,
            self.steps // (self.gen_length // self.block_length),
            (x[:, start:end] == mask_id).sum(-1),
        )
        nfe = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        previous = None  # the distribution of the current state's predecessor
        every_row = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        forward = 0
        while True:
            current = x[:, start:end]
            decoding = selectable_positions(current, mask_id, eos_ids).any(-1)
            state = DecodeState(
                tokens=x, attention_mask=attention_mask, block_start=start, block_end=end,
                mask_token_id=mask_id, active=decoding, logits=previous,
                span_start=block_forward.window_start,
            )
            speculate = previous is not None and self._speculates
            graph = hooks.draft(self.pm, state) if speculate else None
            if graph is None:
                logits = self._timed_forward(block_forward, x)
                x[:, start:end] = kernel(current, logits, every_row)
                previous, root_logits, accepted = logits, logits, None
                if observer is not None:
                    observer(StepRecord(block, rows, current, logits, x[:, start:end].clone()))
            else:
                verdict, root_logits, exact = self._verification_step(state, graph, block_forward, kernel)
                x[:, start:end] = verdict.block
                previous, accepted = verdict.logits, verdict.accepted
                counters.record_layout(exact)
            counters.forwards += 1
            nfe += decoding.long()
            if not self._synchronise(block, forward, x[:, start:end], root_logits, kernel, accepted, decoding, counters):
                return nfe
            forward += 1

    def _verification_step(
        self, state: DecodeState, graph, block_forward: BlockForward, kernel: KernelStep
    ):
        """Prune, lay out, run one forward over the root and the drafts, and verify.

        :return: the :class:`~dloom.types.Verdict`, the root's ``(B, K, V)`` logits, and
            whether the layout gave exact draft distributions.
        """
        graph = hooks.prune(self.pm, graph, self.draft_budget)
        layout = hooks.build_mask(self.pm, state, graph)
        outputs = self._timed_forward(block_forward.evaluate, state.tokens, layout)
        all_logits = node_logits(outputs, layout, state.block_end - state.block_start)
        verdict = hooks.verify(self.pm, state, graph, all_logits, kernel)
        return verdict, all_logits[:, 0], layout_is_exact(layout, self.cache, self.model.attention)

    def _synchronise(
        self, block, forward, current, root_logits, kernel, accepted, decoding, counters
    ) -> bool:
        """The step's one host synchronisation: check its contracts, count accepted drafts,
        and return whether the block still has positions to decode."""
        mask_id, eos_ids = self.model.mask_token_id, kernel.eos_ids
        status = [
            selectable_positions(current, mask_id, eos_ids).any(),
            ~torch.isfinite(root_logits).all(),
            kernel.idle,
        ]
        if accepted is not None:
            status += [accepted.sum(), decoding.sum()]
        values = torch.stack([v.long() for v in status]).tolist()
        more, non_finite, idle = values[:3]
        if accepted is not None:
            counters.accepted += values[3]
            counters.verifications += values[4]
        if non_finite:
            raise NonFiniteLogitsError(
                f"model {self.model.name!r} returned NaN or inf logits at block {block}, "
                f"forward {forward}; try dtype='float32' or check the checkpoint"
            )
        if idle:
            raise HookContractError(
                f"commit rule {self.composition.provider('dloom_select_commit')!r} "
                f"committed no position in a row that had masked positions "
                f"(block {block}, forward {forward}); every step must commit at least one"
            )
        return bool(more)

    def generate(
        self,
        prompts: Prompts,
        attention_mask: torch.Tensor | None = None,
        observer: Callable[[StepRecord], None] | None = None,
        on_block: Callable[[BlockRecord], None] | None = None,
    ) -> GenerationResult:
        """Decode a batch of prompts.

        :param prompts: texts, token-id lists (left-padded here), or a ``(B, P)`` tensor of
            left-padded ids with its ``attention_mask``.
        :param observer: called after every plain step with a :class:`StepRecord` (the
            reference process as it runs; ``dloom calibrate`` records it).
        :param on_block: called once per decoded block with a :class:`BlockRecord`: the
            block's final tokens for the rows that decoded it, plain or speculative
            (``dloom serve`` streams them).
        :return: the decoded batch with its metrics.
        :raises ModelError: for empty prompts or a sequence beyond the model's context.
        :raises NonFiniteLogitsError: when the model returns NaN or inf.
        """
        start_time = time.perf_counter()
        self.timer.seconds.clear()
        self._forward_seconds = 0.0
        model, mask_id = self.model, self.model.mask_token_id
        prompts = check_prompts(self.model, prompts, attention_mask)
        prompt_ids, prompt_mask = left_pad_prompts(self.model, prompts, attention_mask)
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
        counters = _Counters(self._speculates)
        blocks = self.gen_length // self.block_length
        for block in range(blocks):
            rows = torch.nonzero(~finished).squeeze(1)
            if rows.numel() == 0:
                break
            start = prompt_len + block * self.block_length
            attn = full_mask[rows] if padded else None
            if model.attention == "block-causal":
                attn = block_causal_mask(full_mask[rows], prompt_len, self.block_length)
            block_forward = BlockForward(
                model, self.cache, attn, positions[rows], start, start + self.block_length,
                self.cache_refresh,
            )
            x = tokens[rows]
            block_nfe = self._decode_block(
                block, rows, x, full_mask[rows], block_forward, generator, eos_ids, counters,
                observer,
            )
            nfe.index_add_(0, rows, block_nfe)
            tokens[rows] = x
            finished[rows] = finished_rows(x[:, prompt_len:], mask_id, eos_ids)
            if on_block is not None:
                on_block(BlockRecord(block, rows, x[:, start:start + self.block_length]))

        generated = tokens[:, prompt_len:]
        lengths = generated_lengths(generated, eos_ids)
        length_list = lengths.tolist()
        generated_list = generated.tolist()
        token_lists = [row[:n] for row, n in zip(generated_list, length_list)]
        texts = None
        if model.tokenizer is not None:
            texts = [model.decode([t for t in row if t not in model.eos_token_ids]) for row in token_lists]
        hook_seconds = {"forward": self._forward_seconds, **self.timer.seconds}
        return GenerationResult(
            sequences=tokens,
            generated=generated,
            generated_lengths=lengths,
            nfe=nfe,
            forwards=counters.forwards,
            verifications=counters.verifications,
            accepted_drafts=counters.accepted,
            layout_exact=counters.exact,
            wall_seconds=time.perf_counter() - start_time,
            hook_seconds=hook_seconds,
            config=self.config,
            texts=texts,
            token_lists=token_lists,
        )


@dataclass(frozen=True)
class StepRecord:
    """One plain step of the reference process, as an observer of
    :meth:`DiffusionDecoder.generate` sees it (``B`` rows of the block, ``K``, ``V``).

    :ivar block: the block's index.
    :ivar rows: ``(B,)`` long, the rows' indices in the batch passed to ``generate``.
    :ivar before: ``(B, K)`` long, the block before the step.
    :ivar logits: ``(B, K, V)``, the distribution the step sampled from.
    :ivar after: ``(B, K)`` long, the block after it.
    """

    block: int
    rows: torch.Tensor
    before: torch.Tensor
    logits: torch.Tensor
    after: torch.Tensor


@dataclass(frozen=True)
class BlockRecord:
    """One decoded block, as the ``on_block`` callback of :meth:`DiffusionDecoder.generate`
    sees it (``B`` rows that decoded the block, ``K = block_length``).

    :ivar block: the block's index.
    :ivar rows: ``(B,)`` long, the rows' indices in the batch passed to ``generate``.
    :ivar tokens: ``(B, K)`` long, the block's final tokens (final: a later block never
        changes them; positions after a row's EOS may stay masked).
    """

    block: int
    rows: torch.Tensor
    tokens: torch.Tensor


class _Counters:
    """Per-generation tallies the decoder keeps while decoding blocks."""

    def __init__(self, speculative: bool) -> None:
        self.forwards = 0
        self.verifications = 0  # row-verifications: rows decoding in a verification forward
        self.accepted = 0  # drafts accepted, over all rows
        # whether every verification layout was exact (vacuously so before the first one);
        # None for a strategy that never speculates
        self.exact: bool | None = True if speculative else None

    def record_layout(self, exact: bool) -> None:
        assert self.exact is not None, "a verification in a run without a draft hook"
        self.exact = self.exact and exact
