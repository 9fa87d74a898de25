"""A running batch of the diffusion decoder: rows join between forwards, and leave when they
finish or are cancelled (continuous batching at block boundaries).

:class:`DecodeSession` holds the state of a batch that :class:`~dloom.DiffusionDecoder`
decodes; :meth:`DiffusionDecoder.generate <dloom.DiffusionDecoder.generate>` is one
session with every prompt admitted at once, stepped until it is empty, so there is one
decode loop. A server keeps a session per decoder settings and, between two steps,
admits waiting rows (:meth:`DecodeSession.admit`) and withdraws cancelled ones
(:meth:`DecodeSession.cancel`).

Why a row may join at any step. Rows already progress through their blocks independently
(per-row block progression): each row decodes its own active block with its own step count,
cache state and random stream, and leaves the batch as soon as it has finished. A joining
row starts at its own first block boundary: its first forward is a full one (with a cache,
it records the row's keys and values: the prefill), its kernel counters and its random
stream start at zero. Nothing of it reaches the other rows: attention never crosses rows,
and padding columns are masked out. So, under greedy decoding, every row's tokens and NFE
are those of decoding its prompt alone (batch invariance, as for rows of one ``generate``
call), and a sampling row with its stream index draws what ``generate`` of its own request
draws, whenever it joined. This holds for every commit rule, for the cache modes ``none``,
``prefix`` and ``dual``, and for speculative strategies (Spiffy): a joining row has no
previous distribution, so it is not drafted for until its first step (the rule of a row at
a block start).

A block's first forward. A row whose verification completed its block in a drafted state
evaluated with the next block's logits (:class:`~dloom.types.Verdict`'s ``primed``: Spiffy
without a cache) moves on *primed*: its next block's first kernel step samples from those
logits, the very distribution the reference's first forward on that block gives, without a
forward; the step's forward then serves the state after it. Such a step counts one NFE,
and the used draft one accepted draft. Likewise, without a cache, a row whose plain step
settled its block with a post step that changed nothing (an editing rule on the revisable
kernel, :meth:`~dloom.decode.transition.TransitionKernel.unchanged_post_steps`) moves on
primed: that step's forward ran on the very tokens the next block's first forward would
run on, and read the next block's logits too (:attr:`~dloom.decode.step.StepInput.next_block`,
asked for only on steps where some row's block may hold no mask). A row whose edit budget
ran out on a post step that changed its block is not primed (its tokens are no longer
those the forward read). With a cache that records, or with static shapes, no plain step
primes a row.

Widths. All rows share one sequence width ``L = P + G`` (``P`` prompt columns, left-padded;
``G`` the generated region). A joining prompt longer than ``P`` widens the batch: every row
gets padding columns on the left, and its recorded keys and values move with it
(:meth:`dloom.model.runner.BlockForward.join`); position ids ignore left padding, so no row's
forward changes. When the batch empties, the next admission starts at its own width.

Host synchronisation: one per step, as in ``generate`` (the step's status read), one more
(the plan of the next forward) after an admission or a cancellation, and one per
admission (whether any row is padded) and per cancellation (how many rows it removes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pluggy
import torch

from dloom.decode.edit_ledger import EditLedger
from dloom.decode.generation import Prompts, row_streams
from dloom.decode.host_read import read_on_host
from dloom.decode.kernel import RowStreams, eos_clear
from dloom.decode.logprobs import CommitLogprobs, RowLogprobs
from dloom.decode.prompts import check_prompts
from dloom.decode.step import ForwardPlan, StepInput, StepOutcome, Stepper
from dloom.decode.transition import TransitionKernel, kernel_class
from dloom.decode.uniform import UniformKernel
from dloom.errors import ConfigurationError, ModelError
from dloom.metrics import ForwardClock, speculation_summary
from dloom.model.adapter import ModelAdapter, left_pad_prompts, padding_or_none
from dloom.model.attention import absolute_block_ids, block_ids
from dloom.model.canvas import CanvasForward
from dloom.model.runner import BlockForward


def finished_rows(generated: torch.Tensor, mask_token_id: int, eos_ids: torch.Tensor) -> torch.Tensor:
    """Rows whose output is final: an EOS with nothing masked before it, or nothing masked.

    :param generated: ``(B, G)`` long, the generated region.
    :param eos_ids: ``(E,)`` long.
    :return: ``(B,)`` bool.
    """
    return eos_clear(generated, mask_token_id, eos_ids) | ~(generated == mask_token_id).any(-1)


def generated_lengths(generated: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """``(B,)`` tokens up to and including the first EOS (``G`` when there is none)."""
    is_eos = torch.isin(generated, eos_ids)
    width = generated.shape[1]
    index = torch.arange(width, device=generated.device).expand_as(generated)
    first = torch.where(is_eos, index, torch.full_like(index, width)).min(-1).values
    return torch.clamp(first + 1, max=width)


@dataclass(frozen=True)
class StepRecord:
    """One plain step of the reference process, as an observer of
    ``generate`` (or a :class:`DecodeSession`) sees it (``B`` rows of the block, ``K``, ``V``).

    :ivar block: ``(B,)`` long, each row's block index (rows progress independently).
    :ivar rows: ``(B,)`` long, the rows' ids (for ``generate``: their indices in the batch).
    :ivar before: ``(B, K)`` long, the block before the step.
    :ivar logits: ``(B, K, V)``, the distribution the step sampled from.
    :ivar after: ``(B, K)`` long, the block after it.
    """

    block: torch.Tensor
    rows: torch.Tensor
    before: torch.Tensor
    logits: torch.Tensor
    after: torch.Tensor


@dataclass(frozen=True)
class BlockRecord:
    """Blocks that rows finished in one step, as the ``on_block`` callback of
    ``generate`` (or a :class:`DecodeSession`) sees them (``B`` rows, ``K = block_length``). Rows
    advance through their blocks independently, so each row names its own block.

    :ivar blocks: ``(B,)`` long, each row's finished block (its index among that row's
        blocks, from 0).
    :ivar rows: ``(B,)`` long, the rows' ids (for ``generate``: their indices in the batch).
    :ivar tokens: ``(B, K)`` long, the blocks' final tokens (a later step never changes
        them; positions after a row's EOS may stay masked).
    :ivar generated: ``(B, K)`` bool, which of those positions are generated ones (with
        ``block_alignment="absolute"`` a row's first block also holds the prompt's tail, and
        its last one may run into padding).
    """

    blocks: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor
    generated: torch.Tensor


@dataclass(frozen=True)
class FinishedRows:
    """Rows that left the batch in one step, their outputs final (``R`` rows).

    :ivar rows: ``(R,)`` long, the rows' ids (as :meth:`DecodeSession.admit` returned them).
    :ivar sequences: ``(R, L)`` long, prompt (left-padded to the batch's width) and
        generated region as decoded; positions a finished row never needed stay masked.
    :ivar prompt_width: ``P``, the prompt columns of ``sequences``.
    :ivar lengths: ``(R,)`` long, generated tokens up to and including the first EOS (the
        whole region when there is none).
    :ivar nfe: ``(R,)`` long, forwards in which each row was decoding.
    :ivar logprobs: the rows' commit-time log-probabilities, columns as ``sequences``
        (``None`` unless the session records them).
    :ivar edits: ``(R,)`` long, the edits each row took (:class:`~dloom.decode.edit_ledger.EditLedger`);
        ``None`` on a kernel that does not edit.
    :ivar drafts: ``(R, L)`` long, ``sequences`` with each generated position's first filled
        token (``None`` likewise).
    :ivar draft_lengths: ``(R,)`` long, ``drafts``' generated tokens up to and including their
        first EOS (``None`` likewise).
    """

    rows: torch.Tensor
    sequences: torch.Tensor
    prompt_width: int
    lengths: torch.Tensor
    nfe: torch.Tensor
    logprobs: RowLogprobs | None = None
    edits: torch.Tensor | None = None
    drafts: torch.Tensor | None = None
    draft_lengths: torch.Tensor | None = None

    @property
    def generated(self) -> torch.Tensor:
        """``(R, G)`` long, the generated region alone."""
        return self.sequences[:, self.prompt_width:]

    def token_lists(self) -> list[list[int]]:
        """Each row's generated tokens up to and including the first EOS (two host reads)."""
        lengths = self.lengths.tolist()
        return [row[:n] for row, n in zip(self.generated.tolist(), lengths)]


class _Tallies:
    """Figures of a session over all its steps."""

    def __init__(self, speculative: bool) -> None:
        self.forwards = 0
        self.model_calls = 0  # of the batches the session has emptied
        self.row_forwards = 0  # rows in model calls, of the batches the session has emptied
        self.verification_forwards = 0
        self.verifications = 0  # row-verifications: rows decoding in a verification forward
        self.accepted = 0  # drafts accepted, over all rows
        # whether every verification layout was exact (vacuously so before the first one);
        # None for a strategy that never speculates
        self.exact: bool | None = True if speculative else None

    def record(self, outcome: StepOutcome) -> None:
        """Count what a step did (its verification, if it verified)."""
        if outcome.verified:
            assert self.exact is not None, "a verification in a run without a draft hook"
            self.exact = self.exact and outcome.layout_exact
            self.verification_forwards += 1


@dataclass(frozen=True)
class StepStatus:
    """What a step's one host synchronisation read (:meth:`DecodeSession.step`).

    :ivar non_finite: some stepping row's logits held NaN or inf.
    :ivar idle: the kernel's idle code: 0, or why some row that could step committed nothing
        (:data:`dloom.decode.kernel.IDLE`, :data:`dloom.decode.kernel.IDLE_DECODED`).
    :ivar leaving: rows that finished in the step.
    :ivar plan: the next forward's plan, over the rows that stay.
    :ivar can_draft: some staying row's last distribution is known (a draft may start).
    :ivar accepted: drafts accepted over all rows (0 when the step verified nothing).
    :ivar verifications: rows decoding in the step's verification (0 without one).
    :ivar primed: some staying row moves on primed (:class:`~dloom.types.Verdict`, or a
        plain step that settled its block unchanged).
    :ivar post_next: some staying row's block holds no mask, or the row is primed (its next
        step may be a post step: the next plain forward reads the next block's logits too).
    :ivar blocks_done: rows that finished a block (0 unless an ``on_block`` callback is set).
    """

    non_finite: bool
    idle: int
    leaving: int
    plan: ForwardPlan
    can_draft: bool
    accepted: int = 0
    verifications: int = 0
    primed: bool = False
    post_next: bool = False
    blocks_done: int = 0

    @classmethod
    def read(cls, values: dict[str, torch.Tensor]) -> StepStatus:
        """The status of the device values named as this class's fields (``plan``: the
        ``(3,)`` plan tensor; absent optional fields keep their defaults), in one host read."""
        read = read_on_host(values)
        plan = ForwardPlan(*read.pop("plan"))
        fields: dict[str, Any] = {name: value[0] for name, value in read.items()}
        for flag in ("non_finite", "can_draft", "primed", "post_next"):
            if flag in fields:
                fields[flag] = bool(fields[flag])
        return cls(plan=plan, **fields)


@dataclass(frozen=True)
class SessionCalls:
    """What a :class:`DecodeSession` calls on its decoder, besides reading its public
    settings (:meth:`dloom.DiffusionDecoder.session_calls` hands it over, its forward clock
    and hook timer reset for the new session).

    :ivar layout: ``(prompt_ids, prompt_mask)``, ``(B, P)`` left-padded, to the sequences to
        decode ``(B, L)``, their padding mask and position ids ``(B, L)``, each row's first
        block column ``(B,)`` and the end of its generated region ``(B,)``.
    :ivar check: ``(forward, non_finite, idle, blocks)``: raises for the contract violations
        a step's synchronisation found (``blocks``: each row's block index ``(B,)``).
    :ivar clock: times the model forwards (the session reads it, never resets it).
    :ivar plain_step: one forward and one kernel step of every row
        (:class:`~dloom.decode.step.PlainStepper`).
    :ivar speculative_step: the strategy's speculative step
        (:class:`~dloom.decode.step.SpeculativeStepper`), or ``None`` for a strategy that
        never drafts, or whose speculator declined drafting under these settings.
    :ivar speculator: the strategy has a speculator (a draft hook): its results carry
        speculation figures, none of them verifications where it declined drafting.
    """

    layout: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
    check: Callable[[int, int, int, torch.Tensor], None]
    clock: ForwardClock
    plain_step: Stepper
    speculative_step: Stepper | None
    speculator: bool


class SessionDecoder(Protocol):
    """The decoder a :class:`DecodeSession` runs (:class:`dloom.DiffusionDecoder`): its
    settings, its plugin manager, and :meth:`session_calls` for the rest."""

    model: ModelAdapter
    mask_token_id: int
    gen_length: int
    block_length: int
    steps: int
    temperature: float
    remasking: str
    seed: int | None
    cache: str
    cache_refresh: int | None
    static_shapes: bool
    pm: pluggy.PluginManager
    on_proposal: Callable[[torch.Tensor, torch.Tensor], None] | None
    kernel_options: dict[str, bool]

    @property
    def name(self) -> str:
        """The strategy's name (for messages)."""
        ...

    def session_calls(self) -> SessionCalls:
        """What the session calls on the decoder (:class:`SessionCalls`)."""
        ...


class DecodeSession:
    """A running batch of ``decoder``: admit rows, step, collect finished rows.

    Not thread-safe: one thread admits, cancels and steps (a server's worker). One session
    of a decoder at a time: the decoder's hook timer and forward time are the session's.

    :param decoder: the decoder whose settings, strategy and model every row shares.
    :param observer: called after every plain step with a :class:`StepRecord`, and before
        it, for rows a plain step primed (see the module docstring), with a record of the
        primed rows' first step in their new block (taken without a forward; its rows are
        picked with one host read, only when an observer is given).
    :param on_block: called after every step in which some rows finished a block, with a
        :class:`BlockRecord` (rows named by their ids). Costs no host
        synchronisation unless given.
    :param logprobs: record each committed token's log-probability and this many
        alternatives (:mod:`dloom.decode.logprobs`; ``None``: record nothing). Tokens and
        NFE are the same either way. Not for a speculative strategy, whose verified
        tokens are committed from drafts' distributions.
    :param ignore_eos: rows do not end at an EOS: each decodes its whole generated region
        (EOS ids are committed like any token; ``lengths`` are the whole region). Up to
        and including its first EOS, a row's tokens are those of a decode without it (the
        steps before that EOS is clear are the same steps).

    :ivar on_block: the callback above; a caller may set or clear it between steps.
    :ivar ledger: the running rows' edits and drafts when the kernel edits (an editing rule on
        the revisable kernel), counted on the device at every step; else ``None``.
    :ivar size: rows in the batch now (a host int).
    :ivar forwards: steps taken (each one forward of the batch, or a verification).
    """

    def __init__(
        self,
        decoder: SessionDecoder,
        observer: Callable[[StepRecord], None] | None = None,
        on_block: Callable[[BlockRecord], None] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
    ) -> None:
        calls = decoder.session_calls()
        if logprobs is not None and calls.speculative_step is not None:
            raise ConfigurationError(
                f"strategy {decoder.name!r} speculates; commit-time log-probabilities "
                "are recorded for plain (non-speculative) strategies only"
            )
        self.logprobs = None if logprobs is None else CommitLogprobs(logprobs, decoder.mask_token_id)
        self.decoder = decoder
        self.model = decoder.model
        self.observer, self.on_block = observer, on_block
        self._mask_id = decoder.mask_token_id
        eos_ids = [] if ignore_eos else self.model.eos_token_ids
        self._eos = torch.tensor(eos_ids, dtype=torch.long, device=self.model.device)
        self._samples = decoder.temperature > 0 or decoder.remasking == "random"
        self._steps_per_block = decoder.steps // (decoder.gen_length // decoder.block_length)
        self.calls = calls
        self.tallies = _Tallies(self.calls.speculator)
        self.size = 0
        self._next_id = 0
        self._plan: ForwardPlan | None = None
        self._can_draft = False
        self._primed_any = False  # some row is primed (read at the last step's sync)
        self._primed_plain = False  # the primed rows were primed by a plain step (not a verification)
        self._post_next = False  # some row's next step may be a post step (read at the last sync)
        self._reuse = False  # plain steps may prime rows (set per batch, _start)
        self.forward: BlockForward | None = None
        self.kernel: TransitionKernel
        self.ledger: EditLedger | None = None

    @property
    def forwards(self) -> int:
        return self.tallies.forwards

    @property
    def model_calls(self) -> int:
        """Model calls over the session (a step may make two: full and cached rows)."""
        return self.tallies.model_calls + (self.forward.calls if self.forward is not None else 0)

    @property
    def row_forwards(self) -> int:
        """Rows in model calls, over the session."""
        return self.tallies.row_forwards + (self.forward.row_forwards if self.forward is not None else 0)

    @property
    def speculation(self) -> dict | None:
        """Acceptance figures so far (``None`` for a strategy that never speculates)."""
        if self.tallies.exact is None:
            return None
        return speculation_summary(self.tallies.verifications, self.tallies.accepted, self.tallies.exact)

    # --- rows in ----------------------------------------------------------------------

    def admit(
        self,
        prompts: Prompts,
        attention_mask: torch.Tensor | None = None,
        *,
        row_offset: int | Sequence[int] | torch.Tensor = 0,
    ) -> range:
        """Add rows to the batch; they take their first step in the next :meth:`step`.

        :param prompts: / :param attention_mask: as in
            :meth:`~dloom.DiffusionDecoder.generate`.
        :param row_offset: each prompt's random stream, as in ``generate``.
        :return: the new rows' ids, consecutive from 0 over the session's life (a fresh
            session's first ``B`` rows are ``0 .. B-1``).
        :raises ModelError: for empty prompts or a prompt beyond the model's context.
        :raises ConfigurationError: for a bad ``row_offset``.
        """
        decoder, model = self.decoder, self.model
        prompts = check_prompts(model, prompts, attention_mask)
        prompt_ids, prompt_mask = left_pad_prompts(model, prompts, attention_mask)
        joining, prompt_len = prompt_ids.shape
        if model.max_context is not None and prompt_len + decoder.gen_length > model.max_context:
            raise ModelError(
                f"prompt of {prompt_len} tokens + gen_length {decoder.gen_length} = "
                f"{prompt_len + decoder.gen_length} exceeds the model's context of {model.max_context} tokens"
            )
        streams = row_streams(row_offset, joining, prompt_ids.device)
        ids = torch.arange(self._next_id, self._next_id + joining, device=prompt_ids.device)
        if self.forward is None:
            self._start(prompt_ids, prompt_mask, streams, ids)
        else:
            self._join(prompt_ids, prompt_mask, streams, ids)
        self._plan = None
        self.size += joining
        self._next_id += joining
        return range(self._next_id - joining, self._next_id)

    def _block_ids(self) -> torch.Tensor | None:
        """Every position's block index for a block-causal model (:mod:`dloom.model.attention`)."""
        if self.model.attention != "block-causal":
            return None
        width = self.decoder.block_length
        if self.model.block_alignment == "absolute":
            return absolute_block_ids(self.positions, width)
        ids = block_ids(self.x.shape[1], self.width, width, self.x.device)
        return ids.expand(self.x.shape[0], -1)

    def _start(self, prompt_ids, prompt_mask, streams, ids) -> None:
        """The first rows of an empty batch."""
        decoder = self.decoder
        self.x, self.full_mask, self.positions, start, self.region_end = self.calls.layout(prompt_ids, prompt_mask)
        self.width = prompt_ids.shape[1]
        self.rows = ids
        if self.logprobs is not None:
            self.logprobs.start(self.x)
        self.block_index = torch.zeros_like(ids)
        self.nfe = torch.zeros_like(ids)
        self.known = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        # rows whose block's first distribution is known (``previous``), from the verification
        # that completed their last block: their first step takes no forward
        self.primed = torch.zeros_like(self.known)
        self.previous: torch.Tensor | None = None  # (B, K, V): each row's last step's distribution
        kernel = kernel_class(self.model)
        runner = CanvasForward if issubclass(kernel, UniformKernel) else BlockForward
        self.forward = runner(
            self.model, decoder.cache, padding_or_none(self.full_mask), self.positions, start,
            decoder.block_length, decoder.cache_refresh, self._block_ids(), self._static_width(),
        )
        generator = RowStreams(decoder.seed, streams) if self._samples or kernel.samples else None
        self.kernel = kernel(
            decoder.pm, decoder.temperature, decoder.remasking, generator, self._mask_id, self._eos,
            self._steps_per_block, self._masked(self.x, self.forward.block_columns), decoder.on_proposal,
            **decoder.kernel_options,
        )
        self.ledger = EditLedger(self.x, self._mask_id) if self.kernel.edits else None
        # a settling post step's forward gives the next block's first distribution only when
        # it is the forward the next step would run: uncached, of dynamic shapes
        self._reuse = (
            runner is BlockForward and not self.forward.policy.records
            and self.forward.static_width is None and self.kernel.unchanged_post_steps() is not None
        )
        if isinstance(self.forward, CanvasForward):  # it reads the kernel's canvases
            assert isinstance(self.kernel, UniformKernel)
            self.forward.kernel = self.kernel

    def _static_width(self) -> int | None:
        """With ``static_shapes``, the columns every window lies in: the generated region, a
        block before it when the first block may start in the prompt (absolute alignment), and
        the column before it for a shifted model; ``None`` without."""
        if not self.decoder.static_shapes:
            return None
        lead = self.decoder.block_length - 1 if self.model.block_alignment == "absolute" else 0
        return self.x.shape[1] - self.width + lead + self.model.shift

    def _masked(self, tokens: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """``(B,)`` masked positions of the blocks at ``columns`` ``(B, K)``."""
        return (torch.gather(tokens, 1, columns) == self._mask_id).sum(-1)

    def _join(self, prompt_ids, prompt_mask, streams, ids) -> None:
        """Rows joining a running batch (see the module docstring, "Widths")."""
        decoder, pad = self.decoder, self.model.pad_token_id
        widened = max(0, prompt_ids.shape[1] - self.width)
        if widened:
            self.width += widened
            self.x = _pad_left(self.x, widened, pad)
            self.full_mask = _pad_left(self.full_mask, widened, 0)
            self.positions = _pad_left(self.positions, widened, 0)
            self.region_end = self.region_end + widened
        short = self.width - prompt_ids.shape[1]
        tokens, mask, positions, start, region_end = self.calls.layout(
            _pad_left(prompt_ids, short, pad), _pad_left(prompt_mask, short, 0)
        )
        if self.logprobs is not None:
            self.logprobs.join(widened, tokens)
        if self.ledger is not None:
            self.ledger.join(widened, tokens, pad)
        self.x = torch.cat([self.x, tokens])
        self.full_mask = torch.cat([self.full_mask, mask])
        self.positions = torch.cat([self.positions, positions])
        self.region_end = torch.cat([self.region_end, region_end])
        self.rows = torch.cat([self.rows, ids])
        self.block_index = torch.cat([self.block_index, torch.zeros_like(ids)])
        self.nfe = torch.cat([self.nfe, torch.zeros_like(ids)])
        self.known = torch.cat([self.known, torch.zeros(len(ids), dtype=torch.bool, device=ids.device)])
        self.primed = torch.cat([self.primed, torch.zeros(len(ids), dtype=torch.bool, device=ids.device)])
        if self.previous is not None:
            self.previous = torch.cat([self.previous, self.previous.new_zeros(len(ids), *self.previous.shape[1:])])
        self._running_forward().join(
            padding_or_none(self.full_mask), self.positions, start, self._block_ids(), widened
        )
        columns = start.unsqueeze(1) + torch.arange(decoder.block_length, device=start.device)
        self.kernel.join(torch.gather(tokens, 1, columns), streams)

    # --- rows out ---------------------------------------------------------------------

    def cancel(self, rows: Sequence[int]) -> None:
        """Withdraw rows now, between two steps: they take no further forward and are not
        reported as finished. A row that has already finished is left as it is.

        :raises ConfigurationError: for an id this session never gave out.
        """
        unknown = [row for row in rows if not 0 <= row < self._next_id]
        if unknown:
            raise ConfigurationError(
                f"cannot cancel rows {unknown}: this session's rows are 0..{self._next_id - 1}"
            )
        if not rows or self.forward is None:
            return
        cancelled = torch.tensor(sorted(set(rows)), dtype=torch.long, device=self.rows.device)
        dropped = torch.isin(self.rows, cancelled)
        count = int(dropped.sum())
        if count == self.size:
            self._empty()
        elif count:
            self._keep(torch.argsort(dropped.long(), stable=True)[: self.size - count])
            self._plan = None

    def _running_forward(self) -> BlockForward:
        """The running batch's forward (called only while the batch holds rows)."""
        assert self.forward is not None, "no running batch"
        return self.forward

    def _keep(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order."""
        self.x, self.rows, self.known = self.x[index], self.rows[index], self.known[index]
        self.primed = self.primed[index]
        self.block_index, self.nfe = self.block_index[index], self.nfe[index]
        self.full_mask, self.positions = self.full_mask[index], self.positions[index]
        self.region_end = self.region_end[index]
        if self.logprobs is not None:
            self.logprobs.keep(index)
        if self.ledger is not None:
            self.ledger.keep(index)
        if self.previous is not None:
            self.previous = self.previous[index]
        self._running_forward().select(index)
        self.kernel.select(index)
        self.size = len(index)

    def _empty(self) -> None:
        """Drop the batch's state (the next admission starts a new batch at its own width)."""
        forward = self._running_forward()
        self.tallies.model_calls += forward.calls
        self.tallies.row_forwards += forward.row_forwards
        self.forward = None
        self.size = 0
        self._plan = None
        self._can_draft = False
        self._primed_any = False
        self._post_next = False

    # --- stepping ---------------------------------------------------------------------

    def step(self) -> FinishedRows | None:
        """One step of every row (one forward, or a verification): the rows that finished
        in it, or ``None`` when none did (or the batch is empty).

        :raises NonFiniteLogitsError: when the model returns NaN or inf.
        :raises HookContractError: when the commit rule commits nothing in a decoding row.
        """
        if self.forward is None:
            return None
        decoder, forward, kernel = self.decoder, self.forward, self.kernel
        if self._plan is None:
            self._plan = ForwardPlan(*forward.plan().tolist())
        x = self.x
        columns = forward.block_columns
        block = torch.gather(x, 1, columns)
        # aligned at position 0, a row's first block also holds the prompt's last partial block
        generated = columns >= self.width if self.model.block_alignment == "absolute" else None
        kernel.restrict(generated)
        # Every row here has a position to decode: a finished row left the batch at the end of
        # the step that finished it, and a row that moved on holds a fresh, fully masked block.
        decoding = torch.ones(len(block), dtype=torch.bool, device=block.device)
        if self._primed_any:
            # A primed row's first step in this block samples from the distribution the
            # verification that completed its last block read off the completed state (the
            # forward the reference runs here): a kernel step without a forward. The forward
            # below then serves its next state; a row with nothing left to decode sits it out.
            assert self.previous is not None
            primed_block = kernel(block, self.previous, self.primed)
            if self.ledger is not None:
                self.ledger.record(columns, block, primed_block, generated)
            if self.logprobs is not None:  # only primed rows' blocks changed
                self.logprobs.record(columns, block, self.previous, primed_block)
            if self.observer is not None and self._primed_plain:
                rows = self.primed
                self.observer(StepRecord(
                    self.block_index[rows], self.rows[rows], block[rows], self.previous[rows], primed_block[rows],
                ))
            block = primed_block
            x.scatter_(1, columns, block)
            decoding = ~self.primed | kernel.pending(block)
        speculative = self.calls.speculative_step if self._can_draft else None
        stepper = speculative or self.calls.plain_step
        outcome = stepper(StepInput(
            x, self.full_mask, block, decoding, self.known, self.previous, forward, kernel, self._plan,
            next_block=self._post_next and speculative is None,
        ))
        new_block, self.previous, accepted = outcome.block, outcome.logits, outcome.accepted
        self.tallies.record(outcome)
        if speculative is None:
            if self.logprobs is not None:
                self.logprobs.record(columns, block, outcome.logits, new_block)
            if self.observer is not None:
                self.observer(StepRecord(
                    self.block_index.clone(), self.rows.clone(), block.clone(), outcome.logits, new_block.clone(),
                ))
        x.scatter_(1, columns, new_block)
        if self.ledger is not None:
            self.ledger.record(columns, block, new_block, generated)
        self.nfe = self.nfe + decoding.long()
        # Earlier blocks are final and hold no EOS: the row's output is final exactly when
        # its block has ended it, or is complete and is its last block.
        ended, complete = kernel.settle(new_block)
        block_done = ended | complete
        finished = ended | (complete & (forward.start + decoder.block_length >= self.region_end))
        moving = block_done & ~finished
        forward.advance(moving)
        active = torch.gather(x, 1, forward.block_columns)  # (B, K): each row's block now (moved rows' next one)
        kernel.start_block(moving, active)
        done_block = self.block_index
        self.block_index = self.block_index + moving
        self.known = decoding & ~moving
        if outcome.primed is not None:  # rows moving on with their next block's first distribution
            self.primed = outcome.primed & moving
            self.known = self.known | self.primed
            assert outcome.next_logits is not None
            self.previous = torch.where(self.primed[:, None, None], outcome.next_logits, outcome.logits)
            if accepted is not None:  # the completed draft's forward is used
                accepted = accepted + self.primed.long()
            self._primed_plain = accepted is None
        elif self._primed_any:
            self.primed = torch.zeros_like(self.primed)
        values = {
            "non_finite": kernel.non_finite, "idle": kernel.idle, "leaving": finished.sum(),
            "plan": forward.plan(~finished), "can_draft": (self.known & ~finished).any(),
        }
        if accepted is not None:
            values.update(accepted=accepted.sum(), verifications=decoding.sum())
        if outcome.primed is not None:
            values["primed"] = (self.primed & ~finished).any()
        if self._reuse:  # a block with no mask left (or a primed row's) may take a post step next
            unmasked = (active != self._mask_id).all(-1)
            values["post_next"] = ((unmasked | self.primed) & ~finished).any()
        if self.on_block is not None:
            values["blocks_done"] = (block_done | finished).sum()
        status = StepStatus.read(values)  # the step's one sync
        self.calls.check(self.tallies.forwards, status.non_finite, status.idle, self.block_index)
        leaving = status.leaving
        self._plan = status.plan
        self._can_draft = status.can_draft
        self.tallies.accepted += status.accepted
        self.tallies.verifications += status.verifications
        self._primed_any = status.primed
        self._post_next = status.post_next
        self.tallies.forwards += 1
        if status.blocks_done:
            done = block_done | finished
            generated_columns = (columns >= self.width) & (torch.gather(self.full_mask, 1, columns) == 1)
            assert self.on_block is not None
            self.on_block(BlockRecord(done_block[done], self.rows[done], new_block[done], generated_columns[done]))
        if not leaving:
            return None
        order = torch.argsort(finished.long(), stable=True)
        gone = order[self.size - leaving:]
        room = self.region_end[gone] - self.width  # each leaving row's generated region

        def lengths_of(rows: torch.Tensor) -> torch.Tensor:  # (R,): up to the first EOS, within the region
            return torch.minimum(generated_lengths(rows[:, self.width:], self._eos), room)

        logprobs = self.logprobs.take(gone) if self.logprobs is not None else None
        result = FinishedRows(self.rows[gone], x[gone], self.width, lengths_of(x[gone]), self.nfe[gone], logprobs)
        if self.ledger is not None:
            drafts = self.ledger.drafts[gone]
            result = dataclasses.replace(result, edits=self.ledger.edits[gone], drafts=drafts,
                                         draft_lengths=lengths_of(drafts))
        if leaving == self.size:
            self._empty()
        else:
            self._keep(order[: self.size - leaving])
        return result


def _pad_left(values: torch.Tensor, columns: int, fill: int) -> torch.Tensor:
    """``(B, columns + N)``: ``values`` ``(B, N)`` after ``columns`` columns of ``fill``."""
    if not columns:
        return values
    return torch.cat([values.new_full((values.shape[0], columns), fill), values], dim=1)
