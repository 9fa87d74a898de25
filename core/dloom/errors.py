"""Exceptions raised by dloom. Every message names the bad value and what is allowed."""

from __future__ import annotations

import sys
import warnings
from types import FrameType


class DloomError(Exception):
    """Base class of every error dloom raises on purpose."""


class ConfigurationError(DloomError, ValueError):
    """A decoding setting is out of range or inconsistent (gen_length, steps, a parameter)."""


class UnknownStrategyError(DloomError, KeyError):
    """A strategy name that no loaded plugin registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class CompositionError(DloomError):
    """Strategies that cannot be combined into one decoder (raised when the decoder is built)."""


class PluginLoadError(DloomError):
    """A plugin failed to load or to register; fatal only under ``DLOOM_STRICT_PLUGINS=1``.

    :ivar fatal: set once the failure has been reported as fatal (an outer check re-raises it).
    """

    fatal: bool = False


class ModelError(DloomError, ValueError):
    """A model, tokenizer or prompt that dloom cannot decode with as asked."""


class NonFiniteLogitsError(DloomError, FloatingPointError):
    """The model returned NaN or infinite logits during decoding."""


class HookContractError(DloomError):
    """A plugin's hook returned something that breaks the hook's documented contract."""


INTERNAL_PACKAGES = ("dloom", "dloom_plugins", "pluggy", "typer", "click")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue a warning attributed to the first caller outside dloom, its built-in plugins, pluggy and the command
    line's typer and click (for ``dloom ...`` that is the command itself).

    A warning raised in a hook implementation would otherwise point into pluggy's caller
    (or into the decoder, or typer), which tells the user nothing about which of their lines
    caused it.
    """
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in INTERNAL_PACKAGES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
