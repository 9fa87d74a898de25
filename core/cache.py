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

For a shifted model (the output at ``i`` predicts token ``i + 1``) the recomputed window
starts one position before the block, so that the block's logits come from fresh outputs.
"""

from __future__ import annotations

import inspect

import torch

from dloom.adapter import ModelAdapter
from dloom.attention import model_mask
from dloom.errors import ConfigurationError, ModelError

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
    ) -> None:
        if mode not in CACHE_MODES:
            raise ConfigurationError(f"cache is {mode!r}; allowed: {', '.join(CACHE_MODES)}")
        self.model = model
        self.mode = mode
        self.position_ids = position_ids
        self.start, self.end = start, end
        self.query_positions = 0
        length = position_ids.shape[1]
        self._full_mask = attention_mask
        if attention_mask is not None and attention_mask.dim() == 4:
            self._full_mask = model_mask(attention_mask, model.model)
        self._cache = None
        if mode == "none":
            return
        self._argument = cache_argument(model.model)
        if self._argument is None:
            raise ModelError(
                f"model {model.name!r} does not take a KV cache; use cache='none'"
            )
        device = position_ids.device
        # Recomputed window [window_start, window_end) of every cached step.
        self.window_start = start - int(model.shift_logits)
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
        if self._cache is None:
            return self._block_start(tokens)
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
