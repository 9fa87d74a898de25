"""The autoregressive target of speculative decoding: a causal LM behind a KV cache.

:class:`ARTarget` wraps any ``transformers`` causal LM whose forward takes a
:class:`transformers.DynamicCache` (:attr:`dloom.model.adapter.ModelAdapter.cache_argument`). It holds one cache
for a batch of rows laid out as columns of one sequence: the left-padded prompt (width
``P``), then each row's accepted tokens. The cache holds the keys and values of the first
:attr:`ARTarget.length` columns, the same number for every row.

Prefill runs once per batch over the prompt minus its last column. Every later forward
(:meth:`ARTarget.forward`) feeds, per row, a right-padded run of new columns that continues
the cached ones: the row's accepted tokens not yet cached (at least the last one, whose
output predicts the first draft position) and its draft. The cache then holds every fed
column; :meth:`ARTarget.crop` cuts it back to the columns every row has accepted (rows
accept different numbers of draft tokens; the tokens a row accepted beyond the shortest
row's are fed again in the next forward). Kept columns are exact: each is a real token of
its row at its true position, whose keys only depend on the columns before it (causal
attention), so a cached forward gives the logits of an uncached one (up to floating-point
summation order).

Shapes: ``B`` rows, ``P`` prompt width, ``S`` columns fed in one forward, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from dloom.errors import ModelError
from dloom.model.adapter import ModelAdapter, position_ids_from_mask


class ARTarget:
    """A causal LM with a cropped-on-rejection KV cache, for a batch of rows.

    :param model: an adapter whose ``attention`` is ``"causal"`` and whose forward takes a
        ``transformers`` cache. The raw output at a column is the distribution of the next
        token (every causal LM's convention; the adapter's ``shift_logits`` is not consulted).
    :raises ModelError: for a non-causal model or one whose forward takes no cache.

    :ivar length: columns whose keys and values the cache holds (the same for every row).
    :ivar forwards: model forwards run since the last :meth:`reset` (prefill included).
    """

    def __init__(self, model: ModelAdapter) -> None:
        if model.attention != "causal":
            raise ModelError(
                f"target model {model.name!r} has {model.attention!r} attention; an AR target "
                "needs 'causal' (pass attention='causal' to load_model if the config is wrong)"
            )
        if model.cache_argument is None:
            raise ModelError(
                f"target model {model.name!r} takes no transformers KV cache in its forward; "
                "an AR target needs one (any transformers causal LM does)"
            )
        self.model = model
        self._cache: Any = None  # a transformers DynamicCache from reset() on
        self._key_mask: torch.Tensor | None = None
        self._position_ids: torch.Tensor | None = None
        self.length = 0
        self.forwards = 0

    def reset(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int) -> None:
        """Start a batch: prefill the prompt's first ``P - 1`` columns into a fresh cache.

        The last prompt column is fed by the first :meth:`forward`, whose output there is the
        distribution of the first generated token.

        :param prompt_ids: ``(B, P)`` long, left-padded prompts (every row's last column real).
        :param prompt_mask: ``(B, P)`` long, 0 on left padding.
        :param max_new_tokens: the most columns any row will append (sizes the padding mask).
        :raises ModelError: when ``P + max_new_tokens`` exceeds the model's context.
        """
        from transformers import DynamicCache

        batch, width = prompt_ids.shape
        total = width + max_new_tokens
        if self.model.max_context is not None and total > self.model.max_context:
            raise ModelError(
                f"prompt of {width} tokens + {max_new_tokens} new tokens = {total} exceeds the "
                f"target {self.model.name!r}'s context of {self.model.max_context} tokens"
            )
        self._key_mask = torch.cat(
            [prompt_mask.long(), torch.ones(batch, max_new_tokens, dtype=torch.long, device=prompt_ids.device)],
            dim=1,
        )
        self._position_ids = position_ids_from_mask(self._key_mask)
        self._cache = DynamicCache()
        self.length = 0
        self.forwards = 0
        if width > 1:
            self._run(prompt_ids[:, :-1], self._key_mask[:, : width - 1], self._positions(0, width - 1))
            self.length = width - 1

    def _positions(self, start: int, count: int) -> torch.Tensor:
        """``(B, count)`` position ids of columns ``start ..``: real tokens before each
        (left padding takes position 0)."""
        assert self._position_ids is not None, "reset() before the first forward"
        return self._position_ids[:, start : start + count]

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.model.raw_logits(ids, mask, positions, cache=self._cache)
        self.forwards += 1
        return logits

    def forward(self, ids: torch.Tensor, slot_mask: torch.Tensor) -> torch.Tensor:
        """One forward over ``S`` new columns per row, continuing the cached ones.

        :param ids: ``(B, S)`` long, columns ``length .. length + S - 1`` of every row; a row
            with fewer new columns is right-padded (any id).
        :param slot_mask: ``(B, S)``, 1 on the real new columns, 0 on right padding. A padded
            slot is never attended to; its output is meaningless.
        :return: ``(B, S, V)`` logits (model dtype): entry ``j`` is the distribution of the
            token after column ``length + j``. The cache then holds ``length + S`` columns;
            call :meth:`crop` before the next forward.
        """
        if self._cache is None or self._key_mask is None:
            raise ModelError("ARTarget.forward before reset(): start a batch first")
        width = ids.shape[1]
        mask = torch.cat([self._key_mask[:, : self.length], slot_mask.long()], dim=1)
        logits = self._run(ids, mask, self._positions(self.length, width))
        self.length += width
        return logits

    def crop(self, length: int) -> None:
        """Keep the keys and values of the first ``length`` columns only (``length <= self.length``)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop to {length} columns; allowed: 0 .. {self.length}")
        self._cache.crop(length - self.length)  # transformers 5: minus the columns to remove
        self.length = length

    def release(self) -> None:
        """Drop the cache (frees its memory; :meth:`reset` starts the next batch)."""
        self._cache = None
        self._key_mask = None
        self._position_ids = None
        self.length = 0
