"""The global strategy registry, fed by the ``dloom`` entry-point group.

It also holds the model families (:attr:`Registry.families`) that the plugins, and first the
core's own plugin modules (:data:`CORE_PLUGINS`), register through ``dloom_register_families``.

Loading is isolated per entry point: a plugin that fails to import or to register is
reported (a :class:`RuntimeWarning` and an entry in :attr:`Registry.failures`) and skipped,
unless ``DLOOM_STRICT_PLUGINS=1``, which makes it fatal (a :class:`PluginLoadError` naming
the plugin). Any exception counts, ``BaseException`` included: a plugin that calls
``sys.exit()`` or raises ``KeyboardInterrupt`` at import or in ``dloom_register_strategies``
is skipped like one that raises ``ImportError``. Only a Ctrl-C the process really received
while plugins load (:func:`real_interrupts`) still interrupts. ``DLOOM_PLUGINS`` selects the
third-party plugins to load: unset loads all installed ones, a comma list loads those (a
name no installed plugin has is warned about), an empty value loads the built-ins only.

Every registered strategy's plugin class is checked against the hook specifications when
it registers (:func:`check_plugin_class`): a ``dloom_*`` hook implementation whose name is
no hook (``dloom_select_comit``) or whose arguments the hook does not pass is reported and
that strategy skipped (fatal in strict mode), so it never reaches a decoder.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from dloom.errors import PluginLoadError, UnknownStrategyError, warn
from dloom.hooks import specs as hookspecs
from dloom.hooks.specs import PROJECT_NAME
from dloom.model.families import FamilyTable, collect_families
from dloom.types import DECODERS, Claim, Parameter, StrategyRegistration

BUILTIN_DISTRIBUTION = "dloom"
CORE_PLUGINS = {"families": "dloom.model.builtin_families"}
"""The core's own plugin modules by plugin name, loaded (by module name, as an entry point
is) before the ``dloom`` entry-point group; failures there are bugs, never skipped."""
DECODING_HOOKS = hookspecs.DECODING_HOOKS  # kept importable here for plugins and tests
DEFAULT_STRATEGY = "quota"
"""The strategy decoded with when none is named, the one place that names it:
:class:`dloom.DiffusionDecoder`'s default and that of every front-end (``--strategy`` of
the command line and ``dloom serve``, Ray's specs). A built-in plugin registers it."""


@dataclass(frozen=True)
class Strategy:
    """A registered strategy, stamped with the plugin that registered it."""

    name: str
    plugin: str
    registration: StrategyRegistration

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return tuple(self.registration.parameters)

    @property
    def guarantee(self) -> str:
        return self.registration.guarantee

    @property
    def summary(self) -> str:
        return self.registration.summary

    @property
    def claim(self) -> Claim | None:
        """The testable claim, or ``None`` when the strategy declares none."""
        return self.registration.claim

    @property
    def hooks(self) -> tuple[str, ...]:
        """The decoding hooks the strategy's plugin object implements."""
        return hooks_implemented_by(self.registration.plugin_class)

    def build(self, **params: object) -> object:
        """Instantiate the plugin object with ``params`` (already validated)."""
        return self.registration.plugin_class(**params)


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin, for ``dloom plugins``."""

    name: str
    version: str
    builtin: bool
    hooks: tuple[str, ...]
    strategies: tuple[str, ...]


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was reported and skipped."""

    name: str
    error: str


@dataclass
class Registry:
    """All strategies and plugins known to this process."""

    strategies: dict[str, Strategy] = field(default_factory=dict)
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    modules: dict[str, ModuleType] = field(default_factory=dict)
    """Each loaded plugin's module (what its module-level hooks, such as
    ``dloom_register_commands``, are called on), by plugin name."""
    families: FamilyTable = field(default_factory=FamilyTable)
    """The model families registered through ``dloom_register_families``
    (:mod:`dloom.model.families`)."""

    def get(self, name: str) -> Strategy:
        """Return the strategy called ``name``.

        :raises UnknownStrategyError: listing the known names and the closest match.
        """
        try:
            return self.strategies[name]
        except KeyError:
            known = sorted(self.strategies)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownStrategyError(
                f"unknown strategy {name!r}; known strategies: {', '.join(known)}.{hint}"
            ) from None


def hooks_implemented_by(obj: object) -> tuple[str, ...]:
    """Names of the ``dloom_*`` hooks that ``obj`` (a class, instance or module) implements."""
    names = []
    for attr in dir(obj):
        if attr.startswith("dloom_") and hasattr(getattr(obj, attr, None), f"{PROJECT_NAME}_impl"):
            names.append(attr)
    return tuple(sorted(names))


def check_plugin_class(plugin_class: object) -> None:
    """Check ``plugin_class``'s hook implementations against the hook specifications.

    :raises PluginLoadError: naming the hook: an unknown hook name (with the closest
        known one), or arguments the hook does not pass.
    """
    known = sorted(hookspecs.HOOKS)
    for name in dir(plugin_class):
        if not name.startswith("dloom_"):
            continue
        attribute = getattr(plugin_class, name, None)
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            marked = hasattr(attribute, f"{PROJECT_NAME}_impl")
            raise PluginLoadError(
                f"{getattr(plugin_class, '__name__', plugin_class)!r} defines {name}, which is "
                f"no dloom hook{' (marked @dloom.hookimpl)' if marked else ''}"
                + (f"; did you mean {close[0]!r}?" if close else f"; hooks: {', '.join(known)}")
            )
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(plugin_class, name=str(getattr(plugin_class, "__name__", plugin_class)))
        pm.check_pending()
    except pluggy.PluginValidationError as error:
        raise PluginLoadError(str(error)) from None


def check_registration(registration: StrategyRegistration, others: Iterable[Strategy]) -> None:
    """Check a registration's ``decoder`` and ``options`` (``others``: the strategies
    registered before it).

    :raises PluginLoadError: a decoder not in :data:`dloom.types.DECODERS`, an option
        that names none of the strategy's parameters, or one another strategy owns; an
        editing rule whose ``edit_budget`` names none of its integer parameters (a block it
        edits must settle within a bound).
    """
    where = f"strategy {registration.name!r}"
    if registration.decoder not in DECODERS:
        raise PluginLoadError(
            f"{where} names decoder {registration.decoder!r}; allowed: {', '.join(DECODERS)}"
        )
    parameters = [p.name for p in registration.parameters]
    if registration.edits:
        budgets = [p.name for p in registration.parameters if p.kind is int]
        if registration.edit_budget not in budgets:
            raise PluginLoadError(
                f"{where} edits, so its edit_budget must name the integer parameter that bounds "
                f"a block's post steps; got {registration.edit_budget!r}, allowed: {', '.join(budgets) or 'none'}"
            )
    owners = {option: s.name for s in others for option in s.registration.options}
    for option in registration.options:
        if option not in parameters:
            raise PluginLoadError(
                f"{where} offers option {option!r}, which is none of its parameters "
                f"({', '.join(parameters) or 'none'})"
            )
        if option in owners:
            raise PluginLoadError(
                f"{where} offers option --{option.replace('_', '-')}, which strategy "
                f"{owners[option]!r} already owns"
            )


def _strict() -> bool:
    return os.environ.get("DLOOM_STRICT_PLUGINS", "") not in ("", "0", "false", "no")


def _selected_third_party() -> set[str] | None:
    """Entry-point names selected by ``DLOOM_PLUGINS``; ``None`` means all of them."""
    value = os.environ.get("DLOOM_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def report_failure(registry: Registry, name: str, error: BaseException) -> None:
    """Record and warn about a plugin part that is skipped (fatal under ``DLOOM_STRICT_PLUGINS=1``)."""
    message = f"dloom plugin {name!r} was skipped: {type(error).__name__}: {error}"
    if getattr(error, "fatal", False):  # already reported by an inner check in strict mode
        raise error
    if _strict():
        fatal = PluginLoadError(message + " (DLOOM_STRICT_PLUGINS=1 makes this fatal)")
        fatal.fatal = True
        raise fatal from error
    registry.failures.append(PluginFailure(name=name, error=f"{type(error).__name__}: {error}"))
    warn(message, RuntimeWarning)


def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.name == BUILTIN_DISTRIBUTION


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    """Built-in entry points first, then the selected third-party ones, each once; warns
    about a ``DLOOM_PLUGINS`` name that no installed plugin has."""
    selected = _selected_third_party()
    available: set[str] = set()
    builtins, third_party = [], []
    seen: set[tuple[str | None, str]] = set()
    for ep in importlib.metadata.entry_points(group=PROJECT_NAME):
        key = (ep.dist.name if ep.dist is not None else None, ep.name)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        available.add(ep.name)
        if _is_builtin(ep):
            builtins.append(ep)
        elif selected is None or ep.name in selected:
            third_party.append(ep)
    for name in sorted((selected or set()) - available):
        close = difflib.get_close_matches(name, sorted(available), n=1)
        warn(
            f"DLOOM_PLUGINS names {name!r}, which no installed plugin provides"
            + (f"; did you mean {close[0]!r}?" if close else "")
            + f" (installed: {', '.join(sorted(available)) or 'none'})",
            RuntimeWarning,
        )
    return builtins + third_party


def _register_plugin(
    registry: Registry, name: str, module: ModuleType, version: str, builtin: bool
) -> None:
    """Run one plugin's ``dloom_register_strategies`` and ``dloom_register_families``, stamping
    what they register; a refused family raises, so nothing of the plugin is registered."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(module, name=name)
    pm.check_pending()
    registered: list[Strategy] = []

    def register(registration: StrategyRegistration) -> None:
        if not isinstance(registration, StrategyRegistration):
            raise TypeError(
                f"register() takes a dloom.StrategyRegistration, got {type(registration).__name__}"
            )
        taken = registry.strategies.get(registration.name) or next(
            (s for s in registered if s.name == registration.name), None
        )
        if taken is not None:
            raise PluginLoadError(
                f"strategy {registration.name!r} is already registered by plugin {taken.plugin!r}"
            )
        try:
            check_plugin_class(registration.plugin_class)
            check_registration(registration, [*registry.strategies.values(), *registered])
        except PluginLoadError as error:
            report_failure(registry, f"{name}:{registration.name}", error)
            return
        registered.append(Strategy(registration.name, name, registration))

    for impl in pm.hook.dloom_register_strategies.get_hookimpls():
        impl.function(register=register)
    # model families (dloom.model.families): a refused one raises, skipping the whole plugin
    families = collect_families(
        (impl.function for impl in pm.hook.dloom_register_families.get_hookimpls()), name, registry.families
    )
    registry.families.add(families)
    for strategy in registered:
        registry.strategies[strategy.name] = strategy
    hooks = set(hooks_implemented_by(module))
    for strategy in registered:
        hooks.update(strategy.hooks)
    registry.modules[name] = module
    registry.plugins[name] = PluginInfo(
        name=name,
        version=version,
        builtin=builtin,
        hooks=tuple(sorted(hooks)),
        strategies=tuple(s.name for s in registered),
    )


@contextmanager
def real_interrupts() -> Iterator[list[int]]:
    """Record the SIGINTs this process receives while the block runs (each still goes to
    the handler there was, Python's raising :class:`KeyboardInterrupt`), so that a plugin
    raising ``KeyboardInterrupt`` itself can be told from a real Ctrl-C. Only the main
    thread can install a signal handler; elsewhere (or where SIGINT is ignored) nothing is
    recorded."""
    received: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield received
        return

    def record(number: int, frame: Any) -> None:
        received.append(number)
        if callable(previous):  # Python's default raises KeyboardInterrupt; an app's its own
            previous(number, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, record)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


def load_registry() -> Registry:
    """Load every selected plugin from the ``dloom`` entry-point group into a new registry."""
    registry = Registry()
    try:
        version = importlib.metadata.version(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        version = "unknown"
    for name, module in CORE_PLUGINS.items():
        _register_plugin(registry, name, importlib.import_module(module), version, builtin=True)
    with real_interrupts() as received:
        for ep in _entry_points():
            _load_entry_point(registry, ep, received)
    return registry


def _load_entry_point(registry: Registry, ep: importlib.metadata.EntryPoint, received: list[int]) -> None:
    """Import and register one plugin; any exception it raises is reported and the plugin
    skipped (:func:`report_failure`), except a real Ctrl-C (``received``)."""
    builtin = _is_builtin(ep)
    version = ep.dist.version if ep.dist is not None else "unknown"
    try:
        if ep.name in registry.plugins:
            raise PluginLoadError(
                f"plugin name {ep.name!r} is already taken by "
                f"{'the built-in' if registry.plugins[ep.name].builtin else 'another'} plugin"
            )
        module = ep.load()
        if not inspect.ismodule(module):
            raise TypeError(f"entry point {ep.value!r} must name a module")
        _register_plugin(registry, ep.name, module, version, builtin)
    except BaseException as error:  # noqa: BLE001 - isolate every third-party plugin
        if received and isinstance(error, KeyboardInterrupt):
            raise
        report_failure(registry, ep.name, error)


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = load_registry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the loaded registry so the next :func:`get_registry` loads plugins again."""
    global _REGISTRY
    _REGISTRY = None
