"""Exceptions raised by dloom, and its warnings. Every message names the bad value and what is allowed."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import FrameType
from typing import Any


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


class OracleMismatchError(DloomError):
    """The oracle's output differs from the reference decode it was told to reproduce
    (:mod:`dloom.decode.oracle`)."""


class EvaluationFailed(DloomError):
    """A batch of :func:`dloom.evaluation.evaluate` raised after earlier batches had
    finished: carries their report (:attr:`partial`, a :class:`dloom.evaluation.EvalReport`
    with ``complete=False``), so that nothing already decoded is lost; the batch's own error
    is ``__cause__``. An error before any batch finished is raised as is."""

    def __init__(self, partial: Any, error: BaseException) -> None:
        super().__init__(f"stopped after {partial.n} examples: {type(error).__name__}: {error}")
        self.partial = partial


class EvaluationInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`dloom.evaluation.evaluate`: a ``KeyboardInterrupt`` that carries
    the report of the batches that finished (:attr:`partial`, a
    :class:`dloom.evaluation.EvalReport` with ``complete=False``).

    The one class here that is no :class:`DloomError`: it is an interrupt, not an error, and
    stays out of every ``except Exception`` (a :class:`DloomError` is an ``Exception``)."""

    def __init__(self, partial: Any) -> None:
        super().__init__(f"interrupted after {partial.n} examples")
        self.partial = partial


class OutputError(DloomError):
    """The command line's results could not be written; the message names the stream or
    file. ``dloom`` exits with status 74 on it, not 2 (:mod:`dloom.cli.exits`)."""


class HTTPError(DloomError):
    """A refusal of ``dloom serve`` with its HTTP status code and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class QueueFullError(DloomError):
    """The server's token budget is taken by admitted rows; retry later (HTTP 429).

    :ivar retry_after: seconds after which a retry may be admitted
        (:meth:`dloom.serve.scheduler.Scheduler.retry_after`), sent as the ``Retry-After`` header.
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkerDeadError(DloomError):
    """The server's worker thread has stopped on an error: nothing can be decoded (HTTP 503)."""


class ServerFault(DloomError):
    """Work for a server request raised what is not an ordinary exception (a plugin's
    ``SystemExit`` or ``KeyboardInterrupt``): that request fails with 500, the server goes on
    (:func:`dloom.serve.errors.shielded`)."""


INTERNAL_PACKAGES = ("dloom", "dloom_plugins", "pluggy", "typer", "click")


_WARNED: ContextVar[set[tuple[str, int, type[Warning]]] | None] = ContextVar("_WARNED", default=None)
"""The lines that have warned within :func:`each_warning_once` (``None`` outside it)."""


@contextmanager
def each_warning_once() -> Iterator[None]:
    """Within the block (and this thread), :func:`warn` called from one line of code warns
    once, the first time: a run that builds many decoders (``dloom check``: one on the
    user's model, one per tiny model of the sampling test) would otherwise repeat each of
    their plugins' warnings, differing only in the model named. Usable as a decorator."""
    token = _WARNED.set(set())
    try:
        yield
    finally:
        _WARNED.reset(token)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue a warning attributed to the first caller outside dloom, its built-in plugins, pluggy and the command
    line's typer and click (for ``dloom ...`` that is the command itself); within
    :func:`each_warning_once`, only the first from the calling line.

    A warning raised in a hook implementation would otherwise point into pluggy's caller
    (or into the decoder, or typer), which tells the user nothing about which of their lines
    caused it.
    """
    frame: FrameType | None = sys._getframe(1)
    warned = _WARNED.get()
    if warned is not None and frame is not None:
        site = (frame.f_code.co_filename, frame.f_lineno, category)
        if site in warned:
            return
        warned.add(site)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in INTERNAL_PACKAGES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
