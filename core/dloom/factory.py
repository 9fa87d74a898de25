"""Build a decoder from the settings a front-end collects: one factory for the command
line, the server and Ray.

:func:`build_decoder` loads the models and builds the decoder that a strategy's registration
names (:func:`dloom.decode.decoders.decoder_kind`); :func:`parse_params` reads ``NAME=VALUE``
strategy parameters. Both raise :class:`dloom.errors.DloomError` subclasses on bad input,
before any model is loaded where they can; each front-end turns those into its own output
(an exit status and a message, an HTTP error, an error record).
"""

from __future__ import annotations

from typing import Any

from dloom.ar.decoder import load_ar_target_decoder
from dloom.decode.decoders import (
    AR_TARGET,
    DIFFUSION,
    Decoder,
    decoder_kind,
    strategies_for,
)
from dloom.errors import ConfigurationError

DEFAULT_MODEL = "toy-dllm"
"""The diffusion model a front-end decodes with when given none."""


def parse_params(pairs: list[str]) -> dict[str, str]:
    """``["tau=0.8", "spiffy.budget=3"]`` -> ``{"tau": "0.8", "spiffy.budget": "3"}``."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigurationError(f"--param takes NAME=VALUE, got {pair!r}")
        params[name.strip()] = value.strip()
    return params


def build_decoder(
    model: str | None, strategy: str, param: list[str], *, mask_token_id: int | None = None,
    trust_remote_code: bool = False, device: str = "cpu", dtype: str = "float32",
    device_map: str | None = None, target: str | None = None, drafter: str | None = None,
    **settings: Any,
) -> Decoder:
    """Load the models and build the decoder that ``strategy``'s registration names
    (:func:`dloom.decode.decoders.decoder_kind`).

    ``param``: strategy parameters as ``NAME=VALUE`` strings (:func:`parse_params`).

    ``settings`` go to the decoder: lengths, ``steps``, ``temperature``, ``remasking``,
    ``seed``, ``cache``, ``cache_refresh`` and ``static_shapes``. Options that would have no effect are
    refused: ``--model`` with an AR-target strategy (it takes ``--target`` and
    ``--drafter``), those two with a diffusion one, and ``--steps`` with a commit rule that
    does not read the step budget. The option names in messages are the command line's,
    which the server and Ray take under the same names.

    :raises dloom.errors.DloomError: a setting, strategy or model that cannot be used (nothing is printed).
    """
    build = DECODER_BUILDERS[decoder_kind(strategy)]
    return build(
        model, strategy, parse_params(param), mask_token_id=mask_token_id,
        trust_remote_code=trust_remote_code, device=device, dtype=dtype, device_map=device_map,
        target=target, drafter=drafter, **settings,
    )


def _ar_target_decoder(
    model: str | None, strategy: str, params: dict[str, str], *, device_map: str | None,
    target: str | None, drafter: str | None, **settings: Any,
) -> Decoder:
    """An ``"ar-target"`` strategy's decoder: ``--target`` (default ``toy-ar``) decodes,
    ``--drafter`` (default ``toy-dllm``) drafts."""
    if model is not None:
        raise ConfigurationError(
            f"--model {model} does not apply to --strategy {strategy}: give the AR model with "
            "--target and the dLLM drafter with --drafter"
        )
    if settings.pop("cache_refresh", None) is not None:
        raise ConfigurationError(f"--cache-refresh applies to diffusion decoding, not to {strategy}")
    if settings.pop("static_shapes", False):
        raise ConfigurationError(f"--static-shapes applies to diffusion decoding, not to {strategy}")
    if device_map is not None:
        raise ConfigurationError(f"--device-map does not apply to {strategy}; use --device")
    return load_ar_target_decoder(target or "toy-ar", drafter or "toy-dllm", strategy, params, **settings)


def _diffusion_decoder(
    model: str | None, strategy: str, params: dict[str, str], *, mask_token_id: int | None,
    trust_remote_code: bool, device: str, dtype: str, device_map: str | None,
    target: str | None, drafter: str | None, **settings: Any,
) -> Decoder:
    """A ``"diffusion"`` strategy's :class:`~dloom.DiffusionDecoder` over ``--model``."""
    from dloom.decode.decoder import DiffusionDecoder
    from dloom.model.adapter import load_model

    if target is not None or drafter is not None:
        raise ConfigurationError(
            f"--target and --drafter apply to --strategy {' or '.join(strategies_for(AR_TARGET))} only"
        )
    adapter = load_model(
        model or DEFAULT_MODEL, mask_token_id=mask_token_id, trust_remote_code=trust_remote_code,
        device=device, dtype=dtype, device_map=device_map,
    )
    decoder = DiffusionDecoder(adapter, strategy, params=params, **settings)
    if settings.get("steps") is not None and not decoder.composition.reads_step_budget():
        rule = decoder.composition.provider("dloom_select_commit")
        raise ConfigurationError(
            f"--steps {settings['steps']} has no effect: commit rule {rule!r} does not read the "
            "step budget (a quota rule does); drop --steps"
        )
    return decoder


DECODER_BUILDERS = {DIFFUSION: _diffusion_decoder, AR_TARGET: _ar_target_decoder}
"""How :func:`build_decoder` builds each decoder of :data:`dloom.decode.decoders.DECODERS`."""
