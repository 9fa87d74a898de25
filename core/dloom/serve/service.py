"""The request logic behind the endpoints: validation, queueing, and turning the scheduler's
events into OpenAI responses and stream chunks (:class:`Service`, one per app).

Every check runs before a row is queued: the model name (404), the dloom settings (400, the
CLI's messages), empty prompts, token ids outside the vocabulary, text the tokenizer cannot
encode, ``max_tokens`` beyond ``gen_length`` and prompts that would not fit the model's
context (400: refused, never truncated; a text too long to fit is refused before it is
tokenized, :mod:`dloom.serve.limits`), stop sequences over their length limit, and path
parameters that name anything but a file the operator offers (:mod:`dloom.serve.files`);
a full queue answers 429.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dloom.decode.prompts import check_not_mask_only
from dloom.errors import ConfigurationError, DloomError, HTTPError, ModelError
from dloom.model.adapter import ModelAdapter
from dloom.serve.batches import check_batchable
from dloom.serve.body import OTHER_ARRAYS, least_token_rows
from dloom.serve.decoders import DecodeDefaults, DecoderPool, Resolved
from dloom.serve.files import PathHider, ServerFiles, offered_directories
from dloom.serve.limits import (
    KEEP_ALIVE_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    READ_TIMEOUT,
    TextLimit,
    check_stops,
    longest_token_chars,
)
from dloom.serve.metrics import ServerMetrics
from dloom.serve.openai_fields import (
    chat_logprobs,
    check_openai_fields,
    completion_logprobs,
    requested_logprobs,
)
from dloom.serve.responses import error_body, sse, usage
from dloom.serve.scheduler import BlockTokens, Failed, Finished, Job, Scheduler
from dloom.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
)
from dloom.serve.text import StreamText, Visible, tokens_of_text, visible_output

POLL_SECONDS = 0.5  # how often a waiting response checks that its client is still there


@dataclass(frozen=True)
class ServeConfig:
    """What ``dloom serve`` configures.

    :ivar model: the served model: a dLLM, or the AR target of an ``"ar-target"`` default
        strategy (whose outputs the server returns).
    :ivar defaults: the decoding settings (a request may override strategy, params, cache).
    :ivar max_batch_size: rows decoded together, at most.
    :ivar max_queued_tokens: token budget of admitted rows (``prompt + gen_length`` each).
    :ivar max_waiting_tokens: token budget of the requests held in line, first come first
        served, until the budget has room for them; beyond it requests get 429 (0: at once).
    :ivar plain_chat: without a chat template, join the messages' contents with spaces
        (else a chat request to such a model is refused with 400).
    :ivar name: the model name clients use (default: the model's; for a local checkpoint,
        its directory's name: no answer reveals a path on the server).
    :ivar max_body_bytes: the longest request body taken; a longer one gets 413.
    :ivar graph_dirs: directories whose files requests may name in path parameters
        (:mod:`dloom.serve.files`); a request never names a path itself.
    :ivar drafter: the AR target's dLLM drafter, for an ``"ar-target"`` default strategy.
    :ivar max_header_bytes: the longest request head (request line and headers) taken, in
        bytes; a longer one gets 400 (:mod:`dloom.serve.connections`).
    :ivar max_headers: the most headers a request may have; more get 431.
    :ivar read_timeout: seconds a request's head and body may take to arrive.
    :ivar keep_alive_timeout: seconds an idle connection is kept open after a response.
    :ivar max_connections: open connections at most; beyond them requests get 503.
    """

    model: ModelAdapter
    defaults: DecodeDefaults = field(default_factory=DecodeDefaults)
    max_batch_size: int = 16
    max_queued_tokens: int = 65536
    max_waiting_tokens: int = 65536
    plain_chat: bool = False
    name: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    graph_dirs: tuple[str, ...] = ()
    drafter: ModelAdapter | None = None
    max_header_bytes: int = MAX_HEADER_BYTES
    max_headers: int = MAX_HEADERS
    read_timeout: float = READ_TIMEOUT
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT
    max_connections: int = MAX_CONNECTIONS


@dataclass
class Prepared:
    """A validated request: its decoder, its rows' prompt ids and its output limits.

    :ivar prompts: one row per choice: each prompt ``n`` times in a row (choice ``i`` of
        prompt ``p`` is row ``p * n + i``, its random stream).
    :ivar logprobs: alternatives per token to report (``None``: no logprobs).
    :ivar echo: each prompt's text, put before its choices' texts (empty: no echo).
    :ivar continuous_usage: every stream chunk carries the usage so far.
    :ivar ignore_eos: rows decode past their EOS (``ignore_eos``).
    """

    resolved: Resolved
    prompts: list[list[int]]
    max_tokens: int
    stop: list[str]
    n: int = 1
    logprobs: int | None = None
    echo: list[str] = field(default_factory=list)
    continuous_usage: bool = False
    ignore_eos: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request (each prompt counted once, whatever ``n``)."""
        return sum(len(p) for p in self.prompts[:: self.n])


class Service:
    """The request logic behind the endpoints (one per app)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.model = config.model
        self.name = config.name or Path(config.model.name).name  # a checkpoint's directory name, never its path
        self.pool = DecoderPool(config.model, config.defaults, drafter=config.drafter)
        self.gen_length = self.pool.default.decoder.config["gen_length"]
        self.metrics = ServerMetrics(config.max_batch_size)
        self.scheduler = Scheduler(
            self.gen_length, config.max_batch_size, config.max_queued_tokens, self.metrics,
            max_waiting_tokens=config.max_waiting_tokens,
        )
        model_config = getattr(config.model.model, "config", None)
        text_config = getattr(model_config, "get_text_config", None)  # a composite config (DiffusionGemma)'s
        self.vocab_size = getattr(model_config if text_config is None else text_config(), "vocab_size", None)
        self.files = ServerFiles(config.graph_dirs)
        served = [m.name for m in (config.model, config.drafter) if m is not None]
        self.paths = PathHider(offered_directories(self.files), named=served)
        self.text_limit = TextLimit(config.model.max_context, self.gen_length, longest_token_chars(config.model.tokenizer))

    # --- validation ----------------------------------------------------------------------

    def check_rows(self, raw: bytes) -> None:
        """Refuse a completion body, before it is parsed, whose prompts of token ids are
        more than the budget could ever admit (each costs at least ``1 + gen_length``
        tokens; :func:`~dloom.serve.body.least_token_rows` counts them in the raw bytes).

        :raises ConfigurationError: for such a body (answered with 400).
        """
        rows = least_token_rows(raw)
        if rows * (1 + self.gen_length) > self.scheduler.max_tokens:
            raise ConfigurationError(
                f"the request body opens {rows + OTHER_ARRAYS} JSON arrays: {rows} or more prompts of token ids, "
                f"which need at least {rows * (1 + self.gen_length)} tokens (prompt + gen_length each), more "
                f"than the server's whole budget of {self.scheduler.max_tokens} (--max-queued-tokens)"
            )

    def check_texts(self, value: Any) -> None:
        """Refuse a parsed completion body (the JSON value, before its schema builds a
        request from it) whose list of text prompts, ``n`` choices each, could never fit the
        budget, a text counted as one token: the strings the JSON parser made (in C, off
        the event loop) are the only per-row objects built for it. A body of another shape
        is left to its schema.

        :raises ConfigurationError: for such a body (answered with 400, in
            :meth:`check_cost`'s words).
        """
        prompt = value.get("prompt") if isinstance(value, dict) else None
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            return
        n = value.get("n")
        choices = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        self.scheduler.check_cost(choices * len(prompt) * (1 + self.gen_length), at_least=True)

    def check_cost(self, prompts: list[str] | list[list[int]], n: int) -> None:
        """Refuse a request whose cost, ``n x (prompt + gen_length)`` tokens per prompt,
        could never fit the budget or does not fit it now, before any per-row object is
        built. A text counts as one token until it is encoded (a lower bound: the exact
        cost of texts is checked again once they are encoded).

        :raises ConfigurationError: beyond the whole budget (400).
        :raises QueueFullError: beyond the room left now (429).
        """
        texts = bool(prompts) and isinstance(prompts[0], str)
        tokens = len(prompts) if texts else sum(max(1, len(p)) for p in prompts)
        cost = n * (tokens + len(prompts) * self.gen_length)
        self.scheduler.check_cost(cost, at_least=texts)
        self.scheduler.check_room(cost)

    def prepare(self, body: GenerationFields, prompts: list[str] | list[list[int]], token_limit: int | None) -> Prepared:
        """Check everything about a request before any of it is queued: its cost first
        (:meth:`check_cost`), before anything is built or encoded for its prompts.

        :raises DloomError: for bad settings, prompts or lengths (answered with 400).
        :raises QueueFullError: when the request does not fit the budget now (429).
        """
        self.check_cost(prompts, body.n)
        check_stops(body.stop or [])
        params = self.files.resolve(body.strategy or self.config.defaults.strategy, body.params)
        resolved = self.pool.resolve(
            body.strategy, params, body.cache, body.cache_refresh, body.temperature or 0.0, body.seed,
        )
        speculates = resolved.decoder.composition.provider("dloom_draft") is not None
        check_openai_fields(body, speculates)
        top = requested_logprobs(body)
        check_batchable(resolved.decoder, top, body.ignore_eos)
        if top is not None or body.ignore_eos:  # such rows decode in their own lane
            key = dataclasses.replace(resolved.key, logprobs=top, ignore_eos=body.ignore_eos)
            resolved = dataclasses.replace(resolved, key=key)
        max_tokens = self.gen_length if token_limit is None else token_limit
        if max_tokens > self.gen_length:
            raise ModelError(
                f"max_tokens {max_tokens} exceeds the {self.gen_length} positions this server "
                f"decodes per prompt (gen_length); allowed: 1..{self.gen_length}"
            )
        texts = bool(prompts) and isinstance(prompts[0], str)
        rows: list[list[int]] = (
            self._encode(cast("list[str]", prompts)) if texts else [list(cast("list[int]", p)) for p in prompts]
        )
        if texts:
            self.check_cost(rows, body.n)  # the exact cost, now that the texts are encoded
        if not rows:
            raise ModelError("no prompt given; allowed: a text, texts, token ids or lists of token ids")
        for index, row in enumerate(rows):
            self._check_row(index, row)
        echo = []
        if isinstance(body, CompletionRequest) and body.echo:
            echo = [p if isinstance(p, str) else self.model.decode(list(p)) for p in prompts]
        continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
        return Prepared(
            resolved, [row for row in rows for _ in range(body.n)], max_tokens, list(body.stop or []),
            body.n, top, echo, continuous, body.ignore_eos,
        )

    def _encode(self, prompts: list[str]) -> list[list[int]]:
        self.text_limit.check(prompts)
        try:
            return self.model.encode(prompts)
        except DloomError:
            raise
        except Exception as error:  # noqa: BLE001 - the tokenizer's own refusal, reported as the client's
            raise ModelError(f"the model's tokenizer cannot encode the prompt: {error}") from None

    def check_model(self, body: GenerationFields) -> None:
        """:raises HTTPError: 404 when the body names another model."""
        if body.model != self.name:
            raise HTTPError(
                404, f"model {body.model!r} is not served here; this server serves {self.name!r}",
                code="model_not_found",
            )

    def _check_row(self, index: int, row: list[int]) -> None:
        if not row:
            raise ModelError(f"prompt {index} is empty; every prompt needs at least one token")
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in row):
            bad = next(t for t in row if not 0 <= t < self.vocab_size)
            raise ModelError(f"prompt {index} has token id {bad}; allowed: 0..{self.vocab_size - 1}")
        check_not_mask_only(row, f"prompt {index}", self.model.mask_token_id)
        context = self.model.max_context
        if context is not None and len(row) + self.gen_length > context:
            raise ModelError(
                f"prompt {index} of {len(row)} tokens + gen_length {self.gen_length} = "
                f"{len(row) + self.gen_length} exceeds the model's context of {context} tokens; "
                "dloom refuses it rather than truncate it"
            )

    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        """The conversation as one prompt text: the tokenizer's chat template, or with
        ``plain_chat`` the contents joined by spaces.

        :raises ModelError: when the model has neither, or its template raises
            (:meth:`~dloom.model.adapter.ModelAdapter.render_chat`).
        """
        messages = [message.model_dump() for message in body.messages]
        tokenizer = self.model.tokenizer
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return self.model.render_chat(messages)
        if self.config.plain_chat:
            return " ".join(message["content"] for message in messages)
        raise ModelError(
            f"model {self.name!r} has no chat template in its tokenizer; use /v1/completions, "
            "give the checkpoint's tokenizer_config.json a chat_template, or start the server "
            "with --plain-chat (the messages' contents joined by spaces)"
        )

    # --- answering -----------------------------------------------------------------------

    def submit(self, prepared: Prepared, stream: bool) -> tuple[list[Job], asyncio.Queue]:
        """Queue the request's rows; their events arrive on the returned queue as
        ``(row index, event)``."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def poster(index: int):
            def post(event) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop is gone: the server is shutting down
                    pass
            return post

        jobs = [Job(prompt, stream, poster(i), index=i) for i, prompt in enumerate(prepared.prompts)]
        self.scheduler.submit(prepared.resolved, jobs)
        return jobs, events

    def visible(self, prepared: Prepared, tokens: list[int], complete: bool) -> Visible:
        """What the client sees of a row's ``tokens`` (:func:`~dloom.serve.text.visible_output`)."""
        return visible_output(
            tokens, self.model.eos_token_ids, prepared.max_tokens, prepared.stop, self.model.decode, complete,
            stop_at_eos=not prepared.ignore_eos,
        )

    def cancel(self, jobs: list[Job]) -> None:
        """The client left: withdraw its rows and count the request as cancelled."""
        self.withdraw(jobs)
        self.metrics.count_request("cancelled")

    def withdraw(self, jobs: list[Job]) -> None:
        """Withdraw the request's rows that have not finished (a failed batch ends the
        request; its rows in other batches are not needed any more)."""
        for job in jobs:
            self.scheduler.cancel(job)

    async def next_event(self, request: Request, events: asyncio.Queue):
        """The next ``(index, event)``, or ``None`` once the client has disconnected."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), POLL_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    async def complete(self, request: Request, prepared: Prepared, kind: str) -> JSONResponse:
        """Wait for every row and answer with one JSON object."""
        jobs, events = self.submit(prepared, stream=False)
        finished: dict[int, Finished] = {}
        try:
            while len(finished) < len(jobs):
                item = await self.next_event(request, events)
                if item is None:
                    self.cancel(jobs)
                    return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
                index, event = item
                if isinstance(event, Failed):
                    self.withdraw(jobs)
                    return self.failure(event)
                finished[index] = event
        except asyncio.CancelledError:
            self.cancel(jobs)
            raise
        choices, completion_tokens = [], 0
        for index in range(len(jobs)):
            shown = self.visible(prepared, finished[index].tokens, complete=True)
            completion_tokens += len(shown.tokens)
            text = prepared.echo[index // prepared.n] + shown.text if prepared.echo else shown.text
            logprobs = self.logprobs(kind, prepared, finished[index], shown)
            choices.append(choice(kind, index, text, shown.finish_reason, logprobs))
        prompt_tokens = prepared.prompt_tokens
        self.metrics.count_request("completed", prompt_tokens, completion_tokens)
        body = envelope(kind, self.name)
        body["choices"] = choices
        body["usage"] = usage(prepared.resolved.decoder, prompt_tokens, completion_tokens, [finished[i] for i in range(len(jobs))])
        return JSONResponse(body)

    def stream(self, request: Request, prepared: Prepared, kind: str, include_usage: bool) -> StreamingResponse:
        """Answer with server-sent events: each row's text as its blocks land."""
        jobs, events = self.submit(prepared, stream=True)
        return StreamingResponse(
            self._events(request, prepared, kind, include_usage, jobs, events),
            media_type="text/event-stream",
        )

    async def _events(self, request, prepared, kind, include_usage, jobs, events) -> AsyncIterator[str]:
        """The stream's events: a chat's role chunk, each row's text deltas (the chunk that
        ends a row carries its ``finish_reason``), the usage chunk if asked, ``[DONE]``.
        A client that leaves, by disconnecting or by the stream being closed, withdraws
        its rows."""
        chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        head = envelope(chunk_kind, self.name)
        texts = [StreamText(prepared.stop) for _ in jobs]
        decoded: list[list[int]] = [[] for _ in jobs]
        closed = [False] * len(jobs)
        finished: dict[int, Finished] = {}
        done = False
        try:
            if kind == "chat.completion":
                yield sse({**head, "choices": [chunk(kind, i, "", None, role=True) for i in range(len(jobs))]})
            if prepared.echo:
                yield sse({**head, "choices": [chunk(kind, i, prepared.echo[i // prepared.n], None) for i in range(len(jobs))]})
            counted = [0] * len(jobs)
            while len(finished) < len(jobs):
                item = await self.next_event(request, events)
                if item is None:
                    return
                index, event = item
                if isinstance(event, Failed):
                    self.withdraw(jobs)
                    self.metrics.count_request("failed")
                    done = True
                    yield sse(error_body(self.paths.hide(f"decoding failed: {event.message}"), "server_error"))
                    return
                if isinstance(event, BlockTokens):
                    decoded[index].extend(event.tokens)
                    shown = self.visible(prepared, decoded[index], complete=False)
                else:
                    finished[index] = event
                    shown = self.visible(prepared, event.tokens, complete=True)
                if closed[index]:
                    continue
                delta = texts[index].advance(shown)
                counted[index] = self.counted(prepared, shown, texts[index].sent)
                if delta or shown.finish_reason is not None:
                    closed[index] = shown.finish_reason is not None
                    body = {**head, "choices": [chunk(kind, index, delta, shown.finish_reason)]}
                    if prepared.continuous_usage:
                        body["usage"] = usage_so_far(prepared.prompt_tokens, sum(counted))
                    yield sse(body)
            prompt_tokens = prepared.prompt_tokens
            completion_tokens = sum(
                len(self.visible(prepared, finished[i].tokens, complete=True).tokens) for i in range(len(jobs))
            )
            if include_usage:
                rows = [finished[i] for i in range(len(jobs))]
                yield sse({**head, "choices": [], "usage": usage(prepared.resolved.decoder, prompt_tokens, completion_tokens, rows)})
            yield sse("[DONE]")
            self.metrics.count_request("completed", prompt_tokens, completion_tokens)
            done = True
        finally:
            if not done:
                self.cancel(jobs)

    def counted(self, prepared: Prepared, shown: Visible, sent: str) -> int:
        """A streamed row's completion tokens so far, for ``continuous_usage_stats``: all its
        visible tokens once it has finished or when no stop sequence may cut it, else those
        that make the text ``sent`` so far (a stop sequence may still cut at it, and the
        count never goes down)."""
        if shown.finish_reason is not None or not prepared.stop:
            return len(shown.tokens)
        return tokens_of_text(shown.tokens, len(sent), set(self.model.eos_token_ids), self.model.decode)

    def logprobs(self, kind: str, prepared: Prepared, row: Finished, shown: Visible) -> dict[str, Any] | None:
        """A choice's ``logprobs`` object for its counted tokens (``None`` unless asked)."""
        if prepared.logprobs is None or row.logprobs is None:
            return None
        count = len(shown.tokens)
        values, ids, alternatives = row.logprobs
        values, ids, alternatives = values[:count], ids[:count], alternatives[:count]
        build = completion_logprobs if kind == "text_completion" else chat_logprobs
        return build(shown.tokens, values, ids, alternatives, self.model.decode, prepared.logprobs)

    def failure(self, event: Failed) -> JSONResponse:
        """The 500 answer of a request whose batch failed."""
        self.metrics.count_request("failed")
        return JSONResponse(error_body(self.paths.hide(f"decoding failed: {event.message}"), "server_error"), status_code=500)


def envelope(kind: str, model: str) -> dict[str, Any]:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def choice(kind: str, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if kind == "text_completion":
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason, "logprobs": logprobs}


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A stream chunk's usage with ``continuous_usage_stats``: OpenAI's three counts so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def chunk(kind: str, index: int, text: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
    if kind == "text_completion":
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
