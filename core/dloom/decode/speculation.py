"""The decoder's side of speculation: following a draft graph losslessly with the kernel step
(:class:`dloom.decode.kernel.KernelStep`), and reading every node's logits out of a verification
forward.

Lossless verification (``docs/concepts.md``, "Lossless"): from the root, take one kernel
step with the root's distribution; if the new block equals a draft exactly, that draft's
distribution is the one a forward on that state would give, so the next kernel step uses it
without a forward; continue along that draft's children and stop at the first state that is
no draft. Every kernel step is the reference kernel's, so the sequence of states has the
reference distribution (and, with one row and the same seed, the very same random numbers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dloom.decode.kernel import KernelStep, selectable_positions
from dloom.errors import HookContractError
from dloom.types import DecodeState, DraftGraph, NodeLogits, Verdict, VerificationLayout

if TYPE_CHECKING:
    from dloom.model.cache_policy import CachePolicy


def follow_graph(graph: DraftGraph, node_logits: NodeLogits, kernel: KernelStep) -> Verdict:
    """Take kernel steps from the root while each new block equals a draft (lossless).

    Vectorised over rows, with no host synchronisation: a Python loop of exactly
    ``longest_path + 1`` iterations (the longest path through the graph), each one kernel
    step of the rows still on the graph (the others take no step, so their random streams
    do not advance: every row draws exactly what the reference process draws).

    A block's first forward (``node_logits.has_next``: every node was evaluated with the
    next block's logits, :attr:`~dloom.types.VerificationLayout.next_block`): when a row's
    step completes its block in a state that *equals* a draft, that draft's next-block
    logits are those of the forward the reference runs first on the next block (the same
    canvas), so the verdict hands them on (``primed``, ``next_logits``) and the decoder
    takes that block's first step from them without its forward. A completed block that
    equals no draft primes nothing.

    :param graph: the evaluated graph; ``graph.tokens[:, 0]`` is the root's block.
    :param node_logits: every node's distribution from the forward (:class:`NodeLogits`;
        read for one node per row per step).
    :param kernel: the decoder's :class:`KernelStep` (the ``kernel`` argument of
        ``dloom_verify``).
    :return: the new block (the first state that was no draft, or the finished block), the
        distribution its last step sampled from, the drafts each row accepted and, with
        next-block logits, the rows primed for their next block and those logits.
    """
    rows = torch.arange(graph.tokens.shape[0], device=graph.tokens.device)
    node = torch.zeros_like(rows)
    block = graph.tokens[:, 0]
    logits = node_logits.of(node)
    on_graph = graph.valid[:, 0].clone()
    accepted = torch.zeros_like(rows)
    primed = torch.zeros_like(on_graph)
    completion = torch.zeros_like(rows)  # the draft each primed row's block completed as
    longest = graph.longest_path
    if longest is None:
        longest = int(graph.depth.max()) if graph.num_nodes else 0
    for _ in range(longest + 1):
        block = kernel(block, logits, on_graph)
        children = graph.children(node) & graph.valid
        same = (graph.tokens == block.unsqueeze(1)).all(-1)
        hits = children & same
        still_masked = selectable_positions(block, kernel.mask_token_id, kernel.eos_ids, kernel.generated).any(-1)
        if node_logits.has_next:
            completed = on_graph & hits.any(-1) & ~(block == kernel.mask_token_id).any(-1)
            completion = torch.where(completed, hits.long().argmax(-1), completion)
            primed = primed | completed
        on_graph = on_graph & hits.any(-1) & still_masked
        node = torch.where(on_graph, hits.long().argmax(-1), node)
        logits = node_logits.of(node)  # rows off the graph keep their node, so their logits
        # stay those their last step sampled from
        accepted = accepted + on_graph.long()
    if not node_logits.has_next:
        return Verdict(block=block, logits=logits, accepted=accepted)
    return Verdict(block=block, logits=logits, accepted=accepted, primed=primed,
                   next_logits=node_logits.next_of(completion))


def evaluate_in_parts(
    evaluate: Callable[[torch.Tensor, VerificationLayout, int], torch.Tensor],
    tokens: torch.Tensor, layout: VerificationLayout, first_window: int, max_rows: int,
    static_rows: int | None = None,
) -> torch.Tensor:
    """One verification forward's outputs, evaluated in model calls of at most ``max_rows``
    layout rows each.

    Layout rows are independent sequences (each attends to its own row alone), so evaluating
    them a few at a time gives every row the outputs it has in one call over all of them;
    the rows' layout is unchanged. A rows layout has one row per evaluated node (up to
    ``budget + 1`` per batch row): the decoder passes ``max(B, layout.call_tokens // Q)``
    (``Q`` query tokens per row), so that a large verification runs no more rows at once
    than a plain step of the same batch and its peak memory is that of such a step
    (``docs/benchmarks/engine.md``, "Memory"), while a small one stays one call. It is still one verification forward (one
    step, one NFE for each decoding row, as in one call); ``result.model_calls`` counts the
    calls.

    Static shapes (``static_rows``, :func:`static_call_rows`): every call holds exactly
    ``static_rows`` layout rows, the last (or only) one filled up with padding rows
    (:func:`pad_layout`) whose outputs are dropped. ``static_rows`` is ``max_rows`` or, when
    every layout of the batch fits in fewer, that bound, so the calls are the same as
    without it (as many, over the same real rows), each of one shape.

    :param evaluate: the forward over a layout (``BlockForward.evaluate``): ``(tokens,
        layout, first_window)`` to ``(R', S, V)``.
    :param tokens: ``(B, L)`` long, the batch's current state.
    :param layout: the verification layout, ``R`` rows.
    :param first_window: passed on to ``evaluate``.
    :param max_rows: the most layout rows of one model call (``>= 1``).
    :param static_rows: ``None``, or the rows of every call (``R <= static_rows`` or
        ``static_rows == max_rows``).
    :return: ``(R, S, V)``, row ``r`` the outputs of layout row ``r``.
    """
    count = layout.input_ids.shape[0]
    size = max_rows if static_rows is None else static_rows

    def call(part: VerificationLayout, rows: int) -> torch.Tensor:
        if static_rows is None or rows == size:
            return evaluate(tokens, part, first_window)
        return evaluate(tokens, pad_layout(part, size), first_window)[:rows]  # padding rows' outputs dropped

    if count <= size:
        return call(layout, count)
    out: torch.Tensor | None = None
    for first in range(0, count, size):
        stop = min(first + size, count)
        outputs = call(layout_part(layout, first, stop), stop - first)
        if out is None:  # written in place: no second (R, S, V) copy from a concatenation
            out = outputs.new_empty(count, *outputs.shape[1:])
        out[first : first + outputs.shape[0]] = outputs
        del outputs
    assert out is not None
    return out


def static_call_rows(layout: VerificationLayout, max_rows: int) -> int:
    """The rows of every model call of a verification under static shapes: ``max_rows``, or
    ``B * row_bound`` when that is fewer (``row_bound``: the layout's
    :attr:`~dloom.types.VerificationLayout.row_bound`, else ``N + 1``). Every layout of a
    batch of ``B`` rows fits in that bound, so a verification of that batch is evaluated in
    calls of this one row count (:func:`evaluate_in_parts`), and in exactly the calls it
    takes without static shapes.

    :raises HookContractError: for a layout of more rows than its bound (a prune or layout
        hook that evaluates more nodes per row than the layout states).
    """
    batch, nodes = layout.node_rows.shape
    bound = batch * (layout.row_bound or nodes)
    count = layout.input_ids.shape[0]
    if count > bound:
        raise HookContractError(
            f"verification layout has {count} rows for {batch} batch rows, more than its "
            f"row_bound of {layout.row_bound or nodes} per row; a layout must hold at most "
            "row_bound rows per batch row"
        )
    return min(max_rows, bound)


def pad_layout(layout: VerificationLayout, rows: int) -> VerificationLayout:
    """``layout`` (``R`` rows, ``R <= rows``) followed by ``rows - R`` padding rows: copies of
    its first row as a standalone sequence (layout rows never attend to one another, so a
    padding row changes no real row's outputs), ``segment`` ``-1``. ``node_rows`` and
    ``node_offsets`` are unchanged: no node is read from a padding row."""
    extra = rows - layout.input_ids.shape[0]
    if extra <= 0:
        return layout

    def padded(field: torch.Tensor) -> torch.Tensor:
        return torch.cat([field, field[:1].expand(extra, *field.shape[1:])])

    return dataclasses.replace(
        layout, input_ids=padded(layout.input_ids), source=padded(layout.source),
        segment=torch.cat([layout.segment, layout.segment.new_full((extra, layout.segment.shape[1]), -1)]),
        span_position=padded(layout.span_position),
    )


def layout_part(layout: VerificationLayout, first: int, stop: int) -> VerificationLayout:
    """Layout rows ``first .. stop - 1`` of ``layout``, as a layout to evaluate.

    Its ``(R', ...)`` fields are the rows' own; ``node_rows`` and ``node_offsets`` stay
    those of the whole layout (they index its rows, and are read from the whole layout's
    outputs, :class:`NodeLogits`; a forward does not read them)."""
    rows = slice(first, stop)
    return dataclasses.replace(
        layout, input_ids=layout.input_ids[rows], source=layout.source[rows],
        segment=layout.segment[rows], span_position=layout.span_position[rows],
    )


def layout_is_exact(layout: VerificationLayout, cache: CachePolicy, attention: str) -> bool:
    """Whether every node's logits equal a standalone forward's (see
    :class:`~dloom.types.VerificationLayout`): a rows layout always; a packed one where no
    span can change the context's keys and values (a policy whose cached forwards read
    the context from the record, :attr:`~dloom.model.cache_policy.CachePolicy.fixed_context`,
    or a block-causal model)."""
    return not layout.packed or cache.fixed_context or attention == "block-causal"


def layout_drafts(
    state: DecodeState, graph: DraftGraph, packed: bool = False, nodes: int | None = None
) -> VerificationLayout:
    """The layout of the root and every valid draft: one batch row each
    (:func:`rows_layout`, exact everywhere) or packed per row (:func:`packed_layout`).

    A span covers ``[state.span_start, block_end)``: for a shifted model the column before
    the block leads every node's tokens. The root is always evaluated (it carries the
    row's context), even for a finished row.

    :param nodes: ``None``, or for static shapes the most nodes one row evaluates (the root
        included; the strategy's budget + 1): a packed layout then always has ``nodes``
        spans per row, and either layout states its
        :attr:`~dloom.types.VerificationLayout.row_bound` (``nodes`` rows, or 1 packed).
    """
    lead = state.span[:, : state.span.shape[1] - graph.tokens.shape[2]]  # (B, shift)
    spans = torch.cat(
        [lead.unsqueeze(1).expand(-1, graph.tokens.shape[1], -1), graph.tokens], dim=2
    )  # (B, N + 1, W)
    evaluated = graph.valid.clone()
    evaluated[:, 0] = True
    if nodes is None:
        return packed_layout(spans, evaluated) if packed else rows_layout(spans, evaluated)
    if packed:
        return dataclasses.replace(packed_layout(spans, evaluated, nodes), row_bound=1)
    return dataclasses.replace(rows_layout(spans, evaluated), row_bound=nodes)


def rows_layout(spans: torch.Tensor, evaluated: torch.Tensor) -> VerificationLayout:
    """One layout row per evaluated ``(row, node)``: ``R = evaluated.sum()``, ``S = W``."""
    batch_rows, nodes = torch.nonzero(evaluated, as_tuple=True)
    count, width = batch_rows.shape[0], spans.shape[2]
    node_rows = torch.full(evaluated.shape, -1, dtype=torch.long, device=spans.device)
    node_rows[batch_rows, nodes] = torch.arange(count, device=spans.device)
    return VerificationLayout(
        input_ids=spans[batch_rows, nodes],
        source=batch_rows,
        segment=nodes.unsqueeze(1).expand(-1, width),
        span_position=torch.arange(width, device=spans.device).expand(count, -1),
        node_rows=node_rows,
        node_offsets=torch.zeros_like(node_rows),
        packed=False,
    )


def packed_layout(spans: torch.Tensor, evaluated: torch.Tensor, slots: int | None = None) -> VerificationLayout:
    """One layout row per batch row: the root's span, then the row's evaluated drafts, then
    padding up to the longest row: ``R = B``, ``S = W * max evaluated``; or with ``slots``
    (static shapes, ``>=`` every row's evaluated nodes) up to ``slots`` spans,
    ``S = W * slots``. Padding spans have segment ``-1``: no real column attends to them."""
    batch, nodes, width = spans.shape
    device = spans.device
    most = int(evaluated.sum(-1).max())
    if slots is None:
        slots = most
    elif most > slots:
        raise HookContractError(
            f"a row evaluates {most} nodes, more than the layout's {slots} slots per row"
        )
    order = torch.argsort((~evaluated).long(), dim=-1, stable=True)[:, :slots]  # node per slot
    filled = torch.gather(evaluated, 1, order)  # (B, slots)
    slot_of = torch.zeros(batch, nodes, dtype=torch.long, device=device)
    slot_of.scatter_(1, order, torch.arange(slots, device=device).expand(batch, -1))
    rows = torch.arange(batch, device=device)
    input_ids = spans[rows[:, None], order].reshape(batch, slots * width)
    segment = torch.where(filled, order, -1).repeat_interleave(width, dim=1)
    return VerificationLayout(
        input_ids=input_ids,
        source=rows,
        segment=segment,
        span_position=torch.arange(width, device=device).repeat(slots).expand(batch, -1),
        node_rows=torch.where(evaluated, rows[:, None], -1),
        node_offsets=torch.where(evaluated, slot_of * width, 0),
        packed=most > 1,
    )
