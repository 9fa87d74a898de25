"""What one connection may cost the server: request-head size, read time, idle time, count.

The server runs uvicorn with the h11 protocol, not httptools: httptools puts no bound on a
request's headers, h11 bounds the whole request head (request line and headers) in bytes
(``h11_max_incomplete_event_size``; a longer head is answered ``400`` and the connection
closed). On top of it :class:`TimedH11Protocol` bounds the time a request may take to
arrive, which neither has: a request's head and body must arrive within ``read_timeout``
seconds of its first byte (of the connection's opening, for its first request), else the
connection is closed, so slow clients cannot hold connections for ever. After a response,
uvicorn closes a connection idle for ``keep_alive_timeout`` seconds; beyond
``max_connections`` open connections it answers new requests ``503``. The number of headers
is bounded by :class:`~dloom.serve.limits.HeaderLimit` (``431``).

:func:`uvicorn_options` turns a :class:`~dloom.serve.service.ServeConfig` into uvicorn's
settings; ``dloom serve`` and :class:`~dloom.serve.background.BackgroundServer` both use it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from dloom.serve.service import ServeConfig


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read timeout (see the module docstring); the class
    :func:`uvicorn_options` makes sets :attr:`read_timeout`."""

    read_timeout: float = 30.0
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and not self._request_received():
            self._arm()  # the first bytes of a request: it has read_timeout seconds to arrive
        super().data_received(data)
        if self._request_received():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already received in part
        if not self._request_received() and self.cycle is not None and not self.cycle.response_complete:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _request_received(self) -> bool:
        """Whether the connection's current request has arrived whole (the app has it)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and not cycle.more_body

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if not self._request_received() and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(config: ServeConfig) -> dict[str, Any]:
    """uvicorn's settings (keyword arguments of ``uvicorn.Config`` and ``uvicorn.run``) for
    the connection limits of ``config``."""
    protocol = type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": config.read_timeout})
    return {
        "http": protocol,
        "h11_max_incomplete_event_size": config.max_header_bytes,
        "timeout_keep_alive": config.keep_alive_timeout,
        "limit_concurrency": config.max_connections,
    }
