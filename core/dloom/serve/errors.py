"""Every refusal and failure as OpenAI's error object, counted in ``/metrics``.

FastAPI answers some requests itself (an unknown route, a wrong method, a body that is not
JSON) and an unexpected exception would be a plain-text 500; the handlers here give each
of them OpenAI's ``{"error": {"message", "type", "param", "code"}}``, which the ``openai``
client raises with its message, and count its outcome (:data:`~dloom.serve.metrics.
OUTCOMES`). The service's own refusals are mapped in :mod:`dloom.serve.app`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dloom.errors import ServerFault
from dloom.serve.metrics import ServerMetrics
from dloom.serve.responses import error_body
from dloom.serve.scheduler import Failed

Result = TypeVar("Result")
ALTERNATIVE = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])")
"""How pydantic names the alternative of a union type that a value failed."""


def shielded(function: Callable[..., Result]) -> Callable[..., Result]:
    """``function``, with a ``SystemExit``, ``KeyboardInterrupt`` or other non-``Exception``
    it raises turned into :class:`ServerFault` (for work a request runs in a thread: the
    error must fail the request, not travel up into the server's event loop)."""

    def call(*args, **kwargs) -> Result:
        try:
            return function(*args, **kwargs)
        except Exception:
            raise
        except BaseException as error:  # noqa: BLE001 - see the docstring
            raise ServerFault(Failed(error).message) from None

    return call


def describe(problems: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """``(field, message)`` of each of pydantic's validation problems of a request body. A
    value that matches none of a field's alternative types is one message naming them all
    (not one per alternative); a body that is no JSON object says so."""
    described: list[tuple[str, str]] = []  # (field, message, or the place of a union value)
    given: dict[str, str] = {}  # a union value's place -> the value, shortened
    alternatives: dict[str, list[str]] = {}  # a union value's place -> the types it failed
    for problem in problems:
        loc = [str(part) for part in problem["loc"] if part != "body"]
        if not loc:
            described.append(("", "the request body must be a JSON object (Content-Type: application/json)"))
            continue
        branch = next((i for i in range(1, len(loc)) if ALTERNATIVE.fullmatch(loc[i])), None)
        if branch is None:
            described.append((loc[0], f"{'.'.join(loc)}: {problem['msg']}"))
            continue
        where = ".".join(loc[:branch])
        if where not in given:
            value = repr(problem.get("input"))
            given[where] = value if len(value) <= 80 else value[:77] + "..."
            alternatives[where] = []
            described.append((loc[0], where))
        if loc[branch] not in alternatives[where]:
            alternatives[where].append(loc[branch])
    return [
        (field, f"{text}: got {given[text]}; allowed: {' | '.join(alternatives[text])}" if text in given else text)
        for field, text in described
    ]


def install(app: FastAPI, metrics: ServerMetrics, hide: Callable[[str], str] = lambda message: message) -> None:
    """Answer FastAPI's own refusals, request validation and unexpected errors of ``app``
    with OpenAI error objects, counting each; ``hide`` shortens the server paths in the
    message of a server failure (:class:`dloom.serve.files.PathHider`)."""

    @app.exception_handler(StarletteHTTPException)
    async def unrouted(request: Request, error: StarletteHTTPException) -> JSONResponse:
        metrics.count_request("unrouted")
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            message, code = f"no endpoint answers {where}; see GET /v1/models and the docs", "not_found"
        elif error.status_code == 405:
            allowed = next((v for k, v in (error.headers or {}).items() if k.lower() == "allow"), "")
            message, code = f"{where}: method {request.method} is not allowed; allowed: {allowed}", "method_not_allowed"
        else:
            message, code = f"{where}: {error.detail}", None
        return JSONResponse(
            error_body(message, "invalid_request_error", code), status_code=error.status_code, headers=error.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        metrics.count_request("invalid")
        problems = error.errors()
        broken = next((p for p in problems if p.get("type") == "json_invalid"), None)
        if broken is not None:
            detail = (broken.get("ctx") or {}).get("error", broken["msg"])
            return JSONResponse(
                error_body(f"the request body is not valid JSON: {detail}", "invalid_request_error", "invalid_json"),
                status_code=400,
            )
        messages = describe(problems)
        fields = {field for field, _ in messages}
        param = next(iter(fields)) if len(fields) == 1 and "" not in fields else None
        return JSONResponse(
            error_body("; ".join(message for _, message in messages), "invalid_request_error", param=param),
            status_code=422,
        )

    @app.exception_handler(ServerFault)  # a DloomError, but the server's failure: 500, not the client's 400
    async def fault(request: Request, error: ServerFault) -> JSONResponse:
        return server_failed(str(error))

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        return server_failed(f"{type(error).__name__}: {error}")

    def server_failed(cause: str) -> JSONResponse:
        metrics.count_request("failed")
        message = hide(f"the server failed on this request: {cause}")
        return JSONResponse(error_body(message, "server_error"), status_code=500)
