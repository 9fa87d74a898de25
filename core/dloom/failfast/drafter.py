"""The drafter's forwards over the canvas, with its prefix KV cache across rounds."""

from __future__ import annotations

import torch

from dloom.adapter import ModelAdapter
from dloom.cache import cache_argument


class DrafterForward:
    """The drafter's logits of the canvas columns ``stable ..``, one forward per call.

    :param model: the drafter adapter (bidirectional).
    :param mode: one of :data:`DRAFTER_CACHE_MODES` (see the module docstring).
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
        self._cache = None
        self._argument = cache_argument(model.model) if mode == "prefix" else None

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
        from transformers import DynamicCache

        if self._cache is None:
            self._cache = DynamicCache()
        start = self.cached
        with torch.no_grad():
            out = self.model.model(
                input_ids=canvas[:, start:], attention_mask=self.attention_mask,
                position_ids=self.position_ids[:, start:], use_cache=True,
                **{self._argument: self._cache},
            )
        raw = out.logits if hasattr(out, "logits") else out[0]
        keep = max(start, stable - self.shift)
        self._cache.crop(keep - width)
        self.cached = keep
        first = stable - self.shift - start
        return raw[:, first : first + width - stable]
