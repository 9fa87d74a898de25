"""FailFast's drafter: a dLLM denoising small blocks after each row's accepted tokens, with
its prefix KV cache across rounds (``dloom_draft``)."""

from __future__ import annotations

import time

import pluggy
import torch
from transformers import DynamicCache

from dloom import hooks
from dloom.adapter import ModelAdapter, output_logits
from dloom.cache import cache_argument
from dloom.errors import HookContractError, NonFiniteLogitsError
from dloom.kernel import RowStreams, apply_commit, propose, without_mask
from dloom.metrics import HookTimer
from dloom.types import BlockSchedule, ChainState, DraftChains


class DrafterForward:
    """The drafter's logits of the canvas columns ``stable ..``, one forward per call.

    :param model: the drafter adapter (bidirectional).
    :param mode: one of :data:`dloom.ar_decoder.DRAFTER_CACHE_MODES` (``docs/strategies/failfast.md``).
    :param attention_mask: ``(B, W)`` padding mask, or ``None`` without padding.
    :param position_ids: ``(B, W)`` long.
    """

    def __init__(
        self, model: ModelAdapter, mode: str, attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
    ) -> None:
        self.model = model
        self.mode = mode
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.shift = int(model.shift_logits)
        self.cached = 0
        self._cache: DynamicCache | None = None
        # dloom_configure refuses prefix mode for a drafter whose forward takes no cache
        self._argument = cache_argument(model.model) or ""

    def __call__(self, canvas: torch.Tensor, stable: int) -> torch.Tensor:
        """One forward on ``canvas``.

        :param canvas: ``(B, W)`` long, the current canvas.
        :param stable: first column that may still change in any row (columns before it are
            every row's prompt and accepted tokens); ``prefix`` mode keeps the keys and
            values of the columns before ``stable - shift`` after this call.
        :return: ``(B, W - stable, V)`` logits, entry ``i`` the distribution of column
            ``stable + i``.
        """
        width = canvas.shape[1]
        if self.mode == "none":
            return self.model.logits(canvas, self.attention_mask, self.position_ids)[:, stable:]
        if self._cache is None:
            self._cache = DynamicCache()
        start = self.cached
        with torch.no_grad():
            out = self.model.model(
                input_ids=canvas[:, start:], attention_mask=self.attention_mask,
                position_ids=self.position_ids[:, start:], use_cache=True,
                **{self._argument: self._cache},
            )
        raw = output_logits(out)
        keep = max(start, stable - self.shift)
        self._cache.crop(keep - width)
        self.cached = keep
        first = stable - self.shift - start
        return raw[:, first : first + width - stable]


class DraftingRound:
    """One generation's drafter: its canvas, its KV cache and the current round's progress.

    The canvas holds, per row, the prompt, the row's accepted tokens, then masks. A round
    denoises each drafting row's masks after its accepted tokens in small blocks of
    ``small_block`` positions, left to right, one drafter forward and one commit of the
    commit rule per :meth:`step`, recording each committed token's probability.

    :param drafter: the drafter's adapter. :param pm: the plugin manager of its commit rule.
    :param timer: that manager's :class:`~dloom.metrics.HookTimer` (the commit rule's time).
    :param rule: the commit rule's name (for messages).
    :param state: the generation's first :class:`~dloom.types.ChainState`.
    :param mode: the drafter's cache mode. :param small_block: positions per small block.
    :param remasking: the commit rule's confidence kind.
    :param keep_probs: record the drafter's tempered distributions (ratio verification).
    """

    def __init__(
        self, drafter: ModelAdapter, pm: pluggy.PluginManager, timer: HookTimer, rule: str,
        state: ChainState, mode: str, small_block: int, remasking: str, keep_probs: bool,
        mask_id: int,
    ) -> None:
        self.drafter, self.pm, self.timer, self.rule = drafter, pm, timer, rule
        self.mask_id = mask_id  # the drafter's mask token
        self.small_block, self.remasking, self.keep_probs = small_block, remasking, keep_probs
        mask = state.attention_mask
        padded = bool((mask == 0).any())
        self.forward = DrafterForward(drafter, mode, mask if padded else None, torch.clamp(mask.cumsum(-1) - 1, min=0))
        self.canvas = state.tokens.clone()

    def start(self, state: ChainState) -> None:
        """Start a round: masks after every active row's accepted tokens."""
        mask_id = self.mask_id
        self.stable = state.shared  # first column that may change in any row
        self.canvas[:, : self.stable] = state.tokens[:, : self.stable]  # the newly accepted columns
        width = self.canvas.shape[1]
        self.first = state.prompt_length + state.lengths  # (B,) first draft column
        columns = torch.arange(self.stable, width, device=self.canvas.device)
        self.offset = columns.unsqueeze(0) - self.first.unsqueeze(1)  # (B, T) position in the draft
        ahead = (self.offset >= 0) & state.active.unsqueeze(1)
        self.tail = torch.where(ahead, mask_id, state.tokens[:, self.stable :])
        self.block_start = torch.zeros_like(state.lengths)  # draft position of each row's small block
        self.probability = torch.zeros(self.tail.shape, dtype=torch.float64, device=self.canvas.device)
        self.draft_probs: torch.Tensor | None = None
        self.room = state.room
        self.nfe = torch.zeros_like(state.lengths)
        self.forwards = 0
        self.seconds = {"drafter_forward": 0.0, "select_commit": 0.0}
        batch = state.lengths.shape[0]
        ones = torch.ones(batch, dtype=torch.long, device=self.canvas.device)
        # every step commits within the current small block: a quota rule commits one position
        self.schedule = BlockSchedule(torch.zeros_like(ones), 1, ones)

    def step(self, state: ChainState, drafting: torch.Tensor) -> DraftChains:
        """One drafter forward and commit for the rows ``drafting`` (``(B,)`` bool)."""
        mask_id, stable = self.mask_id, self.stable
        self.canvas[:, stable:] = self.tail
        started = time.perf_counter()
        logits = self.forward(self.canvas, stable)
        self.seconds["drafter_forward"] += time.perf_counter() - started
        self.nfe += drafting.long()
        self.forwards += 1
        offset, tail = self.offset, self.tail
        end = self.block_start + self.small_block
        in_block = (offset >= self.block_start.unsqueeze(1)) & (offset < end.unsqueeze(1))
        selectable = (tail == mask_id) & in_block & drafting.unsqueeze(1)
        streams = state.streams
        if isinstance(streams, RowStreams):  # draws keyed to each row's own draft positions
            streams.offset = stable - self.first
        candidates, confidence = propose(logits, state.temperature, self.remasking, streams, mask_id)
        if isinstance(streams, RowStreams):
            streams.advance(drafting)
            streams.offset = None
        before = self.timer.seconds["select_commit"]
        commit = hooks.select_commit(self.pm, confidence, selectable, self.schedule)
        self.seconds["select_commit"] += self.timer.seconds["select_commit"] - before
        self.tail = tail = apply_commit(tail, candidates, commit)
        logits64 = without_mask(logits, mask_id)
        token_probability = torch.softmax(logits64, dim=-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
        self.probability = torch.where(commit, token_probability, self.probability)
        if self.keep_probs:
            tempered = torch.softmax(logits64 / state.temperature, dim=-1)
            self.draft_probs = (
                tempered if self.draft_probs is None else torch.where(commit.unsqueeze(-1), tempered, self.draft_probs)
            )
        still_masked = ((tail == mask_id) & in_block).any(-1)
        self.block_start = torch.where(still_masked, self.block_start, end)
        idle = (selectable.any(-1) & ~commit.any(-1)).any()
        checks = (
            (~torch.isfinite(logits).all(), NonFiniteLogitsError(
                f"drafter {self.drafter.name!r} returned NaN or inf logits; try dtype='float32'")),
            (idle, HookContractError(
                f"drafter commit rule {self.rule!r} committed no position in a row that had masked positions")),
        )
        return self._chains(state, drafting, checks)

    def _chains(self, state: ChainState, drafting: torch.Tensor, checks) -> DraftChains:
        """The round's chains so far, aligned to each row's draft positions."""
        mask_id = self.mask_id
        width = self.tail.shape[1]
        position = torch.arange(width, device=self.tail.device)
        index = (self.first - self.stable).unsqueeze(1) + position  # tail column of draft position i
        inside = (index >= 0) & (index < width)  # finished rows may lie before the tail
        index = index.clamp(0, width - 1)
        tokens = self.tail.gather(1, index)
        masked = (tokens == mask_id) | ~inside
        drafted = torch.minimum(torch.where(masked, position, width).amin(-1), self.room)
        committed = position.unsqueeze(0) < drafted.unsqueeze(1)
        eos = torch.where(committed & torch.isin(tokens, state.eos_token_ids), position, width).amin(-1)
        limit = torch.minimum(self.room, eos + 1)
        drafted = torch.where(state.active, drafted, 0)
        limit = torch.where(state.active, limit, 0)
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs.gather(1, index.unsqueeze(-1).expand(-1, -1, self.draft_probs.shape[-1]))
        return DraftChains(
            tokens=tokens, length=torch.minimum(drafted, limit), open=drafting & (drafted < limit),
            confidence=self.probability.gather(1, index), drafted=drafted, limit=limit, probs=probs,
            left_to_right=self.small_block == 1, carry=self, drafter_forwards=self.forwards,
            drafter_nfe=self.nfe.clone(), seconds=dict(self.seconds), checks=checks,
        )
