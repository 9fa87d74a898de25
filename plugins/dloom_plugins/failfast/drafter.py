"""FailFast's drafter (``dloom_draft``): a dLLM denoising small blocks after each row's
accepted tokens, one step of the drafter's own diffusion decoder
(:class:`dloom.DiffusionDecoder` over the drafter composition, block length
``small_block``) per call.

A step is the engine's: a plain step (one forward of the canvas, then the engine's kernel
step, :class:`dloom.decode.kernel.KernelStep`, with the drafter's commit rule), or, for a
drafter composition that speculates (``spiffy+threshold``), the engine's speculative step
(:class:`dloom.decode.step.SpeculativeStepper`: the composition's draft, prune,
build_mask and verify over every row's small block, one verification forward, the kernel
followed along the drafts). So a speculating drafter commits what its base commit rule
commits, in fewer drafter forwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dloom.sdk import (
    BlockForward,
    ChainState,
    DraftChains,
    ForwardPlan,
    HookContractError,
    KernelStep,
    NonFiniteLogitsError,
    RowStreams,
    StepInput,
    padding_or_none,
    position_ids_from_mask,
    without_mask,
)

if TYPE_CHECKING:
    from dloom.sdk import DiffusionDecoder


class DrafterKernel(KernelStep):
    """The drafter decoder's kernel step, recording what FailFast reads of each commit.

    :param decoder: the drafter's :class:`~dloom.DiffusionDecoder` (commit rule, temperature,
        remasking, mask id, steps per block).
    :param streams: the rows' random streams (:class:`~dloom.decode.kernel.RowStreams`) or ``None``.
    :param eos_ids: ``(E,)`` long, the target's end tokens (a block holding one with nothing
        masked before it takes no more steps: the length policy has closed that row).
    :param rows: ``B``.
    :param keep_probs: also record the tempered distributions (ratio verification).

    :ivar committed: ``(B, K)`` bool, positions committed since :meth:`clear`.
    :ivar probability: ``(B, K)`` float64, the committed token's probability under the
        drafter's softmax (mask excluded) at those positions: FailFast's confidence.
    :ivar distribution: ``(B, K, V)`` float64, ``softmax(logits / T)`` the committed token
        was sampled from (``None`` without ``keep_probs``).
    """

    def __init__(
        self, decoder: DiffusionDecoder, streams: RowStreams | None, eos_ids: torch.Tensor,
        rows: int, keep_probs: bool,
    ) -> None:
        blocks = decoder.gen_length // decoder.block_length
        masked = torch.full((rows,), decoder.block_length, dtype=torch.long, device=eos_ids.device)
        super().__init__(
            decoder.pm, decoder.temperature, decoder.remasking, streams, decoder.mask_token_id,
            eos_ids, decoder.steps // blocks, masked,
        )
        self.keep_probs = keep_probs
        self.distribution: torch.Tensor | None = None
        self.clear(rows, decoder.block_length)

    def clear(self, rows: int, width: int) -> None:
        """Forget the recorded commits (before each drafter step)."""
        device = self.masked_at_start.device
        self.committed = torch.zeros(rows, width, dtype=torch.bool, device=device)
        self.probability = torch.zeros(rows, width, dtype=torch.float64, device=device)
        self.distribution = None

    def __call__(self, block: torch.Tensor, logits: torch.Tensor, advance: torch.Tensor) -> torch.Tensor:
        new = super().__call__(block, logits, advance)
        fresh = new != block  # committed now (a candidate is never the mask)
        logits64 = without_mask(logits, self.mask_token_id)
        chosen = torch.softmax(logits64, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        self.probability = torch.where(fresh, chosen, self.probability)
        self.committed = self.committed | fresh
        if self.keep_probs:
            tempered = torch.softmax(logits64 / self.temperature, dim=-1)
            old = torch.zeros_like(tempered) if self.distribution is None else self.distribution
            self.distribution = torch.where(fresh.unsqueeze(-1), tempered, old)
        return new


class DraftingRound:
    """One generation's drafter: its canvas, forwards, kernel and the current round's progress.

    The canvas ``(B, W)`` holds, per row, the prompt, the row's accepted tokens, then masks.
    A round denoises each drafting row's masks after its accepted tokens in small blocks
    of ``K = decoder.block_length`` positions, left to right: the block of a row starts at
    its first draft column and moves on by ``K`` once it holds no mask (kept inside the
    canvas: near the end it starts at ``W - K``, where the columns before the row's draft are
    already final). Each :meth:`step` is one step of the drafter decoder on every drafting
    row's block (one drafter forward), recording each committed token's probability.

    :param decoder: the drafter's :class:`~dloom.DiffusionDecoder`.
    :param state: the generation's first :class:`~dloom.types.ChainState`.
    :param mode: the drafter's cache policy (``drafter_cache``), that of its
        :class:`~dloom.model.runner.BlockForward`: one that records nothing (``"none"``)
        recomputes the canvas at every forward; one that records (``"prefix"``) keeps the
        keys and values of the columns every row has accepted, settled at each round's
        start (:meth:`~dloom.model.runner.BlockForward.settle`), and recomputes the columns
        after them. A bidirectional drafter's kept keys are stale (computed when later
        columns held other tokens): drafts differ slightly from uncached ones, the output
        does not (the target decides every token).
    :param keep_probs: record the drafter's tempered distributions (ratio verification).

    :raises HookContractError: for a recording cache under a drafter composition that asks
        for next-block logits (``first_forward`` on), which a settled forward computes none of.
    """

    def __init__(self, decoder: DiffusionDecoder, state: ChainState, mode: str, keep_probs: bool) -> None:
        self.decoder = decoder
        self.mask_id = decoder.mask_token_id
        self.block_length = decoder.block_length
        self.speculates = decoder.composition.provider("dloom_draft") is not None
        mask = state.attention_mask
        padding, positions = padding_or_none(mask), position_ids_from_mask(mask)
        self.forward = BlockForward(decoder.model, mode, padding, positions, state.prompt_length, self.block_length)
        self.settles = self.forward.policy.records
        primed = [c.name for c in decoder.composition.components if c.params.get("first_forward") is True]
        if self.settles and primed:
            raise HookContractError(
                f"the FailFast drafter's cache {mode!r} computes no next-block logits, which "
                f"{primed[0]!r} asks for; pass drafter_params '{primed[0]}.first_forward=false' "
                "(the default) or drafter_cache 'none'"
            )
        rows, width = state.tokens.shape
        self.kernel = DrafterKernel(decoder, state.streams, state.eos_token_ids, rows, keep_probs)
        self.keep_probs = keep_probs
        self.canvas = state.tokens.clone()
        self.plan = ForwardPlan(0, 0, width - self.block_length)  # every column's logits (no cache plan)

    def start(self, state: ChainState) -> None:
        """Start a round: masks after every active row's accepted tokens, each row's block at
        its first draft column, no previous distribution."""
        canvas, width = self.canvas, self.canvas.shape[1]
        self.stable = stable = state.shared  # first column that may change in any row
        self.first = state.prompt_length + state.lengths  # (B,) first draft column
        columns = torch.arange(width, device=canvas.device)
        ahead = (columns >= self.first.unsqueeze(1)) & state.active.unsqueeze(1)
        canvas[:, stable:] = torch.where(ahead, self.mask_id, state.tokens)[:, stable:]
        canvas[:, :stable] = state.tokens[:, :stable]  # the newly accepted columns
        self.forward.start = torch.clamp(self.first, max=width - self.block_length)
        if self.settles:
            self.forward.settle(stable)
        everyone = torch.ones_like(state.active)
        self.kernel.start_block(everyone, canvas.gather(1, self.forward.block_columns))
        self.previous: torch.Tensor | None = None  # (B, K, V), the last step's distribution
        self.known = torch.zeros_like(state.active)
        self.probability = torch.zeros(canvas.shape, dtype=torch.float64, device=canvas.device)
        self.draft_probs: torch.Tensor | None = None
        self.room = state.room
        self.nfe = torch.zeros_like(state.lengths)
        self.forwards = 0
        timer = self.decoder.timer.seconds
        self._since = {"drafter_forward": self.decoder.forward_seconds, **{k: timer[k] for k in self._hooks()}}

    def _hooks(self) -> tuple[str, ...]:
        return ("select_commit", "draft", "prune", "build_mask", "verify") if self.speculates else ("select_commit",)

    def step(self, state: ChainState, drafting: torch.Tensor) -> DraftChains:
        """One drafter step for the rows ``drafting`` (``(B,)`` bool): the engine's speculative
        step once a distribution is known (speculating drafter), else a plain one."""
        canvas, forward, kernel = self.canvas, self.forward, self.kernel
        columns = forward.block_columns
        block = canvas.gather(1, columns)
        # a block near the canvas's end starts before the row's draft: only draft columns
        # may be committed (an accepted token may be the drafter's mask id)
        draft_columns = columns >= self.first.unsqueeze(1)
        kernel.restrict(draft_columns)
        streams = state.streams
        if isinstance(streams, RowStreams):  # draws keyed to each row's own draft positions
            streams.offset = forward.start - self.first
        kernel.clear(*block.shape)
        speculative = self.decoder.speculative_step if self.previous is not None else None
        stepper = speculative or self.decoder.plain_step
        outcome = stepper(StepInput(
            canvas, state.attention_mask, block, drafting, self.known, self.previous, forward, kernel, self.plan,
        ))
        new_block, self.previous = outcome.block, outcome.logits
        if isinstance(streams, RowStreams):
            streams.offset = None
        canvas.scatter_(1, columns, new_block)
        self._record(columns)
        width = canvas.shape[1]
        moving = ~((new_block == self.mask_id) & draft_columns).any(-1) & drafting
        forward.advance(moving)
        forward.start = torch.clamp(forward.start, max=width - self.block_length)
        kernel.start_block(moving, canvas.gather(1, forward.block_columns))
        self.known = drafting & ~moving
        self.nfe += drafting.long()
        self.forwards += 1
        name = self.decoder.model.name
        checks = (
            (kernel.non_finite, NonFiniteLogitsError(
                f"drafter {name!r} returned NaN or inf logits; try dtype='float32'")),
            (kernel.idle, HookContractError(
                f"drafter commit rule {self.decoder.composition.provider('dloom_select_commit')!r} "
                "committed no position in a row that had masked positions")),
        )
        return self._chains(state, drafting, checks)

    def _record(self, columns: torch.Tensor) -> None:
        """Keep the probabilities (and distributions) of the step's commits by canvas column."""
        kernel = self.kernel
        old = self.probability.gather(1, columns)
        self.probability.scatter_(1, columns, torch.where(kernel.committed, kernel.probability, old))
        if kernel.distribution is not None:
            if self.draft_probs is None:
                shape = (*self.canvas.shape, kernel.distribution.shape[-1])
                self.draft_probs = torch.zeros(shape, dtype=torch.float64, device=self.canvas.device)
            index = columns.unsqueeze(-1).expand(-1, -1, kernel.distribution.shape[-1])
            kept = torch.where(kernel.committed.unsqueeze(-1), kernel.distribution, self.draft_probs.gather(1, index))
            self.draft_probs.scatter_(1, index, kept)

    def _seconds(self) -> dict[str, float]:
        """The drafter's forward and hook seconds this round (hooks as ``drafter_<hook>``,
        the commit rule as ``select_commit``)."""
        timer = self.decoder.timer.seconds
        forward = self.decoder.forward_seconds - self._since["drafter_forward"]
        hooks = {
            ("select_commit" if k == "select_commit" else f"drafter_{k}"): timer[k] - self._since[k]
            for k in self._hooks()
        }
        return {"drafter_forward": forward, **hooks}

    def _chains(self, state: ChainState, drafting: torch.Tensor, checks) -> DraftChains:
        """The round's chains so far, aligned to each row's draft positions."""
        canvas, mask_id = self.canvas, self.mask_id
        width = canvas.shape[1]
        length = width - self.stable  # the most draft positions any row has
        position = torch.arange(length, device=canvas.device)
        index = self.first.unsqueeze(1) + position  # canvas column of draft position i
        inside = index < width
        index = index.clamp(max=width - 1)
        tokens = canvas.gather(1, index)
        masked = (tokens == mask_id) | ~inside
        drafted = torch.minimum(torch.where(masked, position, length).amin(-1), self.room)
        committed = position.unsqueeze(0) < drafted.unsqueeze(1)
        eos = torch.where(committed & torch.isin(tokens, state.eos_token_ids), position, length).amin(-1)
        limit = torch.minimum(self.room, eos + 1)
        drafted = torch.where(state.active, drafted, 0)
        limit = torch.where(state.active, limit, 0)
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs.gather(1, index.unsqueeze(-1).expand(-1, -1, self.draft_probs.shape[-1]))
        return DraftChains(
            tokens=tokens, length=torch.minimum(drafted, limit), open=drafting & (drafted < limit),
            confidence=self.probability.gather(1, index), drafted=drafted, limit=limit, probs=probs,
            left_to_right=self.block_length == 1, carry=self, drafter_forwards=self.forwards,
            drafter_nfe=self.nfe.clone(), seconds=self._seconds(), checks=checks,
        )
