"""The registered KV cache policies, fed by :func:`dloom.hooks.specs.dloom_register_cache_policies`,
and their lookup by name (:func:`cache_policy`: the value of a decoder's ``cache``).

The core's built-in policies register first (:mod:`dloom.model.cache_policy`, through
this module's implementation of the hook), then every
plugin module of the strategy registry (:func:`dloom.hooks.registry.get_registry`) that
implements the hook, in loading order. A plugin whose hook raises, or that registers an
object that is no :class:`~dloom.model.cache_policy.CachePolicy` or a name already taken, is
reported and skipped like any plugin part (:func:`dloom.hooks.registry.report_failure`:
fatal under ``DLOOM_STRICT_PLUGINS=1``). The policies are loaded once per registry: after
:func:`dloom.hooks.registry.reset_registry` the next lookup loads them again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType

from dloom.errors import ConfigurationError, PluginLoadError
from dloom.hooks.registry import Registry, get_registry, real_interrupts, report_failure
from dloom.hooks.specs import hookimpl
from dloom.model.cache_policy import BUILTIN_POLICIES, CachePolicy

_LOADED: tuple[Registry, dict[str, CachePolicy]] | None = None


@hookimpl
def dloom_register_cache_policies(register: Callable[[CachePolicy], None]) -> None:
    """The core's policies (:data:`dloom.model.cache_policy.BUILTIN_POLICIES`), registered
    as a plugin registers its own."""
    for policy in BUILTIN_POLICIES:
        register(policy)


def registered_cache_policies() -> dict[str, CachePolicy]:
    """Every registered policy by name, the built-ins first (loaded on first use)."""
    global _LOADED
    registry = get_registry()
    if _LOADED is None or _LOADED[0] is not registry:
        _LOADED = (registry, load_cache_policies(registry))
    return _LOADED[1]


def load_cache_policies(registry: Registry) -> dict[str, CachePolicy]:
    """Run the core's and every plugin module's ``dloom_register_cache_policies``.

    :raises PluginLoadError: for a broken built-in registration (never skipped), or a
        plugin's under ``DLOOM_STRICT_PLUGINS=1``.
    """
    policies: dict[str, CachePolicy] = {}
    _register_from(policies, "dloom", sys.modules[__name__], registry, [], builtin=True)
    with real_interrupts() as received:
        for plugin, module in registry.modules.items():
            _register_from(policies, plugin, module, registry, received, builtin=False)
    return policies


def _register_from(
    policies: dict[str, CachePolicy], plugin: str, module: ModuleType, registry: Registry,
    received: list[int], builtin: bool,
) -> None:
    """Add one module's policies to ``policies``: all of them, or none when any is refused
    (any exception counts, ``BaseException`` included, but a real Ctrl-C: ``received``)."""
    hook = getattr(module, "dloom_register_cache_policies", None)
    if hook is None:
        return
    found: dict[str, CachePolicy] = {}

    def register(policy: CachePolicy) -> None:
        if not isinstance(policy, CachePolicy) or not isinstance(policy.name, str) or not policy.name:
            raise PluginLoadError(
                f"register() takes a dloom cache policy (name, help, records, fixed_context, "
                f"window_width, static_slack), got {policy!r}"
            )
        if policy.name in policies or policy.name in found:
            raise PluginLoadError(f"cache policy {policy.name!r} is already registered")
        found[policy.name] = policy

    try:
        hook(register=register)
    except BaseException as error:  # noqa: BLE001 - isolate every third-party plugin
        if builtin or (received and isinstance(error, KeyboardInterrupt)):
            raise
        report_failure(registry, f"{plugin} (dloom_register_cache_policies)", error)
        return
    policies.update(found)


def cache_policy(cache: str | CachePolicy) -> CachePolicy:
    """The registered policy called ``cache`` (a policy object is returned as it is).

    :raises ConfigurationError: naming the value and the registered names (also for a
        value that is neither a name nor a policy).
    """
    if isinstance(cache, CachePolicy):
        return cache
    policies = registered_cache_policies()
    if cache not in policies:
        raise ConfigurationError(f"cache is {cache!r}; allowed: {', '.join(policies)}")
    return policies[cache]


def cache_modes(records: bool | None = None) -> tuple[str, ...]:
    """The names of every registered policy, the built-ins first (``records``: only those
    whose :attr:`~dloom.model.cache_policy.CachePolicy.records` is that)."""
    return tuple(
        name for name, policy in registered_cache_policies().items()
        if records is None or policy.records == records
    )


def cache_help() -> str:
    """One line per registered policy for a ``--cache`` help text: ``name: help``."""
    return "; ".join(f"{name}: {policy.help}" for name, policy in registered_cache_policies().items())
