"""FailFast's drafter decoder: the drafter composition (``drafter_strategy`` with
``drafter_tau`` and ``drafter_params``) as a :class:`dloom.DiffusionDecoder` on the drafter
model, whose steps the drafting rounds run (:mod:`.drafter`).

Any composition a diffusion decoder accepts may draft: a commit rule (``threshold``,
``quota``, ``factor``, ``frechet``) or a speculating one (``spiffy+threshold``,
``spiffy+quota``, ``spiffy+frechet``). Its block is FailFast's small block
(``K = min(small_block, max_new_tokens)``) and its step budget one step per position
(``K`` steps per block: a quota rule commits one position per step), so a draft graph
calibrated with ``dloom calibrate ... --block-length K`` (and ``--gen-length`` a multiple
of ``K``) fits it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dloom.sdk import (
    DIFFUSION,
    Composition,
    CompositionError,
    ConfigurationError,
    DiffusionDecoder,
    ModelAdapter,
    UnknownStrategyError,
    compose,
)

from .settings import FailFastSettings


def parse_drafter_params(text: str) -> dict[str, str]:
    """``"spiffy.budget=4,graph=g.json"`` -> ``{"spiffy.budget": "4", "graph": "g.json"}``
    (names as ``--param`` takes them: ``name`` or ``strategy.name``; values parsed by each
    parameter).

    :raises ConfigurationError: an item without ``=`` or with an empty name.
    """
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = item.partition("=")
        if not equals or not name.strip():
            raise ConfigurationError(
                f"failfast drafter_params item {item!r} is not NAME=VALUE; allowed: "
                "comma-separated NAME=VALUE items, e.g. 'spiffy.budget=4,spiffy.graph=graph.json'"
            )
        params[name.strip()] = value.strip()
    return params


def drafter_composition(settings: FailFastSettings, registry: Any = None) -> Composition:
    """The validated drafter composition with its parameters: ``drafter_tau`` as ``tau`` when
    a component declares one, ``first_forward`` off when one declares it (Spiffy's
    next-block priming: the drafting round's steps do not take it), then
    ``drafter_params`` (which win).

    :raises UnknownStrategyError: / :raises CompositionError: / :raises ConfigurationError:
        naming ``drafter_strategy`` (an unknown name, components that clash, an unknown
        parameter, or an AR-target strategy such as FailFast itself).
    """
    name = settings.drafter_strategy
    extra = parse_drafter_params(settings.drafter_params)
    try:
        bare = compose(name, {}, registry)
        declared = {p.name for c in bare.components if c.strategy is not None for p in c.strategy.parameters}
        declares_tau = "tau" in declared
        for component in bare.components:
            kind = component.strategy.registration.decoder if component.strategy is not None else DIFFUSION
            if kind != DIFFUSION:
                raise ConfigurationError(
                    f"{component.name!r} runs in the {kind!r} decoder (FailFast itself, or another "
                    "drafter of an AR target); allowed: a dLLM decoder composition, e.g. "
                    "'threshold', 'frechet' or 'spiffy+threshold'"
                )
        params: dict[str, Any] = {"tau": settings.drafter_tau} if declares_tau else {}
        if "first_forward" in declared:  # the drafter's small blocks take no next-block priming
            params["first_forward"] = False
        return compose(name, {**params, **extra}, registry)
    except (UnknownStrategyError, CompositionError, ConfigurationError) as error:
        raise type(error)(f"failfast drafter_strategy {name!r}: {error}") from None


def drafter_decoder(drafter: ModelAdapter, settings: FailFastSettings, config: Mapping[str, Any]) -> DiffusionDecoder:
    """The drafter composition's diffusion decoder on ``drafter``, for the ar-target
    decoder's ``config`` (its ``gen_length``, ``temperature``, ``remasking``, ``registry``).

    :raises ConfigurationError: / :raises CompositionError: / :raises UnknownStrategyError:
        what :func:`drafter_composition` and :class:`~dloom.DiffusionDecoder` refuse (no
        commit rule; a draft graph for another block length or base rule), naming
        ``drafter_strategy``.
    """
    composition = drafter_composition(settings, config.get("registry"))
    block = min(settings.small_block, config["gen_length"])
    gen_length = -(-config["gen_length"] // block) * block
    try:
        return DiffusionDecoder(
            drafter, composition, gen_length=gen_length, block_length=block, steps=gen_length,
            temperature=config["temperature"], remasking=config["remasking"],
            registry=config.get("registry"),
        )
    except (CompositionError, ConfigurationError) as error:
        raise type(error)(
            f"failfast drafter_strategy {settings.drafter_strategy!r} (block length {block}): {error}"
        ) from None
