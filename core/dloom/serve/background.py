"""A server in a background thread of this process, for notebooks, tests and benchmarks.

    with BackgroundServer(ServeConfig(dloom.load_model("toy-dllm"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")

``dloom serve`` is the way to run a server on its own.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from dloom.serve.app import ServeConfig, Service, create_app
from dloom.serve.connections import uvicorn_options


class BackgroundServer:
    """uvicorn serving ``create_app(config)`` on ``host:port`` in a daemon thread.

    :param port: 0 (the default) picks a free port; :attr:`url` says which.
    :ivar service: the app's :class:`~dloom.serve.app.Service` (scheduler, metrics).
    :raises RuntimeError: when the server does not start within ``timeout`` seconds.
    """

    def __init__(self, config: ServeConfig, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> None:
        app = create_app(config)
        self.service: Service = app.state.service
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **uvicorn_options(config)))
        self._thread = threading.Thread(target=self._server.run, name="dloom-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {host}:{port} did not start")
            time.sleep(0.02)
        bound = self._server.servers[0].sockets[0].getsockname()
        self.url = f"http://{bound[0]}:{bound[1]}"

    def stop(self) -> None:
        """Finish the running batch, close the server and join its thread."""
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
