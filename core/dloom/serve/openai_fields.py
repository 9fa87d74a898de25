"""OpenAI fields beyond the basics: which values dloom honours, and the ``logprobs``
objects of its answers.

:func:`check_openai_fields` refuses, before any work, a value dloom cannot honour, naming
the field and what is allowed (HTTP 400). The rest is honoured as documented in
``docs/serving.md``: ``user`` is accepted and ignored, ``top_p`` below 1 is honoured when
greedy (the most likely token is always in the nucleus), ``ignore_eos`` decodes each row's
whole region past its EOS, ``n`` decodes each choice as its own row, ``echo`` puts the prompt's text first, and ``logprobs`` reports each generated
token's commit-time log-probability (:mod:`dloom.decode.logprobs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from dloom.errors import ConfigurationError
from dloom.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
)


def requested_logprobs(body: GenerationFields) -> int | None:
    """Alternatives per token the request asks for; ``None`` when it asks no logprobs."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if isinstance(body, ChatCompletionRequest) and body.logprobs:
        return body.top_logprobs or 0
    return None


def check_openai_fields(body: GenerationFields, speculates: bool) -> None:
    """Refuse the values dloom cannot honour.

    :param speculates: whether the request's strategy is speculative (no logprobs then).
    :raises ConfigurationError: naming the field, its value and what is allowed.
    """
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value:
            raise ConfigurationError(
                f"{name} is {value}; allowed: 0 (a diffusion model decodes a block's positions "
                "in parallel, so there is no earlier output of the same pass to penalise)"
            )
    temperature = body.temperature or 0.0
    if body.top_p is not None and body.top_p < 1 and temperature > 0:
        raise ConfigurationError(
            f"top_p is {body.top_p} with temperature {temperature}; allowed: top_p 1 when "
            "sampling (dloom samples from the whole distribution), any top_p in (0, 1] with "
            "temperature 0 (the most likely token is always in the nucleus)"
        )
    if body.stream_options is not None and not body.stream:
        raise ConfigurationError(
            "stream_options is given without stream; allowed: stream_options only with stream true (as OpenAI)"
        )
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise ConfigurationError(f"top_logprobs is {body.top_logprobs} without logprobs; allowed: with logprobs true")
    top = requested_logprobs(body)
    if top is None:
        return
    if body.stream:
        raise ConfigurationError("logprobs with stream is not supported; allowed: logprobs without stream")
    if speculates:
        raise ConfigurationError(
            "logprobs with a speculative strategy is not supported (its tokens are committed by "
            "verifying drafts); allowed: logprobs with a plain strategy (quota, threshold, ...)"
        )
    if isinstance(body, CompletionRequest) and body.echo:
        raise ConfigurationError(
            "echo with logprobs is not supported: a diffusion model gives no left-to-right "
            "likelihood of the prompt's tokens; allowed: echo without logprobs, or logprobs "
            "without echo (log-probabilities of generated tokens)"
        )


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def completion_logprobs(
    tokens: Sequence[int], values: Sequence[float], top_ids: Sequence[Sequence[int]],
    top_values: Sequence[Sequence[float]], decode: Callable[[list[int]], str], top: int,
) -> dict[str, Any]:
    """The ``logprobs`` object of a completion choice (legacy OpenAI layout: ``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``) for its counted ``tokens``."""
    strings = [decode([t]) for t in tokens]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    tops = None
    if top:
        tops = [alternatives(ids[:top], vals[:top], decode) for ids, vals in zip(top_ids, top_values)]
    return {
        "tokens": strings, "token_logprobs": [_finite(v) for v in values[: len(tokens)]],
        "top_logprobs": tops, "text_offset": offsets,
    }


def alternatives(ids: Sequence[int], values: Sequence[float], decode: Callable[[list[int]], str]) -> dict[str, float]:
    """One position's ``top_logprobs`` entry of a completion, most likely first: keyed by each
    alternative's text, and, for an id whose text an earlier (likelier) id already has,
    by ``token_id:<id>`` (vLLM's spelling of a token by its id), so distinct ids stay apart
    (two ids that both decode to ``''`` are two entries, each with its own value)."""
    entries: dict[str, float] = {}
    for token, value in zip(ids, values):
        text = decode([token])
        entries[f"token_id:{token}" if text in entries else text] = _finite(value)
    return entries


def chat_logprobs(
    tokens: Sequence[int], values: Sequence[float], top_ids: Sequence[Sequence[int]],
    top_values: Sequence[Sequence[float]], decode: Callable[[list[int]], str], top: int,
) -> dict[str, Any]:
    """The ``logprobs`` object of a chat choice (``content``: one entry per token)."""

    def entry(token: int, value: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": _finite(value), "bytes": list(text.encode())}

    content = []
    for token, value, ids, vals in zip(tokens, values, top_ids, top_values):
        item = entry(token, value)
        item["top_logprobs"] = [entry(t, v) for t, v in zip(ids[:top], vals[:top])]
        content.append(item)
    return {"content": content, "refusal": None}
