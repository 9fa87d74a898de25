"""The SDK for plugins that add commands to the ``dloom`` command line
(``dloom_register_commands``): the core's option defaults, so that a plugin's command
spells ``--model`` or ``--strategy`` as the core's do, and the helpers the core's commands
use to build a decoder, read prompts, refuse an output path and report an error.

The option defaults, each the core commands' own (a ``typer.Option``): ``ModelOption``
(``--model``), ``StrategyOption`` (``--strategy``), ``ParamOption`` (``--param``),
``GenLengthOption``, ``BlockLengthOption``, ``StepsOption``, ``TemperatureOption``,
``RemaskingOption``, ``CacheOption``, ``CacheRefreshOption``, ``DeviceOption``,
``DtypeOption`` and ``JsonOption`` (``--json``).

Importing this module imports the command line (typer, rich); :mod:`dloom.sdk` does not.
The version policy is :mod:`dloom.sdk`'s.
"""

from __future__ import annotations

from rich.console import Console

from dloom.cli import commands as _commands
from dloom.cli.commands import (
    BlockLengthOption,
    CacheOption,
    CacheRefreshOption,
    DeviceOption,
    DtypeOption,
    GenLengthOption,
    JsonOption,
    ModelOption,
    ParamOption,
    RemaskingOption,
    StepsOption,
    StrategyOption,
    TemperatureOption,
    build_decoder,
    check_output,
    read_prompts,
)

__all__ = [
    "BlockLengthOption",
    "CacheOption",
    "CacheRefreshOption",
    "DeviceOption",
    "DtypeOption",
    "GenLengthOption",
    "JsonOption",
    "ModelOption",
    "ParamOption",
    "RemaskingOption",
    "StepsOption",
    "StrategyOption",
    "TemperatureOption",
    "build_decoder",
    "check_output",
    "fail",
    "read_prompts",
    "stdout",
    "stderr",
]


def stdout() -> Console:
    """The console the command line prints its results to (read at each call, so a command
    prints where the core's commands print, even when that console is swapped)."""
    return _commands.console


def stderr() -> Console:
    """The console for notes and progress bars (standard error), read at each call."""
    return _commands.err_console


def fail(error: Exception) -> None:
    """Report ``error`` as the core's commands report a dloom error (``error: ...`` on
    standard error) and exit with status 2 (the command line's own report, read at each call)."""
    _commands.fail(error)
