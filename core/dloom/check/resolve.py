"""Turn what a user hands ``dloom check`` into decoder specs and the claim to test.

A strategy may be given as a registered name (``"threshold"``, ``"spiffy+frechet"``), a
:class:`~dloom.hooks.registry.Strategy`, a :class:`~dloom.types.StrategyRegistration` that was never
registered (an author's work in progress, a negative control; composed with its
``default_commit_rule`` as a registered one would be), or a bare plugin object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dloom.decode.transition import ABSORBING, KERNELS, common_kernel, unsupported
from dloom.errors import ConfigurationError
from dloom.hooks.composition import StrategySpec, claim_values, compose
from dloom.hooks.registry import Strategy, get_registry, hooks_implemented_by
from dloom.model.adapter import ModelAdapter
from dloom.types import Claim, StrategyRegistration

KERNEL = "kernel"
"""``Claim.against`` value: the strategy's own commit rule, one forward per step."""

CLAIM_PRIORITY = ("lossless", "bound", "approximate", "reference")


@dataclass(frozen=True)
class Resolved:
    """A strategy ready for :class:`~dloom.DiffusionDecoder`.

    :ivar name: display name.
    :ivar spec: what the decoder takes as ``strategy``.
    :ivar params: what it takes as ``params``.
    :ivar claim: the claim to test (``None``: none declared).
    :ivar claimed_by: the component that declared it.
    :ivar kernel: the transition kernel it is checked on (the first every component
        supports: :func:`dloom.decode.transition.common_kernel`).
    :ivar claim_values: the claiming component's parameters, given or default (what the
        claim's ``holds_when`` is judged at, with the check's temperature).
    :ivar kernels: every kernel all its components support (registered strategies; a
        strategy given otherwise is taken to run on the absorbing kernel alone), whose claims
        the check tests (:mod:`dloom.check.kernel_claims`).
    """

    name: str
    spec: StrategySpec
    params: Mapping[str, Any]
    claim: Claim | None
    claimed_by: str | None
    kernel: str = ABSORBING
    claim_values: Mapping[str, Any] = field(default_factory=dict)
    kernels: tuple[str, ...] = (ABSORBING,)

    def on(self, model: ModelAdapter) -> ModelAdapter:
        """``model`` decoding with this strategy's kernel."""
        return model if model.kernel == self.kernel else dataclasses.replace(model, kernel=self.kernel)


def _values(registration: StrategyRegistration, params: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of ``registration``, given (coerced) or default."""
    known = {p.name: p for p in registration.parameters}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigurationError(
            f"unknown parameter {unknown[0]!r} for strategy {registration.name!r}; allowed: "
            + (", ".join(known) or "none")
        )
    return {
        name: p.coerce(params[name], registration.name) if name in params else p.default
        for name, p in known.items()
    }


def resolve(strategy: Any, params: Mapping[str, Any] | None = None) -> Resolved:
    """Resolve ``strategy`` with ``params`` (names as for the decoder's ``params``), each
    claiming component's :attr:`~dloom.types.Claim.exercised_at` values added where
    ``params`` does not set them.

    For a composition the claim tested is the strongest its components declare, in the
    order of :data:`CLAIM_PRIORITY` (a speculative strategy's ``lossless`` over its commit
    rule's ``bound``).

    :raises UnknownStrategyError: for an unregistered name.
    :raises ConfigurationError: for bad parameters.
    """
    params = dict(params or {})
    if isinstance(strategy, Strategy):
        strategy = strategy.registration
    if isinstance(strategy, StrategyRegistration):
        registered = get_registry().strategies.get(strategy.name)
        if registered is not None and registered.registration is strategy:
            return resolve(strategy.name, params)
        if strategy.claim is not None:
            params = {**strategy.claim.exercised_at, **params}
        values = _values(strategy, params)
        plugin = strategy.plugin_class(**values)
        default_rule = strategy.default_commit_rule
        if default_rule is not None and "dloom_select_commit" not in hooks_implemented_by(plugin):
            # as its registration would compose: a speculator runs over its default rule
            return Resolved(strategy.name, [plugin, default_rule], {}, strategy.claim, strategy.name, claim_values=values)
        return Resolved(strategy.name, plugin, {}, strategy.claim, strategy.name, claim_values=values)
    if isinstance(strategy, str):
        composition = compose(strategy, params)  # validates names and parameters early
        exercised = {
            f"{c.name}.{name}": value
            for c in composition.components if c.strategy is not None and c.strategy.claim is not None
            for name, value in c.strategy.claim.exercised_at.items()
            if name not in params and f"{c.name}.{name}" not in params
        }
        if exercised:  # where the claim has something to test, unless the user chose
            params = {**params, **exercised}
            composition = compose(strategy, params)
        claims = [
            (c, c.strategy.claim) for c in composition.components
            if c.strategy is not None and c.strategy.claim is not None
        ]
        claims.sort(key=lambda item: CLAIM_PRIORITY.index(item[1].kind))
        kernel = common_kernel(composition)
        kernels = tuple(name for name in KERNELS if unsupported(composition, name) is None)
        if not claims:
            return Resolved(composition.name, strategy, params, None, None, kernel=kernel, kernels=kernels)
        component, claim = claims[0]
        return Resolved(
            composition.name, strategy, params, claim, component.name, kernel=kernel,
            claim_values=claim_values(component), kernels=kernels,
        )
    if params:
        raise ConfigurationError("parameters cannot be routed to a bare plugin object; set them on it")
    return Resolved(type(strategy).__name__, strategy, {}, None, None)


def commit_rule_of(resolved: Resolved) -> Resolved:
    """The strategy's commit rule alone (the reference of a ``lossless against kernel``
    claim): the component that provides ``dloom_select_commit``, with its parameters."""
    composition = compose(resolved.spec, resolved.params)
    provider = composition.provider("dloom_select_commit")
    if provider is None:
        raise ConfigurationError(f"strategy {resolved.name!r} has no commit rule to run as the kernel")
    component = next(c for c in composition.components if c.name == provider)
    return Resolved(f"kernel({provider})", component.plugin, {}, None, None)


def reference(against: Any, resolved: Resolved, params: Mapping[str, Any] | None = None) -> Resolved:
    """The reference ``against`` names, for ``resolved``: ``"kernel"`` or any strategy."""
    if against == KERNEL:
        return commit_rule_of(resolved)
    return resolve(against, params)
