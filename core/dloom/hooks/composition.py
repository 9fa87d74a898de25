"""Turn a strategy spec (``"threshold"``, ``"spiffy+frechet"``, plugin objects) into one
plugin manager, checking the composition when the decoder is built, never mid-decode.

Who answers a decoding hook: each single-answer hook has at most one provider in a
composition; two components implementing it is a :class:`~dloom.errors.CompositionError`,
unless one of them is an explicit **replacement** of that hook: :func:`replace`
(``dloom.replace("prune", MyPrune())``) or ``NAME@HOOK`` in a spec string
(``"spiffy+quota+myprune@prune"``). A replacement answers exactly the decoding hooks it
names, instead of every other component's implementation of them (those are not called at
all); its other decoding hooks are left out, its ``dloom_configure`` still runs. Two
replacements of one hook are an error.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy
import torch

from dloom.errors import CompositionError, ConfigurationError, warn
from dloom.hooks import specs as hookspecs
from dloom.hooks.calls import DEFAULTS_PLUGIN
from dloom.hooks.registry import (
    DECODING_HOOKS,
    Registry,
    Strategy,
    get_registry,
    hooks_implemented_by,
)
from dloom.hooks.specs import PROJECT_NAME, hookimpl
from dloom.types import BlockSchedule, DraftGraph

StrategySpec = str | object | Sequence[str | object]


@dataclass(frozen=True)
class Replacement:
    """A composition member that answers ``hooks`` instead of the other members
    (:func:`replace`).

    :ivar plugin: a registered strategy name or a plugin object.
    :ivar hooks: full decoding-hook names (``"dloom_prune"``).
    """

    plugin: object
    hooks: tuple[str, ...]


def replace(hook: str | Sequence[str], plugin: object) -> Replacement:
    """Mark ``plugin`` as the one answer of ``hook`` in a composition, replacing the
    implementation of whichever strategy would otherwise answer it.

    :param hook: a decoding hook, with or without the ``dloom_`` prefix (``"prune"``,
        ``"dloom_verify"``), or several.
    :param plugin: a plugin object or a registered strategy name.
    :raises CompositionError: for a hook that is not a decoding hook, or one ``plugin``
        does not implement.
    """
    names = (hook,) if isinstance(hook, str) else tuple(hook)
    full = tuple(h if h.startswith(f"{PROJECT_NAME}_") else f"{PROJECT_NAME}_{h}" for h in names)
    unknown = [h for h in full if h not in DECODING_HOOKS]
    if unknown or not full:
        raise CompositionError(
            f"cannot replace {', '.join(map(repr, names)) or 'no hook'}: allowed: "
            + ", ".join(h.removeprefix(f"{PROJECT_NAME}_") for h in DECODING_HOOKS)
        )
    return Replacement(plugin, full)


class CoreDefaults:
    """Built-in fallbacks, registered ``trylast`` so that any strategy overrides them."""

    @hookimpl(trylast=True)
    def dloom_prune(self, graph: DraftGraph, budget: int) -> DraftGraph:
        """Keep the whole graph (no pruning)."""
        return graph


REQUIRED_SPECULATION_HOOKS = tuple(
    hook for hook in hookspecs.SPECULATION_HOOKS if hook not in hooks_implemented_by(CoreDefaults)
)
"""The speculation hooks a speculator must provide together (the core has no default)."""


@dataclass(frozen=True)
class Component:
    """One member of a composition: its display name, plugin object and parameters.

    :ivar answers: the hooks this member answers in the composition (its implemented hooks,
        less decoding hooks a replacement took over; a replacement's: the hooks it names plus
        its non-decoding ones).
    :ivar replaces: the decoding hooks this member replaces (empty for an ordinary member).
    """

    name: str
    plugin: object
    params: Mapping[str, Any]
    strategy: Strategy | None
    answers: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()


@dataclass(frozen=True)
class Composition:
    """A validated strategy composition (the ``+``-joined name and its components)."""

    name: str
    components: tuple[Component, ...]

    def provider(self, hook: str) -> str | None:
        """Name of the component that answers ``hook``, or ``None``."""
        for component in self.components:
            if hook in component.answers:
                return component.name
        return None

    def hook_table(self) -> dict[str, dict[str, Any]]:
        """Who answers each decoding hook, JSON-ready: ``{hook: {"provider": name or None,
        "replaces": [names whose implementation it overrides]}}``."""
        table = {}
        for hook in DECODING_HOOKS:
            provider = self.provider(hook)
            replaced = [
                c.name for c in self.components
                if c.name != provider and hook in hooks_implemented_by(c.plugin) and hook not in c.answers
            ]
            table[hook] = {"provider": provider, "replaces": replaced}
        return table

    def params(self) -> dict[str, dict[str, Any]]:
        """The parameters each component runs with, by component name."""
        return {c.name: dict(c.params) for c in self.components}

    @property
    def guarantees(self) -> dict[str, str]:
        return {c.name: c.strategy.guarantee for c in self.components if c.strategy is not None}

    def guarantees_under(self, temperature: float, remasking: str) -> dict[str, str]:
        """What each component still promises at ``temperature`` and ``remasking``, warning
        when a claim is dropped.

        A ``bound`` claim certifies the committed tokens from their probabilities: it holds
        only for greedy decoding (``temperature == 0``) with ``low_confidence`` remasking,
        where the confidence is the committed token's probability. Under sampling or another
        remasking the bound is not claimed; what still holds is recorded instead.

        A claim with ``holds_when`` (:attr:`dloom.Claim.holds_when`) is not made where the
        component's parameters, the temperature or the remasking break it: the guarantee
        recorded says so.
        """
        recorded = {}
        for name, guarantee in self.guarantees.items():
            component = next(c for c in self.components if c.name == name and c.strategy is not None)
            claim = component.strategy.claim if component.strategy is not None else None
            unmet = claim.unmet(claim_values(component, temperature, remasking)) if claim is not None else []
            if claim is not None and unmet:
                plain = dataclasses.replace(claim, holds_when={}).describe(conditions=False)
                guarantee = f"{plain} not claimed at {', '.join(unmet)}"
                warn(f"strategy {name!r}: {guarantee}")
            elif claim is not None and claim.kind == "bound" and (temperature > 0 or remasking != "low_confidence"):
                why = f"temperature {temperature:g}" if temperature > 0 else f"remasking {remasking!r}"
                guarantee = (
                    f"bound {claim.bound} not certified under {why} (it needs temperature 0 and "
                    "low_confidence remasking); what holds: every committed token is one the "
                    "kernel proposed, with no bound on the joint"
                )
                warn(f"strategy {name!r}: {guarantee}")
            recorded[name] = guarantee
        return recorded

    def reads_step_budget(self) -> bool:
        """Whether the commit rule reads the schedule's ``steps_per_block`` (a quota rule
        does; a threshold rule ignores ``steps``). Found by calling it once on a one-row
        block and watching the schedule; a rule that fails the probe counts as reading it."""
        provider = self.provider("dloom_select_commit")
        plugin: Any = next(c.plugin for c in self.components if c.name == provider)
        read: list[str] = []

        class WatchedSchedule(BlockSchedule):
            def __getattribute__(self, name: str) -> Any:
                if name == "steps_per_block":
                    read.append(name)
                return super().__getattribute__(name)

        schedule = WatchedSchedule(
            step_in_block=torch.zeros(1, dtype=torch.long), steps_per_block=2,
            masked_at_block_start=torch.full((1,), 4, dtype=torch.long),
        )
        confidence = torch.tensor([[0.9, 0.6, 0.3, 0.1]], dtype=torch.float64)
        probabilities = torch.stack([confidence, 1 - confidence], dim=-1)  # (1, 4, 2)
        entropy = -(probabilities * probabilities.log()).sum(-1)
        signals = {
            "confidence": confidence, "margin": (2 * confidence - 1).abs(), "entropy": entropy,
            "probabilities": probabilities,
        }
        arguments = {
            "confidence": confidence, "selectable": torch.ones(1, 4, dtype=torch.bool),
            "schedule": schedule, "signals": signals,
        }
        try:  # as pluggy calls it: with the arguments the implementation names
            taken = inspect.signature(plugin.dloom_select_commit).parameters
            plugin.dloom_select_commit(**{k: v for k, v in arguments.items() if k in taken})
        except Exception:  # noqa: BLE001 - cannot tell: assume the steps matter
            return True
        return bool(read)


def claim_values(component: Component, temperature: float | None = None, remasking: str | None = None) -> dict[str, Any]:
    """What a component's claim is judged at (:meth:`dloom.Claim.unmet`): every parameter
    of its strategy (given or default, coerced as its plugin got it), and the decoder's
    ``temperature`` and ``remasking`` where given."""
    values: dict[str, Any] = {}
    if component.strategy is not None:
        registration = component.strategy.registration
        for parameter in registration.parameters:
            given = component.params.get(parameter.name, parameter.default)
            values[parameter.name] = parameter.coerce(given, registration.name)
    if temperature is not None:
        values["temperature"] = temperature
    if remasking is not None:
        values["remasking"] = remasking
    return values


def split_spec(spec: StrategySpec) -> list[str | object]:
    """The members of a strategy spec, the one parser of spec strings: ``"a+b+c@prune"`` is
    ``["a", "b", Replacement("c", ("dloom_prune",))]``; plugin objects and the items of a
    sequence are taken as they are (a string item is split too).

    :raises ConfigurationError: for an empty member or a ``NAME@HOOK`` without one side.
    :raises CompositionError: for ``@HOOK`` naming no decoding hook.
    """
    if isinstance(spec, str):
        parts = [part.strip() for part in spec.split("+")]
        if not all(parts):
            raise ConfigurationError(f"malformed strategy {spec!r}: use names joined by '+'")
        items: list[str | object] = []
        for part in parts:
            name, at, hooks = part.partition("@")
            if at and not (name.strip() and hooks.strip()):
                raise ConfigurationError(f"malformed strategy {spec!r}: write NAME@HOOK, e.g. myprune@prune")
            items.append(replace(hooks.strip().split(","), name.strip()) if at else part)
        return items
    if isinstance(spec, Sequence):
        flat: list[str | object] = []
        for item in spec:
            flat.extend(split_spec(item) if isinstance(item, str) else [item])
        return flat
    return [spec]


def strategy_names(spec: StrategySpec) -> list[str]:
    """The registered strategy names ``spec`` names, ``@HOOK`` suffixes removed
    (``"spiffy+quota+myprune@prune"``: ``["spiffy", "quota", "myprune"]``); plugin objects
    are left out."""
    members = [m.plugin if isinstance(m, Replacement) else m for m in split_spec(spec)]
    return [m for m in members if isinstance(m, str)]


def _route_params(
    strategies: list[Strategy], params: Mapping[str, Any], spec_name: str,
    generation: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Send each parameter to the strategies that declare it (``name`` or ``strategy.name``);
    a parameter not given takes the model's ``generation`` config value it names
    (:attr:`dloom.types.Parameter.generation_key`), else its default."""
    routed: dict[str, dict[str, Any]] = {s.name: {} for s in strategies}
    by_name = {s.name: s for s in strategies}
    for key, value in params.items():
        target, _, pname = key.rpartition(".")
        if target:
            if target not in by_name:
                raise ConfigurationError(
                    f"parameter {key!r} names strategy {target!r}, which is not part of "
                    f"{spec_name!r}; components: {', '.join(by_name)}"
                )
            owners = [by_name[target]]
        else:
            owners = list(strategies)
        owners = [s for s in owners if any(p.name == pname for p in s.parameters)]
        if not owners:
            allowed = sorted(f"{p.name} ({s.name})" for s in strategies for p in s.parameters)
            raise ConfigurationError(
                f"unknown parameter {key!r} for strategy {spec_name!r}; allowed: "
                + (", ".join(allowed) if allowed else "none")
            )
        for owner in owners:
            parameter = next(p for p in owner.parameters if p.name == pname)
            routed[owner.name][pname] = parameter.coerce(value, owner.name)
    for strategy in strategies:
        for parameter in strategy.parameters:
            if parameter.name in routed[strategy.name]:
                continue
            configured = parameter.generation_default(generation or {})
            routed[strategy.name][parameter.name] = (
                parameter.default if configured is None else parameter.coerce(configured, strategy.name)
            )
    return routed


def compose(
    spec: StrategySpec,
    params: Mapping[str, Any] | None = None,
    registry: Registry | None = None,
    generation: Mapping[str, Any] | None = None,
) -> Composition:
    """Resolve ``spec`` into plugin objects with validated parameters.

    :param spec: a registered name, names joined with ``+``, a plugin object (any object
        with ``@dloom.hookimpl`` methods), or a sequence of those; or a :class:`Composition`
        (returned as it is).
    :param params: strategy parameters; ``name`` goes to every component that declares it,
        ``strategy.name`` to one component.
    :param generation: the generation config of the model decoded with it
        (:attr:`dloom.ModelAdapter.generation`): the defaults of the parameters that name one
        of its keys.
    :raises UnknownStrategyError: for an unregistered name.
    :raises ConfigurationError: for an unknown parameter or a value out of range.
    :raises CompositionError: when two components answer the same decoding hook.
    """
    if isinstance(spec, Composition):
        if params:
            raise ConfigurationError(
                f"composition {spec.name!r} is already built; give its parameters when composing it"
            )
        return spec
    registry = registry or get_registry()
    members = split_spec(spec)
    replacing = {id(m.plugin) if not isinstance(m.plugin, str) else m.plugin: m.hooks
                 for m in members if isinstance(m, Replacement)}
    items = [m.plugin if isinstance(m, Replacement) else m for m in members]
    strategies = [registry.get(item) for item in items if isinstance(item, str)]
    items += _default_commit_rule(items, strategies, registry)
    strategies = [registry.get(item) for item in items if isinstance(item, str)]
    names = [s.name for s in strategies]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise CompositionError(f"strategy {sorted(duplicates)[0]!r} appears twice in the composition")
    display = "+".join(
        (item if isinstance(item, str) else type(item).__name__)
        + ("@" + ",".join(h.removeprefix(f"{PROJECT_NAME}_") for h in replacing[_key(item)]) if _key(item) in replacing else "")
        for item in items
    )
    routed = _route_params(strategies, params or {}, display, generation)
    components: list[Component] = []
    for item in items:
        if isinstance(item, str):
            strategy = registry.get(item)
            plugin = strategy.build(**routed[strategy.name])
            components.append(Component(strategy.name, plugin, routed[strategy.name], strategy))
        else:
            if not hooks_implemented_by(item):
                raise CompositionError(
                    f"{item!r} implements no dloom hook; decorate its methods with @dloom.hookimpl"
                )
            taken = {c.name for c in components} | set(names)
            name, suffix = type(item).__name__, 2
            while name in taken:
                name, suffix = f"{type(item).__name__}#{suffix}", suffix + 1
            components.append(Component(name, item, {}, None))
    composition = Composition(display, _assign_answers(components, [replacing.get(_key(i), ()) for i in items]))
    _check_single_answers(composition)
    return composition


def _key(item: str | object) -> int | str:
    return item if isinstance(item, str) else id(item)


def _assign_answers(components: list[Component], replaces: list[tuple[str, ...]]) -> tuple[Component, ...]:
    """Each component's :attr:`Component.answers` under the replacement rule (module docstring)."""
    taken: dict[str, str] = {}
    for component, hooks in zip(components, replaces):
        implemented = hooks_implemented_by(component.plugin)
        for hook in hooks:
            if hook not in implemented:
                raise CompositionError(
                    f"{component.name!r} replaces {hook} but does not implement it; it implements "
                    + (", ".join(implemented) or "no hook")
                )
            if hook in taken:
                raise CompositionError(
                    f"{taken[hook]!r} and {component.name!r} both replace {hook}; a hook has one replacement"
                )
            taken[hook] = component.name
    result = []
    for component, hooks in zip(components, replaces):
        implemented = hooks_implemented_by(component.plugin)
        if hooks:
            answers = tuple(h for h in implemented if h in hooks or h not in DECODING_HOOKS)
        else:
            answers = tuple(h for h in implemented if h not in taken)
        result.append(dataclasses.replace(component, answers=answers, replaces=hooks))
    return tuple(result)


def _default_commit_rule(
    items: list[str | object], strategies: list[Strategy], registry: Registry
) -> list[str]:
    """The commit rule to add when no member provides one and a member names a default
    (``spiffy`` alone runs over ``quota``)."""
    commits = [
        item for item in items
        if "dloom_select_commit" in hooks_implemented_by(
            registry.get(item).registration.plugin_class if isinstance(item, str) else item
        )
    ]
    defaults = [s.registration.default_commit_rule for s in strategies]
    default = next((d for d in defaults if d), None)
    return [] if commits or default is None else [default]


def _check_single_answers(composition: Composition) -> None:
    for hook in DECODING_HOOKS:
        providers = [c.name for c in composition.components if hook in c.answers]
        if len(providers) > 1:
            short = hook.removeprefix(f"{PROJECT_NAME}_")
            raise CompositionError(
                f"strategies {providers[0]!r} and {providers[1]!r} both answer {hook}, a "
                f"single-answer hook; a decoder takes one provider of each hook (to replace "
                f"one strategy's {short} with another's, say so: dloom.replace({short!r}, plugin) "
                f"or NAME@{short} in the strategy spec)"
            )
    speculation = [h for h in REQUIRED_SPECULATION_HOOKS if composition.provider(h) is not None]
    if speculation and len(speculation) != len(REQUIRED_SPECULATION_HOOKS):
        missing = [h for h in REQUIRED_SPECULATION_HOOKS if h not in speculation]
        raise CompositionError(
            f"composition {composition.name!r} speculates ({', '.join(speculation)}) but "
            f"nothing provides {', '.join(missing)}"
        )


def _trace(hook_name: str, hook_impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    providers = ", ".join(impl.plugin_name for impl in hook_impls if not impl.wrapper)
    print(f"[dloom trace] {hook_name} -> {providers or '(no plugin)'}", file=sys.stderr)


class _CompositionManager(pluggy.PluginManager):
    """A plugin manager that registers, for each composition member, only the hooks it
    answers (:attr:`Component.answers`): a replaced implementation is never called."""

    def __init__(self, project_name: str, answers: Mapping[int, set[str]]) -> None:
        super().__init__(project_name)
        self._answers = answers

    def parse_hookimpl_opts(self, plugin: Any, name: str):
        allowed = self._answers.get(id(plugin))
        if allowed is not None and name.startswith(f"{PROJECT_NAME}_") and name not in allowed:
            return None
        return super().parse_hookimpl_opts(plugin, name)


def build_plugin_manager(composition: Composition, *extra: object) -> pluggy.PluginManager:
    """A fresh plugin manager holding exactly the composition's plugins, the core defaults
    and ``extra`` wrapper plugins (timing). ``DLOOM_TRACE=1`` prints every hook call and the
    plugins that implement it."""
    pm = _CompositionManager(PROJECT_NAME, {id(c.plugin): set(c.answers) for c in composition.components})
    pm.add_hookspecs(hookspecs)
    for component in composition.components:
        pm.register(component.plugin, name=component.name)
    pm.register(CoreDefaults(), name=DEFAULTS_PLUGIN)
    for plugin in extra:
        pm.register(plugin)
    pm.check_pending()
    if os.environ.get("DLOOM_TRACE", "") not in ("", "0"):
        pm.add_hookcall_monitoring(_trace, lambda *args: None)
    return pm
