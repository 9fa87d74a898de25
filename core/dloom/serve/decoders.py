"""Decoders by settings: each request's dloom settings resolved into a decoder built by the
one factory (:func:`dloom.factory.decoder_over`), validated exactly as the CLI validates them.

A request names a strategy, its parameters, a cache mode, a temperature and a seed; the
server's command line fixes the rest (lengths, steps, remasking) and the models: a dLLM, or
for an ``"ar-target"`` strategy an AR target and its dLLM drafter. Building
the decoder is the validation: an unknown strategy, parameter or value raises the same
:class:`~dloom.errors.DloomError` with the same message as ``dloom generate``; a strategy
that needs other models than the server's is refused. Two requests whose settings build
the same decoder (``{"tau": 0.9}`` and the default) share one :class:`LaneKey`, so the
scheduler can batch them together.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dloom.decode.decoders import ComposedDecoder, decoder_kind
from dloom.factory import LoadedModels, decoder_over
from dloom.hooks.registry import DEFAULT_STRATEGY
from dloom.model.adapter import ModelAdapter


@dataclass(frozen=True)
class DecodeDefaults:
    """The server-wide settings every request decodes with (``dloom serve`` options).

    ``strategy``, ``params`` and ``cache`` are the defaults a request may override;
    ``gen_length``, ``block_length``, ``steps`` and ``remasking`` are fixed per server.
    """

    strategy: str = DEFAULT_STRATEGY
    params: Mapping[str, Any] | None = None
    cache: str = "none"
    cache_refresh: int | None = None
    gen_length: int | None = None
    block_length: int | None = None
    steps: int | None = None
    remasking: str = "low_confidence"


@dataclass(frozen=True)
class LaneKey:
    """Everything that makes two rows decodable in one batch: the decoder's settings, the
    seed included for a decoder that draws random numbers (each row samples from its own
    stream, keyed to the seed and the row's index in its request, so seeded rows of many
    requests share a batch and each still decodes as its request alone)."""

    settings: str  # the decoder's config as sorted JSON (seed left out unless it matters)
    logprobs: int | None = None  # alternatives per token its rows record (None: no logprobs)
    ignore_eos: bool = False  # its rows decode their whole region, past any EOS


@dataclass(frozen=True)
class Resolved:
    """A request's decoder and the lane its rows join."""

    key: LaneKey
    decoder: ComposedDecoder


class DecoderPool:
    """Builds, validates and keeps decoders for request settings (thread-safe).

    :param model: the served model: a dLLM, or the AR target of an ``"ar-target"``
        default strategy.
    :param defaults: the server's settings.
    :param capacity: decoders kept for reuse (least recently used dropped first; a lane
        holds its own decoder, so dropping one never disturbs a running batch).
    :param drafter: the AR target's dLLM drafter (``"ar-target"`` strategies only).
    :raises DloomError: the CLI's error for bad default settings.
    """

    def __init__(
        self, model: ModelAdapter, defaults: DecodeDefaults, capacity: int = 64, *,
        drafter: ModelAdapter | None = None,
    ) -> None:
        self.model = model
        self.defaults = defaults
        self.models = LoadedModels(decoder_kind(defaults.strategy), model, drafter)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._decoders: OrderedDict[str, Resolved] = OrderedDict()
        # validate the server's own defaults now: a bad `dloom serve` fails at start
        self.default = self.resolve()

    def resolve(
        self,
        strategy: str | None = None,
        params: Mapping[str, Any] | None = None,
        cache: str | None = None,
        cache_refresh: int | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> Resolved:
        """The decoder for these settings (``None``: the server's default).

        :raises DloomError: the CLI's error for a bad strategy, parameter, cache mode or
            temperature (the decoder's constructor raises it).
        """
        d = self.defaults
        given: dict[str, Any] = {
            "strategy": strategy or d.strategy,
            "params": dict(d.params or {}) if params is None else dict(params),
            "cache": cache or d.cache,
            "cache_refresh": d.cache_refresh if cache_refresh is None and cache is None else cache_refresh,
            "temperature": float(temperature),
            "seed": seed,
        }
        request_key = json.dumps(given, sort_keys=True, default=str)
        with self._lock:
            if request_key in self._decoders:
                self._decoders.move_to_end(request_key)
                return self._decoders[request_key]
        decoder = decoder_over(
            self.models, given["strategy"], given["params"], cache=given["cache"],
            cache_refresh=given["cache_refresh"], temperature=given["temperature"],
            seed=seed, gen_length=d.gen_length, block_length=d.block_length, steps=d.steps,
            remasking=d.remasking,
        )
        config = dict(decoder.config)
        random = config["temperature"] > 0 or config["remasking"] == "random"
        if not random or seed is None:
            config["seed"] = None  # the seed changes nothing, or nothing is reproducible
        resolved = Resolved(LaneKey(json.dumps(config, sort_keys=True, default=str)), decoder)
        with self._lock:
            self._decoders[request_key] = resolved
            while len(self._decoders) > self.capacity:
                self._decoders.popitem(last=False)
        return resolved
