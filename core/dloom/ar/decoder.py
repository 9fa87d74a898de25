"""The speculative decoder of an autoregressive target: rounds of drafting token chains and
verifying them in one target forward, through the same decoding hooks as
:class:`dloom.DiffusionDecoder`'s speculation.

Each round, for every row still generating:

1. ``dloom_draft`` proposes a token chain per row (:class:`~dloom.types.DraftChains`)
   from a :class:`~dloom.types.ChainState`; ``dloom_prune`` cuts it (a length policy, the
   decoder's ``draft_budget``). A drafter may build chains over several calls: while some
   row stays ``open`` after pruning, ``dloom_draft`` is called again with the chains so far.
2. ``dloom_build_mask`` lays out one target forward (:class:`~dloom.types.ChainLayout`):
   each row's accepted tokens the target has not cached, then its chain.
3. The decoder runs that forward on the target's KV cache (:class:`dloom.ar.target.ARTarget`) and
   ``dloom_verify`` returns the accepted tokens and the target's next token
   (:class:`~dloom.types.ChainVerdict`), sampling with the target's kernel
   (:class:`dloom.ar.chains.TargetKernel`).
4. The decoder appends them, ends rows at an EOS or ``max_new_tokens``, and crops the
   target's cache to the columns every row accepted.

The decoder owns the target's forward and its cache; everything a strategy decides (what to
draft, how long, how to verify) is its plugins'. Lossless verification
(:func:`dloom.ar.chains.match_chains`) makes the output the target's own decoding, whatever drafts.

A strategy that stops drafting (:attr:`~dloom.types.DraftChains.target_alone`, e.g.
FailFast where drafting does not pay) hands the rest of the batch to the target alone: the
decoder's plain autoregressive loop, one cached forward per token with no hook calls, the
tokens an empty chain's verification would give, run under ``torch.inference_mode`` (cheaper
per operation than ``no_grad``, which transformers' ``generate`` uses). The result's
``drafting`` says which path the batch took.

Host synchronisation: once per drafting call (is any row still open, the layout's width, the
drafter's deferred checks) and once per round (is every row finished, the new cache length);
never per row. With the target alone: once per token, as any autoregressive loop.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dloom.ar.chains import TargetKernel, chain_logits, uncached_tokens
from dloom.ar.result import ARTargetResult
from dloom.ar.target import ARTarget
from dloom.decode.generation import prepare_prompts, token_lists_and_texts
from dloom.decode.kernel import REMASKING
from dloom.decode.prompts import check_lengths
from dloom.errors import ConfigurationError, ModelError
from dloom.hooks import calls as hooks
from dloom.hooks.cache_policies import cache_modes
from dloom.hooks.composition import StrategySpec, build_plugin_manager, compose
from dloom.hooks.registry import Registry
from dloom.hooks.timing import HookTimer
from dloom.model.adapter import ModelAdapter
from dloom.model.runner import settling_cache_modes
from dloom.types import ChainState, DraftChains

DEFAULT_MAX_NEW_TOKENS = 128


def drafter_cache_modes() -> tuple[str, ...]:
    """The registered cache policies a drafter's runner (:class:`dloom.model.runner.BlockForward`)
    can take: those that record nothing (every drafter forward recomputes the canvas) and
    those that keep settled columns (:func:`dloom.model.runner.settling_cache_modes`: the
    columns every row has accepted), the built-ins first: ``("none", "prefix")``."""
    return cache_modes(records=False) + settling_cache_modes()


class ARTargetDecoder:
    """Decode an autoregressive target with a strategy that drafts token chains, losslessly.

    :param target: the AR target's adapter (causal, with a KV cache).
    :param strategy: a registered name, ``"a+b"``, a plugin object, a list of those (a
        composition providing ``dloom_draft``, ``dloom_build_mask`` and ``dloom_verify``),
        or a :class:`~dloom.hooks.composition.Composition`.
    :param drafter: the model a drafter plugin runs (``None`` for drafters without one,
        such as prompt lookup); handed to the plugins by ``dloom_configure``
        (``config["drafter_model"]``).
    :param max_new_tokens: most generated tokens per row (default: the drafter's default
        generation length, else 128).
    :param temperature: 0 for greedy, ``> 0`` to sample (target and drafter alike).
    :param remasking: the confidence kind of a dLLM drafter's commit rule
        (:data:`dloom.decode.kernel.REMASKING`).
    :param seed: seeds every prompt's random stream (``None``: nondeterministic).
    :param drafter_cache: the drafter's KV cache policy, one of :func:`drafter_cache_modes`
        (a drafter plugin checks that its model supports it).
    :param draft_budget: the most chain tokens per row one verification may evaluate
        (``None``: the strategy's own limit); longer chains after pruning are a
        :class:`~dloom.errors.HookContractError`.
    :param params: strategy parameters by name or by component.
    :raises ConfigurationError: bad lengths, temperature, remasking, cache mode or budget; a
        composition without the speculation hooks, or with a commit rule.
    :raises ModelError: a target that is not causal or takes no cache; a drafter on another
        device.

    :ivar model: the target's adapter (what the CLI reads: tokenizer, padding, chat template).
    :ivar target: the :class:`dloom.ar.target.ARTarget` around it (its KV cache).
    :ivar drafter: the drafter's adapter, or ``None``.
    :ivar composition: the strategy's :class:`~dloom.hooks.composition.Composition`.
    """

    def __init__(
        self,
        target: ModelAdapter,
        strategy: StrategySpec = "failfast",
        *,
        drafter: ModelAdapter | None = None,
        params: Mapping[str, Any] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        remasking: str = "low_confidence",
        seed: int | None = None,
        drafter_cache: str = "none",
        draft_budget: int | None = None,
        registry: Registry | None = None,
        **strategy_params: Any,
    ) -> None:
        check_lengths(max_new_tokens=max_new_tokens)
        self.composition = compose(strategy, {**(params or {}), **strategy_params}, registry)
        self.target = ARTarget(target)
        self.model = target
        self.drafter = drafter
        default = drafter.default_gen_length if drafter is not None else None
        self.max_new_tokens = max_new_tokens or default or DEFAULT_MAX_NEW_TOKENS
        self.temperature = float(temperature)
        self.remasking = remasking
        self.seed = seed
        self.drafter_cache = drafter_cache
        self.draft_budget = draft_budget
        self._validate()
        self.timer = HookTimer()
        self.pm = build_plugin_manager(self.composition, self.timer)
        hooks.configure(self.pm, {
            **self.config, "decoder": "ar-target", "tokenizer_sha256": target.tokenizer_sha256,
            "target_model": target, "drafter_model": drafter, "registry": registry,
        })
        self.reset_totals()

    def _validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigurationError(f"max_new_tokens is {self.max_new_tokens}; allowed: >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigurationError(f"temperature is {self.temperature!r}; allowed: >= 0")
        if self.remasking not in REMASKING:
            raise ConfigurationError(f"remasking is {self.remasking!r}; allowed: {', '.join(REMASKING)}")
        if self.drafter_cache not in drafter_cache_modes():
            raise ConfigurationError(
                f"drafter_cache is {self.drafter_cache!r}; allowed: {', '.join(drafter_cache_modes())}"
            )
        if self.draft_budget is not None and self.draft_budget < 0:
            raise ConfigurationError(f"draft_budget is {self.draft_budget!r}; allowed: >= 0 or None")
        if self.drafter is not None and self.drafter.device != self.model.device:
            raise ModelError(
                f"drafter {self.drafter.name!r} is on {self.drafter.device}, target "
                f"{self.model.name!r} on {self.model.device}; put both on one device"
            )
        name = self.composition.name
        rule = self.composition.provider("dloom_select_commit")
        if rule is not None:
            raise ConfigurationError(
                f"strategy {name!r}: {rule!r} is a commit rule, which an AR target does not "
                "take (it decodes one token per position); a dLLM drafter's commit rule is a "
                "parameter of the drafting strategy"
            )
        if self.composition.provider("dloom_draft") is None:
            raise ConfigurationError(
                f"strategy {name!r} drafts nothing (no dloom_draft); the ar-target decoder runs "
                "a strategy that proposes token chains, e.g. failfast"
            )

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
            **{key: t[key] for key in ("rows", "generated_tokens", "target_nfe", "drafter_nfe",
                                       "target_forwards", "drafter_forwards")},
            "rounds": rounds,
            "accepted_per_round": accepted / rounds if rounds else 0.0,
            "accepted_histogram": {str(k): v for k, v in sorted(t["histogram"].items())},
            "target_nfe_per_token": t["target_nfe"] / t["generated_tokens"] if t["generated_tokens"] else 0.0,
        }

    @property
    def name(self) -> str:
        """The strategy's name (:class:`dloom.decode.decoders.Decoder`)."""
        return self.composition.name

    @property
    def config(self) -> dict[str, Any]:
        """The settings, JSON-ready (recorded in every result)."""
        return {
            "model": self.model.name,
            "target": self.model.name,
            "drafter": self.drafter.name if self.drafter is not None else None,
            "strategy": self.composition.name,
            "params": self.composition.params(),
            "gen_length": self.max_new_tokens,
            "temperature": self.temperature,
            "remasking": self.remasking,
            "seed": self.seed,
            "drafter_cache": self.drafter_cache,
            "draft_budget": self.draft_budget,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
        }

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        row_offset: int | Sequence[int] | torch.Tensor = 0,
    ) -> ARTargetResult:
        """Decode a batch of prompts.

        :param prompts: texts, token-id lists (left-padded here), or a ``(B, P)`` tensor of
            left-padded ids with its ``attention_mask``.
        :param row_offset: each prompt's random stream (:class:`dloom.decode.kernel.RowStreams`; a
            row's draws advance with its own drafting steps and verifications only): an int
            is the index of the first prompt in the whole request, a sequence or ``(B,)``
            tensor gives one stream per prompt, as in :meth:`dloom.DiffusionDecoder.generate`.
        :return: the generated tokens (``generated`` ``(B, max_new_tokens)``, the target's
            pad id after each row's end) and the metrics.
        :raises ModelError: empty prompts, or a sequence beyond either model's context.
        :raises ConfigurationError: a negative ``row_offset`` or one of the wrong length.
        :raises NonFiniteLogitsError: / :raises HookContractError: from a drafter's checks.
        """
        start_time = time.perf_counter()
        self.timer.reset()
        seconds: dict[str, float] = defaultdict(float)
        samples = self.temperature > 0 or self.remasking == "random"
        prompt_ids, prompt_mask, streams = prepare_prompts(
            self.model, prompts, attention_mask, row_offset, self.seed, samples
        )
        batch, prompt_len = prompt_ids.shape
        total = prompt_len + self.max_new_tokens
        drafter = self.drafter
        if drafter is not None and drafter.max_context is not None and total > drafter.max_context:
            raise ModelError(
                f"prompt of {prompt_len} tokens + max_new_tokens {self.max_new_tokens} = {total} "
                f"exceeds the drafter {drafter.name!r}'s context of {drafter.max_context}"
            )
        device = prompt_ids.device
        tokens = torch.cat(
            [prompt_ids, torch.full((batch, self.max_new_tokens), self.model.pad_token_id, device=device)], dim=1
        )
        full_mask = torch.cat([prompt_mask, torch.ones_like(tokens[:, prompt_len:])], dim=1)
        started = time.perf_counter()
        self.target.reset(prompt_ids, prompt_mask, self.max_new_tokens)
        seconds["target_forward"] += time.perf_counter() - started
        eos_ids = torch.tensor(self.model.eos_token_ids, dtype=torch.long, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        target_nfe = torch.full((batch,), self.target.forwards, dtype=torch.long, device=device)
        drafter_nfe = torch.zeros(batch, dtype=torch.long, device=device)
        kernel = TargetKernel(self.temperature, streams)
        history: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        drafter_forwards, shared, previous = 0, prompt_len, None
        drafting: dict[str, Any] = {"path": "drafted"}
        while True:
            state = ChainState(
                tokens=tokens, attention_mask=full_mask, prompt_length=prompt_len,
                lengths=lengths.clone(), active=~finished, max_new_tokens=self.max_new_tokens,
                eos_token_ids=eos_ids, shared=shared, cached=self.target.length, streams=streams,
                temperature=self.temperature, previous=previous,
            )
            chains = self._draft(state)
            if chains.decision is not None:
                drafting.update(chains.decision)
            if chains.target_alone:
                drafting.update(path="target alone", drafted_rounds=len(history))
                started = time.perf_counter()
                self._decode_alone(tokens, prompt_len, lengths, finished, kernel, eos_ids, target_nfe)
                seconds["target_alone"] += time.perf_counter() - started
                break
            layout = hooks.build_mask(self.pm, state, chains)
            started = time.perf_counter()
            outputs = self.target.forward(layout.input_ids, layout.slot_mask)
            seconds["target_forward"] += time.perf_counter() - started
            logits = chain_logits(outputs, layout, chains.longest or 0)
            verdict = hooks.verify(self.pm, state, chains, logits, kernel)
            active = state.active
            if streams is not None:
                streams.advance(active)
            accepted = torch.where(active, verdict.accepted, 0)
            self._append(tokens, lengths, finished, chains, accepted, verdict.token, active, eos_ids)
            target_nfe += active.long()
            if chains.drafter_nfe is not None:
                drafter_nfe += chains.drafter_nfe
            drafter_forwards += chains.drafter_forwards
            for part, value in chains.seconds.items():
                seconds[part] += value
            history.append((accepted, torch.where(active, chains.length, 0), active))
            remaining = torch.where(finished, self.max_new_tokens, lengths)
            status = torch.stack([finished.all().long(), remaining.min()]).tolist()
            if status[0]:
                break
            shared = prompt_len + int(status[1])
            self.target.crop(shared - 1)
            previous = chains
        self.target.release()
        seconds.update(self.timer.seconds)
        return self._result(
            tokens, prompt_len, lengths, target_nfe, drafter_nfe, drafter_forwards, history,
            dict(seconds), start_time, drafting,
        )

    def _draft(self, state: ChainState) -> DraftChains:
        """Draft and prune until no row is open; the chains with ``span`` and ``longest``."""
        uncached = uncached_tokens(state)
        chains = hooks.draft(self.pm, state)
        if chains.target_alone:
            return chains
        while True:
            chains = hooks.prune(self.pm, chains, self.draft_budget)
            proposed = torch.where(state.active, chains.length, 0)
            flags = [flag for flag, _ in chains.checks]
            values = torch.stack(
                [v.long() for v in (chains.open.any(), (uncached + proposed).max(), proposed.max(), *flags)]
            ).tolist()
            for (_, error), raised in zip(chains.checks, values[3:]):
                if raised:
                    raise error
            if not values[0]:
                return dataclasses.replace(chains, checks=(), span=values[1], longest=values[2])
            chains = hooks.draft(self.pm, dataclasses.replace(state, draft=chains))

    @torch.inference_mode()
    def _decode_alone(
        self, tokens: torch.Tensor, prompt_len: int, lengths: torch.Tensor, finished: torch.Tensor,
        kernel: TargetKernel, eos_ids: torch.Tensor, target_nfe: torch.Tensor,
    ) -> None:
        """Decode the rest of the batch with the target alone, its plain autoregressive loop:
        one cached forward per token, each unfinished row feeding its accepted tokens past the
        cache (one, unless rows accepted different numbers of drafts before: then the longer
        rows feed their extra ones again, as in a round without drafts), and the token drawn
        with the target's kernel from the last one's output, as the verification of an empty
        chain draws it (the same tokens and random draws). Updates ``tokens`` ``(B, L)``,
        ``lengths``, ``finished`` and ``target_nfe`` ``(B,)`` in place.

        Runs under ``torch.inference_mode``: nothing it makes is kept for autograd (its
        outputs are token ids written into the caller's tensors), so autograd's bookkeeping
        (version counters, view tracking) is off for every operation of the loop and the
        target's forwards.

        Host synchronisation: one per token (is every row finished, the unfinished rows'
        shortest and longest lengths), none per row.
        """
        streams = kernel.streams
        most = self.max_new_tokens
        while True:  # rows at different lengths: each feeds its columns past the shortest row's
            live = ~finished
            status = torch.stack([
                finished.all().long(), torch.where(live, lengths, most).min(), torch.where(live, lengths, 0).max(),
            ]).tolist()
            if status[0]:
                return
            first = prompt_len + status[1] - 1  # the first column the cache lacks
            if self.target.length > first:
                self.target.crop(first)
            if status[1] == status[2]:
                break
            width = status[2] - status[1] + 1
            fed = torch.where(live, prompt_len + lengths - first, 0)  # (B,) columns each row feeds
            slot_mask = (torch.arange(width, device=tokens.device) < fed.unsqueeze(1)).long()
            logits = self.target.forward(tokens[:, first : first + width] * slot_mask, slot_mask)
            last = (fed - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
            token = kernel(logits.gather(1, last))[:, 0]
            if streams is not None:
                streams.advance(live)
            column = (prompt_len + lengths).clamp(max=tokens.shape[1] - 1).unsqueeze(1)
            tokens.scatter_(1, column, torch.where(live, token, tokens.gather(1, column).squeeze(1)).unsqueeze(1))
            lengths += live
            target_nfe += live
            finished |= live & (torch.isin(token, eos_ids) | (lengths >= most))
        # every unfinished row has accepted as many tokens: one new column per forward. A
        # finished row's columns past its end are never read, so they are written freely,
        # unless a finished row is longer than the others (it accepted more drafts)
        guard = bool((finished & (lengths > status[1])).any())
        column, entry, ended = first + 1, lengths.clone(), int(finished.sum())
        live = ~finished
        slot_mask = live.long().unsqueeze(1)
        token = tokens[:, first:column]
        while column < prompt_len + most:
            token = kernel(self.target.forward(token, slot_mask))  # (B, 1)
            if streams is not None:
                streams.advance(live)
            written = tokens[:, column : column + 1]
            written.copy_(torch.where(live.unsqueeze(1), token, written) if guard else token)
            lengths += live
            finished |= torch.isin(token[:, 0], eos_ids)
            column += 1
            now = int(finished.sum())
            if now == finished.shape[0]:
                break
            if now != ended:
                ended, live = now, ~finished
                slot_mask = live.long().unsqueeze(1)
        else:
            finished.fill_(True)
        target_nfe += lengths - entry

    def _append(
        self, tokens: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor,
        chains: DraftChains, accepted: torch.Tensor, token: torch.Tensor, active: torch.Tensor,
        eos_ids: torch.Tensor,
    ) -> None:
        """Write each active row's accepted chain tokens and the target's token after them
        into ``tokens``; update ``lengths`` and ``finished`` in place (an EOS among the new
        tokens ends a row there; so does reaching ``max_new_tokens``)."""
        prompt_len = tokens.shape[1] - self.max_new_tokens
        index = torch.arange(self.max_new_tokens, device=tokens.device)
        offset = index.unsqueeze(0) - lengths.unsqueeze(1)  # (B, G) position after the accepted tokens
        chain = chains.tokens.gather(1, offset.clamp(0, chains.tokens.shape[1] - 1))
        new = torch.where(offset < accepted.unsqueeze(1), chain, token.unsqueeze(1))
        write = active.unsqueeze(1) & (offset >= 0) & (offset <= accepted.unsqueeze(1))
        generated = tokens[:, prompt_len:]
        generated.copy_(torch.where(write, new, generated))
        new_len = torch.where(active, torch.clamp(lengths + accepted + 1, max=self.max_new_tokens), lengths)
        fresh = (index >= lengths.unsqueeze(1)) & (index < new_len.unsqueeze(1))
        eos_at = torch.where(fresh & torch.isin(generated, eos_ids), index, self.max_new_tokens).amin(-1)
        ended = eos_at < self.max_new_tokens
        new_len = torch.where(ended, eos_at + 1, new_len)
        finished |= ended | (new_len >= self.max_new_tokens)
        lengths.copy_(new_len)

    def _result(
        self, tokens, prompt_len, lengths, target_nfe, drafter_nfe, drafter_forwards, history,
        seconds, start_time, drafting,
    ) -> ARTargetResult:
        index = torch.arange(self.max_new_tokens, device=tokens.device)
        generated = torch.where(index < lengths.unsqueeze(1), tokens[:, prompt_len:], self.model.pad_token_id)
        empty: list[list[int]] = [[] for _ in range(tokens.shape[0])]
        accepted, proposed, active = (
            torch.stack([h[i] for h in history], 1).tolist() if history else empty for i in range(3)
        )
        token_lists, texts = token_lists_and_texts(self.model, generated, lengths)
        result = ARTargetResult(
            sequences=torch.cat([tokens[:, :prompt_len], generated], dim=1),
            generated=generated,
            generated_lengths=lengths.clone(),
            nfe=target_nfe,
            forwards=self.target.forwards,
            wall_seconds=time.perf_counter() - start_time,
            hook_seconds=seconds,
            config=self.config,
            texts=texts,
            token_lists=token_lists,
            verifications=sum(map(sum, active)),
            accepted_drafts=sum(a for row, live in zip(accepted, active) for a, on in zip(row, live) if on),
            layout_exact=True,  # one causal forward over the chain: the target's exact distributions
            drafter_nfe=drafter_nfe,
            drafter_forwards=drafter_forwards,
            accepted=[[a for a, on in zip(row, live) if on] for row, live in zip(accepted, active)],
            proposed=[[k for k, on in zip(row, live) if on] for row, live in zip(proposed, active)],
            drafting=drafting,
        )
        totals = self._totals
        totals["rows"] += len(token_lists)
        totals["generated_tokens"] += sum(map(len, token_lists))
        totals["target_nfe"] += int(target_nfe.sum())
        totals["drafter_nfe"] += int(drafter_nfe.sum())
        totals["target_forwards"] += result.forwards
        totals["drafter_forwards"] += drafter_forwards
        totals["histogram"].update(a for row in result.accepted for a in row)
        return result


def load_ar_target_decoder(
    target: str | ModelAdapter,
    drafter: str | ModelAdapter | None,
    strategy: StrategySpec,
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
) -> ARTargetDecoder:
    """Load ``target`` (an AR model) and ``drafter`` (a dLLM, or ``None``) by zoo name or
    directory and build an :class:`ARTargetDecoder`, taking the diffusion decoder's setting
    names (what ``dloom generate`` passes): ``gen_length`` is ``max_new_tokens``, ``cache``
    the ``drafter_cache``, ``mask_token_id`` the drafter's; ``settings`` (``temperature``,
    ``remasking``, ``seed``, ``draft_budget``) go to the decoder as they are.

    :raises ConfigurationError: for ``block_length`` or ``steps`` (they are a diffusion
        decoder's; a dLLM drafter's own settings are strategy parameters).
    """
    from dloom.model.adapter import load_model

    check_lengths(gen_length=gen_length)
    name = strategy if isinstance(strategy, str) else "an ar-target strategy"
    if block_length is not None or steps is not None:
        raise ConfigurationError(
            f"block_length {block_length} / steps {steps} do not apply to {name}; they are "
            "settings of diffusion decoding (a dLLM drafter takes its own as --param NAME=VALUE)"
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
    return ARTargetDecoder(
        target, strategy, drafter=drafter, params=params, max_new_tokens=gen_length,
        drafter_cache=cache, **settings,
    )
