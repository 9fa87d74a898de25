"""The diffusion decoder: semi-autoregressive block decoding with the transition kernel.

The sequence is ``prompt + gen_length`` mask tokens, split into blocks of ``block_length``
decoded left to right. Each step of a row's active block runs one forward, proposes a
candidate and a confidence per position (:func:`dloom.decode.kernel.propose`), asks the strategy's
commit rule which positions to unmask, and commits them.

Per-row block progression: every row decodes its own active block. A row whose block is
done moves on to its next block in the next forward, instead of waiting for the slowest row
of the batch; a row that has finished (an EOS with nothing masked before it, or nothing
masked) leaves the batch at once, its tokens final and its NFE no longer counted. So each
row takes exactly the steps it takes when decoded alone, and no forward is spent on a row
with nothing to decode. The loop synchronises with the host once per forward (to check the
step's contracts, learn which rows left and which need a full forward); never per token or
per row.

The loop itself is :class:`dloom.decode.session.DecodeSession`, a running batch that rows
may also join between forwards (continuous batching: ``dloom serve`` keeps one per decoder
settings); :meth:`DiffusionDecoder.generate` is one session with every prompt admitted at
once, stepped until it is empty.

Every forward goes through the generation's :class:`dloom.model.runner.BlockForward`, which keeps
each row's block columns and, with ``cache="prefix"`` or ``"dual"``, its keys and values
(:mod:`dloom.model.runner`). For a block-causal model the decoder gives it every position's block
(:mod:`dloom.model.attention`), laid out per the model's ``block_alignment``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dloom.decode.decoders import DIFFUSION
from dloom.decode.generation import Prompts, prepare_prompts, token_lists_and_texts
from dloom.decode.kernel import REMASKING, idle_problem
from dloom.decode.prompts import check_lengths, check_special_ids, vocabulary_size
from dloom.decode.session import (
    BlockRecord,
    DecodeSession,
    SessionCalls,
    StepRecord,
)
from dloom.decode.step import PlainStepper, SpeculativeStepper
from dloom.decode.transition import UNIFORM, check_kernel, kernel_class, kernel_options
from dloom.decode.uniform import DEFAULT_DENOISING_STEPS
from dloom.errors import (
    ConfigurationError,
    HookContractError,
    ModelError,
    NonFiniteLogitsError,
)
from dloom.hooks import calls as hooks
from dloom.hooks.cache_policies import cache_policy
from dloom.hooks.composition import StrategySpec, build_plugin_manager, compose
from dloom.hooks.registry import DEFAULT_STRATEGY, Registry
from dloom.hooks.timing import HookTimer
from dloom.metrics import ForwardClock, GenerationResult
from dloom.model.adapter import ModelAdapter, position_ids_from_mask
from dloom.model.cost import measure_cost_curve
from dloom.model.runner import check_refresh

DEFAULT_GEN_LENGTH = 128
DEFAULT_BLOCK_LENGTH = 32


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
        ``gen_length``: one token per step; on the uniform kernel, the checkpoint's
        ``max_denoising_steps`` per canvas).
    :param temperature: 0 for greedy, > 0 samples with float64 Gumbel-max.
    :param remasking: confidence kind, one of :data:`dloom.decode.kernel.REMASKING`.
    :param seed: seeds every prompt's random stream (:class:`dloom.decode.kernel.RowStreams`; ``None``: nondeterministic).
    :param cache: KV cache policy, the name of a registered one
        (:func:`dloom.hooks.cache_policies.cache_modes`): ``"none"``, ``"prefix"`` (reuse the
        keys and values before the active block) or ``"dual"`` (also those after it), or a
        plugin's; exact for block-causal models, approximate for bidirectional ones.
    :param cache_refresh: with a cache, rebuild it with a full forward every
        ``cache_refresh`` forwards of a block (``None``: once per block). Bounds the drift of
        a bidirectional model's cached decoding; plain steps only, so speculative
        strategies refuse it.
    :param static_shapes: ``True`` gives every forward of a fixed set of rows the same shapes
        across steps and blocks (a preallocated record written in place, fixed windows, a
        4-D mask over the whole record: :class:`dloom.model.runner.BlockForward`'s "Static
        shapes"), so that a model compiled with ``torch.compile`` (or captured in a CUDA
        graph) reuses one graph per shape. The same tokens and NFE as ``False`` on the toy
        zoo; logits agree up to floating-point rounding. Costs some compute (a prefix window
        stays as wide as the generated region; full forwards compute the whole region's
        logits). A speculative strategy's verification forwards are padded to one row count
        per batch (:func:`dloom.decode.speculation.static_call_rows`; padding rows whose outputs
        are dropped) and, packed, to one span count per row, in the same model calls.
    :param draft_budget: the most drafts per row one verification forward may evaluate
        (speculative strategies; ``None``: the strategy's own budget).
    :param params: strategy parameters by name (``"tau"``) or by component (``"spiffy.budget"``).
    :param sync_timing: synchronise the device around timed sections (exact per-hook times
        on a GPU at some cost).
    :param on_proposal: an observer of every kernel step's proposal, called before the commit
        rule with the candidates and confidences, both ``(B, K)``
        (:class:`~dloom.decode.kernel.KernelStep`; :mod:`dloom.decode.oracle` reads the candidates).
    :param strategy_params: more strategy parameters as keyword arguments.
    :raises ConfigurationError: for inconsistent lengths, steps or parameters, or an unknown
        cache mode.
    :raises ModelError: for a model without a mask token (but on the uniform kernel), with causal attention, or (with a
        cache) whose forward takes no ``transformers`` cache.
    :raises CompositionError: when the strategies cannot be combined.
    """

    def __init__(
        self,
        model: ModelAdapter,
        strategy: StrategySpec = DEFAULT_STRATEGY,
        *,
        gen_length: int | None = None,
        block_length: int | None = None,
        steps: int | None = None,
        temperature: float = 0.0,
        remasking: str = "low_confidence",
        seed: int | None = None,
        cache: str = "none",
        cache_refresh: int | None = None,
        static_shapes: bool = False,
        draft_budget: int | None = None,
        params: Mapping[str, Any] | None = None,
        sync_timing: bool = False,
        registry: Registry | None = None,
        on_proposal: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        **strategy_params: Any,
    ) -> None:
        if model.mask_token_id is None and model.kernel != UNIFORM:
            raise ModelError(f"model {model.name!r} has no mask token; it cannot be a dLLM")
        if model.attention == "causal":
            raise ModelError(
                f"model {model.name!r} has causal attention; a diffusion decoder needs "
                "'bidirectional' or 'block-causal' (pass attention=... to load_model if the "
                "config is wrong)"
            )
        check_lengths(gen_length=gen_length, block_length=block_length, steps=steps)
        self.model = model
        #: the model's mask id; on the uniform kernel (no mask token) the placeholder of
        #: positions not yet final, the pad id
        self.mask_token_id: int = model.pad_token_id if model.mask_token_id is None else model.mask_token_id
        self.gen_length = gen_length or model.default_gen_length or DEFAULT_GEN_LENGTH
        self.block_length = (
            block_length or model.default_block_length or min(DEFAULT_BLOCK_LENGTH, self.gen_length)
        )
        self.steps = steps or self._default_steps()
        self.temperature = float(temperature)
        self.remasking = remasking
        self.seed = seed
        self.cache = cache
        self.cache_refresh = cache_refresh
        self.static_shapes = static_shapes
        self.draft_budget = draft_budget
        self.on_proposal = on_proposal
        self._validate()
        self.composition = compose(strategy, {**(params or {}), **strategy_params}, registry, model.generation)
        self.guarantees = self.composition.guarantees_under(self.temperature, self.remasking)
        kernel_class(model)  # a kernel dloom has
        check_kernel(self.composition, model.kernel)
        #: keyword arguments of the model's kernel for this composition
        #: (:func:`dloom.decode.transition.kernel_options`)
        self.kernel_options = kernel_options(self.composition, model, self.block_length)
        for component in self.composition.components:
            kind = component.strategy.registration.decoder if component.strategy is not None else DIFFUSION
            if kind != DIFFUSION:
                raise ConfigurationError(
                    f"strategy {component.name!r} runs in the {kind!r} decoder, not in a diffusion "
                    f"decoder: use dloom.ARTargetDecoder(target, {component.name!r}, drafter=...), "
                    f"or `dloom generate --strategy {component.name} --target ... --drafter ...`"
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
        self.forward_clock = ForwardClock(self._sync)  # the model forwards of the last session (it resets the clock)
        self.pm = build_plugin_manager(self.composition, self.timer)
        self.plain_step = PlainStepper(self.forward_clock)
        #: the strategy's speculative step (``None`` for a strategy that never drafts); FailFast's
        #: drafter runs it over its own blocks too
        self.speculative_step: SpeculativeStepper | None = None
        if self.composition.provider("dloom_draft") is not None:
            self.speculative_step = SpeculativeStepper(
                self.pm, self.forward_clock, self.cache_policy, model.attention, self.block_length,
                self.mask_token_id, self.draft_budget, self.static_shapes,
            )
        if self.speculative_step is not None and self.cache_refresh is not None:
            raise ConfigurationError(
                f"cache_refresh={self.cache_refresh} applies to plain steps; speculative strategy "
                f"{self.composition.name!r} verifies drafts on the block-start cache (use cache_refresh=None)"
            )
        hooks.configure(self.pm, self.setup)

    def _default_steps(self) -> int:
        """One step per generated token; on the uniform kernel, the checkpoint's
        ``max_denoising_steps`` per canvas (:data:`dloom.decode.uniform.DEFAULT_DENOISING_STEPS`
        without one)."""
        if self.model.kernel != UNIFORM or self.gen_length % self.block_length:
            return self.gen_length
        per_canvas = self.model.generation.get("max_denoising_steps") or DEFAULT_DENOISING_STEPS
        return int(per_canvas) * (self.gen_length // self.block_length)

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
        self.cache_policy = cache_policy(self.cache)
        check_refresh(self.cache_policy, self.cache_refresh)
        if not isinstance(self.static_shapes, bool):
            raise ConfigurationError(f"static_shapes is {self.static_shapes!r}; allowed: True or False")
        if self.cache_policy.records and self.model.cache_argument is None:
            raise ModelError(
                f"cache {self.cache!r} needs a model whose forward takes a transformers cache; "
                f"model {self.model.name!r} takes none (use cache='none')"
            )

    @property
    def setup(self) -> dict[str, Any]:
        """What :func:`dloom.hooks.specs.dloom_configure` receives."""
        commit_rule = self.composition.provider("dloom_select_commit")
        return {
            **self.config,
            "tokenizer_sha256": self.model.tokenizer_sha256,
            "commit_rule": commit_rule,
            "commit_params": self.composition.params().get(commit_rule, {}) if commit_rule else {},
            "steps_per_block": self.steps // (self.gen_length // self.block_length),
            "attention": self.model.attention,
            "shift_logits": self.model.shift_logits,
            "takes_attention_mask": self.model.can_pad,
            "vocab_size": vocabulary_size(self.model),
            # times this model's forwards on demand (dloom.model.cost.measure_cost_curve)
            "forward_cost": functools.partial(measure_cost_curve, self.model),
            "decline_drafting": self._decline_drafting,
        }

    def _decline_drafting(self, plugin: object) -> None:
        """``plugin`` will not draft under these settings (``decline_drafting`` of
        :func:`~dloom.hooks.specs.dloom_configure`): if it answers the draft hook, the decoder
        takes plain steps of its commit rule only; any other plugin's word is ignored."""
        drafter = self.composition.provider("dloom_draft")
        if drafter is not None and plugin is self.pm.get_plugin(drafter):
            self.speculative_step = None

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
            "static_shapes": self.static_shapes,
            "draft_budget": self.draft_budget,
            "guarantees": self.guarantees,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
        }

    @property
    def name(self) -> str:
        """The strategy's name, its composition's (:class:`dloom.decode.decoders.Decoder`)."""
        return self.composition.name

    @property
    def forward_seconds(self) -> float:
        """Seconds spent in model forwards since the last session started (what
        :meth:`generate` reports as ``hook_seconds["forward"]``)."""
        return self.forward_clock.seconds

    def totals(self) -> None:
        """``None``: every figure of this decoder is in each result
        (:class:`dloom.decode.decoders.Decoder`)."""
        return None

    def session_calls(self) -> SessionCalls:
        """What a new :class:`~dloom.decode.session.DecodeSession` of this decoder calls on it:
        its sequence layout, step check, forward clock and steppers (plain and, for a
        strategy that drafts, speculative). The decoder's forward clock and hook timer start
        again from zero: their figures are the new session's."""
        self.forward_clock.reset()
        self.timer.reset()
        return SessionCalls(
            layout=self._layout, check=self._check, clock=self.forward_clock,
            plain_step=self.plain_step, speculative_step=self.speculative_step,
            speculator=self.composition.provider("dloom_draft") is not None,
        )

    def _check(self, forward: int, non_finite: int, idle: int, blocks: torch.Tensor) -> None:
        """Raise for the contract violations the step's synchronisation found (``blocks``:
        each row's block index, read only to name the earliest in the message)."""
        if non_finite:
            raise NonFiniteLogitsError(
                f"model {self.model.name!r} returned NaN or inf logits at block "
                f"{int(blocks.min())}, forward {forward}; try dtype='float32' or check the checkpoint"
            )
        if idle:
            rule = str(self.composition.provider("dloom_select_commit"))
            raise HookContractError(
                f"{idle_problem(rule, idle)} (block {int(blocks.min())}, forward {forward})"
            )

    def _layout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """The sequences to decode and where each row's blocks lie.

        :param prompt_ids: / :param prompt_mask: ``(B, P)`` left-padded prompts.
        :return: ``tokens`` ``(B, L)`` (prompt, then masks over each row's generated region,
            then padding), its padding mask and position ids ``(B, L)``, each row's first
            block column ``(B,)`` and the end of its generated region ``(B,)``. With
            ``block_alignment="absolute"`` blocks sit at multiples of ``K`` from each row's
            position 0: the first holds the prompt's last partial block, and the last is
            completed to ``K`` positions (as SDAR's ``generate.py`` does), so a row decodes
            up to ``K - 1`` positions more than ``gen_length``; ``L = P + gen_length + K - 1``.
        """
        batch, prompt_len = prompt_ids.shape
        width, device = self.block_length, prompt_ids.device
        if self.model.block_alignment == "absolute":
            start = prompt_len - prompt_mask.sum(-1) % width
            region_end = start + (prompt_len + self.gen_length - start + width - 1) // width * width
            gen_end = prompt_len + self.gen_length + width - 1
        else:
            start = torch.full((batch,), prompt_len, dtype=torch.long, device=device)
            region_end = start + self.gen_length
            gen_end = prompt_len + self.gen_length
        columns = torch.arange(prompt_len, gen_end, device=device).expand(batch, -1)
        decoded = columns < region_end.unsqueeze(1)
        tokens = torch.cat(
            [prompt_ids, torch.where(decoded, self.mask_token_id, self.model.pad_token_id)], dim=1
        )
        full_mask = torch.cat([prompt_mask, decoded.long()], dim=1)
        positions = position_ids_from_mask(full_mask)
        return tokens, full_mask, positions, start, region_end

    def generated_region(
        self, prompts: Prompts, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where :meth:`generate` decodes each prompt: the columns of its result's
        ``sequences`` from ``start`` to ``end``, a whole number of blocks (block ``j`` of row
        ``i`` is ``start[i] + j K`` to ``start[i] + (j + 1) K``).

        :param prompts: / :param attention_mask: as for :meth:`generate`.
        :return: ``start`` and ``end``, both ``(B,)`` long. With ``block_alignment="absolute"``
            the first block also holds the prompt's last partial block.
        :raises ModelError: for empty prompts.
        """
        prompt_ids, prompt_mask, _ = prepare_prompts(self.model, prompts, attention_mask, 0, None, False)
        _, _, _, start, end = self._layout(prompt_ids, prompt_mask)
        return start, end

    def generate(
        self,
        prompts: Prompts,
        attention_mask: torch.Tensor | None = None,
        observer: Callable[[StepRecord], None] | None = None,
        on_block: Callable[[BlockRecord], None] | None = None,
        *,
        row_offset: int | Sequence[int] | torch.Tensor = 0,
    ) -> GenerationResult:
        """Decode a batch of prompts.

        :param prompts: texts, token-id lists (left-padded here), or a ``(B, P)`` tensor of
            left-padded ids with its ``attention_mask``.
        :param observer: called after every plain step with a :class:`StepRecord` (the
            reference process as it runs; ``dloom calibrate`` records it), including a
            step taken from an earlier forward's next-block logits (:class:`DecodeSession`).
        :param on_block: called after every step in which some rows finished a block, plain
            or speculative, with a :class:`BlockRecord` of those rows' final block tokens
            (``dloom serve`` streams them). Costs no host synchronisation unless given.
        :param row_offset: each prompt's random stream (:class:`dloom.decode.kernel.RowStreams`), so
            that a prompt's sample depends on the seed and its stream, not on the batch it is
            decoded in. An int is the index of the first prompt in the whole request (prompt
            ``i`` samples from stream ``row_offset + i``); a sequence or ``(B,)`` tensor gives
            one stream per prompt (``dloom serve`` batches prompts of different requests,
            each with its index in its own request).
        :return: the decoded batch with its metrics.
        :raises ModelError: for empty prompts or a sequence beyond the model's context.
        :raises ConfigurationError: for a negative ``row_offset`` or one whose length is not
            the number of prompts.
        :raises NonFiniteLogitsError: when the model returns NaN or inf.
        """
        start_time = time.perf_counter()
        session = DecodeSession(self, observer, on_block)
        batch = len(session.admit(prompts, attention_mask, row_offset=row_offset))
        width = session.width
        sequences = session.x.clone()
        nfe = torch.zeros(batch, dtype=torch.long, device=sequences.device)
        lengths = torch.zeros_like(nfe)
        # an editing kernel's edits, drafts and their lengths (dloom.decode.edit_ledger)
        edited = None if session.ledger is None else (torch.zeros_like(nfe), sequences.clone(), torch.zeros_like(nfe))
        while session.size:
            done = session.step()
            if done is not None:
                sequences.index_copy_(0, done.rows, done.sequences)
                nfe.index_copy_(0, done.rows, done.nfe)
                lengths.index_copy_(0, done.rows, done.lengths)
                if edited is not None:
                    for total, part in zip(edited, (done.edits, done.drafts, done.draft_lengths)):
                        assert part is not None
                        total.index_copy_(0, done.rows, part)
        model = self.model
        generated = sequences[:, width:]
        token_lists, texts = token_lists_and_texts(model, generated, lengths)
        edits, drafts, draft_texts = None, None, None
        if edited is not None:
            edits, drafts = edited[0], edited[1][:, width:]
            draft_texts = token_lists_and_texts(model, drafts, edited[2])[1]
        hook_seconds = {"forward": self.forward_clock.seconds, **self.timer.seconds}
        tallies = session.tallies
        return GenerationResult(
            sequences=sequences,
            generated=generated,
            generated_lengths=lengths,
            nfe=nfe,
            forwards=tallies.forwards,
            verifications=tallies.verifications,
            accepted_drafts=tallies.accepted,
            layout_exact=tallies.exact,
            wall_seconds=time.perf_counter() - start_time,
            hook_seconds=hook_seconds,
            config=self.config,
            texts=texts,
            token_lists=token_lists,
            row_forwards=session.row_forwards,
            model_calls=session.model_calls,
            verification_forwards=tallies.verification_forwards,
            edits=edits,
            drafts=drafts,
            draft_texts=draft_texts,
        )
