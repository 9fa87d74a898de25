"""The model runner of an encoder-prefix/canvas model (DiffusionGemma).

Such a model takes a row's context and its canvas apart: the encoder writes the prompt and the
finished canvases into a cache, and the decoder denoises the canvas over that cache, with the
previous step's logits as self-conditioning input. :class:`CanvasForward` gives the session
(:class:`dloom.decode.session.DecodeSession`) what :class:`~dloom.model.runner.BlockForward`
gives it, every row's active-block logits, from one such forward per step: each row's prefix is
its sequence before its active block (final tokens only), right-aligned so that every row's
canvas follows its own last token, and the canvas and self-conditioning logits are the
kernel's (:class:`dloom.decode.uniform.UniformKernel`), which holds them until the canvas is
final. The prefix is encoded afresh at every step (``cache="none"``, the one policy it takes):
the logits are those of ``generate``'s incremental encoder cache up to floating-point
summation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dloom.errors import ConfigurationError
from dloom.model.runner import BlockForward

if TYPE_CHECKING:
    from dloom.decode.uniform import UniformKernel


class CanvasForward(BlockForward):
    """Every row's canvas logits, one encoder-prefix/canvas forward per step (the arguments of
    :class:`~dloom.model.runner.BlockForward`; the cache policy must record nothing, and
    shapes are not static).

    :ivar kernel: the uniform kernel whose canvases and self-conditioning logits the forward
        reads (set by the session once it is built).
    """

    kernel: UniformKernel

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.policy.records:
            raise ConfigurationError(
                f"cache {self.policy.name!r}: model {self.model.name!r} encodes its prefix at every "
                "step on its own; allowed: cache='none'"
            )
        if self.static_width is not None:
            raise ConfigurationError(
                f"static_shapes: model {self.model.name!r} encodes a prefix that grows canvas by canvas; "
                "allowed: static_shapes=False"
            )

    def run(
        self, tokens: torch.Tensor, n_full: int, first_window: int, last_window: int,
        cached: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, K, V)`` canvas logits of every row and ``(B,)`` bool, all rows (every forward
        is a full one).

        :param tokens: ``(B, L)`` long, every row's sequence (final tokens before its block).
        :param last_window: the widest prefix, the largest block start (:meth:`plan`).
        """
        width = last_window
        columns = self.start.unsqueeze(1) - width + torch.arange(width, device=tokens.device)
        inside = columns >= 0
        columns = columns.clamp(min=0)
        prefix = torch.where(inside, torch.gather(tokens, 1, columns), self.model.pad_token_id)
        mask = inside & torch.gather(self._keys_ok, 1, columns)
        kernel = self.kernel
        self._count(prefix)
        logits = self.model.canvas_logits(prefix, mask.long(), kernel.canvas, kernel.conditioning, kernel.conditioned)
        return logits, torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
