"""FailFast's decoder: the core's :class:`~dloom.ar.decoder.ARTargetDecoder` with the
``failfast`` strategy and a dLLM drafter, under the names FailFast's papers and scripts use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dloom.sdk import (
    ARTargetDecoder,
    ConfigurationError,
    ModelAdapter,
    Registry,
    StrategySpec,
    compose,
    load_ar_target_decoder,
)

from .plugin import FailFast
from .settings import FailFastSettings


class FailFastDecoder(ARTargetDecoder):
    """Decode an AR target with a dLLM drafter (FailFast), losslessly.

    :param target: the AR target's adapter. :param drafter: the drafter dLLM's adapter,
        sharing the target's tokenizer (:func:`~.settings.check_shared_tokenizer`).
    :param strategy: ``"failfast"``, a composition holding it (e.g. with a user's verifier
        replacing FailFast's: :func:`dloom.replace`), or a :class:`~.settings.FailFastSettings`.
    :param unsafe_ratio_out_of_order: allow ``verification="ratio"`` with ``small_block >
        1`` (biased: for negative controls only).
    :param settings: everything else :class:`~dloom.ar.decoder.ARTargetDecoder` takes
        (``params``, ``max_new_tokens``, ``temperature``, ``remasking``, ``seed``,
        ``drafter_cache``, ``draft_budget``), and strategy parameters as keywords.
    :raises ConfigurationError: parameters passed next to a ``FailFastSettings``, and
        whatever the core decoder and the FailFast plugin refuse.
    """

    def __init__(
        self,
        target: ModelAdapter,
        drafter: ModelAdapter,
        strategy: StrategySpec | FailFastSettings = "failfast",
        *,
        params: Mapping[str, Any] | None = None,
        registry: Registry | None = None,
        unsafe_ratio_out_of_order: bool = False,
        **settings: Any,
    ) -> None:
        decoder_settings = {k: settings.pop(k) for k in list(settings) if k in DECODER_SETTINGS}
        if isinstance(strategy, FailFastSettings):
            if params or settings:
                raise ConfigurationError("pass parameters inside the FailFastSettings, not as params")
            params, strategy = dict(vars(strategy)), "failfast"
        composition = compose(strategy, {**(params or {}), **settings}, registry)
        for component in composition.components:
            if isinstance(component.plugin, FailFast):
                component.plugin.unsafe_ratio_out_of_order = unsafe_ratio_out_of_order
        super().__init__(target, composition, drafter=drafter, registry=registry, **decoder_settings)

    @property
    def settings(self) -> FailFastSettings:
        """The :class:`~.settings.FailFastSettings` of the composition's FailFast."""
        return next(c.plugin.settings for c in self.composition.components if isinstance(c.plugin, FailFast))


DECODER_SETTINGS = ("max_new_tokens", "temperature", "remasking", "seed", "drafter_cache", "draft_budget")


def build_failfast_decoder(
    target: str | ModelAdapter, drafter: str | ModelAdapter, strategy: StrategySpec = "failfast",
    params: Mapping[str, Any] | None = None, **settings: Any,
) -> ARTargetDecoder:
    """Load both models by zoo name or directory and build FailFast's decoder, taking the
    diffusion decoder's setting names (:func:`dloom.ar.decoder.load_ar_target_decoder`)."""
    return load_ar_target_decoder(target, drafter, strategy, params, **settings)
