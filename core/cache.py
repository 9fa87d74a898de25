"""KV caching for block decoding (Fast-dLLM's prefix and dual cache), on ``transformers`` caches.

The decoder asks a :class:`BlockForward`, built at the start of every block for the rows
still decoding, for "the logits of the active block this step". Each call is one forward of
the model (one NFE). The cache mode decides how much of the sequence that forward recomputes:

- ``"none"``: every step is a forward over the whole sequence.
- ``"prefix"``: the first step of the block is a full forward that also fills a
  :class:`transformers.DynamicCache`; the keys and values of every position before the block
  are kept, and the block's later steps recompute the block and everything after it.
- ``"dual"``: the block-start forward also keeps the keys and values of the positions after
  the block; later steps recompute the block alone.

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

import inspect

import torch

from dloom.adapter import ModelAdapter
from dloom.attention import model_mask
from dloom.errors import ConfigurationError, ModelError
from dloom.types import VerificationLayout

CACHE_MODES = ("none", "prefix", "dual")


def cache_argument(model: torch.nn.Module) -> str | None:
    """The name under which ``model``'s forward takes a KV cache, or ``None`` if it takes none.

    ``transformers`` 5 models call it ``cache`` (``past_key_values`` is deprecated there);
    older and remote-code models call it ``past_key_values``.
    """
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return None


def check_refresh(mode: str, refresh: int | None) -> None:
    """Refuse a ``refresh`` interval that is not a positive int, or one without a cache.

    :raises ConfigurationError: naming the bad value and what is allowed.
    """
    if refresh is None:
        return
    if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
        raise ConfigurationError(f"cache_refresh is {refresh!r}; allowed: an int >= 1, or None")
    if mode == "none":
        raise ConfigurationError(
            f"cache_refresh={refresh} needs cache='prefix' or 'dual'; with cache='none' every forward is full"
        )


class BlockForward:
    """The active block's logits, one model forward per call, reusing keys and values per mode.

    Built at block start, after the batch was compacted to the rows still decoding; those rows
    stay fixed for the whole block. Shapes: ``B`` rows, ``L`` sequence length, ``K`` block
    length, ``V`` vocabulary.

    :param model: the model adapter; ``prefix`` and ``dual`` need a model whose forward takes
        a ``transformers`` cache (:func:`cache_argument`).
    :param mode: one of :data:`CACHE_MODES`.
    :param attention_mask: for the whole sequence: ``None`` (bidirectional, no padding), a
        ``(B, L)`` padding mask (1 = real token), or a ``(B, 1, L, L)`` bool mask (``True`` =
        query may attend to key; block-causal models, :func:`dloom.attention.block_causal_mask`).
    :param position_ids: ``(B, L)`` long.
    :param start: first position of the active block.
    :param end: one past its last position.
    :param refresh: with a cache, the block's forwards per full (cache-rebuilding) forward:
        forward ``0, k, 2k, ...`` of the block is a full forward (``None``: only the first).

    :ivar query_positions: positions each row recomputed in the last call: ``L`` for a full
        forward, ``L - start`` (prefix) or ``K`` (dual) for a cached one (one more for a
        shifted model).
    """

    def __init__(
        self,
        model: ModelAdapter,
        mode: str,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        start: int,
        end: int,
        refresh: int | None = None,
    ) -> None:
        if mode not in CACHE_MODES:
            raise ConfigurationError(f"cache is {mode!r}; allowed: {', '.join(CACHE_MODES)}")
        check_refresh(mode, refresh)
        self.refresh = refresh
        self._forwards_on_cache = 0
        self.model = model
        self.mode = mode
        self.position_ids = position_ids
        self.start, self.end = start, end
        self.query_positions = 0
        length = position_ids.shape[1]
        self._attention_mask = attention_mask
        self._full_mask = attention_mask
        if attention_mask is not None and attention_mask.dim() == 4:
            self._full_mask = model_mask(attention_mask, model.model)
        self._cache = None
        self.window_start = start - int(model.shift_logits)
        if mode == "none":
            return
        self._argument = cache_argument(model.model)
        if self._argument is None:
            raise ModelError(
                f"model {model.name!r} does not take a KV cache; use cache='none'"
            )
        device = position_ids.device
        # Recomputed window [window_start, window_end) of every cached step.
        self.window_end = length if mode == "prefix" else end
        kept_before = torch.arange(self.window_start, device=device)
        kept_after = torch.arange(self.window_end, length, device=device)
        window = torch.arange(self.window_start, self.window_end, device=device)
        # The cache holds [0, window_start) then [window_end, L); the window's keys follow.
        self._key_order = torch.cat([kept_before, kept_after, window])
        self._step_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            self._step_mask = attention_mask[:, self._key_order]
        elif attention_mask is not None:
            self._step_mask = model_mask(
                attention_mask[:, :, window][..., self._key_order], model.model
            )

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run one forward on the current state and return the block's logits.

        :param tokens: ``(B, L)`` long, the current state of the rows of this block.
        :return: ``(B, K, V)`` logits of positions ``start .. end - 1``, aligned so that
            entry ``i`` is the distribution of token ``start + i``.
        """
        if self.mode == "none":
            self.query_positions = tokens.shape[1]
            logits = self.model.logits(tokens, self._full_mask, self.position_ids)
            return logits[:, self.start : self.end]
        if self._cache is None or (self.refresh is not None and self._forwards_on_cache >= self.refresh):
            return self._block_start(tokens)
        self._forwards_on_cache += 1
        return self._cached_step(tokens)

    def _run(self, tokens, attention_mask, position_ids, cache) -> torch.Tensor:
        """Raw (unshifted) logits ``(B, Q, V)`` of one forward that reads and extends ``cache``."""
        self.query_positions = tokens.shape[1]
        with torch.no_grad():
            out = self.model.model(
                input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, **{self._argument: cache},
            )
        return out.logits if hasattr(out, "logits") else out[0]

    def _block_start(self, tokens: torch.Tensor) -> torch.Tensor:
        """The full forward of the block's first step; keeps the keys and values to reuse."""
        from transformers import DynamicCache

        cache = DynamicCache()
        raw = self._run(tokens, self._full_mask, self.position_ids, cache)
        if self.mode == "prefix":
            cache.crop(-(tokens.shape[1] - self.window_start))
        else:
            cache = DynamicCache(
                ddp_cache_data=[
                    (self._keep(layer.keys), self._keep(layer.values)) for layer in cache.layers
                ]
            )
        self._cache = cache
        self._forwards_on_cache = 1
        return raw[:, self.window_start : self.window_start + self.end - self.start]

    def _keep(self, states: torch.Tensor) -> torch.Tensor:
        """``(B, H, L, D)`` states -> those of ``[0, window_start)`` then ``[window_end, L)``."""
        return torch.cat(
            [states[:, :, : self.window_start], states[:, :, self.window_end :]], dim=2
        )

    def _cached_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """A forward over the window alone, reading the other positions from the cache."""
        window = slice(self.window_start, self.window_end)
        raw = self._run(tokens[:, window], self._step_mask, self.position_ids[:, window], self._cache)
        self._cache.crop(-(self.window_end - self.window_start))
        return raw[:, : self.end - self.start]

    # --- verification forwards (speculative decoding) --------------------------------------

    def evaluate(self, tokens: torch.Tensor, layout: VerificationLayout) -> torch.Tensor:
        """One forward over a verification layout; its raw outputs at the layout's columns.

        Must follow the block's first call (which, with a cache, fills it). The spans cover
        ``[window_start, end)``: the block, and for a shifted model the column before it.

        :param tokens: ``(B, L)`` long, the current state of the rows of this block.
        :param layout: spans, their source rows and where they sit
            (:class:`~dloom.types.VerificationLayout`).
        :return: ``(R, S, V)``, the outputs at every layout column: the first ``K`` columns
            of a span are its block's logits.
        """
        width = self.end - self.window_start
        source = layout.source
        primary = tokens[source].clone()
        primary[:, self.window_start : self.end] = layout.input_ids[:, :width]
        if not layout.packed:
            return self._standalone(primary, source)[:, self.window_start - self._query_start :][:, :width]
        return self._packed(primary, layout, width)

    @property
    def _query_start(self) -> int:
        """First position a forward of this block recomputes (0 without a cache)."""
        return 0 if self.mode == "none" else self.window_start

    def _row_cache(self, source: torch.Tensor):
        """A fresh cache holding the block-start keys and values of rows ``source``."""
        from transformers import DynamicCache

        return DynamicCache(
            ddp_cache_data=[
                (layer.keys[source], layer.values[source]) for layer in self._cache.layers
            ]
        )

    def _standalone(self, sequences: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Raw outputs of the rows' own forwards, computed exactly as a plain step would."""
        if self.mode == "none":
            mask = None if self._full_mask is None else self._full_mask[source]
            self.query_positions = sequences.shape[1]
            with torch.no_grad():
                out = self.model.model(
                    input_ids=sequences, attention_mask=mask,
                    position_ids=self.position_ids[source],
                )
            return out.logits if hasattr(out, "logits") else out[0]
        window = slice(self.window_start, self.window_end)
        mask = None if self._step_mask is None else self._step_mask[source]
        return self._run(
            sequences[:, window], mask, self.position_ids[source][:, window], self._row_cache(source)
        )

    def _packed(self, primary: torch.Tensor, layout: VerificationLayout, width: int) -> torch.Tensor:
        """Raw outputs of a packed layout: the context once, further spans appended to it."""
        device = primary.device
        length = primary.shape[1]
        source = layout.source
        appended = layout.input_ids[:, width:]
        if self.mode == "none":
            cached = torch.arange(0, device=device)
            recomputed = torch.arange(length, device=device)
        else:
            cached = self._key_order[: self._key_order.numel() - (self.window_end - self.window_start)]
            recomputed = torch.arange(self.window_start, self.window_end, device=device)
        span_positions = self.window_start + layout.span_position[:, width:].clamp(0, width - 1)
        # Absolute position of every query (R, Q) and key (R, C + Q).
        query_abs = torch.cat([recomputed.expand(len(source), -1), span_positions], dim=1)
        key_abs = torch.cat([cached.expand(len(source), -1), query_abs], dim=1)
        n_cached, n_recomputed = cached.numel(), recomputed.numel()
        # Segment of every query and key: 0 for the context and the first span, the node
        # index + 1 for appended spans (-1 + 1 = 0 never occurs: padding gets -1).
        query_segment = torch.cat(
            [torch.zeros(len(source), n_recomputed, dtype=torch.long, device=device),
             torch.where(layout.segment[:, width:] >= 0, layout.segment[:, width:] + 1, -1)],
            dim=1,
        )
        key_segment = torch.cat(
            [torch.zeros(len(source), n_cached, dtype=torch.long, device=device), query_segment], dim=1
        )
        base = self._bool_mask(source, length)
        allowed = torch.gather(
            torch.gather(base, 1, query_abs.unsqueeze(-1).expand(-1, -1, length)),
            2, key_abs.unsqueeze(1).expand(-1, query_abs.shape[1], -1),
        )
        in_window = (key_abs >= self.window_start) & (key_abs < self.end)
        from_context = (key_segment == 0).unsqueeze(1) & (
            (query_segment == 0).unsqueeze(2) | ~in_window.unsqueeze(1)
        )
        own_span = (key_segment.unsqueeze(1) == query_segment.unsqueeze(2)) & (
            query_segment != 0
        ).unsqueeze(2)
        mask = (allowed & (from_context | own_span)).unsqueeze(1)
        inputs = torch.cat([primary[:, recomputed], appended], dim=1)
        positions = torch.gather(self.position_ids[source], 1, query_abs)
        model_input = model_mask(mask, self.model.model)
        self.query_positions = inputs.shape[1]
        with torch.no_grad():
            if self.mode == "none":
                out = self.model.model(
                    input_ids=inputs, attention_mask=model_input, position_ids=positions
                )
            else:
                out = self.model.model(
                    input_ids=inputs, attention_mask=model_input, position_ids=positions,
                    use_cache=True, **{self._argument: self._row_cache(source)},
                )
        raw = out.logits if hasattr(out, "logits") else out[0]
        first = raw[:, self.window_start - recomputed[0] :][:, :width]
        return torch.cat([first, raw[:, n_recomputed:]], dim=1)

    def _bool_mask(self, source: torch.Tensor, length: int) -> torch.Tensor:
        """``(R, L, L)`` bool, the model's attention over the whole sequence for ``source``."""
        mask = self._attention_mask
        if mask is None:
            return torch.ones(len(source), length, length, dtype=torch.bool, device=source.device)
        if mask.dim() == 2:
            return mask[source].bool()[:, None, :].expand(-1, length, -1)
        return mask[source][:, 0].bool()
