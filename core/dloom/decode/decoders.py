"""What every dloom decoder offers (:class:`Decoder`), and which decoder a strategy runs in.

A strategy's registration names its decoder (:attr:`dloom.StrategyRegistration.decoder`),
one of :data:`DECODERS`:

* ``"diffusion"``: :class:`dloom.DiffusionDecoder` decodes a dLLM; the strategy's hooks
  choose the commits and speculate on the dLLM's own future states.
* ``"ar-target"``: an autoregressive target decodes, a dLLM drafter proposes token chains
  and the target verifies them (:class:`dloom.ar.decoder.ARTargetDecoder`, built by
  :mod:`dloom.factory`: this package knows no AR target).

:func:`decoder_kind` reads the kind off a strategy spec, so the command line, evaluation and
``dloom check`` dispatch on the registration, never on a strategy's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from dloom.hooks.composition import Composition
    from dloom.hooks.registry import Registry
    from dloom.metrics import GenerationResult
    from dloom.model.adapter import ModelAdapter

from dloom.types import AR_TARGET, DECODERS, DIFFUSION

__all__ = ["AR_TARGET", "DECODERS", "DIFFUSION", "ComposedDecoder", "Decoder", "decoder_kind", "strategies_for"]


@runtime_checkable
class Decoder(Protocol):
    """The interface :func:`dloom.evaluation.evaluate`, the command line and ``dloom check``
    use, whatever the decoder.

    :ivar model: the adapter of the model whose outputs are produced (tokenizer, padding,
        chat template, context length): the dLLM, or the AR target.
    """

    model: ModelAdapter

    @property
    def name(self) -> str:
        """The strategy's name as reports show it (a composition's ``a+b``)."""

    @property
    def config(self) -> dict[str, Any]:
        """The decoder's settings, JSON-ready; ``gen_length`` is the most generated tokens
        per row."""

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]] | torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        row_offset: int | Sequence[int] | torch.Tensor = 0,
    ) -> GenerationResult:
        """Decode a batch of prompts (texts, id lists, or a ``(B, P)`` left-padded tensor
        with its ``(B, P)`` ``attention_mask``); ``row_offset`` gives each prompt's random
        stream (:class:`dloom.decode.kernel.RowStreams`)."""

    def totals(self) -> dict[str, Any] | None:
        """Counts the decoder adds up over its :meth:`generate` calls, JSON-ready, or
        ``None`` when every figure is already in each result."""


@runtime_checkable
class ComposedDecoder(Decoder, Protocol):
    """A :class:`Decoder` that runs a strategy's composition of plugins: each decoder of
    :data:`DECODERS` (what :mod:`dloom.factory` builds).

    :ivar composition: the strategy's plugins and who answers each hook.
    """

    composition: Composition


def decoder_kind(strategy: Any, registry: Registry | None = None) -> str:
    """The decoder (one of :data:`DECODERS`) that the strategy spec ``strategy`` runs in.

    A string spec (``"a+b"``, ``"a+b+c@prune"``) is read by the one spec parser
    (:func:`dloom.hooks.composition.strategy_names`) and its names looked up in the registry:
    a component whose registration names a decoder other than ``"diffusion"`` decides it
    (that decoder then refuses the components it cannot run). Plugin objects run in the
    diffusion decoder.

    :raises UnknownStrategyError: for a name no plugin registered.
    :raises ConfigurationError: for a malformed spec.
    """
    if not isinstance(strategy, str):
        return DIFFUSION
    from dloom.hooks.composition import strategy_names
    from dloom.hooks.registry import get_registry

    registry = registry or get_registry()
    kinds = [registry.get(name).registration.decoder for name in strategy_names(strategy)]
    return next((kind for kind in kinds if kind != DIFFUSION), DIFFUSION)


def strategies_for(kind: str, registry: Registry | None = None) -> list[str]:
    """The registered strategies whose registration names the decoder ``kind``."""
    from dloom.hooks.registry import get_registry

    registry = registry or get_registry()
    return sorted(s.name for s in registry.strategies.values() if s.registration.decoder == kind)
