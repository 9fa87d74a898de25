"""Model families as registrations: a profile and its native layout, registered through a hook.

A plugin adds a family by implementing :func:`dloom.hooks.specs.dloom_register_families` and
calling ``register`` with a :class:`FamilyRegistration`; the core's own families
(:mod:`dloom.model.builtin_families`) are registered the same way, before any plugin. The
process-wide :class:`FamilyTable` (``dloom.get_registry().families``) recognises a
checkpoint's family from its config (:meth:`FamilyTable.detect`).

Precedence, for a config that more than one family could claim:

1. a family whose identifiers match (``model_type``, ``architectures`` or the ``auto_map``
   module names of its :class:`~dloom.model.profiles.ModelProfile`), in registration order;
2. a family recognised by its own test (:attr:`FamilyRegistration.recognises`), in
   registration order (the built-in ``causal-lm``: no mask token, attention not declared
   bidirectional);
3. the catch-all: the one family with neither (the built-in ``transformers``, whose
   conventions all come from the config).

No identifier is claimed twice: a registration whose name, ``model_type``, architecture or
code module another family already has, or a second catch-all, is refused with a
:class:`~dloom.errors.PluginLoadError` naming both families, and its plugin is reported and
skipped like any broken plugin (fatal under ``DLOOM_STRICT_PLUGINS=1``). The built-ins
register first, so a plugin can add families but never take over a built-in one's
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dloom.errors import ModelError, PluginLoadError
from dloom.model.checkpoints import NativeLayout
from dloom.model.profiles import ModelProfile, config_dict


@dataclass(frozen=True)
class FamilyRegistration:
    """One model family, as a plugin registers it.

    :ivar profile: the family's conventions; its ``name`` names the family.
    :ivar layout: how its checkpoints load onto a native ``transformers`` class (config
        translation and tensor renames), or ``None`` for checkpoints ``transformers`` loads
        as they are. ``layout.family`` must be ``profile.name``.
    :ivar recognises: for a family without identifiers (``model_types``, ``architectures``,
        ``code_modules``), the test that claims a config dict no identified family claims;
        ``None`` for an identified family, or for the one catch-all family.
    """

    profile: ModelProfile
    layout: NativeLayout | None = None
    recognises: Callable[[Mapping[str, Any]], bool] | None = None

    @property
    def name(self) -> str:
        return self.profile.name


@dataclass(frozen=True)
class Family:
    """A registered family, stamped with the plugin that registered it."""

    plugin: str
    registration: FamilyRegistration

    @property
    def name(self) -> str:
        return self.registration.name

    @property
    def profile(self) -> ModelProfile:
        return self.registration.profile

    @property
    def layout(self) -> NativeLayout | None:
        return self.registration.layout

    @property
    def identifiers(self) -> dict[str, tuple[str, ...]]:
        """What recognises the family in a config, by kind (empty kinds left out)."""
        profile = self.profile
        kinds = {"model_type": profile.model_types, "architecture": profile.architectures,
                 "code module": profile.code_modules}
        return {kind: values for kind, values in kinds.items() if values}

    @property
    def is_catch_all(self) -> bool:
        return not self.identifiers and self.registration.recognises is None

    def describe(self) -> str:
        return f"family {self.name!r} of plugin {self.plugin!r}"


def check_registration(registration: object, plugin: str, taken: Iterable[Family]) -> Family:
    """The :class:`Family` of ``registration`` by ``plugin``, checked against the families
    registered before it (``taken``).

    :raises PluginLoadError: for no :class:`FamilyRegistration`, a layout of another family,
        a ``recognises`` test on an identified family, an upper-case ``model_type`` (configs'
        are compared lower-cased), or a name, identifier or catch-all another family has.
    """
    if not isinstance(registration, FamilyRegistration):
        raise PluginLoadError(
            f"register() takes a dloom.FamilyRegistration, got {type(registration).__name__}"
        )
    family = Family(plugin, registration)
    where = f"family {family.name!r}"
    if registration.layout is not None and registration.layout.family != family.name:
        raise PluginLoadError(
            f"{where} has the layout of family {registration.layout.family!r}; a layout's "
            "family must be its profile's name"
        )
    if registration.recognises is not None and family.identifiers:
        raise PluginLoadError(
            f"{where} has identifiers ({_listed(family.identifiers)}) and a recognises test; "
            "give one or the other"
        )
    upper = [t for t in family.profile.model_types if t != t.lower()]
    if upper:
        raise PluginLoadError(f"{where} lists model_type {upper[0]!r}; model_types must be lower-case")
    for other in taken:
        if other.name == family.name:
            raise PluginLoadError(f"{where} is already registered as the {other.describe()}")
        for kind, values in family.identifiers.items():
            shared = sorted(set(values) & set(other.identifiers.get(kind, ())))
            if shared:
                raise PluginLoadError(
                    f"{where} claims {kind} {shared[0]!r}, which the {other.describe()} already "
                    "claims; a family cannot take over another's checkpoints"
                )
        if family.is_catch_all and other.is_catch_all:
            raise PluginLoadError(
                f"{where} has no identifiers and no recognises test, so it would recognise "
                f"every config, as the {other.describe()} already does"
            )
    return family


def _listed(identifiers: Mapping[str, tuple[str, ...]]) -> str:
    return "; ".join(f"{kind} {', '.join(values)}" for kind, values in identifiers.items())


def collect_families(
    implementations: Iterable[Callable[..., object]], plugin: str, taken: Iterable[Family]
) -> list[Family]:
    """Run one plugin's ``dloom_register_families`` implementations and return the families
    they register, each checked by :func:`check_registration` against ``taken`` and the
    ones before it (a refused one raises, so that the plugin is skipped as a whole)."""
    registered: list[Family] = []
    earlier = list(taken)

    def register(registration: FamilyRegistration) -> None:
        registered.append(check_registration(registration, plugin, [*earlier, *registered]))

    for implementation in implementations:
        implementation(register=register)
    return registered


class FamilyTable:
    """The registered model families, in registration order (the core's first)."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def add(self, families: Iterable[Family]) -> None:
        """Append families already checked by :func:`check_registration` against this table."""
        for family in families:
            self._families[family.name] = family

    def __iter__(self) -> Iterator[Family]:
        return iter(self._families.values())

    def __len__(self) -> int:
        return len(self._families)

    def get(self, name: str) -> Family:
        """The family whose profile is called ``name``.

        :raises ModelError: naming the registered families.
        """
        try:
            return self._families[name]
        except KeyError:
            raise ModelError(
                f"no model family {name!r} is registered; registered: {', '.join(self._families)}"
            ) from None

    def detect(self, config: Any) -> Family:
        """The family of a checkpoint, from its config alone, by the precedence of
        :mod:`dloom.model.families` (identifiers, then ``recognises`` tests, then the
        catch-all).

        :param config: a mapping, a ``transformers`` config or a checkpoint directory.
        :raises ModelError: when no family recognises it (no catch-all is registered).
        """
        values = config_dict(config)
        for family in self:
            if family.identifiers and family.profile.matches(values):
                return family
        for family in self:
            if family.registration.recognises is not None and family.registration.recognises(values):
                return family
        for family in self:
            if family.is_catch_all:
                return family
        raise ModelError(
            f"no registered model family recognises model_type {values.get('model_type')!r}; "
            f"registered: {', '.join(self._families) or 'none'}"
        )


def needs_remote_code(config: Mapping[str, Any], family: Family) -> bool:
    """Whether loading the checkpoint would run code shipped with it: an ``auto_map`` for a
    ``model_type`` that ``transformers`` does not know, outside the families recognised by
    their identifiers (which load onto native classes, or are refused as unsupported)."""
    if family.identifiers or not config.get("auto_map"):
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return config.get("model_type") not in CONFIG_MAPPING
