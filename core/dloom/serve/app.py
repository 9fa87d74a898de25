"""The FastAPI application: OpenAI-compatible endpoints over the scheduler.

``create_app(ServeConfig(model))`` returns the app; ``dloom serve`` runs it with uvicorn.
Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events, one per decoded block), ``GET /health`` and
``GET /metrics`` (Prometheus text). The request logic is :class:`~dloom.serve.service.
Service`'s; this module maps its refusals to status codes (404, 400, 429 with
``Retry-After``, 503 once the worker has stopped); :mod:`dloom.serve.errors` answers the
rest (413, 422, unknown routes, unexpected errors) with OpenAI error objects too.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from dloom.errors import (
    ConfigurationError,
    DloomError,
    HTTPError,
    QueueFullError,
    WorkerDeadError,
)
from dloom.serve import errors
from dloom.serve.body import add_schemas, documented, read_body
from dloom.serve.limits import BodyLimit, HeaderLimit
from dloom.serve.responses import error_body
from dloom.serve.schemas import ChatCompletionRequest, CompletionRequest
from dloom.serve.service import ServeConfig, Service

__all__ = ["ServeConfig", "create_app"]


def create_app(config: ServeConfig) -> FastAPI:
    """The server app for ``config``; its worker starts and stops with the app's lifespan.

    :raises DloomError: when the server's own default settings or limits are invalid.
    """
    for name in ("max_body_bytes", "max_header_bytes", "max_headers", "max_connections"):
        if getattr(config, name) < 1:
            raise ConfigurationError(f"{name} is {getattr(config, name)}; allowed: >= 1")
    for name in ("read_timeout", "keep_alive_timeout"):
        if not 0 < getattr(config, name) < math.inf:
            raise ConfigurationError(f"{name} is {getattr(config, name)}; allowed: seconds > 0")
    service = Service(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(service.scheduler.stop)

    app = FastAPI(title="dloom", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, on_refusal=lambda: service.metrics.count_request("too_large"))
    app.add_middleware(
        HeaderLimit, max_headers=config.max_headers, max_bytes=config.max_header_bytes,
        on_refusal=lambda: service.metrics.count_request("too_large"))
    errors.install(app, service.metrics, service.paths.hide)

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, error: HTTPError) -> JSONResponse:
        service.metrics.count_request("invalid")
        return JSONResponse(error_body(service.paths.hide(str(error)), error.kind, error.code), status_code=error.status)

    @app.exception_handler(DloomError)
    async def dloom_error(request: Request, error: DloomError) -> JSONResponse:
        message = service.paths.hide(str(error))
        if isinstance(error, QueueFullError):
            service.metrics.count_request("rejected")
            return JSONResponse(
                error_body(message, "rate_limit_error", "queue_full"), status_code=429,
                headers={"Retry-After": str(error.retry_after)},
            )
        if isinstance(error, WorkerDeadError):
            service.metrics.count_request("unavailable")
            return JSONResponse(error_body(message, "server_error", "worker_stopped"), status_code=503)
        service.metrics.count_request("invalid")
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)

    def prepare_completion(body: CompletionRequest):
        return service.prepare(body, body.prompts(), body.max_tokens)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the worker runs; 503 with the reason once it has stopped."""
        scheduler = service.scheduler
        if scheduler.alive:
            return JSONResponse({"status": "ok", "model": service.name, **scheduler.load()})
        reason = service.paths.hide(scheduler.failure or "the decoding worker is not running")
        return JSONResponse({"status": "error", "model": service.name, "reason": reason, **scheduler.load()}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            service.metrics.render(service.scheduler.load()), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": 0, "owned_by": "dloom"}]}

    @app.post("/v1/completions", openapi_extra=documented(CompletionRequest))
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest, service.check_rows, service.check_texts)
        service.check_model(body)
        prepared = await run_in_threadpool(errors.shielded(prepare_completion), body)
        if body.stream:
            return service.stream(request, prepared, "text_completion", body.include_usage)
        return await service.complete(request, prepared, "text_completion")

    @app.post("/v1/chat/completions", openapi_extra=documented(ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await read_body(request, ChatCompletionRequest)
        service.check_model(body)
        prompt = await run_in_threadpool(errors.shielded(service.chat_prompt), body)
        prepared = await run_in_threadpool(errors.shielded(service.prepare), body, [prompt], body.token_limit)
        if body.stream:
            return service.stream(request, prepared, "chat.completion", body.include_usage)
        return await service.complete(request, prepared, "chat.completion")

    add_schemas(app, [CompletionRequest, ChatCompletionRequest])
    return app
