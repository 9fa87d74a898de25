"""Request bodies of the OpenAI-compatible endpoints, with dloom's own settings.

The OpenAI fields clients send are declared; any other field is refused (HTTP 422 naming
it), so a misspelt setting never passes silently. A declared field whose value dloom
cannot honour (a non-zero penalty, ``top_p`` below 1 when sampling, ...)
is refused with 400 by :func:`dloom.serve.openai_fields.check_openai_fields`, naming the
field and what is allowed (``docs/serving.md`` has the table). dloom's settings sit at the top level of
the body (the ``openai`` client sends them with ``extra_body=``): ``strategy``, ``params``,
``cache`` and ``cache_refresh``; the server validates them against the strategy registry.

Types are strict, as on the command line: a boolean is not a number (``prompt: [true]``
is refused), a string is not a boolean (``stream: "yes"``), a float is not an int.
"""

from __future__ import annotations

from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dloom.model.runner import MAX_CACHE_REFRESH

ParamValue = bool | int | float | str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="send a last chunk with the usage")
    continuous_usage_stats: bool = Field(False, description="every chunk carries the usage so far")


class GenerationFields(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="the served model's name (GET /v1/models)")
    max_tokens: int | None = Field(
        None, ge=1, description="generated tokens returned at most (default and limit: gen_length)"
    )
    temperature: float | None = Field(
        None, ge=0, description="0 (the default, unlike OpenAI's 1) decodes greedily"
    )
    seed: int | None = Field(None, description="seeds the sampler (the request's output is the same whatever shares its batch)")
    stop: str | list[str] | None = Field(None, validate_default=True, description="up to 4 stop sequences")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16, description="choices per prompt (each decoded as its own row)")
    strategy: str | None = Field(None, description="dloom strategy, names joined by '+'")
    params: dict[str, ParamValue] | None = Field(
        None, description="strategy parameters by name ('tau') or component ('spiffy.budget')"
    )
    cache: str | None = Field(None, description="KV cache policy: none, prefix, dual or a plugin's")
    cache_refresh: int | None = Field(
        None, ge=1, le=MAX_CACHE_REFRESH, description="with a cache: a full forward every N forwards"
    )
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus mass; below 1 only when greedy")
    user: str | None = Field(None, description="the end user's id: accepted and ignored")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="0 only")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="0 only")
    ignore_eos: bool = Field(False, description="decode past EOS: max_tokens tokens are returned")

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError(f"{len(stops)} stop sequences given; allowed: at most 4")
        if any(not s for s in stops):
            raise ValueError("a stop sequence is empty; allowed: non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``: ``n`` choices per prompt. ``logprobs`` asks for each
    generated token's commit-time log-probability and that many alternatives; ``echo``
    puts the prompt's text before each choice's text."""

    logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (0..20)")
    echo: bool = Field(False, description="the prompt's text before the completion")

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, texts, token ids, or lists of token ids"
    )

    def prompts(self) -> list[str] | list[list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [cast("list[int]", list(self.prompt))]
        return cast("list[str] | list[list[int]]", list(self.prompt))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(description="a text, or a list of text parts (joined)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: object) -> object:
        """OpenAI's content parts ``[{"type": "text", "text": ...}, ...]`` as one text."""
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"a content part of type {kind!r}; allowed: text parts ({{'type': 'text', 'text': ...}})")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``: the conversation, formatted by the tokenizer's chat
    template, is one prompt. ``max_completion_tokens`` is OpenAI's newer name of
    ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="each generated token's commit-time log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (with logprobs)")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
