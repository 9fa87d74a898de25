"""Build decoders from the settings a front-end collects: the one factory of the command
line (``dloom generate``, ``dloom eval``), the server (``dloom serve``, :mod:`dloom.serve`)
and Ray (:mod:`dloom.ray`), so each runs every strategy the others run.

A strategy's registration names its decoder (:func:`dloom.decode.decoders.decoder_kind`), and
the decoder names the models it needs: a dLLM (``"diffusion"``), or an AR target and its dLLM
drafter (``"ar-target"``). :func:`select_models` checks which model options apply and
names the models (:class:`Models`); :meth:`Models.load` loads them; :func:`decoder_over`
builds a strategy's decoder over them (loading any still named). :func:`build_decoder` is
:func:`select_models` then :func:`decoder_over`, for a front-end that decodes with one
strategy (the command line, Ray's actors); the server (here or in Ray Serve's replicas) loads its
models once and builds a decoder per request setting over them. :func:`parse_params` reads
``NAME=VALUE`` strategy parameters. All raise :class:`dloom.errors.DloomError` subclasses on
bad input, before any model is loaded where they can; each front-end turns those into its
own output (an exit status and a message, an HTTP error, an error record).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dloom.ar.decoder import load_ar_target_decoder
from dloom.decode.decoders import (
    AR_TARGET,
    DIFFUSION,
    ComposedDecoder,
    decoder_kind,
    strategies_for,
)
from dloom.errors import ConfigurationError

if TYPE_CHECKING:
    from dloom.model.adapter import ModelAdapter

DEFAULT_MODEL = "toy-dllm"
"""The diffusion model a front-end decodes with when given none."""
DEFAULT_TARGET = "toy-ar"
"""The AR target an ``"ar-target"`` strategy decodes with when given none."""
DEFAULT_DRAFTER = "toy-dllm"
"""The dLLM drafter an ``"ar-target"`` strategy drafts with when given none."""


@dataclass(frozen=True)
class Models:
    """The models a decoder kind runs on, each a zoo name or directory until :meth:`load`.

    :ivar kind: the decoder they are for, one of :data:`dloom.decode.decoders.DECODERS`.
    :ivar model: what produces the outputs: the dLLM (``"diffusion"``) or the AR target
        (``"ar-target"``).
    :ivar drafter: the AR target's dLLM drafter (``None`` for a dLLM).
    :ivar loading: :func:`dloom.load_model` options (``mask_token_id``, the drafter's with an AR
        target; ``trust_remote_code``, ``device``, ``dtype``, ``device_map``).
    """

    kind: str
    model: str | ModelAdapter
    drafter: str | ModelAdapter | None = None
    loading: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> LoadedModels:
        """These models with every named one loaded.

        :raises dloom.errors.ModelError: for a model that cannot be loaded.
        """
        from dloom.model.adapter import load_model

        loading = dict(self.loading)
        if self.kind == DIFFUSION:
            model = self.model if not isinstance(self.model, str) else load_model(self.model, **loading)
            return LoadedModels(self.kind, model, None, self.loading)
        mask_token_id = loading.pop("mask_token_id", None)
        loading.pop("device_map", None)  # refused for an AR target by select_models
        model = self.model if not isinstance(self.model, str) else load_model(self.model, require_mask=False, **loading)
        drafter = self.drafter
        if isinstance(drafter, str):
            drafter = load_model(drafter, mask_token_id=mask_token_id, **loading)
        return LoadedModels(self.kind, model, drafter, self.loading)


@dataclass(frozen=True)
class LoadedModels(Models):
    """:class:`Models` whose models are loaded (what :meth:`Models.load` returns)."""

    model: ModelAdapter
    drafter: ModelAdapter | None = None


def parse_params(pairs: list[str]) -> dict[str, str]:
    """``["tau=0.8", "spiffy.budget=3"]`` -> ``{"tau": "0.8", "spiffy.budget": "3"}``."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigurationError(f"--param takes NAME=VALUE, got {pair!r}")
        params[name.strip()] = value.strip()
    return params


def select_models(
    model: str | None, strategy: Any, *, target: str | None = None, drafter: str | None = None,
    mask_token_id: int | None = None, trust_remote_code: bool = False, device: str = "cpu",
    dtype: str = "float32", device_map: str | None = None,
) -> Models:
    """The models ``strategy``'s decoder runs on, named, not loaded: ``model`` (default
    :data:`DEFAULT_MODEL`) for a diffusion strategy, ``target`` and ``drafter`` (defaults
    :data:`DEFAULT_TARGET`, :data:`DEFAULT_DRAFTER`) for an AR-target one.

    :raises UnknownStrategyError: for a strategy no plugin registers.
    :raises ConfigurationError: for a model option that does not apply: ``--model`` or
        ``--device-map`` with an AR-target strategy, ``--target`` or ``--drafter`` with a
        diffusion one (the command line's option names, which the server and Ray take too).
    """
    kind = decoder_kind(strategy)
    loading = {"mask_token_id": mask_token_id, "trust_remote_code": trust_remote_code,
               "device": device, "dtype": dtype, "device_map": device_map}
    if kind == AR_TARGET:
        if model is not None:
            raise ConfigurationError(
                f"--model {model} does not apply to --strategy {strategy}: give the AR model with "
                "--target and the dLLM drafter with --drafter"
            )
        if device_map is not None:
            raise ConfigurationError(f"--device-map does not apply to {strategy}; use --device")
        return Models(kind, target or DEFAULT_TARGET, drafter or DEFAULT_DRAFTER, loading)
    if target is not None or drafter is not None:
        raise ConfigurationError(
            f"--target and --drafter apply to --strategy {' or '.join(strategies_for(AR_TARGET))} only"
        )
    return Models(kind, model or DEFAULT_MODEL, None, loading)


def decoder_over(models: Models, strategy: Any, params: Mapping[str, Any], **settings: Any) -> ComposedDecoder:
    """The decoder of ``strategy`` over ``models`` (named ones are loaded first), built by
    the builder of the decoder the strategy's registration names (:data:`DECODER_BUILDERS`).

    ``settings`` go to the decoder: lengths, ``steps``, ``temperature``, ``remasking``,
    ``seed``, ``cache``, ``cache_refresh`` and ``static_shapes``; those an AR target does not
    take (``block_length``, ``steps``, ``cache_refresh``, ``static_shapes``) are refused
    unless ``None``/``False``.

    :raises ConfigurationError: for a strategy whose decoder is not ``models.kind``, or a
        setting the decoder refuses.
    """
    kind = decoder_kind(strategy)
    if kind != models.kind:
        loaded = "a dLLM" if models.kind == DIFFUSION else "an AR target and its dLLM drafter"
        raise ConfigurationError(
            f"strategy {strategy!r} runs in the {kind} decoder, but the models here are {loaded}, "
            f"for the {models.kind} decoder's strategies ({', '.join(strategies_for(models.kind))}); "
            f"load the models for it (e.g. dloom serve --strategy {strategy})"
        )
    return DECODER_BUILDERS[kind](models, strategy, dict(params), **settings)


def build_decoder(
    model: str | None, strategy: str, param: list[str], *, mask_token_id: int | None = None,
    trust_remote_code: bool = False, device: str = "cpu", dtype: str = "float32",
    device_map: str | None = None, target: str | None = None, drafter: str | None = None,
    **settings: Any,
) -> ComposedDecoder:
    """Load the models and build the decoder that ``strategy``'s registration names
    (:func:`select_models`, then :func:`decoder_over`).

    ``param``: strategy parameters as ``NAME=VALUE`` strings (:func:`parse_params`).
    ``settings``: as :func:`decoder_over` takes them. Options that would have no effect are
    refused: those :func:`select_models` refuses, the settings an AR target does not take,
    and ``--steps`` with a commit rule that does not read the step budget.

    :raises dloom.errors.DloomError: a setting, strategy or model that cannot be used (nothing is printed).
    """
    models = select_models(
        model, strategy, target=target, drafter=drafter, mask_token_id=mask_token_id,
        trust_remote_code=trust_remote_code, device=device, dtype=dtype, device_map=device_map,
    )
    decoder = decoder_over(models, strategy, parse_params(param), **settings)
    if models.kind == DIFFUSION and settings.get("steps") is not None and not decoder.composition.reads_step_budget():
        rule = decoder.composition.provider("dloom_select_commit")
        raise ConfigurationError(
            f"--steps {settings['steps']} has no effect: commit rule {rule!r} does not read the "
            "step budget (a quota rule does); drop --steps"
        )
    return decoder


def _ar_target_decoder(models: Models, strategy: Any, params: dict[str, Any], **settings: Any) -> ComposedDecoder:
    """An ``"ar-target"`` strategy's decoder: ``models.model`` (the AR target) decodes,
    ``models.drafter`` drafts."""
    if settings.pop("cache_refresh", None) is not None:
        raise ConfigurationError(f"--cache-refresh applies to diffusion decoding, not to {strategy}")
    if settings.pop("static_shapes", False):
        raise ConfigurationError(f"--static-shapes applies to diffusion decoding, not to {strategy}")
    loading = {k: v for k, v in models.loading.items() if k != "device_map"}
    return load_ar_target_decoder(models.model, models.drafter, strategy, params, **loading, **settings)


def _diffusion_decoder(models: Models, strategy: Any, params: dict[str, Any], **settings: Any) -> ComposedDecoder:
    """A ``"diffusion"`` strategy's :class:`~dloom.DiffusionDecoder` over the dLLM ``models.model``."""
    from dloom.decode.decoder import DiffusionDecoder

    return DiffusionDecoder(models.load().model, strategy, params=params, **settings)


DECODER_BUILDERS = {DIFFUSION: _diffusion_decoder, AR_TARGET: _ar_target_decoder}
"""How :func:`decoder_over` builds each decoder of :data:`dloom.decode.decoders.DECODERS`."""
