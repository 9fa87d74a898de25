"""The FailFast decoder: rounds of drafting and verification over a batch."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from dloom import hooks
from dloom.adapter import ModelAdapter, left_pad_prompts
from dloom.ar import ARTarget
from dloom.cache import cache_argument
from dloom.composition import build_plugin_manager, compose
from dloom.engine import row_streams
from dloom.errors import (
    ConfigurationError,
    HookContractError,
    ModelError,
    NonFiniteLogitsError,
)
from dloom.failfast.drafter import DrafterForward
from dloom.failfast.policy import proposal_length
from dloom.failfast.result import FailFastResult
from dloom.failfast.settings import (
    DEFAULT_MAX_NEW_TOKENS,
    DRAFTER_CACHE_MODES,
    FailFastSettings,
    Prompts,
    check_shared_tokenizer,
)
from dloom.failfast.verification import verify_match, verify_ratio
from dloom.kernel import REMASKING, RowStreams, apply_commit, propose
from dloom.metrics import HookTimer
from dloom.prompt_validation import check_lengths, check_prompts
from dloom.registry import Registry
from dloom.types import BlockSchedule

# --- the decoder -----------------------------------------------------------------------------


class FailFastDecoder:
    """Decode an AR target with a dLLM drafter (FailFast), losslessly.

    :param target: the AR target's adapter (causal, with a KV cache).
    :param drafter: the drafter dLLM's adapter (bidirectional, with a mask token), sharing the
        target's tokenizer (:func:`check_shared_tokenizer`).
    :param strategy: ``"failfast"`` (or another strategy whose object is a
        :class:`FailFastSettings`), or a :class:`FailFastSettings`.
    :param params: strategy parameters (``tau``, ``n``, ...; see :class:`FailFastSettings`).
    :param max_new_tokens: most generated tokens per row (default: the drafter's default
        generation length, else 128); also the drafter canvas' mask region.
    :param temperature: 0 for greedy, ``> 0`` to sample (target and drafter alike).
    :param remasking: confidence kind of the drafter's commit rule
        (:data:`dloom.kernel.REMASKING`); the policy's recorded confidence is always the
        committed token's probability.
    :param seed: seeds every prompt's random stream (``None``: nondeterministic).
    :param drafter_cache: one of :data:`DRAFTER_CACHE_MODES`.
    :param unsafe_ratio_out_of_order: allow ``verification="ratio"`` with ``small_block > 1``.
        That combination is biased; it exists for negative controls (tests showing the bias
        is detected). Never set it otherwise.
    :raises ConfigurationError: bad lengths, temperature, remasking, cache mode or strategy
        parameters; ratio verification with an out-of-order drafter.
    :raises ModelError: models of the wrong kind, on different devices, or without a shared
        tokenizer.
    :raises CompositionError: / :raises UnknownStrategyError: for a bad drafter strategy.

    :ivar model: the target's adapter (what the CLI reads: tokenizer, padding, chat template).
    :ivar target: the :class:`dloom.ar.ARTarget` around it (its KV cache).
    :ivar drafter: the drafter's adapter.
    :ivar settings: the :class:`FailFastSettings` in use.
    """

    def __init__(
        self,
        target: ModelAdapter,
        drafter: ModelAdapter,
        strategy: str | FailFastSettings = "failfast",
        *,
        params: Mapping[str, Any] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        remasking: str = "low_confidence",
        seed: int | None = None,
        drafter_cache: str = "none",
        registry: Registry | None = None,
        unsafe_ratio_out_of_order: bool = False,
        **strategy_params: Any,
    ) -> None:
        check_lengths(max_new_tokens=max_new_tokens)
        if isinstance(strategy, FailFastSettings):
            if params or strategy_params:
                raise ConfigurationError("pass parameters inside the FailFastSettings, not as params")
            self.settings, self.strategy_name = strategy, "failfast"
            self._params = {"failfast": dict(vars(strategy))}
        else:
            composition = compose(strategy, {**(params or {}), **strategy_params}, registry)
            plugins = [c.plugin for c in composition.components]
            if len(plugins) != 1 or not isinstance(plugins[0], FailFastSettings):
                raise ConfigurationError(
                    f"FailFastDecoder runs the 'failfast' strategy alone; got {composition.name!r}"
                )
            self.settings, self.strategy_name = plugins[0], composition.name
            self._params = composition.params()
        if drafter.mask_token_id is None or drafter.attention != "bidirectional":
            raise ModelError(
                f"drafter {drafter.name!r} must be a bidirectional dLLM with a mask token; it has "
                f"{drafter.attention!r} attention and mask token {drafter.mask_token_id!r}"
            )
        if drafter.device != target.device:
            raise ModelError(
                f"drafter {drafter.name!r} is on {drafter.device}, target {target.name!r} on "
                f"{target.device}; put both on one device"
            )
        check_shared_tokenizer(target, drafter)
        self.target = ARTarget(target)
        self.model = target
        self.drafter = drafter
        self.max_new_tokens = max_new_tokens or drafter.default_gen_length or DEFAULT_MAX_NEW_TOKENS
        self.temperature = float(temperature)
        self.remasking = remasking
        self.seed = seed
        self.drafter_cache = drafter_cache
        self._validate(unsafe_ratio_out_of_order)
        if self.drafter_cache == "prefix" and cache_argument(drafter.model) is None:
            raise ModelError(
                f"drafter_cache 'prefix' needs a drafter whose forward takes a transformers "
                f"cache; {drafter.name!r} takes none (use drafter_cache='none')"
            )
        self.drafter_composition = self._drafter_composition(registry)
        self.timer = HookTimer()
        self.pm = build_plugin_manager(self.drafter_composition, self.timer)
        self.reset_totals()

    def reset_totals(self) -> None:
        """Zero the counts that :meth:`totals` adds up over :meth:`generate` calls."""
        self._totals: dict[str, Any] = {
            "rows": 0, "generated_tokens": 0, "target_nfe": 0, "drafter_nfe": 0,
            "target_forwards": 0, "drafter_forwards": 0, "histogram": Counter(),
        }

    def totals(self) -> dict[str, Any]:
        """Counts over every :meth:`generate` since the last :meth:`reset_totals`, JSON-ready:
        rows, generated tokens, target and drafter NFE (row-forwards) and batch forwards,
        verification rounds, accepted draft tokens per round and their histogram, and target
        NFE per generated token."""
        t = self._totals
        rounds = sum(t["histogram"].values())
        accepted = sum(k * v for k, v in t["histogram"].items())
        return {
            "rows": t["rows"],
            "generated_tokens": t["generated_tokens"],
            "target_nfe": t["target_nfe"],
            "drafter_nfe": t["drafter_nfe"],
            "target_forwards": t["target_forwards"],
            "drafter_forwards": t["drafter_forwards"],
            "rounds": rounds,
            "accepted_per_round": accepted / rounds if rounds else 0.0,
            "accepted_histogram": {str(k): v for k, v in sorted(t["histogram"].items())},
            "target_nfe_per_token": t["target_nfe"] / t["generated_tokens"] if t["generated_tokens"] else 0.0,
        }

    def _validate(self, unsafe_ratio: bool) -> None:
        if self.max_new_tokens < 1:
            raise ConfigurationError(f"max_new_tokens is {self.max_new_tokens}; allowed: >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigurationError(f"temperature is {self.temperature!r}; allowed: >= 0")
        if self.remasking not in REMASKING:
            raise ConfigurationError(f"remasking is {self.remasking!r}; allowed: {', '.join(REMASKING)}")
        if self.drafter_cache not in DRAFTER_CACHE_MODES:
            raise ConfigurationError(
                f"drafter_cache is {self.drafter_cache!r}; allowed: {', '.join(DRAFTER_CACHE_MODES)}"
            )
        if self.settings.verification == "ratio" and self.settings.small_block != 1 and not unsafe_ratio:
            raise ConfigurationError(
                f"verification 'ratio' needs drafts produced strictly left to right, but "
                f"small_block is {self.settings.small_block}: the drafter may commit a later "
                "position before an earlier one, so q(x_i) is not the drafter's probability of "
                "x_i given x_<i and min(1, p/q) rejection sampling is biased; use "
                "verification='match' (exact for any drafter) or small_block=1"
            )

    def _drafter_composition(self, registry: Registry | None):
        from dloom.registry import get_registry

        name = self.settings.drafter_strategy
        strategy = (registry or get_registry()).get(name)
        if isinstance(strategy.registration.plugin_class, type) and issubclass(
            strategy.registration.plugin_class, FailFastSettings
        ):
            raise ConfigurationError(f"drafter_strategy {name!r} is FailFast itself; allowed: a commit rule")
        params = {"tau": self.settings.drafter_tau} if any(p.name == "tau" for p in strategy.parameters) else {}
        composition = compose(name, params, registry)
        if composition.provider("dloom_select_commit") is None:
            raise ConfigurationError(
                f"drafter_strategy {name!r} has no commit rule (dloom_select_commit); allowed: "
                "quota, threshold, factor, frechet or another commit rule"
            )
        if composition.provider("dloom_draft") is not None:
            raise ConfigurationError(
                f"drafter_strategy {name!r} speculates; the FailFast drafter takes a plain commit rule"
            )
        return composition

    @property
    def name(self) -> str:
        """The strategy's name (:class:`dloom.decoding.Decoder`)."""
        return self.strategy_name

    @property
    def config(self) -> dict[str, Any]:
        """The settings, JSON-ready (recorded in every result)."""
        return {
            "model": self.model.name,
            "target": self.model.name,
            "drafter": self.drafter.name,
            "strategy": self.strategy_name,
            "params": self._params,
            "drafter_strategy": self.drafter_composition.name,
            "drafter_params": self.drafter_composition.params(),
            "gen_length": self.max_new_tokens,
            "temperature": self.temperature,
            "remasking": self.remasking,
            "seed": self.seed,
            "drafter_cache": self.drafter_cache,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
        }

    def generate(
        self,
        prompts: Prompts,
        attention_mask: torch.Tensor | None = None,
        *,
        row_offset: int | Sequence[int] | torch.Tensor = 0,
    ) -> FailFastResult:
        """Decode a batch of prompts.

        :param prompts: texts, token-id lists (left-padded here), or a ``(B, P)`` tensor of
            left-padded ids with its ``attention_mask``.
        :param row_offset: each prompt's random stream (:class:`dloom.kernel.RowStreams`; a
            row's draws advance with its own drafting steps and verifications only, and are
            keyed to its own draft positions): an int is the index of the first prompt in the
            whole request (prompt ``i`` samples from stream ``row_offset + i``), a sequence or
            ``(B,)`` tensor gives one stream per prompt, as in
            :meth:`dloom.DiffusionDecoder.generate`.
        :return: the generated tokens (``generated`` ``(B, max_new_tokens)``, the target's
            pad id after each row's end) and the metrics.
        :raises ModelError: empty prompts, or a sequence beyond either model's context.
        :raises ConfigurationError: a negative ``row_offset`` or one of the wrong length.
        :raises NonFiniteLogitsError: when the drafter returns NaN or inf logits.
        """
        start_time = time.perf_counter()
        self.timer.seconds.clear()
        timings = {"target_forward": 0.0, "drafter_forward": 0.0, "draft": 0.0, "verify": 0.0}
        prompts = check_prompts(self.model, prompts, attention_mask)
        prompt_ids, prompt_mask = left_pad_prompts(self.model, prompts, attention_mask)
        batch, prompt_len = prompt_ids.shape
        total = prompt_len + self.max_new_tokens
        if self.drafter.max_context is not None and total > self.drafter.max_context:
            raise ModelError(
                f"prompt of {prompt_len} tokens + max_new_tokens {self.max_new_tokens} = {total} "
                f"exceeds the drafter {self.drafter.name!r}'s context of {self.drafter.max_context}"
            )
        device = prompt_ids.device
        stream_ids = row_streams(row_offset, batch, device)
        mask_id = self.drafter.mask_token_id
        generator = None
        if self.temperature > 0 or self.remasking == "random":
            # one random stream per prompt: a prompt's sample does not depend on its batch
            generator = RowStreams(self.seed, stream_ids)
        canvas = torch.cat(
            [prompt_ids, torch.full((batch, self.max_new_tokens), mask_id, device=device)], dim=1
        )
        full_mask = torch.cat([prompt_mask, torch.ones_like(canvas[:, prompt_len:])], dim=1)
        padded = bool((prompt_mask == 0).any())
        drafter_forward = DrafterForward(
            self.drafter, self.drafter_cache, full_mask if padded else None,
            torch.clamp(full_mask.cumsum(-1) - 1, min=0),
        )
        started = time.perf_counter()
        self.target.reset(prompt_ids, prompt_mask, self.max_new_tokens)
        timings["target_forward"] += time.perf_counter() - started
        eos_ids = torch.tensor(self.model.eos_token_ids, dtype=torch.long, device=device)
        accepted_len = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        target_nfe = torch.full((batch,), self.target.forwards, dtype=torch.long, device=device)
        drafter_nfe = torch.zeros(batch, dtype=torch.long, device=device)
        history: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        drafter_forwards = 0
        stable = prompt_len
        while True:
            started, forward_before = time.perf_counter(), timings["drafter_forward"]
            draft_len, draft_probs, steps, widths = self._draft(
                canvas, accepted_len, finished, stable, drafter_forward, drafter_nfe, generator, timings
            )
            drafter_forwards += steps
            timings["draft"] += time.perf_counter() - started - (timings["drafter_forward"] - forward_before)
            started, forward_before = time.perf_counter(), timings["target_forward"]
            accepted, active = self._verify(
                canvas, accepted_len, finished, draft_len, widths, draft_probs, eos_ids, generator, timings
            )
            target_nfe += active.long()
            history.append((accepted, draft_len, active))
            remaining = torch.where(finished, self.max_new_tokens, accepted_len)
            status = torch.stack([finished.all().long(), remaining.min()]).tolist()
            timings["verify"] += time.perf_counter() - started - (timings["target_forward"] - forward_before)
            if status[0]:
                break
            stable = prompt_len + int(status[1])
            self.target.crop(stable - 1)
        self.target.release()
        return self._result(
            canvas, prompt_len, accepted_len, target_nfe, drafter_nfe, drafter_forwards, history,
            timings, start_time,
        )

    def _draft(
        self, canvas: torch.Tensor, accepted_len: torch.Tensor, finished: torch.Tensor, stable: int,
        drafter_forward: DrafterForward, drafter_nfe: torch.Tensor, generator: RowStreams | None,
        timings: dict[str, float],
    ) -> tuple[torch.Tensor, torch.Tensor | None, int, tuple[int, int]]:
        """Draft after every unfinished row's accepted prefix, in place on ``canvas``.

        :return: ``draft_len`` ``(B,)`` long (0 for finished rows), the drafter's
            distributions ``(B, W - stable, V)`` float64 of the committed tail columns (ratio
            verification only, else ``None``), the drafter forwards run, and (fetched with the
            last step's host synchronisation) the longest draft and the verification
            forward's width (accepted tokens not yet cached plus the draft, longest row).
        """
        settings, mask_id = self.settings, self.drafter.mask_token_id
        batch, width = canvas.shape
        prompt_len = width - self.max_new_tokens
        start = prompt_len + accepted_len  # (B,) first draft column
        columns = torch.arange(stable, width, device=canvas.device)  # the tail's columns
        offset = columns.unsqueeze(0) - start.unsqueeze(1)  # (B, T) position in the draft
        tail = canvas[:, stable:]
        tail = torch.where((offset >= 0) & ~finished.unsqueeze(1), mask_id, tail)
        drafting = ~finished
        cap = self.max_new_tokens - accepted_len
        if settings.policy == "failfast":
            cap = torch.clamp(cap, max=settings.n_max)
        draft_len = torch.zeros_like(accepted_len)
        block_start = torch.zeros_like(accepted_len)  # draft position of each row's small block
        probability = torch.zeros(tail.shape, dtype=torch.float64, device=canvas.device)
        draft_probs = None
        ratio = settings.verification == "ratio" and self.temperature > 0
        refeed = torch.where(finished, 0, start - self.target.length)  # accepted, not cached
        eos_ids = torch.tensor(self.model.eos_token_ids, dtype=torch.long, device=canvas.device)
        ones = torch.ones(batch, dtype=torch.long, device=canvas.device)
        schedule = BlockSchedule(0, 1, ones)  # quota: one token per step
        steps = 0
        while True:
            canvas[:, stable:] = tail
            started = time.perf_counter()
            logits = drafter_forward(canvas, stable)
            timings["drafter_forward"] += time.perf_counter() - started
            drafter_nfe += drafting.long()
            steps += 1
            in_block = (offset >= block_start.unsqueeze(1)) & (offset < (block_start + settings.small_block).unsqueeze(1))
            selectable = (tail == mask_id) & in_block & drafting.unsqueeze(1)
            if generator is not None:  # draws keyed to each row's own draft positions
                generator.offset = stable - prompt_len - accepted_len
            candidates, confidence = propose(logits, self.temperature, self.remasking, generator, mask_id)
            if generator is not None:
                generator.advance(drafting)
                generator.offset = None
            commit = hooks.select_commit(self.pm, confidence, selectable, schedule)
            tail = apply_commit(tail, candidates, commit)
            logits64 = logits.to(torch.float64, copy=True)
            logits64[..., mask_id] = -torch.inf
            token_probability = torch.softmax(logits64, dim=-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
            probability = torch.where(commit, token_probability, probability)
            if ratio:
                tempered = torch.softmax(logits64 / self.temperature, dim=-1)
                draft_probs = tempered if draft_probs is None else torch.where(commit.unsqueeze(-1), tempered, draft_probs)
            still_masked = ((tail == mask_id) & in_block).any(-1)
            block_start = torch.where(still_masked, block_start, block_start + settings.small_block)
            stop = self._policy(tail, offset, probability, cap, drafting, eos_ids)
            draft_len = torch.where(stop > 0, stop, draft_len)
            idle = (selectable.any(-1) & ~commit.any(-1)).any()
            drafting = drafting & (stop == 0)
            status = torch.stack(
                [drafting.any(), ~torch.isfinite(logits).all(), idle, draft_len.max(), (refeed + draft_len).max()]
            ).tolist()
            if status[1]:
                raise NonFiniteLogitsError(
                    f"drafter {self.drafter.name!r} returned NaN or inf logits; try dtype='float32'"
                )
            if status[2]:
                raise HookContractError(
                    f"drafter commit rule {self.drafter_composition.provider('dloom_select_commit')!r} "
                    "committed no position in a row that had masked positions"
                )
            if not status[0]:
                break
        canvas[:, stable:] = tail
        return draft_len, draft_probs, steps, (int(status[3]), int(status[4]))

    def _policy(
        self, tail: torch.Tensor, offset: torch.Tensor, probability: torch.Tensor, cap: torch.Tensor,
        drafting: torch.Tensor, eos_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``(B,)`` long: the proposal length of each drafting row that stops now, else 0.

        ``tail``, ``offset`` (draft position of each tail column) and ``probability`` (of
        each committed token) are ``(B, T)``; ``cap`` and ``drafting`` ``(B,)``.
        """
        mask_id, width = self.drafter.mask_token_id, offset.shape[1]
        ahead = offset >= 0
        big = torch.full_like(offset, width + self.max_new_tokens)
        done = torch.where(ahead & (tail == mask_id), offset, big).amin(-1)
        done = torch.minimum(done, cap)
        committed = ahead & (offset < done.unsqueeze(1))
        eos = torch.isin(tail, eos_ids)
        first_eos = torch.where(committed & eos, offset, big).amin(-1)
        first_low = torch.where(committed & (probability < self.settings.tau), offset, big).amin(-1)
        first_low = torch.minimum(first_low, done)
        limit = torch.minimum(cap, first_eos + 1)
        length = proposal_length(done, first_low, limit, self.settings)
        return torch.where(drafting & (done >= length), length, torch.zeros_like(length))

    def _verify(
        self, canvas: torch.Tensor, accepted_len: torch.Tensor, finished: torch.Tensor,
        draft_len: torch.Tensor, widths: tuple[int, int], draft_probs: torch.Tensor | None,
        eos_ids: torch.Tensor, generator: RowStreams | None, timings: dict[str, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over every unfinished row's draft; updates ``canvas``,
        ``accepted_len`` and ``finished`` in place. ``widths``: the longest draft and the
        forward's width, from :meth:`_draft`.

        :return: ``accepted`` ``(B,)`` long draft tokens accepted and ``active`` ``(B,)`` bool
            (rows that were verified).
        """
        width = canvas.shape[1]
        prompt_len = width - self.max_new_tokens
        device = canvas.device
        active = ~finished
        cached = self.target.length
        refeed = torch.where(active, prompt_len + accepted_len - cached, 0)
        fed = refeed + torch.where(active, draft_len, 0)
        longest, slots = widths
        slot = torch.arange(slots, device=device)
        slot_mask = slot.unsqueeze(0) < fed.unsqueeze(1)
        ids = torch.where(slot_mask, canvas[:, cached : cached + slots], self.model.pad_token_id)
        started = time.perf_counter()
        logits = self.target.forward(ids, slot_mask)
        timings["target_forward"] += time.perf_counter() - started
        position = torch.arange(longest + 1, device=device)
        rows = (refeed - 1).clamp(min=0).unsqueeze(1) + position
        target_logits = logits.gather(1, rows.clamp(max=slots - 1).unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        draft_columns = (prompt_len + accepted_len).unsqueeze(1) + position[:longest]
        draft = canvas.gather(1, draft_columns.clamp(max=width - 1))
        if self.settings.verification == "ratio" and self.temperature > 0:
            tail_start = width - draft_probs.shape[1]
            index = (draft_columns - tail_start).clamp(0, draft_probs.shape[1] - 1)
            q = draft_probs.gather(1, index.unsqueeze(-1).expand(-1, -1, draft_probs.shape[-1]))
            vocab = target_logits.shape[-1]  # the drafter's logits may be narrower or wider
            q = torch.nn.functional.pad(q[..., :vocab], (0, max(0, vocab - q.shape[-1])))
            accepted, token = verify_ratio(draft, draft_len, target_logits, q, self.temperature, generator)
        else:
            accepted, token = verify_match(draft, draft_len, target_logits, self.temperature, generator)
        if generator is not None:
            generator.advance(active)
        accepted = torch.where(active, accepted, 0)
        token_column = prompt_len + accepted_len + accepted
        write = active & (token_column < width)
        column = token_column.clamp(max=width - 1).unsqueeze(1)
        canvas.scatter_(1, column, torch.where(write.unsqueeze(1), token.unsqueeze(1), canvas.gather(1, column)))
        new_len = torch.where(active, torch.clamp(accepted_len + accepted + 1, max=self.max_new_tokens), accepted_len)
        generated = canvas[:, prompt_len:]
        index = torch.arange(self.max_new_tokens, device=device)
        fresh = (index >= accepted_len.unsqueeze(1)) & (index < new_len.unsqueeze(1))
        eos_at = torch.where(fresh & torch.isin(generated, eos_ids), index, self.max_new_tokens).amin(-1)
        ended = eos_at < self.max_new_tokens
        new_len = torch.where(ended, eos_at + 1, new_len)
        finished |= ended | (new_len >= self.max_new_tokens)
        accepted_len.copy_(new_len)
        return accepted, active

    def _result(
        self, canvas, prompt_len, accepted_len, target_nfe, drafter_nfe, drafter_forwards, history,
        timings, start_time,
    ) -> FailFastResult:
        index = torch.arange(self.max_new_tokens, device=canvas.device)
        generated = torch.where(
            index < accepted_len.unsqueeze(1), canvas[:, prompt_len:], self.model.pad_token_id
        )
        sequences = torch.cat([canvas[:, :prompt_len], generated], dim=1)
        accepted = torch.stack([h[0] for h in history], 1).tolist()
        proposed = torch.stack([h[1] for h in history], 1).tolist()
        active = torch.stack([h[2] for h in history], 1).tolist()
        lengths = accepted_len.tolist()
        token_lists = [row[:n] for row, n in zip(generated.tolist(), lengths)]
        texts = None
        if self.model.tokenizer is not None:
            eos = set(self.model.eos_token_ids)
            texts = [self.model.decode([t for t in row if t not in eos]) for row in token_lists]
        result = FailFastResult(
            sequences=sequences,
            generated=generated,
            generated_lengths=accepted_len.clone(),
            nfe=target_nfe,
            forwards=self.target.forwards,
            wall_seconds=time.perf_counter() - start_time,
            hook_seconds={**timings, **self.timer.seconds},
            config=self.config,
            texts=texts,
            token_lists=token_lists,
            verifications=sum(map(sum, active)),
            accepted_drafts=sum(a for row, live in zip(accepted, active) for a, on in zip(row, live) if on),
            layout_exact=True,  # one causal forward over the draft: the target's exact distributions
            drafter_nfe=drafter_nfe,
            drafter_forwards=drafter_forwards,
            accepted=[[a for a, on in zip(row, live) if on] for row, live in zip(accepted, active)],
            proposed=[[k for k, on in zip(row, live) if on] for row, live in zip(proposed, active)],
        )
        totals = self._totals
        totals["rows"] += len(lengths)
        totals["generated_tokens"] += sum(lengths)
        totals["target_nfe"] += int(target_nfe.sum())
        totals["drafter_nfe"] += int(drafter_nfe.sum())
        totals["target_forwards"] += result.forwards
        totals["drafter_forwards"] += drafter_forwards
        totals["histogram"].update(a for row in result.accepted for a in row)
        return result


def build_failfast_decoder(
    target: str | ModelAdapter,
    drafter: str | ModelAdapter,
    strategy: str = "failfast",
    params: Mapping[str, Any] | None = None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    mask_token_id: int | None = None,
    trust_remote_code: bool = False,
    gen_length: int | None = None,
    block_length: int | None = None,
    steps: int | None = None,
    cache: str = "none",
    **settings: Any,
) -> FailFastDecoder:
    """Load ``target`` (an AR model) and ``drafter`` (a dLLM) by zoo name or directory and
    build a :class:`FailFastDecoder`, taking the diffusion decoder's setting names (what
    ``dloom generate --strategy failfast`` runs).

    ``gen_length`` is ``max_new_tokens``, ``cache`` the ``drafter_cache``; ``mask_token_id``
    is the drafter's; ``settings`` (``temperature``, ``remasking``, ``seed``) go to the
    decoder as they are.

    :raises ConfigurationError: for ``block_length`` or ``steps`` (FailFast's drafter uses
        ``small_block`` and its commit rule instead).
    """
    from dloom.adapter import load_model

    check_lengths(gen_length=gen_length)
    if block_length is not None or steps is not None:
        raise ConfigurationError(
            f"block_length {block_length} / steps {steps} do not apply to failfast; the drafter "
            "denoises small blocks (--param small_block=N) with its commit rule "
            "(--param drafter_strategy=NAME)"
        )
    if isinstance(target, str):
        target = load_model(
            target, device=device, dtype=dtype, require_mask=False,
            trust_remote_code=trust_remote_code,
        )
    if isinstance(drafter, str):
        drafter = load_model(
            drafter, device=device, dtype=dtype, mask_token_id=mask_token_id,
            trust_remote_code=trust_remote_code,
        )
    return FailFastDecoder(
        target, drafter, strategy, params=params, max_new_tokens=gen_length, drafter_cache=cache,
        **settings,
    )
