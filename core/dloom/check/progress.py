"""Progress of a running check: each stage's one line to whoever listens (``dloom check``
prints them on stderr with the elapsed time; a library caller hears nothing unless it
listens with :func:`listen`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_LISTENER: ContextVar[Callable[[str], None] | None] = ContextVar("dloom_check_progress", default=None)


def stage(message: str) -> None:
    """Announce the stage a check is starting (no-op when nobody listens)."""
    listener = _LISTENER.get()
    if listener is not None:
        listener(message)


@contextmanager
def listen(callback: Callable[[str], None]) -> Iterator[None]:
    """Send every :func:`stage` message of the enclosed checks to ``callback``."""
    token = _LISTENER.set(callback)
    try:
        yield
    finally:
        _LISTENER.reset(token)
