"""Reading a request body: bounded before it is parsed, parsed off the event loop.

:func:`read_body` takes the body :class:`~dloom.serve.limits.BodyLimit` has already bounded
in bytes and parses it in a worker thread (JSON, then the endpoint's pydantic schema), so
that a large body does not hold up the event loop while it is parsed. Before parsing it,
``precheck`` (the service's) may refuse it from its raw bytes: :func:`least_token_rows`
counts, in one pass, the prompts of token ids a completion body holds at least, and a body
holding more rows than the server's budget could ever admit is refused without a Python
object being built for any of them. Once it is parsed, ``admit`` (the service's) may refuse
the JSON value before the schema builds a request from it (a list of text prompts too many
for the budget, counted from the parsed list).

A body that is not UTF-8, not JSON, or nested deeper than Python's parser goes is refused
with 400 and OpenAI's error object (counted as ``invalid``); one that does not match the
schema with 422, as FastAPI would. Since FastAPI does not see such bodies, :func:`documented`
and :func:`add_schemas` describe them in the app's OpenAPI document.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from dloom.errors import HTTPError
from dloom.serve.errors import shielded

Schema = TypeVar("Schema", bound=BaseModel)

JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
"""A JSON string, escapes included (the unrolled form: linear in its length)."""

OTHER_ARRAYS = 2
"""Arrays of a completion body that are not a prompt's token ids: ``prompt`` itself (a list
of rows) and ``stop``; no other field of :class:`~dloom.serve.schemas.CompletionRequest`
holds an array."""


def documented(schema: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of an endpoint that reads a ``schema`` body with
    :func:`read_body` (FastAPI does not see it then): the body as a reference to the schema,
    which :func:`add_schemas` puts in the OpenAPI document."""
    reference = {"$ref": f"#/components/schemas/{schema.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": reference}}}}


def add_schemas(app: FastAPI, schemas: Sequence[type[BaseModel]]) -> None:
    """Put ``schemas`` (and the models they use) in ``app``'s OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for schema in schemas:
                spec = schema.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(spec.pop("$defs", {}))
                components[schema.__name__] = spec
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def least_token_rows(raw: bytes) -> int:
    """The fewest prompts of token ids a completion body ``raw`` holds, if it is valid: the
    JSON arrays it opens (``[`` outside strings) less :data:`OTHER_ARRAYS`; 0 or less for
    a body of texts. Linear in the body's bytes; a body with few ``[`` at all is counted
    without looking for its strings."""
    opened = raw.count(b"[")
    if opened <= OTHER_ARRAYS:
        return opened - OTHER_ARRAYS
    return JSON_STRING.sub(b"", raw).count(b"[") - OTHER_ARRAYS


def charset_of(request: Request) -> str | None:
    """The ``charset`` the request's ``Content-Type`` names, lower-cased (``None``: none)."""
    for part in request.headers.get("content-type", "").split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


async def read_body(
    request: Request, schema: type[Schema], precheck: Callable[[bytes], None] | None = None,
    admit: Callable[[Any], None] | None = None,
) -> Schema:
    """The request's body as ``schema``, parsed in a worker thread after ``precheck(raw)``,
    and validated after ``admit(value)`` of the parsed JSON value.

    :raises HTTPError: 400 for a body that is not UTF-8 JSON.
    :raises RequestValidationError: for a body that does not match ``schema`` (422).
    :raises DloomError: whatever ``precheck`` or ``admit`` raises.
    """
    charset = charset_of(request)
    if charset not in (None, "utf-8", "utf8"):
        raise HTTPError(
            400, f"the request body is declared as charset {charset!r}; allowed: JSON in UTF-8 "
            "(Content-Type: application/json)", code="invalid_json",
        )
    raw = await request.body()
    return await run_in_threadpool(shielded(parse_body), raw, schema, precheck, admit)


def parse_body(
    raw: bytes, schema: type[Schema], precheck: Callable[[bytes], None] | None = None,
    admit: Callable[[Any], None] | None = None,
) -> Schema:
    """``raw`` as ``schema`` (see :func:`read_body`; runs in a worker thread)."""
    if precheck is not None:
        precheck(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise HTTPError(
            400, f"the request body is not UTF-8 (byte {error.start}); allowed: JSON in UTF-8", code="invalid_json",
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise HTTPError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:
        raise HTTPError(
            400, "the request body is not valid JSON: it nests arrays or objects too deeply", code="invalid_json",
        ) from None
    if admit is not None:
        admit(value)
    try:
        return schema.model_validate(value)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None
