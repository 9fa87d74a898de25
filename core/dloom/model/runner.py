"""KV caching for block decoding (Fast-dLLM's prefix and dual cache), on ``transformers`` caches.

The decoder asks a :class:`BlockForward`, built once per generation, for "the logits of
every row's active block this step". Rows advance through their blocks independently, so
each row has its own active block (``start`` per row) and its own cache state. The cache
policy (:mod:`dloom.model.cache_policy`) decides how much of the sequence a row's forward
recomputes; with one that records (``"prefix"``, ``"dual"``), a row's first step in a block
is a full forward that also records the keys and values of every position, and its later
steps recompute the row's window alone (``"prefix"``: the block and everything after it;
``"dual"``: the block), reading every other position from that record. Without one
(``"none"``) every step is a forward over the whole sequence.

One call (:meth:`BlockForward.run`) serves every row: rows that need a full forward (block
start, or a refresh) get one, the others one cached forward over their windows: at most two
model calls, each row in exactly one of them. The windows of a cached forward have one width
for all rows (``K``, or for prefix the longest suffix, narrower rows padded with invisible
columns), and the record is kept at full length ``L`` with each row's stale window masked
out, so that rows in different blocks share one ``transformers`` cache.

Exactness. The cached keys and values are those of the block-start state. For a block-causal
model nothing before the block attends to the block, and nothing in the block attends to
what follows it, so prefix and dual caching give the logits an uncached forward gives (up to
floating-point summation order). For a bidirectional model the cached entries go stale as
the block is committed (they are refreshed once per block): caching is then approximate.
``refresh=k`` rebuilds the cache with a full forward every ``k`` forwards of a block, which
bounds how stale it gets (``k = 1`` is uncached decoding at cached-forward prices).

For a shifted model (the output at ``i`` predicts token ``i + 1``) the recomputed window
starts one position before the block, so that the block's logits come from fresh outputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dloom.errors import ConfigurationError, HookContractError
from dloom.hooks.cache_policies import cache_modes, cache_policy
from dloom.model.adapter import ModelAdapter
from dloom.model.attention import mask_from_block_ids, model_mask
from dloom.model.cache_policy import CachePolicy
from dloom.types import VerificationLayout

MAX_CACHE_REFRESH = 1 << 20
"""The largest ``cache_refresh`` (beyond a block's forwards any interval is the same as
``None``); every surface (Python, ``dloom generate``, ``dloom serve``, requests) is held to
it by :func:`check_refresh`."""


def check_refresh(policy: CachePolicy, refresh: int | None) -> None:
    """Refuse a ``refresh`` interval that is not an int in ``1 .. MAX_CACHE_REFRESH``, or one
    with a policy that records nothing.

    :raises ConfigurationError: naming the bad value and what is allowed.
    """
    if refresh is None:
        return
    if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
        raise ConfigurationError(f"cache_refresh is {refresh!r}; allowed: an int >= 1, or None")
    if refresh > MAX_CACHE_REFRESH:
        raise ConfigurationError(
            f"cache_refresh is {refresh}; allowed: at most {MAX_CACHE_REFRESH} (a larger interval is the "
            "same as None: one full forward per block)"
        )
    if not policy.records:
        recording = " or ".join(repr(name) for name in cache_modes(records=True))
        raise ConfigurationError(
            f"cache_refresh={refresh} needs cache={recording}; with cache={policy.name!r} every forward is full"
        )


class BlockForward:
    """Every row's active-block logits, one model forward per row per call, reusing keys and
    values as the cache policy says.

    Shapes: ``B`` rows, ``L`` sequence length, ``K`` block length, ``V`` vocabulary, ``W``
    the recomputed window of a cached forward.

    :param model: the model adapter; a policy that records needs a model whose forward takes
        a ``transformers`` cache (:attr:`ModelAdapter.cache_argument`).
    :param mode: a registered cache policy's name (:func:`dloom.hooks.cache_policies.cache_modes`)
        or a :class:`~dloom.model.cache_policy.CachePolicy`.
    :param padding_mask: ``(B, L)`` padding mask (1 = real token), or ``None`` when no row is
        padded.
    :param position_ids: ``(B, L)`` long.
    :param start: first column of each row's active block: an int (every row) or ``(B,)``.
    :param block_length: ``K``.
    :param refresh: with a cache, a row's forwards per full (cache-rebuilding) forward within
        a block: forward ``0, k, 2k, ...`` of the row's block is a full one (``None``: only
        the first).
    :param block_ids: ``(B, L)`` long block index of every position for a block-causal model
        (:mod:`dloom.model.attention`), ``None`` for a bidirectional one.
    :param static_width: ``None`` (the default) sizes every forward to what it needs; an int
        ``S`` gives static shapes (see "Static shapes" below): ``S`` is the last ``S``
        columns, which must hold every window any row will ever have (``L - S <=`` every
        row's first window start).

    Static shapes (``static_width``). For a fixed set of rows, every forward of a kind has
    the same shapes whatever the blocks: a full forward is ``(R, L)`` and computes the logits
    of the last ``S`` columns; a cached window is ``(R, W)`` with ``W = K + shift`` for dual
    and ``W = S`` for prefix (columns past ``L`` are invisible padding); the record is a
    ``(B, H, L + P, D)`` buffer per layer (``P`` the policy's slack columns, where a
    window's invisible columns write: ``S`` for prefix, 0 for dual), allocated at the batch's first full forward
    and from then on written in place: by every full forward (which runs on a
    ``DynamicCache``, bit-identical to the default path, and copies its keys and values in)
    and by every cached window, which writes its own at its columns (:func:`static_view`);
    the window's 4-D mask covers the whole record. A model
    compiled with ``torch.compile`` then reuses one graph per ``(rows, width)`` across steps
    and blocks. A cached query attends to the same keys and values as without static shapes,
    in another order (the window's own entries at their columns, not appended), and a full
    forward's head runs over more columns: logits agree up to floating-point rounding, and
    the decoded tokens and NFE match on the toy zoo (``tests/decode/test_static_shapes.py``). The
    cost: a prefix window stays ``S`` wide (it does not shrink as blocks advance), and full
    forwards compute ``S`` columns of logits instead of the active blocks'.

    Verification forwards (:meth:`evaluate`) with static shapes: the decoder pads every
    model call of a verification to one row count per batch
    (:func:`dloom.decode.speculation.static_call_rows`: copies of a real row, outputs dropped), and
    a packed layout has one span count. A rows layout's cached windows run on the static
    record as a cached step of some rows does: each layout row writes its window into its
    own copy of its source row's record (:func:`static_view` with ``rows``; the record
    itself is never written by a verification). A packed layout reads the record through
    :func:`record_view` instead: its appended spans sit at the block's positions, which
    the window already occupies, so they have no record column to be written at; the
    record is still the preallocated buffer (its first ``L`` columns, as views), and the
    keys a packed call attends to, the rows' record then the window and the spans, have
    one shape for a fixed set of rows.

    Settled columns (:meth:`settle`). A caller whose rows share a prefix that no row will
    change again (FailFast's drafter: the columns every row has accepted) may declare it
    instead of the per-row record above: every forward is then one model call of every row
    over the columns after the settled ones, reading their keys and values, kept across
    blocks and extended as columns settle (never rebuilt by a full forward).

    :ivar policy: the :class:`~dloom.model.cache_policy.CachePolicy` ``mode`` names: what
        this runner asks whether forwards read a record, how wide a cached window is, and
        how many slack columns a static record has.
    :ivar start: ``(B,)`` long, each row's active block; :meth:`advance` moves rows on.
    :ivar window_start: ``(B,)`` long, first recomputed column of a cached forward (one
        before the block for a shifted model).
    :ivar query_positions: positions each row recomputed in the last model call: ``L`` for a
        full forward, ``W`` for a cached one.
    """

    _full_mask: torch.Tensor | None  # the prepared 4-D attention mask (None: no padding, not block-causal)

    def __init__(
        self,
        model: ModelAdapter,
        mode: str | CachePolicy,
        padding_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        start: int | torch.Tensor,
        block_length: int,
        refresh: int | None = None,
        block_ids: torch.Tensor | None = None,
        static_width: int | None = None,
    ) -> None:
        self.policy = policy = cache_policy(mode)
        check_refresh(policy, refresh)
        self.model, self.refresh = model, refresh
        self.position_ids = position_ids
        self.block_length = block_length
        self.shift = model.shift
        batch, self.length = position_ids.shape
        device = position_ids.device
        self.block_columns: torch.Tensor  # (B, K) long, the columns of every row's active block
        self.window_start: torch.Tensor  # (B,) long
        self._window: tuple | None = None
        self.start = torch.as_tensor(start, dtype=torch.long, device=device).expand(batch).clone()
        self.static_width = None if static_width is None else min(static_width, self.length)
        # slack columns past L where a static window's invisible columns write
        self.slack = (
            0 if self.static_width is None
            else policy.static_slack(block_length, self.shift, self.static_width)
        )
        self._set_masks(padding_mask, block_ids)
        self.query_positions = 0
        self.calls = 0  # model calls
        self.row_forwards = 0  # rows over all model calls
        self._store: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._needs_full = torch.full((batch,), policy.records, dtype=torch.bool, device=device)
        self._on_cache = torch.zeros(batch, dtype=torch.long, device=device)
        self._settled: Any = None  # a transformers DynamicCache of the settled columns, once settle() is called
        self._settled_width = 0  # columns it holds
        self._settling = 0  # columns the next forward leaves in it (settle())
        if policy.records:
            model.check_takes_cache()

    def _set_masks(self, padding_mask: torch.Tensor | None, block_ids: torch.Tensor | None) -> None:
        """The padding and block layout of every row, and the 4-D mask of a full forward."""
        self.padding_mask, self.block_ids = padding_mask, block_ids
        batch, device = self.position_ids.shape[0], self.position_ids.device
        self._keys_ok = (
            torch.ones(batch, self.length, dtype=torch.bool, device=device)
            if padding_mask is None else padding_mask.bool()
        )
        # A prepared 4-D mask: transformers passes it through (its 2-D path costs a host
        # synchronisation per forward for a padded batch).
        if block_ids is not None:
            self._full_mask = model_mask(mask_from_block_ids(padding_mask, block_ids), self.model.model)
        elif padding_mask is not None:
            keys = padding_mask.bool()[:, None, None, :].expand(-1, 1, self.length, -1)
            self._full_mask = model_mask(keys, self.model.model)
        else:
            self._full_mask = None

    # --- per-row bookkeeping (device tensors only) -----------------------------------------

    @property
    def start(self) -> torch.Tensor:
        return self._start

    @start.setter
    def start(self, value: torch.Tensor) -> None:
        """Each row's block start, and what follows from it (computed once per change, read
        several times a step): :attr:`window_start` and :attr:`block_columns`."""
        self._start = value
        self.window_start = value - self.shift if self.shift else value
        self.block_columns = value.unsqueeze(1) + torch.arange(self.block_length, device=value.device)

    def pending_full(self) -> torch.Tensor:
        """``(B,)`` bool, rows whose next forward is a full one."""
        if self.refresh is None:
            return self._needs_full
        return self._needs_full | (self._on_cache >= self.refresh)

    def plan(self, staying: torch.Tensor | None = None) -> torch.Tensor:
        """``(3,)`` long on the device: rows due a full forward, and the first and last window
        start of any row (among ``staying``, ``(B,)`` bool, when rows are about to leave); the
        decoder reads them at its step's one host synchronisation and passes them to
        :meth:`run`."""
        full, starts = self.pending_full(), self.window_start
        if staying is not None:
            full = full & staying
            first = torch.where(staying, starts, self.length).min()
            last = torch.where(staying, starts, 0).max()
        else:
            first, last = starts.min(), starts.max()
        return torch.stack([full.sum(), first, last])

    def advance(self, moving: torch.Tensor) -> None:
        """Move the rows ``moving`` (``(B,)`` bool) on to their next block."""
        self.start = self.start + self.block_length * moving.long()
        if self.policy.records:
            self._needs_full = self._needs_full | moving

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order (rows that left the batch)."""
        assert self._settled is None, "rows leave a runner with settled columns"
        self.position_ids = self.position_ids[index]
        self.start = self.start[index]
        self._window = None
        self._keys_ok = self._keys_ok[index]
        if self.padding_mask is not None:
            self.padding_mask = self.padding_mask[index]
        if self.block_ids is not None:
            self.block_ids = self.block_ids[index]
        if self._full_mask is not None:
            self._full_mask = self._full_mask[index]
        self._needs_full = self._needs_full[index]
        self._on_cache = self._on_cache[index]
        if self._store is not None:
            self._store = [(k[index], v[index]) for k, v in self._store]

    def join(
        self, padding_mask: torch.Tensor | None, position_ids: torch.Tensor, start: torch.Tensor,
        block_ids: torch.Tensor | None, widened: int,
    ) -> None:
        """Rows join the batch (:class:`dloom.decode.session.DecodeSession`): ``J`` new rows
        after the ``B`` rows here, all ``L' = L + widened`` columns wide.

        The rows here were widened by ``widened`` padding columns on the left (a longer
        prompt joined): their block starts and recorded keys and values move with them
        (the new columns are padding, never attended to), so their next forwards are the
        ones they would have run. The joining rows have nothing recorded: their first
        forward is a full one (it records their keys and values, as a row's first forward
        in a new generation does).

        :param padding_mask: ``(B + J, L')``, or ``None`` when no row is padded.
        :param position_ids: ``(B + J, L')`` long.
        :param start: ``(J,)`` long, the joining rows' first block column.
        :param block_ids: ``(B + J, L')`` long for a block-causal model, else ``None``.
        :param widened: columns added on the left of the rows here (``>= 0``).
        """
        assert self._settled is None, "rows join a runner with settled columns"
        joining = start.shape[0]
        device = start.device
        self.position_ids, self.length = position_ids, position_ids.shape[1]
        self.start = torch.cat([self.start + widened, start])
        self._window = None
        self._needs_full = torch.cat(
            [self._needs_full, torch.full((joining,), self.policy.records, dtype=torch.bool, device=device)]
        )
        self._on_cache = torch.cat([self._on_cache, torch.zeros(joining, dtype=torch.long, device=device)])
        if self._store is not None:
            self._store = [(_grow(keys, widened, joining), _grow(values, widened, joining)) for keys, values in self._store]
        self._set_masks(padding_mask, block_ids)

    # --- forwards ---------------------------------------------------------------------------

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`run` with its plan read here (one host synchronisation; the decoder reads
        the plan at its own step synchronisation instead)."""
        n_full, first, last = self.plan().tolist()
        return self.run(tokens, n_full, first, last)[0]

    def run(
        self, tokens: torch.Tensor, n_full: int, first_window: int, last_window: int,
        cached: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's forwards: a full forward for the ``n_full`` rows that need one (all of
        them without a cache), a cached forward for the others.

        :param tokens: ``(B, L)`` long, the current state of every row.
        :param n_full: / :param first_window: / :param last_window: the entries of
            :meth:`plan`; logits are computed for columns ``first_window`` to
            ``last_window + K`` only, where the model takes ``logits_to_keep``.
        :param cached: ``False`` runs the full forward only (the others are then verified by
            :meth:`evaluate`).
        :return: ``(B, K, V)`` logits, entry ``i`` the distribution of token
            ``start + i`` (zeros for rows not run), and ``(B,)`` bool, the rows of the full
            forward.
        """
        if self._settled is not None:
            return self._settled_forward(tokens), torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        batch = tokens.shape[0]
        keep = self._kept(first_window, last_window)
        if not self.policy.records:
            raw = self._run(tokens, self._full_mask, self.position_ids, None, keep)
            picked = self._pick(raw, self.window_start, keep)
            return picked, torch.ones(batch, dtype=torch.bool, device=tokens.device)
        if n_full == 0:  # every row on its record (no row selection needed)
            out = None
            if cached:
                out = self._window_forward(tokens, None, first_window)[:, : self.block_length]
                self._on_cache = self._on_cache + 1
            return out, torch.zeros(batch, dtype=torch.bool, device=tokens.device)  # type: ignore[return-value]
        self._window = None  # some row moved on (or refreshes): its window moves
        if n_full == batch:
            return self._full_forward(tokens, None, True, keep), torch.ones(batch, dtype=torch.bool, device=tokens.device)
        full = self.pending_full()
        order = torch.argsort((~full).long(), stable=True)
        full_rows, cached_rows = order[:n_full], order[n_full:]
        block = self._full_forward(tokens, full_rows, False, keep)
        out = block.new_zeros(batch, *block.shape[1:]).index_copy_(0, full_rows, block)
        if cached:
            raw = self._window_forward(tokens[cached_rows], cached_rows, first_window)
            out.index_copy_(0, cached_rows, raw[:, : self.block_length])
            self._on_cache = self._on_cache + (~full).long()
        return out, full

    def run_next(
        self, tokens: torch.Tensor, n_full: int, first_window: int, last_window: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run` without a cache that also returns every row's next block's logits,
        from the same forward (what the row's first step in its next block would read, if
        its tokens stay as they are): the head runs over ``K`` more columns than
        :meth:`run`'s, nothing else is computed.

        :param tokens: / :param n_full: / :param first_window: / :param last_window: as in
            :meth:`run` (every row's forward is a full one).
        :return: ``(B, K, V)`` the active blocks' logits, as :meth:`run` gives them, and
            ``(B, K, V)`` those of the ``K`` columns after each row's block (columns past the
            sequence's end read its last column: a row whose next block would pass the end
            has none).
        :raises ConfigurationError: with a cache that records, static shapes or settled
            columns (their forwards do not compute the next block as the next step would).
        """
        if self.policy.records or self.static_width is not None or self._settled is not None:
            raise ConfigurationError(
                f"next-block logits come from an uncached forward of dynamic shapes; this runner has "
                f"cache={self.policy.name!r}, static_width={self.static_width!r}"
                f"{', settled columns' if self._settled is not None else ''}"
            )
        keep = (first_window, min(last_window + 2 * self.block_length, self.length))
        raw = self._run(tokens, self._full_mask, self.position_ids, None, keep)
        logits = self._pick(raw, self.window_start, keep)
        offset = keep[0] if self.model.takes_logits_to_keep else 0
        columns = self.window_start.unsqueeze(1) + torch.arange(
            self.block_length, 2 * self.block_length, device=raw.device
        )
        following = torch.take_along_dim(raw, (columns - offset).clamp(max=raw.shape[1] - 1).unsqueeze(-1), dim=1)
        return logits, following

    def _kept(self, first_window: int, last_window: int) -> tuple[int, int]:
        """The columns whose logits a full forward computes: the rows' windows, or with static
        shapes always the last ``static_width``."""
        if self.static_width is not None:
            return self.length - self.static_width, self.length
        return first_window, last_window + self.block_length

    def _full_forward(
        self, tokens: torch.Tensor, rows: torch.Tensor | None, every: bool, keep: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """A full forward of ``rows`` (every row when ``every``; ``rows`` is then unused)
        that records their keys and values; their block logits (computed for columns
        ``keep`` only, where the model allows)."""
        pick = (lambda t: t) if every else (lambda t: None if t is None else t[rows])
        raw = self._record(pick(tokens), pick(self._full_mask), pick(self.position_ids), rows, every, keep)
        if every:
            self._needs_full = torch.zeros_like(self._needs_full)
            self._on_cache = torch.ones_like(self._on_cache)
            return self._pick(raw, self.window_start, keep)
        assert rows is not None, "a full forward of some rows names them"
        self._needs_full = self._needs_full.index_fill(0, rows, False)
        self._on_cache = self._on_cache.index_fill(0, rows, 1)
        return self._pick(raw, self.window_start if every else self.window_start[rows], keep)

    def _record(self, tokens, attention_mask, position_ids, rows, every, keep) -> torch.Tensor:
        """A full forward through a ``DynamicCache``, whose keys and values become the record
        (all of it, or ``rows`` of it); its raw outputs. With static shapes the record is
        preallocated at ``(B, H, L + P, D)`` on the batch's first full forward and written in
        place by the later ones."""
        from transformers import DynamicCache

        if every and self.static_width is None:
            self._store = None  # replaced whole: the old record need not live through this forward
        cache = DynamicCache()
        raw = self._run(tokens, attention_mask, position_ids, cache, keep)
        layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (layer.keys, layer.values) for layer in cache.layers  # type: ignore[union-attr, misc]  # full-attention layers
        ]
        if self._store is None and self.static_width is not None:
            self._store = [(_slack(keys, self.slack), _slack(values, self.slack)) for keys, values in layers]
        elif every and self.static_width is None:
            self._store = layers
        else:
            assert self._store is not None, "the batch's first full forward holds every row"
            for (keys, values), (new_keys, new_values) in zip(self._store, layers):
                for record, new in ((keys, new_keys), (values, new_values)):
                    if every:
                        record[:, :, : self.length].copy_(new)
                    else:
                        record[:, :, : self.length].index_copy_(0, rows, new)
        return raw

    def _kept_columns(self, keep: tuple[int, int] | None) -> torch.Tensor | None:
        """``(Q',)`` long, the columns ``keep`` whose outputs a forward computes (``None``: all,
        also for a model that does not take ``logits_to_keep``)."""
        if keep is None or not self.model.takes_logits_to_keep:
            return None
        return torch.arange(keep[0], min(keep[1], self.length), device=self.position_ids.device)

    def _pick(self, raw: torch.Tensor, starts: torch.Tensor, keep: tuple[int, int] | None) -> torch.Tensor:
        """``(R, K, V)`` block logits out of raw outputs over all columns, or over the kept
        columns from ``keep[0]`` on."""
        if keep is not None and self.model.takes_logits_to_keep:
            starts = starts - keep[0]
        columns = starts.unsqueeze(1) + torch.arange(self.block_length, device=raw.device)
        return torch.take_along_dim(raw, columns.unsqueeze(-1), dim=1)

    def _count(self, tokens: torch.Tensor) -> None:
        self.query_positions = tokens.shape[1]
        self.calls += 1
        self.row_forwards += tokens.shape[0]

    def _run(self, tokens, attention_mask, position_ids, cache=None, keep=None) -> torch.Tensor:
        """Raw (unshifted) logits ``(B, Q, V)`` of one counted forward that reads and extends
        ``cache`` (``None``: uncached), computed for columns ``keep`` where the model allows."""
        self._count(tokens)
        return self.model.raw_logits(
            tokens, attention_mask, position_ids, cache=cache, logits_to_keep=self._kept_columns(keep)
        )

    def query_width(self, first_window: int) -> int:
        """Tokens one layout row's forward computes in :meth:`evaluate`: the whole sequence
        when the policy records nothing, the window when it does, the columns after the
        settled ones when there are (:meth:`settle`)."""
        if self._settled is not None:
            return self.length - self._settled_width
        return self.window_width(first_window)

    def window_width(self, first_window: int) -> int:
        """``W``, the policy's (:meth:`dloom.model.cache_policy.CachePolicy.window_width`):
        for dual the block (and the column before it, shifted), for prefix everything from
        the earliest window start on."""
        return self.policy.window_width(
            self.length, self.block_length, self.shift, first_window, self.static_width
        )

    def _windows(self, rows: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(R, W)`` columns of the rows' windows (clamped into the sequence) and which of
        them are real (a prefix window is narrower for a row further on)."""
        starts = self.window_start if rows is None else self.window_start[rows]
        columns = starts.unsqueeze(1) + torch.arange(width, device=starts.device)
        return columns.clamp(max=self.length - 1), columns < self.length

    def _allowed(self, rows: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``(R, Q, C)`` bool: the model's own attention from columns ``query`` (``(R, Q)``) to
        columns ``key`` (``(R, C)``): keys that are not padding, in blocks not after the query's."""
        keys_ok = self._keys_ok if rows is None else self._keys_ok[rows]
        allowed = torch.gather(keys_ok, 1, key).unsqueeze(1).expand(-1, query.shape[1], -1)
        if self.block_ids is not None:
            ids = self.block_ids if rows is None else self.block_ids[rows]
            allowed = allowed & (
                torch.gather(ids, 1, key).unsqueeze(1) <= torch.gather(ids, 1, query).unsqueeze(2)
            )
        return allowed

    def _row_cache(self, rows: torch.Tensor | None):
        """A read-only view of the recorded keys and values of ``rows`` (``None``: every
        row), for one cached forward (:func:`record_view`: no copy of the record)."""
        assert self._store is not None, "a cached forward before the full forward that records it"
        if self.slack:  # the static record's first L columns (views)
            return record_view([(k[..., : self.length, :], v[..., : self.length, :]) for k, v in self._store], rows)
        return record_view(self._store, rows)

    def _window_forward(self, tokens: torch.Tensor, rows: torch.Tensor | None, first_window: int) -> torch.Tensor:
        """A forward over the rows' windows alone, reading every other position from the
        record: raw outputs ``(R, W, V)``.

        :param tokens: ``(R, L)``, the rows' current state.
        :param rows: the rows (``None``: every row, in order).
        """
        memo = self._window if rows is None else None
        if memo is not None and memo[0] == first_window:  # every row in its block as before
            _, columns, positions, mask, targets = memo
        else:
            columns, positions, mask, targets = self._window_layout(tokens, rows, first_window)
            if rows is None:
                self._window = (first_window, columns, positions, mask, targets)
        if targets is None:
            cache = self._row_cache(rows)
        else:
            assert self._store is not None, "a cached forward before the full forward that records it"
            cache = static_view(self._store, rows, targets)
        return self._run(torch.gather(tokens, 1, columns), mask, positions, cache)

    def _window_layout(self, tokens: torch.Tensor, rows: torch.Tensor | None, first_window: int):
        """What a window forward of ``rows`` takes besides the tokens, the same for every
        step of the rows' blocks (memoised for all rows until a row moves on): the ``(R, W)``
        columns and their positions, the model's 4-D mask, and with static shapes the record
        columns the window writes (``None`` without).

        Without static shapes the mask covers the record (less the window's stale entries)
        then the window's own keys; with them, the record of ``L + P`` columns, where the
        window writes its keys at its own columns (an invisible column into the slack past
        ``L``)."""
        width = self.window_width(first_window)
        columns, real = self._windows(rows, width)
        positions = self.position_ids if rows is None else self.position_ids[rows]
        keys = torch.arange(self.length, device=tokens.device).expand(len(tokens), -1)
        targets = None
        if self.static_width is not None:
            count = len(columns)
            mask = self._allowed(rows, columns, keys)
            if self.slack:
                mask = torch.cat([mask, mask.new_zeros(count, width, self.slack)], dim=2)
            targets = torch.where(real, columns, self.length + torch.arange(width, device=columns.device))
        else:
            starts = columns[:, :1]
            stale = (keys >= starts) & (keys < starts + width)  # recorded, but recomputed here
            recorded = self._allowed(rows, columns, keys) & ~stale.unsqueeze(1)
            fresh = self._allowed(rows, columns, columns) & real.unsqueeze(1)
            mask = torch.cat([recorded, fresh], dim=2)
        return columns, torch.gather(positions, 1, columns), model_mask(mask.unsqueeze(1), self.model.model), targets

    # --- verification forwards (speculative decoding) --------------------------------------

    def evaluate(self, tokens: torch.Tensor, layout: VerificationLayout, first_window: int) -> torch.Tensor:
        """One forward over a verification layout; its raw outputs at the layout's columns.

        With a cache, every row's record must be current (no full forward pending). The spans
        cover ``[window_start, start + K)`` of their source row: the block, and for a shifted
        model the column before it.

        :param tokens: ``(B, L)`` long, the current state of every row.
        :param layout: spans, their source rows and where they sit
            (:class:`~dloom.types.VerificationLayout`).
        :param first_window: the second entry of :meth:`plan`.
        :return: ``(R, S, V)``, the outputs at every layout column: the first ``K`` columns
            of a span are its block's logits; with ``layout.next_block`` (a rows layout
            without a cache) ``K`` more columns follow each row's span, the next block's
            logits on that row's state.

        With static shapes (``static_width``) a rows layout's windows read and write a copy
        of the static record (:func:`static_view`) and a packed layout reads the record
        (:func:`record_view`); see "Verification forwards" in the class docstring.
        """
        width = self.block_length + self.shift
        source = layout.source
        span = self.window_start[source].unsqueeze(1) + torch.arange(width, device=tokens.device)
        primary = tokens[source].scatter(1, span, layout.input_ids[:, :width])
        if layout.next_block and (layout.packed or self.policy.records):
            raise HookContractError(
                f"a verification layout asked for next-block logits with cache {self.policy.name!r}"
                f"{' and packed spans' if layout.packed else ''}; only a rows layout without a "
                "cache computes them (the whole canvas is in its forward)"
            )
        if self._settled is not None:
            return self._settled_evaluate(tokens, layout)
        if not layout.packed:
            if not self.policy.records:
                mask = None if self._full_mask is None else self._full_mask[source]
                # outputs from the first window on (every span starts there or later; the
                # prompt's columns are not computed), or with static shapes the plain steps' columns
                keep = self._kept(first_window, self.length - self.block_length)
                raw = self._run(primary, mask, self.position_ids[source], keep=keep)
                if layout.next_block:  # and the next block's K columns (clamped at the end)
                    further = span[:, -1:] + torch.arange(1, self.block_length + 1, device=tokens.device)
                    span = torch.cat([span, further.clamp(max=self.length - 1)], dim=1)
                if self.model.takes_logits_to_keep:
                    span = span - keep[0]
                return torch.take_along_dim(raw, span.unsqueeze(-1), dim=1)
            return self._window_forward(primary, source, first_window)[:, :width]
        return self._packed(primary, layout, width, span, first_window)

    def _packed(self, primary, layout, width, span, first_window) -> torch.Tensor:
        """Raw outputs of a packed layout: the context once, further spans appended to it."""
        device = primary.device
        source = layout.source
        count = len(source)
        appended = layout.input_ids[:, width:]
        if not self.policy.records:
            recomputed = torch.arange(self.length, device=device).expand(count, -1)
            real = torch.ones_like(recomputed, dtype=torch.bool)
            cached = recomputed[:, :0]
        else:
            recomputed, real = self._windows(source, self.window_width(first_window))
            cached = torch.arange(self.length, device=device).expand(count, -1)
        starts = span[:, :1]
        span_positions = starts + layout.span_position[:, width:].clamp(0, width - 1)
        # Column of every query (R, Q) and key (R, C + Q).
        query_abs = torch.cat([recomputed, span_positions], dim=1)
        key_abs = torch.cat([cached, query_abs], dim=1)
        n_cached, n_recomputed = cached.shape[1], recomputed.shape[1]
        # Segment of every query and key: 0 for the context and the first span, the node
        # index + 1 for appended spans (-1 + 1 = 0 never occurs: padding gets -1).
        appended_segment = torch.where(layout.segment[:, width:] >= 0, layout.segment[:, width:] + 1, -1)
        query_segment = torch.cat(
            [torch.zeros(count, n_recomputed, dtype=torch.long, device=device), appended_segment], dim=1
        )
        key_segment = torch.cat(
            [torch.zeros(count, n_cached, dtype=torch.long, device=device), query_segment], dim=1
        )
        window_first = recomputed[:, :1]
        stale = (cached >= window_first) & (cached < window_first + n_recomputed)
        key_real = torch.cat([~stale, real, appended_segment >= 0], dim=1)
        allowed = self._allowed(source, query_abs, key_abs) & key_real.unsqueeze(1)
        in_window = (key_abs >= starts) & (key_abs < starts + width)
        from_context = (key_segment == 0).unsqueeze(1) & (
            (query_segment == 0).unsqueeze(2) | ~in_window.unsqueeze(1)
        )
        own_span = (key_segment.unsqueeze(1) == query_segment.unsqueeze(2)) & (
            query_segment != 0
        ).unsqueeze(2)
        mask = (allowed & (from_context | own_span)).unsqueeze(1)
        inputs = torch.cat([torch.gather(primary, 1, recomputed), appended], dim=1)
        positions = torch.gather(self.position_ids[source], 1, query_abs)
        model_input = model_mask(mask, self.model.model)
        cache = self._row_cache(source) if self.policy.records else None
        raw = self._run(inputs, model_input, positions, cache)
        first = torch.take_along_dim(raw, (span - window_first).unsqueeze(-1), dim=1)
        return torch.cat([first, raw[:, n_recomputed:]], dim=1)

    # --- settled columns ---------------------------------------------------------------------

    def settle(self, column: int) -> None:
        """Declare the columns before ``column`` final in every row: the next forward keeps
        the keys and values it computes for them (up to ``column - shift``: on a shifted
        model the column before a block stays recomputed, as a window's does), and every
        forward from the first call on recomputes only the columns after the kept ones,
        one model call of every row reading them (see "Settled columns" in the class
        docstring). The plan arguments of :meth:`run` then do not apply: every row's
        forward is the same and none is a full one.

        Exactness. A kept entry is never recomputed: on a bidirectional model it is the one
        computed when its column settled, when later columns held other tokens, so the
        logits are approximate (as a prefix cache's are, here without a per-block refresh);
        on a block-causal model, settled at a block boundary, they are exact.

        :param column: a host int, ``0 <= column <= L``; a column before the kept ones
            keeps what is kept (the record only grows).
        :raises ConfigurationError: for a policy that records nothing or fixes the context
            (the forward recomputes every column after the settled ones), naming the
            policies that can, or for a runner with static shapes.
        """
        policy = self.policy
        if not policy.records or policy.fixed_context or self.static_width is not None:
            settling = ", ".join(repr(name) for name in settling_cache_modes())
            raise ConfigurationError(
                f"settled columns need a cache that records and recomputes every column after "
                f"them, without static shapes; got cache={policy.name!r}"
                f"{'' if self.static_width is None else f' and static_width={self.static_width}'}; "
                f"allowed: cache={settling}"
            )
        if self._settled is None:
            from transformers import DynamicCache

            self._settled = DynamicCache()
        self._settling = max(self._settled_width, column - self.shift)

    def _settled_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """One forward of every row over the columns after the settled record, which then
        keeps the columns before the last :meth:`settle`'s; ``(B, K, V)`` block logits (a
        block column that is settled gets the first recomputed column's)."""
        kept = self._settled_width
        raw = self._run(tokens[:, kept:], self.padding_mask, self.position_ids[:, kept:], self._settled)
        dropped = tokens.shape[1] - self._settling  # the record now holds every column
        if dropped:
            self._settled.crop(-dropped)
        self._settled_width = self._settling
        index = self.window_start.unsqueeze(1) - kept + torch.arange(self.block_length, device=raw.device)
        return torch.take_along_dim(raw, index.clamp(0, raw.shape[1] - 1).unsqueeze(-1), dim=1)

    def _settled_evaluate(self, tokens: torch.Tensor, layout: VerificationLayout) -> torch.Tensor:
        """:meth:`evaluate` over the settled record (read, not extended): every layout row
        recomputes the columns after it, a packed layout one span per forward row (exact:
        no span sees another)."""
        width = self.block_length + self.shift
        source, ids = layout.source, layout.input_ids
        slots = ids.shape[1] // width
        if layout.packed:
            source = source.repeat_interleave(slots)
            ids = ids.reshape(-1, width)
        span = self.window_start[source].unsqueeze(1) + torch.arange(width, device=tokens.device)
        primary = tokens[source].scatter(1, span, ids[:, :width])
        kept = self._settled_width
        mask = None if self.padding_mask is None else self.padding_mask[source]
        store: list[tuple[torch.Tensor, torch.Tensor]] = [
            (layer.keys, layer.values) for layer in self._settled.layers  # type: ignore[union-attr, misc]  # full-attention layers
        ]
        raw = self._run(primary[:, kept:], mask, self.position_ids[source, kept:], record_view(store, source))
        picked = torch.take_along_dim(raw, (span - kept).clamp(min=0).unsqueeze(-1), dim=1)
        return picked.reshape(layout.input_ids.shape[0], slots * width, -1) if layout.packed else picked


def settling_cache_modes() -> tuple[str, ...]:
    """The registered cache policies a runner can keep settled columns under
    (:meth:`BlockForward.settle`): those that record and do not fix the context (a settled
    runner's forward recomputes every column after the settled ones), the built-ins first."""
    return tuple(
        name for name in cache_modes(records=True) if not cache_policy(name).fixed_context
    )


def _slack(recorded: torch.Tensor, columns: int) -> torch.Tensor:
    """Recorded keys or values ``(B, H, L, D)`` in a new ``(B, H, L + columns, D)`` buffer
    (zeros after them)."""
    batch, heads, length, width = recorded.shape
    buffer = recorded.new_zeros(batch, heads, length + columns, width)
    buffer[:, :, :length] = recorded
    return buffer


def _grow(recorded: torch.Tensor, columns: int, rows: int) -> torch.Tensor:
    """Recorded keys or values ``(B, H, L, D)`` with ``columns`` zero columns on the left
    and ``rows`` zero rows after the last: ``(B + rows, H, columns + L, D)``."""
    batch, heads, length, width = recorded.shape
    grown = recorded.new_zeros(batch + rows, heads, columns + length, width)
    grown[:batch, :, columns:] = recorded
    return grown


@functools.cache
def _record_layer() -> type:
    """The cache layer class of :func:`record_view` (defined on first use: ``transformers`` is
    imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class RecordLayer(DynamicLayer):
        """One layer of a :func:`record_view`: the record's ``(B, H, L, D)`` keys and values,
        read for ``rows`` (``None``: every row) and never written."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None) -> None:
            super().__init__()
            self.keys, self.values, self.rows = keys, values, rows
            self.device = keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """The keys and values the window attends to: the rows' record, then the window's
            own ``(R, H, W, D)`` entries; built while this layer runs, the record unchanged."""
            rows = self.rows
            if rows is None:
                return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
            return self._gather(self.keys, key_states, rows), self._gather(self.values, value_states, rows)

        def _gather(self, record: torch.Tensor, window: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            """``(R, H, L + W, D)``: the rows' record then ``window``, in one allocation."""
            length = record.shape[-2]
            out = window.new_empty(*window.shape[:-2], length + window.shape[-2], window.shape[-1])
            torch.index_select(record, 0, rows, out=out[..., :length, :])
            out[..., length:, :] = window
            return out

    return RecordLayer


def record_view(store: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor | None):
    """A ``transformers`` cache reading a record, for one cached forward, without copying it.

    A ``DynamicCache`` built from the record copies every layer's ``(B, H, L, D)`` keys and
    values at construction and keeps each layer's concatenation with the window until the
    forward returns: two copies of the whole record, and for a verification forward one per
    layout row (rows sharing a batch row's context). Here each layer reads the record: the
    rows' keys and values are gathered only while that layer attends, so at most one layer's
    ``(R, H, L + W, D)`` is alive beyond the record. The attention sees the same values, so
    the logits are bit-identical (``tests/model/test_runner.py``).

    :param store: per layer, the recorded ``(B, H, L, D)`` keys and values.
    :param rows: ``(R,)`` long, the batch row each forward row reads (repeats allowed), or
        ``None`` for every row in order.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    layer = _record_layer()
    cache.layers = [layer(keys, values, rows) for keys, values in store]
    cache.layer_class_to_replicate = None
    return cache


@functools.cache
def _static_layer() -> type:
    """The cache layer class of :func:`static_view` (defined on first use: ``transformers``
    is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class StaticRecordLayer(DynamicLayer):
        """One layer of a :func:`static_view`: the preallocated ``(B, H, N, D)`` record,
        written in place at given columns."""

        def __init__(
            self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None, columns: torch.Tensor
        ) -> None:
            super().__init__()
            self.keys, self.values, self.rows, self.columns = keys, values, rows, columns
            self.length = keys.shape[-2]
            self.device = keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """Write the window's ``(R, H, W, D)`` keys and values at its columns and attend to
            the whole record (the rows' copy when ``rows`` is given, so that rows repeating
            one batch row each see their own window)."""
            index = self.columns[:, None, :, None]
            if self.rows is None:
                keys, values = self.keys, self.values
            else:
                keys, values = self.keys.index_select(0, self.rows), self.values.index_select(0, self.rows)
            keys.scatter_(2, index.expand_as(key_states), key_states)
            values.scatter_(2, index.expand_as(value_states), value_states)
            return keys, values

        def get_seq_length(self) -> int:
            return self.length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length, 0

    return StaticRecordLayer


def static_view(store: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor | None, columns: torch.Tensor):
    """A ``transformers`` cache over a preallocated record for a cached forward of static
    shapes (:class:`BlockForward`'s ``static_width``): each layer writes the window's keys
    and values at its columns and the window attends to the whole record.

    ``transformers``' own ``StaticCache`` does not fit: it appends at one position shared by
    the whole batch, while here every row rewrites its own window (rows sit in different
    blocks), and a step's rows may be a subset of the batch or repeat a row (verification).

    :param store: per layer, the record's ``(B, H, N, D)`` keys and values.
    :param rows: ``(R,)`` long, the batch row each forward row reads, or ``None`` for every
        row in order: then the window is written into the record itself (in place, no copy);
        else into a copy of the rows' record (repeats allowed).
    :param columns: ``(R, W)`` long, the record column of each window position, distinct
        within a row, ``< N``.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    layer = _static_layer()
    cache.layers = [layer(keys, values, rows, columns) for keys, values in store]
    cache.layer_class_to_replicate = None
    return cache
