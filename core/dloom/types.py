"""Frozen dataclasses passed to and returned from the hooks.

Two kinds of speculation share the hooks: for a dLLM target the state is a
:class:`DecodeState`, drafts a :class:`DraftGraph` of future states of its active block, laid
out as a :class:`VerificationLayout` and judged by a :class:`Verdict`; for an autoregressive
target the state is a :class:`ChainState`, drafts are :class:`DraftChains` of tokens, laid out
as a :class:`ChainLayout` and judged by a :class:`ChainVerdict`.

Shapes: ``B`` batch rows, ``L`` full sequence length (prompt + generation), ``K`` positions
of the active block, ``V`` vocabulary, ``N`` draft nodes, ``R`` layout rows, ``S`` layout
sequence length, ``T`` draft positions of a chain.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dloom.errors import ConfigurationError, HookContractError


@dataclass(frozen=True)
class BlockSchedule:
    """Where the current step lies in the active block's step budget.

    :ivar step_in_block: ``(B,)`` long, 0-based index of this step within the block, per
        row (rows advance at different rates when a speculative strategy accepts drafts).
    :ivar steps_per_block: the step budget of one block (``steps / number of blocks``).
    :ivar masked_at_block_start: ``(B,)`` long, masked positions of each row when the block
        started; a quota rule spreads these over ``steps_per_block`` steps.
    :ivar masked: on the revisable kernel, ``(B, K)`` bool, the positions still masked at this
        step (the others offered in ``selectable`` are filled positions an editing rule may
        rewrite); ``None`` on the absorbing kernel, where every selectable position is masked.
    :ivar post_steps: on the revisable kernel, ``(B,)`` long, the steps of this block taken
        since it held no mask, this one included (0 while masks remain; an editing rule's
        edit budget); ``None`` on the absorbing kernel.
    """

    step_in_block: torch.Tensor
    steps_per_block: int
    masked_at_block_start: torch.Tensor
    masked: torch.Tensor | None = None
    post_steps: torch.Tensor | None = None


@dataclass(frozen=True)
class Edits:
    """An editing rule's answer to ``dloom_select_commit`` that also deletes positions and
    inserts masks (LLaDA2.2's Levenshtein edits, DELETE and SPLIT) or returns filled
    positions to the mask (WINO's remasks), on the revisable kernel (``B`` rows, blocks of
    ``K``). A plain ``(B, K)`` bool answer is one that does none of these.

    ``commit`` is what a plain answer is: the positions that take their candidate (masked
    ones filled, filled ones rewritten), a subset of ``selectable``. ``delete`` and
    ``split`` act in a post step only (a step begun with no mask in the row's block:
    ``schedule.masked`` has none), on the filled positions the step offered
    (``selectable & ~schedule.masked``); elsewhere they are ignored. After the step's
    commits the kernel rebuilds the row's generated positions of the block, in order:

    * a position in ``delete`` is removed (whatever else it is in): the tokens after it move
      one position left, and the block ends in one more mask;
    * a position in ``split`` keeps its token with a mask inserted before it: the tokens
      from it on move one position right, and the block's last token, pushed out of the
      block, is dropped (a block keeps its ``K`` positions).

    Prompt positions, earlier blocks (final) and later ones never move. The masks a step
    makes are filled by the steps that follow (which are not post steps: they take no edit
    budget, and each fills at least one), so a block still ends within its edit budget.

    ``remask`` (WINO's narrow-out: draft low, remask suspicious tokens) acts in a fill step
    only (a step begun with at least one mask in the row's block), on the generated filled
    positions of the block that the step did not commit; elsewhere (a post step, a prompt
    position, a masked one, a position committed this step) it is ignored. Those positions
    return to the mask token after the step's commits, but the kernel keeps a row's remasks
    only while the step still fills at least one position net: at most ``n - 1`` of them
    for ``n`` masked positions the step filled, the ones whose current token is least
    probable under the step's distribution first (ties: the lower position). So every fill
    step leaves the row's block with fewer masks than it began with, and a block of ``K``
    positions ends within ``K`` fill steps plus its edit budget whatever the rule asks.

    :ivar commit: ``(B, K)`` bool.
    :ivar delete: ``(B, K)`` bool.
    :ivar split: ``(B, K)`` bool.
    :ivar remask: ``(B, K)`` bool, or ``None`` (no remask).
    """

    commit: torch.Tensor
    delete: torch.Tensor
    split: torch.Tensor
    remask: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeState:
    """A snapshot of decoding at the start of a step.

    Rows advance through their blocks independently, so the active block's columns may
    differ per row: ``block_start`` is an int (every row) or a ``(B,)`` long tensor; every
    row's block has the same length ``K``.

    :ivar tokens: ``(B, L)`` long, the current sequences (mask id where still masked).
    :ivar attention_mask: ``(B, L)`` long, 0 on padding.
    :ivar block_start: first column of each row's active block (int or ``(B,)``).
    :ivar block_end: one past its last column (``K = block_end - block_start``).
    :ivar mask_token_id: the model's mask id.
    :ivar active: ``(B,)`` bool, rows taking a kernel step in this forward.
    :ivar logits: ``(B, K, V)`` logits of the active block from the most recent forward
        whose distribution is known: that of the current state's predecessor (the state one
        kernel step earlier), or ``None`` when no row has one.
    :ivar span_start: first column of the span a draft node occupies in a verification
        layout: ``block_start``, or ``block_start - 1`` for a shifted model (whose block
        logits come from the outputs one position earlier). A span covers
        ``[span_start, block_end)``, ``W = block_end - span_start`` columns.
    :ivar known: ``(B,)`` bool, rows whose ``logits`` are their predecessor's (``False`` for
        a row at the start of its block: nothing to draft from); ``None``: every row's.
    :ivar width: ``K`` when the block columns are per-row tensors (unused with ints).
    :ivar span_lead: ``block_start - span_start`` (1 for a shifted model) with per-row
        tensors.
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    block_start: int | torch.Tensor
    block_end: int | torch.Tensor
    mask_token_id: int
    active: torch.Tensor
    logits: torch.Tensor | None = None
    span_start: int | torch.Tensor | None = None
    known: torch.Tensor | None = None
    width: int = 0
    span_lead: int = 0

    @property
    def block_length(self) -> int:
        """``K``, the same for every row."""
        if isinstance(self.block_end, int) and isinstance(self.block_start, int):
            return self.block_end - self.block_start
        return self.width

    def _gather(self, start: torch.Tensor, width: int) -> torch.Tensor:
        columns = start.unsqueeze(1) + torch.arange(width, device=self.tokens.device)
        return torch.gather(self.tokens, 1, columns)

    @property
    def block(self) -> torch.Tensor:
        """``(B, K)`` long, the active block's tokens."""
        if isinstance(self.block_start, int):
            return self.tokens[:, self.block_start : self.block_end]
        return self._gather(self.block_start, self.width)

    @property
    def span(self) -> torch.Tensor:
        """``(B, W)`` long, the columns of a verification span (:attr:`span_start` on)."""
        start = self.block_start if self.span_start is None else self.span_start
        if isinstance(start, int):
            return self.tokens[:, start : self.block_end]
        lead = 0 if self.span_start is None else self.span_lead
        return self._gather(start, self.width + lead)


@dataclass(frozen=True)
class DraftGraph:
    """Speculated future states of the active block, as a directed acyclic graph.

    Node ``0`` is the root, the current state; nodes ``1 .. N`` are drafts. Draft ``n`` is a
    guess of the block ``depth[n]`` kernel steps after the root. A draft may have several
    parents when different orders of commits reach the same state.

    :ivar tokens: ``(B, N + 1, K)`` long, the block each node proposes, per row
        (``tokens[:, 0]`` is the root's block).
    :ivar parents: ``(N + 1, N + 1)`` bool, ``parents[c, p]`` when ``c`` is one kernel step
        after ``p``; every draft has at least one parent, the root none.
    :ivar depth: ``(N + 1,)`` long, the fewest steps from the root (``depth[0] == 0``).
    :ivar score: ``(B, N + 1)`` float, how likely each node is (higher is likelier).
    :ivar valid: ``(B, N + 1)`` bool, ``False`` where a row could not fill a node or pruned
        it; ``valid[:, 0]`` marks the rows still decoding.
    :ivar longest_path: the most kernel steps from the root to any node, as a Python int
        (the verifier walks that many steps plus one without reading the device); ``None``:
        read from ``depth``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    valid: torch.Tensor
    longest_path: int | None = None

    @property
    def num_nodes(self) -> int:
        """``N``, the number of drafts (the root not counted)."""
        return int(self.depth.shape[0]) - 1

    def children(self, node: torch.Tensor) -> torch.Tensor:
        """``(B, N + 1)`` bool, the children of each row's ``node`` (``(B,)`` long)."""
        return self.parents.T[node]


@dataclass(frozen=True)
class VerificationLayout:
    """How one forward pass evaluates the root and the draft nodes of every row.

    The forward has ``R`` layout rows. Each holds one or more *spans* of ``W`` columns (the
    tokens of a node over ``[span_start, block_end)``, see :class:`DecodeState`), next to
    the context of batch row ``source[r]``: the prompt, the earlier blocks and the masked
    blocks after the active one. The first span of a layout row sits in the context, where
    the active block is; further spans are appended after it with the positions of the
    block, attend to the context (never to the first span) and to their own span, and are
    seen by nothing else.

    One span per row (``packed == False``) is exact for every model and cache mode: each
    row is a standalone forward on its node's state. With several spans per row
    (``packed == True``) the context is computed once, next to the first span: exact only
    when the context's keys and values do not depend on the active block (dual cache, or a
    block-causal model), near-lossless anywhere else. The decoder decides which and
    reports it.

    :ivar input_ids: ``(R, S)`` long, the spans of every layout row, side by side.
    :ivar source: ``(R,)`` long, the batch row whose context each layout row uses.
    :ivar segment: ``(R, S)`` long, which node each column belongs to (``-1`` on padding).
    :ivar span_position: ``(R, S)`` long, each column's offset in its span (``0 .. W - 1``;
        any value on padding).
    :ivar node_rows: ``(B, N + 1)`` long, the layout row holding each row's node, ``-1``
        where the node is not evaluated.
    :ivar node_offsets: ``(B, N + 1)`` long, the column where that node's span starts.
    :ivar packed: whether some layout row holds more than one span.
    :ivar call_tokens: how many query tokens one model call of the verification may hold
        beyond the batch's ``B`` rows: the decoder evaluates the layout in calls of at most
        ``max(B, call_tokens // Q)`` rows, ``Q`` the tokens its forward computes per row (the
        sequence without a cache, the window with one); ``0``: ``B`` rows, so that a
        verification holds no more rows at once than a plain step
        (:func:`dloom.decode.speculation.evaluate_in_parts`).
    :ivar row_bound: the most layout rows per batch row that any layout of this verification
        kind holds, stated for static shapes (:func:`dloom.decode.speculation.layout_drafts` with
        ``nodes``: the nodes one row may evaluate for a rows layout, 1 for a packed one);
        ``0``: not stated, then ``N + 1``. With ``static_shapes`` the decoder pads every model
        call of a verification to the same row count, at most ``B * row_bound``
        (:func:`dloom.decode.speculation.static_call_rows`).
    :ivar next_block: every evaluated node's outputs also hold the next block's logits (the
        ``K`` columns after its span's block: the distribution a forward on that node's
        state gives the positions of the following block). Only a rows layout without a
        cache computes them (:meth:`dloom.model.runner.BlockForward.evaluate` sees the whole
        canvas there); a drafter asks for them to draft a block's first forward.
    """

    input_ids: torch.Tensor
    source: torch.Tensor
    segment: torch.Tensor
    span_position: torch.Tensor
    node_rows: torch.Tensor
    node_offsets: torch.Tensor
    packed: bool
    call_tokens: int = 0
    row_bound: int = 0
    next_block: bool = False


class NodeLogits:
    """Every node's block distribution in a verification forward's outputs, read on demand.

    Stands for the ``(B, N + 1, K, V)`` array of every node's logits without building it:
    the verifier reads one node per row per kernel step (:meth:`of`), a ``(B, K, V)``
    gather, so the ``N + 1`` nodes' logits are never copied out of the forward's outputs.

    :param outputs: ``(R, S, V)``, the forward's raw outputs at the layout's columns; the
        first ``K`` columns of a span give its block's logits (for a shifted model the span
        starts one column early, so this holds for it too).
    :param layout: the verification layout (``node_rows``/``node_offsets`` ``(B, N + 1)``).
    :param block_length: ``K``.
    """

    def __init__(self, outputs: torch.Tensor, layout: VerificationLayout, block_length: int) -> None:
        self.outputs = outputs
        self.rows = layout.node_rows.clamp(min=0)  # nodes not evaluated read some other output
        self.offsets = layout.node_offsets
        self.span = torch.arange(block_length, device=outputs.device)
        self.has_next = layout.next_block

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, N + 1, K, V)``."""
        return (*self.rows.shape, self.span.shape[0], self.outputs.shape[-1])

    def of(self, node: torch.Tensor) -> torch.Tensor:
        """``(B, K, V)``: row ``b``'s logits of its node ``node[b]`` (``(B,)`` long);
        meaningless for a node that was not evaluated."""
        return self._columns(node, 0)

    def next_of(self, node: torch.Tensor) -> torch.Tensor:
        """``(B, K, V)``: row ``b``'s logits of the block after the active one on its node
        ``node[b]``'s state (a layout with :attr:`VerificationLayout.next_block` only)."""
        if not self.has_next:
            raise HookContractError("next_of: the verification layout carries no next-block logits")
        return self._columns(node, self.span.shape[0])

    def _columns(self, node: torch.Tensor, skip: int) -> torch.Tensor:
        """``(B, K, V)``: the ``K`` output columns ``skip`` after each row's node's span start."""
        index = node.unsqueeze(1)
        rows = torch.gather(self.rows, 1, index)  # (B, 1)
        columns = torch.gather(self.offsets, 1, index) + self.span + skip  # (B, K)
        return self.outputs[rows.expand_as(columns), columns]


@dataclass(frozen=True)
class Verdict:
    """What a verification forward accepted.

    :ivar block: ``(B, K)`` long, the active block after the accepted steps and the first
        missed one (the next forward's state).
    :ivar logits: ``(B, K, V)``, the distribution the last kernel step sampled from (that of
        the new state's predecessor); the next drafts are filled from it.
    :ivar accepted: ``(B,)`` long, drafts accepted per row (kernel steps taken minus one).
    :ivar primed: ``(B,)`` bool or ``None``: rows whose last step completed the block in a
        drafted state evaluated with its next block's logits (:attr:`next_logits`): the
        decoder takes the next block's first step from them, without its forward.
    :ivar next_logits: ``(B, K, V)`` or ``None``: those rows' next-block distribution, the
        one a forward on the completed state gives (meaningless where ``primed`` is off).
    """

    block: torch.Tensor
    logits: torch.Tensor
    accepted: torch.Tensor
    primed: torch.Tensor | None = None
    next_logits: torch.Tensor | None = None


# --- speculation against an autoregressive target: token chains -----------------------------


@dataclass(frozen=True)
class ChainState:
    """A snapshot of decoding an autoregressive target at the start of a drafting call.

    The rows are laid out as columns of one sequence: the left-padded prompt (width ``P``),
    then each row's accepted tokens (``lengths[b]`` of them), then padding up to
    ``P + max_new_tokens = L``. A drafter proposes token chains that continue each row's
    accepted tokens (:class:`DraftChains`).

    :ivar tokens: ``(B, L)`` long, prompts and accepted tokens (columns after a row's
        accepted tokens hold the target's pad id).
    :ivar attention_mask: ``(B, L)`` long, 0 on the prompt's left padding.
    :ivar prompt_length: ``P``.
    :ivar lengths: ``(B,)`` long, tokens each row has accepted (generated so far).
    :ivar active: ``(B,)`` bool, rows still generating (no EOS yet, room left).
    :ivar max_new_tokens: the most generated tokens per row.
    :ivar eos_token_ids: ``(E,)`` long.
    :ivar shared: columns every active row has accepted (prompt included), as a Python
        int: columns before it never change again.
    :ivar cached: columns the target's KV cache holds (the same for every row, ``<
        shared``); a layout feeds each row's accepted tokens from there on.
    :ivar streams: the rows' random streams (:class:`dloom.decode.kernel.RowStreams`, one per
        prompt) or ``None`` when nothing samples. A drafter draws with tags 0 and 1 (those of
        :func:`dloom.decode.kernel.propose`) and advances the rows that took a drafter step; the
        verification draws with tags 2 to 4 and the decoder advances every active row after it.
    :ivar temperature: the target's (and by default the drafter's) sampling temperature.
    :ivar draft: ``None`` on a round's first ``dloom_draft`` call; on later calls of the
        same round, the chains so far (after ``dloom_prune``), to extend where ``open``.
    :ivar previous: the last round's verified chains (``None`` in the first round), so a
        drafter can carry its own state (``DraftChains.carry``) across rounds.
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    lengths: torch.Tensor
    active: torch.Tensor
    max_new_tokens: int
    eos_token_ids: torch.Tensor
    shared: int
    cached: int
    streams: Any = None
    temperature: float = 0.0
    draft: DraftChains | None = None
    previous: DraftChains | None = None

    @property
    def room(self) -> torch.Tensor:
        """``(B,)`` long, tokens each row may still generate (0 for finished rows)."""
        return torch.where(self.active, self.max_new_tokens - self.lengths, 0)


@dataclass(frozen=True)
class DraftChains:
    """Token chains proposed to continue each row of a :class:`ChainState` (``T`` draft
    positions; entry ``i`` of a row is its ``i``-th token after its accepted ones).

    A drafter may build its chains over several ``dloom_draft`` calls in one round: the
    decoder calls ``dloom_prune`` after every call and ``dloom_draft`` again while some row is
    ``open``. A chain is verified once no row is open.

    :ivar tokens: ``(B, T)`` long; entries at or after ``length`` are ignored.
    :ivar length: ``(B,)`` long, the tokens proposed for verification (0: none; the
        target then decodes one token).
    :ivar open: ``(B,)`` bool, rows whose chain the drafter may still extend.
    :ivar confidence: ``(B, T)`` float, the drafter's probability of each drafted token
        (``None``: not known); what a length policy reads.
    :ivar drafted: ``(B,)`` long, leading tokens of each row that are drafted and final
        (``>= length``; ``None``: ``length``).
    :ivar limit: ``(B,)`` long, the most tokens a row may propose: its room before
        ``max_new_tokens``, and no token after a drafted EOS (``None``: ``drafted``).
    :ivar probs: ``(B, T, V)`` float64, the distribution each token was sampled from (for
        ratio verification; ``None`` when not kept).
    :ivar left_to_right: every token was drafted given exactly the tokens before it, so
        ``probs[:, i]`` is the drafter's distribution of token ``i`` given tokens ``< i``
        (ratio-based rejection sampling is exact only then).
    :ivar carry: the drafter's own state (caches, canvases), passed back unchanged through
        :attr:`ChainState.draft` and :attr:`ChainState.previous`; the core never reads it.
    :ivar drafter_forwards: drafter batch forwards run for this round so far.
    :ivar drafter_nfe: ``(B,)`` long, drafter forwards each row took part in this round
        (``None``: none).
    :ivar seconds: wall seconds of the drafter's parts this round (e.g. its forwards, its
        commit rule), by name; reported in ``result.hook_seconds``.
    :ivar checks: ``(flag, error)`` pairs: ``()`` bool device tensors the decoder reads with
        its one host synchronisation per drafting call, raising ``error`` when a flag is set
        (a drafter's NaN logits or idle commit rule, detected without a sync of its own).
    :ivar span: filled by the decoder after pruning, as a Python int: the widest run one
        row feeds the target (its uncached accepted tokens plus its chain).
    :ivar longest: filled by the decoder after pruning: the longest proposed chain.
    :ivar target_alone: the strategy proposes nothing in this round nor any later one of the
        batch: the decoder decodes the rest with the target alone, in its plain
        autoregressive loop (one cached forward per token, no more hook calls), the tokens
        an empty chain's verification would give.
    :ivar decision: the strategy's account of a choice it took about drafting (e.g. whether
        drafting pays: FailFast's break-even and measured cost ratios); the decoder reports
        the last one in the result's ``drafting``.
    """

    tokens: torch.Tensor
    length: torch.Tensor
    open: torch.Tensor
    confidence: torch.Tensor | None = None
    drafted: torch.Tensor | None = None
    limit: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    left_to_right: bool = False
    carry: Any = None
    drafter_forwards: int = 0
    drafter_nfe: torch.Tensor | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)
    checks: tuple[tuple[torch.Tensor, Exception], ...] = ()
    span: int | None = None
    longest: int | None = None
    target_alone: bool = False
    decision: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ChainLayout:
    """The target forward that verifies every row's chain (``S`` new columns per row).

    Each row feeds its accepted tokens the target has not cached yet (at least the last one,
    whose output is the distribution of the chain's first token), then its chain, then
    padding.

    :ivar input_ids: ``(B, S)`` long, the new columns of every row (right-padded).
    :ivar slot_mask: ``(B, S)`` long, 1 on real columns, 0 on padding.
    :ivar first_output: ``(B,)`` long, the column whose output is the distribution of the
        chain's first token (the ``i``-th token's is ``first_output + i``).
    """

    input_ids: torch.Tensor
    slot_mask: torch.Tensor
    first_output: torch.Tensor


@dataclass(frozen=True)
class ChainVerdict:
    """What a verification of token chains accepted.

    :ivar accepted: ``(B,)`` long, leading chain tokens kept per row.
    :ivar token: ``(B,)`` long, the target's token after them (the correction at the first
        rejected position, or the bonus token after a fully accepted chain).
    """

    accepted: torch.Tensor
    token: torch.Tensor


@dataclass(frozen=True)
class Parameter:
    """One strategy parameter: its name, type, default and allowed values.

    :ivar low: / :ivar high: bounds of the allowed interval (``None`` = unbounded).
    :ivar low_open: / :ivar high_open: whether the bound itself is excluded.
    :ivar choices: the allowed values, for categorical parameters.
    :ivar path: the value is a path of a file the strategy reads. Where clients are not
        trusted with the file system (``dloom serve``), a request may only name a file that
        the operator put in an allowed directory, or one of ``path_files``, never a path.
    :ivar path_files: with ``path``: glob patterns of the plugin's own files for this
        parameter (e.g. its built-in draft graphs, ``.../graphs/*.json``), which a server
        offers by name too.
    :ivar words: strings taken as they are besides the typed values (``("auto",)``: a
        budget the strategy chooses itself); the bounds apply to the typed values.
    :ivar generation_key: a dotted key of a checkpoint's ``generation_config.json``
        (``"sampler_config.entropy_bound"``) whose value, where the checkpoint sets it, is
        this parameter's default when decoding that model (:meth:`generation_default`).
    """

    name: str
    default: Any
    kind: type = float
    help: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] | None = None
    path: bool = False
    path_files: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    generation_key: str | None = None

    def generation_default(self, generation: Mapping[str, Any]) -> Any:
        """The value of :attr:`generation_key` in ``generation`` (a checkpoint's generation
        config), or ``None`` when the parameter names no key or the config does not set it."""
        if self.generation_key is None:
            return None
        value: Any = generation
        for part in self.generation_key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        return value

    def allowed(self) -> str:
        """Human-readable description of the allowed values, e.g. ``(0, 1)``."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        words = "".join(f" or {word!r}" for word in self.words)
        if self.low is None and self.high is None:
            return f"any {self.kind.__name__}{words}"
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"{left}{low}, {high}{right}{words}"

    def _typed(self, value: Any) -> Any:
        """A value that is not a string, taken only when it has the declared type: a bool
        is no number, a number no bool or string, and a float no int (``2.7`` for an int
        parameter is refused, never truncated); an int is a float.

        :raises ValueError: for a value of another type.
        """
        if self.kind in (bool, int, float, str) and isinstance(value, bool) != (self.kind is bool):
            raise ValueError(value)
        if self.kind is int and not isinstance(value, numbers.Integral):
            raise ValueError(value)
        if self.kind is float and not isinstance(value, numbers.Real):
            raise ValueError(value)
        if self.kind is str:
            raise ValueError(value)  # strings are parsed by the caller
        return self.kind(value)

    def coerce(self, value: Any, strategy: str) -> Any:
        """Parse ``value`` (a string from the CLI, or a Python value of the declared type)
        and check its range.

        :raises ConfigurationError: naming the strategy, the parameter, the value and the
            allowed range.
        """
        where = f"parameter {self.name!r} of strategy {strategy!r}"
        if isinstance(value, str) and value in self.words:
            return value
        try:
            if self.kind is bool and isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                parsed: Any = value.lower() in ("true", "1", "yes")
            elif isinstance(value, str):
                parsed = self.kind(value)
            else:
                parsed = self._typed(value)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"{where} must be a {self.kind.__name__}, got {value!r}; allowed: {self.allowed()}"
            ) from None
        if self.choices is not None:
            if parsed not in self.choices:
                raise ConfigurationError(f"{where} is {parsed!r}; allowed: {self.allowed()}")
            return parsed
        if isinstance(parsed, float) and not math.isfinite(parsed):
            raise ConfigurationError(f"{where} is {parsed!r}; allowed: {self.allowed()}")
        too_low = self.low is not None and (
            parsed < self.low or (self.low_open and parsed == self.low)
        )
        too_high = self.high is not None and (
            parsed > self.high or (self.high_open and parsed == self.high)
        )
        if too_low or too_high:
            raise ConfigurationError(f"{where} is {parsed!r}; allowed: {self.allowed()}")
        return parsed


CLAIM_KINDS = ("lossless", "bound", "approximate", "reference")
CLAIM_SETTINGS = ("temperature", "remasking")
"""Decoder settings a claim's ``holds_when`` may name, besides the strategy's parameters."""


@dataclass(frozen=True)
class Claim:
    """What a strategy promises, in a form ``dloom check`` can test.

    :ivar kind: one of :data:`CLAIM_KINDS`:

        * ``"lossless"``: the output distribution equals ``against``'s (under ``T == 0``:
          the same tokens);
        * ``"bound"``: the commit rule is certified by the bound named ``bound``;
        * ``"approximate"``: no exactness promise (``against``, if given, is the strategy it
          approximates; ``dloom check`` measures the agreement);
        * ``"reference"``: the strategy *is* a reference process (lossless claims are
          measured against it).
    :ivar against: for ``"lossless"`` (required) and ``"approximate"``: a registered
        strategy name, or ``"kernel"`` for the strategy's own commit rule run one forward
        per step (what a speculative strategy must reproduce).
    :ivar bound: for ``"bound"`` (required): the name of the bound (``"frechet"``), given
        with ``bound_function``, or an import path ``"package.module:function"`` of a
        function from a sorted ``(B, K)`` confidence profile to ``(L, U, G)``.
    :ivar bound_function: the bound ``bound`` names, supplied by the plugin that declares the
        claim (``dloom check`` finds a named bound among the registered strategies' claims).
    :ivar conditions: when the claim holds, in words (temperature, remasking, cache).
    :ivar holds_when: when the claim holds, checked: ``{name: value}`` of the strategy's
        parameters and decoder settings (:data:`CLAIM_SETTINGS`) at which it holds, each a
        value or a list/tuple of the values allowed (``{"gamma": 0}``: "lossless at
        gamma = 0"). Elsewhere the decoder records the claim as not made and ``dloom check``
        does not test it (:meth:`unmet`). Empty: it holds at every value.
    :ivar exercised_at: ``{name: value}`` of the strategy's parameters that ``dloom check``
        decodes at unless the user gives them: values where the claim has something to test.
        A speculator whose default drafts nothing on the checking machine (Spiffy's
        ``budget="auto"`` on a CPU) would otherwise pass its identity trivially.
    """

    kind: str
    against: str | None = None
    bound: str | None = None
    conditions: str = ""
    bound_function: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    holds_when: Mapping[str, Any] = field(default_factory=dict)
    exercised_at: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in CLAIM_KINDS:
            raise ConfigurationError(
                f"claim kind {self.kind!r} is not known; allowed: {', '.join(CLAIM_KINDS)}"
            )
        if self.kind == "lossless" and not self.against:
            raise ConfigurationError(
                "a 'lossless' claim needs against=: the strategy it is lossless with respect to"
            )
        if self.kind == "bound" and not self.bound:
            raise ConfigurationError("a 'bound' claim needs bound=: the name of the bound")
        for name, allowed in self.holds_when.items():
            if isinstance(allowed, (list, tuple, set, frozenset)) and not allowed:
                raise ConfigurationError(f"holds_when[{name!r}] allows no value; give a value or a non-empty list")

    def unmet(self, values: Mapping[str, Any]) -> list[str]:
        """The conditions of :attr:`holds_when` that ``values`` (parameters and decoder
        settings by name; a name missing from it is not judged) break, worded
        ``"k = 2 (holds at k = 1)"``; empty when the claim holds there."""
        broken = []
        for name, allowed in self.holds_when.items():
            if name in values and values[name] not in _choices(allowed):
                broken.append(f"{name} = {values[name]!r} (holds at {_condition(name, allowed)})")
        return broken

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "kind": self.kind, "against": self.against, "bound": self.bound,
            "conditions": self.conditions,
        }
        if self.exercised_at:
            record["exercised_at"] = dict(self.exercised_at)
        if self.holds_when:
            record["holds_when"] = {
                name: list(_choices(allowed)) if isinstance(allowed, (list, tuple, set, frozenset)) else allowed
                for name, allowed in self.holds_when.items()
            }
        return record

    def describe(self, conditions: bool = True) -> str:
        """One line, e.g. ``lossless against quota (any temperature)``; ``conditions=False``
        leaves the parenthesis out."""
        text = {
            "lossless": f"lossless against {self.against}",
            "bound": f"bound {self.bound}",
            "approximate": "approximate" + (f" (of {self.against})" if self.against else ""),
            "reference": "reference process",
        }[self.kind]
        if self.holds_when:
            text += " at " + ", ".join(_condition(n, a) for n, a in self.holds_when.items())
        return f"{text} ({self.conditions})" if conditions and self.conditions else text


def _choices(allowed: Any) -> tuple[Any, ...]:
    if isinstance(allowed, (set, frozenset)):
        return tuple(sorted(allowed, key=repr))
    return tuple(allowed) if isinstance(allowed, (list, tuple)) else (allowed,)


def _condition(name: str, allowed: Any) -> str:
    """``"gamma = 0"`` or ``"remasking in ('low_confidence', 'margin')"``."""
    choices = _choices(allowed)
    return f"{name} = {choices[0]!r}" if len(choices) == 1 else f"{name} in {choices!r}"


DIFFUSION = "diffusion"
AR_TARGET = "ar-target"
DECODERS = (DIFFUSION, AR_TARGET)
"""The decoders a strategy registration may name (:attr:`StrategyRegistration.decoder`);
:mod:`dloom.decode.decoders` says what each one is and dispatches on them."""


@dataclass(frozen=True)
class StrategyRegistration:
    """What a plugin hands to ``register`` in :func:`dloom_register_strategies`.

    :ivar name: the strategy's name, used with ``--strategy`` and in ``a+b`` compositions.
    :ivar plugin_class: called with the strategy's parameters as keyword arguments; the
        object it returns is registered in the decoder's plugin manager.
    :ivar parameters: every keyword ``plugin_class`` accepts, with defaults and ranges.
    :ivar guarantee: what the strategy promises, in one sentence.
    :ivar summary: one line for ``dloom strategies``.
    :ivar claim: the guarantee in a form ``dloom check`` tests (``None``: no claim).
    :ivar default_commit_rule: for a strategy without a commit rule (a speculator): the
        strategy composed in when a composition has no commit rule, e.g. ``"quota"``.
    :ivar decoder: the decoder the strategy runs in, one of
        :data:`DECODERS`: ``"diffusion"`` (:class:`dloom.DiffusionDecoder`,
        the default) or ``"ar-target"`` (an autoregressive target with a dLLM drafter).
        ``dloom generate``/``eval`` build that decoder for ``--strategy``.
    :ivar options: names of ``parameters`` that ``dloom generate``, ``eval`` and ``check``
        also take as ``--NAME`` options (``_`` written ``-``); ``--NAME VALUE`` means
        ``--param STRATEGY.NAME=VALUE``. An option name is owned by one strategy.
    :ivar edits: the strategy's commit rule also rewrites filled positions (token-to-token
        edits) on the revisable kernel: it is offered them in ``selectable``, told apart from
        masked ones by :attr:`BlockSchedule.masked`. ``False``: a fill rule, offered masked
        positions only, on any kernel.
    :ivar edit_budget: for an editing rule (required), the name of its integer parameter
        that bounds the post steps of a block (steps begun with no mask in it): once they
        are spent the kernel settles the block without a further forward, so every block
        ends within the budget however the rule edits.
    :ivar kernels: the transition kernels the strategy supports (names of
        :data:`dloom.decode.transition.KERNELS`, chosen by the model's profile); a decoder
        pairing it with another kernel is refused when it is built. ``("absorbing",)``: a
        position is masked until committed, and a committed token never changes.
    """

    name: str
    plugin_class: Callable[..., object]
    parameters: Sequence[Parameter] = field(default_factory=tuple)
    guarantee: str = ""
    summary: str = ""
    claim: Claim | None = None
    default_commit_rule: str | None = None
    decoder: str = DIFFUSION
    options: Sequence[str] = field(default_factory=tuple)
    kernels: Sequence[str] = ("absorbing",)
    edits: bool = False
    edit_budget: str | None = None

    def __post_init__(self) -> None:
        if self.claim is not None:
            known = {p.name for p in self.parameters}
            unknown = sorted(set(self.claim.holds_when) - known - set(CLAIM_SETTINGS))
            if unknown:
                raise ConfigurationError(
                    f"strategy {self.name!r}: its claim's holds_when names {unknown[0]!r}, which is "
                    f"neither a parameter nor a decoder setting; allowed: "
                    f"{', '.join([*sorted(known), *CLAIM_SETTINGS])}"
                )
