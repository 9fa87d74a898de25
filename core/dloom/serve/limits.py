"""Limits that bound what one request can cost the server before any work is done for it.

* **Body size.** :class:`BodyLimit` answers ``413`` to a body longer than
  ``ServeConfig.max_body_bytes`` before the application reads or parses it: at once from its
  ``Content-Length``, or, for a chunked body, as soon as the bytes received pass the limit
  (so a body in memory never exceeds the limit).
* **Prompt text.** :class:`TextLimit` refuses a text too long to fit the model's context
  *before* the tokenizer sees it: a token never spans more characters than the longest
  entry of the tokenizer's vocabulary, so a text of more than ``(context - gen_length) x
  that many`` characters cannot fit, and tokenizing it (seconds and gigabytes for
  megabytes of text) would only end in the same refusal. (A tokenizer whose normalizer
  drops characters, control characters say, could fit such a text; the server refuses it
  all the same: the limit is a documented bound on what it takes, not a count.)
* **Stop sequences.** At most :data:`MAX_STOP_CHARS` characters each: the stream holds
  back text that may begin one, a cost that grows with the square of its length.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dloom.errors import ModelError
from dloom.serve.responses import error_body

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The default request-body limit (``dloom serve --max-body-bytes``): 4 MiB holds a
100k-token prompt as text or as token ids."""

MAX_HEADER_BYTES = 32 * 1024
"""The default request-head limit in bytes (``dloom serve --max-header-bytes``)."""

MAX_HEADERS = 100
"""The default limit on a request's headers (``dloom serve --max-headers``)."""

READ_TIMEOUT = 30.0
"""The default seconds a request may take to arrive (``dloom serve --read-timeout``)."""

KEEP_ALIVE_TIMEOUT = 5.0
"""The default seconds an idle connection stays open (``dloom serve --keep-alive-timeout``)."""

MAX_CONNECTIONS = 1024
"""The default limit on open connections (``dloom serve --max-connections``)."""

MAX_STOP_CHARS = 256
"""The longest stop sequence a request may give, in characters."""

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: a request whose body passes ``max_bytes`` gets ``413`` with OpenAI's
    error object, without the body being parsed (and, given a ``Content-Length``, read).

    :param on_refusal: called once per refused request (the server counts it).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, on_refusal: Callable[[], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, f"the request body has {int(declared)} bytes")
            return
        chunks: list[bytes] = []
        received = 0
        while True:  # read the whole body here, never more than the limit
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nothing to answer
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._refuse(send, f"the request body passed {self.max_bytes} bytes")
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the client to disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, what: str) -> None:
        self.on_refusal()
        await refuse(
            send, 413, f"{what}; allowed: at most {self.max_bytes} bytes (dloom serve --max-body-bytes)",
            "request_too_large",
        )


class HeaderLimit:
    """ASGI middleware: a request with more than ``max_headers`` headers, or headers of more
    than ``max_bytes`` bytes (names and values), gets ``431`` with OpenAI's error object.
    (The server's protocol bounds the request head before, as it arrives, to the same
    bytes: :mod:`dloom.serve.connections`; a head that arrives in one read is measured here.)

    :param on_refusal: called once per refused request (the server counts it).
    """

    def __init__(self, app: ASGIApp, max_headers: int, max_bytes: int, on_refusal: Callable[[], None]) -> None:
        self.app = app
        self.max_headers = max_headers
        self.max_bytes = max_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        size = sum(len(name) + len(value) for name, value in headers)
        if len(headers) > self.max_headers:
            message = f"the request has {len(headers)} headers; allowed: at most {self.max_headers} (dloom serve --max-headers)"
        elif size > self.max_bytes:
            message = f"the request's headers have {size} bytes; allowed: at most {self.max_bytes} (dloom serve --max-header-bytes)"
        else:
            await self.app(scope, receive, send)
            return
        self.on_refusal()
        await refuse(send, 431, message, "request_header_fields_too_large")


async def refuse(send: Send, status: int, message: str, code: str) -> None:
    """Answer ``status`` with OpenAI's error object and close the connection."""
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the longest entry of ``tokenizer``'s vocabulary (special tokens
    included): the most characters of text one token can stand for; ``None`` when the
    tokenizer has no readable vocabulary."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    entries = vocab()
    return max((len(entry) for entry in entries), default=None)


class TextLimit:
    """The most characters a prompt text may have to fit the model's context.

    :param context: the model's context in tokens (``None``: unknown, no limit).
    :param gen_length: positions generated after every prompt.
    :param token_chars: the most characters one token stands for (``None``: no limit).
    """

    def __init__(self, context: int | None, gen_length: int, token_chars: int | None) -> None:
        self.context, self.gen_length, self.token_chars = context, gen_length, token_chars
        self.max_chars = (
            None if context is None or token_chars is None else max(0, context - gen_length) * token_chars
        )

    def check(self, texts: Sequence[str]) -> None:
        """:raises ModelError: naming the first text that cannot fit, before any tokenizing."""
        if self.max_chars is None:
            return
        for index, text in enumerate(texts):
            if len(text) > self.max_chars:
                assert self.context is not None  # max_chars is known only with a context
                raise ModelError(
                    f"prompt {index} has {len(text)} characters; allowed: at most {self.max_chars} "
                    f"(the model's context of {self.context} tokens minus gen_length "
                    f"{self.gen_length}, at most {self.token_chars} characters per token of this "
                    "tokenizer); dloom refuses it rather than truncate it"
                )


def check_stops(stops: Sequence[str]) -> None:
    """:raises ModelError: for a stop sequence longer than :data:`MAX_STOP_CHARS`."""
    for index, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            raise ModelError(
                f"stop sequence {index} has {len(stop)} characters; allowed: at most {MAX_STOP_CHARS}"
            )
