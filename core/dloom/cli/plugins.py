"""The plugin-owned parts of the ``dloom`` command line: commands and strategy options.

* **Commands.** Every loaded plugin module that implements
  :func:`dloom.hooks.specs.dloom_register_commands` is handed a :class:`typer.Typer` of its
  own; the commands it declares join the core's (:class:`DloomGroup`), in ``dloom --help``
  too. A command named like a core command, or like one an earlier plugin declared, is
  reported and skipped (:func:`dloom.hooks.registry.report_failure`).
* **Options.** A strategy registration lists some of its parameters in
  :attr:`~dloom.StrategyRegistration.options`; every core command that takes ``--param``
  (:class:`StrategyOptionsCommand`: ``generate``, ``eval``, ``check``) then also takes
  ``--NAME VALUE`` for each, which it passes on as ``--param STRATEGY.NAME=VALUE`` (after
  the ``--param`` values, so it wins over them). The value is checked by the parameter
  itself, with the same message as ``--param``; a strategy spec without that strategy
  refuses it, naming its components.

* **Cache policies.** ``--cache``'s help lists the registered cache policies
  (:func:`dloom.hooks.cache_policies.cache_help`).

All are read from the registry when the command line is built (once per invocation).
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup, TyperOption

from dloom.cli.exits import end_quietly
from dloom.errors import DloomError, PluginLoadError
from dloom.hooks.registry import Registry, get_registry, real_interrupts, report_failure
from dloom.hooks.specs import PROJECT_NAME
from dloom.startup import hand_interrupts_to_commands

PARAM_OPTION = "param"
"""The ``--param`` option's parameter name: commands with it take strategy options."""

CACHE_OPTION = "cache"
"""The ``--cache`` option's parameter name: its help lists the registered cache policies."""


def cache_option_help() -> str:
    """``--cache``'s help: every registered cache policy and what it keeps
    (:func:`dloom.hooks.cache_policies.cache_help`)."""
    from dloom.hooks.cache_policies import cache_help

    return f"KV cache policy ({cache_help()}); exact for block-causal models."


def _or_exit(build: Any) -> Any:
    """``build()``, or exit with status 2 and the dloom error (a plugin failure under
    ``DLOOM_STRICT_PLUGINS=1``)."""
    try:
        return build()
    except DloomError as error:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
        raise typer.Exit(code=2) from None


# --- options ---------------------------------------------------------------------------


def _metavar(parameter: Any) -> str:
    if parameter.choices is not None:
        return "[" + "|".join(str(c) for c in parameter.choices) + "]"
    kind = {int: "INTEGER", float: "FLOAT", bool: "BOOLEAN"}.get(parameter.kind, "TEXT")
    return "|".join((kind, *parameter.words))


def strategy_options(registry: Registry) -> list[tuple[str, str, Any]]:
    """Every offered option as ``(flag, strategy, parameter)``, sorted by strategy."""
    found = []
    for strategy in sorted(registry.strategies.values(), key=lambda s: s.name):
        parameters = {p.name: p for p in strategy.parameters}
        for name in strategy.registration.options:
            found.append((f"--{name.replace('_', '-')}", strategy.name, parameters[name]))
    return found


def _option_params(options: list[tuple[str, str, Any]]) -> list[Any]:
    """The options as command-line parameters, built by typer from a signature of
    ``str | None`` keywords (the value is parsed by the strategy's parameter)."""
    signature = inspect.Signature([
        inspect.Parameter(
            f"option_{index}", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
            default=typer.Option(
                None, flag, metavar=_metavar(parameter),
                help=f"{strategy}: {parameter.help}.",
            ),
        )
        for index, (flag, strategy, parameter) in enumerate(options)
    ])

    def holder(**values: Any) -> None:
        """Holds the signature typer reads."""

    holder.__signature__ = signature  # type: ignore[attr-defined]
    helper = typer.Typer()
    helper.command()(holder)
    return list(typer.main.get_command(helper).params)


class StrategyOptionsCommand(TyperCommand):
    """A core command that also takes the strategies' options (see the module docstring)."""

    def _strategy_options(self, ctx: Any) -> list[tuple[Any, str, str]]:
        """``(parameter, strategy, name)`` per option this command takes, built once per
        context."""
        key = f"{PROJECT_NAME}.strategy_options.{self.name}"
        if key not in ctx.meta:
            ctx.meta[key] = _or_exit(self._build_strategy_options)
        return ctx.meta[key]

    def _build_strategy_options(self) -> list[tuple[Any, str, str]]:
        """An option whose flag the command has already is reported and skipped."""
        registry = get_registry()
        taken = {opt for param in self.params for opt in param.opts}
        options = []
        for flag, strategy, parameter in strategy_options(registry):
            if flag in taken:
                report_failure(registry, f"{strategy}:{flag}", PluginLoadError(
                    f"strategy {strategy!r} offers option {flag}, which `dloom {self.name}` "
                    "already has; use --param instead"
                ))
                continue
            options.append((flag, strategy, parameter))
        params = _option_params(options)
        return [(p, s, par.name) for p, (_, s, par) in zip(params, options)]

    def get_params(self, ctx: Any) -> list[Any]:
        own = super().get_params(ctx)
        for param in own:
            if param.name == CACHE_OPTION and isinstance(param, TyperOption):  # lists the policies
                param.help = _or_exit(cache_option_help)
        help_option = self.get_help_option(ctx)
        extra = [param for param, _, _ in self._strategy_options(ctx)]
        if help_option is None:
            return [*own, *extra]
        return [*(p for p in own if p is not help_option), *extra, help_option]

    def invoke(self, ctx: Any) -> Any:
        given = []
        for param, strategy, name in self._strategy_options(ctx):
            value = ctx.params.pop(param.name, None)
            if value is not None:
                given.append(f"{strategy}.{name}={value}")
        if given:
            ctx.params[PARAM_OPTION] = [*(ctx.params.get(PARAM_OPTION) or ()), *given]
        return super().invoke(ctx)


# --- commands --------------------------------------------------------------------------


def plugin_commands(registry: Registry, core: set[str]) -> dict[str, Any]:
    """The commands the loaded plugins declare, by name, none named like one of ``core``."""
    with real_interrupts() as received:
        return _declared_commands(registry, core, received)


def _declared_commands(registry: Registry, core: set[str], received: list[int]) -> dict[str, Any]:
    """:func:`plugin_commands`; any exception a plugin's ``dloom_register_commands`` raises
    (``SystemExit`` too) is reported and its commands skipped, except a real Ctrl-C."""
    commands: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for plugin, module in registry.modules.items():
        register = getattr(module, "dloom_register_commands", None)
        if register is None or not hasattr(register, f"{PROJECT_NAME}_impl"):
            continue
        cli = typer.Typer()
        try:
            register(cli=cli)
            declared = (
                typer.main.get_group(cli).commands
                if cli.registered_commands or cli.registered_groups else {}
            )
        except BaseException as error:  # noqa: BLE001 - isolate every plugin's commands
            if received and isinstance(error, KeyboardInterrupt):
                raise
            report_failure(registry, f"{plugin} (dloom_register_commands)", error)
            continue
        for name, command in declared.items():
            owner = "the core" if name in core else owners.get(name)
            if owner is not None:
                report_failure(registry, f"{plugin}:{name}", PluginLoadError(
                    f"plugin {plugin!r} declares command {name!r}, which {owner} has already"
                ))
                continue
            commands[name], owners[name] = command, f"plugin {plugin!r}"
    return commands


class DloomGroup(TyperGroup):
    """The ``dloom`` group: the core's commands, then the plugins' (built once per
    context)."""

    def _plugin_commands(self, ctx: Any) -> dict[str, Any]:
        key = f"{PROJECT_NAME}.plugin_commands"
        root = ctx.find_root()
        if key not in root.meta:
            root.meta[key] = _or_exit(lambda: plugin_commands(get_registry(), set(self.commands)))
        return root.meta[key]

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *sorted(self._plugin_commands(ctx))]

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line; Ctrl-C now raises ``KeyboardInterrupt`` (no longer the
        startup exit of :mod:`dloom.startup`)."""
        hand_interrupts_to_commands()
        return super().main(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        """Run the chosen command (loading plugins first); a Ctrl-C or an output error
        that the command did not report itself ends with one line
        (:func:`dloom.cli.exits.end_quietly`)."""
        return end_quietly(lambda: super(DloomGroup, self).invoke(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        return super().get_command(ctx, cmd_name) or self._plugin_commands(ctx).get(cmd_name)
